"""XPU backend (``docs/formats.md`` §6): int4 as two nibbles per byte, N-first.

The Intel XPU kernel (``xpu_fused_moe(is_int4=True)``) takes

* ``w13 [E, 2I, H/2] uint8``, ``w2 [E, H, I/2] uint8``: byte ``j`` of a row holds input index
  ``k = 2j`` in its low nibble and ``2j + 1`` in its high nibble; the nibbles stay uint4b8
  (the kernel subtracts 8, there are no zero points);
* ``w13_scales [E, 2I, H/g]``, ``w2_scales [E, H, I/g]`` (N-first);
* biases passed through.

vLLM obtains the bytes by viewing the canonical N-first int32 words ``[E, N, K/8]`` as uint8,
which is only right on a little-endian host (``_process_weights_xpu`` hard-fails otherwise);
we do the same view with ``lax.bitcast_convert_type`` and the same guard.

Inputs: :func:`process_weights_xpu` ports the helper of vLLM's WNA16 oracle (``vllm/model_executor/layers/fused_moe/oracle/int_wna16.py``), which receives GPTQ's K-first
tensors (``w [E, K/8, N]``, ``scales [E, G, N]``) and transposes them first; vLLM 0.33.0 hands
the helper the canonical N-first tensors instead and skips the transpose — the output is the
same. :func:`convert_xpu` starts from the canonical N-first layout of any loader layout. Note
that vLLM does *not* convert AutoAWQ's N-packed layout for XPU (docs/formats.md §6, nothing blocks AWQ
there either), so an AWQ checkpoint would reach the kernel mis-packed; we bring AWQ to the
canonical layout through its codes first, so symmetric AWQ converts correctly. AWQ with zero
points (and every other asymmetric scheme) is refused: the kernel has no zero points.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..errors import ShapeError, UnsupportedError, check_dtype, check_rank
from ..schemes import QuantScheme
from ..weights import CheckpointWeights, Form, LogicalQuant, QuantMatrix, SchemeLayout, layout_names, pytree_dataclass
from .common import check_input_dtype, check_same_scheme
from .humming import canonical_n_first


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise UnsupportedError(
            "host byte order: the XPU int4 repack views int32 words as bytes and needs a "
            f"little-endian host, got sys.byteorder={sys.byteorder!r}")


def int32_words_to_int4_bytes(name: str, words: Any) -> Any:
    """Canonical N-first words ``[E, N, K/8] int32`` → ``[E, N, K/2] uint8`` by a byte view
    (byte ``j`` = nibbles ``k = 2j`` (low) and ``2j + 1`` (high) on a little-endian host)."""
    _require_little_endian()
    words = jnp.asarray(words)
    check_rank(name, words, 3)
    check_dtype(name, words, np.int32)
    e, n, kw = words.shape
    return lax.bitcast_convert_type(words, jnp.uint8).reshape(e, n, 4 * kw)


class XPUTensors(NamedTuple):
    w13: Any
    w2: Any
    w13_scales: Any
    w2_scales: Any
    w13_bias: Any
    w2_bias: Any


def process_weights_xpu(w13_qweight: Any, w2_qweight: Any, w13_scales: Any, w2_scales: Any,
                        w13_bias: Any = None, w2_bias: Any = None) -> XPUTensors:
    """Port of ``_process_weights_xpu``: GPTQ K-first int4 tensors → the XPU layout.

    ``w13_qweight [E, H/8, 2I] int32`` (packed along K), ``w13_scales [E, G13, 2I]``,
    ``w2_qweight [E, I/8, H]``, ``w2_scales [E, G2, H]`` → transpose dims 1↔2, view the words
    as bytes. Raises :class:`UnsupportedError` on a big-endian host.
    """
    _require_little_endian()
    w13_qweight, w2_qweight, w13_scales, w2_scales = (
        jnp.asarray(a) for a in (w13_qweight, w2_qweight, w13_scales, w2_scales))
    for name, arr in (("w13_qweight", w13_qweight), ("w2_qweight", w2_qweight),
                      ("w13_scales", w13_scales), ("w2_scales", w2_scales)):
        check_rank(name, arr, 3)
    return XPUTensors(
        int32_words_to_int4_bytes("w13_qweight", jnp.swapaxes(w13_qweight, 1, 2)),
        int32_words_to_int4_bytes("w2_qweight", jnp.swapaxes(w2_qweight, 1, 2)),
        jnp.swapaxes(w13_scales, 1, 2),
        jnp.swapaxes(w2_scales, 1, 2),
        w13_bias,
        w2_bias,
    )


@dataclasses.dataclass(frozen=True)
class XPUForm(Form):
    """``[E, N, K/2]`` uint8, low nibble = even k, uint4b8 codes (no zero points)."""

    def decode(self, m: QuantMatrix) -> LogicalQuant:
        w = m.qvalue
        lo = (w & 0xF).astype(jnp.int32)
        hi = (w >> 4).astype(jnp.int32)
        codes = jnp.stack([lo, hi], axis=-1).reshape(w.shape[:-1] + (2 * w.shape[-1],))
        return LogicalQuant(codes, m.scale, None, None, bits=4, group_size=m.group_size)


@pytree_dataclass(meta=("scheme", "hidden_size", "intermediate_size"))
class XPUWeights(SchemeLayout):
    """XPU int4 layout of one MoE layer.

    ``w13_weight [E, 2I, H/2] uint8``, ``w2_weight [E, H, I/2] uint8`` (low nibble = even k,
    uint4b8 codes), ``w13_scales [E, 2I, G13]``, ``w2_scales [E, H, G2]``, optional biases
    ``[E, 2I]`` / ``[E, H]``.
    """

    LAYOUT: ClassVar[str] = "xpu"
    NAMES: ClassVar[dict] = layout_names("{}_weight", "{}_scales")


    @classmethod
    def forms(cls, *, scheme, hidden_size, intermediate_size):
        return XPUForm(2 * intermediate_size, hidden_size), XPUForm(hidden_size, intermediate_size)


def convert_xpu(scheme: QuantScheme, weights: CheckpointWeights, input_dtype: Any = None
                ) -> XPUWeights:
    """Loader layout → :class:`XPUWeights`. 4-bit symmetric schemes only (kInt4Static /
    kInt4Static32), no act-order; ``H`` and ``I`` must be multiples of 8. Pure and jit-able
    (``scheme`` and ``input_dtype`` static)."""
    check_same_scheme(scheme, weights)
    check_input_dtype("XPU", input_dtype)
    _require_little_endian()
    if scheme.bits != 4:
        raise UnsupportedError(
            f"scheme.bits: the XPU MoE kernel takes 4-bit weights only, got {scheme.bits}")
    if scheme.zero_point:
        raise UnsupportedError(
            "scheme.zero_point: the XPU MoE kernel has no zero points (symmetric uint4b8 only), "
            f"got {scheme.describe()}")
    if scheme.act_order:
        raise UnsupportedError(
            f"scheme.act_order: the XPU MoE kernel has no g_idx support, got {scheme.describe()}")
    for name, size in (("hidden_size", weights.hidden_size),
                       ("intermediate_size", weights.intermediate_size)):
        if size % 8:
            raise ShapeError(
                f"{name}: {size} is not a multiple of 8 (XPU bytes [N, K/2] come from whole "
                "int32 words of 8 nibbles)")
    t = canonical_n_first(weights)
    return XPUWeights.of(
        w13_weight=int32_words_to_int4_bytes("w13_weight", t.w13_weight),
        w2_weight=int32_words_to_int4_bytes("w2_weight", t.w2_weight),
        w13_scales=t.w13_weight_scale, w2_scales=t.w2_weight_scale,
        w13_bias=weights.w13_bias, w2_bias=weights.w2_bias,
        scheme=scheme, hidden_size=weights.hidden_size,
        intermediate_size=weights.intermediate_size)


__all__ = ["XPUTensors", "XPUWeights", "convert_xpu", "int32_words_to_int4_bytes",
           "process_weights_xpu"]
