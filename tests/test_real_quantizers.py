"""The library against checkpoints written by the real quantization tools.

Each folder under ``tests/fixtures/quantizers/`` is a tiny MoE (Qwen3-MoE or Mixtral, random
weights) quantized by llm-compressor, AutoAWQ or GPTQModel with their own entry points, kept with
the tools' own file and tensor names, plus ``reference.npz`` / ``reference.json`` written by
``tools/quantizer_fixtures/make_references.py`` (how to regenerate: that folder's README).

Two references per MoE layer, both on the stored input ``x [16, H]``:

* ``out_float`` — the stored tensors decoded by the generator's own code (not the tool's, not
  this library's) with the scales upcast exactly, the HF sparse-MoE block evaluated in float64;
* ``out_tool`` — the tool's own quantized forward (bf16 for llm-compressor, fp16 for AutoAWQ
  and GPTQModel), i.e. what a user of the tool gets.

No torch here: only numpy, safetensors and jax.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wna16_jax import routing
from wna16_jax.backends import TABLE, Backend
from wna16_jax.checkpoint import Checkpoint
from wna16_jax.moe import fused_moe
from wna16_jax.nn import QuantizedMoE

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "quantizers")

# What each tool wrote (read off the checkpoints, see docs/quantizers.md) and what the library's
# QuantScheme / MoEModelConfig must make of it. ``backends``: the layouts the README's support
# matrix promises for the scheme (each must accept it; more may).
EXPECTED = {
    "ct-w4a16-qwen3moe": dict(
        method="compressed-tensors", bits=4, group_size=128, zero_point=False, act_order=False,
        model_type="qwen3_moe", num_experts=8, top_k=2, hidden=256, inter=128, renormalize=True,
        backends={Backend.CPU, Backend.XPU, Backend.MARLIN, Backend.BATCHED_MARLIN}),
    "ct-w4a16asym-mixtral": dict(
        method="compressed-tensors", bits=4, group_size=128, zero_point=True, act_order=False,
        model_type="mixtral", num_experts=4, top_k=2, hidden=128, inter=256, renormalize=True,
        backends={Backend.MARLIN, Backend.BATCHED_MARLIN}),
    "ct-w8a16-qwen3moe": dict(
        method="compressed-tensors", bits=8, group_size=128, zero_point=False, act_order=False,
        model_type="qwen3_moe", num_experts=4, top_k=2, hidden=128, inter=128, renormalize=True,
        backends={Backend.MARLIN, Backend.BATCHED_MARLIN}),
    "awq-mixtral": dict(
        method="awq", bits=4, group_size=128, zero_point=True, act_order=False,
        model_type="mixtral", num_experts=4, top_k=2, hidden=256, inter=256, renormalize=True,
        backends={Backend.CPU, Backend.MARLIN, Backend.BATCHED_MARLIN, Backend.HUMMING}),
    "awq-qwen3moe": dict(
        method="awq", bits=4, group_size=128, zero_point=True, act_order=False,
        model_type="qwen3_moe", num_experts=8, top_k=2, hidden=256, inter=128, renormalize=True,
        backends={Backend.CPU, Backend.MARLIN, Backend.BATCHED_MARLIN, Backend.HUMMING}),
    "gptq-descact-qwen3moe": dict(
        method="gptq", bits=4, group_size=128, zero_point=False, act_order=True,
        model_type="qwen3_moe", num_experts=4, top_k=2, hidden=256, inter=256, renormalize=False,
        backends={Backend.MARLIN, Backend.BATCHED_MARLIN}),
    "gptq-asym-qwen3moe": dict(
        method="gptq", bits=4, group_size=128, zero_point=True, act_order=False,
        model_type="qwen3_moe", num_experts=4, top_k=2, hidden=128, inter=128, renormalize=True,
        backends={Backend.CPU, Backend.MARLIN, Backend.BATCHED_MARLIN, Backend.HUMMING}),
    "gptq-mixtral": dict(
        method="gptq", bits=4, group_size=128, zero_point=False, act_order=False,
        model_type="mixtral", num_experts=4, top_k=2, hidden=128, inter=256, renormalize=True,
        backends={Backend.CPU, Backend.XPU, Backend.MARLIN, Backend.BATCHED_MARLIN, Backend.HUMMING}),
}

# Library refusals / misreads of what a real tool writes: case -> the library's exact error.
# These cases are expected to fail (strict xfail: the day the loader accepts them, the mark
# must go).
KNOWN_LIBRARY_FAILURES: dict[str, str] = {}

# --- tolerances -------------------------------------------------------------------------------
# Against out_float (float64 on the same stored codes/scales): the library dequantizes exactly in
# float32 ((code - zero) is an integer of at most 8 bits, the scale a bf16/fp16 value with at most
# 11 significant bits, so the product is exact), so only float32 rounding in the two GEMMs
# (K = 128/256), the SiLU and the weighted sum remains: about sqrt(K)·2^-24 ≈ 1e-6 of the output
# scale. Measured (max-abs error / max |ref|): 3.9e-7 .. 1.0e-6 over all fixtures and layers.
# 1e-5 leaves 10× headroom and still catches a single stored code read one step off: flipping
# the lowest bit of one code of a routed expert moves the output by 3e-5 (int8) .. 1e-3 (int4).
FLOAT_RTOL = 1e-5
# Against out_tool: the tools dequantize to and compute in 16 bits, rounding the dequantized
# weights, the input, both GEMM outputs and the activation (unit roundoff u = 2^-9 for bf16,
# 2^-12 for fp16). We allow 8u of relative Frobenius error per layer: 1.5e-2 (bf16; measured
# 6.0e-3 .. 6.6e-3) and 2e-3 (fp16; measured 7.6e-4 .. 8.2e-4). These bounds are far too loose
# to catch one misread code; that is what the float reference is for.
TOOL_RTOL = {"bfloat16": 1.5e-2, "float16": 2e-3}


def _cases() -> list:
    present = sorted(d for d in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, d)))
    params = []
    for case in present:
        marks = []
        if case in KNOWN_LIBRARY_FAILURES:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_LIBRARY_FAILURES[case]))
        params.append(pytest.param(case, marks=marks, id=case))
    return params


CASES = _cases()


def test_every_fixture_is_present_and_expected():
    present = {p.values[0] for p in CASES}
    assert present == set(EXPECTED), (present ^ set(EXPECTED))
    for case in present:
        d = os.path.join(ROOT, case)
        total = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        assert total < 3 * 2**20, f"{case}: {total} bytes"


@pytest.fixture(scope="module")
def refs():
    cache = {}

    def get(case):
        if case not in cache:
            d = os.path.join(ROOT, case)
            with open(os.path.join(d, "reference.json")) as f:
                meta = json.load(f)
            with np.load(os.path.join(d, "reference.npz")) as z:
                arrays = {k: z[k] for k in z.files}
            cache[case] = (d, meta, arrays)
        return cache[case]

    return get


@pytest.fixture(scope="module")
def checkpoints():
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = Checkpoint(path)
        return cache[path]

    return get


# The library's default formulation for 16 tokens (what a user gets) on the loader layout.
_fused = jax.jit(fused_moe)
# Backend layouts differ only in how they store and decode the weights (each decodes to the same
# logical codes/scales, then shares the executor); "dense" compiles in about half the time of
# the default formulation, which keeps this file fast with ~20 layouts to check.
_fused_dense = jax.jit(functools.partial(fused_moe, formulation="dense"))
_apply = nnx.jit(lambda m, x: m(x))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _route(router, x, k, renormalize):
    logits = jnp.einsum("th,eh->te", jnp.asarray(x, jnp.float32), jnp.asarray(router, jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    return logits, routing.fused_topk(logits, k, renormalize=renormalize)


def _check_close(y, ref, rtol, what):
    y = np.asarray(y, np.float64)
    assert y.shape == ref.shape, (what, y.shape, ref.shape)
    assert np.isfinite(y).all(), f"{what}: non-finite output"
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0, f"{what}: degenerate reference"
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err <= rtol, f"{what}: max-abs error {err:.3g} of max |ref| > {rtol:g}"
    return err


def _check_rel_fro(y, ref, rtol, what):
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all(), f"{what}: non-finite output"
    err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert err <= rtol, f"{what}: relative Frobenius error {err:.3g} > {rtol:g}"
    return err


# ----------------------------------------------------------------------------- scheme & config


def _as_written(qc: dict) -> tuple:
    """(method, bits, group_size, zero_point, act_order, ignore) read straight off the tool's
    ``quantization_config``, in each tool's own vocabulary."""
    m = qc["quant_method"]
    if m == "awq":
        return (m, qc["bits"], qc["group_size"], qc["zero_point"], False,
                tuple(qc.get("modules_to_not_convert") or ()))
    if m == "gptq":
        assert qc["checkpoint_format"] == "gptq"  # v1: qzeros hold z - 1
        return (m, qc["bits"], qc["group_size"], not qc["sym"], qc["desc_act"], ())
    (group,) = qc["config_groups"].values()
    w = group["weights"]
    assert qc["format"] == group["format"] == "pack-quantized" and w["type"] == "int"
    assert group["input_activations"] is None and w["strategy"] == "group"
    return (m, w["num_bits"], w["group_size"], not w["symmetric"], w["actorder"] == "group",
            tuple(qc["ignore"]))


