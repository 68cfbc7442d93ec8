"""The executor registry: who runs a MoE layer, and who can run which layout on which device.

Each executor is one object with ``supports(weights, device, ...) -> reason | None`` (can it run
these weights, as they are, on that device) and a call. :data:`REGISTRY` lists them in order of
preference — the wgmma engine (Hopper, Mosaic GPU), the Triton-lowered engine (NVIDIA GPUs),
the XLA executor (everywhere; every layout has an XLA decode) — and :func:`select` walks it: the
first that supports the layer runs it, and the reasons of those that refused travel with the
choice (``fused_moe`` warns with them where an engine's own layout fell back).

The dispatch table's :meth:`~wna16_jax.backends.BackendSpec.prepare` walks the same registry the
other way round: for a MARLIN-row layer on an NVIDIA GPU, the first engine whose
``prepares(weights, device)`` passes converts the loader layout into its own layout once, ahead
of time; otherwise the row's own layout runs on the XLA executor.

Each executor also runs the library's second operation, the dense quantized linear
(:func:`wna16_jax.matmul.quantized_matmul`; ``matmul_supports`` / ``matmul``, and
``prepares_matmul`` / ``prepare_matmul`` for laying a checkpoint matrix out at load): a dense
linear is one expert that every row is routed to, so the wgmma engine runs it on its grouped GEMM.

The engines adapt this library's weight pytrees to the kernels of the leaf package
``pallas_kernels`` (arrays and a config in, arrays out) and turn the kernels' errors into
``WNA16Error`` subclasses at that boundary.
"""

from __future__ import annotations

import dataclasses
import os
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.device import num_sms, wgmma_device_reason
from pallas_kernels.fused_moe_tiles import batched_experts_tiles, fused_moe_tiles, fused_moe_tiles_bwd
from pallas_kernels.wgmma_config import LayerConfig, plan_gemm
from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm
from pallas_kernels.wgmma_layer import fused_moe_wgmma

from .convert.marlin import MarlinWeights
from .convert.tiles import TileWeights, convert_tiles, tile_unsupported_reason
from .convert.wgmma import WgmmaForm, WgmmaWeights, convert_wgmma, wgmma_matrix, wgmma_unsupported_reason
from .device import Device, input_dtype_name
from .errors import ConfigError, UnsupportedError, kernel_errors
from .weights import CheckpointForm, LayerStack

_ENGINE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: ``WNA16_JAX_GPU_KERNELS``: which engine :meth:`BackendSpec.prepare` lays MARLIN layers out for.
GPU_KERNELS = ("auto", "wgmma", "triton")


def forced_gpu_kernels() -> str:
    """``WNA16_JAX_GPU_KERNELS`` (default ``"auto"``), checked against :data:`GPU_KERNELS`."""
    forced = os.environ.get("WNA16_JAX_GPU_KERNELS", "auto").lower()
    if forced not in GPU_KERNELS:
        raise ConfigError(f"WNA16_JAX_GPU_KERNELS: expected one of {GPU_KERNELS}, got {forced!r}")
    return forced


def _device(device=None):
    return device or Device.current()


def _nvidia_reason(device) -> str | None:
    if not device.is_nvidia:
        return f"the Pallas engine needs an NVIDIA GPU, not {device.describe()}"
    return None


def _call_reason(hidden_dtype, formulation, compute_dtype) -> str | None:
    """What an engine refuses about the call itself (not the layout or the device)."""
    if formulation is not None:
        return f"formulation={formulation!r} names an XLA formulation"
    if hidden_dtype is not None and jnp.dtype(hidden_dtype) not in _ENGINE_DTYPES:
        return (f"activations are {jnp.dtype(hidden_dtype).name}; the engine's tensor-core GEMMs take "
                f"bfloat16/float16 (the XLA executor computes float32 exactly)")
    if compute_dtype is not None and hidden_dtype is not None and jnp.dtype(compute_dtype) != jnp.dtype(hidden_dtype):
        return (f"compute_dtype={jnp.dtype(compute_dtype).name} differs from the activations "
                f"({jnp.dtype(hidden_dtype).name}); the engine computes in the activation dtype")
    return None


