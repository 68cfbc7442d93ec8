"""A quantized dense linear on the wgmma kernels: the wgmma layout of one expert
(:func:`wna16_jax.convert.wgmma.wgmma_matrix`) is exact (it decodes to the checkpoint's own codes,
scales and zero points), and the registry's dense-linear glue (rows padded to blocks, the
configuration the heuristics pick, the K splits' sum, the bias) gives ``x Wᵀ + b`` — on the CPU with
the kernel's jnp reference, on a Hopper GPU with the kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wna16_jax import executors, formats
from wna16_jax.autodiff import matmul_trainable
from wna16_jax.convert.wgmma import WgmmaForm, wgmma_matrix
from wna16_jax.errors import ConfigError, UnsupportedError
from wna16_jax.matmul import quantized_matmul
from wna16_jax.models.linear import QuantizedLinear
from wna16_jax.quantize import quantize_rtn
from wna16_jax.schemes import QuantScheme
from wna16_jax.weights import CheckpointForm, QuantMatrix
from wna16_jax.writers import default_scale_dtype

ON_HOPPER = jax.default_backend() == "gpu" and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
SCHEMES = {"gptq g128": QuantScheme("gptq", 4, 128, False), "awq g128": QuantScheme("awq", 4, 128, True),
           "ct channel": QuantScheme("compressed-tensors", 4, -1, False)}


def _linear(scheme, n, k, seed=0, bias=True):
    """``(matrix, bias, q)``: a random ``[n, k]`` linear quantized and packed as the tools store it,
    as a one-expert checkpoint-form matrix, its 16-bit bias (or None) and the quantizer's output."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    q = quantize_rtn(w, scheme, scale_dtype=default_scale_dtype(scheme))
    m = QuantMatrix.from_stored(scheme, formats.pack(scheme, q.codes, q.scales, q.zeros, q.g_idx), n=n, k=k)
    b = jnp.asarray((0.1 * rng.standard_normal(n)).astype(np.float16)) if bias else None
    return jax.tree.map(jnp.asarray, m), b, q


def _reference_mm(gemm=None):
    """The wgmma executor's dense linear with the kernel's jnp reference (any device)."""
    from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm_reference

    return matmul_trainable("wgmma", gemm or wgmma_grouped_gemm_reference)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_engine_layout_decodes_to_the_checkpoint(name):
    lw, _, q = _linear(SCHEMES[name], 192, 256)
    ew = wgmma_matrix(lw, jnp.bfloat16)
    assert isinstance(ew.form, WgmmaForm) and ew.qvalue.dtype == jnp.int16
    got, want = ew.decode(), lw.decode()
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
    np.testing.assert_array_equal(np.asarray(got.scales, np.float32),
                                  np.asarray(jnp.asarray(want.scales).astype(jnp.bfloat16), np.float32))
    if want.zeros is None:
        assert got.zeros is None
    else:
        np.testing.assert_array_equal(np.asarray(got.zeros), np.asarray(want.zeros))
    # the same bytes as the checkpoint's codes and 16-bit scales (zero points: 16-bit, biased)
    assert ew.qvalue.size * 2 == lw.qvalue.size * 4


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("lead", [(1,), (3, 5), (130,)])
def test_engine_glue_with_the_reference_gemm(name, lead):
    """Rows padded to whole blocks and sliced back, the K splits summed, the bias added: against
    float64 ``x Wᵀ + b`` on the bf16-rounded dequantized weight, at bf16 input rounding."""
    s = SCHEMES[name]
    lw, bias, q = _linear(s, 192, 512, seed=len(lead))
    ew = wgmma_matrix(lw, jnp.bfloat16)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal(lead + (512,)), jnp.bfloat16)
    y = np.asarray(jax.jit(_reference_mm())(x, ew, bias), np.float64)
    ref = np.asarray(x, np.float64) @ _kernel_weight64(q, s, 512).T + np.asarray(bias, np.float64)
    assert y.shape == lead + (192,) and np.isfinite(y).all()
    err = np.abs(y - ref).max() / np.abs(ref).max()
    # float32 accumulation of exact bf16 products; an unsplit GEMM writes its output rounded to
    # bf16 once (unit roundoff 2^-9), which bounds the error, bias included, by 2^-8
    assert err < 2 ** -8, err


