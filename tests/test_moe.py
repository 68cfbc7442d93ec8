"""fused_moe on the XLA executor vs a per-token float64 loop, for every format × activation ×
routing mode × expert_map, every formulation, and ragged_dot as a cross-check."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference import dequant_checkpoint, fused_moe_ref
from wna16_jax import routing
from wna16_jax.checkpoint import Checkpoint
from wna16_jax.writers import random_moe_layer, write_checkpoint
from wna16_jax.errors import ConfigError, DTypeError, ShapeError, ValueRangeError
from wna16_jax.moe import ACTIVATIONS, FORMULATIONS, fused_moe, fused_moe_ragged_dot, shared_expert_moe
from wna16_jax.schemes import QuantScheme

FORMATS = {
    "awq_g32_bias": (QuantScheme("awq", 4, 32, True), True),
    "gptq4_g64_actorder_bias": (QuantScheme("gptq", 4, 64, False, True), True),
    "gptq8_channel": (QuantScheme("gptq", 8, -1, False), False),
    "gptq4_asym_v1": (QuantScheme("gptq", 4, 128, True), False),
    "ct4_asym_g32": (QuantScheme("compressed-tensors", 4, 32, True), False),
    "ct8_sym_g128": (QuantScheme("compressed-tensors", 8, 128, False), False),
}
E, H, I, T, K = 8, 128, 128, 7, 2
E_GLOBAL = 12


@pytest.fixture(scope="module", params=sorted(FORMATS))
def layer(request, tmp_path_factory):
    scheme, bias = FORMATS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    write_checkpoint(path, scheme, [random_moe_layer(np.random.default_rng(), E, H, I, bias=bias)])
    w = Checkpoint(path).load_layer(0).experts
    ref = dequant_checkpoint(w, scheme)
    b = (None, None) if w.w13_bias is None else (np.asarray(w.w13_bias, np.float64), np.asarray(w.w2_bias, np.float64))
    return w.to_jax(), ref, b


def _routings(rng, x, num_experts):
    router = jnp.asarray(rng.standard_normal((num_experts, H)) / np.sqrt(H), jnp.float32)
    logits = x @ router.T
    bias = jnp.asarray(rng.standard_normal(num_experts) * 0.1, jnp.float32)
    return {
        "softmax_renorm": routing.fused_topk(logits, K, renormalize=True),
        "sigmoid": routing.fused_topk(logits, K, renormalize=False, scoring_func="sigmoid"),
        "grouped": routing.grouped_topk(logits, K, renormalize=True, num_expert_group=4, topk_group=2,
                                        scoring_func="sigmoid", e_score_correction_bias=bias,
                                        routed_scaling_factor=2.5),
    }


def _all_outputs(x, tw, ids, w, expert_map):
    out = {}
    for form in FORMULATIONS:
        for act in ACTIVATIONS:
            out[form, act, False] = fused_moe(x, tw, ids, w, activation=act, formulation=form, expert_map=expert_map)
        out[form, "silu", True] = fused_moe(x, tw, ids, w, formulation=form, expert_map=expert_map,
                                            apply_router_weight_on_input=True)
    return out


_all_outputs_jit = jax.jit(_all_outputs)


def _close(got, ref, rtol):
    got = np.asarray(got, np.float64)
    assert np.isfinite(got).all()
    err = np.abs(got - ref).max()
    assert err <= rtol * np.abs(ref).max(), (err, np.abs(ref).max())


@pytest.mark.parametrize("with_map", [False, True])
def test_fused_moe_vs_float64(layer, with_map):
    w, (r13, r2), (b13, b2) = layer
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    expert_map = None
    n_route = E
    if with_map:
        n_route = E_GLOBAL
        local = rng.permutation(E_GLOBAL)[:E]            # global experts living on this shard
        em = np.full(E_GLOBAL, -1, np.int32)
        em[local] = np.arange(E)
        expert_map = jnp.asarray(em)
    for mode, (tw, ids) in _routings(rng, x, n_route).items():
        outs = _all_outputs_jit(x, tw, ids, w, expert_map)
        tw_np, ids_np = np.asarray(tw, np.float64), np.asarray(ids)
        refs = {}
        for (form, act, on_input), got in outs.items():
            key = (act, on_input)
            if key not in refs:
                refs[key] = fused_moe_ref(np.asarray(x), tw_np, ids_np, r13, r2, b13, b2, activation=act,
                                          on_input=on_input, expert_map=None if expert_map is None else np.asarray(expert_map))
            _close(got, refs[key], 2e-5)


def test_ragged_dot_cross_check(layer):
    w, _, _ = layer
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    tw, ids = routing.fused_topk(x @ jnp.asarray(rng.standard_normal((E, H)), jnp.float32).T, K, renormalize=True)
    a = jax.jit(fused_moe)(x, tw, ids, w)
    b = jax.jit(fused_moe_ragged_dot)(x, tw, ids, w)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()))


def test_bf16_activations(layer):
    w, (r13, r2), (b13, b2) = layer
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.bfloat16)
    tw, ids = routing.fused_topk(x.astype(jnp.float32) @ jnp.asarray(rng.standard_normal((E, H)), jnp.float32).T,
                                 K, renormalize=True)
    got = jax.jit(fused_moe)(x, tw, ids, w)
    assert got.dtype == jnp.bfloat16
    ref = fused_moe_ref(np.asarray(x.astype(jnp.float32)), np.asarray(tw), np.asarray(ids), r13, r2, b13, b2)
    _close(got.astype(jnp.float32), ref, 1e-2)        # bf16 output rounding: 2^-8 relative


def _small():
    scheme = QuantScheme("awq", 4, 32, True)
    import tempfile

    d = tempfile.mkdtemp()
    write_checkpoint(d, scheme, [random_moe_layer(np.random.default_rng(), 4, 64, 64)])
    return Checkpoint(d).load_layer(0).experts.to_jax()


def test_shared_expert_and_edge_cases():
    w = _small()
    x = jnp.ones((3, 64), jnp.float32)
    out = shared_expert_moe(x, w.take_experts(jnp.array([1])), gate=jnp.ones((1, 64)) * 0.01)
    assert out.shape == (3, 64) and np.isfinite(np.asarray(out)).all()
    # zero tokens
    z = fused_moe(jnp.zeros((0, 64)), jnp.zeros((0, 2)), jnp.zeros((0, 2), jnp.int32), w)
    assert z.shape == (0, 64)
    # an expert that gets no tokens, and a token whose slots are all off-shard
    em = jnp.array([0, 1, -1, -1, 2, 3], jnp.int32)
    out = fused_moe(jnp.ones((2, 64)), jnp.ones((2, 2)), jnp.array([[2, 3], [0, 4]], jnp.int32), w, expert_map=em)
    assert np.all(np.asarray(out[0]) == 0) and np.any(np.asarray(out[1]) != 0)


def test_out_of_range_ids():
    w = _small()
    x = jnp.ones((3, 64), jnp.float32)
    tw = jnp.ones((3, 2), jnp.float32)
    bad = jnp.array([[0, 1], [2, 9], [3, 0]], jnp.int32)
    with pytest.raises(ValueRangeError, match=r"topk_ids.*\[0, 4\).*9"):
        fused_moe(x, tw, bad, w)
    for form in FORMULATIONS:
        out = np.asarray(jax.jit(lambda a, b, c: fused_moe(a, b, c, w, formulation=form))(x, tw, bad))
        assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all(), form


@pytest.mark.parametrize("kwargs, exc, words", [
    (dict(x=jnp.ones((3, 32))), ShapeError, ["hidden_states", "64", "(3, 32)"]),
    (dict(x=jnp.ones((3, 64), jnp.int32)), DTypeError, ["hidden_states", "int32"]),
    (dict(ids=jnp.zeros((3, 3), jnp.int32)), ShapeError, ["topk_weights", "(3, 3)", "(3, 2)"]),
    (dict(ids=jnp.zeros((2, 2), jnp.int32)), ShapeError, ["topk_ids", "(3, k)", "(2, 2)"]),
    (dict(ids=jnp.zeros((3, 2), jnp.float32)), DTypeError, ["topk_ids", "float32"]),
    (dict(expert_map=jnp.zeros((2, 2), jnp.int32)), ShapeError, ["expert_map"]),
    (dict(expert_map=jnp.array([0, 1, 7], jnp.int32)), ValueRangeError, ["expert_map", "7"]),
    (dict(activation="relu"), ConfigError, ["activation", "relu"]),
    (dict(formulation="magic"), ConfigError, ["formulation", "magic"]),
    (dict(global_num_experts=6), ShapeError, ["global_num_experts", "6"]),
])
def test_bad_input(kwargs, exc, words):
    w = _small()
    x = kwargs.pop("x", jnp.ones((3, 64), jnp.float32))
    ids = kwargs.pop("ids", jnp.zeros((3, 2), jnp.int32))
    tw = jnp.ones((3, 2), jnp.float32)
    with pytest.raises(exc) as ei:
        fused_moe(x, tw, ids, w, **kwargs)
    for word in words:
        assert word in str(ei.value)


def test_inputs_not_mutated():
    w = _small()
    x = np.ones((3, 64), np.float32)
    tw = np.ones((3, 2), np.float32)
    ids = np.array([[0, 1], [2, 3], [1, 0]], np.int32)
    copies = [a.copy() for a in (x, tw, ids)]
    leaves = [np.asarray(l).copy() for l in jax.tree_util.tree_leaves(w)]
    fused_moe(x, tw, ids, w)
    for a, c in zip((x, tw, ids), copies):
        np.testing.assert_array_equal(a, c)
    for l, c in zip(jax.tree_util.tree_leaves(w), leaves):
        np.testing.assert_array_equal(np.asarray(l), c)


def test_batched_experts_forward(layer):
    """The batched-experts executor + routing's dispatch/combine equal the per-token reference."""
    from wna16_jax.moe import batched_experts_forward
    from wna16_jax.routing import combine_batched, dispatch_batched

    w, (r13, r2), (b13, b2) = layer
    rng = np.random.default_rng()
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    tw, ids = routing.fused_topk(x @ jnp.asarray(rng.standard_normal((E, H)), jnp.float32).T, K, renormalize=True)
    bt = dispatch_batched(x, ids, E, T)
    y = jax.jit(batched_experts_forward)(bt.hidden_states, bt.expert_num_tokens, w)
    got = combine_batched(y, bt, tw, T)
    ref = fused_moe_ref(np.asarray(x), np.asarray(tw), np.asarray(ids), r13, r2, b13, b2)
    _close(got, ref, 2e-5)
    with pytest.raises(ShapeError, match="batched_hidden"):
        batched_experts_forward(bt.hidden_states[:, :, :3], bt.expert_num_tokens, w)


