"""The MoE facts of a model's ``config.json``: :class:`MoEModelConfig`, read through
:class:`~wna16_jax.fields.Fields` (the one validator).

A MoE layer alone (:class:`~wna16_jax.checkpoint.Checkpoint`, :class:`~wna16_jax.nn.QuantizedMoE`)
needs these; a whole decoder's :class:`~wna16_jax.models.DecoderConfig` composes them (its
``moe``), parsed once from the same :class:`Fields`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from .errors import ConfigError, UnsupportedError
from .fields import Fields
from .routing import MoERouting

#: the largest sizes a config may give (beyond them a typo, not a model: refused before anything
#: is allocated)
MAX_EXPERTS = 1 << 16
MAX_SIZE = 1 << 20

#: ``hidden_act`` spellings → the experts' activation
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
#: DeepSeek's grouped top-k methods
GROUPED_TOPK = ("group_limited_greedy", "noaux_tc")
#: the fields that may give the number of routed experts, in the order they are looked for
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")


def _routed(name: str):
    return property(lambda self: getattr(self.routing, name),
                    doc=f"``routing.{name}`` (:class:`~wna16_jax.routing.MoERouting`)")


@dataclasses.dataclass(frozen=True)
class MoEModelConfig:
    """The MoE-relevant facts of a model's ``config.json``: the layer's sizes, how it routes
    (``routing``, a checked :class:`~wna16_jax.routing.MoERouting`; its fields read here too:
    ``config.top_k`` is ``config.routing.top_k``) and its shared experts."""

    model_type: str
    num_experts: int
    hidden_size: int
    moe_intermediate_size: int
    routing: MoERouting
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int | None = None

    #: the config.json keys the sizes came from (for messages)
    num_experts_field: str = "num_experts"
    hidden_size_field: str = "hidden_size"
    intermediate_size_field: str = "moe_intermediate_size"

    top_k = _routed("top_k")
    renormalize = _routed("renormalize")
    scoring_func = _routed("scoring_func")
    num_expert_group = _routed("num_expert_group")
    topk_group = _routed("topk_group")
    routed_scaling_factor = _routed("routed_scaling_factor")
    activation = _routed("activation")
    grouped = _routed("grouped")

    def __post_init__(self):
        if not isinstance(self.routing, MoERouting):
            raise ConfigError(f"routing: expected a MoERouting, got {type(self.routing).__name__}")
        self.routing.check_experts(self.num_experts)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], where: str = "config.json") -> "MoEModelConfig":
        return cls.from_fields(Fields(config, where))

    @classmethod
    def from_fields(cls, f: Fields) -> "MoEModelConfig":
        """From the fields of a ``config.json`` (see the module doc)."""
        mt = f.string("model_type", "unknown")
        e_key = f.first(*EXPERT_FIELDS)
        if e_key is None:
            raise ConfigError(f"{f.where}: none of the fields {EXPERT_FIELDS} is present (model_type {mt!r})")
        e = f.integer(e_key, low=1, high=MAX_EXPERTS)
        i_key = f.first("moe_intermediate_size", "intermediate_size") or "moe_intermediate_size"
        shared_i = f.integer("shared_expert_intermediate_size", None, low=1, high=MAX_SIZE)
        n_shared = f.integer("n_shared_experts", 0, low=0, high=MAX_EXPERTS) or (1 if shared_i else 0)
        act = f.string("hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise UnsupportedError(f"{f.where}: hidden_act {act!r} is not supported (the experts' activations: "
                                   f"{sorted(ACTIVATIONS)})")
        routing = MoERouting(top_k=f.integer("num_experts_per_tok", low=1, high=e),
                             renormalize=f.flag("norm_topk_prob", mt == "mixtral" or mt.startswith("qwen3")),
                             scoring_func=f.string("scoring_func", "softmax", choices=("softmax", "sigmoid")),
                             **_groups(f, e), routed_scaling_factor=f.number("routed_scaling_factor", 1.0, above=0.0),
                             activation=ACTIVATIONS[act])
        try:
            return cls(model_type=mt, num_experts=e, hidden_size=f.integer("hidden_size", low=1, high=MAX_SIZE),
                       moe_intermediate_size=f.integer(i_key, low=1, high=MAX_SIZE), routing=routing,
                       num_shared_experts=n_shared, shared_expert_intermediate_size=shared_i, num_experts_field=e_key,
                       hidden_size_field="hidden_size", intermediate_size_field=i_key)
        except ConfigError as ex:                      # top_k against the kept groups' experts
            raise ConfigError(f"{f.where}: {ex}") from None


def _groups(f: Fields, num_experts: int) -> dict:
    """DeepSeek's expert groups (``n_group`` of which ``topk_group`` are searched) where the
    ``topk_method`` is grouped, else none."""
    method = f.string("topk_method", None)
    if method not in GROUPED_TOPK:
        return dict(num_expert_group=None, topk_group=None)
    n_group = f.integer("n_group", None, low=1, high=num_experts)
    topk_group = f.integer("topk_group", None, low=1, high=n_group or num_experts)
    if n_group and num_experts % n_group:
        raise f.fail("n_group", f"must divide the number of experts ({num_experts})")
    return dict(num_expert_group=n_group, topk_group=topk_group)


__all__ = ["MoEModelConfig", "ACTIVATIONS", "EXPERT_FIELDS", "GROUPED_TOPK", "MAX_EXPERTS", "MAX_SIZE"]
