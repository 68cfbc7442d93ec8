"""Writer → safetensors → loader round trips in every format, against an independent float64
dequantization (tests/reference.py), plus tensor-parallel slicing and the error cases."""

import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from reference import dequant_checkpoint, unpack_cols, unpack_rows
from wna16_jax import formats
from wna16_jax.checkpoint import Checkpoint, DenseWeights
from wna16_jax.writers import random_moe_layer, write_checkpoint
from wna16_jax.errors import (
    ConfigError,
    MissingTensorError,
    ShapeError,
    UnexpectedTensorError,
    ValueRangeError,
    WNA16Error,
)
from wna16_jax.quantize import quantize_rtn
from wna16_jax.schemes import QuantScheme

SCHEMES = {
    "awq_g32": QuantScheme("awq", 4, 32, True),
    "awq_g64": QuantScheme("awq", 4, 64, True),
    "awq_g128": QuantScheme("awq", 4, 128, True),
    "gptq4_g128": QuantScheme("gptq", 4, 128, False),
    "gptq4_channel": QuantScheme("gptq", 4, -1, False),
    "gptq4_g32_actorder": QuantScheme("gptq", 4, 32, False, True),
    "gptq8_g64": QuantScheme("gptq", 8, 64, False),
    "gptq8_channel": QuantScheme("gptq", 8, -1, False),
    "gptq8_g32_actorder": QuantScheme("gptq", 8, 32, False, True),
    "gptq4_asym_v1": QuantScheme("gptq", 4, 64, True),
    "gptq4_asym_v2": QuantScheme("gptq", 4, 64, True, gptq_checkpoint_format="gptq_v2"),
    "ct4_sym_g128": QuantScheme("compressed-tensors", 4, 128, False),
    "ct4_asym_g32": QuantScheme("compressed-tensors", 4, 32, True),
    "ct4_sym_channel": QuantScheme("compressed-tensors", 4, -1, False),
    "ct8_sym_g64": QuantScheme("compressed-tensors", 8, 64, False),
    "ct8_asym_channel": QuantScheme("compressed-tensors", 8, -1, True),
    "ct4_actorder": QuantScheme("compressed-tensors", 4, 32, False, True),
}
E, H, I = 4, 128, 128


@pytest.fixture(params=sorted(SCHEMES))
def scheme(request):
    return SCHEMES[request.param]


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe"])
def test_round_trip(tmp_path, scheme, model_type):
    rng = np.random.default_rng()
    shared = model_type in ("deepseek_v3", "qwen2_moe")
    bias = scheme.may_have_bias and model_type == "mixtral"
    layers = [random_moe_layer(rng, E, H, I, bias=bias, shared_intermediate=128 if shared else None,
                               shared_gate=model_type == "qwen2_moe", score_bias=model_type == "deepseek_v3")
              for _ in range(2)]
    write_checkpoint(tmp_path, scheme, layers, model_type=model_type,
                     max_shard_bytes=40_000 if model_type == "qwen3_moe" else None)
    ckpt = Checkpoint(tmp_path)
    assert ckpt.scheme == scheme and ckpt.moe_layer_indices == [0, 1]
    assert ckpt.model_config.num_experts == E and ckpt.model_config.hidden_size == H
    if model_type == "qwen3_moe":
        assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    for li, layer in enumerate(ckpt.iter_layers(progress=False)):
        w = layer.experts
        assert (w.num_experts, w.hidden_size, w.intermediate_size) == (E, H, I)
        ref13, ref2 = dequant_checkpoint(w, scheme)
        got13, got2 = w.to_jax().dequantize()
        # dequantization is exact in float32: equal to the independent float64 reference
        np.testing.assert_array_equal(np.asarray(got13, np.float64), ref13)
        np.testing.assert_array_equal(np.asarray(got2, np.float64), ref2)
        # and close to the float weights that were quantized (RTN error bound: half a step)
        f13 = np.concatenate([layers[li].w1, layers[li].w3], axis=1)
        step = 1.0 / (1 << scheme.bits)
        assert np.abs(ref13 - f13).max() <= 2.5 * step * np.abs(f13).max()
        assert np.abs(ref2 - layers[li].w2).max() <= 2.5 * step * np.abs(layers[li].w2).max()
        np.testing.assert_allclose(layer.router.astype(np.float32), layers[li].router, rtol=1e-2, atol=1e-3)
        if bias:
            np.testing.assert_allclose(np.asarray(w.w13_bias, np.float32),
                                       np.concatenate([layers[li].b1, layers[li].b3], 1), rtol=1e-3, atol=1e-3)
        else:
            assert w.w13_bias is None and w.w2_bias is None
        if shared:
            assert layer.shared_experts is not None and layer.shared_experts.num_experts == 1
            s13, _ = layer.shared_experts.dequantize()
            sf = np.concatenate(layers[li].shared[:2])
            assert np.abs(np.asarray(s13)[0] - sf).max() <= 2.5 * step * np.abs(sf).max()
        if model_type == "qwen2_moe":
            assert layer.shared_expert_gate.shape == (1, H)
        if model_type == "deepseek_v3":
            np.testing.assert_allclose(layer.e_score_correction_bias, layers[li].e_score_correction_bias)


