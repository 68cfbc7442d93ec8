"""HUMMING backend: the weight schema vLLM hands Humming, and Humming's canonical layout
(``docs/formats.md`` §7, §1.6).

vLLM's Humming path (``convert_to_humming_moe_kernel_format``) does three things:

1. ``_humming_wna16_weight_schema(quant_config)`` turns the quantization config into a dict —
   ported as :func:`humming_weight_schema` (AWQ and GPTQ; compressed-tensors raises a
   ``TypeError`` exactly as vLLM's WNA16 oracle (``vllm/model_executor/layers/fused_moe/oracle/int_wna16.py``)
   does). ``docs/formats.md`` §7 also documents a compressed-tensors
   schema dict; since our compressed-tensors checkpoints can take this path, that dict is
   :func:`humming_ct_weight_schema`.
2. Each sublayer (w13 with ``shape_n_stacks = [I, I]``, w2) is converted into Humming's
   canonical ``HummingWeightSchema``:
   ``weight [E, N, K·b/32] int32`` packed along K (LSB first, standard order),
   ``weight_scale [E, N, K/g]``, ``zero_point [E, N·b/32, K/g] int32`` packed along N.
   This is exactly vLLM 0.33.0's canonical N-first layout (§1.6); :func:`canonical_n_first`
   produces it from any loader layout, and the XPU and FlashInfer converters start from it.
3. Humming's own ``prepare_and_transform_humming_tensors`` then rewrites the tensors into its
   kernel layout. That step is opaque (an external JIT-compiled library; docs/formats.md
   does not describe its output) and **is not reproduced here**: :class:`HummingWeights` holds the
   canonical schema tensors, which is the last layout that is specified.

Zero points are *true* zero points here. Humming's GPTQ schema passes ``qzeros`` through
without the AutoGPTQ v1 "+1" (docs/formats.md §7, §1.2; it only matters for asymmetric GPTQ, which vLLM
0.33.0 refuses to load). We add the 1 back (mod ``2**bits``) for v1 checkpoints, so the
canonical tensors dequantize to what the checkpoint means. GPTQ act-order (``desc_act``) is
refused, as Humming's GPTQ schema asserts ``not desc_act``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping, NamedTuple

import jax.numpy as jnp
import numpy as np

from .. import packing
from ..errors import (
    ConfigError,
    DTypeError,
    MissingTensorError,
    UnexpectedTensorError,
    UnsupportedError,
)
from ..schemes import QuantMethod, QuantScheme
from ..weights import CheckpointWeights, Form, LogicalQuant, QuantMatrix, SchemeLayout, layout_names, pytree_dataclass
from .common import check_input_dtype, check_same_scheme


class HummingSchemaError(UnsupportedError, TypeError):
    """The quantization config has no Humming WNA16 schema (vLLM's WNA16 oracle raises ``TypeError``)."""


# ---------------------------------------------------------------------- schema dicts
def humming_weight_schema(scheme: QuantScheme) -> dict[str, Any]:
    """Port of ``_humming_wna16_weight_schema``: the source-schema dict for AWQ and GPTQ.

    compressed-tensors raises :class:`HummingSchemaError` (a ``TypeError``), as vLLM's WNA16 oracle does;
    use :func:`humming_ct_weight_schema` for the §7 compressed-tensors dict.
    """
    if scheme.method is QuantMethod.AWQ:
        return {
            "quant_method": "awq",
            "bits": scheme.bits,
            "group_size": scheme.group_size,
            "zero_point": scheme.zero_point,
        }
    if scheme.method is QuantMethod.GPTQ:
        return {
            "quant_method": "gptq",
            "bits": scheme.bits,
            "group_size": scheme.group_size,
            "desc_act": scheme.desc_act,
            "sym": scheme.symmetric,
        }
    raise HummingSchemaError(
        "scheme.method: Humming WNA16 MoE requires an AutoAWQ or AutoGPTQ config "
        f"(humming_ct_weight_schema covers compressed-tensors), got {scheme.method.value!r}"
    )


def humming_ct_weight_schema(scheme: QuantScheme) -> dict[str, Any]:
    """The compressed-tensors ``pack-quantized`` source-schema dict of docs/formats.md §7."""
    if scheme.method is not QuantMethod.COMPRESSED_TENSORS:
        raise HummingSchemaError(
            "scheme.method: humming_ct_weight_schema needs a compressed-tensors scheme, "
            f"got {scheme.method.value!r}"
        )
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "type": "int",
        "num_bits": scheme.bits,
        "strategy": scheme.ct_strategy,
        "group_size": None if scheme.group_size == -1 else scheme.group_size,
        "symmetric": scheme.symmetric,
    }


