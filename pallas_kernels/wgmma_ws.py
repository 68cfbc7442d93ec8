"""The wgmma GEMM's warp-specialized form (``ws``): each program covers ``2·block_n`` columns with
two compute warpgroups (``block_n`` each: one dequantizes while the other's wgmmas run) and a
third that only issues the TMA copies (``plgpu.emit_pipeline_warp_specialized``). The prefill
GEMMs (blocks of 64 rows and more, and medium blocks over long K ranges) run in this form."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .wgmma_common import GemmBuild
from .wgmma_config import IDS_PAD
from .wgmma_layout import BLOCK_K


def ws_gmem_refs(b: GemmBuild, w_gmem, a_gmem, s_gmem, z_gmem, blk, j, sp):
    """``ex → `` the ``ws`` pipeline's operands for block ``blk``'s column-pair tile ``j``
    (``2·block_n`` columns of expert ``ex``) and K split ``sp``."""
    from jax.experimental import pallas as pl
    kb0, nk = sp * b.chunk * b.kpb, b.chunk * b.kpb
    cols2 = pl.ds(j * 2 * b.bn, 2 * b.bn)
    return lambda ex: (
        w_gmem.at[ex, cols2, pl.ds(kb0 * b.wcols, nk * b.wcols)],
        a_gmem.at[pl.ds(blk * b.bm, b.bm), pl.ds(kb0 * BLOCK_K, nk * BLOCK_K)],
        s_gmem.at[ex, pl.ds(kb0, nk), cols2], *([z_gmem.at[ex, pl.ds(kb0, nk), cols2]] if b.has_zp else []))


def ws_pipeline(b: GemmBuild, step, context, state=None):
    """The warp-specialized pipeline over one item's ``chunk`` steps: compute warpgroups 0 and 1
    (``block_n`` columns each), copy warpgroup 2; ``state``: its place in a chain of pipelines."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    specs = [b.word_spec(2 * b.bn), b.x_spec(), *[plgpu.BlockSpec((b.kpb, 2 * b.bn), lambda kb: (kb, 0))]
             * (2 if b.has_zp else 1)]
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=(b.chunk,), memory_registers=40, in_specs=specs, wg_axis="wg", num_compute_wgs=2,
        max_concurrent_steps=min(b.stages, b.chunk), compute_context=context,
        **({} if state is None else dict(pipeline_state=state)))


def ws_step(b: GemmBuild, wg, acc_box):
    """The ``ws`` pipeline body of compute warpgroup ``wg``: its ``block_n`` columns of the step,
    dequantized and multiplied into the accumulator ref ``acc_box[-1]`` (the current item's)."""
    from jax.experimental import pallas as pl

    def step(_, w_smem, x_smem, s_smem, *rest):
        mine = pl.ds(wg * b.bn, b.bn)
        z_smem = rest[0].at[:, mine] if b.has_zp else None
        return b.accumulate(acc_box[-1], rest[-1], w_smem.at[mine], x_smem, s_smem.at[:, mine], z_smem)
    return step


def ignore(*_, **__):
    return None


def ws_kernel(b: GemmBuild):
    """``(body, mesh)`` of the ``ws`` form for the launch ``b``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def kernel(ids_gmem, a_gmem, w_gmem, s_gmem, *rest):
        z_gmem = rest[0] if b.has_zp else None
        row_gmem, o_gmem = rest[int(b.has_zp):-1], rest[-1]
        i, j, sp = jax.lax.axis_index("b"), jax.lax.axis_index("n"), jax.lax.axis_index("s")
        wg = jax.lax.axis_index("wg")
        gmem_refs = ws_gmem_refs(b, w_gmem, a_gmem, s_gmem, z_gmem, i, j, sp)

        def body(ids_smem, ids_bar, allocs, *scratch):
            nrow = 2 * int(b.has_rs)
            row_scratch, o_smem = scratch[:nrow], scratch[nrow:]

            @pl.when(wg == 0)
            def _():
                b.fetch_ids(ids_gmem, ids_smem, ids_bar, row_gmem, row_scratch)
            b.wait_ids(ids_bar, row_scratch)
            rs_smem = b.row_smem(row_scratch)
            ex = ids_smem[i // IDS_PAD, i % IDS_PAD]
            mycols = pl.ds(j * 2 * b.bno + wg * b.bno, b.bno)                # compute warpgroups only
            dst = b.window(o_gmem, sp, i, mycols)
            my_smem = o_smem[0].at[wg] if b.tout else None
            acc_box = []

            def context(run):
                def with_acc(acc_ref):
                    acc_box.append(acc_ref)
                    b.store(b.scaled(b.finish(run(b.zero())), rs_smem), dst, my_smem)
                pl.run_scoped(with_acc, plgpu.ACC((b.bn, b.bm), jnp.float32))

            @pl.when(ex >= 0)
            def _():
                ws_pipeline(b, ws_step(b, wg, acc_box), context)(*gmem_refs(ex), allocations=allocs)

            @pl.when((ex < 0) & (wg < 2))
            def _():
                b.store(b.zero(b.bno), dst, my_smem)

        pl.run_scoped(body, plgpu.SMEM((b.rows_ids, IDS_PAD), jnp.int32), plgpu.Barrier(num_arrivals=1),
                      ws_pipeline(b, ignore, ignore).get_allocations(*gmem_refs(0)), *b.row_types(),
                      *([plgpu.SMEM((2, b.bm, b.bno), b.odt)] if b.tout else []), collective_axes="wg")

    return kernel, dict(grid=(b.nb, b.n // (2 * b.bn), b.split_k), grid_names=("b", "n", "s"), num_threads=3,
                        thread_name="wg")


__all__ = ["ignore", "ws_gmem_refs", "ws_kernel", "ws_pipeline", "ws_step"]
