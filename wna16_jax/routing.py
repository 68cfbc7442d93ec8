"""MoE routing, block alignment and the batched-experts layout, in pure JAX.

``docs/moe-semantics.md`` §1.1 (routing), §1.2 (alignment), §1.4 (EP expert maps) and
§2.8 (batched-experts form). Every function is pure and jit-able: sizes that shape arrays
(``topk``, ``block_size``, ``num_experts``, ``max_tokens_per_expert``, ...) must be static
Python ints, while ids, weights and expert maps may be traced.

Conventions:

* flat id ``i = t * k + j`` for token ``t`` and routing slot ``j`` (row-major ``topk_ids``);
* the sentinel of an :class:`AlignedBlocks` (padding rows) is ``num_valid_tokens``
  (``T * k`` for :func:`moe_align_block_size`, ``E * max_tokens`` for
  :func:`batched_moe_align_block_size`); kernels treat ``id >= num_valid_tokens`` as invalid;
* an ``expert_map`` is an int32 ``[E_global]`` array holding each global expert's local index
  on this rank, or ``-1`` when the expert lives elsewhere (see :func:`determine_expert_map`).

Out-of-range ``topk_ids`` (outside ``[0, num_experts)``): with concrete (non-traced) inputs the
functions raise :class:`ValueRangeError`; under ``jax.jit`` they cannot check values, so such
entries are treated like tokens of a non-local expert: they are never counted, never occupy a
row of any block or batch, never appear in ``sorted_token_ids`` / ``token_index``, and
contribute nothing on combine.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.align import (ALIGN_METHODS, COMPARE_MAX_PAIRS, COMPARE_MAX_WORK, RANK_MIN_PAIRS, align_pairs,
                                   max_padded_size)
from pallas_kernels.align import align_method as _align_method

from .errors import ConfigError, DTypeError, ShapeError, ValueRangeError, kernel_errors
from .fields import check_flag, check_int, check_number, check_string

__all__ = [
    "AlignedBlocks",
    "BatchedTokens",
    "MoERouting",
    "fused_topk",
    "grouped_topk",
    "moe_align_block_size",
    "align_method",
    "max_padded_size",
    "dispatch_batched",
    "combine_batched",
    "batched_overflow",
    "batched_moe_align_block_size",
    "determine_expert_map",
]

SCORING_FUNCS = ("softmax", "sigmoid")
EXPERT_MAP_STRATEGIES = ("linear", "round_robin")


# --------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------


def _shape_str(shape: Any) -> str:
    shape = tuple(shape)
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _as_array(name: str, x: Any):
    if x is None:
        raise ShapeError(f"{name}: expected an array, got None")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    return x


def _check_rank(name: str, x: Any, rank: int, what: str) -> None:
    if len(x.shape) != rank:
        raise ShapeError(
            f"{name}: expected a rank-{rank} tensor {what}, got shape {_shape_str(x.shape)}"
        )


def _check_shape(name: str, x: Any, expected: tuple) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ShapeError(
            f"{name}: expected shape {_shape_str(expected)}, got {_shape_str(x.shape)}"
        )


def _check_float(name: str, x: Any) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise DTypeError(
            f"{name}: expected a floating dtype (float16/bfloat16/float32), got {np.dtype(x.dtype)}"
        )


def _check_int(name: str, x: Any) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise DTypeError(f"{name}: expected an integer dtype (int32), got {np.dtype(x.dtype)}")


def _static_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{name}: expected an int, got {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise ConfigError(
            f"{name}: expected a static Python int, got {type(value).__name__} {value!r}"
        ) from None
    if v < minimum:
        raise ConfigError(f"{name}: expected an int >= {minimum}, got {v}")
    return v


def _check_scoring(scoring_func: str) -> None:
    if scoring_func not in SCORING_FUNCS:
        raise ConfigError(f"scoring_func: expected one of {SCORING_FUNCS}, got {scoring_func!r}")


def _concrete(x: Any) -> Optional[np.ndarray]:
    """``x`` as a numpy array when its values are known now; ``None`` under tracing."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def _check_ids_range(name: str, ids: Any, num_experts: int) -> None:
    c = _concrete(ids)
    if c is None or c.size == 0:
        return
    bad = (c < 0) | (c >= num_experts)
    if bad.any():
        pos = np.unravel_index(int(np.argmax(bad)), c.shape)
        raise ValueRangeError(
            f"{name}: values must lie in [0, {num_experts}) (num_experts={num_experts}), "
            f"got {int(c[pos])} at index {tuple(int(p) for p in pos)} "
            f"({int(bad.sum())} out-of-range value(s))"
        )