def _parse_schema(quant_config: Mapping[str, Any]) -> tuple[str, int, bool]:
    """``(method, bits, has_zero_point)`` of a schema dict; refuses act-order and unknown methods."""
    method = quant_config.get("quant_method")
    if method == "awq":
        return method, int(quant_config["bits"]), bool(quant_config["zero_point"])
    if method == "gptq":
        if quant_config.get("desc_act"):
            raise UnsupportedError(
                "quant_config.desc_act: Humming's GPTQ schema requires desc_act=False "
                "(no act-order / g_idx support), got True"
            )
        return method, int(quant_config["bits"]), not quant_config["sym"]
    if method == "compressed-tensors":
        return method, int(quant_config["num_bits"]), not quant_config["symmetric"]
    raise HummingSchemaError(
        "quant_config.quant_method: expected 'awq', 'gptq' or 'compressed-tensors', "
        f"got {method!r}"
    )


# ---------------------------------------------------------------------- array-level
class HummingTensors(NamedTuple):
    """Humming's canonical ``HummingWeightSchema`` tensors of one MoE layer (N-first)."""

    w13_weight: Any
    w13_weight_scale: Any
    w13_zero_point: Any
    w2_weight: Any
    w2_weight_scale: Any
    w2_zero_point: Any


def _canonical_sublayer(method: str, bits: int, zeros_minus_one: bool,
                        qweight: Any, scales: Any, qzeros: Any) -> tuple[Any, Any, Any]:
    """Loader layout of one stacked sublayer → ``(weight, weight_scale, zero_point)``."""
    mask = (1 << bits) - 1
    if method == "awq":
        order = packing.awq_order(bits)
        codes = jnp.swapaxes(packing.unpack(qweight, bits, axis=2, order=order), 1, 2)  # [E,N,K]
        weight = packing.pack(codes, bits, axis=2)
        scale = jnp.swapaxes(scales, 1, 2)
        zp = None
        if qzeros is not None:
            z = jnp.swapaxes(packing.unpack(qzeros, bits, axis=2, order=order), 1, 2)  # [E,N,G]
            zp = packing.pack(z, bits, axis=1)
        return weight, scale, zp
    if method == "gptq":
        # qweight [E, K/pf, N] is already packed along K: a transpose is bit-exact.
        weight = jnp.swapaxes(qweight, 1, 2)
        scale = jnp.swapaxes(scales, 1, 2)
        zp = None
        if qzeros is not None:
            if zeros_minus_one:
                z = (packing.unpack(qzeros, bits, axis=2) + 1) & mask  # [E, G, N] true zeros
                zp = packing.pack(jnp.swapaxes(z, 1, 2), bits, axis=1)
            else:
                zp = jnp.swapaxes(qzeros, 1, 2)
        return weight, scale, zp
    # compressed-tensors is born canonical.
    return qweight, scales, qzeros


def convert_to_humming_moe_kernel_format(
    quant_config: Mapping[str, Any],
    w13_qweight: Any,
    w2_qweight: Any,
    w13_scales: Any,
    w2_scales: Any,
    w13_qzeros: Any = None,
    w2_qzeros: Any = None,
    *,
    zeros_minus_one: bool = True,
) -> HummingTensors:
    """Loader-layout tensors (the layout named by ``quant_config``, a schema dict from
    :func:`humming_weight_schema` / :func:`humming_ct_weight_schema`) → Humming's canonical
    schema tensors. Stops before Humming's opaque ``prepare_and_transform_humming_tensors``.

    ``zeros_minus_one`` (GPTQ only): the qzeros hold AutoGPTQ v1 ``z - 1`` (the default
    ``checkpoint_format="gptq"``); False for ``gptq_v2``. Pure and jit-able.
    """
    method, bits, has_zp = _parse_schema(quant_config)
    packing.check_bits(bits, "quant_config.bits")
    for name, arr in (("w13_qzeros", w13_qzeros), ("w2_qzeros", w2_qzeros)):
        if has_zp and arr is None:
            raise MissingTensorError(f"{name}: required by a {method} schema with zero points, but missing")
        if not has_zp and arr is not None:
            raise UnexpectedTensorError(
                f"{name}: the {method} schema is symmetric (no zero points), but a tensor of "
                f"shape {tuple(arr.shape)} was given")
    return _canonical_layer(method, bits, zeros_minus_one, w13_qweight, w2_qweight,
                            w13_scales, w2_scales, w13_qzeros, w2_qzeros)


