"""A fused MoE layer on the Pallas grouped GEMM (engine version 1) and its kernel-native layout.

``TileWeights`` holds one layer in the tile layout of :mod:`pallas_kernels.wna16_grouped_gemm`
(converted once from any layout through its logical decode); :func:`fused_moe_tiles` runs the
layer: align (sorted expert blocks) → gather rows → GEMM1 kernel → bias + activation →
GEMM2 kernel → router weights and top-k sum. Semantics equal :func:`wna16_jax.moe.fused_moe`.

Not yet supported (callers fall back to the XLA executor with this reason): act-order
(``g_idx``), and K dimensions that are not a multiple of the tile depth (128 rows for 4-bit,
64 for 8-bit).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from wna16_jax.errors import ShapeError, UnsupportedError
from wna16_jax.moe import check_activation, default_block_m
from wna16_jax.routing import moe_align_block_size
from wna16_jax.weights import ExpertsMixin, LogicalQuant, pytree_dataclass

from .wna16_grouped_gemm import grouped_gemm, pack_tiles, tile_bk, unpack_tiles


@pytree_dataclass(meta=("bits", "group_size", "hidden_size", "intermediate_size"))
class TileWeights(ExpertsMixin):
    """``w13 [E, H/pf, 2I]``, ``w2 [E, I/pf, H]`` int32 tiles; scales ``[E, G, N]``; zero points
    ``[E, G, N]`` uint8 or None; biases ``[E, 2I]`` / ``[E, H]`` or None."""

    w13_qweight: Any
    w2_qweight: Any
    w13_scales: Any
    w2_scales: Any
    w13_zeros: Any = None
    w2_zeros: Any = None
    w13_bias: Any = None
    w2_bias: Any = None
    bits: int = 4
    group_size: int = 128
    hidden_size: int = 0
    intermediate_size: int = 0

    def decode(self) -> tuple[LogicalQuant, LogicalQuant]:
        def one(w, s, z):
            return LogicalQuant(unpack_tiles(w, self.bits), jnp.swapaxes(s, 1, 2),
                                None if z is None else jnp.swapaxes(z, 1, 2).astype(jnp.int32),
                                None, bits=self.bits, group_size=self.group_size)

        return (one(self.w13_qweight, self.w13_scales, self.w13_zeros),
                one(self.w2_qweight, self.w2_scales, self.w2_zeros))


def tile_unsupported_reason(weights) -> str | None:
    """Why :func:`convert_tiles` cannot take ``weights`` (None if it can)."""
    scheme = getattr(weights, "scheme", None)
    if scheme is not None and scheme.act_order:
        return "act-order (g_idx) is not supported by the tile engine yet"
    bk = tile_bk(scheme.bits if scheme is not None else 4)
    for name, k in (("hidden size", weights.hidden_size), ("intermediate size", weights.intermediate_size)):
        if k % bk:
            return f"{name} {k} is not a multiple of the tile depth {bk}"
    return None


def convert_tiles(weights) -> TileWeights:
    """Any experts pytree with a scheme (loader or backend layout) → :class:`TileWeights`."""
    reason = tile_unsupported_reason(weights)
    if reason:
        raise UnsupportedError(f"tile engine: {reason}")
    l13, l2 = weights.decode()
    b13, b2 = weights.decode_bias() or (None, None)

    def one(lq: LogicalQuant):
        z = None if lq.zeros is None else jnp.swapaxes(lq.zeros, 1, 2).astype(jnp.uint8)
        return pack_tiles(lq.codes, lq.bits), jnp.swapaxes(lq.scales, 1, 2), z

    w13, s13, z13 = one(l13)
    w2, s2, z2 = one(l2)
    return TileWeights(w13, w2, s13, s2, z13, z2, b13, b2, bits=l13.bits, group_size=l13.group_size,
                       hidden_size=weights.hidden_size, intermediate_size=weights.intermediate_size)


def fused_moe_tiles(hidden_states, topk_weights, topk_ids, weights: TileWeights, *,
                    activation: str = "silu", expert_map=None, global_num_experts: int | None = None,
                    block_m: int | None = None, block_n: int = 64, interpret: bool = False,
                    poison_outputs: bool = False):
    """The fused MoE layer on the Pallas grouped GEMM; returns ``[T, H]`` in the input dtype.

    ``poison_outputs`` (tests): the kernels write into NaN-filled buffers, so an element a kernel
    fails to write shows up as NaN in the result.
    """
    act = check_activation(activation)
    t, k = topk_ids.shape
    if hidden_states.shape != (t, weights.hidden_size):
        raise ShapeError(f"hidden_states: expected shape ({t}, {weights.hidden_size}), got {hidden_states.shape}")
    e = weights.num_experts
    gne = global_num_experts or (e if expert_map is None else expert_map.shape[0])
    bm = block_m or max(16, default_block_m(t, k, e))
    aligned = moe_align_block_size(topk_ids.astype(jnp.int32), bm, gne, expert_map,
                                   ignore_invalid_experts=True)
    ids = aligned.sorted_token_ids
    valid = ids < t * k
    rows = jnp.where(valid, ids // k, 0)
    cdt = hidden_states.dtype
    a1 = jnp.where(valid[:, None], hidden_states[rows], 0).astype(cdt)
    expert_ids = aligned.expert_ids
    row_expert = jnp.maximum(jnp.repeat(expert_ids, bm), 0)
    kw = dict(bits=weights.bits, group_size=weights.group_size, block_m=bm, interpret=interpret)
    def poisoned(n):
        return jnp.full((a1.shape[0], n), jnp.nan, jnp.float32) if poison_outputs else None

    h = grouped_gemm(a1, expert_ids, weights.w13_qweight, weights.w13_scales, weights.w13_zeros,
                     poisoned(2 * weights.intermediate_size),
                     block_n=min(block_n, 2 * weights.intermediate_size), **kw)
    if weights.w13_bias is not None:
        h = h + weights.w13_bias.astype(jnp.float32)[row_expert]
    a2 = act(h).astype(cdt)
    y = grouped_gemm(a2, expert_ids, weights.w2_qweight, weights.w2_scales, weights.w2_zeros,
                     poisoned(weights.hidden_size), block_n=min(block_n, weights.hidden_size), **kw)
    if weights.w2_bias is not None:
        y = y + weights.w2_bias.astype(jnp.float32)[row_expert]
    tw = jnp.where(valid, topk_weights.astype(jnp.float32).reshape(-1)[jnp.where(valid, ids, 0)], 0.0)
    out = jax.ops.segment_sum(y * tw[:, None], jnp.where(valid, rows, t), num_segments=t + 1)[:t]
    return out.astype(cdt)


__all__ = ["TileWeights", "convert_tiles", "fused_moe_tiles", "tile_unsupported_reason"]
