"""fused_moe_trainable: gradients w.r.t. hidden states, router weights and a router matrix
(through routing) through frozen quantized experts, against (a) jax.grad of a float32 dense
computation on the dequantized weights (tight) and (b) float64 numpy central differences
(directional derivative), for every activation, with and without bias / expert_map /
apply_router_weight_on_input. Fresh random data each run (the seed is in the failure message)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference import dequant_checkpoint, fused_moe_ref
from wna16_jax import routing
from wna16_jax.autodiff import fused_moe_trainable
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.moe import ACTIVATIONS, fused_moe
from wna16_jax.schemes import QuantScheme

E, H, I, T, K = 8, 64, 64, 12, 2
SCHEME = QuantScheme("gptq", 4, 32, False)
SCHEMES = {"awq4_g32": QuantScheme("awq", 4, 32, True),
           "ct8_g64": QuantScheme("compressed-tensors", 8, 64, False)}


def _seed():
    return int(np.random.SeedSequence().entropy % (2**63))


def _layer(rng, scheme, e, bias):
    w = random_checkpoint_weights(rng, scheme, e, H, I, scale=0.3 / np.sqrt(H) / (2 ** (scheme.bits - 1)) * 2)
    if bias:
        w = w.replace(w13_bias=(0.1 * rng.standard_normal((e, 2 * I))).astype(np.float16),
                                w2_bias=(0.1 * rng.standard_normal((e, H))).astype(np.float16))
    return w.to_jax()


def _dense_ref(x, tw, ids, w13, w2, b13, b2, act, expert_map, on_input):
    """float32 dense reference on the dequantized weights (plain jnp; jax.grad differentiates it)."""
    local = ids if expert_map is None else expert_map[ids]
    valid = (local >= 0).astype(jnp.float32)
    safe = jnp.maximum(local, 0)
    hp = jax.lax.Precision.HIGHEST
    h = jnp.einsum("th,tknh->tkn", x, w13[safe], precision=hp)
    if b13 is not None:
        h = h + b13[safe]
    if on_input:
        h = h * tw[..., None]
    y = jnp.einsum("tki,tkhi->tkh", ACTIVATIONS[act](h), w2[safe], precision=hp)
    if b2 is not None:
        y = y + b2[safe]
    scale = valid if on_input else tw * valid
    return jnp.einsum("tkh,tk->th", y, scale, precision=hp)


def _close(name, got, want, seed, rtol=2e-5):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), f"{name}: non-finite gradient (seed {seed})"
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert np.max(np.abs(want)) > 0, f"{name}: reference gradient is identically zero (seed {seed})"
    assert err < rtol, f"{name}: max error {err:.3g} relative to max |grad| (seed {seed})"


CASES = [
    # activation, bias, expert_map, on_input
    ("silu", False, False, False),
    ("silu", True, True, False),
    ("gelu", True, False, False),
    ("gelu", True, True, True),
    ("swigluoai", False, False, False),
    ("swigluoai", True, True, False),
]


@pytest.mark.parametrize("activation,bias,use_map,on_input", CASES)
def test_grads_match_dense_reference_and_float64_differences(activation, bias, use_map, on_input):
    seed = _seed()
    rng = np.random.default_rng(seed)
    e_global = E
    if use_map:
        e_local, emap = routing.determine_expert_map(2, 1, E)
        w = _layer(rng, SCHEME, e_local, bias)
        expert_map = jnp.asarray(emap)
    else:
        w = _layer(rng, SCHEME, E, bias)
        expert_map = None
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((T, e_global)), jnp.float32)
    tw, ids = routing.fused_topk(logits, K, renormalize=False)
    g = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w13, w2 = w.dequantize(jnp.float32)
    b13, b2 = (None, None) if not bias else (w.w13_bias.astype(jnp.float32), w.w2_bias.astype(jnp.float32))

    def loss_q(x, tw):
        return jnp.sum(fused_moe_trainable(x, tw, ids, w, activation=activation, expert_map=expert_map,
                                           apply_router_weight_on_input=on_input) * g)

    def loss_r(x, tw):
        return jnp.sum(_dense_ref(x, tw, ids, w13, w2, b13, b2, activation, expert_map, on_input) * g)

    gx, gw = jax.jit(jax.grad(loss_q, argnums=(0, 1)))(x, tw)
    rx, rw = jax.jit(jax.grad(loss_r, argnums=(0, 1)))(x, tw)
    _close("d/dx", gx, rx, seed)
    _close("d/dtopk_weights", gw, rw, seed)
    # float64 central differences of an independent numpy reference, along a random direction
    w13_64, w2_64 = dequant_checkpoint(jax.tree.map(np.asarray, w), SCHEME)
    b64 = (None, None) if not bias else (np.asarray(b13, np.float64), np.asarray(b2, np.float64))
    vx, vw = rng.standard_normal((T, H)), rng.standard_normal((T, K))
    x64, tw64, g64, ids64 = (np.asarray(a, np.float64) for a in (x, tw, g, ids))
    em = None if expert_map is None else np.asarray(expert_map)

    def f64(eps):
        out = fused_moe_ref(x64 + eps * vx, tw64 + eps * vw, ids64.astype(int), w13_64, w2_64, *b64,
                            activation=activation, on_input=on_input, expert_map=em)
        return float(np.sum(out * g64))

    eps = 1e-4
    fd = (f64(eps) - f64(-eps)) / (2 * eps)
    ad = float(np.sum(np.asarray(gx, np.float64) * vx) + np.sum(np.asarray(gw, np.float64) * vw))
    scale = float(np.sum(np.abs(np.asarray(gx) * vx)) + np.sum(np.abs(np.asarray(gw) * vw)))
    assert abs(fd - ad) <= 1e-5 * scale + 1e-6, (
        f"directional derivative: autodiff {ad}, float64 differences {fd} (seed {seed})")


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_router_gradient_through_routing(scheme):
    """d loss / d router through softmax top-k routing (renormalised) + quantized experts."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    w = _layer(rng, SCHEMES[scheme], E, bias=True)
    w13, w2 = w.dequantize(jnp.float32)
    b13, b2 = w.w13_bias.astype(jnp.float32), w.w2_bias.astype(jnp.float32)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    router = jnp.asarray(rng.standard_normal((E, H)) / np.sqrt(H), jnp.float32)
    g = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)

    def loss(router, x, use_q):
        logits = jnp.dot(x, router.T, precision=jax.lax.Precision.HIGHEST)
        tw, ids = routing.fused_topk(logits, K, renormalize=True)
        out = (fused_moe_trainable(x, tw, ids, w) if use_q
               else _dense_ref(x, tw, ids, w13, w2, b13, b2, "silu", None, False))
        return jnp.sum(out * g)

    gq = jax.jit(jax.grad(lambda r, x: loss(r, x, True), argnums=(0, 1)))(router, x)
    gr = jax.jit(jax.grad(lambda r, x: loss(r, x, False), argnums=(0, 1)))(router, x)
    _close("d/drouter", gq[0], gr[0], seed)
    _close("d/dx (with routing)", gq[1], gr[1], seed)


