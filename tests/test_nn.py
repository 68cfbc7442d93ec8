"""QuantizedMoE (Flax NNX): checkpoint loading, routing modes, shared experts, backend
dispatch, NNX state typing (quantized buffers are not Params), gradients, typed errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from reference import dequant_checkpoint, fused_moe_ref
from wna16_jax import routing
from wna16_jax.backends import Backend
from wna16_jax.checkpoint import Checkpoint
from wna16_jax.writers import random_moe_layer, write_checkpoint
from wna16_jax.errors import ConfigError, DTypeError, ShapeError, UnsupportedError, ValueRangeError, WNA16Error
from wna16_jax.nn import QuantizedExperts, QuantizedMoE, RouterBias
from wna16_jax.routing import MoERouting
from wna16_jax.schemes import QuantScheme
from wna16_jax.weights import LayerStack

E, H, I = 8, 64, 64
GPTQ = QuantScheme("gptq", 4, 32, False)


def _seed():
    return int(np.random.SeedSequence().entropy % (2**63))


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    rng = np.random.default_rng(_seed())
    p = tmp_path_factory.mktemp("mixtral")
    write_checkpoint(p, GPTQ, [random_moe_layer(rng, E, H, I), random_moe_layer(rng, E, H, I)], top_k=2)
    return p


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    rng = np.random.default_rng(_seed())
    p = tmp_path_factory.mktemp("deepseek")
    write_checkpoint(p, QuantScheme("awq", 4, 32, True),
                     [random_moe_layer(rng, E, H, I, shared_intermediate=64, score_bias=True)],
                     model_type="deepseek_v3", top_k=3, scoring_func="sigmoid", num_expert_group=4,
                     topk_group=2, routed_scaling_factor=2.5)
    return p


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    rng = np.random.default_rng(_seed())
    p = tmp_path_factory.mktemp("qwen2")
    write_checkpoint(p, GPTQ, [random_moe_layer(rng, E, H, I, shared_intermediate=64, shared_gate=True)
                               for _ in range(2)], model_type="qwen2_moe", top_k=2, renormalize=False)
    return p


def _logits(x2d, router):
    return jnp.einsum("th,eh->te", x2d.astype(jnp.float32), jnp.asarray(router, jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _reference(ckpt, x2d, tw, ids, index=0):
    layer = ckpt.load_layer(index)
    w13, w2 = dequant_checkpoint(layer.experts, ckpt.scheme)
    out = fused_moe_ref(np.asarray(x2d), np.asarray(tw), np.asarray(ids), w13, w2)
    if layer.shared_experts is not None:
        s13, s2 = dequant_checkpoint(layer.shared_experts, ckpt.scheme)
        t = x2d.shape[0]
        s = fused_moe_ref(np.asarray(x2d), np.ones((t, 1)), np.zeros((t, 1), int), s13, s2)
        if layer.shared_expert_gate is not None:
            gate = np.asarray(layer.shared_expert_gate, np.float64)
            s = s / (1.0 + np.exp(-(np.asarray(x2d, np.float64) @ gate.T)))
        out = out + s
    return out


def _check(got, want, what):
    got = np.asarray(got, np.float64)
    assert np.all(np.isfinite(got)), what
    err = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert err < 2e-5, f"{what}: relative error {err:.3g}"


def test_mixtral_forward_batched_input_matches_float64(mixtral_dir):
    ckpt = Checkpoint(mixtral_dir)
    m = QuantizedMoE.from_checkpoint(mixtral_dir, 1, activation_dtype=jnp.float32)
    if jax.default_backend() == "cpu":
        assert m.backend == str(Backend.CPU)
    x = jnp.asarray(np.random.default_rng(_seed()).standard_normal((2, 5, H)), jnp.float32)
    y = nnx.jit(lambda m, x: m(x))(m, x)
    assert y.shape == (2, 5, H) and y.dtype == jnp.float32
    x2d = x.reshape(-1, H)
    router = ckpt.load_layer(1).router
    tw, ids = routing.fused_topk(_logits(x2d, router), 2, renormalize=True)
    layer = ckpt.load_layer(1)
    w13, w2 = dequant_checkpoint(layer.experts, ckpt.scheme)
    _check(y.reshape(-1, H), fused_moe_ref(np.asarray(x2d), np.asarray(tw), np.asarray(ids), w13, w2), "mixtral")
    # bf16 activations keep their dtype
    yb = nnx.jit(lambda m, x: m(x))(m, x.astype(jnp.bfloat16))
    assert yb.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(yb, np.float32)))


def test_deepseek_grouped_sigmoid_bias_scaling_shared(deepseek_dir):
    ckpt = Checkpoint(deepseek_dir)
    cfg = ckpt.model_config
    assert cfg.num_expert_group == 4 and cfg.topk_group == 2 and cfg.routed_scaling_factor == 2.5
    m = QuantizedMoE.from_checkpoint(ckpt, 0)
    assert isinstance(m.e_score_correction_bias, RouterBias) and m.shared_experts is not None
    x = jnp.asarray(np.random.default_rng(_seed()).standard_normal((9, H)), jnp.float32)
    y = nnx.jit(lambda m, x: m(x))(m, x)
    layer = ckpt.load_layer(0)
    tw, ids = routing.grouped_topk(_logits(x, layer.router), 3, renormalize=True, num_expert_group=4,
                                   topk_group=2, scoring_func="sigmoid",
                                   e_score_correction_bias=layer.e_score_correction_bias,
                                   routed_scaling_factor=2.5)
    _check(y, _reference(ckpt, x, tw, ids), "deepseek")


def test_qwen2_shared_gate_and_loader_layout(qwen2_dir):
    ckpt = Checkpoint(qwen2_dir)
    x = jnp.asarray(np.random.default_rng(_seed()).standard_normal((6, H)), jnp.float32)
    layer = ckpt.load_layer(0)
    tw, ids = routing.fused_topk(_logits(x, layer.router), 2, renormalize=False)
    want = _reference(ckpt, x, tw, ids)
    # the CPU row converts for the CPU only: forced on another device it is refused (tested elsewhere)
    for backend in (None, "loader") + (("cpu",) if jax.default_backend() == "cpu" else ()):
        m = QuantizedMoE.from_checkpoint(qwen2_dir, 0, backend, activation_dtype=jnp.float32)
        assert m.shared_expert_gate is not None
        _check(nnx.jit(lambda m, x: m(x))(m, x), want, f"qwen2 backend={backend}")


def test_state_typing_and_optimizer_skips_quantized_buffers(deepseek_dir):
    m = QuantizedMoE.from_checkpoint(deepseek_dir, 0)
    params = nnx.state(m, nnx.Param)
    assert set(params.keys()) == {"router"}
    q = nnx.state(m, QuantizedExperts)
    assert set(q.keys()) == {"experts", "shared_experts"}
    view = m.quantized_arrays()
    assert {"qvalue", "scale"} <= set(view["w13"]) and {"qvalue", "scale"} <= set(view["w2"])
    before = jax.tree.map(np.asarray, nnx.state(m, nnx.Not(nnx.Param)))
    opt = nnx.Optimizer(m, optax.sgd(0.1), wrt=nnx.Param)
    x = jnp.asarray(np.random.default_rng(_seed()).standard_normal((16, H)), jnp.float32)

    @nnx.jit
    def step(m, opt, x):
        loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x) - x) ** 2))(m)
        opt.update(m, g)
        return loss, g

    r0 = np.asarray(m.router[...])
    loss, g = step(m, opt, x)
    gr = np.asarray(g["router"][...])
    assert np.isfinite(float(loss)) and np.all(np.isfinite(gr)) and np.any(gr != 0)
    assert not np.array_equal(np.asarray(m.router[...]), r0)
    after = jax.tree.map(np.asarray, nnx.state(m, nnx.Not(nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, before, after)


def test_router_gradient_matches_dense_reference(mixtral_dir):
    ckpt = Checkpoint(mixtral_dir)
    layer = ckpt.load_layer(0)
    m = QuantizedMoE.from_checkpoint(ckpt, 0)
    w13, w2 = (jnp.asarray(a, jnp.float32) for a in dequant_checkpoint(layer.experts, ckpt.scheme))
    x = jnp.asarray(np.random.default_rng(_seed()).standard_normal((10, H)), jnp.float32)

    def dense(router, x):
        tw, ids = routing.fused_topk(_logits(x, router), 2, renormalize=True)
        hp = jax.lax.Precision.HIGHEST
        h = jnp.einsum("th,tknh->tkn", x, w13[ids], precision=hp)
        y = jnp.einsum("tki,tkhi->tkh", jax.nn.silu(h[..., :I]) * h[..., I:], w2[ids], precision=hp)
        return jnp.sum(jnp.einsum("tkh,tk->th", y, tw, precision=hp) ** 2)

    want = jax.grad(dense)(jnp.asarray(layer.router, jnp.float32), x)
    got = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(m)["router"][...]
    err = np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(np.asarray(want)))
    assert np.all(np.isfinite(np.asarray(got))) and err < 2e-5, err


def test_linen_wrapper_matches_nnx_and_trains_only_the_router(mixtral_dir):
    from wna16_jax.nn import linen_quantized_moe

    ckpt = Checkpoint(mixtral_dir)
    layer = ckpt.load_layer(0)
    x = jnp.asarray(np.random.default_rng(_seed()).standard_normal((6, H)), jnp.float32)
    lin = linen_quantized_moe(layer.experts, layer.router, MoERouting(top_k=2))
    variables = jax.jit(lin.init)(jax.random.key(0), x)
    assert set(variables) == {"params", "QuantizedExperts"} and set(variables["params"]) == {"router"}
    want = QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2))(x)
    np.testing.assert_array_equal(np.asarray(jax.jit(lin.apply)(variables, x)), np.asarray(want))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(lin.apply({**variables, "params": p}, x) ** 2)))(variables["params"])
    g = np.asarray(grads["router"])
    assert g.shape == (E, H) and np.isfinite(g).all() and np.abs(g).max() > 0


def test_typed_errors(mixtral_dir):
    with pytest.raises(ValueRangeError, match=r"7 .*MoE layers are \[0, 1\]"):
        QuantizedMoE.from_checkpoint(mixtral_dir, 7)
    with pytest.raises(UnsupportedError, match="XPU was forced"):
        QuantizedMoE.from_checkpoint(mixtral_dir, 0, "xpu")
    layer = Checkpoint(mixtral_dir).load_layer(0)
    with pytest.raises(DTypeError, match="router: expected a float dtype.*got int32"):
        QuantizedMoE(layer.experts, np.zeros((E, H), np.int32), MoERouting(top_k=2))
    with pytest.raises(ShapeError, match=r"router: expected shape \(8, 64\), got \(8, 32\)"):
        QuantizedMoE(layer.experts, np.zeros((E, 32), np.float32), MoERouting(top_k=2))
    m = QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2))
    m.router.set_value(jnp.asarray(m.router[...], jnp.float16))
    with pytest.raises(DTypeError, match=r"router: expected dtype float32 .*got float16 with shape \(8, 64\)"):
        m(jnp.ones((3, H), jnp.float32))
    m = QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2))
    with pytest.raises(ShapeError, match=r"x: expected shape \(T, 64\).*got \(3, 65\)"):
        m(jnp.ones((3, 65), jnp.float32))
    with pytest.raises(WNA16Error, match=r"top_k: expected 1 <= top_k <= 8 .*got 9"):
        QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=9))
    for bad, shown in ((jnp.int8, "int8"), ("not-a-dtype", "'not-a-dtype'"), (3, "3")):
        with pytest.raises(DTypeError, match=rf"activation_dtype: expected None or a float dtype .*got .*{shown}"):
            QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2), activation_dtype=bad)


def test_jit_without_boilerplate(mixtral_dir):
    """The module's options (activation, formulation, top_k, ...) are static attributes:
    ``nnx.jit(model)(x)``, ``jax.jit`` of a function merging ``nnx.split``'s state, and a plain
    call all run without static_argnames, against float64; ``fused_moe_trainable`` compiles
    itself, and ``jax.jit`` of a partial of it differentiates."""
    import functools

    from wna16_jax.autodiff import fused_moe_trainable

    ckpt = Checkpoint(mixtral_dir)
    layer = ckpt.load_layer(0)
    m = QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2, activation="gelu_tanh"), formulation="gather")
    rng = np.random.default_rng(_seed())
    x = jnp.asarray(rng.standard_normal((2, 3, H)), jnp.float32)
    y = nnx.jit(m)(x)
    graphdef, state = nnx.split(m)
    y2 = jax.jit(lambda state, x: nnx.merge(graphdef, state)(x))(state, x)
    assert y.shape == (2, 3, H)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    x2d = x.reshape(-1, H)
    tw, ids = routing.fused_topk(_logits(x2d, layer.router), 2, renormalize=True)
    w13, w2 = dequant_checkpoint(layer.experts, ckpt.scheme)
    want = fused_moe_ref(np.asarray(x2d), np.asarray(tw), np.asarray(ids), w13, w2, activation="gelu_tanh")
    _check(y.reshape(-1, H), want, "nnx.jit(model)")
    # the plain (eager) call reaches the same compiled MoE program
    _check(m(x).reshape(-1, H), want, "model(x)")
    # fused_moe_trainable: a plain call with options, and jax.jit(grad) of a partial
    w = m.expert_weights()
    got = fused_moe_trainable(x2d, tw, ids, w, activation="gelu_tanh", formulation="gather")
    _check(got, want, "fused_moe_trainable")
    f = functools.partial(fused_moe_trainable, activation="gelu_tanh", formulation="gather")
    g = jax.jit(jax.grad(lambda x, tw: jnp.sum(f(x, tw, ids, w) ** 2), argnums=(0, 1)))(x2d, tw)
    assert all(np.isfinite(np.asarray(a)).all() and np.abs(np.asarray(a)).max() > 0 for a in g)


@pytest.mark.parametrize("formulation", ["gather", "dense", "blocked"])
def test_16bit_float_experts_run_in_16_bit(formulation):
    """16-bit float experts (a dequantized model's, or a checkpoint's 16-bit shared experts) under
    activations of their dtype run their GEMMs in that dtype with float32 accumulation, as a 16-bit
    model does: no float32 copy of an expert's weights appears in the program (the float32 path,
    for quantized experts, would widen each expert it reads), and the output matches the float64
    reference to bf16 rounding (the hidden activations are rounded to bf16 between the GEMMs)."""
    from reference import fused_moe_ref
    from wna16_jax.checkpoint import DenseWeights
    from wna16_jax.nn import float_compute_dtype

    rng = np.random.default_rng(_seed())
    e, i, h, t = 8, 64, 128, 6
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    experts = DenseWeights(w13, w2, hidden_size=h, intermediate_size=i)
    router = rng.standard_normal((e, h)).astype(np.float32)
    moe = QuantizedMoE(experts, router, MoERouting(top_k=2), formulation=formulation)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    assert float_compute_dtype(experts, jnp.bfloat16) == jnp.bfloat16
    assert float_compute_dtype(experts, jnp.float32) is None           # float32 activations: float32
    hlo = jax.jit(lambda x: moe(x)).lower(x).as_text()
    assert f"{2 * i}x{h}xbf16>" in hlo and f"{2 * i}x{h}xf32>" not in hlo and f"{h}x{i}xf32>" not in hlo
    y = np.asarray(jax.jit(lambda x: moe(x))(x), np.float64)
    tw, ids = moe.route(x)
    want = fused_moe_ref(np.asarray(x, np.float64), np.asarray(tw, np.float64), np.asarray(ids),
                         np.asarray(w13, np.float64), np.asarray(w2, np.float64))
    assert np.isfinite(y).all()
    err = np.abs(y - want).max() / np.abs(want).max()
    assert err < 2e-2, err


def _is_var(v):
    return isinstance(v, nnx.Variable)


def test_layers_bound_at_the_scan_boundary_match_each_layer(qwen2_dir):
    """Two layers' QuantizedExperts (routed and shared) stacked and bound as LayerStack at the
    scan's traced index, the rest of the state scanned over: each step is that layer's own output
    (against float64, and against the unstacked layer run alone)."""
    ckpt = Checkpoint(qwen2_dir)
    mods = [QuantizedMoE.from_checkpoint(ckpt, i, activation_dtype=jnp.float32) for i in range(2)]
    x = jnp.asarray(np.random.default_rng(_seed()).standard_normal((6, H)), jnp.float32)
    graphdef, q0, rest0 = nnx.split(mods[0], QuantizedExperts, ...)
    _, q1, rest1 = nnx.split(mods[1], QuantizedExperts, ...)
    stack = jax.tree.map(lambda a, b: jnp.stack([a, b]), q0, q1)
    rests = jax.tree.map(lambda a, b: jnp.stack([a, b]), rest0, rest1)

    @jax.jit
    def run(stack, rests, x):
        def body(carry, step):
            index, rest = step
            bound = jax.tree.map(lambda v: v.replace(LayerStack(v.get_value(), index)), stack, is_leaf=_is_var)
            return carry, nnx.merge(graphdef, bound, rest)(x)

        return jax.lax.scan(body, None, (jnp.arange(2, dtype=jnp.int32), rests))[1]

    ys = run(stack, rests, x)
    for i, m in enumerate(mods):
        layer = ckpt.load_layer(i)
        tw, ids = routing.fused_topk(_logits(x, layer.router), 2, renormalize=False)
        _check(ys[i], _reference(ckpt, x, tw, ids, i), f"scan step {i}")
        alone = np.asarray(nnx.jit(lambda m, x: m(x))(m, x), np.float64)
        np.testing.assert_allclose(np.asarray(ys[i], np.float64), alone, rtol=1e-6, atol=1e-6 * np.abs(alone).max())


def test_partly_bound_experts_are_refused(mixtral_dir):
    m = QuantizedMoE.from_checkpoint(mixtral_dir, 0)
    v = jax.tree.leaves(m.experts, is_leaf=_is_var)[0]
    v.set_value(LayerStack(jnp.stack([v.get_value()] * 2), jnp.int32(1)))
    with pytest.raises(ShapeError, match=r"experts: 1 of \d+ variables hold a LayerStack"):
        m.expert_weights()


def test_nan_or_inf_state_is_refused_in_eager_calls(qwen2_dir, deepseek_dir):
    """A router (set with ``[...] =`` or ``nnx.update``), score-correction bias or shared-expert
    gate holding NaN / Inf: an eager call raises naming it, and the module is left as it was."""
    x = jnp.asarray(np.random.default_rng(_seed()).standard_normal((3, H)), jnp.float32)
    m = QuantizedMoE.from_checkpoint(qwen2_dir, 0, activation_dtype=jnp.float32)
    good = np.asarray(m.router[...])
    bad = good.copy()
    bad[3, 5] = np.nan
    m.router[...] = jnp.asarray(bad)
    with pytest.raises(ValueRangeError, match=r"router: expected finite values, got 1 NaN or Inf .*\(3, 5\)"):
        m(x)
    with pytest.raises(ValueRangeError, match="router"):
        m.route(x)
    state = nnx.state(m, nnx.Param)
    state["router"].set_value(jnp.asarray(good))
    state["shared_expert_gate"].set_value(jnp.full((1, H), jnp.inf, jnp.float32))
    nnx.update(m, state)
    with pytest.raises(ValueRangeError, match=r"shared_expert_gate: expected finite values, got 64 NaN or Inf"):
        m(x)
    d = QuantizedMoE.from_checkpoint(deepseek_dir, 0)
    d.e_score_correction_bias[...] = d.e_score_correction_bias[...].at[2].set(-jnp.inf)
    with pytest.raises(ValueRangeError, match=r"e_score_correction_bias: .*index \(2,\)"):
        d(x)


def test_routing_argument_is_checked(mixtral_dir):
    layer = Checkpoint(mixtral_dir).load_layer(0)
    with pytest.raises(ConfigError, match=r"routing: expected a MoERouting, got dict \{'top_k': 2\}"):
        QuantizedMoE(layer.experts, layer.router, {"top_k": 2})
    with pytest.raises(ConfigError, match=r"num_expert_group: the number of experts 8 is not a multiple of .*=3"):
        QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2, num_expert_group=3, topk_group=1))
    with pytest.raises(WNA16Error, match=r"e_score_correction_bias: .*\(9,\)"):
        QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2),
                     e_score_correction_bias=np.zeros(E + 1, np.float32))


def test_selection_bias_without_groups(mixtral_dir):
    """A selection bias with ungrouped routing (Kimi-K2: noaux_tc with n_group 1) chooses by
    score + bias and weighs by the unbiased scores: a large bias on one expert puts it in every
    token's top-k, with its softmax weight, renormalized, as float64 computes it."""
    layer = Checkpoint(mixtral_dir).load_layer(0)
    bias = np.zeros(E, np.float32)
    bias[3] = 100.0
    m = QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2), e_score_correction_bias=bias)
    x = jnp.asarray(np.random.default_rng().standard_normal((5, layer.router.shape[1])), jnp.float32)
    w, ids = (np.asarray(a) for a in jax.jit(lambda m, x: m.route(x))(m, x))
    assert (ids == 3).any(axis=1).all()
    logits = np.asarray(x, np.float64) @ np.asarray(layer.router, np.float64).T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    chosen = np.take_along_axis(p, ids, 1)
    np.testing.assert_allclose(w, chosen / chosen.sum(1, keepdims=True), rtol=1e-5, atol=0)
    other = np.argsort(-(p + bias), 1)[:, :2]
    assert (np.sort(other, 1) == np.sort(ids, 1)).all()
    with pytest.raises(DTypeError, match="param_dtype: expected a float dtype, got 'nope'"):
        QuantizedMoE(layer.experts, layer.router, MoERouting(top_k=2), param_dtype="nope")
