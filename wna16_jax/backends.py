"""The dispatch table: which backend layout serves a scheme on a device, and why the others don't.

A port of the backend selection of
vLLM's WNA16 oracle (``vllm/model_executor/layers/fused_moe/oracle/int_wna16.py``) (``_get_priority_backends`` and the experts
classes' support checks, ``docs/formats.md`` §9) onto JAX platforms. The table
(:data:`TABLE`) is one literal mapping ``Backend → BackendSpec``; each spec's ``supports``
returns ``None`` or the reason it refuses. :func:`select_backend` walks the platform's priority
list and returns the first backend whose check passes. When none does (vLLM raises there), it
returns :attr:`Backend.LOADER` — the checkpoint's own layout, which the XLA executor runs on
every platform — and warns once with every refused row and its reason
(:class:`BackendFallbackWarning`). Forcing a backend that refuses raises with the reason; the
fallback is never silent. ``WNA16_JAX_BACKEND`` forces a backend the same way (like vLLM's
``--moe-backend``).

Every backend's layout also has an XLA decode (``<Backend>Weights.decode``), so any converted
pytree runs on any platform through :func:`wna16_jax.moe.fused_moe`; the device gates below say
where the backend is *selected*, mirroring vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from enum import Enum
from typing import Any, Callable

from . import executors
from .convert.cpu import convert_cpu
from .convert.humming import convert_humming
from .convert.marlin import convert_marlin, marlin_moe_padded_intermediate
from .convert.trtllm_mxint4 import convert_trtllm_mxint4
from .convert.xpu import convert_xpu
from .device import Device, input_dtype_name
from .errors import BackendSelectionError, ConfigError, UnsupportedError
from .schemes import QuantMethod, QuantScheme
from .weights import CheckpointWeights


class Backend(str, Enum):
    """The ``WNA16MoEBackend`` members of vLLM's WNA16 oracle."""

    CPU = "cpu"
    XPU = "xpu"
    MARLIN = "marlin"
    BATCHED_MARLIN = "batched_marlin"
    FLASHINFER_TRTLLM = "flashinfer_trtllm"
    HUMMING = "humming"
    #: no conversion: the loader layout, run by the XLA executor (selected when no row above is)
    LOADER = "loader"

    def __str__(self) -> str:
        return self.name

    @classmethod
    def parse(cls, name: "str | Backend") -> "Backend":
        if isinstance(name, Backend):
            return name
        key = str(name).strip().lower().replace("-", "_")
        for b in cls:
            if b.value == key:
                return b
        raise ConfigError(f"backend: expected one of {[b.value for b in cls]}, got {name!r}")


#: fp8 activations on Marlin need SM89 or SM12x (Hopper emulates the PTX; docs/moe-semantics.md §2.7, docs/formats.md §3.7).
_FP8_ACT_CC = ((8, 9), (12, 0), (12, 1))
ACTIVATION_FORMATS = ("standard", "batched")


@dataclasses.dataclass(frozen=True)
class Request:
    """One layer's needs, as the frontends hand them to the oracle (docs/formats.md §9.1)."""

    scheme: QuantScheme
    input_dtype: str | None = None        # None = 16-bit activations; "int8" / "float8_e4m3fn" (Marlin)
    has_bias: bool = False
    activation: str = "silu"
    activation_format: str = "standard"
    hidden_size: int | None = None
    intermediate_size: int | None = None


Check = Callable[[Request, Device], "str | None"]


def _first(*reasons: str | None) -> str | None:
    for r in reasons:
        if r:
            return r
    return None


# ------------------------------------------------------------------ per-backend gates


def _need_nvidia(min_cc: tuple[int, int] = (7, 5)) -> Check:
    def check(req: Request, dev: Device) -> str | None:
        if dev.platform == "rocm":
            return "needs an NVIDIA CUDA GPU (never ROCm)"
        if not dev.is_nvidia:
            return f"needs an NVIDIA CUDA GPU (SM{min_cc[0]}{min_cc[1]}+), this device is {dev.describe()}"
        if dev.compute_capability < min_cc:
            return f"needs compute capability >= {min_cc[0]}.{min_cc[1]}, got {dev.compute_capability}"
        return None
    return check


