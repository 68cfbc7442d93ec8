"""The wgmma GEMM's chained warp-specialized stream: ``programs`` programs (one per SM), each
running its share of the (block, ``2·block_n`` column tile, K split) items as one
warp-specialized pipeline per item, the pipelines chained (``pipeline_state`` START / STEADY /
STOP), so the copy warpgroup fetches the next item's first steps while the compute warpgroups
finish the current one and store its output, and no item starts with an empty ring. Items run up
to the last block with an expert; each program then writes zeros over its share of the rest.
Medium blocks (33–63 rows) over short K ranges run in this form."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .wgmma_common import GemmBuild
from .wgmma_config import IDS_PAD
from .wgmma_ws import ignore, ws_gmem_refs, ws_pipeline, ws_step


def stream_share(p, programs: int, n_live):
    """Program ``p`` of ``programs`` streams items ``[lo, lo + count)`` of the ``n_live`` live ones
    (contiguous shares, sizes differing by at most one). Python ints or traced int32 scalars."""
    per, extra = n_live // programs, n_live % programs
    lo = p * per + jnp.minimum(p, extra)
    return lo, per + (p < extra).astype(jnp.int32)


def stream_item(item, items_per_block: int, split_k: int):
    """Item → ``(block, column-pair tile, K split)``: items are ordered block-major, then column
    tile, then K split."""
    r = item % items_per_block
    return item // items_per_block, r // split_k, r % split_k


def stream_tail(p, programs: int, n_live, n_all: int):
    """The items after the live ones (blocks past the last one with an expert) whose outputs
    program ``p`` zeroes: ``n_live + p + r · programs`` for ``r < count``; returns ``count``."""
    return jnp.maximum(n_all - n_live - p + programs - 1, 0) // programs


def ws_stream_kernel(b: GemmBuild):
    """``(body, mesh)`` of the chained ``ws`` stream for the launch ``b``."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    programs, split_k = b.programs, b.split_k
    nt = b.n // (2 * b.bn) * split_k            # items per block: column-pair tiles × K splits
    PipelinePipeline = plgpu.PipelinePipeline

    def kernel(ids_gmem, a_gmem, w_gmem, s_gmem, *rest):
        z_gmem = rest[0] if b.has_zp else None
        o_gmem = rest[-1]
        p, wg = jax.lax.axis_index("p"), jax.lax.axis_index("wg")

        def gmem_refs(ex, blk, j, sp):
            return ws_gmem_refs(b, w_gmem, a_gmem, s_gmem, z_gmem, blk, j, sp)(ex)

        def dst_of(blk, j, sp):                 # this compute warpgroup's half of the item's columns
            return b.window(o_gmem, sp, blk, pl.ds(j * 2 * b.bno + wg * b.bno, b.bno))

        def body(ids_smem, ids_bar, allocs, *o_smem):
            @pl.when(wg == 0)
            def _():
                plgpu.copy_gmem_to_smem(ids_gmem, ids_smem, ids_bar)
            plgpu.barrier_wait(ids_bar)
            n_live = ids_smem[b.rows_ids - 1, IDS_PAD - 1] * nt          # items of blocks up to the last live one
            lo, count = stream_share(p, programs, n_live)
            my_smem = o_smem[0].at[wg] if b.tout else None
            acc_box = []
            step = ws_step(b, wg, acc_box)

            def run_item(t, state):
                blk, j, sp = stream_item(lo + t, nt, split_k)
                ex = ids_smem[blk // IDS_PAD, blk % IDS_PAD]
                dst = dst_of(blk, j, sp)

                def context(run):
                    def with_acc(acc_ref):
                        acc_box.append(acc_ref)
                        val = b.finish(run(b.zero()))

                        @pl.when(ex >= 0)
                        def _():
                            b.store(val, dst, my_smem)

                        @pl.when(ex < 0)                # a dead block inside the stream: its weights were
                        def _():                        # streamed (expert 0's) to keep the chain, its output is 0
                            b.store(b.zero(b.bno), dst, my_smem)
                    pl.run_scoped(with_acc, plgpu.ACC((b.bn, b.bm), jnp.float32))

                ws_pipeline(b, step, context, state)(*gmem_refs(jnp.maximum(ex, 0), blk, j, sp), allocations=allocs)

            @pl.when(count == 1)
            def _():
                run_item(0, None)

            @pl.when(count > 1)
            def _():
                run_item(0, PipelinePipeline.START)

                @pl.loop(1, count - 1)
                def _(t):
                    run_item(t, PipelinePipeline.STEADY)
                run_item(count - 1, PipelinePipeline.STOP)

            mine = stream_tail(p, programs, n_live, b.nb * nt)       # items of the blocks after it: zeros

            @pl.when(wg < 2)
            def _():
                @pl.loop(0, mine)
                def _(r):
                    blk, j, sp = stream_item(n_live + p + r * programs, nt, split_k)
                    b.store(b.zero(b.bno), dst_of(blk, j, sp), my_smem)

        pl.run_scoped(body, plgpu.SMEM((b.rows_ids, IDS_PAD), jnp.int32), plgpu.Barrier(num_arrivals=1),
                      ws_pipeline(b, ignore, ignore, PipelinePipeline.START).get_allocations(*gmem_refs(0, 0, 0, 0)),
                      *([plgpu.SMEM((2, b.bm, b.bno), b.odt)] if b.tout else []), collective_axes="wg")

    return kernel, dict(grid=(programs,), grid_names=("p",), num_threads=3, thread_name="wg")


__all__ = ["stream_item", "stream_share", "stream_tail", "ws_stream_kernel"]