def _check_expert_map(expert_map: Any, num_experts: int):
    expert_map = _as_array("expert_map", expert_map)
    _check_int("expert_map", expert_map)
    _check_shape("expert_map", expert_map, (num_experts,))
    c = _concrete(expert_map)
    if c is not None and c.size:
        bad = (c < -1) | (c >= num_experts)
        if bad.any():
            e = int(np.argmax(bad))
            raise ValueRangeError(
                f"expert_map: values must be -1 or a local index in [0, {num_experts}), "
                f"got {int(c[e])} for global expert {e}"
            )
    return expert_map


# --------------------------------------------------------------------------------------------
# Routing (§1.1)
# --------------------------------------------------------------------------------------------


def _scores(gating_output, scoring_func: str):
    logits = jnp.asarray(gating_output).astype(jnp.float32)
    if scoring_func == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def _check_gating(gating_output: Any):
    gating_output = _as_array("gating_output", gating_output)
    _check_rank("gating_output", gating_output, 2, "[num_tokens, num_experts]")
    _check_float("gating_output", gating_output)
    return gating_output


def fused_topk(gating_output, topk: int, *, renormalize: bool, scoring_func: str = "softmax"):
    """Plain top-k routing (docs/moe-semantics.md §1.1 "Plain top-k").

    Scores all ``E`` logits of ``gating_output [T, E]`` with softmax or sigmoid (in float32),
    takes the ``topk`` largest (descending), and with ``renormalize`` rescales the ``topk``
    weights of each token to sum to 1.

    Returns ``(topk_weights float32 [T, topk], topk_ids int32 [T, topk])``.
    """
    gating_output = _check_gating(gating_output)
    _check_scoring(scoring_func)
    num_experts = gating_output.shape[1]
    topk = _static_int("topk", topk, 1)
    if topk > num_experts:
        raise ConfigError(f"topk: {topk} exceeds the number of experts {num_experts}")
    scores = _scores(gating_output, scoring_func)
    weights, ids = jax.lax.top_k(scores, topk)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(jnp.float32), ids.astype(jnp.int32)


