"""The wgmma kernels' layout (``WgmmaWeights``): what the Hopper (SM90) GEMMs of
:mod:`pallas_kernels.wgmma_gemm` read — 16-bit words ``[E, N, K/4]``, scales and biased zero
points in the activations' dtype (:mod:`pallas_kernels.wgmma_layout`) — converted once, ahead of
time, through the engine's tile layout (so act-order rows are sorted the same way). 4-bit codes,
group 128 or channelwise."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from pallas_kernels.experts import GemmExperts
from pallas_kernels.wgmma_layout import (BLOCK_K, BLOCK_N, GATE_HALF, deinterleave_gate_up, from_wgmma_layout,
                                         interleave_gate_up, magic_value, to_wgmma_layout)

from ..errors import UnsupportedError, kernel_errors
from ..weights import ExpertsLayout, Form, LogicalQuant, QuantMatrix, layout_names, pytree_dataclass
from .tiles import TileForm, TileWeights, convert_tiles, gemm_experts, tile_matrix, tile_unsupported_reason


@dataclasses.dataclass(frozen=True)
class WgmmaForm(Form):
    """The wgmma kernels' matrix: 16-bit words ``[E, N, K/4]``, scales ``[E, G, N]`` and zero
    points biased by the magic number in the activations' dtype; ``interleaved``: columns in the
    gated epilogue's order (``w13`` only)."""

    interleaved: bool = False

    def to_tiles(self, m: QuantMatrix) -> QuantMatrix:
        """The same matrix in the engine's tile form, bit-exactly."""
        def cols(x, axis):
            return deinterleave_gate_up(x, axis) if self.interleaved and x is not None else x

        scale = cols(m.scale, 2)
        zeros = cols(m.zero_point, 2)
        if zeros is not None:
            zeros = (zeros.astype(jnp.float32) - magic_value(scale.dtype)).astype(jnp.uint8)
        return QuantMatrix(from_wgmma_layout(cols(m.qvalue, 1)), scale, zeros, None, m.perm, bits=4,
                           group_size=m.group_size, form=TileForm(self.n, self.k))

    def decode(self, m: QuantMatrix) -> LogicalQuant:
        return self.to_tiles(m).decode()


@pytree_dataclass(meta=("hidden_size", "intermediate_size", "w13_interleaved"))
class WgmmaWeights(ExpertsLayout):
    """One layer in the wgmma kernels' layout (:func:`convert_wgmma`): 16-bit words
    ``w13_words [E, 2I, H/4]``, ``w2_words [E, H, I/4]``; scales ``[E, G, N]`` and zero points
    (stored biased by the magic number, or None) in the activations' dtype; biases and act-order
    row orders as in :class:`~wna16_jax.convert.tiles.TileWeights`. ``w13_interleaved``: ``w13``'s
    words, scales and zero points (not its bias) are in the gated epilogue's column order. Each
    matrix's ``group_size`` is its own: 128, or -1 where it has one group (channelwise, or K = 128,
    which decodes the same)."""

    LAYOUT: ClassVar[str] = "wgmma"
    NAMES: ClassVar[dict] = layout_names("{}_words", "{}_scales", "{}_zeros", perm="{}_perm")
    INTERMEDIATE_AXES: ClassVar[dict] = dict(w13_words=1, w13_scales=2, w13_zeros=2, w13_bias=1,
                                             w2_words=2, w2_scales=1, w2_zeros=1, w2_perm=1)

    w13_interleaved: bool = False

    @classmethod
    def forms(cls, *, hidden_size, intermediate_size, w13_interleaved):
        h, i = hidden_size, intermediate_size
        return WgmmaForm(2 * i, h, bool(w13_interleaved)), WgmmaForm(h, i, False)

    @classmethod
    def quant_params(cls, meta):
        return 4, BLOCK_K

    @classmethod
    def of(cls, **kw):
        w = super().of(**kw)
        # one scale group per matrix reads as channelwise (the kernels' and the tiles' convention)
        one = w.w13.scale is not None and w.w13.scale.shape[1] == 1 and w.w2.scale.shape[1] == 1
        if not one:
            return w
        return dataclasses.replace(w, w13=dataclasses.replace(w.w13, group_size=-1),
                                   w2=dataclasses.replace(w.w2, group_size=-1))

    def gemms(self) -> tuple[GemmExperts, GemmExperts]:
        """The two GEMMs' arrays as the kernels take them."""
        return gemm_experts(self.w13, self.w13_bias), gemm_experts(self.w2, self.w2_bias)

    @kernel_errors()
    def to_tiles(self) -> TileWeights:
        """The same layer in the engine's tile layout, bit-exactly (the backward's layout)."""
        t13, t2 = self.w13.form.to_tiles(self.w13), self.w2.form.to_tiles(self.w2)
        return TileWeights(t13, t2, self.w13_bias, self.w2_bias, bits=4, group_size=t13.group_size,
                           hidden_size=self.hidden_size, intermediate_size=self.intermediate_size)


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
    w13, w2 = wgmma_matrix(tw.w13, dtype), wgmma_matrix(tw.w2, dtype)
    inter = tw.intermediate_size % GATE_HALF == 0       # the gated epilogue's column order
    if inter:
        w13 = dataclasses.replace(w13, qvalue=interleave_gate_up(w13.qvalue, 1), scale=interleave_gate_up(w13.scale, 2),
                                  zero_point=None if w13.zero_point is None else interleave_gate_up(w13.zero_point, 2),
                                  form=WgmmaForm(w13.form.n, w13.form.k, True))
    return WgmmaWeights(dataclasses.replace(w13, perm=tw.w13_perm), dataclasses.replace(w2, perm=tw.w2_perm),
                        tw.w13_bias, tw.w2_bias, hidden_size=tw.hidden_size, intermediate_size=tw.intermediate_size,
                        w13_interleaved=inter)


def wgmma_matrix(m: QuantMatrix, dtype=jnp.bfloat16) -> QuantMatrix:
    """One matrix (any form with a decode; a dense linear is one expert) in the wgmma kernels' form
    for ``dtype`` activations, through the engine's tile form: 16-bit words ``[E, N, K/4]``,
    scales and biased zero points ``[E, G, N]`` in ``dtype``; group 128, or -1 where there is one
    group. Act-order matrices (a row order) are not taken here: their order stays with the tiles."""
    tiles = m if isinstance(m.form, TileForm) else tile_matrix(m.decode())
    words, scales, zeros = to_wgmma_layout(tiles.qvalue, tiles.scale, tiles.zero_point, dtype)
    return QuantMatrix(words, scales, zeros, None, None, bits=4, group_size=-1 if scales.shape[1] == 1 else BLOCK_K,
                       form=WgmmaForm(tiles.form.n, tiles.form.k, False))


__all__ = ["WgmmaForm", "WgmmaWeights", "convert_wgmma", "wgmma_matrix", "wgmma_unsupported_reason"]
