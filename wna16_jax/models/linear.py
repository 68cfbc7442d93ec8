"""Dense linear layers of a quantized checkpoint: :class:`QuantizedLinear` and :class:`DenseLinear`.

AWQ, GPTQ and compressed-tensors checkpoints quantize the attention projections and dense MLPs
with the same per-tensor packing as one MoE expert (``docs/formats.md`` §1.3–§1.5), and leave
the embeddings, ``lm_head``, norms and routers in 16 bits. A quantized linear ``y = x Wᵀ + b``
with ``W [N, K]`` (output × input) is stored as, per method:

====================  ==================================  ====================================
method                tensors (suffix: shape)             decode
====================  ==================================  ====================================
AWQ (GEMM)            ``qweight [K, N/pf]``,               codes unpacked along N in AutoAWQ
                      ``scales [G, N]``,                   order, zero points likewise
                      ``qzeros [G, N/pf]``
GPTQ (v1 / v2)        ``qweight [K/pf, N]``,               codes unpacked along K; v1 stores
                      ``scales [G, N]``,                   ``z - 1``; ``g_idx`` names the group
                      ``qzeros [G, N/pf]``, ``g_idx [K]``  of each input row (desc_act)
compressed-tensors    ``weight_packed [N, ⌈K/pf⌉]``,       codes unpacked along K, zero points
                      ``weight_scale [N, G]``,             along N; ``weight_shape = [N, K]``
                      ``weight_zero_point [⌈N/pf⌉, G]``,
                      ``weight_g_idx [K]``,
                      ``weight_shape [2]``
====================  ==================================  ====================================

``pf = 32 // bits`` (4- and 8-bit), ``G = K / group_size`` (1 when channelwise). Every method
may carry a 16-bit ``bias [N]``. :class:`QuantizedLinearWeights` holds those arrays as stored
(int32 words, 16-bit scales) and decodes them with the loader layout's own decode
(:func:`wna16_jax.formats.decode`, one expert) and the arithmetic ``(code - zero) · scale``
of :class:`wna16_jax.weights.LogicalQuant`: a dense linear decodes exactly like one expert.

Execution goes through one function, :func:`quantized_matmul`: it picks an executor from
:data:`LINEAR_EXECUTORS` — ``"wgmma"`` on a Hopper GPU, where :class:`QuantizedLinear` lays the
weights out once, at load, for the same wgmma kernels the experts run on (a dense linear is one
expert that every row is routed to: :class:`WgmmaLinearWeights`), else ``"xla"`` (dequantize
inside the compiled program, then one ``dot`` with float32 accumulation).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from .. import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from pallas_kernels import device as kernel_device
from pallas_kernels.device import wgmma_device_reason
from pallas_kernels.wgmma_config import LayerConfig, plan_gemm
from pallas_kernels.wgmma_gemm import wgmma_grouped_gemm
from pallas_kernels.wgmma_layout import from_wgmma_layout, magic_value, to_wgmma_layout
from pallas_kernels.wna16_grouped_gemm import pack_tiles, unpack_tiles

from ..device import Device
from ..errors import ConfigError, ShapeError, kernel_errors
from .. import formats
from ..schemes import QuantScheme
from ..weights import LayerStack, LogicalQuant, layer_stack

#: checkpoint suffix of each role, per method (the format table's)
SUFFIXES = formats.SUFFIXES
QUANTIZED_MARKERS = formats.QUANTIZED_MARKERS


@dataclasses.dataclass(frozen=True)
class QuantizedLinearWeights:
    """One quantized linear layer ``W [N, K]`` in its checkpoint's own layout (see module doc).

    ``qweight``, ``scales``, ``qzeros`` (None when the scheme has no zero points), ``g_idx``
    (None unless act-order), ``bias [N]`` (or None) are arrays; ``scheme``, ``out_features`` (N)
    and ``in_features`` (K) are static. A registered JAX pytree: arrays are its leaves.
    """

    qweight: Any
    scales: Any
    qzeros: Any = None
    g_idx: Any = None
    bias: Any = None
    scheme: QuantScheme = None  # type: ignore[assignment]
    out_features: int = 0
    in_features: int = 0

    def decode(self) -> LogicalQuant:
        """The logical codes ``[N, K]``, scales / zeros ``[N, G]`` and ``g_idx [K]`` (or None): the
        loader layout's decode (:func:`wna16_jax.formats.decode`) of one expert."""
        def one(a):
            return None if a is None else a[None]

        lq = formats.decode(self.scheme, one(self.qweight), one(self.scales), one(self.qzeros), None,
                           n=self.out_features, k=self.in_features)
        return LogicalQuant(lq.codes[0], lq.scales[0], None if lq.zeros is None else lq.zeros[0], self.g_idx,
                            bits=lq.bits, group_size=lq.group_size)

    def dequantize(self, dtype: Any = jnp.float32):
        """Dense ``W [N, K]`` in ``dtype`` (``(code - zero) · scale`` exact in float32 first)."""
        return self.decode().dequantize(dtype)

    def arrays(self) -> dict[str, Any]:
        """The stored arrays by field name (absent ones omitted)."""
        return {f: getattr(self, f) for f in ("qweight", "scales", "qzeros", "g_idx", "bias")
                if getattr(self, f) is not None}

    @property
    def nbytes(self) -> int:
        return int(sum(np.dtype(a.dtype).itemsize * int(np.prod(a.shape)) for a in self.arrays().values()))