@pytest.mark.parametrize("case", CASES)
def test_scheme_and_config(case, refs, checkpoints):
    d, meta, ref = refs(case)
    exp = EXPECTED[case]
    ckpt = checkpoints(d)
    s = ckpt.scheme
    method, bits, group, zp, act_order, ignore = _as_written(ckpt.config["quantization_config"])
    assert (s.method.value, s.bits, s.group_size, s.zero_point, s.act_order, s.ignore) == (
        method, bits, group, zp, act_order, ignore)
    assert (s.method.value, s.bits, s.group_size, s.zero_point, s.act_order) == (
        exp["method"], exp["bits"], exp["group_size"], exp["zero_point"], exp["act_order"])
    mc = ckpt.model_config
    assert (mc.model_type, mc.num_experts, mc.top_k, mc.hidden_size, mc.moe_intermediate_size,
            mc.renormalize, mc.scoring_func, mc.activation) == (
        exp["model_type"], exp["num_experts"], exp["top_k"], exp["hidden"], exp["inter"],
        exp["renormalize"], "softmax", "silu")
    assert ckpt.moe_layer_indices == ref["layers"].tolist() == [0, 1]
    # The reference was built with the routing the config asks for.
    assert meta["model"]["norm_topk"] == exp["renormalize"]


# ----------------------------------------------------------------------------- one MoE layer