def test_quantized_linear_keeps_the_checkpoint_layout_off_hopper():
    lw, bias, _ = _linear(SCHEMES["gptq g128"], 192, 256)
    layer = QuantizedLinear(lw, bias, compute_dtype=jnp.bfloat16)
    if not ON_HOPPER:
        assert isinstance(layer.weight.get_value().form, CheckpointForm)
        assert "needs an NVIDIA GPU" in executors.WGMMA.prepares_matmul(lw.form)
        with pytest.raises(ConfigError, match="engine=True: no engine takes this linear: wgmma: .*NVIDIA GPU"):
            QuantizedLinear(lw, compute_dtype=jnp.bfloat16, engine=True)
    with pytest.raises(UnsupportedError, match="executor='wgmma'.*CheckpointForm is not the wgmma layout"):
        quantized_matmul(jnp.ones((2, 256), jnp.bfloat16), lw, executor="wgmma")


def test_engine_reasons():
    from wna16_jax.backends import Device

    h200 = Device("gpu", "H200", (9, 0))

    def reason(scheme, n, k, dtype=None):
        return executors.WGMMA.prepares_matmul(CheckpointForm(n, k, scheme), h200, dtype)

    assert reason(SCHEMES["gptq g128"], 192, 256) is None
    assert "8-bit" in reason(QuantScheme("gptq", 8, 128, False), 192, 256)
    assert "group size 32" in reason(QuantScheme("gptq", 4, 32, False), 192, 256)
    assert "act-order" in reason(QuantScheme("gptq", 4, 128, False, act_order=True), 192, 256)
    assert "N=96" in reason(SCHEMES["gptq g128"], 96, 256)
    assert "K=192" in reason(SCHEMES["gptq g128"], 128, 192)
    assert "SM90" in executors.WGMMA.prepares_matmul(CheckpointForm(192, 256, SCHEMES["gptq g128"]), Device("gpu", "A100", (8, 0)))
    assert "float32" in reason(SCHEMES["gptq g128"], 192, 256, jnp.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("m", [1, 8, 64, 1000])
def test_engine_linear_on_hopper(name, m):
    lw, bias, _ = _linear(SCHEMES[name], 2048, 1024, seed=m)
    layer = QuantizedLinear(lw, bias, compute_dtype=jnp.bfloat16)
    ew = layer.weight.get_value()
    assert isinstance(ew.form, WgmmaForm)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 1024)), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x: layer(x))(x), np.float64)
    ref = np.asarray(jax.jit(_reference_mm())(x, ew, bias), np.float64)
    assert np.isfinite(y).all()
    assert np.abs(y - ref).max() / np.abs(ref).max() < 8e-3        # the output's bf16 rounding, 2^-8


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_linears_read_as_one_matrix_are_the_separate_ones(name, tmp_path):
    """q, k and v (different N, one input) read as one matrix of three parts (the load-time
    concatenation) and laid out for the wgmma GEMM: each part of the one GEMM's output is that
    linear's own output, biases included, and the weights are the same bytes. Bound: the
    heuristics may split K differently for the wider GEMM, and an unsplit GEMM rounds its output
    to bf16 once (2^-9), so the two agree within 2^-8 of the largest output; a part read from
    another linear's columns is off by order one."""
    from safetensors.numpy import save_file

    from wna16_jax.checkpoint import Checkpoint, MatrixPart, read_matrix

    s, k, ns = SCHEMES[name], 512, (256, 64, 64)
    made = [_linear(s, n, k, seed=10 + i) for i, n in enumerate(ns)]
    rng = np.random.default_rng()
    tensors = {}
    for (_, b, q), proj in zip(made, ("w1", "w3", "w2")):
        for suffix, a in formats.pack(s, q.codes, q.scales, q.zeros, q.g_idx).items():
            tensors[f"model.layers.0.block_sparse_moe.experts.0.{proj}.{suffix}"] = a
        tensors[f"model.layers.0.block_sparse_moe.experts.0.{proj}.bias"] = np.asarray(b)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        '{"model_type": "mixtral", "num_local_experts": 1, "num_experts_per_tok": 1, "hidden_size": 512, '
        '"intermediate_size": 256, "quantization_config": ' + __import__("json").dumps(s.to_quant_config()) + "}")
    ckpt = Checkpoint(tmp_path)
    parts = [MatrixPart([{key.rsplit(".", 1)[1]: key for key in tensors if f".{proj}." in key}], n, proj)
             for proj, n in zip(("w1", "w3", "w2"), ns)]
    one, bias = read_matrix(ckpt, s, parts, k=k)
    fused = QuantizedLinear(one, bias[0], compute_dtype=jnp.bfloat16, splits=ns, engine=False)
    assert fused.splits == ns and fused.out_features == 384 and fused.in_features == k
    ew = wgmma_matrix(jax.tree.map(jnp.asarray, one), jnp.bfloat16)
    mm = jax.jit(_reference_mm())
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.bfloat16)
    got = fused.split(mm(x, ew, jnp.asarray(bias[0])))
    for g, (lw, b, _) in zip(got, made):
        want = np.asarray(mm(x, wgmma_matrix(lw, jnp.bfloat16), b), np.float64)
        assert g.shape == want.shape and np.isfinite(np.asarray(g)).all()
        assert np.abs(np.asarray(g, np.float64) - want).max() <= 2 ** -8 * np.abs(want).max()
    assert ew.qvalue.size == sum(wgmma_matrix(lw, jnp.bfloat16).qvalue.size for lw, _, _ in made)