jax.tree_util.register_dataclass(QuantizedLinearWeights,
                                 data_fields=["qweight", "scales", "qzeros", "g_idx", "bias"],
                                 meta_fields=["scheme", "out_features", "in_features"])


def read_quantized_linear(ckpt, module: str, tensors: Mapping[str, str], scheme: QuantScheme, *,
                          out_features: int, in_features: int) -> QuantizedLinearWeights:
    """Read the quantized linear ``module`` (``tensors``: suffix → tensor name) of checkpoint
    ``ckpt`` (a :class:`wna16_jax.checkpoint.Checkpoint`) into :class:`QuantizedLinearWeights`:
    one expert of :func:`wna16_jax.checkpoint.read_matrix`, so every rule of the format table
    (:mod:`wna16_jax.formats`) applies, each error naming the tensor."""
    from ..checkpoint import MatrixPart, read_matrix

    s, n, k = scheme, int(out_features), int(in_features)
    reason = formats.size_reason(s, n, k)
    if reason:
        raise ShapeError(f"{module}: {reason}")
    m, bias = read_matrix(ckpt, s, [MatrixPart([dict(tensors)], n, module)], k=k)
    return QuantizedLinearWeights(qweight=m.qvalue[0], scales=m.scale[0],
                                  qzeros=None if m.zero_point is None else m.zero_point[0],
                                  g_idx=None if m.g_idx is None else m.g_idx[0],
                                  bias=None if bias is None else bias[0], scheme=s, out_features=n, in_features=k)


# --------------------------------------------------------------------------- execution


def _xla_matmul(x, w: QuantizedLinearWeights, compute_dtype):
    """Dequantize ``W`` inside the program (exact in float32, then ``compute_dtype``) and run one
    ``dot`` accumulating in float32."""
    cdt = jnp.dtype(compute_dtype)
    wd = w.dequantize(cdt)                                            # [N, K]
    prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
    y = jnp.einsum("...k,nk->...n", x.astype(cdt), wd, precision=prec,
                   preferred_element_type=jnp.float32)
    if w.bias is not None:
        y = y + jnp.asarray(w.bias).astype(jnp.float32)
    return y