@dataclasses.dataclass(frozen=True)
class Executor:
    """One way to run a layer. ``layouts()``: the weight classes it reads (``None``: any)."""

    name: str
    description: str
    #: whether :meth:`run` takes a :class:`~wna16_jax.weights.LayerStack` as it is (else it gets
    #: the layer's weights, ``at_layer()``)
    reads_stacks: bool = False

    def layouts(self) -> tuple[type, ...] | None:
        return None

    def reads(self, weights) -> bool:
        layouts = self.layouts()
        return layouts is None or isinstance(weights, layouts)

    def supports(self, weights, device=None, *, hidden_dtype=None, formulation=None,
                 compute_dtype=None) -> str | None:
        raise NotImplementedError

    def prepares(self, weights, device=None, input_dtype=None) -> str | None:
        """Why this executor does not take ``weights`` (loader or MARLIN-row layout) to convert
        into its own layout on ``device`` (``None``: it does)."""
        return f"{self.name} converts nothing"

    def prepare(self, weights, input_dtype=None):
        raise UnsupportedError(f"{self.name}: converts nothing")

    def run(self, x, topk_weights, topk_ids, weights, expert_map, *, activation, apply_router_weight_on_input,
            global_num_experts, block_m):
        raise NotImplementedError

    # ------------------------------------------------------------------ the dense linear (quantized_matmul)
    def matmul_supports(self, w, device=None, *, x_dtype=None) -> str | None:
        """Why this executor does not run ``x Wᵀ`` for the one-expert matrix ``w`` (a
        :class:`~wna16_jax.weights.QuantMatrix`, or a :class:`~wna16_jax.weights.LayerStack` of
        them) as it is laid out, on ``device``, for ``x_dtype`` activations (None: it does)."""
        return f"the {self.name} executor runs no dense linear"

    def prepares_matmul(self, form, device=None, input_dtype=None) -> str | None:
        """Why this executor does not lay a checkpoint matrix of ``form`` (a
        :class:`~wna16_jax.weights.CheckpointForm`: its sizes and scheme, known before any weight is
        read) out for itself on ``device`` for ``input_dtype`` activations (None: it does)."""
        return f"{self.name} converts nothing"

    def prepare_matmul(self, w, input_dtype=None):
        raise UnsupportedError(f"{self.name}: converts nothing")

    def matmul(self, x, w, bias, compute_dtype):
        """``x Wᵀ + b`` in float32 (``x [..., K]``; ``w`` the matrix or a stack of them)."""
        raise NotImplementedError


class XLAExecutor(Executor):
    """Dequantizes on the fly in XLA; runs every layout on every platform, the fused MoE (its
    formulations live in :mod:`wna16_jax.moe`) and the dense linear."""

    def supports(self, weights, device=None, **_):
        return None

    def run(self, *args, **kwargs):                  # the formulations live in wna16_jax.moe
        raise NotImplementedError("the XLA executor's fused MoE runs inside wna16_jax.moe")

    def matmul_supports(self, w, device=None, *, x_dtype=None):
        return None

    def matmul(self, x, w, bias, compute_dtype):
        """Dequantize ``W`` inside the program (exact in float32, then ``compute_dtype``) and run one
        ``dot`` accumulating in float32 (a stack: the layer's matrix, fused into the dequantization)."""
        cdt = jnp.dtype(compute_dtype)
        m = w.at_layer() if isinstance(w, LayerStack) else w
        wd = m.dequantize(cdt)[0]                                         # [N, K]
        prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
        y = jnp.einsum("...k,nk->...n", x.astype(cdt), wd, precision=prec, preferred_element_type=jnp.float32)
        return y if bias is None else y + bias.astype(jnp.float32)


