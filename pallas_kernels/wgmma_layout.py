"""The wgmma kernels' weight layout, and its transforms from and to the engine's tile layout.

16-bit words ``[E, N, K/4]`` int16: in each 128-deep K-block, word ``16·u + w`` of column ``n``
holds rows ``128·kb + 64·u + 16·t + w`` in its nibble ``t``. A ``[BN, 16]`` word tile loaded in
the wgmma register layout gives, per nibble, one 16-deep K step: ``bits(magic | c)`` is the 16-bit
float ``magic + c`` (bf16 128, fp16 1024), minus the zero point stored biased (``magic + z``),
times the scale — two packed 16-bit float ops per pair of weights, no int→float conversion, and
the reference's rounding (``(c − z)`` exact, one rounding in the product). Scales and zero points
``[E, G, N]`` in the activations' dtype (TMA moves whole 128-byte rows), group 128 or channelwise.

GEMM1's columns may be stored in the gated epilogue's order (:func:`interleave_gate_up`): 64 gate
columns, the matching 64 up columns, and so on, so one 128-column program holds both halves of
its 64 outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .errors import KernelShapeError
from .wna16_grouped_gemm import pack_tiles, unpack_tiles

BLOCK_N = 64          # wgmma M side: output columns per program
BLOCK_K = 128         # one K-block: 16 words × 8 slots
GATE_HALF = 64        # gated epilogue: gate / up halves of each 128-column weight tile


def magic(dtype):
    """Bit pattern ``m`` with ``bits(m | c) == m + c`` for a 4-bit ``c`` in ``dtype``: bf16 128, fp16 1024."""
    return 0x4300 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 0x6400


def magic_value(dtype):
    return 128.0 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else 1024.0


def to_wgmma_layout(words, scales, zeros=None, dtype=jnp.bfloat16):
    """Engine tile layout (``words [E, K/8, N]`` int32, ``scales [E, G, N]``, ``zeros`` uint8 or
    None) → ``(words [E, N, K/4] int16, scales [E, G, N] dtype, zeros [E, G, N] dtype or None)``,
    the zero points stored biased by the dequantization's magic number (:func:`magic_value` + z)
    so the kernel subtracts once."""
    codes = unpack_tiles(words, 4)                                                 # [E, N, K]
    e, n, k = codes.shape
    # row 128·kb + 64·u + 16·t + w → nibble t of word (kb, u, w)
    codes = codes.reshape(e, n, k // BLOCK_K, 2, 4, 16).astype(jnp.uint32)        # [E, N, kb, u, t, w]
    shifts = (jnp.arange(4, dtype=jnp.uint32) * 4)[:, None]
    packed = jnp.sum(codes << shifts, axis=4, dtype=jnp.uint32).reshape(e, n, k // 4)
    packed = jax.lax.bitcast_convert_type(packed.astype(jnp.uint16), jnp.int16)
    z = None if zeros is None else (zeros.astype(jnp.float32) + magic_value(dtype)).astype(dtype)
    return packed, scales.astype(dtype), z


def from_wgmma_layout(words16):
    """Inverse of :func:`to_wgmma_layout`'s words: ``[E, N, K/4]`` int16 → the engine's tile
    layout ``[E, K/8, N]`` int32."""
    e, n, k4 = words16.shape
    w = jax.lax.bitcast_convert_type(words16, jnp.uint16).astype(jnp.uint32).reshape(e, n, k4 // 32, 2, 1, 16)
    shifts = (jnp.arange(4, dtype=jnp.uint32) * 4)[:, None]
    codes = (w >> shifts) & 15                                                     # [E, N, kb, u, t, w]
    return pack_tiles(codes.reshape(e, n, 4 * k4), 4)


def interleave_gate_up(x, axis):
    """``[…, 2I, …]`` (the ``I`` gate columns, then the ``I`` up columns, along ``axis``) → the
    ``gated`` kernel's column order: 64 gate columns, the matching 64 up columns, the next 64 gate
    columns, … (``I`` a multiple of 64). numpy or jax arrays."""
    return _swap_gate_up(x, axis, inverse=False)


def deinterleave_gate_up(x, axis):
    """Inverse of :func:`interleave_gate_up`."""
    return _swap_gate_up(x, axis, inverse=True)


def _swap_gate_up(x, axis, inverse):
    """View ``axis`` as ``[2, I/64, 64]`` (logical order) or ``[I/64, 2, 64]`` (gated order) and
    swap the first two factors."""
    axis = axis % x.ndim
    n = x.shape[axis]
    if n % (2 * GATE_HALF):
        raise KernelShapeError(f"interleave_gate_up: 2·I = {n} along axis {axis} is not a multiple of {2 * GATE_HALF}")
    halves = (n // (2 * GATE_HALF), 2) if inverse else (2, n // (2 * GATE_HALF))
    y = x.reshape(x.shape[:axis] + halves + (GATE_HALF,) + x.shape[axis + 1:])
    return y.swapaxes(axis, axis + 1).reshape(x.shape)


__all__ = ["BLOCK_K", "BLOCK_N", "GATE_HALF", "deinterleave_gate_up", "from_wgmma_layout", "interleave_gate_up",
           "magic", "magic_value", "to_wgmma_layout"]