@dataclasses.dataclass(frozen=True)
class WgmmaLinearWeights:
    """One quantized linear in the wgmma kernels' layout (one expert of
    :mod:`pallas_kernels.wgmma_layout`): ``words [1, N, K/4]`` int16, ``scales [1, G, N]`` and
    biased ``zeros`` (or None) in the activations' 16-bit dtype, ``bias [N]`` or None. The same
    bytes as the checkpoint's int4 codes and 16-bit scales; made once, at load, on a Hopper GPU
    (:func:`to_engine_linear`)."""

    words: Any
    scales: Any
    zeros: Any = None
    bias: Any = None
    out_features: int = 0
    in_features: int = 0
    group_size: int = 128

    def decode(self) -> LogicalQuant:
        codes = unpack_tiles(from_wgmma_layout(self.words), 4)[0]                   # [N, K]
        zeros = None if self.zeros is None else jnp.swapaxes(
            (self.zeros[0].astype(jnp.float32) - magic_value(self.scales.dtype)).astype(jnp.int32), 0, 1)
        return LogicalQuant(codes, jnp.swapaxes(self.scales[0], 0, 1), zeros, None, bits=4,
                            group_size=self.group_size)

    def dequantize(self, dtype: Any = jnp.float32):
        return self.decode().dequantize(dtype)


jax.tree_util.register_dataclass(WgmmaLinearWeights, data_fields=["words", "scales", "zeros", "bias"],
                                 meta_fields=["out_features", "in_features", "group_size"])


def engine_linear_reason(w: QuantizedLinearWeights, device=None) -> str | None:
    """Why :func:`to_engine_linear` does not take ``w`` on ``device`` (None: it does): the wgmma
    kernels need a Hopper GPU, 4-bit codes without act-order, group 128 or channelwise scales,
    N a multiple of 64 and K of 128."""


    dev = device or Device.current()
    s = w.scheme
    return (wgmma_device_reason(dev.compute_capability, dev.describe())
            or (f"{s.bits}-bit codes (the wgmma kernels take 4-bit)" if s.bits != 4 else None)
            or ("act-order (g_idx)" if w.g_idx is not None else None)
            or (f"group size {s.group_size}" if s.group_size not in (-1, 128) else None)
            or (f"N={w.out_features} is not a multiple of 64" if w.out_features % 64 else None)
            or (f"K={w.in_features} is not a multiple of 128" if w.in_features % 128 else None))


@kernel_errors()
def to_engine_linear(w: QuantizedLinearWeights, dtype=jnp.bfloat16) -> WgmmaLinearWeights:
    """``w`` in the wgmma layout for ``dtype`` activations (through the engine's tile layout)."""

    lq = w.decode()
    codes = jnp.asarray(lq.codes)[None]                                             # [1, N, K]
    scales = jnp.swapaxes(jnp.asarray(lq.scales), 0, 1)[None]                       # [1, G, N]
    zeros = None if lq.zeros is None else jnp.swapaxes(jnp.asarray(lq.zeros), 0, 1)[None].astype(jnp.uint8)
    words, sc, z = to_wgmma_layout(pack_tiles(codes, 4), scales, zeros, dtype)
    return WgmmaLinearWeights(words, sc, z, None if w.bias is None else jnp.asarray(w.bias),
                              out_features=w.out_features, in_features=w.in_features,
                              group_size=w.scheme.group_size)