def test_packed_bits_follow_the_spec(scheme):
    """Every packed tensor decodes, with the bit rules of docs/formats.md, to the codes that were packed."""
    rng = np.random.default_rng()
    w = rng.standard_normal((96, 128)).astype(np.float32)
    q = quantize_rtn(w, scheme)
    t = formats.pack(scheme, q.codes, q.scales, q.zeros, q.g_idx)
    b = scheme.bits
    m = scheme.method.value
    if m == "awq":
        np.testing.assert_array_equal(unpack_cols(t["qweight"], b, 96, awq=True).T, q.codes)
        np.testing.assert_array_equal(unpack_cols(t["qzeros"], b, 96, awq=True).T, q.zeros)
    elif m == "gptq":
        np.testing.assert_array_equal(unpack_rows(t["qweight"], b, 128).T, q.codes)
        z = unpack_cols(t["qzeros"], b, 96).T
        want = q.zeros if q.zeros is not None else np.full(z.shape, 1 << (b - 1))
        if scheme.gptq_zeros_minus_one:
            want = (want - 1) % (1 << b)   # AutoGPTQ v1 stores z - 1
        np.testing.assert_array_equal(z, want)
        assert t["g_idx"].shape == (128,)
    else:
        np.testing.assert_array_equal(unpack_cols(t["weight_packed"], b, 128), q.codes)
        if q.zeros is not None:
            np.testing.assert_array_equal(unpack_rows(t["weight_zero_point"], b, 96), q.zeros)
        assert list(t["weight_shape"]) == [96, 128]


@pytest.mark.parametrize("key", ["gptq4_channel", "gptq4_g32_actorder", "ct4_asym_g32", "awq_g32", "ct8_sym_g64"])
def test_tensor_parallel_slices(tmp_path, key):
    scheme = SCHEMES[key]
    rng = np.random.default_rng()
    write_checkpoint(tmp_path, scheme, [random_moe_layer(rng, E, H, 256, bias=scheme.may_have_bias)])
    ckpt = Checkpoint(tmp_path)
    full13, full2 = (np.asarray(a) for a in ckpt.load_layer(0).experts.dequantize())
    for tp in (2, 4):
        for r in range(tp):
            part = ckpt.load_layer(0, tp_size=tp, tp_rank=r).experts
            loc = 256 // tp
            assert part.intermediate_size == loc
            p13, p2 = (np.asarray(a) for a in part.dequantize())
            sl = slice(r * loc, (r + 1) * loc)
            np.testing.assert_array_equal(p13, np.concatenate([full13[:, sl], full13[:, 256 + r * loc:256 + (r + 1) * loc]], 1))
            np.testing.assert_array_equal(p2, full2[:, :, sl])
            if part.w2_bias is not None:
                np.testing.assert_array_equal(np.asarray(part.w2_bias), np.asarray(ckpt.load_layer(0).experts.w2_bias))


def test_unquantized_shared_expert(tmp_path):
    rng = np.random.default_rng()
    layer = random_moe_layer(rng, E, H, I, shared_intermediate=128)
    write_checkpoint(tmp_path, SCHEMES["ct4_sym_g128"], [layer], model_type="deepseek_v3", quantize_shared=False)
    got = Checkpoint(tmp_path).load_layer(0).shared_experts
    assert isinstance(got, DenseWeights)
    s13, s2 = got.dequantize()
    np.testing.assert_allclose(np.asarray(s13)[0], np.concatenate(layer.shared[:2]), rtol=1e-2, atol=1e-3)


# ----------------------------------------------------------------------------- bad input

def _write(tmp_path, scheme=SCHEMES["gptq4_g128"], **kw):
    rng = np.random.default_rng()
    write_checkpoint(tmp_path, scheme, [random_moe_layer(rng, E, H, I)], **kw)
    return tmp_path / "model.safetensors"


def _edit(path, fn):
    t = load_file(path)
    fn(t)
    save_file(t, path)


