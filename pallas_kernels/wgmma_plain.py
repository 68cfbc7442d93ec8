"""The wgmma GEMM's plain kernel form: one program per (block, column tile, K split), its K range
streamed through ``plgpu.emit_pipeline``'s ring of ``stages`` TMA-fed shared-memory buffers
(``kpb`` K-blocks per step). Every decode-sized GEMM and the fold blocks run in this form."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .wgmma_common import GemmBuild
from .wgmma_config import IDS_PAD
from .wgmma_layout import BLOCK_K


def plain_kernel(b: GemmBuild):
    """``(body, mesh)`` of the plain form for the launch ``b``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    bn, bm, kpb, chunk = b.bn, b.bm, b.kpb, b.chunk

    def kernel(ids_gmem, a_gmem, w_gmem, s_gmem, *rest):
        z_gmem, rest = (rest[0], rest[1:]) if b.has_zp else (None, rest)
        row_gmem, o_gmem = rest[:-1], rest[-1]          # row_scale's rows (when given)
        i, j, sp = jax.lax.axis_index("b"), jax.lax.axis_index("n"), jax.lax.axis_index("s")
        specs = [b.word_spec(bn), b.x_spec(),
                 *[plgpu.BlockSpec((1 if b.channelwise else kpb, bn), lambda kb: (0 if b.channelwise else kb, 0))]
                 * (2 if b.has_zp else 1)]

        def run_k(acc_ref, gmem_refs):
            """Stream this program's K range into ``acc_ref``."""
            def step(_, w_smem, x_smem, s_smem, *rest):
                z_smem, rest = (rest[0], rest[1:]) if b.has_zp else (None, rest)
                return b.accumulate(acc_ref, rest[0], w_smem, x_smem, s_smem, z_smem)

            return plgpu.emit_pipeline(step, grid=(chunk,), max_concurrent_steps=min(b.stages, chunk),
                                       in_specs=specs, init_carry=b.zero())(*gmem_refs)

        def body(ids_smem, ids_bar, *row_scratch):
            ex, rs_smem = b.block_start(ids_gmem, ids_smem, ids_bar, row_gmem, row_scratch)
            cols = pl.ds(j * bn, bn)
            kb0 = sp * chunk * kpb
            nk = chunk * kpb
            groups = pl.ds(0, 1) if b.channelwise else pl.ds(kb0, nk)
            dst = b.window(o_gmem, sp, i, pl.ds(j * b.bno, b.bno))

            @pl.when(ex >= 0)
            def _():
                refs = (w_gmem.at[ex, cols, pl.ds(kb0 * b.wcols, nk * b.wcols)],
                        a_gmem.at[pl.ds(i * bm, bm), pl.ds(kb0 * BLOCK_K, nk * BLOCK_K)],
                        s_gmem.at[ex, groups, cols], *([z_gmem.at[ex, groups, cols]] if b.has_zp else []))

                def with_acc(acc_ref):
                    b.store(b.scaled(b.finish(run_k(acc_ref, refs)), rs_smem), dst)
                pl.run_scoped(with_acc, plgpu.ACC((bn, bm), jnp.float32))

            @pl.when(ex < 0)
            def _():
                b.store(b.zero(b.bno), dst)

        pl.run_scoped(body, plgpu.SMEM((b.rows_ids, IDS_PAD), jnp.int32), plgpu.Barrier(num_arrivals=1),
                      *b.row_types())

    return kernel, dict(grid=(b.nb, b.n // bn, b.split_k), grid_names=("b", "n", "s"))


__all__ = ["plain_kernel"]
