"""``fused_moe``: the WNA16 fused mixture-of-experts layer, and its XLA executor.

Semantics (``docs/moe-semantics.md`` §1.3–§1.4), for token ``t`` and its routed slots ``j``::

    h[t, j]  = x[t] @ W13[e]ᵀ (+ b13[e])             W13 = [gate; up], [2I, H]
    a[t, j]  = act(h[t, j])                         silu_and_mul / gelu_and_mul / swigluoai
    y[t, j]  = a[t, j] @ W2[e]ᵀ (+ b2[e])           W2 [H, I]
    out[t]   = Σ_j w[t, j] · y[t, j]

with ``e = topk_ids[t, j]`` mapped through ``expert_map`` (experts not on this shard, ``-1``,
contribute zero). With ``apply_router_weight_on_input`` the router weight scales ``h`` (the
GEMM1 output, as vLLM's kernels do) instead of ``y``.

The XLA executor dequantizes on the fly from whatever layout ``weights`` is in (every layout
decodes to :class:`~wna16_jax.weights.LogicalQuant`). Three formulations are implemented; which
one runs is chosen statically from the sizes (see :func:`choose_formulation` and
``benchmarks/RESULTS.md`` for the CPU measurements behind the rule):

* ``"gather"`` — per-token: gather the packed weights of each routed (token, slot) and
  dequantize just those. Work ∝ T·k; best when few tokens are routed.
* ``"dense"`` — all experts on all tokens, combined with a [T, E] routing matrix. Work ∝ E·T;
  simple, and fastest when tokens per expert is high and E is small.
* ``"blocked"`` — vLLM's schedule: sort (token, slot) pairs by expert into blocks of ``block_m``
  rows (``moe_align_block_size``), then per block dequantize its expert and run one small GEMM.
  Work ∝ T·k (+ padding); memory holds one expert at a time.

Which executor runs a call is the executor registry's choice (:mod:`wna16_jax.executors`,
``executor="auto"``): on an NVIDIA GPU the wgmma kernels' layout
(:class:`~wna16_jax.convert.wgmma.WgmmaWeights`, which the table prepares for 4-bit layers on
Hopper) runs on the Mosaic GPU wgmma kernels; the engine's tile layout
(:class:`~wna16_jax.convert.tiles.TileWeights`, prepared on other NVIDIA GPUs and for what the
wgmma kernels do not take: 8-bit codes, group sizes other than 128 and channelwise, the
batched-experts format) or vLLM's Marlin layout (re-laid per call) on the Triton-lowered
kernels; everything else on this XLA executor. An engine layout that falls back runs here with
an :class:`EngineFallbackWarning` that states why.

``jax.lax.ragged_dot`` is deliberately not the production path (on GPU stacks it lowers to a
padded dense dot, ``docs/jax-ecosystem.md`` §5); :func:`fused_moe_ragged_dot` keeps it as a
cross-check.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.activations import (ACTIVATIONS, SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT,  # noqa: F401 (re-exported)
                                        gelu_and_mul, gelu_tanh_and_mul, silu_and_mul, swigluoai_and_mul)
from pallas_kernels.align import vllm_block_m as default_block_m

from . import executors
from .errors import ConfigError, DTypeError, ShapeError, ValueRangeError, check_dtype
from .routing import moe_align_block_size
from .weights import LayerStack, at_layer

# --------------------------------------------------------------------------- activations


def check_activation(activation: str) -> Callable:
    if not isinstance(activation, str) or activation not in ACTIVATIONS:
        raise ConfigError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return ACTIVATIONS[activation]


# --------------------------------------------------------------------------- validation

FORMULATIONS = ("gather", "dense", "blocked")
#: the activation dtypes the fused MoE takes
FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def validate_moe_inputs(x, topk_weights, topk_ids, weights, expert_map, global_num_experts):
    validate = getattr(weights, "validate", None)
    if not callable(validate):
        raise ConfigError(f"weights: expected an experts pytree of this library (a loader or backend "
                          f"layout), got {type(weights).__name__}")
    validate()
    if getattr(x, "ndim", None) != 2:
        raise ShapeError(f"hidden_states: expected shape (T, H), got {tuple(getattr(x, 'shape', ()))}")
    check_dtype("hidden_states", x, FLOAT_DTYPES)
    t, h = x.shape
    if h != weights.hidden_size:
        raise ShapeError(f"hidden_states: expected hidden size {weights.hidden_size} (from the weights), "
                         f"got shape {tuple(x.shape)}")
    if getattr(topk_ids, "ndim", None) != 2 or topk_ids.shape[0] != t:
        raise ShapeError(f"topk_ids: expected shape ({t}, k), got {tuple(getattr(topk_ids, 'shape', ()))}")
    if not jnp.issubdtype(topk_ids.dtype, jnp.integer):
        raise DTypeError(f"topk_ids: expected an integer dtype, got {topk_ids.dtype}")
    if tuple(getattr(topk_weights, "shape", ())) != tuple(topk_ids.shape):
        raise ShapeError(f"topk_weights: expected shape {tuple(topk_ids.shape)} (as topk_ids), "
                         f"got {tuple(getattr(topk_weights, 'shape', ()))}")
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    e_local = weights.num_experts
    if expert_map is not None:
        if getattr(expert_map, "ndim", None) != 1:
            raise ShapeError(f"expert_map: expected shape (global_num_experts,), got "
                             f"{tuple(getattr(expert_map, 'shape', ()))}")
        if not jnp.issubdtype(expert_map.dtype, jnp.integer):
            raise DTypeError(f"expert_map: expected an integer dtype, got {expert_map.dtype}")
        if global_num_experts is None:
            global_num_experts = int(expert_map.shape[0])
        if expert_map.shape[0] != global_num_experts:
            raise ShapeError(f"expert_map: expected shape ({global_num_experts},), got {tuple(expert_map.shape)}")
        if _is_concrete(expert_map):
            em = np.asarray(expert_map)
            if em.size and (em.min() < -1 or em.max() >= e_local):
                raise ValueRangeError(f"expert_map: entries must be -1 or in [0, {e_local}), "
                                      f"got values in [{em.min()}, {em.max()}]")
    else:
        if global_num_experts is None:
            global_num_experts = e_local
        if global_num_experts != e_local:
            raise ShapeError(f"global_num_experts: {global_num_experts} differs from the {e_local} experts "
                             "in weights, and no expert_map says which are local")
    if _is_concrete(topk_ids) and topk_ids.size:
        ids = np.asarray(topk_ids)
        if ids.min() < 0 or ids.max() >= global_num_experts:
            raise ValueRangeError(f"topk_ids: expert ids must lie in [0, {global_num_experts}), "
                                  f"got values in [{ids.min()}, {ids.max()}]")
    return global_num_experts


# --------------------------------------------------------------------------- helpers


def _local_ids(topk_ids, expert_map, global_num_experts):
    """(local expert id, valid) per slot; out-of-range ids are flagged by ``bad``."""
    ids = topk_ids.astype(jnp.int32)
    bad = (ids < 0) | (ids >= global_num_experts)
    safe = jnp.clip(ids, 0, global_num_experts - 1)
    local = safe if expert_map is None else jnp.asarray(expert_map, jnp.int32)[safe]
    return local, (local >= 0) & ~bad, bad


def expert_biases(weights):
    """Biases in logical order (``[E, 2I]``, ``[E, H]``), undoing any layout permutation."""
    fn = getattr(weights, "decode_bias", None)
    got = fn() if fn is not None else None
    return got if got is not None else (None, None)


_EXACT = jax.lax.Precision.HIGHEST


def dot_f32(a, b, spec):
    # float32 operands mean float32 accuracy: without HIGHEST, GPUs run them as TF32 (~1e-3 error).
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32, precision=precision)


def expert_gemm1(weights, e, x_rows, cdt):
    """One expert's first GEMM: dequantize expert ``e`` (a traced scalar; ``-1`` reads expert 0,
    callers mask) and return ``(h = x_rows @ W13ᵀ + b13 [M, 2I] float32, w2 [H, I], b2 [H] | None)``."""
    one = weights.take_experts(jnp.maximum(e, 0)[None])
    w13, w2 = one.dequantize(cdt)
    b13, b2 = expert_biases(one)
    h = dot_f32(x_rows, w13[0], "mh,nh->mn")
    if b13 is not None:
        h = h + b13[0].astype(jnp.float32)
    return h, w2[0], None if b2 is None else b2[0], w13[0]


def expert_gemm2(a, w2, b2, cdt):
    """The second GEMM of one expert: ``a @ W2ᵀ + b2`` in float32."""
    y = dot_f32(a.astype(cdt), w2, "mi,hi->mh")
    return y if b2 is None else y + b2.astype(jnp.float32)


def choose_formulation(num_tokens: int, top_k: int, num_experts: int, platform: str | None = None) -> str:
    """Static choice of the XLA formulation, from the measurements in ``docs/journal/results-history.md``.

    CPU: the blocked schedule was fastest or tied at every measured size. Accelerators: one
    gather per routed pair while the pairs are no more than the experts, all experts densely
    while each expert sees at most 16 rows on average, the blocked schedule beyond that.
    """
    platform = platform or jax.default_backend()
    pairs = num_tokens * top_k
    if platform == "cpu":
        return "blocked"
    if pairs <= num_experts:
        return "gather"
    if pairs <= 16 * num_experts:
        return "dense"
    return "blocked"


# --------------------------------------------------------------------------- formulations


def _gather(x, tw, local, valid, weights, act, on_input, cdt, offset=0):
    t, k = local.shape
    flat = jnp.where(valid, local, 0).reshape(-1)
    w = weights.take_experts(flat + offset)
    w13, w2 = w.dequantize(cdt)                       # [T·k, 2I, H], [T·k, H, I]
    b13, b2 = expert_biases(w)
    xr = jnp.repeat(x.astype(cdt), k, axis=0)          # row t·k + j = x[t]
    h = dot_f32(xr, w13, "rh,rnh->rn")
    if b13 is not None:
        h = h + b13.astype(jnp.float32)
    twf = (tw.astype(jnp.float32) * valid).reshape(-1)
    if on_input:
        h = h * twf[:, None]
    a = act(h)
    y = dot_f32(a.astype(cdt), w2, "ri,rhi->rh")
    if b2 is not None:
        y = y + b2.astype(jnp.float32)
    if not on_input:
        y = y * twf[:, None]
    else:
        y = y * valid.reshape(-1)[:, None]
    return y.reshape(t, k, -1).sum(axis=1)


def _dense(x, tw, local, valid, weights, act, on_input, cdt):
    e = weights.num_experts
    w13, w2 = weights.dequantize(cdt)                  # [E, 2I, H], [E, H, I]
    b13, b2 = expert_biases(weights)
    h = dot_f32(x.astype(cdt), w13, "th,enh->ten")        # [T, E, 2I]
    if b13 is not None:
        h = h + b13.astype(jnp.float32)[None]
    onehot = (local[..., None] == jnp.arange(e)) & valid[..., None]   # [T, k, E]
    twf = tw.astype(jnp.float32)
    if on_input:
        # act(w·h) is not linear in w: evaluate per slot on the gathered expert row.
        hs = jnp.einsum("tke,ten->tkn", onehot.astype(jnp.float32), h, precision=_EXACT)
        a = act(hs * twf[..., None])                                       # [T, k, I]
        y = jnp.einsum("tki,ehi,tke->tkh", a.astype(cdt), w2, onehot.astype(cdt),
                       preferred_element_type=jnp.float32, precision=_EXACT)
        if b2 is not None:
            y = y + jnp.einsum("tke,eh->tkh", onehot.astype(jnp.float32), b2.astype(jnp.float32),
                               precision=_EXACT)
        return y.sum(axis=1)
    a = act(h)                                                             # [T, E, I]
    y = dot_f32(a.astype(cdt), w2, "tei,ehi->teh")
    if b2 is not None:
        y = y + b2.astype(jnp.float32)[None]
    r = jnp.einsum("tke,tk->te", onehot.astype(jnp.float32), twf, precision=_EXACT)   # routing matrix
    return jnp.einsum("teh,te->th", y, r, precision=_EXACT)


def _blocked(x, tw, topk_ids, weights, act, on_input, cdt, expert_map, global_num_experts, block_m, offset=0):
    t, k = topk_ids.shape
    aligned = moe_align_block_size(topk_ids.astype(jnp.int32), block_m, global_num_experts,
                                   expert_map, ignore_invalid_experts=True)
    ids = aligned.sorted_token_ids.reshape(-1, block_m)                    # [NB, BM]
    experts = aligned.expert_ids                                           # [NB]
    row_ok = ids < t * k
    flat = jnp.where(row_ok, ids, 0)
    twf = tw.astype(jnp.float32).reshape(-1)[flat] * row_ok               # [NB, BM]
    xb = x.astype(cdt)[flat // k]                                          # [NB, BM, H]

    def block(args):
        xr, e, wr, ok = args
        live = (e >= 0).astype(jnp.float32)
        h, w2, b2, _ = expert_gemm1(weights, jnp.maximum(e, 0) + offset, xr, cdt)
        if on_input:
            h = h * wr[:, None]
        y = expert_gemm2(act(h), w2, b2, cdt)
        scale = (ok if on_input else wr) * live
        return y * scale[:, None]

    yb = jax.lax.map(block, (xb, experts, twf, row_ok.astype(jnp.float32)))   # [NB, BM, H]
    tok = jnp.where(row_ok, flat // k, t)                                  # padding → dropped row t
    out = jax.ops.segment_sum(yb.reshape(-1, yb.shape[-1]), tok.reshape(-1), num_segments=t + 1)
    return out[:t]


# --------------------------------------------------------------------------- executors

class EngineFallbackWarning(UserWarning):
    """A layer the GPU engine would run went to the XLA executor; the message says why."""


_WARNED: set[str] = set()


def warn_fallback(weights, choice) -> None:
    """Warn once per reason (:class:`EngineFallbackWarning`) when ``choice`` sent an engine layout
    on an engine platform to the XLA executor."""
    if not executors.fallback_warning_applies(weights, choice):
        return            # not an engine layout on an engine platform: XLA is its executor
    reason = choice.reason
    if reason not in _WARNED:
        _WARNED.add(reason)
        import warnings

        warnings.warn(f"GPU engine not used, running the XLA executor: {reason}", EngineFallbackWarning,
                      stacklevel=3)


# --------------------------------------------------------------------------- public API


def _resolve_options(hidden_states, topk_weights, topk_ids, weights, *, activation: str = "silu",
                     apply_router_weight_on_input: bool = False, expert_map=None,
                     global_num_experts: int | None = None, formulation: str | None = None,
                     block_m: int | None = None, compute_dtype=None, executor: str = "auto"):
    """Validate one :func:`fused_moe` call and resolve its static options.

    Runs outside any compiled program, so the checks that need concrete values (``topk_ids`` and
    ``expert_map`` ranges) run whenever the arguments are concrete. Returns ``(options, reason)``:
    ``options`` the hashable static keyword arguments of :func:`_fused_moe_jit` (the executor
    resolved to the registry's name: ``"wgmma"``, ``"triton"`` or ``"xla"``; ``compute_dtype`` as a
    dtype name), ``choice`` the registry's :class:`~wna16_jax.executors.Choice` (with the reasons
    of the executors that refused).
    """
    check_activation(activation)
    weights = at_layer(weights)              # a stack of layers is checked and chosen for as its layer
    gne = validate_moe_inputs(hidden_states, topk_weights, topk_ids, weights, expert_map, global_num_experts)
    choice = executors.select(weights, hidden_states.dtype, executor=executor, formulation=formulation,
                              compute_dtype=compute_dtype)
    which = choice.executor.name
    if which == "xla" and formulation is not None and formulation not in FORMULATIONS:
        raise ConfigError(f"formulation: expected one of {FORMULATIONS}, got {formulation!r}")
    options = dict(activation=activation, apply_router_weight_on_input=bool(apply_router_weight_on_input),
                   global_num_experts=int(gne), formulation=formulation,
                   block_m=None if block_m is None else int(block_m),
                   compute_dtype=None if compute_dtype is None else jnp.dtype(compute_dtype).name,
                   executor=which)
    return options, choice


def _fused_moe_body(hidden_states, topk_weights, topk_ids, weights, expert_map, *, activation,
                    apply_router_weight_on_input, global_num_experts, formulation, block_m, compute_dtype,
                    executor):
    """The traced body of :func:`fused_moe` on validated inputs and resolved static options."""
    act = check_activation(activation)
    gne = global_num_experts
    t, k = topk_ids.shape
    ex = executors.BY_NAME[executor]
    if executor != "xla":
        return ex.run(hidden_states, topk_weights, topk_ids, weights if ex.reads_stacks else at_layer(weights),
                      expert_map, activation=activation,
                      apply_router_weight_on_input=apply_router_weight_on_input, global_num_experts=gne,
                      block_m=block_m)
    num_experts = jax.eval_shape(at_layer, weights).num_experts      # the layer's E, from shapes only
    if formulation is None:
        formulation = choose_formulation(t, k, num_experts)
    # The gather and blocked formulations take their experts straight from a stack of layers
    # (layer l's expert e is expert l·E + e of the stack seen as L·E experts): slicing the layer
    # out first would give XLA a whole layer to hoist out of the scan, or widen, for every layer.
    offset = 0
    if isinstance(weights, LayerStack) and formulation != "dense" and weights.has_expert_axis():
        weights, _, offset = weights.as_experts()
    else:
        weights = at_layer(weights)
    cdt = jnp.dtype(compute_dtype or jnp.float32)
    if t == 0:
        return jnp.zeros_like(hidden_states)
    local, valid, bad = _local_ids(topk_ids, expert_map, gne)
    x = jnp.asarray(hidden_states)
    if formulation == "gather":
        out = _gather(x, topk_weights, local, valid, weights, act, apply_router_weight_on_input, cdt, offset)
    elif formulation == "dense":
        out = _dense(x, topk_weights, local, valid, weights, act, apply_router_weight_on_input, cdt)
    else:
        bm = block_m or default_block_m(t, k, num_experts)
        ids = jnp.where(bad, 0, topk_ids.astype(jnp.int32))
        out = _blocked(x, topk_weights, ids, weights, act, apply_router_weight_on_input, cdt,
                       expert_map, gne, bm, offset)
    out = jnp.where(bad.any(axis=1)[:, None], jnp.nan, out)
    return out.astype(hidden_states.dtype)


#: The static (hashed, never traced) options of the compiled programs below.
STATIC_OPTIONS = ("activation", "apply_router_weight_on_input", "global_num_experts", "formulation",
                  "block_m", "compute_dtype", "executor")

#: :func:`fused_moe`'s compiled implementation: one program per (shapes, dtypes, weights layout,
#: static options), cached across calls. ``_fused_moe_jit._cache_size()`` counts its programs.
_fused_moe_jit = jax.jit(_fused_moe_body, static_argnames=STATIC_OPTIONS)


def fused_moe(
    hidden_states,
    topk_weights,
    topk_ids,
    weights,
    *,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    expert_map=None,
    global_num_experts: int | None = None,
    formulation: str | None = None,
    block_m: int | None = None,
    compute_dtype=None,
    executor: str = "auto",
):
    """Run one fused MoE layer on ``weights`` (any layout: loader or backend).

    ``hidden_states [T, H]`` fp16/bf16/fp32; ``topk_weights [T, k]`` and ``topk_ids [T, k]``
    from routing (global expert ids); ``expert_map [global_num_experts]`` maps global ids to
    local indices or -1. Returns ``[T, H]`` in ``hidden_states.dtype``.

    Out-of-range ``topk_ids`` raise :class:`ValueRangeError` when the ids are concrete; under
    ``jax.jit`` they cannot be checked, and the affected tokens' outputs are NaN (never a
    silently plausible value).

    ``executor``: ``"auto"`` runs the first executor of the registry that supports the call
    (:func:`wna16_jax.executors.select`: the wgmma engine, the Triton-lowered engine, XLA) — with
    an :class:`EngineFallbackWarning` naming the reasons when an engine layout on a GPU falls back;
    ``"pallas"`` one of the engines (:class:`UnsupportedError` with every reason if none can), or
    one executor by name (``"wgmma"``, ``"triton"``, ``"xla"``).
    ``formulation`` (``"gather"``, ``"dense"``, ``"blocked"``, XLA executor) overrides the static
    choice; ``compute_dtype`` (XLA executor) defaults to float32 (dequantization is exact in float32).

    **Compilation.** ``fused_moe`` is already compiled: it validates its arguments in Python, then
    runs a module-level ``jax.jit`` program whose static arguments are the keyword options
    (``activation``, ``apply_router_weight_on_input``, ``global_num_experts``, ``formulation``,
    ``block_m``, ``compute_dtype``, the resolved ``executor``). A plain call
    ``fused_moe(x, tw, ids, w, activation="gelu")`` compiles once per input shapes, dtypes, weight
    layout and options, and reuses that program afterwards; there is nothing to wrap. Every new
    token count ``T`` is a new shape, hence a new program: for a serving loop see
    :mod:`wna16_jax.serving`, which pads ``T`` into a few buckets. Called inside your own
    ``jax.jit`` (or ``vmap``, ``grad``, ``shard_map``), it traces into the enclosing program.

    To jit code that calls it, close over the options::

        jax.jit(lambda x, tw, ids, w: fused_moe(x, tw, ids, w, activation="gelu"))
        jax.jit(functools.partial(fused_moe, activation="gelu"))

    ``jax.jit(fused_moe)(x, tw, ids, w)`` works with the default options, but
    ``jax.jit(fused_moe)(..., activation="gelu")`` cannot: ``jax.jit`` traces every argument of
    the function it wraps, keyword arguments included, and a string is not an array (JAX raises a
    ``TypeError`` before ``fused_moe`` runs). Under an enclosing trace the range checks of
    ``topk_ids`` cannot run (see above).
    """
    options, choice = _resolve_options(
        hidden_states, topk_weights, topk_ids, weights, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input, expert_map=expert_map,
        global_num_experts=global_num_experts, formulation=formulation, block_m=block_m,
        compute_dtype=compute_dtype, executor=executor)
    if choice.refused:
        warn_fallback(at_layer(weights), choice)
    return _fused_moe_jit(hidden_states, topk_weights, topk_ids, weights, expert_map, **options)


def fused_moe_ragged_dot(hidden_states, topk_weights, topk_ids, weights, *, activation="silu",
                         expert_map=None, global_num_experts=None, compute_dtype=None):
    """Cross-check formulation on ``jax.lax.ragged_dot`` (sorted rows, all experts dequantized).

    Not the production path: XLA lowers ``ragged_dot`` to a padded dense dot on current GPU
    stacks. Router weights are applied after GEMM2.
    """
    act = check_activation(activation)
    gne = validate_moe_inputs(hidden_states, topk_weights, topk_ids, weights, expert_map, global_num_experts)
    cdt = jnp.dtype(compute_dtype or jnp.float32)
    t, k = topk_ids.shape
    e = weights.num_experts
    local, valid, _ = _local_ids(topk_ids, expert_map, gne)
    key = jnp.where(valid, local, e).reshape(-1)                      # invalid sorted last
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)
    xs = hidden_states.astype(cdt)[order // k]
    w13, w2 = weights.dequantize(cdt)
    b13, b2 = expert_biases(weights)
    prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    h = jax.lax.ragged_dot(xs, jnp.swapaxes(w13, 1, 2), sizes, preferred_element_type=jnp.float32,
                           precision=prec)
    se = jnp.minimum(key[order], e - 1)
    if b13 is not None:
        h = h + b13.astype(jnp.float32)[se]
    y = jax.lax.ragged_dot(act(h).astype(cdt), jnp.swapaxes(w2, 1, 2), sizes,
                           preferred_element_type=jnp.float32, precision=prec)
    if b2 is not None:
        y = y + b2.astype(jnp.float32)[se]
    wts = (topk_weights.astype(jnp.float32) * valid).reshape(-1)[order]
    out = jax.ops.segment_sum(y * wts[:, None], order // k, num_segments=t)
    return out.astype(hidden_states.dtype)


def _batched_experts_body(batched_hidden, expert_num_tokens, weights, *, activation, compute_dtype, executor):
    """The traced body of :func:`batched_experts_forward` (static options resolved)."""
    act = check_activation(activation)
    if executor != "xla":
        return executors.BY_NAME[executor].batched(batched_hidden, expert_num_tokens, weights, activation=activation)
    e, m, _ = batched_hidden.shape
    cdt = jnp.dtype(compute_dtype or jnp.float32)

    def one(args):
        xe, ei = args
        h, w2, b2, _ = expert_gemm1(weights, ei, xe.astype(cdt), cdt)
        return expert_gemm2(act(h), w2, b2, cdt)

    y = jax.lax.map(one, (batched_hidden, jnp.arange(e)))
    live = jnp.arange(m)[None, :] < expert_num_tokens[:, None]
    return jnp.where(live[..., None], y, 0.0)


_batched_experts_jit = jax.jit(_batched_experts_body, static_argnames=("activation", "compute_dtype", "executor"))


def batched_experts_forward(batched_hidden, expert_num_tokens, weights, *, activation="silu",
                            compute_dtype=None, executor: str = "auto"):
    """The batched-experts executor (vLLM's BatchedExperts format, docs/moe-semantics.md §2.8).

    ``batched_hidden [E, M, H]`` holds up to ``M`` rows per local expert, of which the first
    ``expert_num_tokens[e]`` are valid. Returns ``[E, M, H]`` float32 expert outputs (invalid rows
    zero), without router weights: weighting and the top-k sum happen in
    :func:`wna16_jax.routing.combine_batched`. ``executor`` as in :func:`fused_moe` (on an NVIDIA
    GPU, BATCHED_MARLIN layers run on the Pallas engine).

    Compiled like :func:`fused_moe`: the checks run in Python, then a cached ``jax.jit`` program
    with ``activation``, ``compute_dtype`` and the resolved executor static. ``M`` is fixed by the
    caller (``max_tokens_per_expert`` of :func:`~wna16_jax.routing.dispatch_batched`), so a fixed
    ``M`` compiles one program per layer whatever the token count.
    """
    check_activation(activation)
    if getattr(batched_hidden, "ndim", None) != 3:
        raise ShapeError(f"batched_hidden: expected shape (E, M, H), got {tuple(getattr(batched_hidden, 'shape', ()))}")
    e, m, h = batched_hidden.shape
    if e != weights.num_experts or h != weights.hidden_size:
        raise ShapeError(f"batched_hidden: expected shape ({weights.num_experts}, M, {weights.hidden_size}), "
                         f"got {tuple(batched_hidden.shape)}")
    if tuple(expert_num_tokens.shape) != (e,):
        raise ShapeError(f"expert_num_tokens: expected shape ({e},), got {tuple(expert_num_tokens.shape)}")
    # the batched-experts format (BATCHED_MARLIN) has no wgmma form
    choice = executors.select(weights, batched_hidden.dtype, executor=executor, compute_dtype=compute_dtype,
                              among=(executors.TRITON, executors.XLA))
    if choice.refused:
        warn_fallback(weights, choice)
    return _batched_experts_jit(batched_hidden, expert_num_tokens, weights, activation=activation,
                                compute_dtype=None if compute_dtype is None else jnp.dtype(compute_dtype).name,
                                executor=choice.executor.name)


def _shared_expert_body(hidden_states, weights, gate, expert_map, **options):
    """The traced body of :func:`shared_expert_moe` (static options resolved)."""
    t = hidden_states.shape[0]
    ids = jnp.zeros((t, 1), jnp.int32)
    w = jnp.ones((t, 1), jnp.float32)
    out = _fused_moe_body(hidden_states, w, ids, weights, expert_map, **options)
    if gate is not None:
        g = jax.nn.sigmoid(hidden_states.astype(jnp.float32) @ jnp.asarray(gate, jnp.float32).T)
        out = (out.astype(jnp.float32) * g).astype(hidden_states.dtype)
    return out


_shared_expert_jit = jax.jit(_shared_expert_body, static_argnames=STATIC_OPTIONS)


def shared_expert_moe(hidden_states, weights, *, activation="silu", gate=None, **kw):
    """Run shared expert(s) stored as one expert (``E = 1``) on every token.

    ``gate [1, H]`` (Qwen2-MoE) multiplies the output by ``sigmoid(x @ gateᵀ)``. Other keyword
    arguments as in :func:`fused_moe`; compiled like it (one cached program per shapes and options).
    """
    t = hidden_states.shape[0] if getattr(hidden_states, "ndim", 0) >= 1 else 0
    ids = np.zeros((t, 1), np.int32)               # host arrays: checked without a device program
    w = np.ones((t, 1), np.float32)
    options, choice = _resolve_options(hidden_states, w, ids, weights, activation=activation, **kw)
    if choice.refused:
        warn_fallback(weights, choice)
    return _shared_expert_jit(hidden_states, weights, gate, kw.get("expert_map"), **options)


__all__ = ["fused_moe", "fused_moe_ragged_dot", "shared_expert_moe", "batched_experts_forward",
           "validate_moe_inputs", "expert_biases", "dot_f32", "check_activation", "expert_gemm1",
           "expert_gemm2", "ACTIVATIONS", "FORMULATIONS",
           "choose_formulation", "default_block_m", "STATIC_OPTIONS", "EngineFallbackWarning", "FLOAT_DTYPES",
           "warn_fallback"]
