"""Converters from the loader layout into every backend's kernel layout, one module per backend.

Names and signatures follow vLLM's helpers (``gptq_marlin_moe_repack``,
``marlin_moe_permute_scales``, ``prepare_int4_moe_layer_for_cpu``, ...) so the two can be read
side by side; unlike vLLM's, every function is pure (new arrays, inputs untouched) and jit-able.
Each returns the backend's weights pytree (a frozen dataclass with named fields, never a
positional tuple); :func:`wna16_jax.backends.convert_to_wna16_moe_kernel_format` is the entry
point of vLLM's WNA16 oracle (``vllm/model_executor/layers/fused_moe/oracle/int_wna16.py``) that
picks the converter by backend.
"""

from __future__ import annotations

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


__all__ = [
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
