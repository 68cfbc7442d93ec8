"""wna16-jax: int4/int8-weight mixture-of-experts layers (AWQ, GPTQ, compressed-tensors) in JAX.

``import wna16_jax as wj`` gives the public API; each name is imported from its module on first
use, so importing the package stays cheap::

    ckpt = wj.Checkpoint("path/to/checkpoint")          # config.json + safetensors
    layer = ckpt.load_layer(ckpt.moe_layer_indices[0])   # experts in the checkpoint's layout
    backend = wj.select_backend(ckpt.scheme)             # the dispatch table's choice here
    moe = wj.QuantizedMoE.from_checkpoint(ckpt, 0)       # a Flax NNX layer
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name → the module that defines it
_EXPORTS = {
    # checkpoints
    "Checkpoint": "checkpoint", "MoELayer": "checkpoint", "MoEModelConfig": "checkpoint",
    "DenseWeights": "checkpoint", "write_checkpoint": "writers", "random_moe_layer": "writers",
    "random_checkpoint_weights": "writers", "FloatMoELayer": "writers",
    "ConvertedCheckpoint": "serialize", "convert_checkpoint": "serialize",
    # quantization schemes
    "QuantScheme": "schemes", "QuantConfig": "schemes", "QuantMethod": "schemes",
    # weights
    "CheckpointWeights": "weights", "LogicalQuant": "weights",
    # the dispatch table
    "Backend": "backends", "TABLE": "backends", "Device": "device", "select_backend": "backends",
    "backend_reasons": "backends", "priority_backends": "backends",
    "BackendFallbackWarning": "backends",
    # running a layer
    "fused_moe": "moe", "shared_expert_moe": "moe", "batched_experts_forward": "moe",
    "EngineFallbackWarning": "moe",
    "fused_topk": "routing", "grouped_topk": "routing", "moe_align_block_size": "routing", "MoERouting": "routing",
    "fused_moe_trainable": "autodiff",
    "sharded_fused_moe": "sharding",
    # serving: bounded compiles
    "BucketedMoE": "serving", "bucket_size": "serving", "pad_tokens": "serving",
    "unpad_tokens": "serving", "DEFAULT_BUCKETS": "serving",
    # Flax
    "QuantizedMoE": "nn", "QuantizedExperts": "nn",
    # whole models
    "MoEDecoder": "models", "load_model": "models", "DecoderConfig": "models", "QuantizedLinear": "models",
    "QuantizedWeight": "models", "DenseLinear": "models", "quantized_matmul": "matmul", "Generator": "models",
    "generate": "models", "load_tokenizer": "models", "write_random_model": "models", "resolve_model_dir": "hub",
    "RandomModelSpec": "models.synthetic", "MeshRules": "models.mesh",
    # errors
    "WNA16Error": "errors", "ConfigError": "errors", "ShapeError": "errors", "DTypeError": "errors",
    "MissingTensorError": "errors", "UnexpectedTensorError": "errors", "ValueRangeError": "errors",
    "UnsupportedError": "errors", "BackendSelectionError": "errors", "CorruptFileError": "errors",
    "UnsafePathError": "errors", "OutputPathError": "errors", "NotCachedError": "errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'wna16_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from .autodiff import fused_moe_trainable
    from .backends import TABLE, Backend, BackendFallbackWarning, backend_reasons, priority_backends, select_backend
    from .device import Device
    from .checkpoint import Checkpoint, DenseWeights, MoELayer, MoEModelConfig
    from .writers import FloatMoELayer, random_checkpoint_weights, random_moe_layer, write_checkpoint
    from .errors import (BackendSelectionError, ConfigError, CorruptFileError, DTypeError,
                         MissingTensorError, NotCachedError, OutputPathError, ShapeError, UnexpectedTensorError,
                         UnsafePathError, UnsupportedError, ValueRangeError, WNA16Error)
    from .models import (DecoderConfig, DenseLinear, Generator, MoEDecoder, QuantizedLinear,
                         QuantizedWeight, generate, load_model, load_tokenizer, write_random_model)
    from .hub import resolve_model_dir
    from .models.mesh import MeshRules
    from .models.synthetic import RandomModelSpec
    from .matmul import quantized_matmul
    from .moe import EngineFallbackWarning, batched_experts_forward, fused_moe, shared_expert_moe
    from .nn import QuantizedExperts, QuantizedMoE
    from .routing import MoERouting, fused_topk, grouped_topk, moe_align_block_size
    from .schemes import QuantConfig, QuantMethod, QuantScheme
    from .serialize import ConvertedCheckpoint, convert_checkpoint
    from .serving import DEFAULT_BUCKETS, BucketedMoE, bucket_size, pad_tokens, unpad_tokens
    from .sharding import sharded_fused_moe
    from .weights import CheckpointWeights, LogicalQuant