def _marlin_layout(req: Request) -> str | None:
    s = req.scheme
    if s.method is QuantMethod.AWQ and not s.zero_point:
        return "AWQ Marlin MoE requires zero-point tensors"
    if s.bits == 8 and s.zero_point:
        return f"weight key {s.weight_key} is not supported (Marlin has no 8-bit zero-point type)"
    if s.group_size not in (-1, 32, 64, 128):
        return f"group size must be one of -1, 32, 64, 128, got {s.group_size}"
    if req.input_dtype == "float8_e4m3fn" and (s.bits != 4 or s.zero_point and s.method is not QuantMethod.AWQ):
        return "fp8 activations need 4-bit symmetric weights (or AWQ)"
    if req.hidden_size is not None and req.hidden_size % 128:
        return f"hidden size must be a multiple of 128, got {req.hidden_size}"
    if req.intermediate_size is not None:
        i = req.intermediate_size
        if s.group_size > 0 and i % s.group_size:
            return f"intermediate size {i} is not a multiple of group size {s.group_size}"
        if s.act_order and marlin_moe_padded_intermediate(i, s.group_size) != i:
            return (f"intermediate size {i} needs padding to the Marlin tile "
                    f"({marlin_moe_padded_intermediate(i, s.group_size)}), which act-order does not allow")
    return None


def _marlin_device(req: Request, dev: Device) -> str | None:
    r = _need_nvidia((7, 5))(req, dev)
    if r:
        return r
    if req.input_dtype == "int8" and dev.compute_capability < (8, 0):
        return "int8 activations need SM80+"
    if req.input_dtype == "float8_e4m3fn" and dev.compute_capability not in _FP8_ACT_CC:
        return f"fp8 activations need SM89 or SM12x, got SM{dev.compute_capability[0]}{dev.compute_capability[1]}"
    return None


def _supports_marlin(req: Request, dev: Device) -> str | None:
    return _first(_marlin_device(req, dev), _marlin_layout(req),
                  None if req.activation_format == "standard"
                  else "MarlinExperts takes the standard activation format (use BATCHED_MARLIN)")


def _supports_batched_marlin(req: Request, dev: Device) -> str | None:
    return _first(_marlin_device(req, dev), _marlin_layout(req),
                  None if req.activation_format == "batched"
                  else "BatchedMarlinExperts takes the batched-experts activation format only")


def _supports_trtllm(req: Request, dev: Device) -> str | None:
    s = req.scheme
    dev_reason = None
    if not dev.is_nvidia or dev.compute_capability[0] != 10:
        dev_reason = f"needs an SM100-family (Blackwell) GPU, this device is {dev.describe()}"
    opt_in = os.environ.get("WNA16_JAX_USE_FLASHINFER_MOE_INT4", "0") == "1"
    return _first(
        dev_reason,
        None if s.weight_key == "kInt4Static32" and not s.zero_point
        else f"needs 4-bit symmetric group-32 weights (kInt4Static32), got {s.weight_key} ({s.describe()})",
        "bias is not supported" if req.has_bias else None,
        None if req.activation in ("silu", "swigluoai")
        else f"activation must be silu or swigluoai, got {req.activation}",
        "only 16-bit (bf16) activations" if req.input_dtype else None,
        None if req.activation_format == "standard" else "standard activation format only",
        # last, so that layout_supports() can tell "everything else passed":
        None if opt_in else "opt-in only (set WNA16_JAX_USE_FLASHINFER_MOE_INT4=1, as vLLM's "
                            "VLLM_USE_FLASHINFER_MOE_INT4); its executor here is the XLA decode",
    )


