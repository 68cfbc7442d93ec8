"""Dense linear layers of a quantized checkpoint: :class:`QuantizedLinear` and :class:`DenseLinear`.

AWQ, GPTQ and compressed-tensors checkpoints quantize the attention projections and dense MLPs
exactly as one MoE expert (the format table, :mod:`wna16_jax.formats`), and leave the
embeddings, ``lm_head``, norms and routers in 16 bits. A :class:`QuantizedLinear` holds its
weight as a one-expert :class:`~wna16_jax.weights.QuantMatrix` — read by the same reader as the
experts (:func:`wna16_jax.checkpoint.read_matrix`; several modules that read the same input,
q / k / v, read as one matrix of several parts), laid out once at load for the engine the registry
picks (:func:`wna16_jax.executors.preparing_matmul_engine`: on a Hopper GPU the wgmma layout of
one expert), else kept as stored — and runs :func:`wna16_jax.matmul.quantized_matmul`, the
registry's dense linear. Nothing here knows a kernel.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from .. import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from .. import executors
from ..errors import ConfigError, ShapeError
from ..matmul import quantized_matmul
from ..schemes import QuantScheme
from ..weights import CheckpointForm, QuantMatrix, at_layer


class QuantizedWeight(nnx.Variable):
    """Frozen weights of a quantized checkpoint: a linear's one-expert
    :class:`~wna16_jax.weights.QuantMatrix` (packed words and 16-bit scales) and its bias, or a
    matrix kept dequantized where it is only read whole (``DenseLinear(frozen=True)``). Not an
    ``nnx.Param``: optimizers built with ``wrt=nnx.Param`` never touch it; a scanned decoder reads
    it in place at the layer's index of its stack."""


def _is_16bit(dtype) -> bool:
    return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def engine_for(form: CheckpointForm, compute_dtype, device=None) -> tuple[Any, str | None]:
    """``(engine or None, why not)``: the engine that lays a checkpoint matrix of ``form`` out for its
    dense-linear kernel with ``compute_dtype`` activations on ``device`` (16-bit only: float32
    inputs run on the XLA executor, which reads the matrix as stored)."""
    if not _is_16bit(compute_dtype or jnp.bfloat16):
        return None, f"{jnp.dtype(compute_dtype).name} activations (the engines take 16-bit)"
    ex, refused = executors.preparing_matmul_engine(form, device, jnp.dtype(compute_dtype or jnp.bfloat16))
    return ex, None if ex is not None else "; ".join(f"{n}: {r}" for n, r in refused)