def _linear_block_m(m: int) -> int:
    """Rows per block of a dense GEMM of ``m`` rows: all of them (to 8) up to 128, else 128."""
    return min(128, -(-m // 8) * 8)


def _wgmma_matmul(x, w: WgmmaLinearWeights, compute_dtype, *, gemm=None):
    """``x Wᵀ + b`` on the wgmma grouped GEMM as one expert that every row is routed to: the rows
    padded to whole blocks, each GEMM's configuration from the layer's heuristics
    (:func:`pallas_kernels.wgmma_config.plan_gemm`), float32 out. ``gemm``: the kernel (default)
    or its jnp reference.

    Differentiable in ``x`` (the weights are frozen: zero cotangents): the backward is
    ``dx = dy W`` on XLA, ``W`` (the layer's, for a stack) dequantized to the activations' dtype
    as the kernel sees it, ``dy`` rounded to that dtype, float32 accumulation."""

    del compute_dtype                                     # the kernel computes in the activations' dtype
    return _wgmma_trainable(gemm or wgmma_grouped_gemm)(x, w)


@functools.lru_cache(maxsize=16)
def _wgmma_trainable(gemm):
    from ..autodiff import _zero_cotangent

    f = jax.custom_vjp(lambda x, w: _wgmma_forward(x, w, gemm))

    def fwd(x, w):
        return _wgmma_forward(x, w, gemm), (x, w)

    def bwd(res, g):
        x, w = res
        one = w.at_layer() if isinstance(w, LayerStack) else w
        cdt = one.scales.dtype
        wd = one.dequantize(cdt)                                            # [N, K]
        dx = jnp.einsum("...n,nk->...k", g.astype(cdt), wd, preferred_element_type=jnp.float32)
        return dx.astype(x.dtype), jax.tree.map(_zero_cotangent, w)

    f.defvjp(fwd, bwd)
    return f


def _wgmma_forward(x, w, gemm):
    layer = None
    if isinstance(w, LayerStack):         # L layers' linears as the experts [L, N, K/4]: row blocks → layer
        layer, w = jnp.asarray(w.index, jnp.int32), w.stacked
        w = dataclasses.replace(w, words=w.words.reshape((-1,) + w.words.shape[2:]),
                                scales=w.scales.reshape((-1,) + w.scales.shape[2:]),
                                zeros=None if w.zeros is None else w.zeros.reshape((-1,) + w.zeros.shape[2:]),
                                bias=None if w.bias is None else jax.lax.dynamic_index_in_dim(w.bias, layer, 0, False))
    lead, k, n = x.shape[:-1], w.in_features, w.out_features
    m = int(np.prod(lead)) if lead else 1
    bm = _linear_block_m(m)
    nb = -(-m // bm)
    cdt = w.scales.dtype
    a = jnp.pad(x.reshape(m, k).astype(cdt), ((0, nb * bm - m), (0, 0)))
    cfg, _ = plan_gemm(LayerConfig(), n_blocks=nb, block_m=bm, n=n, k=k, has_zp=w.zeros is not None,
                       group_size=-1 if w.scales.shape[1] == 1 else 128, sms=kernel_device.num_sms())
    with kernel_errors():
        experts = jnp.zeros((nb,), jnp.int32) if layer is None else jnp.full((nb,), layer, jnp.int32)
        out = gemm(a, experts, w.words, w.scales, w.zeros, config=cfg)
    y = out.astype(jnp.float32).sum(0)[:m]
    if w.bias is not None:
        y = y + jnp.asarray(w.bias).astype(jnp.float32)
    return y.reshape(*lead, n)


#: name → ``fn(x, weights, compute_dtype) -> float32 [..., N]``
LINEAR_EXECUTORS: dict[str, Callable] = {"xla": _xla_matmul, "wgmma": _wgmma_matmul}


def select_linear_executor(x, w, compute_dtype) -> str:
    """The executor :func:`quantized_matmul` runs with ``executor="auto"``: the wgmma kernels for
    weights prepared in their layout (:class:`WgmmaLinearWeights`, made at load on a Hopper GPU)
    called with 16-bit activations, the XLA dequantize-then-dot path otherwise."""
    if isinstance(w, WgmmaLinearWeights) and jnp.dtype(x.dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return "wgmma"
    return "xla"


def quantized_matmul(x, w, *, compute_dtype=None, out_dtype=None,
                     executor: str = "auto"):
    """``y = x Wᵀ + b`` for ``x [..., K]`` and a quantized ``W [N, K]``: the one function every
    quantized dense layer of :mod:`wna16_jax.models` runs through. ``compute_dtype`` (default
    ``x.dtype``) is the dtype ``W`` is dequantized to and ``x`` is cast to; the products
    accumulate in float32; the result is ``out_dtype`` (default ``x.dtype``). Traceable (meant
    to run inside ``jax.jit``). ``w`` may be a :class:`~wna16_jax.weights.LayerStack` of several
    layers' weights (a scanned decoder): the wgmma executor reads the stack in place, the XLA one
    the layer's slice."""
    stack, w = (w, w.at_layer()) if isinstance(w, LayerStack) else (None, w)
    if getattr(x, "ndim", 0) < 1 or x.shape[-1] != w.in_features:
        raise ShapeError(f"x: expected shape (..., {w.in_features}), got {tuple(getattr(x, 'shape', ()))}")
    cdt = jnp.dtype(compute_dtype or x.dtype)
    name = select_linear_executor(x, w, cdt) if executor == "auto" else executor
    if name not in LINEAR_EXECUTORS:
        raise ConfigError(f"executor: expected 'auto' or one of {sorted(LINEAR_EXECUTORS)}, got {executor!r}")
    if name == "wgmma" and not isinstance(w, WgmmaLinearWeights):
        raise ConfigError(f"executor='wgmma': the weights are {type(w).__name__}, not the wgmma layout "
                          "(QuantizedLinear prepares it on a Hopper GPU)")
    y = LINEAR_EXECUTORS[name](x, stack if stack is not None and name == "wgmma" else w, cdt)
    return y.astype(out_dtype or x.dtype)


# --------------------------------------------------------------------------- NNX modules


class QuantizedWeight(nnx.Variable):
    """Frozen quantized linear weights: one :class:`QuantizedLinearWeights` pytree (packed int32
    words and 16-bit scales as stored). Not an ``nnx.Param``: optimizers built with
    ``wrt=nnx.Param`` never touch it."""


class QuantizedLinear(nnx.Module):
    """``y = x Wᵀ + b`` on a frozen quantized ``W`` held packed (device memory = the checkpoint's
    bytes); dequantized on the fly by :func:`quantized_matmul` inside the caller's program.

    ``compute_dtype`` (None → the input's dtype) is what ``W`` is dequantized to.
    """

    def __init__(self, weights: QuantizedLinearWeights, *, compute_dtype=None, engine: bool | None = None,
                 device=None, _engine_weights: tuple | None = None):
        if _engine_weights is not None:               # QuantizedLinear.fused: (WgmmaLinearWeights, scheme, splits)
            w, self._scheme, self.splits = _engine_weights
            self.in_features, self.out_features = w.in_features, w.out_features
            self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype).name
            self.weight = QuantizedWeight(w)
            return
        if not isinstance(weights, QuantizedLinearWeights):
            raise ConfigError(f"weights: expected QuantizedLinearWeights, got {type(weights).__name__}")
        self.in_features, self.out_features = weights.in_features, weights.out_features
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype).name
        self._scheme = weights.scheme
        self.splits = (self.out_features,)
        w = jax.tree.map(jnp.asarray, weights)
        cdt = jnp.dtype(compute_dtype or jnp.bfloat16)
        if engine is None:        # on a Hopper GPU with 16-bit compute, the wgmma layout where it applies
            engine = cdt in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) and engine_linear_reason(w, device) is None
        elif engine:
            reason = engine_linear_reason(w, device)
            if reason:
                raise ConfigError(f"engine=True: the wgmma kernels do not take this linear: {reason}")
        self.weight = QuantizedWeight(jax.jit(to_engine_linear, static_argnums=1)(w, cdt) if engine else w)

    @property
    def scheme(self) -> QuantScheme:
        return self._scheme

    @classmethod
    def fused(cls, linears: Sequence["QuantizedLinear"]) -> "QuantizedLinear | None":
        """One linear computing ``linears`` (which read the same input) as one GEMM: their
        wgmma-layout weights concatenated along N (each output row is packed on its own, so this
        is exact), ``splits`` their output sizes (split the result with :meth:`split`). None when
        they cannot share one: not all in the wgmma layout, different schemes, input sizes, group
        sizes, compute dtypes or scale dtypes, zero points or biases on some only."""
        ws = [lin.weight.get_value() if isinstance(lin, QuantizedLinear) else None for lin in linears]
        if len(ws) < 2 or not all(isinstance(w, WgmmaLinearWeights) for w in ws):
            return None
        first = ws[0]
        if any(w.in_features != first.in_features or w.group_size != first.group_size
               or w.scales.dtype != first.scales.dtype or (w.zeros is None) != (first.zeros is None)
               or (w.bias is None) != (first.bias is None) for w in ws) or len(
                {lin.compute_dtype for lin in linears}) != 1 or len({lin.scheme for lin in linears}) != 1:
            return None

        def cat(field, axis):
            return None if getattr(first, field) is None else jnp.concatenate([getattr(w, field) for w in ws], axis)

        w = WgmmaLinearWeights(cat("words", 1), cat("scales", 2), cat("zeros", 2), cat("bias", 0),
                               out_features=sum(w.out_features for w in ws), in_features=first.in_features,
                               group_size=first.group_size)
        return cls(None, compute_dtype=linears[0].compute_dtype,
                   _engine_weights=(w, linears[0].scheme, tuple(lin.out_features for lin in linears)))

    def split(self, y) -> tuple:
        """The outputs of the fused linears (see :meth:`fused`) from this one's ``y [..., N]``."""
        return tuple(jnp.split(y, np.cumsum(self.splits)[:-1], axis=-1))

    def dequantized(self, dtype=jnp.bfloat16) -> "DenseLinear":
        """The same layer with ``W`` (and the bias) dequantized into a 16-bit :class:`DenseLinear`."""
        w = self.weight.get_value()
        b = None if w.bias is None else jnp.asarray(w.bias, dtype)
        return DenseLinear(w.dequantize(dtype), b, compute_dtype=self.compute_dtype)

    def __call__(self, x, layer=None):
        """``layer``: where the weight holds several layers stacked (a scanned decoder), the one to
        apply (an int32 scalar)."""
        w = self.weight.get_value()
        return quantized_matmul(x, w if layer is None else layer_stack(w, layer), compute_dtype=self.compute_dtype)


class DenseLinear(nnx.Module):
    """A 16-bit (or float32) linear layer ``y = x Wᵀ + b`` with ``W [N, K]`` as an ``nnx.Param``
    in its stored dtype; computed in ``compute_dtype`` (None → the input's dtype), accumulated
    in float32."""

    def __init__(self, weight, bias=None, *, compute_dtype=None, param_dtype=None):
        w = jnp.asarray(weight, param_dtype) if param_dtype is not None else jnp.asarray(weight)
        if w.ndim != 2:
            raise ShapeError(f"weight: expected a rank-2 [out, in] array, got shape {tuple(w.shape)}")
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype).name
        self.weight = nnx.Param(w)
        if bias is not None:
            b = jnp.asarray(bias, param_dtype) if param_dtype is not None else jnp.asarray(bias)
            if tuple(b.shape) != (self.out_features,):
                raise ShapeError(f"bias: expected shape ({self.out_features},), got {tuple(b.shape)}")
            self.bias = nnx.Param(b)
        else:
            self.bias = None

    def __call__(self, x):
        cdt = jnp.dtype(self.compute_dtype or x.dtype)
        prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
        y = jnp.einsum("...k,nk->...n", x.astype(cdt), self.weight[...].astype(cdt), precision=prec,
                       preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + self.bias[...].astype(jnp.float32)
        return y.astype(x.dtype)


__all__ = ["QuantizedLinearWeights", "QuantizedWeight", "QuantizedLinear", "DenseLinear", "WgmmaLinearWeights",
           "quantized_matmul", "select_linear_executor", "LINEAR_EXECUTORS", "read_quantized_linear",
           "engine_linear_reason", "to_engine_linear"]
