"""The dispatch table: completeness, per-platform priority, selection, reasons, forcing."""

import warnings

import numpy as np
import pytest

from wna16_jax.backends import (
    _FALLBACK_WARNED,
    CONVERTING_BACKENDS,
    TABLE,
    Backend,
    BackendFallbackWarning,
    Device,
    backend_reasons,
    priority_backends,
    select_backend,
)
from wna16_jax.errors import BackendSelectionError, ConfigError, UnsupportedError, WNA16Error
from wna16_jax.schemes import QuantScheme

CPU = Device("cpu", "cpu")
H200 = Device("gpu", "NVIDIA H200", (9, 0))
B200 = Device("gpu", "NVIDIA B200", (10, 0))
XPU = Device("xpu", "Intel Data Center GPU Max")
ROCM = Device("rocm", "MI300X")
AWQ = QuantScheme("awq", 4, 128, True)
GPTQ = QuantScheme("gptq", 4, 128, False)
GPTQ_ACT = QuantScheme("gptq", 4, 128, False, True)
GPTQ8 = QuantScheme("gptq", 8, -1, False)
CT_G32 = QuantScheme("compressed-tensors", 4, 32, False)
CT8_ASYM = QuantScheme("compressed-tensors", 8, 64, True)


def test_table_is_complete():
    assert set(TABLE) == set(Backend) and len(Backend) == 7
    assert {b.name for b in CONVERTING_BACKENDS} == {"CPU", "XPU", "MARLIN", "BATCHED_MARLIN",
                                                     "FLASHINFER_TRTLLM", "HUMMING"}
    assert Backend.LOADER not in CONVERTING_BACKENDS
    for b, spec in TABLE.items():
        assert spec.backend is b and spec.layout and spec.executes_on


def test_priority_lists():
    assert priority_backends(CPU) == [Backend.CPU]
    assert priority_backends(XPU) == [Backend.XPU]
    assert priority_backends(H200) == [Backend.FLASHINFER_TRTLLM, Backend.MARLIN, Backend.BATCHED_MARLIN,
                                       Backend.HUMMING]


def test_current_device():
    import jax

    d = jax.devices()[0]
    cur = Device.current()
    if d.platform == "cpu":
        assert cur.platform == "cpu" and cur.compute_capability is None
        assert select_backend(GPTQ) is Backend.CPU
    else:   # an NVIDIA GPU (the device machine): SM90 on an H200
        assert cur.platform == "gpu" and cur.compute_capability == tuple(
            int(v) for v in str(d.compute_capability).split("."))
        assert select_backend(GPTQ) is Backend.MARLIN


def _fallback(scheme, device, **request):
    """select_backend's fallback: LOADER, with one warning that lists every refused row."""
    _FALLBACK_WARNED.clear()
    with pytest.warns(BackendFallbackWarning) as rec:
        assert select_backend(scheme, device, **request) is Backend.LOADER
    msg = str(rec[0].message)
    for b in CONVERTING_BACKENDS:        # every row is listed with its reason
        assert f"  {b.name}: " in msg
    with warnings.catch_warnings():      # once per scheme and device
        warnings.simplefilter("error")
        assert select_backend(scheme, device, **request) is Backend.LOADER
    return msg


def test_selection_on_cpu():
    assert select_backend(AWQ, CPU) is Backend.CPU
    assert select_backend(GPTQ, CPU) is Backend.CPU
    assert "act-order" in _fallback(GPTQ_ACT, CPU)
    assert "kInt8Static" in _fallback(GPTQ8, CPU)
    # the fallback cannot take int8 activations: then selection fails with every reason
    with pytest.raises(BackendSelectionError) as ei:
        select_backend(GPTQ8, CPU, input_dtype="int8")
    assert "LOADER" in str(ei.value) and "kInt8Static" in str(ei.value)


def test_forced_backend_from_environment(monkeypatch):
    monkeypatch.setenv("WNA16_JAX_BACKEND", "loader")
    assert select_backend(GPTQ, CPU) is Backend.LOADER
    monkeypatch.setenv("WNA16_JAX_BACKEND", "humming")
    with pytest.raises(UnsupportedError, match="HUMMING was forced"):
        select_backend(GPTQ, CPU)
    monkeypatch.setenv("WNA16_JAX_BACKEND", "nope")
    with pytest.raises(ConfigError, match="WNA16_JAX_BACKEND.*nope"):
        select_backend(GPTQ, CPU)


def test_loader_row_converts_nothing():
    from wna16_jax.writers import random_checkpoint_weights

    w = random_checkpoint_weights(np.random.default_rng(0), GPTQ8, 2, 128, 128)
    assert TABLE[Backend.LOADER].layout_supports(GPTQ8) is None
    assert TABLE[Backend.LOADER].convert(GPTQ8, w) is w
    assert TABLE[Backend.LOADER].prepare(GPTQ8, w, device=CPU) is w


