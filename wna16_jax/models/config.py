"""The decoder facts of a checkpoint's ``config.json``: :class:`DecoderConfig`.

Families: Qwen3-MoE (``qwen3_moe``), Qwen2-MoE (``qwen2_moe``) and Mixtral (``mixtral``). Both
the transformers 4 spelling (``rope_theta`` + ``rope_scaling``) and the transformers 5 one
(``rope_parameters``) are read. Anything the decoders would get wrong is refused with a typed
error naming the field, what is supported and what the config says.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ..errors import ConfigError, UnsupportedError

#: model_type → human name of the family
SUPPORTED_FAMILIES = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral"}
#: rope types the decoders implement
SUPPORTED_ROPE_TYPES = ("default", "linear")
#: transformers' default rope_theta per family (used when the config omits it)
_DEFAULT_THETA = {"qwen3_moe": 10000.0, "qwen2_moe": 10000.0, "mixtral": 1e6}
_DEFAULT_EPS = {"qwen3_moe": 1e-6, "qwen2_moe": 1e-6, "mixtral": 1e-5}


def supported_families_text() -> str:
    return ", ".join(f"{v} ({k!r})" for k, v in SUPPORTED_FAMILIES.items())


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Everything a decoder needs from ``config.json`` (hashable: a static part of the model).

    ``sparse_layers[i]`` says whether layer ``i`` is a MoE layer (Qwen's ``decoder_sparse_step``
    and ``mlp_only_layers``; every layer for Mixtral). ``qkv_bias`` / ``o_bias``: biases on the
    attention projections. ``qk_norm``: RMS norms on each head's queries and keys (Qwen3).
    ``rope_type`` is ``"default"`` or ``"linear"`` (positions divided by ``rope_factor``).
    ``sliding_window``: keys more than ``sliding_window - 1`` positions back are masked (Mixtral),
    or None. ``eos_token_ids``: the config's ``eos_token_id`` as a tuple (may be empty).
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
            extra = (" (DeepSeek's multi-head latent attention is not implemented: docs/models.md)"
                     if isinstance(mt, str) and mt.startswith("deepseek") else "")
            raise UnsupportedError(f"config.json: model_type {mt!r} is not supported by wna16_jax.models; "
                                   f"supported families: {supported_families_text()}{extra}")

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
        kv = pos_int("num_key_value_heads", heads)
        if heads % kv:
            raise ConfigError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                              f"num_key_value_heads ({kv})")
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
        rope_type, factor = "default", 1.0
        if scaling is not None:
            if not isinstance(scaling, Mapping):
                raise ConfigError(f"config.json: field 'rope_scaling' must be an object or null, got {scaling!r}")
            rope_type = scaling.get("rope_type", scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedError(f"config.json: rope type {rope_type!r} is not supported; "
                                       f"supported rope types: {SUPPORTED_ROPE_TYPES}")
            if rope_type == "linear":
                factor = pos_float("'rope_scaling.factor'", scaling.get("factor"))

        # where the MoE layers are
        if mt == "mixtral":
            sparse = tuple(True for _ in range(layers))
            inter = None
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
        else:
            qkv_bias = o_bias = False

        eos = config.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])
                        if isinstance(e, int) and not isinstance(e, bool) and 0 <= e < vocab)
        bos = config.get("bos_token_id")
        max_pos = config.get("max_position_embeddings")
        return cls(
            model_type=mt, vocab_size=vocab, hidden_size=h, num_layers=layers, num_heads=heads,
            num_kv_heads=kv, head_dim=hd, intermediate_size=None if inter is None else int(inter),
            rms_norm_eps=eps, rope_theta=theta, rope_type=rope_type, rope_factor=factor,
            qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=mt == "qwen3_moe",
            tie_word_embeddings=flag("tie_word_embeddings", False), sparse_layers=sparse,
            sliding_window=window,
            max_position_embeddings=int(max_pos) if isinstance(max_pos, int) and max_pos > 0 else None,
            hidden_act="silu", eos_token_ids=eos_ids,
            bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None)


__all__ = ["DecoderConfig", "SUPPORTED_FAMILIES", "SUPPORTED_ROPE_TYPES"]