def _supports_humming(req: Request, dev: Device) -> str | None:
    s = req.scheme
    return _first(
        _need_nvidia((7, 5))(req, dev),
        None if s.method in (QuantMethod.AWQ, QuantMethod.GPTQ)
        else "the Humming weight schema is derived from AutoAWQ / AutoGPTQ configs only "
             "(vLLM's WNA16 oracle raises TypeError for compressed-tensors)",
        "the Humming GPTQ schema does not support desc_act (act-order)" if s.act_order else None,
        "only 16-bit activations here" if req.input_dtype else None,
    )


def _supports_cpu(req: Request, dev: Device) -> str | None:
    s = req.scheme
    return _first(
        None if dev.platform == "cpu" else f"CPU backend runs on the cpu platform, this device is {dev.describe()}",
        None if s.weight_key == "kInt4Static"
        else f"weight key {s.weight_key} is not supported (CPU int4 MoE takes kInt4Static only)",
        "GPTQ desc_act / act-order is not supported (no g_idx reordering)" if s.act_order else None,
        None if req.activation in ("silu", "gelu_tanh")
        else f"activation must be silu or gelu_tanh, got {req.activation}",
        "only 16-bit activations" if req.input_dtype else None,
        None if req.activation_format == "standard" else "standard activation format only",
    )


def _supports_loader(req: Request, dev: Device) -> str | None:
    del dev
    return _first(
        "int8 / fp8 activations are a Marlin-layout feature; the XLA executor takes 16/32-bit "
        "activations" if req.input_dtype else None,
        None if req.activation_format == "standard" else "standard activation format only",
    )


def _supports_xpu(req: Request, dev: Device) -> str | None:
    s = req.scheme
    return _first(
        None if dev.platform == "xpu" else f"needs an Intel XPU, this device is {dev.describe()}",
        None if s.bits == 4 and not s.zero_point
        else f"needs 4-bit symmetric weights (kInt4Static / kInt4Static32), got {s.describe()}",
        "act-order is not supported" if s.act_order else None,
        "only 16-bit activations" if req.input_dtype else None,
        None if req.activation_format == "standard" else "standard activation format only",
        None if dev.byteorder == "little" else "needs a little-endian host (uint8 view of int32 words)",
    )