def _kernel_weight64(q, s, k):
    """The weight the kernel multiplies by, in float64: scales in bf16, ``(c − z)·s`` rounded to
    bf16 once."""
    sc = np.asarray(jnp.asarray(q.scales, jnp.float32).astype(jnp.bfloat16), np.float64)
    g = np.arange(k) // s.group_size if s.group_size > 0 else np.zeros(k, int)
    z = 8.0 if q.zeros is None else q.zeros[:, g]
    return np.asarray(jnp.asarray((q.codes - z) * sc[:, g], jnp.float32).astype(jnp.bfloat16), np.float64)


def _check_input_gradient(mm, x, w, w64):
    """``jax.grad`` of ``<dy, mm(x, w)>`` in ``x`` is ``dy W`` (float64 reference on the weight the
    kernel sees) and the frozen weights' cotangents are zero. Bound: ``dy`` is rounded to bf16 for
    the backward GEMM (2^-9 each) and ``dx`` to the activations' bf16 (2^-9), float32
    accumulation: within 2^-7 of the largest |dx|; a missing, transposed or wrong-layer backward
    is off by order one."""
    dy = jnp.asarray(np.random.default_rng().standard_normal(x.shape[:-1] + (w64.shape[0],)), jnp.float32)
    dx, dw = jax.jit(jax.grad(lambda x, w: jnp.sum(mm(x, w) * dy), argnums=(0, 1), allow_int=True))(x, w)
    ref = np.asarray(dy, np.float64) @ w64
    got = np.asarray(dx, np.float64)
    assert dx.dtype == x.dtype and got.shape == ref.shape and np.isfinite(got).all()
    assert np.abs(got - ref).max() < 2 ** -7 * np.abs(ref).max(), np.abs(got - ref).max() / np.abs(ref).max()
    for leaf in jax.tree.leaves(dw):
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            assert not np.asarray(leaf).any()


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("stacked", [False, True])
def test_engine_linear_gradient_cpu(name, stacked):
    """A loss on the engine linear's output back-propagates to its input (fine-tuning the 16-bit
    layers around frozen quantized ones), for one linear and for one layer of a stack (a scanned
    decoder, the index traced). The GEMM's own output stops gradients here, as the Pallas kernel
    has no differentiation rule: only the linear's VJP can give ``dx``."""
    from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm_reference
    from wna16_jax.weights import LayerStack

    s = SCHEMES[name]
    seeds = np.random.default_rng().integers(0, 2 ** 31, 3)
    made = [_linear(s, 192, 512, seed=int(seed), bias=False) for seed in seeds]
    ews = [wgmma_matrix(lw, jnp.bfloat16) for lw, _, _ in made]

    def gemm(*a, **kw):
        return jax.lax.stop_gradient(wgmma_grouped_gemm_reference(*a, **kw))

    trainable = _reference_mm(gemm)

    def mm(x, w):
        return trainable(x, w, None)

    x = jnp.asarray(np.random.default_rng().standard_normal((3, 7, 512)), jnp.bfloat16)
    if not stacked:
        _check_input_gradient(mm, x, ews[0], _kernel_weight64(made[0][2], s, 512))
        return
    stack = jax.tree.map(lambda *a: jnp.stack(a), *ews)
    for layer in (2, 0):
        _check_input_gradient(mm, x, LayerStack(stack, jnp.int32(layer)), _kernel_weight64(made[layer][2], s, 512))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("m", [1, 300])
def test_engine_linear_gradient_on_hopper(name, m):
    """The same backward with the kernel in the forward (which JAX cannot differentiate)."""
    s = SCHEMES[name]
    lw, _, q = _linear(s, 2048, 1024, seed=m, bias=False)
    layer = QuantizedLinear(lw, compute_dtype=jnp.bfloat16)
    assert isinstance(layer.weight.get_value().form, WgmmaForm)
    x = jnp.asarray(np.random.default_rng().standard_normal((m, 1024)), jnp.bfloat16)
    mm = functools.partial(quantized_matmul, out_dtype=jnp.float32)
    _check_input_gradient(mm, x, layer.weight.get_value(), _kernel_weight64(q, s, 1024))