def test_unrecognised_naming(tmp_path):
    f = _write(tmp_path)
    _edit(f, lambda t: [t.__setitem__(k.replace("block_sparse_moe.experts", "ffn.moe"), t.pop(k)) for k in list(t)])
    with pytest.raises(ConfigError) as ei:
        Checkpoint(tmp_path)
    assert "no MoE expert tensors recognised" in str(ei.value) and "ffn.moe" in str(ei.value)


def test_missing_tensor(tmp_path):
    f = _write(tmp_path)
    name = "model.layers.0.block_sparse_moe.experts.2.w3.scales"
    _edit(f, lambda t: t.pop(name))
    with pytest.raises(MissingTensorError, match=name.replace(".", r"\.")):
        Checkpoint(tmp_path).load_layer(0)


def test_extra_tensor(tmp_path):
    f = _write(tmp_path)
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight_scale_2"
    _edit(f, lambda t: t.__setitem__(name, np.zeros(3, np.float16)))
    with pytest.raises(UnexpectedTensorError, match="weight_scale_2"):
        Checkpoint(tmp_path).load_layer(0)


def test_wrong_shape(tmp_path):
    f = _write(tmp_path)
    name = "model.layers.0.block_sparse_moe.experts.1.w1.qweight"
    _edit(f, lambda t: t.__setitem__(name, t[name][:, :64].copy()))
    with pytest.raises(ShapeError) as ei:
        Checkpoint(tmp_path).load_layer(0)
    assert "differ between experts" in str(ei.value) or "expected shape" in str(ei.value)


def test_wrong_dtype(tmp_path):
    f = _write(tmp_path)
    _edit(f, lambda t: [t.__setitem__(k, t[k].astype(np.int64)) for k in list(t) if k.endswith("qweight")])
    # the message names the tensor as the file names it, and the dtype it has in the file
    with pytest.raises(WNA16Error, match=r"experts\.0\.w1\.qweight \(in model\.safetensors\).*int32.*int64"):
        Checkpoint(tmp_path).load_layer(0)


def test_g_idx_out_of_range(tmp_path):
    f = _write(tmp_path, SCHEMES["gptq4_g32_actorder"])
    for role in ("w1", "w3"):
        name = f"model.layers.0.block_sparse_moe.experts.0.{role}.g_idx"
        _edit(f, lambda t, name=name: t.__setitem__(name, np.where(np.arange(H) == 5, 99, t[name]).astype(np.int32)))
    with pytest.raises(ValueRangeError, match=r"experts\.0\.w1\.g_idx.*\[0, 4\).*99"):
        Checkpoint(tmp_path).load_layer(0)


def test_gate_up_g_idx_differ(tmp_path):
    f = _write(tmp_path, SCHEMES["gptq4_g32_actorder"])
    name = "model.layers.0.block_sparse_moe.experts.3.w1.g_idx"
    _edit(f, lambda t: t.__setitem__(name, t[name][::-1].copy()))
    with pytest.raises(ValueRangeError, match="w3.g_idx .*g_idx differs from .*w1.s; the fused matrix holds one g_idx"):
        Checkpoint(tmp_path).load_layer(0)


def test_g_idx_without_desc_act(tmp_path):
    f = _write(tmp_path, SCHEMES["gptq8_g64"])
    name = "model.layers.0.block_sparse_moe.experts.0.w2.g_idx"
    _edit(f, lambda t: t.__setitem__(name, t[name][::-1].copy()))
    with pytest.raises(ConfigError, match="desc_act"):
        Checkpoint(tmp_path).load_layer(0)


def test_group_size_does_not_divide(tmp_path):
    _write(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ShapeError, match="128 is not a multiple of 96"):
        Checkpoint(tmp_path).load_layer(0)


def test_bad_layer_and_tp(tmp_path):
    _write(tmp_path)
    ckpt = Checkpoint(tmp_path)
    with pytest.raises(ValueRangeError, match=r"layer_index: 7.*\[0\]"):
        ckpt.load_layer(7)
    with pytest.raises(ConfigError, match="tp_rank"):
        ckpt.load_layer(0, tp_size=2, tp_rank=2)
    with pytest.raises(ShapeError, match="not a multiple"):
        ckpt.load_layer(0, tp_size=4)       # 128 / 4 = 32 is not a whole number of 128-groups


def test_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "awq", "bits": 4,
                                                                              "group_size": 128}}))
    with pytest.raises(ConfigError, match="num_local_experts"):
        Checkpoint(tmp_path)


def test_quantize_does_not_mutate():
    rng = np.random.default_rng()
    w = rng.standard_normal((32, 64)).astype(np.float32)
    keep = w.copy()
    quantize_rtn(w, SCHEMES["awq_g32"])
    np.testing.assert_array_equal(w, keep)
