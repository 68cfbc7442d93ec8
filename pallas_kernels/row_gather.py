"""The token rows of the blocked schedule, gathered into their expert blocks by a Mosaic GPU kernel.

Before GEMM1 the layer lays its routed pairs out as ``block_m``-row expert blocks: row ``r`` of
GEMM1's input is token ``idx[r]``'s hidden row. XLA's gather of those rows (``x[idx]`` as 32-bit
words, zeros elsewhere) writes every row of every block, the blocks the layer leaves empty
included: 209 MB at Qwen3-30B-A3B's 4096 tokens, where the profile's largest XLA kernel, by its
bytes this gather, took 74.7 µs (docs/journal/notes.md v20). With this kernel the layer measured 10–27 µs
faster there.

:func:`gather_rows` copies each row with one bulk copy (``cp.async.bulk``: a row is contiguous
in both places, so no TMA descriptor or swizzle) into shared memory, then writes the program's
rows back with one bulk copy. Rows whose index is negative are not copied, and a program none of
whose rows has an index writes nothing: those rows of the output are left as they were
allocated. The layer only asks for that where no result depends on them — padding rows (GEMM2
scales them by a router weight of 0 and the top-k sum never reads them) and the rows of blocks
without an expert (the GEMMs never read those).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .errors import KernelConfigError, KernelDTypeError, KernelShapeError

IDX_W = 32                  # one program's row indices, padded to a 128-byte row; the last slot: "any row"
ROW_BYTES_PER_PROGRAM = 64 * 1024   # shared memory for one program's rows: three programs per SM


def program_rows(block_m: int, row_bytes: int) -> int:
    """Rows per program: the largest divisor of ``block_m`` whose rows fit in
    ``ROW_BYTES_PER_PROGRAM`` (at least one row), at most ``IDX_W - 1`` — so a program never spans
    two blocks, and a block without an expert is whole programs that write nothing."""
    cap = max(1, min(IDX_W - 1, ROW_BYTES_PER_PROGRAM // max(1, row_bytes)))
    return max(d for d in range(1, min(cap, block_m) + 1) if block_m % d == 0)


def gather_rows_reason(row_len: int, dtype) -> str | None:
    """Why :func:`gather_rows` cannot take rows of ``row_len`` values of ``dtype`` (``None``: it can)."""
    dt = jnp.dtype(dtype)
    if dt.itemsize != 2:
        return f"16-bit rows only, got {dt.name}"
    if (row_len * dt.itemsize) % 16:
        return f"rows of a multiple of 16 bytes (bulk copies), got {row_len} {dt.name} values"
    return None


def _check(x, idx, block_m):
    if x.ndim != 2:
        raise KernelShapeError(f"gather_rows: x must be [T, H], got shape {x.shape}")
    why = gather_rows_reason(x.shape[1], x.dtype)
    if why and jnp.dtype(x.dtype).itemsize != 2:
        raise KernelDTypeError(f"gather_rows: x: {why}")
    if why:
        raise KernelShapeError(f"gather_rows: x: {why}")
    if idx.ndim != 1 or jnp.dtype(idx.dtype) != jnp.dtype(jnp.int32):
        raise KernelDTypeError(f"gather_rows: idx must be a 1-D int32 array, got {idx.dtype}{idx.shape}")
    if block_m < 1 or idx.shape[0] % block_m:
        raise KernelConfigError(f"gather_rows: idx's {idx.shape[0]} rows are not whole blocks of block_m={block_m}")


def gather_rows_reference(x, idx, *, block_m: int):
    """:func:`gather_rows`'s contract in ``jnp``: row ``r`` is ``x[idx[r]]`` where ``idx[r] >= 0``;
    the rows the contract leaves unspecified are NaN here, so that a caller whose result
    depended on them would show it."""
    _check(x, idx, block_m)
    return jnp.where((idx >= 0)[:, None], x[jnp.maximum(idx, 0)], jnp.nan).astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("block_m",))
def gather_rows(x, idx, *, block_m: int):
    """``out[r] = x[idx[r]]`` for every ``r`` with ``idx[r] >= 0``; other rows unspecified.

    ``x [T, H]`` 16-bit, ``idx [R]`` int32 with ``R`` a multiple of ``block_m`` and each index
    below ``T`` (the caller's promise: the copies are not bounds-checked). Rows are copied whole
    (``H`` × 2 bytes, a multiple of 16), :func:`program_rows` of them per program."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _check(x, idx, block_m)
    t, h = x.shape
    r = idx.shape[0]
    if r == 0:
        return jnp.zeros((0, h), x.dtype)
    g = program_rows(block_m, h * x.dtype.itemsize)
    nprog = r // g
    rows = idx.reshape(nprog, g)
    anyrow = (rows >= 0).any(axis=1).astype(jnp.int32)
    idx2 = jnp.concatenate([rows, jnp.full((nprog, IDX_W - 1 - g), -1, jnp.int32), anyrow[:, None]], axis=1)
    in_bounds = plgpu.OOBFillMode.PROMISE_IN_BOUNDS

    def row_gather(idx_gmem, x_gmem, o_gmem):       # (the profiler's name: row_gather_mosaic_gpu_kernel)
        p = jax.lax.axis_index("p")

        def scoped(idx_smem, buf, idx_bar, row_bars):
            plgpu.copy_gmem_to_smem(idx_gmem.at[pl.ds(p, 1)], idx_smem, idx_bar)
            plgpu.barrier_wait(idx_bar)

            @pl.when(idx_smem[0, IDX_W - 1] > 0)
            def _():
                for j in range(g):
                    @pl.when(idx_smem[0, j] >= 0)
                    def _(j=j):
                        plgpu.copy_gmem_to_smem(x_gmem.at[pl.ds(idx_smem[0, j], 1)], buf.at[pl.ds(j, 1)],
                                                row_bars.at[j], oob_mode=in_bounds)
                for j in range(g):
                    @pl.when(idx_smem[0, j] >= 0)
                    def _(j=j):
                        plgpu.barrier_wait(row_bars.at[j])
                plgpu.copy_smem_to_gmem(buf, o_gmem.at[pl.ds(p * g, g)])
                plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.SMEM((1, IDX_W), jnp.int32), plgpu.SMEM((g, h), x.dtype),
                      plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1, num_barriers=g))

    return plgpu.kernel(row_gather, out_type=jax.ShapeDtypeStruct((r, h), x.dtype), grid=(nprog,),
                        grid_names=("p",))(idx2, x)


__all__ = ["gather_rows", "gather_rows_reason", "gather_rows_reference", "program_rows"]
