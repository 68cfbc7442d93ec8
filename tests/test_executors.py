"""The executor registry (:mod:`wna16_jax.executors`): which executor runs a layer on which device
and why the others refused (``select``), the fallback warning, the dispatch table's preparation
of the engines' layouts (``BackendSpec.prepare`` / ``executor_reason`` / ``wgmma_reason``, the
``WNA16_JAX_GPU_KERNELS`` override), and the kernels' errors turned into the library's at the
engines' boundary. Devices are described explicitly (``Device``), so every case runs on the CPU;
the layers the CPU can run are checked against the float64 reference."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import ON_GPU, SCHEMES, layer_case, layer_close, reference
from wna16_jax import executors, moe
from wna16_jax.backends import TABLE, Backend, Device
from wna16_jax.writers import random_checkpoint_weights
from wna16_jax.convert.tiles import TileWeights, convert_tiles
from wna16_jax.convert.wgmma import WgmmaWeights, convert_wgmma
from wna16_jax.errors import (ConfigError, DTypeError, ShapeError, UnsupportedError, WNA16Error, from_kernel_error,
                              kernel_errors)

H200, A100, B200 = Device("gpu", "H200", (9, 0)), Device("gpu", "A100", (8, 0)), Device("gpu", "B200", (10, 0))
CPU = Device("cpu", "cpu")


@pytest.fixture
def layer():
    """A small AWQ layer (loader layout, numpy), 5 tokens top-2, its tile and wgmma layouts."""
    w, x, tw, ids, em = layer_case(np.random.default_rng(), SCHEMES["awq_g128"], 4, 256, 128, 5, 2)
    return w, x, tw, ids, convert_tiles(w.to_jax()), convert_wgmma(w.to_jax())


def test_registry_order_and_names():
    assert executors.REGISTRY == (executors.WGMMA, executors.TRITON, executors.XLA)
    assert executors.ENGINES == (executors.WGMMA, executors.TRITON)
    assert set(executors.BY_NAME) == {"wgmma", "triton", "xla", "triton_interpret"}
    assert executors.EXECUTOR_CHOICES == ("auto", "pallas", "wgmma", "triton", "xla", "triton_interpret")
    assert executors.TRITON_INTERPRET not in executors.REGISTRY      # by name only, never "auto"
    with pytest.raises(ConfigError, match="executor: expected one of"):
        executors.select(None, jnp.bfloat16, executor="engine", device=CPU)


def test_select_reasons(layer):
    """Each layout on each device: the first executor that supports it, and the reasons of those
    before it; whether that fallback deserves a warning (an engine that reads the layout refused
    it on an NVIDIA GPU)."""
    w, _, _, _, tiles, wg = layer
    bf, f32 = jnp.bfloat16, jnp.float32

    def sel(weights, dtype=bf, device=H200, **kw):
        return executors.select(weights, dtype, device=device, **kw)

    c = sel(wg)
    assert c.executor is executors.WGMMA and c.refused == () and c.reason is None
    c = sel(tiles)                                     # the wgmma engine does not read the tile layout
    assert c.executor is executors.TRITON and [n for n, _ in c.refused] == ["wgmma"]
    assert "not the wgmma layout" in c.reason and not executors.fallback_warning_applies(tiles, c, H200)
    for dev in (A100, B200):                           # the wgmma layout off Hopper: XLA, with the reason
        c = sel(wg, device=dev)
        assert c.executor is executors.XLA and "SM90" in c.reason and "MARLIN-row layout" in c.reason
        assert executors.fallback_warning_applies(wg, c, dev)
    assert sel(tiles, device=A100).executor is executors.TRITON          # every NVIDIA GPU from SM75
    for weights in (wg, tiles):
        c = sel(weights, f32)
        assert c.executor is executors.XLA and "float32" in c.reason and executors.fallback_warning_applies(
            weights, c, H200)
        c = sel(weights, bf, formulation="dense")
        assert c.executor is executors.XLA and "formulation='dense'" in c.reason
        c = sel(weights, bf, compute_dtype=f32)
        assert c.executor is executors.XLA and "compute_dtype=float32" in c.reason
        c = sel(weights, device=CPU)
        assert c.executor is executors.XLA and "NVIDIA GPU" in c.reason
        assert not executors.fallback_warning_applies(weights, c, CPU)
    loader = w.to_jax()                                # no engine reads the loader layout: no warning
    c = sel(loader)
    assert c.executor is executors.XLA and not executors.fallback_warning_applies(loader, c, H200)
    with pytest.raises(UnsupportedError, match="not the wgmma layout"):
        sel(tiles, executor="wgmma")
    with pytest.raises(UnsupportedError, match="wgmma: .*triton: "):
        sel(wg, f32, executor="pallas")
    assert sel(wg, executor="xla").executor is executors.XLA
    assert sel(tiles, executor="triton").executor is executors.TRITON
    # the batched-experts format has no wgmma form: among the Triton-lowered engine and XLA
    assert sel(wg, among=(executors.TRITON, executors.XLA)).executor is executors.XLA


def test_select_marlin_layout():
    """vLLM's Marlin layout runs on the Triton-lowered engine (re-laid as tiles per call) on an
    NVIDIA GPU, and not where it was prepared for 8-bit activations."""
    w = random_checkpoint_weights(np.random.default_rng(), SCHEMES["gptq4_g128_actorder"], 2, 256, 128).to_jax()
    mw = TABLE[Backend.MARLIN].convert(w.scheme, w)
    assert type(mw).__name__ == "MarlinWeights"
    assert executors.select(mw, jnp.bfloat16, device=H200).executor is executors.TRITON
    assert executors.select(mw, jnp.bfloat16, device=CPU).executor is executors.XLA
    m8 = TABLE[Backend.MARLIN].convert(w.scheme, w, jnp.int8)
    c = executors.select(m8, jnp.bfloat16, device=H200)
    assert c.executor is executors.XLA and "16-bit activations" in c.reason


@pytest.mark.skipif(ON_GPU, reason="the CPU's dispatch")
def test_dispatch_on_cpu_uses_xla_with_reason(layer):
    """On the CPU every layout runs on the XLA executor (the engines say they need an NVIDIA GPU),
    with no fallback warning (XLA is simply the executor there), and matches the float64
    reference; asking for an engine is an error with the reasons."""
    w, x, tw, ids, tiles, wg = layer
    for weights in (tiles, wg):
        c = executors.select(weights, jnp.bfloat16)
        assert c.executor is executors.XLA and "NVIDIA GPU" in c.reason
        with pytest.raises(UnsupportedError, match="NVIDIA GPU"):
            executors.select(weights, jnp.bfloat16, executor="pallas")
        with warnings.catch_warnings():
            warnings.simplefilter("error", moe.EngineFallbackWarning)
            got = moe.fused_moe(x, tw, ids, weights)
        layer_close(got, reference(w, x, tw, ids, None))
        with pytest.raises(UnsupportedError, match="NVIDIA GPU"):
            moe.fused_moe(x, tw, ids, weights, executor="pallas")


def test_fallback_warning(monkeypatch, layer):
    """An engine layout that falls back to XLA on an NVIDIA GPU warns once per reason, naming it:
    the wgmma layout on an A100, the tile layout with float32 activations; the layer (XLA, run
    here on the CPU) stays right."""
    w, x, tw, ids, tiles, wg = layer
    monkeypatch.setattr(moe, "_WARNED", set())
    monkeypatch.setattr(Device, "current", classmethod(lambda cls, d=None: A100))
    with pytest.warns(moe.EngineFallbackWarning, match="SM90"):
        got = moe.fused_moe(x, tw, ids, wg)
    layer_close(got, reference(w, x, tw, ids, None))
    with warnings.catch_warnings():                    # the same reason again: no second warning
        warnings.simplefilter("error", moe.EngineFallbackWarning)
        moe.fused_moe(x, tw, ids, wg)
    monkeypatch.setattr(Device, "current", classmethod(lambda cls, d=None: H200))
    with pytest.warns(moe.EngineFallbackWarning, match="float32"):
        got = moe.fused_moe(x.astype(jnp.float32), tw, ids, tiles)
    layer_close(got, reference(w, x, tw, ids, None), tol=1e-5)            # exact float32 XLA
    with warnings.catch_warnings():                    # the loader layout: XLA is its executor
        warnings.simplefilter("error", moe.EngineFallbackWarning)
        moe.fused_moe(x.astype(jnp.float32), tw, ids, w.to_jax())


def test_table_prepares_wgmma_layout_for_hopper(monkeypatch, layer):
    """MARLIN on a Hopper GPU prepares the wgmma layout for the 4-bit layers the wgmma kernels
    take, the tile layout otherwise (with the reason), ``WNA16_JAX_GPU_KERNELS`` overrides;
    BATCHED_MARLIN prepares tiles; off the NVIDIA GPUs the row's own layout (XLA)."""
    w4, x, tw, ids, tiles, _ = layer
    rng = np.random.default_rng()
    marlin, batched = TABLE[Backend.MARLIN], TABLE[Backend.BATCHED_MARLIN]
    w8 = random_checkpoint_weights(rng, SCHEMES["gptq8_channel"], 4, 256, 128)
    w64 = random_checkpoint_weights(rng, SCHEMES["gptq4_g64"], 4, 256, 128)
    assert marlin.wgmma_reason(w4, H200) is None
    assert "SM90" in marlin.wgmma_reason(w4, A100) and "SM90" in marlin.wgmma_reason(w4, B200)
    assert "8-bit" in marlin.wgmma_reason(w8, H200) and "group size 64" in marlin.wgmma_reason(w64, H200)
    assert "batched" in batched.wgmma_reason(w4, H200)
    assert marlin.executor_reason(w4, H200) is None and batched.executor_reason(w4, A100) is None
    assert "NVIDIA GPU" in marlin.executor_reason(w4, CPU)
    assert "no GPU engine" in TABLE[Backend.CPU].executor_reason(w4, CPU)
    wg = marlin.prepare(w4.scheme, w4.to_jax(), device=H200)
    assert isinstance(wg, WgmmaWeights) and wg.w13_scales.dtype == jnp.bfloat16
    assert marlin.prepare(w4.scheme, w4.to_jax(), jnp.float16, device=H200).w13_scales.dtype == jnp.float16
    for other, dev in ((w8, H200), (w64, H200), (w4, A100)):
        assert isinstance(marlin.prepare(other.scheme, other.to_jax(), device=dev), TileWeights)
    assert isinstance(batched.prepare(w4.scheme, w4.to_jax(), device=H200), TileWeights)
    assert type(marlin.prepare(w4.scheme, w4.to_jax(), device=CPU)).__name__ == "MarlinWeights"
    monkeypatch.setenv("WNA16_JAX_GPU_KERNELS", "triton")
    assert isinstance(marlin.prepare(w4.scheme, w4.to_jax(), device=H200), TileWeights)
    assert "WNA16_JAX_GPU_KERNELS=triton" in marlin.wgmma_reason(w4, H200)
    monkeypatch.setenv("WNA16_JAX_GPU_KERNELS", "wgmma")
    assert isinstance(marlin.prepare(w4.scheme, w4.to_jax(), device=H200), WgmmaWeights)
    with pytest.raises(UnsupportedError, match="WNA16_JAX_GPU_KERNELS=wgmma: .*8-bit"):
        marlin.prepare(w8.scheme, w8.to_jax(), device=H200)
    monkeypatch.setenv("WNA16_JAX_GPU_KERNELS", "fastest")
    with pytest.raises(ConfigError, match="WNA16_JAX_GPU_KERNELS"):
        marlin.wgmma_reason(w4, H200)
    monkeypatch.delenv("WNA16_JAX_GPU_KERNELS")
    # the wgmma layout is exactly the checkpoint, and its tile view is the tile conversion
    np.testing.assert_array_equal(np.asarray(convert_tiles(wg).w13_qweight), np.asarray(tiles.w13_qweight))
    if not ON_GPU:                                     # run here: the XLA executor, exact
        layer_close(jax.jit(moe.fused_moe)(x, tw, ids, wg), reference(w4, x, tw, ids, None))