# ------------------------------------------------------------------ the table


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """One row of the dispatch table."""

    backend: Backend
    platforms: tuple[str, ...]            # where vLLM selects it
    layout: str                           # docs/formats.md section of the kernel layout
    executes_on: str                      # what runs the layout in this project
    supports_fn: Check
    convert_fn: Callable                  # the converter: (scheme, weights, input_dtype=) -> layout
    engines: tuple[str, ...] = ()         # the GPU engines (wna16_jax.executors) that prepare this row

    def supports(self, scheme: QuantScheme, device: Device | None = None, **request: Any) -> str | None:
        """``None`` if this backend serves ``scheme`` on ``device``, else the reason it does not."""
        req = Request(scheme, input_dtype=input_dtype_name(request.pop("input_dtype", None)), **request)
        if req.activation_format not in ACTIVATION_FORMATS:
            raise ConfigError(f"activation_format: expected one of {ACTIVATION_FORMATS}, "
                              f"got {req.activation_format!r}")
        return self.supports_fn(req, device or Device.current())

    def layout_supports(self, scheme: QuantScheme, **request: Any) -> str | None:
        """Like :meth:`supports` but ignoring the device: can this layout represent the layer?

        Every layout has an XLA decode, so a layout that can represent the layer runs anywhere.
        """
        if self.backend is Backend.FLASHINFER_TRTLLM:
            reason = _supports_trtllm(
                Request(scheme, input_dtype=input_dtype_name(request.pop("input_dtype", None)), **request),
                Device("gpu", "B200", (10, 0)))
            if reason and reason.startswith("opt-in only"):
                reason = None
            return reason
        fake = {Backend.CPU: Device("cpu"), Backend.XPU: Device("xpu")}.get(
            self.backend, Device("gpu", "H200", (9, 0)))
        if self.backend in (Backend.MARLIN, Backend.BATCHED_MARLIN):
            request = dict(request)
            request["activation_format"] = "standard" if self.backend is Backend.MARLIN else "batched"
            if request.get("input_dtype") is not None and "float8" in str(request["input_dtype"]):
                fake = Device("gpu", "L40S", (8, 9))
        return self.supports(scheme, fake, **request)

    def converter(self) -> Callable:
        return self.convert_fn

    def convert(self, scheme: QuantScheme, weights: Any, input_dtype: Any = None) -> Any:
        """Convert a loader-layout pytree (jit-compiled once per scheme, shapes and input dtype).

        The weights are checked against ``scheme`` first (every field's shape and dtype)."""
        if not isinstance(weights, CheckpointWeights):
            raise ConfigError(f"weights: expected the loader layout (CheckpointWeights) to convert, "
                              f"got {type(weights).__name__}")
        if weights.scheme != scheme:
            raise ConfigError(f"scheme: {scheme.describe()} differs from the weights' own "
                              f"{weights.scheme.describe() if weights.scheme else None}")
        weights.validate()
        if self.backend is Backend.LOADER:
            return weights
        return _jitted(self.convert_fn)(scheme, weights, None if input_dtype is None else _hashable_dtype(input_dtype))

    def _engines(self):
        return tuple(executors.BY_NAME[n] for n in self.engines)

    def executor_reason(self, weights: Any, device: Device | None = None, input_dtype: Any = None) -> str | None:
        """``None`` if one of this row's GPU engines takes ``weights`` on ``device`` (then
        :meth:`prepare` converts them into its layout), else why none does (then the row's layout
        runs on the XLA executor)."""
        if not self.engines:
            return f"{self.backend} has no GPU engine in this project; its executor is {self.executes_on}"
        ex, refused = executors.preparing_engine(weights, device or Device.current(), input_dtype, self._engines())
        return None if ex is not None else "; ".join(f"{n}: {r}" for n, r in refused)

    def wgmma_reason(self, weights: Any, device: Device | None = None) -> str | None:
        """``None`` if :meth:`prepare` lays ``weights`` out for the wgmma kernels on ``device``
        (MARLIN on a Hopper GPU, 4-bit, group 128 or channelwise), else why the engine's tile
        layout (Triton-lowered kernels) is used instead. ``WNA16_JAX_GPU_KERNELS=triton`` (or
        ``wgmma``) forces the choice; ``wgmma`` still needs a layer the wgmma kernels take."""
        if "wgmma" not in self.engines:
            return (f"{self.backend}: the batched-experts format runs on the Triton-lowered kernels" if self.engines
                    else f"{self.backend} has no GPU engine in this project")
        return executors.WGMMA.prepares(weights, device or Device.current())

    def prepare(self, scheme: QuantScheme, weights: Any, input_dtype: Any = None,
                device: Device | None = None) -> Any:
        """The layout this row's executor reads on ``device``, converted once ahead of time.

        The row's GPU engines (MARLIN: the wgmma engine, then the Triton-lowered one;
        BATCHED_MARLIN: the Triton-lowered one) are asked in that order
        (:func:`wna16_jax.executors.preparing_engine`): the first that takes the layer converts
        it into its own layout — the wgmma layout on a Hopper GPU for 4-bit layers with group-128
        or channelwise scales (faster than the Triton-lowered kernels at most measured rows:
        ``docs/journal/results-history.md``), else the engine's tile layout. Everywhere else, and
        for configurations outside the engines: :meth:`convert` (the backend's own layout), which
        the XLA executor runs. ``WNA16_JAX_GPU_KERNELS`` narrows the engines asked."""
        dev = device or Device.current()
        if self.backend is Backend.LOADER or not self.engines:
            return self.convert(scheme, weights, input_dtype)
        ex, refused = executors.preparing_engine(weights, dev, input_dtype, self._engines())
        if ex is not None:
            return ex.prepare(weights, input_dtype)
        if executors.forced_gpu_kernels() == "wgmma" and "wgmma" in self.engines and dev.is_nvidia:
            raise UnsupportedError(f"WNA16_JAX_GPU_KERNELS=wgmma: {dict(refused)['wgmma']}")
        return self.convert(scheme, weights, input_dtype)