class QuantizedLinear(nnx.Module):
    """``y = x Wᵀ + b`` on a frozen quantized ``W [N, K]`` (device memory = the checkpoint's bytes);
    dequantized on the fly by :func:`~wna16_jax.matmul.quantized_matmul` inside the caller's program.

    ``matrix``: the one-expert checkpoint-form :class:`QuantMatrix`; ``bias [N]`` or None;
    ``compute_dtype`` (None → the input's dtype) is what ``W`` is dequantized to. ``splits``: the
    output sizes of the modules read as this one matrix (q, k, v: :meth:`split` cuts ``y`` back).
    ``engine``: None lays the matrix out for the engine the registry picks for 16-bit
    ``compute_dtype`` on ``device``; True requires one (a :class:`ConfigError` with the reasons);
    False keeps it as stored."""

    def __init__(self, matrix: QuantMatrix, bias=None, *, compute_dtype=None, splits: Sequence[int] | None = None,
                 engine: bool | None = None, device=None):
        if not isinstance(matrix, QuantMatrix) or not isinstance(matrix.form, CheckpointForm):
            raise ConfigError(f"matrix: expected a checkpoint-form QuantMatrix, got {type(matrix).__name__}")
        n, k = matrix.form.n, matrix.form.k
        if matrix.num_experts != 1:
            raise ShapeError(f"matrix: a dense linear is one expert, got {matrix.num_experts}")
        self.in_features, self.out_features = k, n
        self.scheme: QuantScheme = matrix.form.scheme
        self.splits = tuple(int(s) for s in (splits or (n,)))
        if sum(self.splits) != n:
            raise ShapeError(f"splits: {self.splits} do not add up to the matrix's N={n}")
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype).name
        m = jax.tree.map(jnp.asarray, matrix)
        if engine is not False:
            ex, reason = engine_for(matrix.form, compute_dtype, device)
            if engine and ex is None:
                raise ConfigError(f"engine=True: no engine takes this linear: {reason}")
            if ex is not None:
                m = ex.prepare_matmul(m, compute_dtype)
        self.weight = QuantizedWeight(m)
        self.bias = None if bias is None else QuantizedWeight(jnp.asarray(bias))

    def split(self, y) -> tuple:
        """The outputs of the modules read as this one matrix (see ``splits``) from ``y [..., N]``."""
        return tuple(jnp.split(y, np.cumsum(self.splits)[:-1], axis=-1))

    def _weights(self):
        """``(W, b)``: in a scanned decoder ``W`` is a :class:`~wna16_jax.weights.LayerStack` (bound
        at the scan boundary: the matmul reads the stack in place) and ``b`` the layer's row."""
        w = self.weight.get_value()
        return w, None if self.bias is None else at_layer(self.bias.get_value())

    def dense(self, dtype):
        """``W [N, K]`` in ``dtype``, dequantized inside the program (a stack: the bound layer's)."""
        return at_layer(self._weights()[0]).dequantize(dtype)[0]

    def dequantized(self, dtype=jnp.bfloat16, *, frozen: bool = False) -> "DenseLinear":
        """The same layer with ``W`` (and the bias) dequantized into a :class:`DenseLinear` of ``dtype``
        (``frozen``: its weights stay out of the optimizer's ``nnx.Param`` set, as these are)."""
        b = None if self.bias is None else jnp.asarray(self.bias.get_value(), dtype)
        return DenseLinear(self.dense(dtype), b, compute_dtype=self.compute_dtype, frozen=frozen)

    def __call__(self, x):
        w, b = self._weights()
        return quantized_matmul(x, w, b, compute_dtype=self.compute_dtype)


class DenseLinear(nnx.Module):
    """A 16-bit (or float32) linear layer ``y = x Wᵀ + b`` with ``W [N, K]`` as an ``nnx.Param``
    in its stored dtype; computed in ``compute_dtype`` (None → the input's dtype), accumulated
    in float32."""

    def __init__(self, weight, bias=None, *, compute_dtype=None, param_dtype=None, frozen: bool = False):
        """``frozen``: the weight (and bias) are :class:`QuantizedWeight` variables, not ``nnx.Param``
        (a quantized checkpoint's matrix kept dequantized: optimizers leave it alone, as they leave
        the quantized one)."""
        var = QuantizedWeight if frozen else nnx.Param
        w = jnp.asarray(weight, param_dtype) if param_dtype is not None else jnp.asarray(weight)
        if w.ndim != 2:
            raise ShapeError(f"weight: expected a rank-2 [out, in] array, got shape {tuple(w.shape)}")
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        self.compute_dtype = None if compute_dtype is None else jnp.dtype(compute_dtype).name
        self.weight = var(w)
        if bias is not None:
            b = jnp.asarray(bias, param_dtype) if param_dtype is not None else jnp.asarray(bias)
            if tuple(b.shape) != (self.out_features,):
                raise ShapeError(f"bias: expected shape ({self.out_features},), got {tuple(b.shape)}")
            self.bias = var(b)
        else:
            self.bias = None

    def dense(self, dtype):
        """``W [N, K]`` in ``dtype`` (in a scanned decoder a 16-bit weight is sliced by the scan, a
        frozen one read at the layer's index of its stack)."""
        return at_layer(self.weight.get_value()).astype(dtype)

    def __call__(self, x):
        cdt = jnp.dtype(self.compute_dtype or x.dtype)
        prec = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
        y = jnp.einsum("...k,nk->...n", x.astype(cdt), self.dense(cdt), precision=prec,
                       preferred_element_type=jnp.float32)
        if self.bias is not None:
            y = y + at_layer(self.bias.get_value()).astype(jnp.float32)
        return y.astype(x.dtype)


__all__ = ["QuantizedWeight", "QuantizedLinear", "DenseLinear", "engine_for", "quantized_matmul"]
