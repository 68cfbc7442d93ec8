"""Whole quantized MoE decoders (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V2 / V3) in Flax NNX, and generation.

::

    import wna16_jax as wj

    model = wj.load_model("Qwen3-30B-A3B-GPTQ-Int4")          # config.json + safetensors
    out = wj.generate(model, [[151644, 872]], 64)               # greedy; KV cache, bucketed compiles
    tok = wj.load_tokenizer("Qwen3-30B-A3B-GPTQ-Int4")          # the folder's tokenizer.json

See ``docs/models.md``.
"""

from .config import SUPPORTED_FAMILIES, SUPPORTED_ROPE_TYPES, DecoderConfig
from .decoder import MoEDecoder, load_model
from .generation import Generator, generate
from .kv_cache import KVCache
from .linear import DenseLinear, QuantizedLinear, QuantizedWeight, quantized_matmul
from .mesh import MeshRules, check_mesh
from .synthetic import write_random_model
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["DecoderConfig", "SUPPORTED_FAMILIES", "SUPPORTED_ROPE_TYPES", "MoEDecoder", "load_model", "KVCache", "Generator",
           "generate", "QuantizedLinear", "QuantizedWeight", "DenseLinear",
           "quantized_matmul", "write_random_model", "Tokenizer", "load_tokenizer", "MeshRules", "check_mesh"]