@pytest.mark.parametrize("case", CASES)
def test_layer_against_float_reference(case, refs, checkpoints):
    """Loader layout, fused_topk on the stored router, jit(fused_moe) in float32 vs out_float;
    then the same through every backend layout that can represent the scheme."""
    d, meta, ref = refs(case)
    exp = EXPECTED[case]
    ckpt = checkpoints(d)
    mc = ckpt.model_config
    supported = {b for b in Backend if TABLE[b].layout_supports(ckpt.scheme, has_bias=False) is None}
    assert exp["backends"] <= supported, {b: TABLE[b].layout_supports(ckpt.scheme, has_bias=False)
                                          for b in exp["backends"] - supported}
    for li in ckpt.moe_layer_indices:
        layer = ckpt.load_layer(li)
        x = ref[f"layer{li}_x"]
        assert x.dtype == np.float32 and x.shape == (16, mc.hidden_size)
        logits, (tw, ids) = _route(layer.router, x, mc.top_k, mc.renormalize)
        # Router: the stored weight upcast (float32 here vs float64 in the reference).
        _check_close(logits, ref[f"layer{li}_router_logits"], 1e-5, f"{case} layer {li} router logits")
        np.testing.assert_array_equal(np.asarray(ids), ref[f"layer{li}_topk_ids"])
        np.testing.assert_allclose(np.asarray(tw), ref[f"layer{li}_topk_weights"], rtol=1e-5, atol=1e-6)
        want = ref[f"layer{li}_out_float"]
        experts = layer.experts.to_jax()
        y = _fused(jnp.asarray(x), tw, ids, experts)
        assert y.dtype == jnp.float32
        _check_close(y, want, FLOAT_RTOL, f"{case} layer {li} loader layout")
        for b in sorted(supported, key=lambda b: b.value):
            w = TABLE[b].convert(ckpt.scheme, experts)
            _check_close(_fused_dense(jnp.asarray(x), tw, ids, w), want, FLOAT_RTOL,
                         f"{case} layer {li} {b} layout")


