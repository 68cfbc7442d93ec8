"""The gated activations of a MoE layer, ``act(gate) · up`` over the two halves of GEMM1's output.

One definition serves the kernels' fused epilogues (:func:`act_pair`, float32 in and out), the
layers' XLA glue and, through ``wna16_jax.moe``, the XLA executor (:data:`ACTIVATIONS`: each
takes ``h [..., 2I]``, the gate half first — swigluoai's gate and up interleaved, as gpt-oss
stores them).
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from .errors import KernelConfigError

#: swigluoai's constants (gpt-oss): ``g`` capped at ``limit``, ``u`` clipped to ``[-limit, limit]``,
#: output ``(u + 1) · g · sigmoid(α·g)``
SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def silu_and_mul(x):
    i = x.shape[-1] // 2
    return jax.nn.silu(x[..., :i]) * x[..., i:]


def gelu_and_mul(x):
    i = x.shape[-1] // 2
    return jax.nn.gelu(x[..., :i], approximate=False) * x[..., i:]


def gelu_tanh_and_mul(x):
    i = x.shape[-1] // 2
    return jax.nn.gelu(x[..., :i], approximate=True) * x[..., i:]


def swigluoai_and_mul(x, alpha: float = SWIGLUOAI_ALPHA, limit: float = SWIGLUOAI_LIMIT):
    """gpt-oss SwiGLU on interleaved columns: gate = even, up = odd."""
    g = jnp.minimum(x[..., 0::2], limit)
    u = jnp.clip(x[..., 1::2], -limit, limit)
    return (u + 1.0) * g * jax.nn.sigmoid(alpha * g)


ACTIVATIONS: dict[str, Callable] = {
    "silu": silu_and_mul,
    "gelu": gelu_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
    "swigluoai": swigluoai_and_mul,
}

#: the activations the GEMM epilogues fuse (:func:`act_pair`)
FUSED_ACTIVATIONS = ("silu", "gelu_tanh")


def check_activation(activation: str) -> Callable:
    """The function of a supported activation name; :class:`KernelConfigError` otherwise."""
    fn = ACTIVATIONS.get(activation) if isinstance(activation, str) else None
    if fn is None:
        raise KernelConfigError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    return fn


def act_pair(name, g, u):
    """``act(gate) · up`` for the activations the gated epilogue fuses (float32 in and out)."""
    if name == "silu":
        return g / (1.0 + jnp.exp(-g)) * u
    if name == "gelu_tanh":
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * g * (1.0 + jnp.tanh(c * (g + 0.044715 * g * g * g))) * u
    raise KernelConfigError(f"activation {name!r} is not fused (fused: {FUSED_ACTIVATIONS})")


__all__ = ["ACTIVATIONS", "FUSED_ACTIVATIONS", "SWIGLUOAI_ALPHA", "SWIGLUOAI_LIMIT", "act_pair",
           "check_activation", "gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul", "swigluoai_and_mul"]
