"""Writers of Hugging Face MoE checkpoints: random float layers quantized round-to-nearest
(:mod:`wna16_jax.quantize`) and packed exactly as AutoAWQ, AutoGPTQ (v1) and compressed-tensors
``pack-quantized`` store them (:func:`wna16_jax.formats.pack`), and random loader-layout layers
straight from random words, for tests, examples and benchmarks. Reading is
:mod:`wna16_jax.checkpoint`'s."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from . import formats
from .checkpoint import NAMINGS
from .errors import ConfigError
from .quantize import quantize_rtn
from .schemes import QuantMethod, QuantScheme
from .weights import CheckpointWeights


@dataclasses.dataclass(frozen=True)
class FloatMoELayer:
    """Float weights of one MoE layer (output × input orientation, like ``nn.Linear``).

    ``w1``/``w3`` (gate/up) ``[E, I, H]``, ``w2`` (down) ``[E, H, I]``, ``router [E, H]``,
    optional biases ``b1``/``b3 [E, I]``, ``b2 [E, H]``, optional ``e_score_correction_bias [E]``,
    optional shared expert ``shared = (w1 [Is, H], w3 [Is, H], w2 [H, Is])`` and Qwen2-MoE style
    ``shared_gate [1, H]``.
    """

    w1: np.ndarray
    w3: np.ndarray
    w2: np.ndarray
    router: np.ndarray
    b1: np.ndarray | None = None
    b3: np.ndarray | None = None
    b2: np.ndarray | None = None
    e_score_correction_bias: np.ndarray | None = None
    shared: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    shared_gate: np.ndarray | None = None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]


def random_moe_layer(rng: np.random.Generator, num_experts: int, hidden: int, intermediate: int, *,
                     bias: bool = False, shared_intermediate: int | None = None,
                     shared_gate: bool = False, score_bias: bool = False) -> FloatMoELayer:
    """Random float MoE layer with realistic magnitudes (weights ~ N(0, 1/fan_in))."""
    e, h, i = num_experts, hidden, intermediate

    def lin(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    shared = None
    if shared_intermediate:
        shared = (lin(shared_intermediate, h), lin(shared_intermediate, h), lin(h, shared_intermediate))
    return FloatMoELayer(
        w1=lin(e, i, h), w3=lin(e, i, h), w2=lin(e, h, i), router=lin(e, h),
        b1=(0.1 * rng.standard_normal((e, i))).astype(np.float32) if bias else None,
        b3=(0.1 * rng.standard_normal((e, i))).astype(np.float32) if bias else None,
        b2=(0.1 * rng.standard_normal((e, h))).astype(np.float32) if bias else None,
        e_score_correction_bias=(0.1 * rng.standard_normal(e)).astype(np.float32) if score_bias else None,
        shared=shared,
        shared_gate=lin(1, h) if shared_gate else None,
    )


def random_checkpoint_weights(rng: np.random.Generator, scheme: QuantScheme, num_experts: int,
                              hidden: int, intermediate: int, *, scale: float = 0.01) -> CheckpointWeights:
    """A random loader-layout layer straight from random packed words (no quantization step):
    fast enough for model-sized benchmarks. Scales are positive, ~``scale``; act-order g_idx
    is a random balanced assignment; zero points random."""
    e, h, i = num_experts, hidden, intermediate
    shapes = CheckpointWeights.expected_shapes(scheme, e, h, i)
    f16 = default_scale_dtype(scheme)
    arrays = {}
    for name, shape in shapes.items():
        if name.endswith("bias"):
            continue
        if "g_idx" in name:
            k = shape[1]
            arrays[name] = np.stack([rng.permutation(np.arange(k) // scheme.group_size)
                                     for _ in range(e)]).astype(np.int32)
        elif "scales" in name:
            arrays[name] = (scale * (0.5 + rng.random(shape, dtype=np.float32))).astype(f16)
        else:
            arrays[name] = rng.integers(-2**31, 2**31, shape, dtype=np.int64).astype(np.int32)
    return CheckpointWeights.of(**arrays, scheme=scheme, hidden_size=h, intermediate_size=i).validate()


def default_scale_dtype(scheme: QuantScheme):
    """fp16 for AutoAWQ / AutoGPTQ files, bf16 for compressed-tensors (as those tools write)."""
    import ml_dtypes

    return ml_dtypes.bfloat16 if scheme.method is QuantMethod.COMPRESSED_TENSORS else np.float16


def quantized_linear_tensors(w: np.ndarray, scheme: QuantScheme, *, scale_dtype=None,
                             g_idx: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Quantize one linear weight ``w [N, K]`` and return its checkpoint tensors by suffix."""
    scale_dtype = scale_dtype or default_scale_dtype(scheme)
    q = quantize_rtn(w, scheme, scale_dtype=scale_dtype, g_idx=g_idx)
    return formats.pack(scheme, q.codes, q.scales, q.zeros, q.g_idx)


_MODEL_TEMPLATES = {
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral"},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe"},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
    "deepseek_v2": {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2"},
}


def _write_mlp(tensors: dict, prefix: str, naming: dict, scheme: QuantScheme, scale_dtype, bias_dtype,
               weights: tuple, biases: tuple = (None, None, None)) -> None:
    """Quantize one gated MLP (gate, up, down) into ``tensors`` under ``prefix``."""
    from .quantize import act_order_g_idx

    gate, up, down = weights
    # gate and up share one act-order: the same inputs feed both projections.
    g_idx = act_order_g_idx(np.concatenate([gate, up]), scheme.group_size) if scheme.act_order else None
    for role, w, bias in zip(("gate", "up", "down"), weights, biases):
        gi = g_idx if role != "down" else None
        for suffix, t in quantized_linear_tensors(w, scheme, scale_dtype=scale_dtype, g_idx=gi).items():
            tensors[f"{prefix}.{naming[role]}.{suffix}"] = t
        if bias is not None:
            tensors[f"{prefix}.{naming[role]}.bias"] = np.asarray(bias).astype(bias_dtype)


