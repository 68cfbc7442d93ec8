"""The row-gather kernel (:mod:`pallas_kernels.row_gather`, Mosaic GPU bulk copies): its jnp
reference, the rows per program, the typed errors, the lowering on the CPU, and on a Hopper GPU
the kernel against the input rows bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from engine_helpers import cpu_only, gpu, needs_hopper
from pallas_kernels.errors import KernelConfigError, KernelDTypeError, KernelShapeError
from pallas_kernels.row_gather import (IDX_W, ROW_BYTES_PER_PROGRAM, gather_rows, gather_rows_reason,
                                       gather_rows_reference, program_rows)

# (rows of H 16-bit values, block rows, rows per program): Qwen3 / DeepSeek-V2-Lite, Mixtral, a small
# row, DeepSeek-V3's 7168 (four 14 KB rows in 64 KB)
_ROW_GATHER_CASES = [(2048, 144, 16), (4096, 24, 8), (256, 8, 8), (7168, 24, 4)]
_S = jax.ShapeDtypeStruct
_BAD = [(_S((4, 256), jnp.float32), _S((8,), jnp.int32), KernelDTypeError, "x: 16-bit"),
        (_S((4, 12), jnp.bfloat16), _S((8,), jnp.int32), KernelShapeError, "x: rows of a multiple"),
        (_S((2, 4, 256), jnp.bfloat16), _S((8,), jnp.int32), KernelShapeError, r"x must be \[T, H\]"),
        (_S((4, 256), jnp.bfloat16), _S((8,), jnp.float32), KernelDTypeError, "idx must be a 1-D int32"),
        (_S((4, 256), jnp.bfloat16), _S((2, 4), jnp.int32), KernelDTypeError, "idx must be a 1-D int32"),
        (_S((4, 256), jnp.bfloat16), _S((12,), jnp.int32), KernelConfigError, "idx.s 12 rows are not whole")]


def _gather_case(rng, t, h, nb, bm, dt):
    """``t`` random rows, ``nb`` blocks of ``bm`` indices with ~20% of the rows and one whole block
    without an index."""
    x = jnp.asarray(rng.standard_normal((t, h)).astype(np.float32), dt)
    idx = rng.integers(0, t, nb * bm).astype(np.int32)
    idx[rng.random(nb * bm) < 0.2] = -1
    idx[2 * bm:3 * bm] = -1
    return x, idx


@pytest.mark.parametrize("dt", [jnp.bfloat16, jnp.float16])
def test_gather_rows_reference(dt):
    """The contract in jnp: every row with an index is its token's row, bit for bit; the rows the
    contract leaves unspecified are NaN (so a layer that read them would fail its float64 check);
    the same typed errors as the kernel."""
    rng = np.random.default_rng()
    x, idx = _gather_case(rng, 37, 256, 7, 8, dt)
    got = np.asarray(gather_rows_reference(x, jnp.asarray(idx), block_m=8))
    live = idx >= 0
    assert got.shape == (56, 256) and got.dtype == np.asarray(x).dtype
    np.testing.assert_array_equal(got[live].view(np.uint16), np.asarray(x)[idx[live]].view(np.uint16))
    assert np.isnan(got[~live].astype(np.float32)).all()
    for x_, idx_, err, what in _BAD:
        with pytest.raises(err, match=f"gather_rows: {what}"):
            gather_rows_reference(jnp.zeros(x_.shape, x_.dtype), jnp.zeros(idx_.shape, idx_.dtype), block_m=8)


def test_gather_rows_reason():
    assert gather_rows_reason(2048, jnp.bfloat16) is None and gather_rows_reason(8, jnp.float16) is None
    assert "16-bit rows only" in gather_rows_reason(2048, jnp.float32)
    assert "multiple of 16 bytes" in gather_rows_reason(12, jnp.bfloat16)


@cpu_only
def test_row_gather_lowers_and_checks():
    """The row-gather kernel lowers to Mosaic GPU for bf16 and fp16 rows; a program's rows divide
    the block and fit 64 KB; bad input is a typed error naming the array."""
    for h, bm, g in _ROW_GATHER_CASES:
        assert program_rows(bm, 2 * h) == g
        for dt in (jnp.bfloat16, jnp.float16):
            fn = jax.jit(functools.partial(gather_rows, block_m=bm))
            text = fn.trace(_S((37, h), dt), _S((5 * bm,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
            assert "mosaic_gpu" in text
    fn = functools.partial(gather_rows, block_m=8)
    for x, idx, err, what in _BAD:
        with pytest.raises(err, match=f"gather_rows: {what}"):
            jax.jit(fn).trace(x, idx)
    assert gather_rows(jnp.zeros((3, 256), jnp.bfloat16), jnp.zeros((0,), jnp.int32), block_m=8).shape == (0, 256)


@given(st.integers(1, 512), st.integers(1, 40000))
def test_row_gather_program_rows(block_m, row_bytes):
    """A program's rows: the largest divisor of the block that fits 64 KB (one row at least) and
    the 31 index slots — so a program never spans two blocks."""
    g = program_rows(block_m, row_bytes)
    assert block_m % g == 0 and 1 <= g <= IDX_W - 1
    assert g == 1 or g * row_bytes <= ROW_BYTES_PER_PROGRAM
    assert not any(block_m % d == 0 and d * row_bytes <= ROW_BYTES_PER_PROGRAM for d in range(g + 1, IDX_W))


@gpu
@needs_hopper
@pytest.mark.parametrize("h, bm, g", _ROW_GATHER_CASES)
def test_row_gather_gpu(h, bm, g):
    """Every row with an index is its token's row, bit for bit (random 16-bit rows: a row the kernel
    did not write cannot match), with ~20% of the rows and one whole block without an index, twice
    with fresh inputs, the input unchanged."""
    rng = np.random.default_rng()
    t, nb = 37, 7
    fn = jax.jit(functools.partial(gather_rows, block_m=bm))
    for dt in (jnp.bfloat16, jnp.float16):
        x, idx = _gather_case(rng, t, h, nb, bm, dt)
        before = np.asarray(x).copy()
        got = np.asarray(fn(x, jnp.asarray(idx)))
        live = idx >= 0
        assert got.shape == (nb * bm, h) and got.dtype == before.dtype
        np.testing.assert_array_equal(got[live].view(np.uint16), before[idx[live]].view(np.uint16))
        np.testing.assert_array_equal(np.asarray(x).view(np.uint16), before.view(np.uint16))
