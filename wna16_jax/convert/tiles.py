"""The GPU engine's tile layout (``TileWeights``): what the Triton-lowered kernels of
:mod:`pallas_kernels.wna16_grouped_gemm` read, converted once, ahead of time, from any layout
through its logical decode (the layout the dispatch table's MARLIN rows prepare on NVIDIA GPUs
without wgmma, and for 8-bit or group-32/64 layers on Hopper).

Act-order layers are converted as Marlin does: each expert's K rows are sorted by group (a
stable sort, so groups become contiguous) and the row order is kept (``w13_perm``, ``w2_perm``)
so the layer permutes the activations to match.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels.experts import GemmExperts
from pallas_kernels.wna16_grouped_gemm import pack_tiles, tile_bk, unpack_tiles

from ..errors import UnsupportedError, kernel_errors
from ..weights import ExpertsLayout, Form, LogicalQuant, QuantMatrix, layout_names, pytree_dataclass


@dataclasses.dataclass(frozen=True)
class TileForm(Form):
    """The engine's tiles: ``qvalue [E, K/pf, N]`` int32, ``scale [E, G, N]``, ``zero_point
    [E, G, N]`` uint8 or None, ``perm [E, K]`` (act-order: row ``j`` is input row ``perm[e, j]``)."""

    def decode(self, m: QuantMatrix) -> LogicalQuant:
        codes = unpack_tiles(m.qvalue, m.bits)                                 # [E, N, K] sorted rows
        scales = jnp.swapaxes(m.scale, 1, 2)
        zeros = None if m.zero_point is None else jnp.swapaxes(m.zero_point, 1, 2).astype(jnp.int32)
        g_idx = None
        if m.perm is not None:                                                # undo the row sort
            inv = jnp.argsort(m.perm, axis=1)
            codes = jnp.take_along_axis(codes, inv[:, None, :], axis=2)
            k = codes.shape[-1]
            group = m.group_size if m.group_size > 0 else k                   # -1: one group over K
            g_idx = jnp.take_along_axis(jnp.broadcast_to(jnp.arange(k) // group, m.perm.shape),
                                        inv, axis=1).astype(jnp.int32)
        return LogicalQuant(codes, scales, zeros, g_idx, bits=m.bits, group_size=m.group_size)


def gemm_experts(m: QuantMatrix, bias: Any) -> GemmExperts:
    """One matrix (and its bias) as the kernels take it."""
    return GemmExperts(m.qvalue, m.scale, m.zero_point, bias, m.perm)


@pytree_dataclass(meta=("bits", "group_size", "hidden_size", "intermediate_size"))
class TileWeights(ExpertsLayout):
    """``w13 [E, H/pf, 2I]``, ``w2 [E, I/pf, H]`` int32 tiles; scales ``[E, G, N]``; zero points
    ``[E, G, N]`` uint8 or None; biases ``[E, 2I]`` / ``[E, H]`` or None; act-order row orders
    ``w13_perm [E, H]`` / ``w2_perm [E, I]`` int32 (row ``j`` of the tiles is input row
    ``perm[e, j]``) or None."""

    LAYOUT: ClassVar[str] = "tiles"
    NAMES: ClassVar[dict] = layout_names("{}_qweight", "{}_scales", "{}_zeros", perm="{}_perm")
    INTERMEDIATE_AXES: ClassVar[dict] = dict(w13_qweight=2, w13_scales=2, w13_zeros=2, w13_bias=1,
                                             w2_qweight=1, w2_scales=1, w2_zeros=1, w2_perm=1)

    bits: int = 4
    group_size: int = 128

    @classmethod
    def forms(cls, *, hidden_size, intermediate_size, **_):
        return TileForm(2 * intermediate_size, hidden_size), TileForm(hidden_size, intermediate_size)

    @classmethod
    def quant_params(cls, meta):
        return meta["bits"], meta["group_size"]

    def gemms(self) -> tuple[GemmExperts, GemmExperts]:
        """The two GEMMs' arrays as the kernels take them."""
        return gemm_experts(self.w13, self.w13_bias), gemm_experts(self.w2, self.w2_bias)


