"""DeepSeek-V2 / V3 decoders (multi-head latent attention, YaRN, grouped top-k routing) against
transformers and against a float64 numpy decoder written from the models' published semantics.

The checkpoints are the three of ``tests/fixtures/hf_deepseek/`` (``tools/hf_deepseek/``):
V2-Lite's form with YaRN (``mscale != mscale_all_dim``, so both the cos / sin factor and the
softmax-scale correction matter) and GPTQ act-order, V2's group-limited routing with AWQ, V3's
sigmoid / bias-corrected routing with AWQ. The numpy reference expands every head's keys and
values (``kv_b_proj`` applied to the latent, the published form), rotates DeepSeek's interleaved
pairs as complex numbers, derives YaRN's frequencies from the rotation counts, and routes with
the group-limited / bias-corrected top-k; the library caches the latent and absorbs
``kv_b_proj`` into the queries and outputs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from engine_helpers import gpu, needs_hopper
from wna16_jax.errors import ConfigError, MissingTensorError, UnsupportedError
from wna16_jax.models import load_model
from wna16_jax.models.config import DecoderConfig
from wna16_jax.models.decoder import LatentAttention
from wna16_jax.models.generation import Generator
from wna16_jax.models.synthetic import RandomModelSpec, write_random_model
from wna16_jax.schemes import QuantScheme

# The numpy reference and the library compute from the same dequantized weights in float64 /
# float32, so they agree to float32 rounding: the bound is 1e-5 of the largest logit (measured on
# the CPU: about 4e-7). A wrong rotary layout, a missing YaRN factor or a wrong routing rule moves
# the logits by 1e-2 or more of their scale (test_reference_sees_real_mistakes).
TOL = 1e-5

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf_deepseek")
CASES = sorted(d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, "reference.npz")))

# a model written at test time, for what the fixtures do not have: a dense layer whose
# intermediate size (80) is 2.5 groups of 32
PARTIAL_GROUP = dict(
    model_type="deepseek_v2", vocab_size=96, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4,
    head_dim=24, num_experts=4, top_k=2, moe_intermediate_size=32, intermediate_size=80, first_k_dense_replace=1,
    n_shared_experts=1, seed=14,
    scheme=QuantScheme.from_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                          "sym": True}),
    mla=dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16))


def _quiet_load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(path, **kw)


def _path(name):
    return os.path.join(ROOT, name)


@functools.lru_cache(maxsize=None)
def _model(name):
    return _quiet_load(_path(name), dtype=jnp.float32)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


# --------------------------------------------------------------------------- the float64 reference


def _f64(a):
    return np.asarray(a, np.float64)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _lin(lin, x):
    return x @ _f64(lin.dense(jnp.float32)).T


def _yarn(dim, theta, factor, beta_fast, beta_slow, orig):
    """Frequencies that turn more than ``beta_fast`` times over the original context keep their
    value, fewer than ``beta_slow`` times are divided by ``factor``; between, a linear blend over
    the dimension index (the boundaries rounded outwards)."""
    freq = theta ** (-np.arange(0, dim, 2) / dim)
    # the (fractional) pair index at which a frequency turns `rot` times over `orig` positions
    index_at = lambda rot: np.log(orig / (2 * np.pi * rot)) / np.log(theta) * dim / 2  # noqa: E731
    lo, hi = max(np.floor(index_at(beta_fast)), 0), min(np.ceil(index_at(beta_slow)), dim - 1)
    t = np.clip((np.arange(dim // 2) - lo) / max(hi - lo, 1e-3), 0, 1)
    return freq * (1 - t) + freq / factor * t


def _rope_setup(raw):
    rope_dim, theta = raw["qk_rope_head_dim"], raw.get("rope_theta", 10000.0)
    qk = raw["qk_nope_head_dim"] + rope_dim
    rs = raw.get("rope_scaling")
    if not rs:
        return theta ** (-np.arange(0, rope_dim, 2) / rope_dim), 1.0, qk ** -0.5
    f = rs["factor"]
    m = lambda s: 0.1 * s * np.log(f) + 1  # noqa: E731
    inv = _yarn(rope_dim, theta, f, rs["beta_fast"], rs["beta_slow"], rs["original_max_position_embeddings"])
    return inv, m(rs["mscale"]) / m(rs["mscale_all_dim"]), qk ** -0.5 * m(rs["mscale_all_dim"]) ** 2


def _rotate(x, pos, inv, factor):
    """Interleaved pairs as complex numbers times ``factor · e^{i·pos·inv}``; ``x [S, n, d]``."""
    z = x[..., 0::2] + 1j * x[..., 1::2]
    z = z * (factor * np.exp(1j * pos[:, None, None] * inv[None, None, :]))
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def _route(mlp, hx, raw):
    logits = hx @ _f64(mlp.router[...]).T
    if mlp.routing.scoring_func == "sigmoid":
        scores = 1 / (1 + np.exp(-logits))
    else:
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    bias = None if mlp.e_score_correction_bias is None else _f64(mlp.e_score_correction_bias[...])
    out = []
    for sc in scores:
        choice = sc + (0 if bias is None else bias)
        if raw.get("topk_method") in ("group_limited_greedy", "noaux_tc"):
            g = raw["n_group"]
            groups = choice.reshape(g, -1)
            gscore = np.sort(groups, -1)[:, -2:].sum(-1) if bias is not None else groups.max(-1)
            keep = np.argsort(-gscore, kind="stable")[:raw["topk_group"]]
            allowed = np.zeros(g, bool)
            allowed[keep] = True
            choice = np.where(np.repeat(allowed, groups.shape[1]), choice, -np.inf)
        top = np.argsort(-choice, kind="stable")[:mlp.routing.top_k]
        w = sc[top]
        if mlp.routing.renormalize:
            w = w / w.sum()
        out.append((top, w * mlp.routing.routed_scaling_factor))
    return out


def _swiglu(w13, w2, x):
    hh = x @ w13.T
    i = hh.shape[-1] // 2
    return (hh[..., :i] / (1 + np.exp(-hh[..., :i])) * hh[..., i:]) @ w2.T


def reference_logits(model, raw, tokens, *, rope=None, route=None):
    """float64 logits of ``tokens`` (positions 0..S-1) from ``model``'s own weights."""
    c = model.config
    inv, factor, scale = rope or _rope_setup(raw)
    route = route or _route
    x = _f64(model.embed_tokens[...])[np.asarray(tokens)]
    s = len(tokens)
    pos = np.arange(s, dtype=np.float64)
    nope, rd, r, vd = (raw[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank", "v_head_dim"))
    nh = c.num_heads
    for layer in model.layers:
        a = layer.self_attn
        hx = _rms(x, _f64(layer.input_layernorm.weight[...]), c.rms_norm_eps)
        if a.q_proj is not None:
            q = _lin(a.q_proj, hx)
        else:
            q = _lin(a.q_b_proj, _rms(_lin(a.q_a_proj, hx), _f64(a.q_a_layernorm.weight[...]), 1e-6))
        q = q.reshape(s, nh, nope + rd)
        kva = _lin(a.kv_a_proj_with_mqa, hx)
        kv = _lin(a.kv_b_proj, _rms(kva[:, :r], _f64(a.kv_a_layernorm.weight[...]), 1e-6)).reshape(s, nh, nope + vd)
        k_rope = _rotate(kva[:, None, r:], pos, inv, factor)
        q = np.concatenate([q[..., :nope], _rotate(q[..., nope:], pos, inv, factor)], -1)
        k = np.concatenate([kv[..., :nope], np.broadcast_to(k_rope, (s, nh, rd))], -1)
        v = kv[..., nope:]
        out = np.zeros((s, nh, vd))
        for hd in range(nh):
            sc = q[:, hd] @ k[:, hd].T * scale
            sc = np.where(pos[None, :] <= pos[:, None], sc, -np.inf)
            p = np.exp(sc - sc.max(-1, keepdims=True))
            out[:, hd] = (p / p.sum(-1, keepdims=True)) @ v[:, hd]
        x = x + _lin(a.o_proj, out.reshape(s, -1))
        hx = _rms(x, _f64(layer.post_attention_layernorm.weight[...]), c.rms_norm_eps)
        mlp = layer.mlp
        if hasattr(mlp, "router"):
            w13, w2 = (_f64(t) for t in mlp.expert_weights().dequantize(jnp.float32))
            y = np.zeros_like(hx)
            for t, (top, wts) in enumerate(route(mlp, hx, raw)):
                for e, wt in zip(top, wts):
                    y[t] += wt * _swiglu(w13[e], w2[e], hx[t])
            if mlp.shared_experts is not None:
                s13, s2 = (_f64(t)[0] for t in mlp.shared_expert_weights().dequantize(jnp.float32))
                y = y + _swiglu(s13, s2, hx)
        else:
            g, u = _lin(mlp.gate_proj, hx), _lin(mlp.up_proj, hx)
            y = _lin(mlp.down_proj, g / (1 + np.exp(-g)) * u)
        x = x + y
    x = _rms(x, _f64(model.norm.weight[...]), c.rms_norm_eps)
    return x @ _f64(model.lm_head.dense(jnp.float32)).T


def _raw(name):
    with open(os.path.join(_path(name), "config.json")) as f:
        return json.load(f)


TOKENS = [5, 17, 3, 88, 41, 9, 60, 2, 33, 71, 12, 50]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", CASES)
def test_deepseek_logits_and_cached_decode_match_reference(name):
    """The compiled float32 decoder against the float64 reference over a 12-token prompt plus 8
    greedy tokens, and every cached decode step's logits against the uncached forward."""
    m, raw = _model(name), _raw(name)
    c = m.config
    assert c.mla is not None and all(isinstance(layer.self_attn, LatentAttention) for layer in m.layers)
    assert c.sparse_layers == tuple(i >= raw["first_k_dense_replace"] for i in range(c.num_layers))
    gen = Generator(m, batch_size=2, max_len=32)
    prompts = [TOKENS, TOKENS[:3]]
    steps = list(gen.stream(prompts, 8, with_logits=True))
    cache = m.init_cache(2, 32)
    assert cache.k.shape == (c.num_layers, 2, 1, 32, raw["kv_lora_rank"])    # the latent, not per-head keys
    assert cache.v.shape == (c.num_layers, 2, 1, 32, raw["qk_rope_head_dim"])
    seqs = [p + [int(t[i]) for t, _ in steps] for i, p in enumerate(prompts)]
    width = max(len(q) for q in seqs)
    full = np.asarray(_forward(m, jnp.asarray([q + [0] * (width - len(q)) for q in seqs], jnp.int32)))
    for i, p in enumerate(prompts):
        for j, (toks, logits) in enumerate(steps):
            want = full[i, len(p) - 1 + j]
            assert np.isfinite(logits[i]).all()
            assert float(np.abs(logits[i] - want).max()) <= TOL * max(float(np.abs(want).max()), 1.0), (i, j)
            assert int(toks[i]) == int(np.argmax(want))
    ref = reference_logits(m, raw, seqs[0])
    got = full[0, :len(seqs[0])]
    scale = float(np.abs(ref).max())
    assert np.isfinite(got).all() and float(np.abs(got - ref).max()) <= TOL * max(scale, 1.0), \
        (name, float(np.abs(got - ref).max()), scale)


def test_reference_sees_real_mistakes():
    """The comparison above would catch the mistakes a latent-attention port makes: each
    perturbation of the reference moves the logits by far more than the tolerance."""
    m, raw = _model("v2-lite-gptq"), _raw("v2-lite-gptq")
    got = np.asarray(_forward(m, jnp.asarray([TOKENS], jnp.int32)))[0]
    inv, factor, scale = _rope_setup(raw)
    half = len(inv)
    wrong = {
        "no YaRN": (10000.0 ** (-np.arange(0, 2 * half, 2) / (2 * half)), 1.0, (raw["qk_nope_head_dim"] + 8) ** -0.5),
        "no softmax-scale correction": (inv, factor, (raw["qk_nope_head_dim"] + 8) ** -0.5),
        "no cos/sin factor": (inv, 1.0, scale),
    }
    errs = {k: float(np.abs(reference_logits(m, raw, TOKENS, rope=v) - got).max()) for k, v in wrong.items()}
    scale_l = float(np.abs(got).max())
    assert all(e > 100 * TOL * scale_l for e in errs.values()), (errs, scale_l)
    v3, raw3 = _model("v3-awq"), _raw("v3-awq")
    got3 = np.asarray(_forward(v3, jnp.asarray([TOKENS], jnp.int32)))[0]

    def unbiased(mlp, hx, raw):                  # selection without the score-correction bias
        bias = mlp.e_score_correction_bias
        mlp.e_score_correction_bias = None
        try:
            return _route(mlp, hx, raw)
        finally:
            mlp.e_score_correction_bias = bias

    err = float(np.abs(reference_logits(v3, raw3, TOKENS, route=unbiased) - got3).max())
    assert err > 100 * TOL * float(np.abs(got3).max()), err
    assert float(np.abs(reference_logits(v3, raw3, TOKENS) - got3).max()) <= TOL * float(np.abs(got3).max())


def test_scanned_deepseek_is_the_same_model():
    """All layers sparse (first_k_dense_replace=0): scanned by request, the same logits and
    cached greedy tokens as the unrolled model, the latent cache stacked per layer."""
    unrolled, scanned = _model("v2-grouped-awq"), _quiet_load(_path("v2-grouped-awq"), dtype=jnp.float32,
                                                               scan_layers=True)
    assert scanned.scan_layers and not unrolled.scan_layers
    toks = jnp.asarray([TOKENS], jnp.int32)
    a, b = np.asarray(_forward(unrolled, toks)), np.asarray(_forward(scanned, toks))
    assert float(np.abs(a - b).max()) <= TOL * float(np.abs(a).max())
    assert scanned.init_cache(1, 16).k.shape == (2, 1, 1, 16, 32)
    assert Generator(scanned, batch_size=1, max_len=32).generate([TOKENS], 6) == \
        Generator(unrolled, batch_size=1, max_len=32).generate([TOKENS], 6)


def test_kv_b_proj_is_kept_dequantized_and_frozen():
    """A quantized ``kv_b_proj`` is dequantized at load and cut into its key and value parts, each
    stored apart (``AbsorbedKV``: ``w_uk [heads, nope, rank]``, ``w_uv [heads, v, rank]``, the
    rows of the dequantized matrix), frozen (unrolled and scanned), outside the optimizer's
    ``nnx.Param`` set as the quantized weights are (its values are checked by the logits against
    transformers, above)."""
    from wna16_jax.models.decoder import AbsorbedKV
    from wna16_jax.models.linear import QuantizedWeight

    unrolled, scanned = _model("v2-grouped-awq"), _quiet_load(_path("v2-grouped-awq"), dtype=jnp.float32,
                                                               scan_layers=True)
    c = unrolled.config
    nh, nope, vd, r = c.num_heads, c.mla.qk_nope_head_dim, c.mla.v_head_dim, c.mla.kv_lora_rank
    kv_b = unrolled.layers[0].self_attn.kv_b_proj
    assert isinstance(kv_b, AbsorbedKV)
    assert all(isinstance(v, QuantizedWeight) and v.get_value().dtype == jnp.float32 for v in (kv_b.w_uk, kv_b.w_uv))
    assert kv_b.w_uk.get_value().shape == (nh, nope, r) and kv_b.w_uv.get_value().shape == (nh, vd, r)
    # the scanned model stacks the same parts (its values are the logits' business, above)
    stacked = scanned.stacked_layers.self_attn.kv_b_proj
    first = len(unrolled.layers) - scanned.num_scanned_layers
    for name in ("w_uk", "w_uv"):
        np.testing.assert_array_equal(np.asarray(getattr(stacked, name).get_value()[0]),
                                      np.asarray(getattr(unrolled.layers[first].self_attn.kv_b_proj, name).get_value()))
    for model in (unrolled, scanned):
        params = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
        frozen = jax.tree_util.tree_flatten_with_path(nnx.state(model, QuantizedWeight))[0]
        assert params and not any("kv_b_proj" in jax.tree_util.keystr(p) for p, _ in params)
        assert any("kv_b_proj" in jax.tree_util.keystr(p) for p, _ in frozen)


def test_leading_dense_layers_run_ahead_of_the_scan():
    """first_k_dense_replace=1: the dense first layer runs unrolled, the MoE layers after it are
    scanned; logits, cache layout and greedy tokens are the unrolled model's."""
    path = _path("v3-awq")
    unrolled, scanned = _model("v3-awq"), _quiet_load(path, dtype=jnp.float32, scan_layers=True)
    assert scanned.scan_layers and len(scanned.layers) == 1 and scanned.num_scanned_layers == 2
    assert [hasattr(layer.mlp, "router") for layer in scanned.layer_modules()] == [False, True, True]
    assert scanned.init_cache(1, 16).k.shape == (3, 1, 1, 16, 32)      # one stack: the head layer's first
    toks = jnp.asarray([TOKENS], jnp.int32)
    a, b = np.asarray(_forward(unrolled, toks)), np.asarray(_forward(scanned, toks))
    assert float(np.abs(a - b).max()) <= TOL * float(np.abs(a).max())
    prompts = [TOKENS, TOKENS[:4]]
    assert Generator(scanned, batch_size=2, max_len=32).generate(prompts, 6) == \
        Generator(unrolled, batch_size=2, max_len=32).generate(prompts, 6)
    assert not _quiet_load(path, dtype=jnp.float32).scan_layers          # default: fewer than 8 alike layers


# v3-awq is not among them: on TOKENS its group selection (top-1 of 2 groups by the sum of each
# group's two bias-corrected scores) has gaps of 0.002 and 0.005 at two positions, below the
# bfloat16 rounding of the router's input, so the two dtypes pick different groups there.
@pytest.mark.parametrize("name", ["v2-lite-gptq", "v2-grouped-awq"])
def test_bfloat16_deepseek_tracks_float32(name):
    """bfloat16 activations (the accelerator default) through the same model: logits within
    bfloat16 rounding of the float32 ones (measured on the CPU: at most 1.1% of the largest)."""
    path = _path(name)
    f32 = np.asarray(_forward(_model(name), jnp.asarray([TOKENS], jnp.int32)))
    bf16 = np.asarray(_forward(_quiet_load(path, dtype=jnp.bfloat16), jnp.asarray([TOKENS], jnp.int32)))
    assert np.isfinite(bf16).all()
    assert float(np.abs(bf16 - f32).max()) <= 0.05 * float(np.abs(f32).max())


# --------------------------------------------------------------------------- bad input


def _base_config():
    return {"model_type": "deepseek_v2", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "intermediate_size": 96, "first_k_dense_replace": 1}


@pytest.mark.parametrize("change,error,words", [
    (lambda c: c.pop("kv_lora_rank"), ConfigError, ["'kv_lora_rank'", "required"]),
    (lambda c: c.update(qk_rope_head_dim=7), ConfigError, ["qk_rope_head_dim", "even", "7"]),
    (lambda c: c.update(q_lora_rank="big"), ConfigError, ["'q_lora_rank'", "'big'"]),
    (lambda c: c.update(first_k_dense_replace=-1), ConfigError, ["first_k_dense_replace", "-1"]),
    (lambda c: c.update(rope_scaling={"type": "yarn"}), ConfigError, ["rope_scaling", "'factor'", "required"]),
    (lambda c: c.update(rope_scaling={"type": "yarn", "factor": 4, "truncate": False,
                                     "original_max_position_embeddings": 64}), UnsupportedError,
     ["truncate", "False"]),
    (lambda c: c.update(rope_scaling={"type": "longrope", "factor": 4}), UnsupportedError,
     ["'longrope'", "yarn"]),
])
def test_bad_deepseek_configs_are_named(change, error, words):
    cfg = _base_config()
    change(cfg)
    with pytest.raises(error) as e:
        DecoderConfig.from_hf_config(cfg)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_deepseek_config_fields():
    c = DecoderConfig.from_hf_config({**_base_config(), "moe_layer_freq": 2, "num_hidden_layers": 5,
                                      "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707,
                                                       "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                                                       "original_max_position_embeddings": 4096}})
    assert c.sparse_layers == (False, False, True, False, True)        # i >= 1 and i % 2 == 0
    assert c.num_kv_heads == c.num_heads and c.head_dim == 24 and c.rope_dim == 8 and c.rope_interleaved
    m = 0.1 * 0.707 * np.log(40) + 1
    assert c.rope_yarn == (32.0, 1.0, 4096, pytest.approx(1.0))        # mscale == mscale_all_dim
    assert c.scale == pytest.approx(24 ** -0.5 * m * m)
    assert not DecoderConfig.from_hf_config({**_base_config(), "model_type": "deepseek_v3",
                                             "rope_interleave": False}).rope_interleaved


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.kv_b_proj.qweight",
                                  "model.layers.1.self_attn.kv_a_layernorm.weight"])
def test_missing_latent_attention_tensor_is_named(tmp_path, name):
    from safetensors.numpy import load_file, save_file

    dst = tmp_path / "ckpt"
    shutil.copytree(_path("v2-lite-gptq"), dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = dst / index["weight_map"][name]
    t = load_file(str(shard))
    del t[name]
    save_file(t, str(shard))
    del index["weight_map"][name]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in dst.iterdir()}
    with pytest.raises(MissingTensorError) as e:
        _quiet_load(str(dst))
    assert name.rsplit(".", 1)[0] in str(e.value)
    assert digests == {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in dst.iterdir()}   # untouched


def test_moe_layers_disagreeing_with_first_k_dense_replace_are_refused(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(_path("v2-lite-gptq"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["first_k_dense_replace"] = 2
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"MoE layers at \[2\].*first_k_dense_replace.*layers \[1, 2\]"):
        _quiet_load(str(dst))


def test_yarn_on_a_grouped_query_model():
    """YaRN on a Qwen3-MoE config (the whole head rotated, halves as pairs): the frequencies are
    the blend above and the cos / sin factor is ``0.1 · ln(factor) + 1`` (no mscale fields)."""
    from wna16_jax.models.decoder import rope_frequencies

    cfg = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "rope_theta": 1e6,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    c = DecoderConfig.from_hf_config(cfg)
    inv, factor = rope_frequencies(c)
    want = _yarn(32, 1e6, 4.0, 32.0, 1.0, 32768)
    assert not c.rope_interleaved and c.scale == pytest.approx(32 ** -0.5)
    assert np.allclose(inv, want, rtol=1e-6, atol=0) and factor == pytest.approx(0.1 * np.log(4.0) + 1)
    assert not np.allclose(want, 1e6 ** (-np.arange(0, 32, 2) / 32), rtol=1e-3)   # the blend is not a no-op


# --------------------------------------------------------------------------- partial last groups


@pytest.mark.parametrize("method", ["gptq", "compressed-tensors"])
def test_linear_with_a_partial_last_group(method):
    """K = 80 in groups of 32: three groups, the last of 16 rows, as GPTQ and compressed-tensors
    store it (DeepSeek-V2-Lite's dense down_proj has K = 10944 = 85.5 groups of 128). The stored
    words and scales, decoded here bit by bit in numpy, give the layer's weight and its matmul."""
    from wna16_jax.matmul import quantized_matmul
    from wna16_jax.weights import QuantMatrix
    from wna16_jax.models.synthetic import random_linear_tensors

    if method == "gptq":
        scheme = QuantScheme.from_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 32,
                                                "desc_act": False, "sym": True})
    else:
        scheme = QuantScheme.from_quant_config({
            "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
                "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                   "strategy": "group", "group_size": 32}}}})
    n, k = 64, 80
    rng = np.random.default_rng()
    t = random_linear_tensors(rng, scheme, n, k, float_dtype=np.float32)
    words = t["qweight" if method == "gptq" else "weight_packed"].view(np.uint32)
    if method == "gptq":                             # [K/8, N]: row k in word k // 8, nibble k % 8
        codes = np.stack([(words[kk // 8] >> (4 * (kk % 8))) & 15 for kk in range(k)], axis=1)   # [N, K]
        scales = t["scales"].T                                                                      # [N, 3]
        zero = 8
    else:                                            # [N, K/8]: column k in word k // 8
        codes = np.stack([(words[:, kk // 8] >> (4 * (kk % 8))) & 15 for kk in range(k)], axis=1)
        scales = t["weight_scale"]
        zero = 8
    assert scales.shape == (n, 3)
    # (code - zero) · scale rounded once to float32, as the library computes it
    want = ((codes.astype(np.float32) - zero) * scales[:, np.arange(k) // 32].astype(np.float32)).astype(np.float64)
    w = jax.tree.map(jnp.asarray, QuantMatrix.from_stored(scheme, t, n=n, k=k))
    got = np.asarray(jax.jit(lambda w: w.dequantize(jnp.float32)[0])(w), np.float64)
    assert np.array_equal(got, want)
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = np.asarray(jax.jit(lambda x, w: quantized_matmul(x, w))(jnp.asarray(x), w), np.float64)
    assert np.isfinite(y).all() and np.abs(y - x.astype(np.float64) @ want.T).max() <= 1e-5 * np.abs(y).max()


def test_model_with_a_partial_group_dense_layer(tmp_path):
    """A DeepSeek model whose dense layer's intermediate size (80) is 2.5 groups of 32 loads and
    matches the float64 reference like the others."""
    path = str(tmp_path / "partial")
    write_random_model(path, RandomModelSpec(**{k: v for k, v in PARTIAL_GROUP.items() if k != "seed"}),
                       seed=PARTIAL_GROUP["seed"])
    m = _quiet_load(path, dtype=jnp.float32)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert m.layers[0].mlp.down_proj.weight.get_value().scale.shape == (1, 3, 64)   # GPTQ [1, groups, N]
    got = np.asarray(_forward(m, jnp.asarray([TOKENS], jnp.int32)))[0]
    ref = reference_logits(m, raw, TOKENS)
    assert float(np.abs(got - ref).max()) <= TOL * float(np.abs(ref).max())


# --------------------------------------------------------------------------- against transformers

# float32 against float32 in another order (the absorbed latent attention against the expanded
# form, a fused MoE against a loop over experts): measured on the CPU 1.7e-6 to 2.6e-6 with
# logits up to ~4; the bound is about four times the largest. A wrong rotary layout, YaRN
# factor or routing rule moves the logits by 1e-2 or more (test_reference_sees_real_mistakes).
HF_TOL = 1e-5


#: the keys of Kimi-K2's config.json beyond DeepSeek-V3's (its int4 release: the experts in
#: compressed-tensors pack-quantized int4, group 32, symmetric), at toy sizes
KIMI_K2_KEYS = {
    "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16, "beta_fast": 1.0,
                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    "num_nextn_predict_layers": 0, "bos_token_id": 1, "eos_token_id": 2, "ep_size": 1,
    "torch_dtype": "bfloat16", "use_cache": True, "initializer_range": 0.02, "aux_loss_alpha": 0.001,
    "seq_aux": True, "pretraining_tp": 1, "attention_dropout": 0.0, "attention_bias": False,
}


def test_kimi_k2_config_loads_as_deepseek_v3(tmp_path):
    """A tiny checkpoint with Kimi-K2's config.json keys (model_type kimi_k2, DeepSeek-V3's
    architecture, compressed-tensors int4 group 32, sigmoid noaux_tc routing with one group, a
    dense first layer, YaRN): it loads as DeepSeek-V3 and gives bit for bit the logits and greedy
    tokens of the same folder with model_type deepseek_v3 (the DeepSeek-V3 path is checked
    against transformers by the fixtures above)."""

    spec = RandomModelSpec(
        model_type="deepseek_v3", vocab_size=96, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4,
        head_dim=24, num_experts=8, top_k=2, moe_intermediate_size=32, intermediate_size=64,
        first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=512,
        scheme=QuantScheme.from_quant_config({"quant_method": "compressed-tensors", "format": "pack-quantized",
                                              "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                                  "num_bits": 4, "type": "int", "symmetric": True,
                                                  "strategy": "group", "group_size": 32}}}}),
        mla=dict(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        routing=dict(topk_method="noaux_tc", n_group=1, topk_group=1, scoring_func="sigmoid", norm_topk_prob=True,
                     routed_scaling_factor=2.827),
        extra_config=KIMI_K2_KEYS)
    kimi = write_random_model(str(tmp_path / "kimi"), spec, seed=int(np.random.default_rng().integers(1 << 30)))
    v3 = str(tmp_path / "v3")
    shutil.copytree(kimi, v3)
    with open(os.path.join(v3, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "kimi_k2" and raw["quantization_config"]["config_groups"]["group_0"]["weights"][
        "group_size"] == 32
    raw["model_type"] = "deepseek_v3"
    with open(os.path.join(v3, "config.json"), "w") as f:
        json.dump(raw, f)
    a, b = _quiet_load(kimi, dtype=jnp.float32), _quiet_load(v3, dtype=jnp.float32)
    assert a.config.model_type == "deepseek_v3" and a.config.release == "kimi_k2"
    assert a.config.family == "Kimi-K2 (DeepSeek-V3)" and b.config.family == "DeepSeek-V3"
    assert a.config.moe.scoring_func == "sigmoid" and a.config.moe.routed_scaling_factor == 2.827
    assert a.config.rope_type == "yarn" and a.config.sparse_layers == (False, True, True)
    assert a.config.moe.model_type == "kimi_k2"                     # as config.json says it
    assert dataclasses.replace(a.config, release=None, moe=dataclasses.replace(a.config.moe,
                                                                            model_type="deepseek_v3")) == b.config
    toks = jnp.asarray([np.random.default_rng().integers(0, 96, 12)], jnp.int32)
    la, lb = np.asarray(_forward(a, toks)), np.asarray(_forward(b, toks))
    assert np.isfinite(la).all() and np.array_equal(la, lb)
    prompt = toks[0].tolist()
    assert Generator(a, batch_size=1, max_len=32).generate([prompt], 6) == \
        Generator(b, batch_size=1, max_len=32).generate([prompt], 6)
    with pytest.raises(UnsupportedError, match=r"Kimi-K2 \('kimi_k2', the DeepSeek-V3 architecture\)"):
        DecoderConfig.from_hf_config({**raw, "model_type": "kimi_k3"})


def test_fixtures_exist():
    assert CASES == ["v2-grouped-awq", "v2-lite-gptq", "v3-awq"]


@pytest.mark.parametrize("case", CASES)
def test_logits_and_greedy_tokens_match_transformers(case):
    """The checkpoint (written by write_random_model; tools/hf_deepseek/make_fixtures.py) loaded
    by load_model in float32: the prompt's logits match transformers' DeepseekV2ForCausalLM /
    DeepseekV3ForCausalLM on the same dequantized weights (stored at fixture time), and 32 greedy
    tokens through the KV cache match token for token."""
    with np.load(os.path.join(_path(case), "reference.npz")) as z:
        ref = {k: z[k] for k in z.files}
    m = _model(case)
    got = np.asarray(_forward(m, jnp.asarray(ref["prompt_ids"][None], jnp.int32)))[0]
    assert np.isfinite(got).all()
    err = float(np.abs(got - ref["logits"]).max())
    assert err <= HF_TOL, (case, err)
    gen = Generator(m, batch_size=1, max_len=64)
    out = gen.generate([ref["prompt_ids"].tolist()], len(ref["generated_ids"]))
    assert out[0] == ref["generated_ids"].tolist()


def test_partial_group_with_too_few_scale_rows_is_named(tmp_path):
    """A dense down_proj of K = 80 in groups of 32 stored with floor(K / 32) = 2 scale rows (a
    writer that dropped the partial group): a ShapeError naming the tensor, expected and actual."""
    from safetensors.numpy import load_file, save_file

    from wna16_jax.errors import ShapeError

    path = tmp_path / "partial"
    write_random_model(str(path), RandomModelSpec(**{k: v for k, v in PARTIAL_GROUP.items() if k != "seed"}),
                       seed=PARTIAL_GROUP["seed"])
    name = "model.layers.0.mlp.down_proj.scales"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = path / index["weight_map"][name]
    t = load_file(str(shard))
    assert t[name].shape == (3, 64)
    t[name] = np.ascontiguousarray(t[name][:2])
    save_file(t, str(shard))
    with pytest.raises(ShapeError) as e:
        _quiet_load(str(path))
    msg = str(e.value)
    assert name in msg and "(3, 64)" in msg and "(2, 64)" in msg, msg


# --------------------------------------------------------------------------- on the engine

# DeepSeek-V2-Lite's widths (hidden 2048, 16 heads, latent rank 512, rope 64, experts of 1408),
# fewer layers and experts so that a GPU compiles them in seconds; V3's q LoRA and routing
_ENGINE_SIZED = dict(vocab_size=1024, hidden_size=2048, num_layers=4, num_heads=16, num_kv_heads=16,
                     head_dim=192, num_experts=16, moe_intermediate_size=1408, intermediate_size=2816,
                     first_k_dense_replace=1, n_shared_experts=2, max_position_embeddings=4096)
ENGINE_CASES = {
    "v2-lite": dict(model_type="deepseek_v2", top_k=6,
                    scheme=QuantScheme.from_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 128,
                                                          "desc_act": False, "sym": True}),
                    mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128),
                    extra_config={"rope_scaling": {"type": "yarn", "factor": 40,
                                                   "original_max_position_embeddings": 4096, "beta_fast": 32,
                                                   "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    "v3": dict(model_type="deepseek_v3", top_k=4,
               scheme=QuantScheme.from_quant_config({"quant_method": "awq", "bits": 4, "group_size": 128,
                                                     "zero_point": True, "version": "gemm"}),
               mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128),
               routing=dict(topk_method="noaux_tc", n_group=4, topk_group=2, scoring_func="sigmoid",
                            norm_topk_prob=True, routed_scaling_factor=2.5)),
}


@gpu
@needs_hopper
@pytest.mark.parametrize("name", sorted(ENGINE_CASES))
def test_engine_sized_deepseek_on_the_engine_gpu(tmp_path, name):
    """An engine-sized DeepSeek model in bfloat16 on Hopper (the dense layer unrolled, the MoE
    layers scanned; latent-attention projections and experts in the wgmma layout, ``kv_b_proj``
    dequantized at load; decode steps on the latent kernel) against the same checkpoint's unrolled float32 model:
    prefill logits and greedy tokens, with the tolerances ``scanned_model_matches_float32`` states."""
    from test_layer_stack import scanned_model_matches_float32

    path = write_random_model(str(tmp_path / name), RandomModelSpec(**_ENGINE_SIZED, **ENGINE_CASES[name]),
                              seed=int(np.random.default_rng().integers(1 << 30)))
    # V3's rows are noisier in bf16: the routed experts' sum is scaled by 2.5 and q passes two
    # more rounded GEMMs (the q LoRA). The XLA bf16 model on the CPU (3 random models × 24
    # prompts) had a median row error of 1.5% but only 71–88% of the rows within 3%, so the 3%
    # bar fails by chance; 5% keeps the bulk's margin while a wrong layer or cache row (order
    # one on every row) still fails.
    scanned_model_matches_float32(path, check_engine=True, within=5e-2 if name == "v3" else 3e-2)