@functools.lru_cache(maxsize=None)
def _jitted(fn: Callable) -> Callable:
    import jax

    return jax.jit(lambda scheme, weights, input_dtype: fn(scheme, weights, input_dtype=input_dtype),
                   static_argnums=(0, 2))


def _hashable_dtype(input_dtype: Any) -> Any:
    import numpy as np

    try:
        return np.dtype(input_dtype)
    except TypeError:
        raise ConfigError(f"input_dtype: not a dtype: {input_dtype!r}") from None


def _no_conversion(scheme: QuantScheme, weights: Any, input_dtype: Any = None) -> Any:
    del scheme, input_dtype
    return weights


TABLE: dict[Backend, BackendSpec] = {
    Backend.CPU: BackendSpec(
        Backend.CPU, ("cpu",), "vLLM CPU blocked int4 layout (docs/formats.md §5)", "XLA decode",
        _supports_cpu, convert_cpu),
    Backend.XPU: BackendSpec(
        Backend.XPU, ("xpu",), "[E, N, K/2] uint8, low nibble = even k (docs/formats.md §6)", "XLA decode",
        _supports_xpu, convert_xpu),
    Backend.MARLIN: BackendSpec(
        Backend.MARLIN, ("gpu",), "Marlin tile layout (docs/formats.md §3)",
        "Pallas engine on NVIDIA GPUs (Hopper, 4-bit g128/channelwise: wgmma layout, Mosaic GPU kernels; "
        "otherwise kernel-native tile layout, Triton-lowered kernels), XLA decode elsewhere",
        _supports_marlin, convert_marlin, ("wgmma", "triton")),
    Backend.BATCHED_MARLIN: BackendSpec(
        Backend.BATCHED_MARLIN, ("gpu",), "Marlin tile layout, batched-experts activations (docs/formats.md §3, docs/moe-semantics.md §2.8)",
        "Pallas engine on NVIDIA GPUs (kernel-native tile layout), XLA decode elsewhere",
        _supports_batched_marlin, convert_marlin, ("triton",)),
    Backend.FLASHINFER_TRTLLM: BackendSpec(
        Backend.FLASHINFER_TRTLLM, ("gpu",), "MXINT4: signed int4, bf16 g32 scales, shuffled blocks (docs/formats.md §4)",
        "XLA decode (the real kernel is SM100-only)", _supports_trtllm,
        convert_trtllm_mxint4),
    Backend.HUMMING: BackendSpec(
        Backend.HUMMING, ("gpu",), "Humming canonical weight schema (docs/formats.md §7)", "XLA decode",
        _supports_humming, convert_humming),
    Backend.LOADER: BackendSpec(
        Backend.LOADER, ("cpu", "gpu", "rocm", "tpu", "xpu"),
        "the checkpoint's own layout (no conversion)", "XLA executor (dequantizes on the fly)",
        _supports_loader, _no_conversion),
}

#: the rows vLLM's oracle has (every row but :attr:`Backend.LOADER`).
CONVERTING_BACKENDS: tuple[Backend, ...] = tuple(b for b in Backend if b is not Backend.LOADER)


class BackendFallbackWarning(UserWarning):
    """No row of the dispatch table converts this scheme on this device: the loader layout runs
    on the XLA executor. The message lists every refused row with its reason."""


_FALLBACK_WARNED: set = set()


def fallback_summary(scheme, dev) -> str:
    """The one-line reason a layer of ``scheme`` runs the loader layout on ``dev``'s XLA executor
    (the fallback warning's first line, which is given once per process; callers that report
    every fallback use this)."""
    return f"no WNA16 MoE backend converts {scheme.describe()} on {dev.describe()}"


