"""Converters from the loader layout into every backend's kernel layout, one module per backend.

Names and signatures follow vLLM's helpers (``gptq_marlin_moe_repack``,
``marlin_moe_permute_scales``, ``prepare_int4_moe_layer_for_cpu``, ...) so the two can be read
side by side; unlike vLLM's, every function is pure (new arrays, inputs untouched) and jit-able.
:func:`convert_to_wna16_moe_kernel_format` is the entry point of
vLLM's WNA16 oracle (``vllm/model_executor/layers/fused_moe/oracle/int_wna16.py``): it returns the
backend's weights pytree (a frozen dataclass with named fields, never a positional tuple).
"""

from __future__ import annotations

from typing import Any

from ..backends import TABLE, Backend
from ..schemes import QuantScheme
from .cpu import CPUQuantAlgo, CPUWeights, convert_cpu, prepare_int4_moe_layer_for_cpu
from .humming import (
    HummingWeights,
    convert_humming,
    convert_to_humming_moe_kernel_format,
    humming_ct_weight_schema,
    humming_weight_schema,
)
from .marlin import (
    MarlinWeights,
    awq_marlin_moe_repack,
    awq_marlin_repack,
    awq_to_marlin_zero_points,
    convert_marlin,
    gptq_marlin_moe_repack,
    gptq_marlin_repack,
    marlin_act_int8_process_scales,
    marlin_int4_fp8_preprocess,
    marlin_moe_padded_intermediate,
    marlin_moe_permute_scales,
    marlin_permute_bias,
    marlin_permute_scales,
    marlin_zero_points,
    moe_awq_to_marlin_zero_points,
    moe_packed_to_marlin_zero_points,
)
from .trtllm_mxint4 import (
    TrtllmMxint4Weights,
    convert_trtllm_mxint4,
    prepare_static_weights_for_trtllm_mxint4_moe,
)
from .xpu import XPUWeights, convert_xpu, process_weights_xpu


def convert_to_wna16_moe_kernel_format(backend: Backend | str, scheme: QuantScheme, weights: Any,
                                       input_dtype: Any = None) -> Any:
    """Convert one layer's experts (loader layout) into ``backend``'s kernel layout.

    The device gates of the dispatch table are not applied here (conversion is possible on any
    host); the layout's own refusals raise typed errors naming the rule and the value.
    """
    return TABLE[Backend.parse(backend)].convert(scheme, weights, input_dtype=input_dtype)


__all__ = [
    "convert_to_wna16_moe_kernel_format",
    "CPUQuantAlgo", "CPUWeights", "convert_cpu", "prepare_int4_moe_layer_for_cpu",
    "HummingWeights", "convert_humming", "convert_to_humming_moe_kernel_format", "humming_weight_schema",
    "humming_ct_weight_schema",
    "MarlinWeights", "awq_marlin_moe_repack", "awq_marlin_repack", "awq_to_marlin_zero_points",
    "convert_marlin", "gptq_marlin_moe_repack", "gptq_marlin_repack", "marlin_act_int8_process_scales",
    "marlin_int4_fp8_preprocess", "marlin_moe_padded_intermediate", "marlin_moe_permute_scales",
    "marlin_permute_bias", "marlin_permute_scales", "marlin_zero_points", "moe_awq_to_marlin_zero_points",
    "moe_packed_to_marlin_zero_points",
    "TrtllmMxint4Weights", "convert_trtllm_mxint4", "prepare_static_weights_for_trtllm_mxint4_moe",
    "XPUWeights", "convert_xpu", "process_weights_xpu",
]
