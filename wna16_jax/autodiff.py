"""Gradients through frozen quantized experts: :func:`fused_moe_trainable`.

``fused_moe_trainable`` has the signature of :func:`wna16_jax.moe.fused_moe` and the same
forward (it calls it). Its ``jax.custom_vjp`` backward gives cotangents for the hidden states
and the router weights (``topk_weights``); the experts are frozen and get zero cotangents
(``float0`` for integer leaves), as do ``topk_ids`` and ``expert_map``.

Backward (for every routed row ``r = (t, j)`` on expert ``e`` with router weight ``w``)::

    h  = x[t] W13[e]ᵀ + b13[e]      (× w first with apply_router_weight_on_input)
    a  = act(h);   y = a W2[e]ᵀ + b2[e]
    dy = w · g[t]                   (g[t] with apply_router_weight_on_input)
    dw = <g[t], y>                  (<dh, h/w> with apply_router_weight_on_input)
    dh = act'(h)ᵀ (dy W2[e]);       dx[t] += dh W13[e]

It runs on vLLM's schedule: the (token, slot) rows are sorted by expert into blocks of
``block_m`` (:func:`wna16_jax.routing.moe_align_block_size`) and a ``lax.map`` over blocks
dequantizes one expert per block, recomputes the block's forward and multiplies by the
transposed dequantized weights. Nothing but one expert is ever dequantized at a time, and no
dequantized weight is saved between forward and backward (the residuals are the inputs and
the packed weights).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import executors
from . import moe as _moe
from .routing import moe_align_block_size
from .weights import at_layer
from .moe import check_activation, default_block_m, dot_f32, expert_gemm1, expert_gemm2, validate_moe_inputs


def _zero_cotangent(a):
    if a is None:
        return None
    a = jnp.asarray(a)
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


def _backward_blocked(g, x, tw, topk_ids, weights, expert_map, *, activation, on_input, gne,
                      block_m, cdt):
    """``(dx [T, H] float32, dtw [T, k] float32)`` for output cotangent ``g [T, H]``."""
    act = check_activation(activation)
    t, k = topk_ids.shape
    ids = topk_ids.astype(jnp.int32)
    ids = jnp.where((ids < 0) | (ids >= gne), 0, ids)        # such rows are NaN in the forward
    aligned = moe_align_block_size(ids, block_m, gne, expert_map, ignore_invalid_experts=True)
    rows = aligned.sorted_token_ids.reshape(-1, block_m)              # [NB, BM] flat (t·k + j)
    experts = aligned.expert_ids                                      # [NB] local expert or -1
    ok = rows < t * k
    flat = jnp.where(ok, rows, 0)
    tok = flat // k
    wb = tw.astype(jnp.float32).reshape(-1)[flat] * ok                # [NB, BM]
    xb = x.astype(cdt)[tok]                                           # [NB, BM, H]
    gb = g.astype(jnp.float32)[tok]                                   # [NB, BM, H]

    def block(args):
        xr, gr, e, wr, okr = args
        live = (e >= 0) & (okr > 0)                                   # [BM]
        h, w2, b2, w13 = expert_gemm1(weights, e, xr, cdt)            # one expert dequantized
        if on_input:
            hw = h * wr[:, None]
            a, act_vjp = jax.vjp(act, hw)
            dy = gr
        else:
            a, act_vjp = jax.vjp(act, h)
            dy = gr * wr[:, None]
        da = dot_f32(dy.astype(cdt), w2, "mh,hi->mi")
        (dhw,) = act_vjp(da)
        if on_input:
            dw = jnp.sum(dhw * h, axis=-1)
            dh = dhw * wr[:, None]
        else:
            y = expert_gemm2(a, w2, b2, cdt)
            dw = jnp.sum(gr * y, axis=-1)
            dh = dhw
        dx = dot_f32(dh.astype(cdt), w13, "mn,nh->mh")
        return jnp.where(live[:, None], dx, 0.0), jnp.where(live, dw, 0.0)

    dxb, dwb = jax.lax.map(block, (xb, gb, experts, wb, ok.astype(jnp.float32)))
    seg = jnp.where(ok, tok, t).reshape(-1)
    dx = jax.ops.segment_sum(dxb.reshape(-1, dxb.shape[-1]), seg, num_segments=t + 1)[:t]
    slot = jnp.where(ok, flat, t * k).reshape(-1)
    dtw = jax.ops.segment_sum(dwb.reshape(-1), slot, num_segments=t * k + 1)[:t * k].reshape(t, k)
    return dx, dtw


@functools.lru_cache(maxsize=None)
def _make(activation, on_input, gne, formulation, block_m, cdt_name, executor):
    cdt = None if cdt_name is None else jnp.dtype(cdt_name)

    def forward(x, tw, ids, weights, expert_map):
        return _moe.fused_moe(x, tw, ids, weights, activation=activation,
                              apply_router_weight_on_input=on_input, expert_map=expert_map,
                              global_num_experts=gne, formulation=formulation, block_m=block_m,
                              compute_dtype=cdt, executor=executor)

    f = jax.custom_vjp(forward)

    def fwd(x, tw, ids, weights, expert_map):
        return forward(x, tw, ids, weights, expert_map), (x, tw, ids, weights, expert_map)

    def bwd(res, g):
        x, tw, ids, stored, expert_map = res
        weights = at_layer(stored)               # a stack of layers: the backward reads its layer
        t, k = ids.shape
        bm = block_m or default_block_m(t, k, weights.num_experts)
        choice = executors.select(weights, x.dtype, executor=executor, formulation=formulation, compute_dtype=cdt)
        if choice.executor is not executors.XLA:   # the engine's transposed-access kernels (GPU)
            engine = choice.executor if isinstance(choice.executor, executors.TritonEngine) else executors.TRITON
            dx, dtw = engine.backward(g, x, tw, ids, weights, expert_map, activation=activation,
                                      apply_router_weight_on_input=on_input, global_num_experts=gne,
                                      block_m=block_m)
        else:
            dx, dtw = _backward_blocked(g, x, tw, ids, weights, expert_map, activation=activation,
                                        on_input=on_input, gne=gne, block_m=bm, cdt=cdt or jnp.float32)
        return (dx.astype(x.dtype), dtw.astype(tw.dtype), _zero_cotangent(ids),
                jax.tree.map(_zero_cotangent, stored), jax.tree.map(_zero_cotangent, expert_map))

    f.defvjp(fwd, bwd)
    # compiled like fused_moe: an eager call (or an eager ``jax.grad``) runs one cached program
    # per shapes and options; inside an enclosing trace it traces inline
    return jax.jit(f)


def fused_moe_trainable(hidden_states, topk_weights, topk_ids, weights, *, activation: str = "silu",
                        apply_router_weight_on_input: bool = False, expert_map=None,
                        global_num_experts: int | None = None, formulation: str | None = None,
                        block_m: int | None = None, compute_dtype=None, executor: str = "auto"):
    """:func:`wna16_jax.moe.fused_moe` with a memory-lean VJP (see the module docstring).

    ``executor`` as in :func:`~wna16_jax.moe.fused_moe`: where the forward runs on the Pallas
    engine, so does the backward (the Triton-lowered engine's transposed access to the packed tiles,
    :func:`pallas_kernels.fused_moe_tiles.fused_moe_tiles_bwd`; a wgmma layout is re-laid as tiles).

    Differentiable in ``hidden_states`` and ``topk_weights`` (hence in a router through the
    routing functions); the quantized ``weights`` are frozen (zero cotangents).

    Compiled like :func:`~wna16_jax.moe.fused_moe` (the options are static arguments of a cached
    ``jax.jit`` program, forward and backward); to jit code that calls it, close over the options
    (``jax.jit(functools.partial(fused_moe_trainable, activation="gelu"))``).
    """
    check_activation(activation)
    gne = validate_moe_inputs(hidden_states, topk_weights, topk_ids, at_layer(weights), expert_map,
                              global_num_experts)
    if topk_ids.shape[0] == 0:
        return _moe.fused_moe(hidden_states, topk_weights, topk_ids, weights, activation=activation,
                              expert_map=expert_map, global_num_experts=gne)
    cdt = None if compute_dtype is None else jnp.dtype(compute_dtype).name
    f = _make(activation, bool(apply_router_weight_on_input), int(gne), formulation, block_m, cdt, executor)
    em = None if expert_map is None else jnp.asarray(expert_map, jnp.int32)
    return f(hidden_states, topk_weights, topk_ids, weights, em)


@functools.lru_cache(maxsize=None)
def matmul_trainable(executor: str, gemm=None):
    """An engine's dense linear ``(x, w, bias) -> x Wᵀ + b`` (float32) with a VJP: the kernels have
    no differentiation rule, so the backward is ``dx = dy W`` on XLA, ``W`` (the layer's, for a
    stack) dequantized to the activations' 16-bit dtype as the kernel sees it, ``dy`` rounded to
    it, float32 accumulation; the frozen weights and the bias get zero cotangents. ``gemm``: the
    wgmma kernel's stand-in (its jnp reference, for checks on any device)."""
    ex = executors.BY_NAME[executor]
    extra = {} if gemm is None else {"gemm": gemm}

    def forward(x, w, bias):
        return ex.matmul(x, w, bias, None, **extra)

    f = jax.custom_vjp(forward)

    def fwd(x, w, bias):
        return forward(x, w, bias), (x, w, bias)

    def bwd(res, g):
        x, w, bias = res
        one = at_layer(w)
        cdt = one.scale.dtype
        wd = one.dequantize(cdt)[0]                                           # [N, K]
        dx = jnp.einsum("...n,nk->...k", g.astype(cdt), wd, preferred_element_type=jnp.float32)
        return dx.astype(x.dtype), jax.tree.map(_zero_cotangent, w), _zero_cotangent(bias)

    f.defvjp(fwd, bwd)
    return f


__all__ = ["fused_moe_trainable", "matmul_trainable"]