# ----------------------------------------------------------------------------- compilation


def _fresh_layer(rng, e=5, h=64, i=32, scheme=QuantScheme("gptq", 4, 32, False)):
    """Random weights at sizes no other test here uses (compile counts start from zero) and their
    float64 dequantization."""
    from wna16_jax.writers import random_checkpoint_weights

    w = random_checkpoint_weights(rng, scheme, e, h, i, scale=0.05)
    return w.to_jax(), dequant_checkpoint(w, scheme)


def test_fused_moe_compiles_itself_with_static_options():
    """A plain call with string / bool / dtype options is compiled once and cached (no
    static_argnames boilerplate); a lambda or functools.partial under jax.jit gives the same bits;
    the concrete-value checks still run outside the compiled program."""
    import functools

    from wna16_jax.moe import _fused_moe_jit

    rng = np.random.default_rng()
    w, (r13, r2) = _fresh_layer(rng)
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((6, 5)), jnp.float32), K, renormalize=True)
    ref = fused_moe_ref(np.asarray(x), np.asarray(tw), np.asarray(ids), r13, r2, activation="gelu", on_input=True)
    opts = dict(activation="gelu", apply_router_weight_on_input=True, formulation="gather")
    n0 = _fused_moe_jit._cache_size()
    got = fused_moe(x, tw, ids, w, compute_dtype=jnp.float32, **opts)
    assert _fused_moe_jit._cache_size() == n0 + 1
    _close(got, ref, 2e-5)
    # the same options spelled differently (dtype objects, names) hit the same program
    for cdt in (np.float32, "float32", np.dtype("float32")):
        again = fused_moe(x, tw, ids, w, compute_dtype=cdt, **opts)
        np.testing.assert_array_equal(np.asarray(again), np.asarray(got))
    assert _fused_moe_jit._cache_size() == n0 + 1
    # jit of code that calls it: a closure or a partial; options stay static
    lam = jax.jit(lambda x, tw, ids, w: fused_moe(x, tw, ids, w, compute_dtype=jnp.float32, **opts))
    part = jax.jit(functools.partial(fused_moe, compute_dtype=jnp.float32, **opts))
    for f in (lam, part):
        np.testing.assert_array_equal(np.asarray(f(x, tw, ids, w)), np.asarray(got))
    # jax.jit(fused_moe) itself with default options; a str keyword of a jitted function is traced
    # by JAX (the documented limitation), hence the closure / partial above
    _close(jax.jit(fused_moe)(x, tw, ids, w), fused_moe_ref(np.asarray(x), np.asarray(tw), np.asarray(ids),
                                                               r13, r2), 2e-5)
    with pytest.raises(TypeError, match="str"):
        jax.jit(fused_moe)(x, tw, ids, w, activation="gelu")
    # the checks that need concrete ids still run on every plain call
    bad = ids.at[2, 0].set(5)
    with pytest.raises(ValueRangeError, match=r"topk_ids.*\[0, 5\)"):
        fused_moe(x, tw, bad, w, **opts)
    with pytest.raises(ConfigError, match="formulation"):
        fused_moe(x, tw, ids, w, formulation="magic")
    out = np.asarray(lam(x, tw, bad, w))                  # traced ids: NaN rows, never a plausible value
    assert np.isnan(out[2]).all() and np.isfinite(np.delete(out, 2, axis=0)).all()


