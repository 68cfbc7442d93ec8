"""``quantized_matmul``: the dense quantized linear ``y = x Wᵀ + b``, the library's second operation
beside :func:`wna16_jax.moe.fused_moe`.

A dense linear of an AWQ / GPTQ / compressed-tensors checkpoint is stored exactly like one expert
(:mod:`wna16_jax.formats`), so it is held as a one-expert :class:`~wna16_jax.weights.QuantMatrix`
(read by :func:`wna16_jax.checkpoint.read_matrix`, in the checkpoint's form or laid out for an
engine at load, e.g. :func:`wna16_jax.convert.wgmma.wgmma_matrix`) and run by the executor registry
(:func:`wna16_jax.executors.select_matmul`): the wgmma engine's grouped GEMM for a matrix in its
layout with 16-bit activations on a Hopper GPU, the XLA executor (dequantize inside the program,
one ``dot`` accumulating in float32) everywhere else. Differentiable in ``x`` on every executor
(the weights are frozen; the engines' backward is :func:`wna16_jax.autodiff.matmul_trainable`).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import executors
from .errors import ConfigError, ShapeError
from .weights import LayerStack, QuantMatrix


def _matrix(w):
    """The one-expert matrix behind ``w`` (a QuantMatrix or a stack of them), checked."""
    m = w.stacked if isinstance(w, LayerStack) else w
    if not isinstance(m, QuantMatrix) or m.form is None:
        raise ConfigError(f"w: expected a QuantMatrix (one expert) or a LayerStack of them, got {type(m).__name__}")
    lead = 2 if isinstance(w, LayerStack) else 1
    e = jnp.shape(m.qvalue)[lead - 1] if jnp.ndim(m.qvalue) >= lead else None
    if e != 1:
        raise ShapeError(f"w: a dense linear is one expert; this matrix holds {e} (qvalue shape "
                         f"{tuple(jnp.shape(m.qvalue))})")
    return m


def quantized_matmul(x, w, bias=None, *, compute_dtype=None, out_dtype=None, executor: str = "auto"):
    """``y = x Wᵀ + b`` for ``x [..., K]``, ``w`` a one-expert :class:`QuantMatrix` ``[N, K]`` (or a
    :class:`~wna16_jax.weights.LayerStack` of several layers' matrices, read in place where the
    executor can) and ``bias [N]`` or None. ``compute_dtype`` (default ``x.dtype``): what ``W`` is
    dequantized to on the XLA executor (the engines compute in the activations' 16-bit dtype);
    products accumulate in float32; the result is ``out_dtype`` (default ``x.dtype``).
    ``executor``: ``"auto"`` (the registry's first that supports the call) or one by name.
    Traceable (meant to run inside ``jax.jit``)."""
    from .autodiff import matmul_trainable

    m = _matrix(w)
    if getattr(x, "ndim", 0) < 1 or x.shape[-1] != m.form.k:
        raise ShapeError(f"x: expected shape (..., {m.form.k}), got {tuple(getattr(x, 'shape', ()))}")
    if bias is not None and tuple(jnp.shape(bias)) != (m.form.n,):
        raise ShapeError(f"bias: expected shape ({m.form.n},), got {tuple(jnp.shape(bias))}")
    choice = executors.select_matmul(w, x.dtype, executor=executor)
    cdt = jnp.dtype(compute_dtype or x.dtype)
    if choice.executor is executors.XLA:
        y = executors.XLA.matmul(x, w, bias, cdt)
    else:
        y = matmul_trainable(choice.executor.name)(x, w, bias)
    return y.astype(out_dtype or x.dtype)


__all__ = ["quantized_matmul"]
