"""The decoder facts of a checkpoint's ``config.json``: :class:`DecoderConfig`.

Families: Qwen3-MoE (``qwen3_moe``), Qwen2-MoE (``qwen2_moe``), Mixtral (``mixtral``) and
DeepSeek-V2 / V3 (``deepseek_v2``, ``deepseek_v3``: multi-head latent attention), and
Kimi-K2 (``kimi_k2``: DeepSeek-V3's architecture, :data:`RELEASES`). Both the
transformers 4 spelling (``rope_theta`` + ``rope_scaling``) and the transformers 5 one
(``rope_parameters``) are read. Anything the decoders would get wrong is refused with a typed
error naming the field, what is supported and what the config says.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from ..errors import UnsupportedError
from ..fields import REQUIRED, Fields
from ..model_config import ACTIVATIONS, EXPERT_FIELDS, MAX_SIZE, MoEModelConfig
from .generation_config import GenerationDefaults

#: model_type → human name of the family
SUPPORTED_FAMILIES = {"qwen3_moe": "Qwen3-MoE", "qwen2_moe": "Qwen2-MoE", "mixtral": "Mixtral",
                      "deepseek_v2": "DeepSeek-V2", "deepseek_v3": "DeepSeek-V3"}
#: model types that name a release of a supported architecture: model_type → (the architecture's
#: model_type, the release's name). Kimi-K2 (Moonshot) is DeepSeek-V3's architecture under its
#: own model_type; its int4 release stores the routed experts as compressed-tensors
#: pack-quantized int4, group 32.
RELEASES = {"kimi_k2": ("deepseek_v3", "Kimi-K2")}
#: rope types the decoders implement
SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")
#: transformers' default rope_theta per family (used when the config omits it)
_DEFAULT_THETA = {"qwen3_moe": 10000.0, "qwen2_moe": 10000.0, "mixtral": 1e6, "deepseek_v2": 10000.0,
                  "deepseek_v3": 10000.0}
_DEFAULT_EPS = {"qwen3_moe": 1e-6, "qwen2_moe": 1e-6, "mixtral": 1e-5, "deepseek_v2": 1e-6, "deepseek_v3": 1e-6}
_MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")
#: the largest values a config may give (beyond them a typo, not a model: a 10⁹-layer config is
#: refused before the loader builds anything)
MAX_LAYERS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_VOCAB = 1 << 24
MAX_POSITIONS = 1 << 30


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
    return ", ".join([*(f"{v} ({k!r})" for k, v in SUPPORTED_FAMILIES.items()),
                      *(f"{name} ({k!r}, the {SUPPORTED_FAMILIES[arch]} architecture)"
                        for k, (arch, name) in RELEASES.items())])


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
    (:mod:`wna16_jax.models.generation_config`), set by ``load_model``. ``moe``: the MoE
    layers' facts (:class:`~wna16_jax.model_config.MoEModelConfig`, parsed from the same fields),
    or None where the config has no routed experts. ``num_nextn_predict_layers``: DeepSeek-V3's
    multi-token-prediction modules, stored as layers after the last decoder layer (not loaded).
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
    moe: MoEModelConfig | None = None
    num_nextn_predict_layers: int = 0
    release: str | None = None

    @property
    def rope_dim(self) -> int:
        """How many dimensions of each query / key head are rotated."""
        return self.head_dim if self.mla is None else self.mla.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else self.head_dim ** -0.5

    @property
    def family(self) -> str:
        """The family's name; a release of an architecture (:data:`RELEASES`) names both."""
        arch = SUPPORTED_FAMILIES[self.model_type]
        return arch if self.release is None else f"{RELEASES[self.release][1]} ({arch})"

    @property
    def moe_layer_indices(self) -> list[int]:
        return [i for i, s in enumerate(self.sparse_layers) if s]

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], where: str = "config.json") -> "DecoderConfig":
        """Parse ``config.json`` once (see the module doc); the MoE facts become :attr:`moe`."""
        f = Fields(config, where)
        mt = f.get("model_type")
        release = mt if isinstance(mt, str) and mt in RELEASES else None
        if release is not None:
            mt = RELEASES[release][0]
        if not isinstance(mt, str) or mt not in SUPPORTED_FAMILIES:
            raise UnsupportedError(f"{where}: model_type {mt!r} is not supported by wna16_jax.models; "
                                   f"supported families: {supported_families_text()}")
        sizes = _sizes(f, mt)
        experts = f.first(*EXPERT_FIELDS)             # none, or 0 (DeepSeek's n_routed_experts): no MoE layer
        moe = MoEModelConfig.from_fields(f) if experts and f.integer(experts, low=0) else None
        _check_activation(f, moe)
        sparse, inter = _mlp_layers(f, mt, sizes["num_layers"], moe is not None)
        vocab = sizes["vocab_size"]
        return cls(model_type=mt, **sizes, intermediate_size=inter, sparse_layers=sparse, **_rope(f, mt, sizes),
                   **_attention_options(f, mt, sizes["mla"]), tie_word_embeddings=f.flag("tie_word_embeddings", False),
                   max_position_embeddings=f.integer("max_position_embeddings", None, low=1, high=MAX_POSITIONS),
                   eos_token_ids=f.integers("eos_token_id", (), low=0, high=vocab - 1, scalar=True),
                   bos_token_id=f.integer("bos_token_id", None, low=0, high=vocab - 1), moe=moe,
                   num_nextn_predict_layers=f.integer("num_nextn_predict_layers", 0, low=0, high=MAX_LAYERS)
                   if mt in _MLA_FAMILIES else 0, release=release)