def test_experts_get_zero_gradient_and_bf16_inputs():
    seed = _seed()
    rng = np.random.default_rng(seed)
    w = _layer(rng, SCHEME, E, bias=True)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), K, renormalize=True)
    gw = jax.jit(jax.grad(lambda w, x: jnp.sum(fused_moe_trainable(x, tw, ids, w).astype(jnp.float32)),
                          argnums=(0, 1), allow_int=True))(w, x)
    for name in ("w13_scales", "w2_scales", "w13_bias", "w2_bias"):
        a = np.asarray(getattr(gw[0], name), np.float32)
        assert a.shape == getattr(w, name).shape and not np.any(a), name
    assert gw[1].dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(gw[1], np.float32)))
    assert np.any(np.asarray(gw[1], np.float32))


def _all_shapes(jaxpr):
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ())), getattr(v.aval, "dtype", None)
        for p in eqn.params.values():
            subs = p if isinstance(p, (list, tuple)) else [p]
            for s in subs:
                inner = getattr(s, "jaxpr", s)
                if hasattr(inner, "eqns"):
                    yield from _all_shapes(inner)


def test_backward_never_dequantizes_the_whole_layer():
    """No intermediate of the gradient program has the shape of all experts dequantized."""
    rng = np.random.default_rng(_seed())
    w = _layer(rng, SCHEME, E, bias=False)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), K, renormalize=True)
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, tw: jnp.sum(fused_moe_trainable(x, tw, ids, w)),
                                    argnums=(0, 1)))(x, tw)
    shapes = {s for s, dt in _all_shapes(jaxpr.jaxpr) if dt is not None and jnp.issubdtype(dt, jnp.floating)}
    assert (E, 2 * I, H) not in shapes and (E, H, I) not in shapes
    assert (1, 2 * I, H) in shapes          # one expert at a time


def test_grads_with_gather_and_dense_forward_formulations():
    seed = _seed()
    rng = np.random.default_rng(seed)
    w = _layer(rng, SCHEME, E, bias=False)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), K, renormalize=True)
    w13, w2 = w.dequantize(jnp.float32)
    want = jax.grad(lambda x: jnp.sum(_dense_ref(x, tw, ids, w13, w2, None, None, "silu", None, False) ** 2))(x)
    for form in ("gather", "dense", "blocked"):
        got = jax.jit(jax.grad(lambda x: jnp.sum(fused_moe_trainable(x, tw, ids, w, formulation=form) ** 2)))(x)
        _close(f"d/dx ({form})", got, want, seed)
    # the forward is fused_moe itself, bit for bit
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda x: fused_moe_trainable(x, tw, ids, w))(x)),
                                  np.asarray(jax.jit(lambda x: fused_moe(x, tw, ids, w))(x)))
