"""The wgmma kernels' layout (``WgmmaWeights``): what the Hopper (SM90) GEMMs of
:mod:`pallas_kernels.wgmma_gemm` read — 16-bit words ``[E, N, K/4]``, scales and biased zero
points in the activations' dtype (:mod:`pallas_kernels.wgmma_layout`) — converted once, ahead of
time, through the engine's tile layout (so act-order rows are sorted the same way). 4-bit codes,
group 128 or channelwise."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from pallas_kernels.experts import GemmExperts
from pallas_kernels.wgmma_layout import (BLOCK_K, BLOCK_N, GATE_HALF, deinterleave_gate_up, from_wgmma_layout,
                                         interleave_gate_up, magic_value, to_wgmma_layout)

from ..errors import UnsupportedError, kernel_errors
from ..weights import ExpertsMixin, pytree_dataclass
from .tiles import TileWeights, convert_tiles, tile_unsupported_reason


@pytree_dataclass(meta=("hidden_size", "intermediate_size", "w13_interleaved"))
class WgmmaWeights(ExpertsMixin):
    """One layer in the wgmma kernels' layout (:func:`convert_wgmma`): 16-bit words
    ``w13_words [E, 2I, H/4]``, ``w2_words [E, H, I/4]``; scales ``[E, G, N]`` and zero points
    (stored biased by the magic number, or None) in the activations' dtype; biases and act-order
    row orders as in :class:`~wna16_jax.convert.tiles.TileWeights`. ``w13_interleaved``: ``w13``'s
    words, scales and zero points (not its bias) are in the gated epilogue's column order."""

    w13_words: Any
    w2_words: Any
    w13_scales: Any
    w2_scales: Any
    w13_zeros: Any = None
    w2_zeros: Any = None
    w13_bias: Any = None
    w2_bias: Any = None
    w13_perm: Any = None
    w2_perm: Any = None
    hidden_size: int = 0
    intermediate_size: int = 0
    w13_interleaved: bool = False

    def gemms(self) -> tuple[GemmExperts, GemmExperts]:
        """The two GEMMs' arrays as the kernels take them."""
        return (GemmExperts(self.w13_words, self.w13_scales, self.w13_zeros, self.w13_bias, self.w13_perm),
                GemmExperts(self.w2_words, self.w2_scales, self.w2_zeros, self.w2_bias, self.w2_perm))

    @kernel_errors()
    def to_tiles(self) -> TileWeights:
        """The same layer in the engine's tile layout, bit-exactly (the backward's layout)."""
        def zeros(z, s):
            return None if z is None else (z.astype(jnp.float32) - magic_value(s.dtype)).astype(jnp.uint8)

        def w13(x, axis):
            return deinterleave_gate_up(x, axis) if self.w13_interleaved and x is not None else x

        # each GEMM's own groups: one group is channelwise (or K = 128, which decodes the same)
        channelwise = self.w13_scales.shape[1] == 1 and self.w2_scales.shape[1] == 1
        w13_scales = w13(self.w13_scales, 2)
        return TileWeights(from_wgmma_layout(w13(self.w13_words, 1)), from_wgmma_layout(self.w2_words),
                           w13_scales, self.w2_scales, zeros(w13(self.w13_zeros, 2), w13_scales),
                           zeros(self.w2_zeros, self.w2_scales), self.w13_bias, self.w2_bias, self.w13_perm,
                           self.w2_perm, bits=4, group_size=-1 if channelwise else BLOCK_K,
                           hidden_size=self.hidden_size, intermediate_size=self.intermediate_size)

    def decode(self):
        return self.to_tiles().decode()


def wgmma_unsupported_reason(weights) -> str | None:
    """Why :func:`convert_wgmma` cannot take ``weights`` (None if it can)."""
    if isinstance(weights, WgmmaWeights):
        return None
    scheme = getattr(weights, "scheme", None)
    bits = scheme.bits if scheme is not None else getattr(weights, "bits", None)
    group = scheme.group_size if scheme is not None else getattr(weights, "group_size", None)
    if not isinstance(weights, TileWeights):
        reason = tile_unsupported_reason(weights)
        if reason:
            return reason
    if bits != 4:
        return f"{bits}-bit weights (the wgmma kernel takes 4-bit codes)"
    if group not in (-1, 0, BLOCK_K):
        return f"group size {group} (the wgmma kernel takes {BLOCK_K} or channelwise)"
    for name, n in (("2·intermediate size", 2 * weights.intermediate_size), ("hidden size", weights.hidden_size)):
        if n % BLOCK_N:
            return f"{name} {n} is not a multiple of {BLOCK_N} columns"
    return None


@kernel_errors()
def convert_wgmma(weights, dtype=jnp.bfloat16) -> WgmmaWeights:
    """Any experts pytree with a decode → :class:`WgmmaWeights` for ``dtype`` activations
    (through the engine's tile conversion, so act-order rows are sorted the same way). Scales
    are stored in ``dtype`` (a float16 checkpoint scale run with bfloat16 activations is rounded
    to bfloat16 once, here); the layer re-casts them if called with the other 16-bit dtype.
    ``w13`` is stored in the gated epilogue's column order where the intermediate size is a
    multiple of 64."""
    if isinstance(weights, WgmmaWeights):
        return weights
    reason = wgmma_unsupported_reason(weights)
    if reason:
        raise UnsupportedError(f"wgmma engine: {reason}")
    tw = convert_tiles(weights)
    if tw.w13_scales.shape[1] not in (1, tw.hidden_size // BLOCK_K):
        raise UnsupportedError(f"wgmma engine: {tw.w13_scales.shape[1]} scale groups over K={tw.hidden_size}")
    w13 = to_wgmma_layout(tw.w13_qweight, tw.w13_scales, tw.w13_zeros, dtype)
    w2 = to_wgmma_layout(tw.w2_qweight, tw.w2_scales, tw.w2_zeros, dtype)
    inter = tw.intermediate_size % GATE_HALF == 0       # the gated epilogue's column order
    if inter:
        w13 = (interleave_gate_up(w13[0], 1), interleave_gate_up(w13[1], 2),
               None if w13[2] is None else interleave_gate_up(w13[2], 2))
    return WgmmaWeights(w13[0], w2[0], w13[1], w2[1], w13[2], w2[2], tw.w13_bias, tw.w2_bias, tw.w13_perm,
                        tw.w2_perm, hidden_size=tw.hidden_size, intermediate_size=tw.intermediate_size,
                        w13_interleaved=inter)


__all__ = ["WgmmaWeights", "convert_wgmma", "wgmma_unsupported_reason"]