def _canonical_layer(method: str, bits: int, zeros_minus_one: bool, *arrays: Any) -> HummingTensors:
    w13q, w2q, s13, s2, z13, z2 = (None if a is None else jnp.asarray(a) for a in arrays)
    for name, arr in (("w13_qweight", w13q), ("w2_qweight", w2q), ("w13_qzeros", z13),
                      ("w2_qzeros", z2)):
        if arr is not None and np.dtype(arr.dtype) != np.int32:
            raise DTypeError(f"{name}: expected dtype int32 (packed words), got {np.dtype(arr.dtype)}")
    w13 = _canonical_sublayer(method, bits, zeros_minus_one, w13q, s13, z13)
    w2 = _canonical_sublayer(method, bits, zeros_minus_one, w2q, s2, z2)
    return HummingTensors(w13[0], w13[1], w13[2], w2[0], w2[1], w2[2])


def canonical_n_first(weights: CheckpointWeights) -> HummingTensors:
    """vLLM 0.33.0's canonical N-first layout (§1.6, = Humming's canonical schema) of any
    loader layout, with *true* zero points. Refuses act-order (no g_idx in this layout)."""
    scheme = weights.scheme
    if scheme is None:
        raise ConfigError("weights.scheme: missing")
    if scheme.act_order:
        raise UnsupportedError(
            "scheme.act_order: the canonical N-first layout carries no g_idx; "
            f"act-order checkpoints are not supported here, got {scheme.describe()}")
    return _canonical_layer(
        scheme.method.value, scheme.bits, scheme.gptq_zeros_minus_one,
        weights.w13_qweight, weights.w2_qweight, weights.w13_scales, weights.w2_scales,
        weights.w13_qzeros, weights.w2_qzeros)


# ---------------------------------------------------------------------- pytree
@dataclasses.dataclass(frozen=True)
class HummingForm(Form):
    """Humming's canonical schema: codes packed along K, true zero points packed along N."""

    def decode(self, m: QuantMatrix) -> LogicalQuant:
        codes = packing.unpack(m.qvalue, m.bits, axis=2, size=self.k)
        zeros = None if m.zero_point is None else packing.unpack(m.zero_point, m.bits, axis=1, size=self.n)
        return LogicalQuant(codes, m.scale, zeros, None, bits=m.bits, group_size=m.group_size)


@pytree_dataclass(meta=("scheme", "hidden_size", "intermediate_size"))
class HummingWeights(SchemeLayout):
    """Humming canonical schema of one MoE layer (before Humming's opaque kernel transform).

    ``w13_weight [E, 2I, H·b/32] int32`` (packed along K), ``w13_weight_scale [E, 2I, G13]``,
    ``w13_zero_point [E, 2I·b/32, G13] int32`` (packed along N, true zeros) or None;
    ``w2_*`` likewise with ``N = H``, ``K = I``; biases ``[E, 2I]`` / ``[E, H]`` passed through.
    """

    LAYOUT: ClassVar[str] = "humming"
    NAMES: ClassVar[dict] = layout_names("{}_weight", "{}_weight_scale", "{}_zero_point")


    @classmethod
    def forms(cls, *, scheme, hidden_size, intermediate_size):
        return HummingForm(2 * intermediate_size, hidden_size), HummingForm(hidden_size, intermediate_size)


def convert_humming(scheme: QuantScheme, weights: CheckpointWeights, input_dtype: Any = None
                    ) -> HummingWeights:
    """Loader layout → :class:`HummingWeights` (Humming's canonical schema). Pure and jit-able
    (``scheme`` and ``input_dtype`` static). Like vLLM's WNA16 oracle, compressed-tensors schemes raise
    :class:`HummingSchemaError` (a ``TypeError``): the schema is derived from AutoAWQ / AutoGPTQ
    configs only."""
    check_same_scheme(scheme, weights)
    check_input_dtype("HUMMING", input_dtype)
    if scheme.act_order:
        raise UnsupportedError(
            "scheme.act_order: Humming's schemas take no g_idx (the GPTQ schema asserts "
            f"not desc_act), got {scheme.describe()}")
    t = convert_to_humming_moe_kernel_format(
        humming_weight_schema(scheme), weights.w13_qweight, weights.w2_qweight, weights.w13_scales,
        weights.w2_scales, weights.w13_qzeros, weights.w2_qzeros,
        zeros_minus_one=scheme.gptq_zeros_minus_one)
    return HummingWeights.of(
        w13_weight=t.w13_weight, w2_weight=t.w2_weight,
        w13_weight_scale=t.w13_weight_scale, w2_weight_scale=t.w2_weight_scale,
        w13_zero_point=t.w13_zero_point, w2_zero_point=t.w2_zero_point,
        w13_bias=weights.w13_bias, w2_bias=weights.w2_bias,
        scheme=scheme, hidden_size=weights.hidden_size,
        intermediate_size=weights.intermediate_size)


__all__ = [
    "HummingSchemaError", "HummingTensors", "HummingWeights",
    "canonical_n_first", "convert_humming",
    "convert_to_humming_moe_kernel_format", "humming_ct_weight_schema", "humming_weight_schema",
]