def test_selection_on_gpus():
    assert select_backend(AWQ, H200) is Backend.MARLIN
    assert select_backend(GPTQ_ACT, H200) is Backend.MARLIN
    assert select_backend(GPTQ8, H200) is Backend.MARLIN
    assert select_backend(AWQ, H200, activation_format="batched") is Backend.BATCHED_MARLIN
    # FlashInfer TRT-LLM: rejected on an H200 with the SM100 reason
    r = TABLE[Backend.FLASHINFER_TRTLLM].supports(CT_G32, H200)
    assert "SM100" in r
    # 8-bit asym: only Humming's key family covers it, and Humming needs AWQ/GPTQ configs
    msg = _fallback(CT8_ASYM, H200)
    assert "kInt8StaticAsym" in msg and "compressed-tensors" in msg
    assert "ROCm" in _fallback(GPTQ, ROCM)
    assert "NVIDIA" in _fallback(GPTQ, Device("tpu", "TPU v5e"))


def test_trtllm_opt_in(monkeypatch):
    assert select_backend(CT_G32, B200) is Backend.MARLIN
    assert "opt-in" in TABLE[Backend.FLASHINFER_TRTLLM].supports(CT_G32, B200)
    monkeypatch.setenv("WNA16_JAX_USE_FLASHINFER_MOE_INT4", "1")
    assert select_backend(CT_G32, B200) is Backend.FLASHINFER_TRTLLM
    assert select_backend(GPTQ, B200) is Backend.MARLIN    # GPTQ's key does not encode g32
    assert "bias" in TABLE[Backend.FLASHINFER_TRTLLM].supports(CT_G32, B200, has_bias=True)


@pytest.mark.parametrize("scheme, device, backend, words", [
    (AWQ, XPU, Backend.XPU, ["4-bit symmetric"]),
    (GPTQ, H200, Backend.HUMMING, None),
    (CT_G32, H200, Backend.HUMMING, ["compressed-tensors"]),
    (GPTQ_ACT, H200, Backend.HUMMING, ["desc_act"]),
    (QuantScheme("awq", 4, 128, False), H200, Backend.MARLIN, ["zero-point"]),
    (GPTQ, CPU, Backend.MARLIN, ["NVIDIA"]),
    (GPTQ, Device("gpu", "T4", (7, 0)), Backend.MARLIN, ["7.5"]),
])
def test_reasons(scheme, device, backend, words):
    r = TABLE[backend].supports(scheme, device)
    if words is None:
        assert r is None
    else:
        for w in words:
            assert w in r


def test_marlin_shape_and_dtype_gates():
    m = TABLE[Backend.MARLIN]
    assert "multiple of 128" in m.supports(GPTQ, H200, hidden_size=2880)
    assert m.supports(GPTQ, H200, hidden_size=4096, intermediate_size=14336) is None
    act32 = QuantScheme("gptq", 4, 32, False, True)
    assert "act-order" in m.supports(act32, H200, hidden_size=4096, intermediate_size=1440)   # pads to 1472
    assert m.supports(act32, H200, hidden_size=4096, intermediate_size=1408) is None
    assert "group size 128" in m.supports(GPTQ, H200, intermediate_size=1440)
    assert "fp8 activations need SM89" in m.supports(GPTQ, H200, input_dtype="float8_e4m3fn")
    assert m.supports(GPTQ, Device("gpu", "L40S", (8, 9)), input_dtype="float8_e4m3fn") is None
    assert m.supports(GPTQ, H200, input_dtype="int8") is None
    with pytest.raises(ConfigError, match="input_dtype.*float64"):
        m.supports(GPTQ, H200, input_dtype="float64")


def test_forced_backend():
    assert select_backend(GPTQ, H200, backend="humming") is Backend.HUMMING
    with pytest.raises(UnsupportedError) as ei:
        select_backend(GPTQ_ACT, H200, backend=Backend.HUMMING)
    assert "forced" in str(ei.value) and "desc_act" in str(ei.value)
    with pytest.raises(ConfigError, match="backend.*triton"):
        select_backend(GPTQ, H200, backend="triton")


def test_reasons_listing_and_errors_are_typed():
    reasons = backend_reasons(GPTQ, CPU)
    assert set(reasons) == set(Backend) and reasons[Backend.CPU] is None and reasons[Backend.LOADER] is None
    assert issubclass(BackendSelectionError, WNA16Error)
    assert issubclass(UnsupportedError, NotImplementedError)