@pytest.mark.parametrize("case", CASES)
def test_layer_against_tool_forward(case, refs, checkpoints):
    """jit(fused_moe) in float32 vs the tool's own 16-bit forward (out_tool)."""
    d, meta, ref = refs(case)
    ckpt = checkpoints(d)
    mc = ckpt.model_config
    rtol = TOOL_RTOL[meta["tool"]["tool_dtype"]]
    for li in ckpt.moe_layer_indices:
        layer = ckpt.load_layer(li)
        x = ref[f"layer{li}_x"]
        _, (tw, ids) = _route(layer.router, x, mc.top_k, mc.renormalize)
        y = _fused(jnp.asarray(x), tw, ids, layer.experts.to_jax())
        tool = ref[f"layer{li}_out_tool"].astype(np.float64)
        assert np.isfinite(tool).all()
        _check_rel_fro(y, tool, rtol, f"{case} layer {li} vs the tool's forward")


@pytest.mark.parametrize("case", CASES)
def test_quantized_moe_layer_from_checkpoint(case, refs):
    """The Flax NNX layer built straight from the checkpoint directory routes by itself."""
    d, meta, ref = refs(case)
    for li in ref["layers"].tolist():
        layer = QuantizedMoE.from_checkpoint(d, li, backend="loader")
        y = _apply(layer, jnp.asarray(ref[f"layer{li}_x"]))
        _check_close(y, ref[f"layer{li}_out_float"], FLOAT_RTOL, f"{case} layer {li} QuantizedMoE")


# ----------------------------------------------------------------------------- whole-model data


def _wordlevel_encode(tokenizer_json: str, text: str) -> list[int]:
    """tokenizer.json is a ``tokenizers`` WordLevel model with whitespace pre-tokenization."""
    with open(tokenizer_json) as f:
        tok = json.load(f)
    assert tok["model"]["type"] == "WordLevel"
    vocab = tok["model"]["vocab"]
    return [vocab.get(w, vocab[tok["model"]["unk_token"]]) for w in text.split()]


@pytest.mark.parametrize("case", CASES)
def test_whole_model_reference_is_consistent(case, refs, checkpoints):
    """The stored whole-model data (for the whole-model loader): the prompt is the tokenizer's
    encoding of the stored text, the logits are finite and shaped [prompt, vocab], the greedy
    continuation is the argmax chain of a float32 run, and the tool's own logits agree with the
    float32 ones within 16-bit rounding."""
    d, meta, ref = refs(case)
    ckpt = checkpoints(d)
    vocab = int(ckpt.config["vocab_size"])
    ids = ref["prompt_ids"]
    assert 8 <= len(ids) <= 12
    assert _wordlevel_encode(os.path.join(d, "tokenizer.json"), str(ref["prompt_text"])) == ids.tolist()
    lf, lt = ref["logits_float"].astype(np.float64), ref["logits_tool"].astype(np.float64)
    assert lf.shape == lt.shape == (len(ids), vocab)
    assert np.isfinite(lf).all() and np.isfinite(lt).all()
    gen = ref["generated_ids"]
    assert gen.shape == (32,) and ((0 <= gen) & (gen < vocab)).all()
    # The first generated token is the argmax of the last prompt position, with a clear margin.
    assert gen[0] == int(np.argmax(lf[-1]))
    assert (ref["generated_margins"] > 1e-3).all()
    # Two 16-bit layers, attention included, between the tool and the float32 run: twice the
    # per-layer bound (measured 7.2e-3 .. 8.2e-3 for bf16, 9.1e-4 .. 1.1e-3 for fp16).
    _check_rel_fro(lt, lf, 2 * TOOL_RTOL[meta["tool"]["tool_dtype"]], f"{case} whole-model logits")