class WgmmaEngine(Executor):
    """The Hopper wgmma kernels (Mosaic GPU) on :class:`~wna16_jax.convert.wgmma.WgmmaWeights`."""

    def layouts(self):
        return (WgmmaWeights,)

    def supports(self, weights, device=None, *, hidden_dtype=None, formulation=None, compute_dtype=None):
        dev = _device(device)
        if not self.reads(weights):
            return f"{type(weights).__name__} is not the wgmma layout"
        reason = _nvidia_reason(dev) or wgmma_device_reason(dev.compute_capability, dev.describe())
        if reason:
            return f"{reason} (these weights were prepared in the wgmma layout for a Hopper GPU)"
        return _call_reason(hidden_dtype, formulation, compute_dtype)

    def prepares(self, weights, device=None, input_dtype=None):
        dev = _device(device)
        forced = forced_gpu_kernels()
        if forced == "triton":
            return "WNA16_JAX_GPU_KERNELS=triton"
        if isinstance(weights, MarlinWeights) and getattr(weights, "is_a_8bit", False):
            return "a Marlin layout prepared for 8-bit activations"
        return (_nvidia_reason(dev) or wgmma_device_reason(dev.compute_capability, dev.describe())
                or _input_reason(input_dtype) or wgmma_unsupported_reason(weights))

    def prepare(self, weights, input_dtype=None):
        dt = jnp.float16 if input_dtype is not None and jnp.dtype(input_dtype) == jnp.float16 else jnp.bfloat16
        return jax.jit(convert_wgmma, static_argnums=1)(weights, dt)

    @kernel_errors()
    def run(self, x, topk_weights, topk_ids, weights, expert_map, *, activation, apply_router_weight_on_input,
            global_num_experts, block_m):
        stack = {}
        if isinstance(weights, LayerStack):     # L layers' experts read as L·E experts, in place
            weights, e, offset = weights.as_experts()
            stack = dict(num_experts=e, expert_offset=offset)
        w13, w2 = weights.gemms()
        return fused_moe_wgmma(x, topk_weights, topk_ids, w13, w2, interleaved=weights.w13_interleaved,
                               activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
                               expert_map=expert_map, global_num_experts=global_num_experts, block_m=block_m,
                               **stack)


    def matmul_supports(self, w, device=None, *, x_dtype=None):
        dev = _device(device)
        m = w.stacked if isinstance(w, LayerStack) else w
        if not isinstance(getattr(m, "form", None), WgmmaForm):
            return f"{type(getattr(m, 'form', m)).__name__} is not the wgmma layout"
        reason = _nvidia_reason(dev) or wgmma_device_reason(dev.compute_capability, dev.describe())
        if reason:
            return f"{reason} (this matrix was laid out for the wgmma kernels of a Hopper GPU)"
        if x_dtype is not None and jnp.dtype(x_dtype) not in _ENGINE_DTYPES:
            return f"activations are {jnp.dtype(x_dtype).name}; the wgmma GEMM takes bfloat16 / float16"
        return None

    def prepares_matmul(self, form, device=None, input_dtype=None):
        """The wgmma kernels take 4-bit codes without act-order, group 128 or channelwise scales,
        N a multiple of 64 and K of 128, 16-bit activations, on a Hopper GPU."""
        dev = _device(device)
        if not isinstance(form, CheckpointForm):
            return f"{type(form).__name__} is not a checkpoint matrix"
        s = form.scheme
        return (_nvidia_reason(dev) or wgmma_device_reason(dev.compute_capability, dev.describe())
                or (f"{jnp.dtype(input_dtype).name} activations (the wgmma GEMM takes bfloat16 / float16)"
                    if input_dtype is not None and jnp.dtype(input_dtype) not in _ENGINE_DTYPES else None)
                or (f"{s.bits}-bit codes (the wgmma kernels take 4-bit)" if s.bits != 4 else None)
                or ("act-order (g_idx)" if s.act_order else None)
                or (f"group size {s.group_size}" if s.group_size not in (-1, 128) else None)
                or (f"N={form.n} is not a multiple of 64" if form.n % 64 else None)
                or (f"K={form.k} is not a multiple of 128" if form.k % 128 else None))

    def prepare_matmul(self, w, input_dtype=None):
        dt = jnp.float16 if input_dtype is not None and jnp.dtype(input_dtype) == jnp.float16 else jnp.bfloat16
        return jax.jit(wgmma_matrix, static_argnums=1)(w, dt)

    def matmul(self, x, w, bias, compute_dtype, *, gemm=None):
        """``x Wᵀ + b`` on the wgmma grouped GEMM as one expert that every row is routed to: the rows
        padded to whole blocks, the GEMM's configuration from the layer's heuristics
        (:func:`pallas_kernels.wgmma_config.plan_gemm`), float32 out. A stack of ``L`` layers' matrices
        is read in place as ``L`` experts (every block routed to the layer's). ``gemm``: the kernel
        (default) or its jnp reference."""
        layer = None
        if isinstance(w, LayerStack):
            layer, w = jnp.asarray(w.index, jnp.int32), jax.tree.map(lambda a: a.reshape((-1,) + a.shape[2:]),
                                                                     w.stacked)
        lead, k, n = x.shape[:-1], x.shape[-1], w.form.n
        m = int(np.prod(lead)) if lead else 1
        x = x.reshape(m, k)
        bm = min(128, -(-m // 8) * 8)                    # all rows (to 8) up to 128, else blocks of 128
        nb = -(-m // bm)
        a = jnp.pad(x.astype(w.scale.dtype), ((0, nb * bm - m), (0, 0)))
        cfg, _ = plan_gemm(LayerConfig(), n_blocks=nb, block_m=bm, n=n, k=k, has_zp=w.zero_point is not None,
                           group_size=-1 if w.scale.shape[1] == 1 else 128, sms=num_sms())
        with kernel_errors():
            experts = jnp.zeros((nb,), jnp.int32) if layer is None else jnp.full((nb,), layer, jnp.int32)
            out = (gemm or wgmma_grouped_gemm)(a, experts, w.qvalue, w.scale, w.zero_point, config=cfg)
        y = out.astype(jnp.float32).sum(0)[:m]
        y = y if bias is None else y + bias.astype(jnp.float32)
        return y.reshape(*lead, n)


def _input_reason(input_dtype) -> str | None:
    if input_dtype is None:
        return None
    name = input_dtype_name(input_dtype)
    return None if name in (None, "bfloat16", "float16") else f"the engine takes 16-bit activations, not {name}"


@dataclasses.dataclass(frozen=True)
class TritonEngine(Executor):
    """The Triton-lowered Pallas kernels on the tile layout (:class:`~wna16_jax.convert.tiles.TileWeights`),
    or on vLLM's Marlin layout re-laid as tiles on every call; every NVIDIA GPU from SM75.

    ``interpret=True`` (the registry's ``"triton_interpret"``, chosen by name only, never by
    ``"auto"``): the same kernels in Pallas interpret mode, on any device — slow, for checking the
    engine's logic on the CPU (tests, ``benchmarks/sharding.py --tiny``)."""

    interpret: bool = False

    def layouts(self):
        return (TileWeights, MarlinWeights)

    def supports(self, weights, device=None, *, hidden_dtype=None, formulation=None, compute_dtype=None):
        dev = _device(device)
        reason = None if self.interpret else _nvidia_reason(dev)
        if reason:
            return reason
        if not self.reads(weights):
            return (f"{type(weights).__name__} is not a MARLIN-row layout (the engine reads its tile layout, "
                    f"the wgmma layout or the Marlin layout)")
        if getattr(weights, "is_a_8bit", False) or getattr(weights, "input_dtype", None) not in (
                None, "bfloat16", "float16"):
            return (f"Marlin layout prepared for {getattr(weights, 'input_dtype', None) or 'int8'} activations "
                    f"(the engine takes 16-bit activations)")
        reason = _call_reason(hidden_dtype, formulation, compute_dtype)
        if reason:
            return reason
        return None if isinstance(weights, TileWeights) else tile_unsupported_reason(weights)

    def prepares(self, weights, device=None, input_dtype=None):
        dev = _device(device)
        if self.interpret:
            return "the interpret-mode engine runs layouts prepared for the Triton-lowered engine"
        if forced_gpu_kernels() == "wgmma":
            return "WNA16_JAX_GPU_KERNELS=wgmma"
        return _nvidia_reason(dev) or _input_reason(input_dtype) or tile_unsupported_reason(weights)

    def prepare(self, weights, input_dtype=None):
        return jax.jit(convert_tiles)(weights)

    @staticmethod
    def tiles(weights):
        return convert_tiles(weights)

    @kernel_errors()
    def run(self, x, topk_weights, topk_ids, weights, expert_map, *, activation, apply_router_weight_on_input,
            global_num_experts, block_m):
        tw = self.tiles(weights)
        w13, w2 = tw.gemms()
        return fused_moe_tiles(x, topk_weights, topk_ids, w13, w2, bits=tw.bits, group_size=tw.group_size,
                               activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
                               expert_map=expert_map, global_num_experts=global_num_experts, block_m=block_m,
                               interpret=self.interpret)

    @kernel_errors()
    def batched(self, batched_hidden, expert_num_tokens, weights, *, activation):
        tw = self.tiles(weights)
        w13, w2 = tw.gemms()
        return batched_experts_tiles(batched_hidden, expert_num_tokens, w13, w2, bits=tw.bits,
                                     group_size=tw.group_size, activation=activation, interpret=self.interpret)

    @kernel_errors()
    def backward(self, g, x, topk_weights, topk_ids, weights, expert_map, *, activation,
                 apply_router_weight_on_input, global_num_experts, block_m):
        """``(dx, dtw)`` on the transposed-access kernels (a wgmma layout re-laid as tiles, bit-exactly)."""

        tw = self.tiles(weights)
        w13, w2 = tw.gemms()
        return fused_moe_tiles_bwd(g, x, topk_weights, topk_ids, w13, w2, bits=tw.bits, group_size=tw.group_size,
                                   activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
                                   expert_map=expert_map, global_num_experts=global_num_experts, block_m=block_m,
                                   interpret=self.interpret)


WGMMA = WgmmaEngine("wgmma", "Mosaic GPU wgmma kernels (Hopper)", reads_stacks=True)
TRITON = TritonEngine("triton", "Triton-lowered Pallas kernels (NVIDIA GPUs)")
XLA = XLAExecutor("xla", "XLA dequantize-on-the-fly executor (every platform)")
#: the Triton-lowered kernels in Pallas interpret mode on any device (by name only: checks, not speed)
TRITON_INTERPRET = TritonEngine("triton_interpret", "Triton-lowered Pallas kernels in interpret mode (any device)",
                                interpret=True)

#: the executors in order of preference; the last (XLA) supports everything
REGISTRY: tuple[Executor, ...] = (WGMMA, TRITON, XLA)
ENGINES: tuple[Executor, ...] = (WGMMA, TRITON)
BY_NAME: dict[str, Executor] = {ex.name: ex for ex in (*REGISTRY, TRITON_INTERPRET)}

#: ``fused_moe``'s ``executor=``: "auto" walks the registry, "pallas" the engines only (an error
#: where none supports the call), or one executor by name (``"triton_interpret"`` only so)
EXECUTOR_CHOICES = ("auto", "pallas", *BY_NAME)


@dataclasses.dataclass(frozen=True)
class Choice:
    """The executor that runs a call, and why each executor before it refused."""

    executor: Executor
    refused: tuple[tuple[str, str], ...] = ()

    @property
    def reason(self) -> str | None:
        """The refusals in one line (``None`` when the first executor ran it)."""
        return "; ".join(f"{n}: {r}" for n, r in self.refused) or None


def select(weights, hidden_dtype=None, *, executor: str = "auto", device=None, formulation=None,
           compute_dtype=None, among: tuple[Executor, ...] = REGISTRY) -> Choice:
    """The first executor of ``among`` (default :data:`REGISTRY`; ``executor="auto"``), of its
    engines (``"pallas"``: an :class:`UnsupportedError` with every reason when none can), or the
    one named, that supports this call."""
    if executor not in EXECUTOR_CHOICES:
        raise ConfigError(f"executor: expected one of {EXECUTOR_CHOICES}, got {executor!r}")
    dev = _device(device)
    candidates = (among if executor == "auto" else tuple(ex for ex in among if ex in ENGINES) if executor == "pallas"
                  else (BY_NAME[executor],))
    refused = []
    for ex in candidates:
        reason = ex.supports(weights, dev, hidden_dtype=hidden_dtype, formulation=formulation,
                             compute_dtype=compute_dtype)
        if reason is None:
            return Choice(ex, tuple(refused))
        refused.append((ex.name, reason))
    lines = "; ".join(f"{n}: {r}" for n, r in refused)
    raise UnsupportedError(f"executor={executor!r}: {lines}")


def fallback_warning_applies(weights, choice: Choice, device=None) -> bool:
    """Whether a fallback deserves a warning: an engine that reads this layout refused it on an
    NVIDIA GPU (elsewhere, or for layouts no engine reads, XLA is simply the executor)."""
    dev = _device(device)
    refused = {n for n, _ in choice.refused}
    return dev.is_nvidia and any(ex.name in refused and ex.reads(weights) for ex in ENGINES)


def preparing_engine(weights, device=None, input_dtype=None, engines: tuple[Executor, ...] = ENGINES
                     ) -> tuple[Executor | None, tuple[tuple[str, str], ...]]:
    """The first engine that converts ``weights`` into its own layout on ``device``, and the
    reasons of those that do not."""
    dev = _device(device)
    refused = []
    for ex in engines:
        reason = ex.prepares(weights, dev, input_dtype)
        if reason is None:
            return ex, tuple(refused)
        refused.append((ex.name, reason))
    return None, tuple(refused)


def select_matmul(w, x_dtype=None, *, executor: str = "auto", device=None) -> Choice:
    """The executor that runs :func:`wna16_jax.matmul.quantized_matmul` for matrix ``w``: the first of
    :data:`REGISTRY` whose ``matmul_supports`` passes (``"auto"``), or the one named (an
    :class:`UnsupportedError` with its reason when it cannot)."""
    if executor not in ("auto", *BY_NAME):
        raise ConfigError(f"executor: expected 'auto' or one of {sorted(BY_NAME)}, got {executor!r}")
    dev = _device(device)
    refused = []
    for ex in REGISTRY if executor == "auto" else (BY_NAME[executor],):
        reason = ex.matmul_supports(w, dev, x_dtype=x_dtype)
        if reason is None:
            return Choice(ex, tuple(refused))
        refused.append((ex.name, reason))
    raise UnsupportedError(f"executor={executor!r}: " + "; ".join(f"{n}: {r}" for n, r in refused))


def preparing_matmul_engine(form, device=None, input_dtype=None) -> tuple[Executor | None, tuple[tuple[str, str], ...]]:
    """The first engine that lays a checkpoint matrix of ``form`` out for its dense-linear kernel on
    ``device``, and the reasons of those that do not."""
    dev = _device(device)
    refused = []
    for ex in ENGINES:
        reason = ex.prepares_matmul(form, dev, input_dtype)
        if reason is None:
            return ex, tuple(refused)
        refused.append((ex.name, reason))
    return None, tuple(refused)


__all__ = ["BY_NAME", "Choice", "ENGINES", "EXECUTOR_CHOICES", "Executor", "GPU_KERNELS", "REGISTRY", "TRITON",
           "TRITON_INTERPRET", "WGMMA", "XLA", "fallback_warning_applies", "forced_gpu_kernels", "preparing_engine",
           "preparing_matmul_engine", "select", "select_matmul"]
