"""Random whole-model checkpoints in the tools' on-disk formats (for tests and benchmarks).

:func:`write_random_model` writes a Hugging Face checkpoint folder of the shape a
:class:`RandomModelSpec` gives — ``config.json``, one safetensors shard per decoder layer plus one
for the embeddings / head, and the index — for the Qwen3-MoE, Qwen2-MoE, Mixtral or DeepSeek-V2 /
V3 family, with every attention projection, dense MLP and expert quantized in ``scheme`` and the
embeddings, ``lm_head``, norms and routers in 16 bits, named as the quantization tools name them.
The packed words are random (every int32 word is a valid set of codes), the scales chosen so that
each dequantized weight has a standard deviation of about ``1/sqrt(K)``; nothing is quantized from
float weights, so a model-sized checkpoint is written at disk speed, one layer in memory at a time.

::

    spec = RandomModelSpec(model_type="qwen3_moe", scheme=scheme, vocab_size=512, hidden_size=256,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, num_experts=8,
                           top_k=2, moe_intermediate_size=128)
    write_random_model(path, spec, seed=0)
    write_random_model(path2, spec.replace(num_layers=4), seed=1)
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from .. import formats
from ..errors import ConfigError
from ..fields import check_flag, check_int, check_number, check_string, show_value
from ..schemes import QuantMethod, QuantScheme
from ..writers import default_scale_dtype

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


def _optional_int(name: str, value: Any, low: int) -> int | None:
    return None if value is None else check_int(name, value, low=low)


def _mapping(name: str, value: Any) -> Mapping | None:
    if value is not None and not isinstance(value, Mapping):
        raise ConfigError(f"{name}: expected None or a mapping, got {type(value).__name__} {show_value(value)}")
    return value


@dataclasses.dataclass(frozen=True)
class RandomModelSpec:
    """The shape of a random checkpoint :func:`write_random_model` writes (see the module doc).

    Qwen2-MoE gets q/k/v biases; Qwen3-MoE gets per-head q/k norms; a
    ``shared_expert_intermediate_size`` gives each MoE layer a shared expert with its sigmoid gate
    (Qwen2-MoE); ``mlp_only_layers`` / ``decoder_sparse_step`` place dense MLPs
    (``intermediate_size``) as Qwen's configs do; ``quantize_lm_head`` quantizes ``lm_head`` too;
    ``quantize_attention=False`` writes the attention linears 16-bit (as checkpoints that
    quantize only the experts store them);
    ``extra_config`` is merged into ``config.json`` last. DeepSeek (``deepseek_v2`` /
    ``deepseek_v3``): ``mla`` gives the latent-attention sizes (:data:`MLA_FIELDS`; ``head_dim``
    and ``num_kv_heads`` are then unused), the first ``first_k_dense_replace`` layers are dense,
    each MoE layer has ``n_shared_experts`` shared experts of ``moe_intermediate_size`` each, and
    ``routing`` holds the router's config fields (``topk_method``, ``n_group``, ``topk_group``,
    ``scoring_func``, ``routed_scaling_factor``, ``norm_topk_prob``); ``topk_method="noaux_tc"``
    writes a score-correction bias per layer. Every field is checked on construction
    (:class:`~wna16_jax.errors.ConfigError` naming it); :meth:`replace` changes some.
    """

    model_type: str
    scheme: QuantScheme
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    decoder_sparse_step: int = 1
    mlp_only_layers: Sequence[int] = ()
    tie_word_embeddings: bool = False
    norm_topk_prob: bool | None = None
    sliding_window: int | None = None
    rope_theta: float = 10000.0
    max_position_embeddings: int | None = 4096
    quantize_lm_head: bool = False
    quantize_attention: bool = True
    extra_config: Mapping[str, Any] | None = None
    mla: Mapping[str, int | None] | None = None
    first_k_dense_replace: int = 0
    n_shared_experts: int = 0
    routing: Mapping[str, Any] | None = None

    def __post_init__(self):
        check_string("model_type", self.model_type, choices=sorted(_ARCH))
        if not isinstance(self.scheme, QuantScheme):
            raise ConfigError(f"scheme: expected a QuantScheme, got {type(self.scheme).__name__} "
                              f"{show_value(self.scheme)}")
        facts = {n: check_int(n, getattr(self, n), low=1) for n in _SIZES}
        facts.update(top_k=check_int("top_k", self.top_k, low=1, high=facts["num_experts"]),
                     first_k_dense_replace=check_int("first_k_dense_replace", self.first_k_dense_replace, low=0,
                                                     high=facts["num_layers"]),
                     n_shared_experts=check_int("n_shared_experts", self.n_shared_experts, low=0),
                     rope_theta=check_number("rope_theta", self.rope_theta, above=0),
                     mlp_only_layers=self._layer_list(facts["num_layers"]),
                     **{n: _optional_int(n, getattr(self, n), 1) for n in _OPTIONAL_SIZES},
                     **{n: check_flag(n, getattr(self, n)) for n in ("tie_word_embeddings", "quantize_lm_head",
                                                                  "quantize_attention")},
                     **{n: _mapping(n, getattr(self, n)) for n in ("extra_config", "mla", "routing")})
        if self.norm_topk_prob is not None:
            facts["norm_topk_prob"] = check_flag("norm_topk_prob", self.norm_topk_prob)
        for name, value in facts.items():
            object.__setattr__(self, name, value)
        self._check_family()

    def _layer_list(self, num_layers: int) -> tuple[int, ...]:
        v = self.mlp_only_layers
        if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
            raise ConfigError(f"mlp_only_layers: expected a sequence of layer indices, got {show_value(v)}")
        return tuple(check_int(f"mlp_only_layers[{j}]", i, low=0, high=num_layers - 1) for j, i in enumerate(v))

    def _check_family(self) -> None:
        if self.deepseek:
            if self.mla is None or set(self.mla) != set(MLA_FIELDS):
                raise ConfigError(f"mla: {self.model_type} needs the latent-attention sizes {MLA_FIELDS}, "
                                  f"got {show_value(self.mla)}")
            for name in MLA_FIELDS:
                if name != "q_lora_rank" or self.mla[name] is not None:
                    check_int(name, self.mla[name], low=1, where="mla")
        if not all(self.sparse_layers()) and not self.intermediate_size:
            raise ConfigError("intermediate_size: required when some layers are dense, got None")

    @property
    def deepseek(self) -> bool:
        return self.model_type.startswith("deepseek")

    def sparse_layers(self) -> list[bool]:
        """Whether each layer is a MoE layer (else a dense MLP), as the family's config places them."""
        if self.deepseek:
            return [i >= self.first_k_dense_replace for i in range(self.num_layers)]
        mixtral = self.model_type == "mixtral"
        return [mixtral or (i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)
                for i in range(self.num_layers)]

    def replace(self, **changes) -> "RandomModelSpec":
        """The same spec with some fields changed (checked again)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise ConfigError(f"RandomModelSpec.replace: {unknown} are not fields; expected some of {sorted(names)}")
        return dataclasses.replace(self, **changes)


#: the sizes a spec needs (each >= 1), and the optional ones (None or >= 1)
_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "num_experts",
          "moe_intermediate_size", "decoder_sparse_step")
_OPTIONAL_SIZES = ("intermediate_size", "shared_expert_intermediate_size", "sliding_window",
                   "max_position_embeddings")


class _Draws:
    """The random tensors of one checkpoint, drawn from one generator (in the writer's order)."""

    def __init__(self, spec: RandomModelSpec, seed: int):
        self.rng, self.scheme, self.h = np.random.default_rng(seed), spec.scheme, spec.hidden_size
        self.fdt = default_scale_dtype(spec.scheme)

    def lin(self, tensors, module, n, k, bias=False, g_idx=None):
        """A quantized linear ``[n, k]`` into ``tensors``; returns its act-order ``g_idx`` if any."""
        got = random_linear_tensors(self.rng, self.scheme, n, k, bias=bias, float_dtype=self.fdt, g_idx=g_idx)
        for suffix, a in got.items():
            tensors[f"{module}.{suffix}"] = a
        return got.get("g_idx", got.get("weight_g_idx"))

    def lin16(self, tensors, module, n, k, bias=False):
        """A 16-bit linear ``[n, k]`` (and its bias) into ``tensors``."""
        tensors[f"{module}.weight"] = self.dense(n, k)
        if bias:
            tensors[f"{module}.bias"] = self.dense(n, std=0.1)

    def mlp(self, tensors, prefix, names, inter):
        """A gated MLP (gate, up, down) into ``tensors``; gate and up share one act-order g_idx."""
        gi = self.lin(tensors, f"{prefix}.{names[0]}", inter, self.h)
        self.lin(tensors, f"{prefix}.{names[1]}", inter, self.h, g_idx=gi)
        self.lin(tensors, f"{prefix}.{names[2]}", self.h, inter)

    def dense(self, *shape, std=None):
        std = std if std is not None else 1.0 / np.sqrt(shape[-1])
        return (std * self.rng.standard_normal(shape, dtype=np.float32)).astype(self.fdt)

    def norm(self, size):
        return (1.0 + 0.1 * self.rng.standard_normal(size, dtype=np.float32)).astype(self.fdt)


def _attention(d: _Draws, spec: RandomModelSpec, t: dict, p: str) -> None:
    """Layer ``p``'s attention tensors: DeepSeek's latent attention or q/k/v/o (and Qwen3's norms)."""
    h, nh, nkv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    lin = d.lin if spec.quantize_attention else d.lin16
    if spec.deepseek:
        mla, a = spec.mla, f"{p}.self_attn"
        qk = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
        if mla["q_lora_rank"] is None:
            lin(t, f"{a}.q_proj", nh * qk, h)
        else:
            lin(t, f"{a}.q_a_proj", mla["q_lora_rank"], h)
            t[f"{a}.q_a_layernorm.weight"] = d.norm(mla["q_lora_rank"])
            lin(t, f"{a}.q_b_proj", nh * qk, mla["q_lora_rank"])
        lin(t, f"{a}.kv_a_proj_with_mqa", mla["kv_lora_rank"] + mla["qk_rope_head_dim"], h)
        t[f"{a}.kv_a_layernorm.weight"] = d.norm(mla["kv_lora_rank"])
        lin(t, f"{a}.kv_b_proj", nh * (mla["qk_nope_head_dim"] + mla["v_head_dim"]), mla["kv_lora_rank"])
        lin(t, f"{a}.o_proj", h, nh * mla["v_head_dim"])
    else:
        qkv_bias = spec.model_type == "qwen2_moe"
        lin(t, f"{p}.self_attn.q_proj", nh * hd, h, qkv_bias)
        lin(t, f"{p}.self_attn.k_proj", nkv * hd, h, qkv_bias)
        lin(t, f"{p}.self_attn.v_proj", nkv * hd, h, qkv_bias)
        lin(t, f"{p}.self_attn.o_proj", h, nh * hd)
    if spec.model_type == "qwen3_moe":
        t[f"{p}.self_attn.q_norm.weight"] = d.norm(hd)
        t[f"{p}.self_attn.k_norm.weight"] = d.norm(hd)


def _moe(d: _Draws, spec: RandomModelSpec, t: dict, p: str) -> None:
    """Layer ``p``'s experts, router (and score-correction bias) and shared experts."""
    mixtral = spec.model_type == "mixtral"
    block = "block_sparse_moe" if mixtral else "mlp"
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for e in range(spec.num_experts):
        d.mlp(t, f"{p}.{block}.experts.{e}", names, spec.moe_intermediate_size)
    t[f"{p}.{block}.gate.weight"] = d.dense(spec.num_experts, spec.hidden_size)
    if (spec.routing or {}).get("topk_method") == "noaux_tc":
        t[f"{p}.mlp.gate.e_score_correction_bias"] = (0.1 * d.rng.standard_normal(spec.num_experts)).astype(np.float32)
    if spec.n_shared_experts:
        d.mlp(t, f"{p}.mlp.shared_experts", ("gate_proj", "up_proj", "down_proj"),
              spec.n_shared_experts * spec.moe_intermediate_size)
    if spec.shared_expert_intermediate_size:
        d.mlp(t, f"{p}.mlp.shared_expert", ("gate_proj", "up_proj", "down_proj"),
              spec.shared_expert_intermediate_size)
        t[f"{p}.mlp.shared_expert_gate.weight"] = d.dense(1, spec.hidden_size)


def _layer(d: _Draws, spec: RandomModelSpec, i: int, sparse: bool) -> dict[str, np.ndarray]:
    t: dict[str, np.ndarray] = {}
    p = f"model.layers.{i}"
    _attention(d, spec, t, p)
    t[f"{p}.input_layernorm.weight"] = d.norm(spec.hidden_size)
    t[f"{p}.post_attention_layernorm.weight"] = d.norm(spec.hidden_size)
    if sparse:
        _moe(d, spec, t, p)
    else:
        d.mlp(t, f"{p}.mlp", ("gate_proj", "up_proj", "down_proj"), spec.intermediate_size)
    return t


def _head(d: _Draws, spec: RandomModelSpec) -> dict[str, np.ndarray]:
    """The embeddings, final norm and (untied) ``lm_head``."""
    t = {"model.embed_tokens.weight": d.dense(spec.vocab_size, spec.hidden_size, std=1.0),
         "model.norm.weight": d.norm(spec.hidden_size)}
    if spec.quantize_lm_head and not spec.tie_word_embeddings:
        d.lin(t, "lm_head", spec.vocab_size, spec.hidden_size)
    elif not spec.tie_word_embeddings:
        t["lm_head.weight"] = d.dense(spec.vocab_size, spec.hidden_size)
    return t


def _config(spec: RandomModelSpec) -> dict[str, Any]:
    """``config.json`` of the checkpoint (the family's fields, then ``extra_config``)."""
    qc = spec.scheme.to_quant_config()
    if spec.scheme.method is QuantMethod.COMPRESSED_TENSORS:
        qc["ignore"] = (([] if spec.quantize_lm_head else ["lm_head"]) + ["re:.*\\.gate$", "re:.*shared_expert_gate$"]
                        + ([] if spec.quantize_attention else ["re:.*\\.self_attn\\..*"]))
    config: dict[str, Any] = {
        "architectures": [_ARCH[spec.model_type]], "model_type": spec.model_type, "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_theta": spec.rope_theta, "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings, "num_experts_per_tok": spec.top_k,
        "torch_dtype": "bfloat16" if np.dtype(default_scale_dtype(spec.scheme)) != np.float16 else "float16",
        "bos_token_id": 1, "eos_token_id": 2, "quantization_config": qc,
    }
    _family_config(spec, config)
    config.update(spec.extra_config or {})
    return config


def _family_config(spec: RandomModelSpec, config: dict[str, Any]) -> None:
    """The Mixtral, DeepSeek or Qwen fields of ``config``."""
    moe_i = spec.moe_intermediate_size
    if spec.model_type == "mixtral":
        config.update(num_local_experts=spec.num_experts, intermediate_size=moe_i, sliding_window=spec.sliding_window)
    elif spec.deepseek:
        del config["head_dim"]                             # DeepSeek's configs name the parts instead
        config.update(dict(spec.mla), num_key_value_heads=spec.num_heads, n_routed_experts=spec.num_experts,
                      moe_intermediate_size=moe_i, intermediate_size=spec.intermediate_size or moe_i,
                      first_k_dense_replace=spec.first_k_dense_replace, moe_layer_freq=1,
                      n_shared_experts=spec.n_shared_experts or None, attention_bias=False,
                      topk_method="greedy", norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax")
        config.update(spec.routing or {})
    else:
        norm_topk = spec.model_type == "qwen3_moe" if spec.norm_topk_prob is None else spec.norm_topk_prob
        config.update(num_experts=spec.num_experts, moe_intermediate_size=moe_i,
                      intermediate_size=spec.intermediate_size or moe_i, decoder_sparse_step=spec.decoder_sparse_step,
                      mlp_only_layers=list(spec.mlp_only_layers), use_sliding_window=False, sliding_window=None,
                      norm_topk_prob=norm_topk)
        if spec.shared_expert_intermediate_size:
            config["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size


def write_random_model(path: str | os.PathLike, spec: RandomModelSpec, *, seed: int = 0,
                       progress: bool = False) -> str:
    """Write a random checkpoint of shape ``spec`` into folder ``path`` (see the module doc) and
    return the path: one safetensors shard per layer (one layer in memory at a time), one for the
    embeddings and head, the index and ``config.json``. ``seed`` (an int >= 0) draws every tensor;
    ``progress`` prints a line per layer."""
    from safetensors.numpy import save_file

    if not isinstance(spec, RandomModelSpec):
        raise ConfigError(f"spec: expected a RandomModelSpec, got {type(spec).__name__} {show_value(spec)}")
    d = _Draws(spec, check_int("seed", seed, low=0))
    progress = check_flag("progress", progress)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    total = spec.num_layers + 1
    shards: list[tuple[str, list[str]]] = []
    for i, sparse in enumerate(spec.sparse_layers()):
        t = _layer(d, spec, i, sparse)
        fname = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
        save_file(t, os.path.join(path, fname), metadata={"format": "pt"})
        shards.append((fname, list(t)))
        if progress:
            print(f"  wrote layer {i + 1}/{spec.num_layers}", flush=True)
        del t
    t = _head(d, spec)
    fname = f"model-{total:05d}-of-{total:05d}.safetensors"
    save_file(t, os.path.join(path, fname), metadata={"format": "pt"})
    shards.append((fname, list(t)))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: fn for fn, ns in shards for n in ns}}, f, indent=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(_config(spec), f, indent=2)
    return path


__all__ = ["RandomModelSpec", "write_random_model", "random_linear_tensors"]
