"""The decoder facts of a checkpoint's ``config.json``: :class:`DecoderConfig`.

Families: Qwen3-MoE (``qwen3_moe``), Qwen2-MoE (``qwen2_moe``), Mixtral (``mixtral``) and
DeepSeek-V2 / V3 (``deepseek_v2``, ``deepseek_v3``: multi-head latent attention). Both the
transformers 4 spelling (``rope_theta`` + ``rope_scaling``) and the transformers 5 one
(``rope_parameters``) are read. Anything the decoders would get wrong is refused with a typed
error naming the field, what is supported and what the config says.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ..errors import ConfigError, UnsupportedError
from .generation_config import GenerationDefaults

#: model_type → human name of the family
SUPPORTED_FAMILIES = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral",
                      "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3"}
#: rope types the decoders implement
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")
#: transformers' default rope_theta per family (used when the config omits it)
_DEFAULT_THETA = {"qwen3_moe": 10000.0, "qwen2_moe": 10000.0, "mixtral": 1e6, "deepseek_v2": 10000.0,
                  "deepseek_v3": 10000.0}
_DEFAULT_EPS = {"qwen3_moe": 1e-6, "qwen2_moe": 1e-6, "mixtral": 1e-5, "deepseek_v2": 1e-6, "deepseek_v3": 1e-6}
_MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 · mscale · ln(factor) + 1`` (1 for ``factor <= 1``)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """DeepSeek's multi-head latent attention sizes (``config.json``): queries through a
    ``q_lora_rank`` bottleneck (None: one ``q_proj``), keys and values from a shared latent of
    ``kv_lora_rank`` plus one rotary key of ``qk_rope_head_dim`` shared by all heads; per head
    ``qk_nope_head_dim + qk_rope_head_dim`` query / key dimensions and ``v_head_dim`` value ones.
    ``attention_bias``: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def supported_families_text() -> str:
    return ", ".join(f"{v} ({k!r})" for k, v in SUPPORTED_FAMILIES.items())


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything a decoder needs from ``config.json`` (hashable: a static part of the model).

    ``sparse_layers[i]`` says whether layer ``i`` is a MoE layer (Qwen's ``decoder_sparse_step``
    and ``mlp_only_layers``; every layer for Mixtral). ``qkv_bias`` / ``o_bias``: biases on the
    attention projections. ``qk_norm``: RMS norms on each head's queries and keys (Qwen3).
    ``rope_type`` is ``"default"``, ``"linear"`` (positions divided by ``rope_factor``) or
    ``"yarn"`` (``rope_yarn``: ``(beta_fast, beta_slow, original_max_position_embeddings,
    attention_factor)``; the cos / sin tables are multiplied by the attention factor).
    ``rope_interleaved``: the rotated pairs are adjacent dimensions ``(2j, 2j+1)`` (DeepSeek)
    rather than the two halves of the head. ``mla``: DeepSeek's latent attention sizes (then
    ``head_dim`` is the query / key head size, ``num_kv_heads == num_heads``), or None.
    ``softmax_scale``: the attention scores' scale (``head_dim ** -0.5``, times YaRN's
    ``mscale(factor, mscale_all_dim)²`` for DeepSeek).
    ``sliding_window``: keys more than ``sliding_window - 1`` positions back are masked (Mixtral),
    or None. ``eos_token_ids``: the config's ``eos_token_id`` as a tuple (may be empty);
    :func:`~wna16_jax.models.load_model` puts ``generation_config.json``'s first
    (:meth:`GenerationDefaults.stop_token_ids`). ``generation``: the folder's generation defaults
    (:mod:`wna16_jax.models.generation_config`), set by ``load_model``.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int | None
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    rope_factor: float = 1.0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sparse_layers: tuple[bool, ...] = ()
    sliding_window: int | None = None
    max_position_embeddings: int | None = None
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    rope_yarn: tuple[float, float, int, float] | None = None
    rope_interleaved: bool = False
    mla: MLAConfig | None = None
    softmax_scale: float | None = None
    generation: GenerationDefaults = GenerationDefaults()

    @property
    def rope_dim(self) -> int:
        """How many dimensions of each query / key head are rotated."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5

    @property
    def family(self) -> str:
        return SUPPORTED_FAMILIES[self.model_type]

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.sparse_layers) if s]

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "DecoderConfig":
        if not isinstance(config, Mapping):
            raise ConfigError(f"config.json: expected a JSON object, got {type(config).__name__}")
        mt = config.get("model_type")
        if mt not in SUPPORTED_FAMILIES:
            raise UnsupportedError(f"config.json: model_type {mt!r} is not supported by wna16_jax.models; "
                                   f"supported families: {supported_families_text()}")
        is_mla = mt in _MLA_FAMILIES

        def pos_int(key, default=...):
            v = config.get(key)
            if v is None:
                if default is ...:
                    raise ConfigError(f"config.json: field {key!r} is required for {mt}, but missing")
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)) or float(v) != int(v) or v < 1:
                raise ConfigError(f"config.json: field {key!r} must be a positive integer, got {v!r}")
            return int(v)

        def flag(key, default):
            v = config.get(key)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise ConfigError(f"config.json: field {key!r} must be true or false, got {v!r}")
            return v

        def pos_float(where, v):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"config.json: field {where} must be a positive number, got {v!r}")
            return float(v)

        vocab = pos_int("vocab_size")
        h = pos_int("hidden_size")
        layers = pos_int("num_hidden_layers")
        heads = pos_int("num_attention_heads")
        kv = pos_int("num_key_value_heads", heads) if not is_mla else heads
        if heads % kv:
            raise ConfigError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                              f"num_key_value_heads ({kv})")
        mla = None
        if is_mla:
            qr = config.get("q_lora_rank")
            mla = MLAConfig(q_lora_rank=None if qr is None else pos_int("q_lora_rank"),
                            kv_lora_rank=pos_int("kv_lora_rank"), qk_nope_head_dim=pos_int("qk_nope_head_dim"),
                            qk_rope_head_dim=pos_int("qk_rope_head_dim"), v_head_dim=pos_int("v_head_dim"),
                            attention_bias=flag("attention_bias", False))
            if mla.qk_rope_head_dim % 2:
                raise ConfigError(f"config.json: qk_rope_head_dim must be even for rotary embeddings, "
                                  f"got {mla.qk_rope_head_dim}")
            hd = mla.qk_head_dim
        else:
            if config.get("head_dim") is None and h % heads:
                raise ConfigError(f"config.json: hidden_size ({h}) is not a multiple of num_attention_heads "
                                  f"({heads}) and there is no head_dim")
            hd = pos_int("head_dim", h // heads)
            if hd % 2:
                raise ConfigError(f"config.json: head_dim must be even for rotary embeddings, got {hd}")
        eps = pos_float("'rms_norm_eps'", config.get("rms_norm_eps", _DEFAULT_EPS[mt]))
        act = config.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedError(f"config.json: hidden_act {act!r} is not supported by the dense "
                                   "layers of wna16_jax.models; supported: 'silu'")

        # rotary embeddings: transformers 5 'rope_parameters', or 4's 'rope_theta' + 'rope_scaling'
        rp = config.get("rope_parameters")
        if rp is not None:
            if not isinstance(rp, Mapping):
                raise ConfigError(f"config.json: field 'rope_parameters' must be an object, got {rp!r}")
            if all(isinstance(v, Mapping) for v in rp.values()) and rp:
                raise UnsupportedError("config.json: per-layer-type 'rope_parameters' are not supported; "
                                       f"got keys {sorted(rp)}")
            theta = pos_float("'rope_parameters.rope_theta'",
                              rp.get("rope_theta", config.get("rope_theta", _DEFAULT_THETA[mt])))
            scaling = rp
        else:
            theta = pos_float("'rope_theta'", config.get("rope_theta", _DEFAULT_THETA[mt]))
            scaling = config.get("rope_scaling")
        rope_type, factor, yarn, softmax_scale = "default", 1.0, None, None
        max_pos = config.get("max_position_embeddings")
        if scaling is not None:
            if not isinstance(scaling, Mapping):
                raise ConfigError(f"config.json: field 'rope_scaling' must be an object or null, got {scaling!r}")
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedError(f"config.json: rope type {rope_type!r} is not supported; "
                                       f"supported rope types: {SUPPORTED_ROPE_TYPES}")
            if rope_type in ("linear", "yarn"):
                factor = pos_float("'rope_scaling.factor'", scaling.get("factor"))
            if rope_type == "yarn":
                def opt_pos(key, default):
                    v = scaling.get(key)
                    return default if v is None else pos_float(f"'rope_scaling.{key}'", v)

                orig = scaling.get("original_max_position_embeddings", max_pos)
                if isinstance(orig, bool) or not isinstance(orig, int) or orig < 1:
                    raise ConfigError("config.json: field 'rope_scaling.original_max_position_embeddings' "
                                      f"(or max_position_embeddings) must be a positive integer, got {orig!r}")
                if scaling.get("truncate", True) is not True:
                    raise UnsupportedError(f"config.json: rope_scaling.truncate={scaling.get('truncate')!r} is not "
                                           "supported (the correction range is rounded outwards, truncate=true)")
                mscale, mscale_all = opt_pos("mscale", None), opt_pos("mscale_all_dim", None)
                attn = scaling.get("attention_factor")
                if attn is not None:
                    attn = pos_float("'rope_scaling.attention_factor'", attn)
                elif mscale and mscale_all:
                    attn = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                else:
                    attn = yarn_mscale(factor)
                yarn = (opt_pos("beta_fast", 32.0), opt_pos("beta_slow", 1.0), int(orig), float(attn))
                if is_mla and mscale_all:
                    softmax_scale = hd ** -0.5 * yarn_mscale(factor, mscale_all) ** 2

        # where the MoE layers are
        if mt == "mixtral":
            sparse = tuple(True for _ in range(layers))
            inter = None
        elif is_mla:
            first = config.get("first_k_dense_replace", 0)
            if isinstance(first, bool) or not isinstance(first, int) or first < 0:
                raise ConfigError(f"config.json: field 'first_k_dense_replace' must be a non-negative "
                                  f"integer, got {first!r}")
            freq = pos_int("moe_layer_freq", 1)
            n_exp = config.get("n_routed_experts") or 0
            sparse = tuple(bool(n_exp) and i >= first and i % freq == 0 for i in range(layers))
            inter = pos_int("intermediate_size") if not all(sparse) else config.get("intermediate_size")
        else:
            step = pos_int("decoder_sparse_step", 1)
            only = config.get("mlp_only_layers") or []
            if not isinstance(only, (list, tuple)) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in only):
                raise ConfigError(f"config.json: field 'mlp_only_layers' must list layer indices in "
                                  f"[0, {layers}), got {only!r}")
            n_exp = next((config[k] for k in ("num_local_experts", "num_experts", "n_routed_experts")
                          if config.get(k) is not None), 0)
            sparse = tuple(i not in only and n_exp > 0 and (i + 1) % step == 0 for i in range(layers))
            inter = pos_int("intermediate_size") if not all(sparse) else config.get("intermediate_size")

        # sliding windows
        window = None
        sw = config.get("sliding_window")
        if mt == "mixtral":
            if sw is not None:
                window = pos_int("sliding_window")
        elif flag("use_sliding_window", False):
            raise UnsupportedError(f"config.json: use_sliding_window=true is not supported for {mt} "
                                   f"(sliding_window={sw!r}, max_window_layers="
                                   f"{config.get('max_window_layers')!r}); set it false or use full attention")
        if mt == "qwen2_moe":
            qkv_bias, o_bias = flag("qkv_bias", True), False
        elif mt == "qwen3_moe":
            qkv_bias = o_bias = flag("attention_bias", False)
        elif is_mla:
            qkv_bias = o_bias = mla.attention_bias
        else:
            qkv_bias = o_bias = False

        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                        if isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab)
        bos = config.get("bos_token_id")
        return cls(
            model_type=mt, vocab_size=vocab, hidden_size=h, num_layers=layers, num_heads=heads,
            num_kv_heads=kv, head_dim=hd, intermediate_size=None if inter is None else int(inter),
            rms_norm_eps=eps, rope_theta=theta, rope_type=rope_type, rope_factor=factor,
            qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=mt == "qwen3_moe",
            tie_word_embeddings=flag("tie_word_embeddings", False), sparse_layers=sparse,
            sliding_window=window,
            max_position_embeddings=int(max_pos) if isinstance(max_pos, int) and max_pos > 0 else None,
            hidden_act="silu", eos_token_ids=eos_ids,
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
            rope_yarn=yarn, rope_interleaved=is_mla and flag("rope_interleave", True), mla=mla,
            softmax_scale=softmax_scale)


__all__ = ["DecoderConfig", "MLAConfig", "SUPPORTED_FAMILIES", "SUPPORTED_ROPE_TYPES", "yarn_mscale"]