def _sizes(f: Fields, mt: str) -> dict:
    """Vocabulary, widths, layer and head counts, and DeepSeek's latent-attention sizes."""
    is_mla = mt in _MLA_FAMILIES
    h = f.integer("hidden_size", low=1, high=MAX_SIZE)
    heads = f.integer("num_attention_heads", low=1, high=MAX_HEADS)
    kv = heads if is_mla else f.integer("num_key_value_heads", heads, low=1, high=heads)
    if heads % kv:
        raise f.fail("num_key_value_heads", f"must divide num_attention_heads ({heads})")
    mla = _mla(f) if is_mla else None
    if mla is None:
        if "head_dim" not in f and h % heads:
            raise f.fail("hidden_size", f"must be a multiple of num_attention_heads ({heads}) where there is no "
                         "head_dim")
        hd = f.integer("head_dim", h // heads, low=2, high=MAX_HEAD_DIM)
        if hd % 2:
            raise f.fail("head_dim", "must be even for rotary embeddings")
    return dict(vocab_size=f.integer("vocab_size", low=1, high=MAX_VOCAB), hidden_size=h,
                num_layers=f.integer("num_hidden_layers", low=1, high=MAX_LAYERS), num_heads=heads,
                num_kv_heads=kv, head_dim=hd if mla is None else mla.qk_head_dim,
                rms_norm_eps=f.number("rms_norm_eps", _DEFAULT_EPS[mt], above=0.0), mla=mla)


def _mla(f: Fields) -> MLAConfig:
    mla = MLAConfig(q_lora_rank=f.integer("q_lora_rank", None, low=1, high=MAX_SIZE),
                    kv_lora_rank=f.integer("kv_lora_rank", low=1, high=MAX_SIZE),
                    qk_nope_head_dim=f.integer("qk_nope_head_dim", low=1, high=MAX_HEAD_DIM),
                    qk_rope_head_dim=f.integer("qk_rope_head_dim", low=2, high=MAX_HEAD_DIM),
                    v_head_dim=f.integer("v_head_dim", low=1, high=MAX_HEAD_DIM),
                    attention_bias=f.flag("attention_bias", False))
    if mla.qk_rope_head_dim % 2:
        raise f.fail("qk_rope_head_dim", "must be even for rotary embeddings")
    return mla


def _check_activation(f: Fields, moe: MoEModelConfig | None) -> None:
    """The decoders' MLPs (dense and experts) are gated SiLU: one rule for ``hidden_act``."""
    act = f.string("hidden_act", "silu")
    if ACTIVATIONS.get(act) != "silu" or (moe is not None and moe.activation != "silu"):
        raise UnsupportedError(f"{f.where}: hidden_act {act!r} is not supported by wna16_jax.models; "
                               "supported: 'silu' (or 'swish')")


def _mlp_layers(f: Fields, mt: str, layers: int, has_moe: bool) -> tuple[tuple[bool, ...], int | None]:
    """``(sparse_layers, intermediate_size)``: which layers are MoE layers, and the dense MLPs'
    width (required where a layer is dense)."""
    if mt == "mixtral":
        if not has_moe:
            raise f.fail("num_local_experts", "is required for mixtral (every layer is a MoE layer)", None)
        sparse = (True,) * layers
    elif mt in _MLA_FAMILIES:
        first = f.integer("first_k_dense_replace", 0, low=0, high=layers)
        freq = f.integer("moe_layer_freq", 1, low=1, high=layers)
        sparse = tuple(has_moe and i >= first and i % freq == 0 for i in range(layers))
    else:
        step = f.integer("decoder_sparse_step", 1, low=1, high=layers)
        only = set(f.integers("mlp_only_layers", (), low=0, high=layers - 1))
        sparse = tuple(has_moe and i not in only and (i + 1) % step == 0 for i in range(layers))
    dense = not all(sparse)
    inter = f.integer("intermediate_size", None if not dense else REQUIRED, low=1, high=MAX_SIZE)
    return sparse, inter


def _attention_options(f: Fields, mt: str, mla: MLAConfig | None) -> dict:
    """Biases, per-head q/k norms and Mixtral's sliding window."""
    window = None
    if mt == "mixtral":
        window = f.integer("sliding_window", None, low=1, high=MAX_POSITIONS)
    elif f.flag("use_sliding_window", False):
        raise UnsupportedError(f"{f.where}: use_sliding_window=true is not supported for {mt} "
                               f"(sliding_window={f.get('sliding_window')!r}, max_window_layers="
                               f"{f.get('max_window_layers')!r}); set it false or use full attention")
    if mt == "qwen2_moe":
        qkv_bias, o_bias = f.flag("qkv_bias", True), False
    elif mt == "qwen3_moe":
        qkv_bias = o_bias = f.flag("attention_bias", False)
    else:
        qkv_bias = o_bias = mla is not None and mla.attention_bias
    return dict(qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=mt == "qwen3_moe", sliding_window=window)


def _rope(f: Fields, mt: str, sizes: dict) -> dict:
    """Rotary embeddings: transformers 5's ``rope_parameters`` or 4's ``rope_theta`` +
    ``rope_scaling``; the rope type, factor, YaRN's settings and DeepSeek's softmax scale."""
    params = f.object("rope_parameters")
    if params is not None and params.data and all(isinstance(v, Mapping) for v in params.data.values()):
        raise UnsupportedError(f"{f.where}: per-layer-type 'rope_parameters' are not supported; "
                               f"got keys {sorted(params.data)}")
    theta_from = params if params is not None and "rope_theta" in params else f
    theta = theta_from.number("rope_theta", _DEFAULT_THETA[mt], above=0.0)
    scaling = params if params is not None else f.object("rope_scaling")
    out = dict(rope_theta=theta, rope_type="default", rope_factor=1.0, rope_yarn=None, softmax_scale=None,
               rope_interleaved=mt in _MLA_FAMILIES and f.flag("rope_interleave", True))
    if scaling is None:
        return out
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedError(f"{f.where}: rope type {rope_type!r} is not supported; "
                               f"supported rope types: {SUPPORTED_ROPE_TYPES}")
    out["rope_type"] = rope_type
    if rope_type in ("linear", "yarn"):
        out["rope_factor"] = scaling.number("factor", above=0.0)
    if rope_type == "yarn":
        out.update(_yarn(f, scaling, out["rope_factor"], sizes["head_dim"], mt in _MLA_FAMILIES))
    return out


def _yarn(f: Fields, scaling: Fields, factor: float, head_dim: int, is_mla: bool) -> dict:
    """YaRN's ``(beta_fast, beta_slow, original_max_position_embeddings, attention_factor)`` and,
    for DeepSeek with ``mscale_all_dim``, the softmax scale."""
    orig = scaling.integer("original_max_position_embeddings", None, low=1, high=MAX_POSITIONS)
    if orig is None:
        orig = f.integer("max_position_embeddings", low=1, high=MAX_POSITIONS)
    if scaling.get("truncate", True) is not True:
        raise UnsupportedError(f"{f.where}: rope_scaling.truncate={scaling.get('truncate')!r} is not "
                               "supported (the correction range is rounded outwards, truncate=true)")
    mscale, mscale_all = (scaling.number(k, None, above=0.0) for k in ("mscale", "mscale_all_dim"))
    attn = scaling.number("attention_factor", None, above=0.0)
    if attn is None:
        attn = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                else yarn_mscale(factor))
    yarn = (scaling.number("beta_fast", 32.0, above=0.0), scaling.number("beta_slow", 1.0, above=0.0), orig,
            float(attn))
    scale = head_dim ** -0.5 * yarn_mscale(factor, mscale_all) ** 2 if is_mla and mscale_all else None
    return dict(rope_yarn=yarn, softmax_scale=scale)


__all__ = ["DecoderConfig", "MLAConfig", "RELEASES", "SUPPORTED_FAMILIES", "SUPPORTED_ROPE_TYPES", "yarn_mscale"]