def test_batched_and_shared_experts_compile_themselves():
    """batched_experts_forward and shared_expert_moe take their options without boilerplate,
    compiled once per shapes and options, against float64 references."""
    import functools

    from wna16_jax.moe import _batched_experts_jit, _shared_expert_jit, batched_experts_forward
    from wna16_jax.routing import combine_batched, dispatch_batched

    rng = np.random.default_rng()
    w, (r13, r2) = _fresh_layer(rng)
    t = 7
    x = jnp.asarray(rng.standard_normal((t, 64)), jnp.float32)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((t, 5)), jnp.float32), K, renormalize=True)
    bt = dispatch_batched(x, ids, 5, t)
    n0 = _batched_experts_jit._cache_size()
    y = batched_experts_forward(bt.hidden_states, bt.expert_num_tokens, w, activation="gelu_tanh",
                                compute_dtype=jnp.float32)
    y2 = batched_experts_forward(bt.hidden_states, bt.expert_num_tokens, w, activation="gelu_tanh",
                                 compute_dtype="float32")
    assert _batched_experts_jit._cache_size() == n0 + 1
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    y3 = jax.jit(functools.partial(batched_experts_forward, activation="gelu_tanh"))(
        bt.hidden_states, bt.expert_num_tokens, w)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y3))
    ref = fused_moe_ref(np.asarray(x), np.asarray(tw), np.asarray(ids), r13, r2, activation="gelu_tanh")
    _close(combine_batched(y, bt, tw, t), ref, 2e-5)
    # one shared expert (expert 3 of the layer) with a Qwen2-MoE sigmoid gate
    gate = (0.1 * rng.standard_normal((1, 64))).astype(np.float32)
    s0 = _shared_expert_jit._cache_size()
    shared = w.take_experts(jnp.array([3]))
    got = shared_expert_moe(x, shared, activation="gelu_tanh", gate=gate, formulation="dense")
    again = shared_expert_moe(x, shared, activation="gelu_tanh", gate=gate, formulation="dense")
    assert _shared_expert_jit._cache_size() == s0 + 1
    np.testing.assert_array_equal(np.asarray(got), np.asarray(again))
    one = np.ones((t, 1))
    sref = fused_moe_ref(np.asarray(x), one, np.zeros((t, 1), int), r13[3:4], r2[3:4], activation="gelu_tanh")
    sref = sref / (1.0 + np.exp(-(np.asarray(x, np.float64) @ gate.T.astype(np.float64))))
    _close(got, sref, 2e-5)
    with pytest.raises(TypeError):
        shared_expert_moe(x, shared, no_such_option=1)
