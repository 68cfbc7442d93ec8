"""A quantized dense linear on the wgmma kernels (``WgmmaLinearWeights``): the layout conversion
is exact (it decodes to the checkpoint's own codes, scales and zero points), and the GEMM glue
(rows padded to blocks, the configuration the heuristics pick, the K splits' sum, the bias) gives
``x Wᵀ + b`` — on the CPU with the kernel's jnp reference, on a Hopper GPU with the kernel."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wna16_jax import formats
from wna16_jax.writers import default_scale_dtype
from wna16_jax.errors import ConfigError
from wna16_jax.models.linear import (SUFFIXES, QuantizedLinear, QuantizedLinearWeights, WgmmaLinearWeights,
                                     _wgmma_matmul, engine_linear_reason, quantized_matmul, to_engine_linear)
from wna16_jax.quantize import quantize_rtn
from wna16_jax.schemes import QuantScheme

ON_HOPPER = jax.default_backend() == "gpu" and str(getattr(jax.devices()[0], "compute_capability", "")) == "9.0"
SCHEMES = {"gptq g128": QuantScheme("gptq", 4, 128, False), "awq g128": QuantScheme("awq", 4, 128, True),
           "ct channel": QuantScheme("compressed-tensors", 4, -1, False)}


def _linear(scheme, n, k, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32) / np.sqrt(k)
    q = quantize_rtn(w, scheme, scale_dtype=default_scale_dtype(scheme))
    t = formats.pack(scheme, q.codes, q.scales, q.zeros, q.g_idx)
    suff = {v: key for key, v in SUFFIXES[scheme.method].items()}
    fields = {suff[key]: v for key, v in t.items() if suff[key] in ("qweight", "scales", "qzeros")}
    if scheme.method.value == "gptq" and not scheme.zero_point:
        fields.pop("qzeros")
    b = (0.1 * rng.standard_normal(n)).astype(np.float16) if bias else None
    lw = QuantizedLinearWeights(**fields, bias=b, scheme=scheme, out_features=n, in_features=k)
    return jax.tree.map(jnp.asarray, lw), q


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_engine_layout_decodes_to_the_checkpoint(name):
    lw, q = _linear(SCHEMES[name], 192, 256)
    ew = to_engine_linear(lw, jnp.bfloat16)
    assert isinstance(ew, WgmmaLinearWeights) and ew.words.dtype == jnp.int16
    got, want = ew.decode(), lw.decode()
    np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(want.codes))
    np.testing.assert_array_equal(np.asarray(got.scales, np.float32),
                                  np.asarray(jnp.asarray(want.scales).astype(jnp.bfloat16), np.float32))
    if want.zeros is None:
        assert got.zeros is None
    else:
        np.testing.assert_array_equal(np.asarray(got.zeros), np.asarray(want.zeros))
    # the same bytes as the checkpoint's codes and 16-bit scales (zero points: 16-bit, biased)
    assert ew.words.size * 2 == lw.qweight.size * 4


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("lead", [(1,), (3, 5), (130,)])
def test_engine_glue_with_the_reference_gemm(name, lead):
    """Rows padded to whole blocks and sliced back, the K splits summed, the bias added: against
    float64 ``x Wᵀ + b`` on the bf16-rounded dequantized weight, at bf16 input rounding."""
    from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm_reference

    s = SCHEMES[name]
    lw, q = _linear(s, 192, 512, seed=len(lead))
    ew = to_engine_linear(lw, jnp.bfloat16)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal(lead + (512,)), jnp.bfloat16)
    f = jax.jit(functools.partial(_wgmma_matmul, compute_dtype=jnp.bfloat16, gemm=wgmma_grouped_gemm_reference))
    y = np.asarray(f(x, ew), np.float64)
    ref = np.asarray(x, np.float64) @ _kernel_weight64(q, s, 512).T + np.asarray(lw.bias, np.float64)
    assert y.shape == lead + (192,) and np.isfinite(y).all()
    err = np.abs(y - ref).max() / np.abs(ref).max()
    # float32 accumulation of exact bf16 products; an unsplit GEMM writes its output rounded to
    # bf16 once (unit roundoff 2^-9), which bounds the error, bias included, by 2^-8
    assert err < 2 ** -8, err


def test_quantized_linear_keeps_the_checkpoint_layout_off_hopper():
    lw, _ = _linear(SCHEMES["gptq g128"], 192, 256)
    layer = QuantizedLinear(lw, compute_dtype=jnp.bfloat16)
    if not ON_HOPPER:
        assert isinstance(layer.weight.get_value(), QuantizedLinearWeights)
        assert "SM90" in engine_linear_reason(lw)
        with pytest.raises(ConfigError, match="engine=True.*SM90"):
            QuantizedLinear(lw, compute_dtype=jnp.bfloat16, engine=True)
    with pytest.raises(ConfigError, match="executor='wgmma'.*QuantizedLinearWeights"):
        quantized_matmul(jnp.ones((2, 256), jnp.bfloat16), lw, executor="wgmma")


def test_engine_reasons():
    from wna16_jax.backends import Device

    h200 = Device("gpu", "H200", (9, 0))
    ok, _ = _linear(SCHEMES["gptq g128"], 192, 256)
    assert engine_linear_reason(ok, h200) is None
    assert "8-bit" in engine_linear_reason(_linear(QuantScheme("gptq", 8, 128, False), 192, 256)[0], h200)
    assert "group size 32" in engine_linear_reason(_linear(QuantScheme("gptq", 4, 32, False), 192, 256)[0], h200)
    assert "N=96" in engine_linear_reason(_linear(SCHEMES["gptq g128"], 96, 256)[0], h200)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("m", [1, 8, 64, 1000])
def test_engine_linear_on_hopper(name, m):
    from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm_reference

    lw, _ = _linear(SCHEMES[name], 2048, 1024, seed=m)
    layer = QuantizedLinear(lw, compute_dtype=jnp.bfloat16)
    ew = layer.weight.get_value()
    assert isinstance(ew, WgmmaLinearWeights)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 1024)), jnp.bfloat16)
    y = np.asarray(jax.jit(lambda x: layer(x))(x), np.float64)
    ref = np.asarray(jax.jit(functools.partial(_wgmma_matmul, compute_dtype=jnp.bfloat16,
                                               gemm=wgmma_grouped_gemm_reference))(x, ew), np.float64)
    assert np.isfinite(y).all()
    assert np.abs(y - ref).max() / np.abs(ref).max() < 8e-3        # the output's bf16 rounding, 2^-8


def _engine_linear(lw, dtype=jnp.bfloat16):
    """A QuantizedLinear holding ``lw`` in the wgmma layout, made on any backend (the constructor
    converts only on a Hopper GPU)."""
    return QuantizedLinear(None, compute_dtype=dtype,
                           _engine_weights=(to_engine_linear(lw, dtype), lw.scheme, (lw.out_features,)))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_fused_linears_are_the_separate_ones(name):
    """q, k and v (different N, one input) fused into one GEMM: each part of the fused output
    is that linear's own output, biases included, and the weights are the same bytes. Bound:
    the heuristics may split K differently for the wider GEMM, and an unsplit GEMM rounds its
    output to bf16 once (2^-9), so the two agree within 2^-8 of the largest output; a part
    read from another linear's columns is off by order one."""
    from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm_reference

    s = SCHEMES[name]
    lws = [_linear(s, n, 512, seed=10 + i)[0] for i, n in enumerate((256, 64, 64))]
    parts = [_engine_linear(lw) for lw in lws]
    fused = QuantizedLinear.fused(parts)
    assert fused.splits == (256, 64, 64) and fused.out_features == 384 and fused.in_features == 512
    assert fused.weight.get_value().words.size == sum(p.weight.get_value().words.size for p in parts)
    f = jax.jit(functools.partial(_wgmma_matmul, compute_dtype=jnp.bfloat16, gemm=wgmma_grouped_gemm_reference))
    x = jnp.asarray(np.random.default_rng().standard_normal((3, 512)), jnp.bfloat16)
    got = fused.split(f(x, fused.weight.get_value()))
    for g, p in zip(got, parts):
        want = np.asarray(f(x, p.weight.get_value()), np.float64)
        assert g.shape == want.shape and np.isfinite(np.asarray(g)).all()
        assert np.abs(np.asarray(g, np.float64) - want).max() <= 2 ** -8 * np.abs(want).max()