def priority_backends(device: Device | None = None) -> list[Backend]:
    """vLLM's ``_get_priority_backends`` on JAX platforms (the converting rows; when none of
    them accepts a layer, :func:`select_backend` falls back to :attr:`Backend.LOADER`)."""
    dev = device or Device.current()
    if dev.platform == "cpu":
        return [Backend.CPU]
    if dev.platform == "xpu":
        return [Backend.XPU]
    return [Backend.FLASHINFER_TRTLLM, Backend.MARLIN, Backend.BATCHED_MARLIN, Backend.HUMMING]


def backend_reasons(scheme: QuantScheme, device: Device | None = None, **request: Any
                    ) -> dict[Backend, str | None]:
    """Every backend of the table with ``None`` (supported) or the reason it is not."""
    dev = device or Device.current()
    return {b: TABLE[b].supports(scheme, dev, **dict(request)) for b in Backend}


def select_backend(scheme: QuantScheme, device: Device | None = None, *, backend: Any = None,
                   **request: Any) -> Backend:
    """The first backend of the device's priority list that supports the request.

    ``backend`` (or, when it is None, the ``WNA16_JAX_BACKEND`` environment variable) forces
    one: if it does not support the request, :class:`UnsupportedError` carries the reason (no
    fallback). Without a forced backend, when no row of the priority list accepts the request,
    returns :attr:`Backend.LOADER` (the XLA executor runs the checkpoint's layout) and warns
    once per scheme and device with every row's reason. Raises :class:`BackendSelectionError`
    only when not even that can run the request (int8 / fp8 activations need Marlin).
    """
    dev = device or Device.current()
    if backend is None:
        backend = env_forced_backend()
    if backend is not None:
        b = Backend.parse(backend)
        reason = TABLE[b].supports(scheme, dev, **dict(request))
        if reason:
            raise UnsupportedError(f"backend {b} was forced but does not support {scheme.describe()} "
                                   f"on {dev.describe()}: {reason}")
        return b
    prio = priority_backends(dev)
    reasons = backend_reasons(scheme, dev, **request)
    for b in prio:
        if reasons[b] is None:
            return b
    lines = "\n".join(f"  {b}: {reasons[b] or 'supported, but not in this platform priority list'}"
                      + ("" if b in prio else " [not in this platform's priority list]")
                      for b in CONVERTING_BACKENDS)
    if reasons[Backend.LOADER] is None:
        key = (scheme, dev, tuple(sorted(request.items(), key=str)))
        if key not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(key)
            import warnings

            warnings.warn(f"{fallback_summary(scheme, dev)}; "
                          f"running the loader layout on the XLA executor. Refused rows:\n{lines}",
                          BackendFallbackWarning, stacklevel=2)
        return Backend.LOADER
    raise BackendSelectionError(
        f"no WNA16 MoE backend supports {scheme.describe()} on {dev.describe()}:\n{lines}\n"
        f"  {Backend.LOADER}: {reasons[Backend.LOADER]}")


def env_forced_backend() -> Backend | None:
    """``WNA16_JAX_BACKEND`` (like vLLM's ``--moe-backend``) forces a backend when set."""
    v = os.environ.get("WNA16_JAX_BACKEND")
    if not v:
        return None
    try:
        return Backend.parse(v)
    except ConfigError as e:
        raise ConfigError(f"WNA16_JAX_BACKEND: {e}") from None


def convert_to_wna16_moe_kernel_format(backend: "Backend | str", scheme: QuantScheme, weights: Any,
                                       input_dtype: Any = None) -> Any:
    """Convert one layer's experts (loader layout) into ``backend``'s kernel layout (the entry
    point of vLLM's WNA16 oracle).

    The device gates of the dispatch table are not applied here (conversion is possible on any
    host); the layout's own refusals raise typed errors naming the rule and the value.
    """
    return TABLE[Backend.parse(backend)].convert(scheme, weights, input_dtype=input_dtype)
