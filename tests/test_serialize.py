"""`wna16-jax convert`: every backend layout written to safetensors + manifest and read back into
the pytree that fused_moe runs, with the same result as the loader layout."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wna16_jax import routing
from wna16_jax.backends import TABLE, Backend
from wna16_jax.checkpoint import Checkpoint
from wna16_jax.writers import random_moe_layer, write_checkpoint
from wna16_jax.cli import main
from wna16_jax.errors import ConfigError, ShapeError, ValueRangeError
from wna16_jax.moe import fused_moe
from wna16_jax.schemes import QuantScheme
from wna16_jax.serialize import ConvertedCheckpoint, convert_checkpoint

CASES = [
    (QuantScheme("awq", 4, 64, True), "mixtral", Backend.MARLIN),
    (QuantScheme("awq", 4, 64, True), "mixtral", Backend.CPU),
    (QuantScheme("awq", 4, 64, True), "mixtral", Backend.HUMMING),
    (QuantScheme("gptq", 4, 64, False, True), "qwen3_moe", Backend.BATCHED_MARLIN),
    (QuantScheme("compressed-tensors", 4, 32, False), "deepseek_v3", Backend.FLASHINFER_TRTLLM),
    (QuantScheme("compressed-tensors", 4, 32, False), "deepseek_v3", Backend.XPU),
]


@pytest.mark.parametrize("scheme, model_type, backend", CASES, ids=lambda v: str(v))
def test_convert_round_trip(tmp_path, scheme, model_type, backend):
    rng = np.random.default_rng()
    src, out = tmp_path / "src", tmp_path / "out"
    write_checkpoint(src, scheme, [random_moe_layer(rng, 4, 256, 256, shared_intermediate=128
                                                    if model_type == "deepseek_v3" else None,
                                                    score_bias=model_type == "deepseek_v3")] * 2,
                     model_type=model_type)
    assert main(["convert", str(src), "--backend", backend.value, "--out", str(out), "--expert-chunk", "3"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["backend"] == backend.name and sorted(manifest["layers"]) == ["0", "1"]
    assert manifest["source"]["quantization_config"]["quant_method"] == scheme.method.value
    conv = ConvertedCheckpoint(out)
    assert conv.scheme == scheme and conv.backend is backend
    ckpt = Checkpoint(src)
    x = jnp.asarray(rng.standard_normal((5, 256)), jnp.float32)
    for li in conv.moe_layer_indices:
        got = conv.load_layer(li)
        ref_layer = ckpt.load_layer(li)
        want = TABLE[backend].convert(scheme, ref_layer.experts.to_jax())
        assert type(got.experts) is type(want)
        for a, b in zip(jax.tree_util.tree_leaves(got.experts), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))     # chunked == whole layer
        np.testing.assert_array_equal(got.router, ref_layer.router)
        tw, ids = routing.fused_topk(x @ jnp.asarray(got.router, jnp.float32).T, 2, renormalize=True)
        y = jax.jit(fused_moe)(x, tw, ids, got.experts.to_jax())
        y0 = jax.jit(fused_moe)(x, tw, ids, ref_layer.experts.to_jax())
        np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-5, atol=1e-5 * float(jnp.abs(y0).max()))
        if model_type == "deepseek_v3":
            assert got.shared_experts is not None and got.e_score_correction_bias is not None


def test_convert_refusals(tmp_path):
    rng = np.random.default_rng()
    src = tmp_path / "src"
    write_checkpoint(src, QuantScheme("gptq", 4, 64, False, True), [random_moe_layer(rng, 4, 128, 128)])
    with pytest.raises(ConfigError, match="act-order"):
        convert_checkpoint(src, "cpu", tmp_path / "o")
    assert main(["convert", str(src), "--backend", "nope", "--out", str(tmp_path / "o")]) == 2
    with pytest.raises(ConfigError, match="manifest.json"):
        ConvertedCheckpoint(tmp_path)
    out = convert_checkpoint(src, "marlin", tmp_path / "m", progress=False)
    with pytest.raises(ValueRangeError, match="layer_index: 3"):
        ConvertedCheckpoint(out).load_layer(3)
    m = json.loads((tmp_path / "m" / "manifest.json").read_text())
    m["layers"]["0"]["experts"]["tensors"]["w13_qweight"]["shape"][0] = 99
    (tmp_path / "m" / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ShapeError, match="w13_qweight"):
        ConvertedCheckpoint(out).load_layer(0)