def tile_unsupported_reason(weights) -> str | None:
    """Why :func:`convert_tiles` cannot take ``weights`` (None if it can)."""
    scheme = getattr(weights, "scheme", None)
    bits = scheme.bits if scheme is not None else getattr(weights, "bits", 4)
    bk = tile_bk(bits)
    for name, k in (("hidden size", weights.hidden_size), ("intermediate size", weights.intermediate_size)):
        if k % bk:
            return f"{name} {k} is not a multiple of the engine's {bk}-row tile"
    if scheme is not None and scheme.act_order and (scheme.group_size <= 0 or scheme.group_size % 16):
        return f"act-order with group size {scheme.group_size} (needs a multiple of 16)"
    return None


def _sort_rows(lq: LogicalQuant):
    """Act-order: stable-sort each expert's K rows by group. Returns (codes, perm, ok)."""
    gi = jnp.asarray(lq.g_idx).astype(jnp.int32)                            # [E, K]
    perm = jnp.argsort(gi, axis=1, stable=True).astype(jnp.int32)
    codes = jnp.take_along_axis(jnp.asarray(lq.codes), perm[:, None, :], axis=2)
    k = gi.shape[1]
    ok = jnp.all(jnp.take_along_axis(gi, perm, axis=1) == (jnp.arange(k) // lq.group_size)[None])
    return codes, perm, ok


@kernel_errors()
def convert_tiles(weights) -> TileWeights:
    """Any experts pytree with a decode (loader or backend layout) → :class:`TileWeights`.

    Act-order layers are sorted by group; if a sorted expert does not have exactly
    ``group_size`` rows per group, :class:`UnsupportedError` (concrete inputs) or NaN scales
    (under ``jit``, where it cannot be checked) — never a silently wrong layer. A layout with its
    own bit-exact re-lay into tiles (the wgmma layout's ``to_tiles``) uses it."""
    reason = tile_unsupported_reason(weights)
    if reason:
        raise UnsupportedError(f"tile engine: {reason}")
    if isinstance(weights, TileWeights):
        return weights
    to_tiles = getattr(weights, "to_tiles", None)
    if to_tiles is not None:
        return to_tiles()
    l13, l2 = weights.decode()
    b13, b2 = weights.decode_bias() or (None, None)
    t13, t2 = tile_matrix(l13, "w13"), tile_matrix(l2, "w2")
    return TileWeights(t13, t2, b13, b2, bits=l13.bits, group_size=l13.group_size, hidden_size=weights.hidden_size,
                       intermediate_size=weights.intermediate_size)


def tile_matrix(lq: LogicalQuant, name: str = "matrix") -> QuantMatrix:
    """One matrix's logical codes (``codes [E, N, K]``) in the engine's tile form: codes packed
    ``[E, K/pf, N]``, scales and zero points ``[E, G, N]``, act-order rows sorted by group (the
    order kept in ``perm``; see :func:`convert_tiles` for what happens when the groups are not
    whole after sorting). A dense linear is one expert."""
    perm = None
    codes = lq.codes
    scales = jnp.swapaxes(jnp.asarray(lq.scales), 1, 2)
    if lq.g_idx is not None and jnp.asarray(lq.g_idx).ndim == 2:
        codes, perm, ok = _sort_rows(lq)
        if not isinstance(ok, jax.core.Tracer) and not bool(ok):
            raise UnsupportedError(f"tile engine: {name}: act-order groups are not {lq.group_size} "
                                   f"rows each after sorting")
        scales = jnp.where(ok, scales, jnp.nan).astype(scales.dtype)
    z = None if lq.zeros is None else jnp.swapaxes(jnp.asarray(lq.zeros), 1, 2).astype(jnp.uint8)
    e, n, k = jnp.shape(codes)
    return QuantMatrix(pack_tiles(jnp.asarray(codes), lq.bits), scales, z, None, perm, bits=lq.bits,
                       group_size=lq.group_size, form=TileForm(n, k))


__all__ = ["TileWeights", "convert_tiles", "tile_matrix", "tile_unsupported_reason"]