def test_linears_that_cannot_share_a_gemm_are_not_fused():
    s = SCHEMES["gptq g128"]
    a, b = _linear(s, 128, 512, seed=1)[0], _linear(s, 128, 512, seed=2, bias=False)[0]
    c = _linear(SCHEMES["ct channel"], 128, 512, seed=3, bias=True)[0]
    d = _linear(s, 128, 256, seed=4)[0]
    assert QuantizedLinear.fused([_engine_linear(a), _engine_linear(b)]) is None          # a bias on one only
    assert QuantizedLinear.fused([_engine_linear(a), _engine_linear(c)]) is None          # group 128 and channelwise
    assert QuantizedLinear.fused([_engine_linear(a), _engine_linear(d)]) is None          # different K
    assert QuantizedLinear.fused([_engine_linear(a), QuantizedLinear(a)]) is None         # one not on the engine
    assert QuantizedLinear.fused([_engine_linear(a)]) is None
    other = QuantizedLinear(None, compute_dtype=jnp.bfloat16, _engine_weights=(
        to_engine_linear(a, jnp.bfloat16), SCHEMES["awq g128"], (a.out_features,)))
    assert QuantizedLinear.fused([_engine_linear(a), other]) is None                        # another scheme
    assert QuantizedLinear.fused([_engine_linear(a), _engine_linear(_linear(s, 64, 512, seed=5)[0])]) is not None


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
    made = [_linear(s, 192, 512, seed=int(seed)) for seed in seeds]
    ews = [to_engine_linear(lw, jnp.bfloat16) for lw, _ in made]

    def gemm(*a, **kw):
        return jax.lax.stop_gradient(wgmma_grouped_gemm_reference(*a, **kw))

    mm = functools.partial(_wgmma_matmul, compute_dtype=jnp.bfloat16, gemm=gemm)
    x = jnp.asarray(np.random.default_rng().standard_normal((3, 7, 512)), jnp.bfloat16)
    if not stacked:
        _check_input_gradient(mm, x, ews[0], _kernel_weight64(made[0][1], s, 512))
        return
    stack = jax.tree.map(lambda *a: jnp.stack(a), *ews)
    for layer in (2, 0):
        _check_input_gradient(mm, x, LayerStack(stack, jnp.int32(layer)), _kernel_weight64(made[layer][1], s, 512))


@pytest.mark.gpu
@pytest.mark.skipif(not ON_HOPPER, reason="needs an NVIDIA Hopper GPU (runs on the device machine)")
@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("m", [1, 300])
def test_engine_linear_gradient_on_hopper(name, m):
    """The same backward with the kernel in the forward (which JAX cannot differentiate)."""
    s = SCHEMES[name]
    lw, q = _linear(s, 2048, 1024, seed=m)
    layer = QuantizedLinear(lw, compute_dtype=jnp.bfloat16)
    assert isinstance(layer.weight.get_value(), WgmmaLinearWeights)
    x = jnp.asarray(np.random.default_rng().standard_normal((m, 1024)), jnp.bfloat16)
    mm = functools.partial(quantized_matmul, out_dtype=jnp.float32)
    _check_input_gradient(mm, x, layer.weight.get_value(), _kernel_weight64(q, s, 1024))