def write_checkpoint(
    path: str | os.PathLike,
    scheme: QuantScheme,
    layers: Sequence[FloatMoELayer],
    *,
    model_type: str = "mixtral",
    top_k: int = 2,
    renormalize: bool = True,
    scoring_func: str = "softmax",
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
    hidden_act: str = "silu",
    extra_tensors: Mapping[str, np.ndarray] | None = None,
    extra_config: Mapping[str, Any] | None = None,
    max_shard_bytes: int | None = None,
    scale_dtype=None,
    quantize_shared: bool = True,
) -> str:
    """Quantize ``layers`` into ``scheme`` and write a Hugging Face style checkpoint directory.

    Layer ``j`` of ``layers`` becomes ``model.layers.{j}``. ``max_shard_bytes`` splits the
    tensors into ``model-XXXXX-of-YYYYY.safetensors`` shards with an index file.
    Returns the directory path.
    """
    from safetensors.numpy import save_file

    if model_type not in _MODEL_TEMPLATES:
        raise ConfigError(f"model_type: expected one of {sorted(_MODEL_TEMPLATES)}, got {model_type!r}")
    if not layers:
        raise ConfigError("layers: at least one MoE layer is required")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    naming = NAMINGS["mixtral" if model_type == "mixtral" else "qwen"]
    block = naming["block"]
    sd = scale_dtype or default_scale_dtype(scheme)
    tensors: dict[str, np.ndarray] = {}
    import ml_dtypes

    f16 = ml_dtypes.bfloat16 if sd == ml_dtypes.bfloat16 else np.float16
    ref = layers[0]
    e, i, h = ref.w1.shape
    for li, layer in enumerate(layers):
        base = f"model.layers.{li}.{block}"
        for ei in range(layer.num_experts):
            biases = tuple(None if b_ is None else b_[ei] for b_ in (layer.b1, layer.b3, layer.b2))
            _write_mlp(tensors, f"{base}.experts.{ei}", naming, scheme, sd, f16,
                       (layer.w1[ei], layer.w3[ei], layer.w2[ei]), biases)
        tensors[f"{base}.gate.weight"] = layer.router.astype(f16)
        if layer.e_score_correction_bias is not None:
            tensors[f"{base}.gate.e_score_correction_bias"] = layer.e_score_correction_bias.astype(np.float32)
        if layer.shared is not None:
            sp = f"{base}.shared_expert" if model_type == "qwen2_moe" else f"{base}.shared_experts"
            if quantize_shared:
                _write_mlp(tensors, sp, NAMINGS["qwen"], scheme, sd, f16, layer.shared)
            else:
                for role, w in zip(("gate", "up", "down"), layer.shared):
                    tensors[f"{sp}.{NAMINGS['qwen'][role]}.weight"] = w.astype(f16)
        if layer.shared_gate is not None:
            tensors[f"{base}.shared_expert_gate.weight"] = layer.shared_gate.astype(f16)
    for k, v in (extra_tensors or {}).items():
        tensors[k] = np.ascontiguousarray(v)

    qc = scheme.to_quant_config()
    if not quantize_shared and scheme.method is QuantMethod.COMPRESSED_TENSORS:
        qc["ignore"] = sorted(set(qc["ignore"]) | {"re:.*shared_expert.*"})
    config: dict[str, Any] = dict(_MODEL_TEMPLATES[model_type])
    config.update({
        "hidden_size": h,
        "num_hidden_layers": len(layers),
        "num_experts_per_tok": top_k,
        "norm_topk_prob": renormalize,
        "scoring_func": scoring_func,
        "routed_scaling_factor": routed_scaling_factor,
        "hidden_act": hidden_act,
        "torch_dtype": "bfloat16" if f16 == ml_dtypes.bfloat16 else "float16",
        "quantization_config": qc,
    })
    if model_type == "mixtral":
        config.update({"num_local_experts": e, "intermediate_size": i})
    elif model_type.startswith("qwen"):
        config.update({"num_experts": e, "moe_intermediate_size": i, "decoder_sparse_step": 1})
        if ref.shared is not None:
            config["shared_expert_intermediate_size"] = ref.shared[0].shape[0]
    else:
        config.update({"n_routed_experts": e, "moe_intermediate_size": i, "first_k_dense_replace": 0,
                       "n_shared_experts": 1 if ref.shared is not None else 0,
                       "topk_method": "noaux_tc" if num_expert_group else "greedy"})
        if num_expert_group:
            config.update({"n_group": num_expert_group, "topk_group": topk_group})
    config.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    meta = {"format": "pt"}
    if not max_shard_bytes:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata=meta)
        return path
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for k in sorted(tensors):
        nbytes = tensors[k].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = tensors[k]
        size += nbytes
    weight_map = {}
    for si, shard in enumerate(shards):
        fname = f"model-{si + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata=meta)
        weight_map.update({k: fname for k in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))},
                   "weight_map": weight_map}, f, indent=2)
    return path


def float_reference_weights(layer: FloatMoELayer) -> tuple[np.ndarray, np.ndarray]:
    """``w13 [E, 2I, H]`` (gate first) and ``w2 [E, H, I]`` float64 from a float layer."""
    return (np.concatenate([layer.w1, layer.w3], axis=1).astype(np.float64),
            layer.w2.astype(np.float64))




__all__ = ["FloatMoELayer", "random_moe_layer", "random_checkpoint_weights", "default_scale_dtype",
           "quantized_linear_tensors", "write_checkpoint", "float_reference_weights"]