def grouped_topk(
    gating_output,
    topk: int,
    *,
    renormalize: bool,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    e_score_correction_bias=None,
    routed_scaling_factor: float = 1.0,
):
    """Group-limited top-k routing with DeepSeek-V2/V3 semantics (docs/moe-semantics.md §1.1).

    1. ``scores`` = softmax/sigmoid of ``gating_output [T, E]`` in float32;
       ``choice = scores + e_score_correction_bias`` when a bias ``[E]`` is given (selection only).
    2. Experts form ``num_expert_group`` contiguous groups of ``E / num_expert_group``. A group's
       score is the sum of its top-2 ``choice`` values with a bias (its only value for groups
       of one expert), else the max of its scores. The best ``topk_group`` groups survive; the
       other experts are masked to -inf.
    3. The ``topk`` best surviving experts (by ``choice``) are chosen; their weights are the
       UNBIASED ``scores``, optionally renormalized to sum to 1, then multiplied by
       ``routed_scaling_factor``.

    Returns ``(topk_weights float32 [T, topk], topk_ids int32 [T, topk])``.
    """
    gating_output = _check_gating(gating_output)
    _check_scoring(scoring_func)
    num_tokens, num_experts = gating_output.shape
    topk = _static_int("topk", topk, 1)
    num_expert_group = _static_int("num_expert_group", num_expert_group, 1)
    topk_group = _static_int("topk_group", topk_group, 1)
    if num_experts % num_expert_group != 0:
        raise ConfigError(
            f"num_expert_group: the number of experts {num_experts} is not a multiple of "
            f"num_expert_group={num_expert_group}"
        )
    if topk_group > num_expert_group:
        raise ConfigError(
            f"topk_group: {topk_group} exceeds num_expert_group={num_expert_group}"
        )
    group_size = num_experts // num_expert_group
    if topk > topk_group * group_size:
        raise ConfigError(
            f"topk: {topk} exceeds the experts of the kept groups "
            f"(topk_group * E / num_expert_group = {topk_group} * {group_size} = "
            f"{topk_group * group_size})"
        )

    scores = _scores(gating_output, scoring_func)
    if e_score_correction_bias is not None:
        bias = _as_array("e_score_correction_bias", e_score_correction_bias)
        _check_float("e_score_correction_bias", bias)
        _check_shape("e_score_correction_bias", bias, (num_experts,))
        choice = scores + jnp.asarray(bias).astype(jnp.float32)[None, :]
        grouped = choice.reshape(num_tokens, num_expert_group, group_size)
        top2, _ = jax.lax.top_k(grouped, min(2, group_size))
        group_scores = jnp.sum(top2, axis=-1)
    else:
        choice = scores
        group_scores = jnp.max(
            scores.reshape(num_tokens, num_expert_group, group_size), axis=-1
        )

    _, kept_groups = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
    group_mask = (
        jnp.zeros((num_tokens, num_expert_group), dtype=bool)
        .at[jnp.arange(num_tokens)[:, None], kept_groups]
        .set(True)
    )
    expert_mask = jnp.repeat(group_mask, group_size, axis=1)
    masked = jnp.where(expert_mask, choice, -jnp.inf)
    _, ids = jax.lax.top_k(masked, topk)
    weights = jnp.take_along_axis(scores, ids, axis=1)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    # Always applied (x1.0 is exact), so a traced factor works too.
    weights = weights * jnp.asarray(routed_scaling_factor, jnp.float32)
    return weights.astype(jnp.float32), ids.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class MoERouting:
    """How a MoE layer routes its tokens and activates its experts (static, hashable).

    ``top_k`` experts per token (>= 1); ``scoring_func`` ``"softmax"`` or ``"sigmoid"``;
    ``renormalize``: the ``top_k`` weights rescaled to sum to 1; ``num_expert_group`` > 1 selects
    DeepSeek's group-limited top-k over the best ``topk_group`` (1 to ``num_expert_group``)
    groups (None or 1: plain top-k, and both are stored as None); ``routed_scaling_factor``
    (finite, > 0) multiplies the weights; ``activation`` is the experts' gated activation
    (:func:`wna16_jax.moe.check_activation`). Every field is checked on construction and raises
    :class:`ConfigError` naming it. :meth:`of` reads the same names from any config object.
    """

    top_k: int
    renormalize: bool = True
    scoring_func: str = "softmax"
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0
    activation: str = "silu"

    def __post_init__(self):
        from .moe import check_activation   # moe imports this module

        check_activation(self.activation)
        groups = None if self.num_expert_group is None else check_int("num_expert_group", self.num_expert_group,
                                                                       low=1)
        topk_group = self.topk_group
        if topk_group is not None or (groups or 1) > 1:
            topk_group = check_int("topk_group", topk_group, low=1, high=groups or 1)
        grouped = (groups or 1) > 1
        facts = dict(top_k=check_int("top_k", self.top_k, low=1),
                     renormalize=check_flag("renormalize", self.renormalize),
                     scoring_func=check_string("scoring_func", self.scoring_func, choices=SCORING_FUNCS),
                     num_expert_group=groups if grouped else None, topk_group=topk_group if grouped else None,
                     routed_scaling_factor=check_number("routed_scaling_factor", self.routed_scaling_factor,
                                                        above=0))
        for name, value in facts.items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, config: Any) -> "MoERouting":
        """The routing of ``config``: any object with this class's field names as attributes (the
        checkpoint's ``MoEModelConfig``, a decoder's config)."""
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if not hasattr(config, n)]
        if missing:
            raise ConfigError(f"config: expected an object with the attributes {names}, got "
                              f"{type(config).__name__} without {missing}")
        return cls(**{n: getattr(config, n) for n in names})

    @property
    def grouped(self) -> bool:
        return self.num_expert_group is not None

    def check_experts(self, num_experts: int) -> None:
        """Raise :class:`ConfigError` unless a layer of ``num_experts`` experts can route this way."""
        e, k = num_experts, self.top_k
        if k > e:
            raise ConfigError(f"top_k: expected 1 <= top_k <= {e} (the number of experts), got {k}")
        if self.grouped:
            g = self.num_expert_group
            if e % g:
                raise ConfigError(f"num_expert_group: the number of experts {e} is not a multiple of "
                                  f"num_expert_group={g}")
            if k > self.topk_group * (e // g):
                raise ConfigError(f"top_k: {k} exceeds the experts of the kept groups (topk_group * E / "
                                  f"num_expert_group = {self.topk_group * (e // g)})")

    def route(self, logits, e_score_correction_bias=None):
        """``(topk_weights [T, k] float32, topk_ids [T, k] int32)`` for router ``logits [T, E]``
        (:func:`grouped_topk` where grouped, else :func:`fused_topk` times the scaling factor).
        ``e_score_correction_bias [E]`` (DeepSeek-V3's selection bias) selects by the biased
        scores and weighs by the unbiased ones, grouped or not: without groups it is
        :func:`grouped_topk` over one group (Kimi-K2's ``n_group: 1``)."""
        if self.grouped or e_score_correction_bias is not None:
            return grouped_topk(logits, self.top_k, renormalize=self.renormalize,
                                num_expert_group=self.num_expert_group or 1, topk_group=self.topk_group or 1,
                                scoring_func=self.scoring_func, e_score_correction_bias=e_score_correction_bias,
                                routed_scaling_factor=self.routed_scaling_factor)
        w, ids = fused_topk(logits, self.top_k, renormalize=self.renormalize, scoring_func=self.scoring_func)
        if self.routed_scaling_factor != 1.0:
            w = w * jnp.float32(self.routed_scaling_factor)
        return w, ids


# --------------------------------------------------------------------------------------------
# Block alignment (§1.2)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AlignedBlocks:
    """Flat token ids sorted by expert and padded to whole blocks (docs/moe-semantics.md §1.2).

    * ``sorted_token_ids`` int32 ``[max_padded]``: expert ``e``'s rows occupy a run of
      ``ceil(count_e / block_size)`` blocks, ids in ascending order, padded with the sentinel
      ``num_valid_tokens``; everything after ``num_tokens_post_padded`` is sentinel too.
    * ``expert_ids`` int32 ``[max_padded // block_size]``: the expert of each block; ``-1``
      for unused trailing blocks and, in legacy EP mode, for blocks of non-local experts.
    * ``num_tokens_post_padded`` int32 ``[1]``: number of used blocks times ``block_size``.

    ``block_size`` and ``num_valid_tokens`` (the sentinel) are static pytree metadata.
    """

    sorted_token_ids: Any
    expert_ids: Any
    num_tokens_post_padded: Any
    block_size: int = dataclasses.field(default=1)
    num_valid_tokens: int = dataclasses.field(default=0)

    @property
    def max_padded(self) -> int:
        return int(self.sorted_token_ids.shape[0])

    @property
    def max_blocks(self) -> int:
        return int(self.expert_ids.shape[0])


jax.tree_util.register_dataclass(
    AlignedBlocks,
    data_fields=["sorted_token_ids", "expert_ids", "num_tokens_post_padded"],
    meta_fields=["block_size", "num_valid_tokens"],
)


def moe_align_block_size(
    topk_ids,
    block_size: int,
    num_experts: int,
    expert_map=None,
    *,
    ignore_invalid_experts: bool = False,
    method: str = "auto",
) -> AlignedBlocks:
    """Sort flat token ids by expert and pad each expert's run to whole blocks (docs/moe-semantics.md §1.2).

    ``topk_ids [T, k]`` (integer) holds global expert ids in ``[0, num_experts)``. Flat id
    ``t*k + j`` is listed under its expert, ascending within an expert (a stable order), and
    each expert's run is padded to a multiple of ``block_size`` with the sentinel ``T*k``.
    Sizes are static: ``len(sorted_token_ids) = max_padded_size(T*k, block_size, num_experts)``.

    EP (``expert_map [num_experts]`` int, local index or -1):

    * ``ignore_invalid_experts=False`` (legacy): every expert is counted and gets blocks; then
      ``expert_ids`` is mapped through ``expert_map``, so non-local blocks read -1.
    * ``ignore_invalid_experts=True``: tokens of non-local experts are never counted (they own
      no rows); experts are grouped and reported by LOCAL index, in ascending local order.

    Out-of-range ids raise :class:`ValueRangeError` when ``topk_ids`` is concrete; under jit
    they are skipped (never counted, never listed) in both modes.

    ``method`` (the same result either way): ``"sort"`` — one int32 sort; ``"compare"`` — all
    pairs of routed slots compared (``(T·k)²`` work, for up to about a thousand slots);
    ``"rank"`` — each slot's rank within its expert from per-chunk counts, and the padded list by
    one scatter; ``"auto"`` — comparing up to :data:`COMPARE_MAX_PAIRS` routed pairs (while the
    padded rows × pairs stay within :data:`COMPARE_MAX_WORK`), else ranking from
    :data:`RANK_MIN_PAIRS` pairs on and sorting below (``pallas_kernels.align``).
    """
    return _moe_align(topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts=ignore_invalid_experts,
                      method=method)[0]


def align_method(num_pairs: int, block_size: int, num_experts: int, method: str = "auto") -> str:
    """The method :func:`moe_align_block_size` runs for ``num_pairs`` routed pairs (``"auto"``
    resolved: ``"compare"``, ``"sort"`` or ``"rank"``)."""
    with kernel_errors():
        return _align_method(num_pairs, block_size, num_experts, method)


def _moe_align(topk_ids, block_size, num_experts, expert_map=None, *, ignore_invalid_experts=False, method="auto",
               with_rows=False):
    """:func:`moe_align_block_size` → ``(AlignedBlocks, rows)``: ``rows [T·k]`` the padded row of
    each routed slot (``max_padded`` where it has none) with ``with_rows`` and a method that has
    them (``"compare"``, ``"rank"``), else ``None``."""
    if method not in ALIGN_METHODS:
        raise ConfigError(f"method: expected one of {ALIGN_METHODS}, got {method!r}")
    topk_ids = _as_array("topk_ids", topk_ids)
    _check_rank("topk_ids", topk_ids, 2, "[num_tokens, topk]")
    _check_int("topk_ids", topk_ids)
    block_size = _static_int("block_size", block_size, 1)
    num_experts = _static_int("num_experts", num_experts, 1)
    num_tokens, topk = topk_ids.shape
    if topk > num_experts:
        raise ConfigError(f"topk: topk_ids has {topk} slots but num_experts is {num_experts}")
    _check_ids_range("topk_ids", topk_ids, num_experts)
    if expert_map is not None:
        expert_map = jnp.asarray(_check_expert_map(expert_map, num_experts)).astype(jnp.int32)
    sorted_ids, block_expert, post, rows = align_pairs(
        topk_ids, block_size, num_experts, expert_map, ignore_invalid_experts=ignore_invalid_experts, method=method)
    aligned = AlignedBlocks(
        sorted_token_ids=sorted_ids,
        expert_ids=block_expert,
        num_tokens_post_padded=post,
        block_size=block_size,
        num_valid_tokens=num_tokens * topk,
    )
    return aligned, rows if with_rows else None


# --------------------------------------------------------------------------------------------
# Batched-experts form (§2.8)
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BatchedTokens:
    """Tokens bucketed per local expert ("BatchedExperts" format, docs/moe-semantics.md §2.8).

    * ``hidden_states`` ``[E_local, max_tokens, H]``: row ``r`` of expert ``e`` holds the
      hidden state of the token whose flat id is ``token_index[e, r]``; unused rows are zero.
    * ``expert_num_tokens`` int32 ``[E_local]``: the TRUE number of routed slots per expert;
      it exceeds ``max_tokens`` when tokens were dropped (see :func:`batched_overflow`).
    * ``token_index`` int32 ``[E_local, max_tokens]``: flat id ``t*k + j`` per row, ascending
      within an expert, sentinel ``num_valid_tokens`` (= ``T*k``) for empty rows.

    ``top_k`` and ``num_valid_tokens`` are static pytree metadata.
    """

    hidden_states: Any
    expert_num_tokens: Any
    token_index: Any
    top_k: int = dataclasses.field(default=1)
    num_valid_tokens: int = dataclasses.field(default=0)

    @property
    def max_tokens_per_expert(self) -> int:
        return int(self.token_index.shape[1])

    @property
    def num_local_experts(self) -> int:
        return int(self.token_index.shape[0])


jax.tree_util.register_dataclass(
    BatchedTokens,
    data_fields=["hidden_states", "expert_num_tokens", "token_index"],
    meta_fields=["top_k", "num_valid_tokens"],
)


def dispatch_batched(
    hidden_states,
    topk_ids,
    num_experts: int,
    max_tokens_per_expert: int,
    expert_map=None,
    *,
    num_local_experts: Optional[int] = None,
) -> BatchedTokens:
    """Bucket tokens per local expert into ``[E_local, max_tokens_per_expert, H]``.

    Each routed slot ``(t, j)`` with a local expert ``e`` becomes one row of expert ``e``
    (rows in ascending flat id). Slots past an expert's capacity are dropped; with concrete
    inputs that raises :class:`ValueRangeError` instead, and under jit
    :func:`batched_overflow` reports it. Slots of non-local (or, under jit, out-of-range)
    experts get no row.

    ``E_local`` is ``num_experts`` without a map; with ``expert_map`` it is
    ``num_local_experts`` if given, else the number of non-negative entries of the (then
    necessarily concrete) map.
    """
    hidden_states = _as_array("hidden_states", hidden_states)
    _check_rank("hidden_states", hidden_states, 2, "[num_tokens, hidden_size]")
    _check_float("hidden_states", hidden_states)
    topk_ids = _as_array("topk_ids", topk_ids)
    _check_rank("topk_ids", topk_ids, 2, "[num_tokens, topk]")
    _check_int("topk_ids", topk_ids)
    num_experts = _static_int("num_experts", num_experts, 1)
    cap = _static_int("max_tokens_per_expert", max_tokens_per_expert, 1)
    num_tokens, topk = topk_ids.shape
    if hidden_states.shape[0] != num_tokens:
        raise ShapeError(
            f"hidden_states: expected {num_tokens} rows (topk_ids has shape "
            f"{_shape_str(topk_ids.shape)}), got shape {_shape_str(hidden_states.shape)}"
        )
    if topk > num_experts:
        raise ConfigError(f"topk: topk_ids has {topk} slots but num_experts is {num_experts}")
    _check_ids_range("topk_ids", topk_ids, num_experts)

    map_c = None
    if expert_map is None:
        e_local = num_experts if num_local_experts is None else num_local_experts
        e_local = _static_int("num_local_experts", e_local, 1)
        if e_local != num_experts:
            raise ConfigError(
                f"num_local_experts: {e_local} != num_experts={num_experts} without an expert_map"
            )
    else:
        expert_map = _check_expert_map(expert_map, num_experts)
        map_c = _concrete(expert_map)
        if num_local_experts is None:
            if map_c is None:
                raise ConfigError(
                    "num_local_experts: required when expert_map is traced (under jit)"
                )
            num_local_experts = int((map_c >= 0).sum())
        e_local = _static_int("num_local_experts", num_local_experts, 1)
        if map_c is not None and (map_c >= e_local).any():
            e = int(np.argmax(map_c >= e_local))
            raise ValueRangeError(
                f"expert_map: local index {int(map_c[e])} of global expert {e} is not below "
                f"num_local_experts={e_local}"
            )
        expert_map = jnp.asarray(expert_map).astype(jnp.int32)

    ids_c = _concrete(topk_ids)
    if ids_c is not None and (expert_map is None or map_c is not None):
        local_c = ids_c.reshape(-1) if map_c is None else map_c[ids_c.reshape(-1)]
        local_c = local_c[local_c >= 0]
        if local_c.size:
            counts_c = np.bincount(local_c, minlength=e_local)
            if counts_c.max() > cap:
                e = int(np.argmax(counts_c))
                raise ValueRangeError(
                    f"max_tokens_per_expert: local expert {e} receives {int(counts_c[e])} "
                    f"tokens, exceeding max_tokens_per_expert={cap}"
                )

    n = num_tokens * topk
    flat = jnp.asarray(topk_ids).reshape(-1).astype(jnp.int32)
    valid = (flat >= 0) & (flat < num_experts)
    local = flat if expert_map is None else expert_map[jnp.clip(flat, 0, num_experts - 1)]
    valid = valid & (local >= 0) & (local < e_local)
    key = jnp.where(valid, local, e_local).astype(jnp.int32)
    counts_ext = jnp.zeros((e_local + 1,), jnp.int32).at[key].add(1)
    raw_start_ext = jnp.cumsum(counts_ext) - counts_ext
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sk = key[order]
    rank = jnp.arange(n, dtype=jnp.int32) - raw_start_ext[sk]
    token_index = (
        jnp.full((e_local, cap), n, jnp.int32).at[sk, rank].set(order, mode="drop")
    )
    hidden = jnp.asarray(hidden_states)
    if num_tokens == 0:
        batched_hidden = jnp.zeros((e_local, cap, hidden.shape[1]), hidden.dtype)
    else:
        batched_hidden = jnp.take(
            hidden, token_index // topk, axis=0, mode="fill", fill_value=0
        )
    return BatchedTokens(
        hidden_states=batched_hidden,
        expert_num_tokens=counts_ext[:e_local],
        token_index=token_index,
        top_k=topk,
        num_valid_tokens=n,
    )


def batched_overflow(batched: BatchedTokens):
    """Bool scalar: did any expert receive more tokens than its capacity (rows dropped)?"""
    return jnp.any(batched.expert_num_tokens > batched.token_index.shape[1])


def combine_batched(expert_outputs, batched: BatchedTokens, topk_weights, num_tokens: int):
    """Weighted sum of per-expert outputs back to tokens: ``[T, H']`` float32.

    ``out[t] = sum over rows (e, r) holding flat id t*k+j of topk_weights[t, j] *
    expert_outputs[e, r]``. Slots routed to non-local experts (or dropped for capacity) add
    nothing; values in unused rows of ``expert_outputs`` are ignored (even NaN).
    """
    if not isinstance(batched, BatchedTokens):
        raise ConfigError(f"batched: expected a BatchedTokens, got {type(batched).__name__}")
    num_tokens = _static_int("num_tokens", num_tokens, 0)
    expert_outputs = _as_array("expert_outputs", expert_outputs)
    _check_rank("expert_outputs", expert_outputs, 3, "[E_local, max_tokens, H_out]")
    _check_float("expert_outputs", expert_outputs)
    idx_shape = tuple(batched.token_index.shape)
    if tuple(expert_outputs.shape[:2]) != idx_shape:
        raise ShapeError(
            f"expert_outputs: expected leading dims {_shape_str(idx_shape)} (batched.token_index), "
            f"got shape {_shape_str(expert_outputs.shape)}"
        )
    topk = batched.top_k
    topk_weights = _as_array("topk_weights", topk_weights)
    _check_float("topk_weights", topk_weights)
    _check_shape("topk_weights", topk_weights, (num_tokens, topk))
    if num_tokens * topk != batched.num_valid_tokens:
        raise ShapeError(
            f"num_tokens: {num_tokens} tokens x top_k {topk} != {batched.num_valid_tokens} "
            f"routed slots of the batched tokens"
        )
    n = batched.num_valid_tokens
    h_out = expert_outputs.shape[2]
    out = jnp.zeros((num_tokens, h_out), jnp.float32)
    if n == 0:
        return out
    idx = batched.token_index
    valid = (idx >= 0) & (idx < n)
    w = jnp.take(
        jnp.asarray(topk_weights).astype(jnp.float32).reshape(-1),
        idx,
        mode="fill",
        fill_value=0,
    )
    contrib = jnp.asarray(expert_outputs).astype(jnp.float32) * w[..., None]
    contrib = jnp.where(valid[..., None], contrib, 0.0)
    rows = jnp.where(valid, idx // topk, num_tokens)
    return out.at[rows.reshape(-1)].add(contrib.reshape(-1, h_out), mode="drop")


def batched_moe_align_block_size(
    max_tokens_per_expert: int, block_size: int, expert_num_tokens
) -> AlignedBlocks:
    """Block alignment of the batched form, viewed as ``E * max_tokens`` flat rows (top_k=1).

    Row ``e * max_tokens + r`` is valid when ``r < min(expert_num_tokens[e], max_tokens)``
    (counts past capacity are clamped: those tokens were dropped). Experts' valid rows are
    listed in order, each expert padded to whole blocks with the sentinel ``E * max_tokens``;
    ``expert_ids`` holds the expert per used block and -1 for the unused trailing blocks.
    Static length: ``E * ceil(max_tokens / block_size) * block_size``.
    """
    cap = _static_int("max_tokens_per_expert", max_tokens_per_expert, 1)
    block_size = _static_int("block_size", block_size, 1)
    expert_num_tokens = _as_array("expert_num_tokens", expert_num_tokens)
    _check_rank("expert_num_tokens", expert_num_tokens, 1, "[num_local_experts]")
    _check_int("expert_num_tokens", expert_num_tokens)
    c = _concrete(expert_num_tokens)
    if c is not None and c.size and (c < 0).any():
        e = int(np.argmax(c < 0))
        raise ValueRangeError(
            f"expert_num_tokens: counts must be >= 0, got {int(c[e])} for expert {e}"
        )
    e_local = expert_num_tokens.shape[0]
    n = e_local * cap
    max_padded = e_local * (-(-cap // block_size)) * block_size
    max_blocks = max_padded // block_size
    counts = jnp.clip(jnp.asarray(expert_num_tokens).astype(jnp.int32), 0, cap)
    if e_local == 0:
        return AlignedBlocks(
            jnp.zeros((0,), jnp.int32), jnp.zeros((0,), jnp.int32),
            jnp.zeros((1,), jnp.int32), block_size, 0,
        )
    nblocks = (counts + (block_size - 1)) // block_size
    padded = nblocks * block_size
    start = jnp.cumsum(padded) - padded
    r = jnp.arange(cap, dtype=jnp.int32)
    row_valid = r[None, :] < counts[:, None]
    dest = jnp.where(row_valid, start[:, None] + r[None, :], max_padded)
    row_id = jnp.arange(e_local, dtype=jnp.int32)[:, None] * cap + r[None, :]
    sorted_ids = (
        jnp.full((max_padded,), n, jnp.int32)
        .at[dest.reshape(-1)]
        .set(row_id.reshape(-1), mode="drop")
    )
    cum_blocks = jnp.cumsum(nblocks)
    total_blocks = cum_blocks[-1]
    b = jnp.arange(max_blocks, dtype=jnp.int32)
    block_expert = jnp.searchsorted(cum_blocks, b, side="right").astype(jnp.int32)
    block_expert = jnp.where(b < total_blocks, block_expert, -1)
    return AlignedBlocks(
        sorted_token_ids=sorted_ids,
        expert_ids=block_expert,
        num_tokens_post_padded=(total_blocks * block_size).astype(jnp.int32).reshape(1),
        block_size=block_size,
        num_valid_tokens=n,
    )


# --------------------------------------------------------------------------------------------
# Expert parallelism (§1.4)
# --------------------------------------------------------------------------------------------


def determine_expert_map(
    ep_size: int, ep_rank: int, global_num_experts: int, strategy: str = "linear"
):
    """Experts owned by EP rank ``ep_rank`` of ``ep_size``: ``(local_num_experts, expert_map)``.

    ``expert_map`` is np.int32 ``[global_num_experts]``: the local index of each global expert
    on this rank, -1 elsewhere. ``"linear"``: contiguous blocks of ``E // ep_size`` experts,
    the first ``E % ep_size`` ranks own one extra. ``"round_robin"``: experts
    ``ep_rank, ep_rank + ep_size, ...``. Requires ``global_num_experts >= ep_size`` so every
    rank owns at least one expert. With ``ep_size == 1`` the map is the identity.
    """
    ep_size = _static_int("ep_size", ep_size, 1)
    ep_rank = _static_int("ep_rank", ep_rank, 0)
    global_num_experts = _static_int("global_num_experts", global_num_experts, 1)
    if ep_rank >= ep_size:
        raise ConfigError(f"ep_rank: expected 0 <= ep_rank < ep_size={ep_size}, got {ep_rank}")
    if global_num_experts < ep_size:
        raise ConfigError(
            f"global_num_experts: {global_num_experts} experts cannot cover ep_size={ep_size} "
            f"ranks (every rank needs at least one expert)"
        )
    if strategy not in EXPERT_MAP_STRATEGIES:
        raise ConfigError(f"strategy: expected one of {EXPERT_MAP_STRATEGIES}, got {strategy!r}")
    expert_map = np.full((global_num_experts,), -1, dtype=np.int32)
    if strategy == "linear":
        base, rem = divmod(global_num_experts, ep_size)
        local = base + (1 if ep_rank < rem else 0)
        start = ep_rank * base + min(ep_rank, rem)
        owned = np.arange(start, start + local)
    else:
        owned = np.arange(ep_rank, global_num_experts, ep_size)
    expert_map[owned] = np.arange(owned.size, dtype=np.int32)
    return int(owned.size), expert_map