def test_kernel_errors_at_the_library_boundary(layer):
    """The kernels raise their own errors (``KernelError``, ValueErrors); the engines and the
    converters turn them into the library's (``WNA16Error``) of the same kind, same message."""
    from pallas_kernels import errors as k

    _, x, tw, ids, tiles, wg = layer
    for kind, lib in ((k.KernelConfigError, ConfigError), (k.KernelShapeError, ShapeError),
                      (k.KernelDTypeError, DTypeError), (k.KernelUnsupportedError, UnsupportedError)):
        err = from_kernel_error(kind("the message"))
        assert type(err) is lib and str(err) == "the message" and isinstance(err, WNA16Error)
        with pytest.raises(lib, match="the message"):
            with kernel_errors():
                raise kind("the message")
    with pytest.raises(ValueError, match="not a kernel error"):             # others pass through
        with kernel_errors():
            raise ValueError("not a kernel error")
    opts = dict(activation="silu", apply_router_weight_on_input=False, global_num_experts=4, block_m=None)
    for engine, weights in ((executors.TRITON, tiles), (executors.WGMMA, wg)):
        with pytest.raises(DTypeError, match="hidden_states"):
            engine.run(x.astype(jnp.float32), tw, ids, weights, None, **opts)
        with pytest.raises(ShapeError, match="hidden_states"):
            engine.run(x[:, :128], tw, ids, weights, None, **opts)
        with pytest.raises(ConfigError, match="activation"):
            engine.run(x, tw, ids, weights, None, **{**opts, "activation": "relu"})
    with pytest.raises(DTypeError, match="batched_hidden"):
        executors.TRITON.batched(jnp.zeros((4, 8, 256), jnp.float32), jnp.zeros((4,), jnp.int32), tiles,
                                 activation="silu")
    with pytest.raises(DTypeError, match="hidden_states"):
        executors.TRITON.backward(jnp.zeros((5, 256), jnp.float32), x.astype(jnp.float32), tw, ids, wg, None, **opts)
