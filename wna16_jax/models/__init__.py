"""Whole quantized MoE decoders (Qwen3-MoE, Qwen2-MoE, Mixtral) in Flax NNX, and generation."""

from .config import SUPPORTED_FAMILIES, DecoderConfig
from .decoder import MoEDecoder, load_model
from .linear import DenseLinear, QuantizedLinear, QuantizedLinearWeights, QuantizedWeight, quantized_matmul

__all__ = ["DecoderConfig", "SUPPORTED_FAMILIES", "MoEDecoder", "load_model", "QuantizedLinear",
           "QuantizedLinearWeights", "QuantizedWeight", "DenseLinear", "quantized_matmul"]
