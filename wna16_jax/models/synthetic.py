"""Random whole-model checkpoints in the tools' on-disk formats (for tests and benchmarks).

:func:`write_random_model` writes a Hugging Face checkpoint folder — ``config.json``, one
safetensors shard per decoder layer plus one for the embeddings / head, and the index — for the
Qwen3-MoE, Qwen2-MoE, Mixtral or DeepSeek-V2 / V3 family, with every attention projection,
dense MLP and expert quantized in ``scheme`` and the embeddings, ``lm_head``, norms and routers
in 16 bits, named as the quantization tools name them. The packed words are random (every int32 word is a valid set
of codes), the scales chosen so that each dequantized weight has a standard deviation of about
``1/sqrt(K)``; nothing is quantized from float weights, so a model-sized checkpoint is written
at disk speed, one layer in memory at a time.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..writers import default_scale_dtype
from ..errors import ConfigError
from ..schemes import QuantMethod, QuantScheme
from .config import SUPPORTED_FAMILIES
from .. import formats

_ARCH = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM",
         "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
#: the config.json fields of DeepSeek's latent attention (``mla=``)
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def random_linear_tensors(rng: np.random.Generator, scheme: QuantScheme, n: int, k: int, *,
                          bias: bool = False, float_dtype=None, g_idx: np.ndarray | None = None
                          ) -> dict[str, np.ndarray]:
    """Checkpoint tensors (suffix → array) of a random quantized linear ``W [n, k]`` (``g_idx``:
    the act-order group of each input row to use, else a random balanced one)."""
    float_dtype = float_dtype or default_scale_dtype(scheme)
    levels = 1 << scheme.bits
    code_var = (levels * levels - 1) / 12.0 * (2.0 if scheme.zero_point else 1.0)
    s0 = 1.0 / (np.sqrt(code_var) * np.sqrt(k))
    out = {}
    for spec in formats.tensors(scheme, n, k).values():
        suffix, shape = spec.suffix, spec.shape
        if suffix == "bias":
            if bias:
                out[suffix] = (0.02 * rng.standard_normal(shape)).astype(float_dtype)
        elif suffix in ("g_idx", "weight_g_idx"):
            trivial = np.zeros(k, np.int64) if scheme.group_size == -1 else np.arange(k) // scheme.group_size
            if scheme.act_order:
                trivial = rng.permutation(trivial) if g_idx is None else np.asarray(g_idx)
            out[suffix] = trivial.astype(np.int32)
        elif suffix == "weight_shape":
            out[suffix] = np.array([n, k], np.int64)
        elif suffix in ("scales", "weight_scale"):
            out[suffix] = (s0 * (0.75 + 0.5 * rng.random(shape, dtype=np.float32))).astype(float_dtype)
        elif scheme.method is QuantMethod.GPTQ and suffix == "qzeros" and not scheme.zero_point:
            z = scheme.implicit_zero - 1 if scheme.gptq_zeros_minus_one else scheme.implicit_zero
            word = np.uint32(sum(z << (scheme.bits * j) for j in range(scheme.pack_factor)))
            out[suffix] = np.full(shape, word, np.uint32).view(np.int32)
        else:
            out[suffix] = rng.integers(0, 2**32, size=shape, dtype=np.uint32).view(np.int32)
    return out


def write_random_model(
    path: str | os.PathLike, *, model_type: str, scheme: QuantScheme, vocab_size: int, hidden_size: int,
    num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int, num_experts: int, top_k: int,
    moe_intermediate_size: int, intermediate_size: int | None = None,
    shared_expert_intermediate_size: int | None = None, decoder_sparse_step: int = 1,
    mlp_only_layers: Sequence[int] = (), tie_word_embeddings: bool = False, norm_topk_prob: bool | None = None,
    sliding_window: int | None = None, rope_theta: float = 10000.0, max_position_embeddings: int = 4096,
    quantize_lm_head: bool = False, seed: int = 0, extra_config: Mapping[str, Any] | None = None,
    progress: bool = False, mla: Mapping[str, int | None] | None = None, first_k_dense_replace: int = 0,
    n_shared_experts: int = 0, routing: Mapping[str, Any] | None = None,
) -> str:
    """Write a random checkpoint of the given shape (see the module doc) and return its path.
    Qwen2-MoE gets q/k/v biases; Qwen3-MoE gets per-head q/k norms; a
    ``shared_expert_intermediate_size`` gives each MoE layer a shared expert with its sigmoid gate
    (Qwen2-MoE); ``mlp_only_layers`` / ``decoder_sparse_step`` place dense MLPs
    (``intermediate_size``) as Qwen's configs do; ``quantize_lm_head`` quantizes ``lm_head`` too.
    DeepSeek (``deepseek_v2`` / ``deepseek_v3``): ``mla`` gives the latent-attention sizes
    (:data:`MLA_FIELDS`; ``head_dim`` and ``num_kv_heads`` are then unused), the first
    ``first_k_dense_replace`` layers are dense, each MoE layer has ``n_shared_experts`` shared
    experts of ``moe_intermediate_size`` each, and ``routing`` holds the router's config fields
    (``topk_method``, ``n_group``, ``topk_group``, ``scoring_func``, ``routed_scaling_factor``,
    ``norm_topk_prob``); ``topk_method="noaux_tc"`` writes a score-correction bias per layer."""
    from safetensors.numpy import save_file

    if model_type not in SUPPORTED_FAMILIES:
        raise ConfigError(f"model_type: expected one of {sorted(SUPPORTED_FAMILIES)}, got {model_type!r}")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    fdt = default_scale_dtype(scheme)
    h, nh, nkv, hd = hidden_size, num_heads, num_kv_heads, head_dim
    mixtral = model_type == "mixtral"
    deepseek = model_type.startswith("deepseek")
    if deepseek and (mla is None or set(mla) != set(MLA_FIELDS)):
        raise ConfigError(f"mla: {model_type} needs the latent-attention sizes {MLA_FIELDS}, got {mla!r}")
    routing = dict(routing or {})
    if deepseek:
        sparse = [i >= first_k_dense_replace for i in range(num_layers)]
    else:
        sparse = [mixtral or (i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0)
                  for i in range(num_layers)]
    if not all(sparse) and not intermediate_size:
        raise ConfigError("intermediate_size: required when some layers are dense")

    def lin(tensors, module, n, k, bias=False, g_idx=None):
        got = random_linear_tensors(rng, scheme, n, k, bias=bias, float_dtype=fdt, g_idx=g_idx)
        for suffix, a in got.items():
            tensors[f"{module}.{suffix}"] = a
        return got.get("g_idx", got.get("weight_g_idx"))

    def mlp(tensors, prefix, names, inter):           # gate and up share one act-order g_idx
        gi = lin(tensors, f"{prefix}.{names[0]}", inter, h)
        lin(tensors, f"{prefix}.{names[1]}", inter, h, g_idx=gi)
        lin(tensors, f"{prefix}.{names[2]}", h, inter)

    def dense(*shape, std=None):
        std = std if std is not None else 1.0 / np.sqrt(shape[-1])
        return (std * rng.standard_normal(shape, dtype=np.float32)).astype(fdt)

    def norm(size):
        return (1.0 + 0.1 * rng.standard_normal(size, dtype=np.float32)).astype(fdt)

    shards: list[tuple[str, list[str]]] = []
    total = num_layers + 1
    for i in range(num_layers):
        t: dict[str, np.ndarray] = {}
        p = f"model.layers.{i}"
        qkv_bias = model_type == "qwen2_moe"
        if deepseek:
            a, qk = f"{p}.self_attn", mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
            if mla["q_lora_rank"] is None:
                lin(t, f"{a}.q_proj", nh * qk, h)
            else:
                lin(t, f"{a}.q_a_proj", mla["q_lora_rank"], h)
                t[f"{a}.q_a_layernorm.weight"] = norm(mla["q_lora_rank"])
                lin(t, f"{a}.q_b_proj", nh * qk, mla["q_lora_rank"])
            lin(t, f"{a}.kv_a_proj_with_mqa", mla["kv_lora_rank"] + mla["qk_rope_head_dim"], h)
            t[f"{a}.kv_a_layernorm.weight"] = norm(mla["kv_lora_rank"])
            lin(t, f"{a}.kv_b_proj", nh * (mla["qk_nope_head_dim"] + mla["v_head_dim"]), mla["kv_lora_rank"])
            lin(t, f"{a}.o_proj", h, nh * mla["v_head_dim"])
        else:
            lin(t, f"{p}.self_attn.q_proj", nh * hd, h, qkv_bias)
            lin(t, f"{p}.self_attn.k_proj", nkv * hd, h, qkv_bias)
            lin(t, f"{p}.self_attn.v_proj", nkv * hd, h, qkv_bias)
            lin(t, f"{p}.self_attn.o_proj", h, nh * hd)
        if model_type == "qwen3_moe":
            t[f"{p}.self_attn.q_norm.weight"] = norm(hd)
            t[f"{p}.self_attn.k_norm.weight"] = norm(hd)
        t[f"{p}.input_layernorm.weight"] = norm(h)
        t[f"{p}.post_attention_layernorm.weight"] = norm(h)
        if sparse[i]:
            block = "block_sparse_moe" if mixtral else "mlp"
            names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
            i_moe = moe_intermediate_size
            for e in range(num_experts):
                mlp(t, f"{p}.{block}.experts.{e}", names, i_moe)
            t[f"{p}.{block}.gate.weight"] = dense(num_experts, h)
            if routing.get("topk_method") == "noaux_tc":
                t[f"{p}.mlp.gate.e_score_correction_bias"] = (0.1 * rng.standard_normal(num_experts)).astype(np.float32)
            if n_shared_experts:
                mlp(t, f"{p}.mlp.shared_experts", ("gate_proj", "up_proj", "down_proj"),
                    n_shared_experts * moe_intermediate_size)
            if shared_expert_intermediate_size:
                mlp(t, f"{p}.mlp.shared_expert", ("gate_proj", "up_proj", "down_proj"),
                    shared_expert_intermediate_size)
                t[f"{p}.mlp.shared_expert_gate.weight"] = dense(1, h)
        else:
            mlp(t, f"{p}.mlp", ("gate_proj", "up_proj", "down_proj"), intermediate_size)
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file(t, os.path.join(path, fname), metadata={"format": "pt"})
        shards.append((fname, list(t)))
        if progress:
            print(f"  wrote layer {i + 1}/{num_layers}", flush=True)
        del t
    t = {"model.embed_tokens.weight": dense(vocab_size, h, std=1.0), "model.norm.weight": norm(h)}
    if quantize_lm_head and not tie_word_embeddings:
        lin(t, "lm_head", vocab_size, h)
    elif not tie_word_embeddings:
        t["lm_head.weight"] = dense(vocab_size, h)
    fname = f"model-{total:05d}-of-{total:05d}.safetensors"
    save_file(t, os.path.join(path, fname), metadata={"format": "pt"})
    shards.append((fname, list(t)))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: fn for fn, ns in shards for n in ns}}, f, indent=1)

    qc = scheme.to_quant_config()
    if scheme.method is QuantMethod.COMPRESSED_TENSORS:
        qc["ignore"] = ([] if quantize_lm_head else ["lm_head"]) + ["re:.*\\.gate$", "re:.*shared_expert_gate$"]
    config: dict[str, Any] = {
        "architectures": [_ARCH[model_type]], "model_type": model_type, "vocab_size": vocab_size,
        "hidden_size": h, "num_hidden_layers": num_layers, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "head_dim": hd, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta, "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings, "num_experts_per_tok": top_k,
        "torch_dtype": "bfloat16" if np.dtype(fdt) != np.float16 else "float16",
        "bos_token_id": 1, "eos_token_id": 2, "quantization_config": qc,
    }
    if mixtral:
        config.update(num_local_experts=num_experts, intermediate_size=moe_intermediate_size,
                      sliding_window=sliding_window)
    elif deepseek:
        del config["head_dim"]                             # DeepSeek's configs name the parts instead
        config.update(dict(mla), num_key_value_heads=nh, n_routed_experts=num_experts,
                      moe_intermediate_size=moe_intermediate_size,
                      intermediate_size=intermediate_size or moe_intermediate_size,
                      first_k_dense_replace=first_k_dense_replace, moe_layer_freq=1,
                      n_shared_experts=n_shared_experts or None, attention_bias=False,
                      topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax")
        config.update(routing)
    else:
        config.update(num_experts=num_experts, moe_intermediate_size=moe_intermediate_size,
                      intermediate_size=intermediate_size or moe_intermediate_size,
                      decoder_sparse_step=decoder_sparse_step, mlp_only_layers=list(mlp_only_layers),
                      use_sliding_window=False, sliding_window=None,
                      norm_topk_prob=(model_type == "qwen3_moe") if norm_topk_prob is None else norm_topk_prob)
        if shared_expert_intermediate_size:
            config["shared_expert_intermediate_size"] = shared_expert_intermediate_size
    config.update(extra_config or {})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return path


__all__ = ["write_random_model", "random_linear_tensors"]
