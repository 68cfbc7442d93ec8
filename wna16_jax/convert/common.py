"""Checks shared by the converters."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError, UnsupportedError
from ..schemes import QuantScheme
from ..weights import CheckpointWeights

_SIXTEEN_BIT = (np.dtype(np.float16), np.dtype(jnp.bfloat16))


def check_input_dtype(backend: str, input_dtype: Any, allowed: tuple = _SIXTEEN_BIT) -> None:
    """Backends other than Marlin take 16-bit activations only (docs/formats.md §9.3); ``None`` = default."""
    if input_dtype is None:
        return
    dt = np.dtype(input_dtype)
    if dt not in tuple(np.dtype(a) for a in allowed):
        want = " or ".join(str(np.dtype(a)) for a in allowed)
        raise UnsupportedError(f"input_dtype: the {backend} backend takes {want} activations, got {dt}")


def check_same_scheme(scheme: QuantScheme, weights: CheckpointWeights) -> None:
    """The converters' entry check: the loader layout, in ``scheme``, every field's shape and
    dtype right (hand-built pytrees included)."""
    if not isinstance(weights, CheckpointWeights):
        raise ConfigError(f"weights: expected the loader layout (CheckpointWeights), got {type(weights).__name__}")
    if weights.scheme is not None and weights.scheme != scheme:
        raise ConfigError(
            f"scheme: the weights were loaded as {weights.scheme.describe()}, "
            f"but {scheme.describe()} was given")
    (weights if weights.scheme is not None else weights.replace(scheme=scheme)).validate()
