"""Typed errors. Every error the library raises on bad input is a :class:`WNA16Error`.

Each subclass also derives from the builtin exception a Python user would expect
(``ValueError`` for bad values and shapes, ``TypeError`` for dtypes, ``KeyError``-like
``LookupError`` for missing tensors, ``NotImplementedError`` for refused configurations),
so ``except ValueError`` keeps working for callers that do not know this library.
"""

from __future__ import annotations

from typing import Any, Sequence

from pallas_kernels import errors as _k


class WNA16Error(Exception):
    """Base class of every error raised by wna16_jax on bad input or unsupported requests."""


class ConfigError(WNA16Error, ValueError):
    """A quantization config (or model config) is malformed or names unsupported values."""


class ShapeError(WNA16Error, ValueError):
    """A tensor has the wrong shape, or a size violates a layout's divisibility rule."""


class DTypeError(WNA16Error, TypeError):
    """A tensor has the wrong dtype."""


class MissingTensorError(WNA16Error, LookupError):
    """A checkpoint lacks a tensor the format requires."""


class UnexpectedTensorError(WNA16Error, LookupError):
    """A checkpoint carries a tensor the format does not know what to do with."""


class ValueRangeError(WNA16Error, ValueError):
    """A tensor holds values outside their legal range (g_idx, topk_ids, codes, ...)."""


class UnsupportedError(WNA16Error, NotImplementedError):
    """A backend or function refuses this (otherwise valid) configuration."""


class BackendSelectionError(WNA16Error, RuntimeError):
    """No backend of the dispatch table supports the request; the message lists every reason."""


class CorruptFileError(WNA16Error, ValueError):
    """A file is not in the format it claims (a safetensors header, an index or manifest that is
    not valid JSON, offsets past the end of the file, ...). The message names the file."""


class UnsafePathError(WNA16Error, ValueError):
    """A path read from an index or a manifest would leave the checkpoint folder, or names a
    file kind that is never read (pickled ``*.bin`` weights)."""


class OutputPathError(WNA16Error, ValueError):
    """An output folder is refused: it is the input, lies inside it, is a file, or is not empty."""


class NotCachedError(WNA16Error, LookupError):
    """A Hugging Face hub id (or the revision asked for) is not in the local hub cache. Nothing is
    ever downloaded; the message names the id, the cache folder searched and the download command."""


def _fmt_shape(shape: Any) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def check_shape(name: str, array: Any, expected: Sequence[int]) -> None:
    """Raise :class:`ShapeError` naming ``name`` unless ``array.shape == expected``."""
    actual = tuple(getattr(array, "shape", ()))
    if actual != tuple(expected):
        raise ShapeError(
            f"{name}: expected shape {_fmt_shape(tuple(expected))}, got {_fmt_shape(actual)}"
        )


def check_rank(name: str, array: Any, rank: int) -> None:
    actual = tuple(getattr(array, "shape", ()))
    if len(actual) != rank:
        raise ShapeError(f"{name}: expected a rank-{rank} tensor, got shape {_fmt_shape(actual)}")


def check_dtype(name: str, array: Any, expected: Any) -> None:
    """Raise :class:`DTypeError` unless ``array.dtype`` is ``expected`` (or one of a tuple)."""
    import numpy as np

    allowed = expected if isinstance(expected, (tuple, list)) else (expected,)
    actual = np.dtype(array.dtype)
    if not any(actual == np.dtype(a) for a in allowed):
        want = " or ".join(str(np.dtype(a)) for a in allowed)
        raise DTypeError(f"{name}: expected dtype {want}, got {actual}")


def check_divisible(name: str, value: int, divisor: int, rule: str = "") -> None:
    """Raise :class:`ShapeError` unless ``divisor`` divides ``value``."""
    if divisor <= 0 or value % divisor != 0:
        extra = f" ({rule})" if rule else ""
        raise ShapeError(f"{name}: {value} is not a multiple of {divisor}{extra}")


def from_kernel_error(e: Exception) -> WNA16Error:
    """The library's error for a ``pallas_kernels`` error (same message, the matching kind)."""
    kind = (ConfigError if isinstance(e, _k.KernelConfigError) else ShapeError if isinstance(e, _k.KernelShapeError)
            else DTypeError if isinstance(e, _k.KernelDTypeError)
            else UnsupportedError if isinstance(e, _k.KernelUnsupportedError) else ConfigError)
    return kind(str(e))


class kernel_errors:
    """Context manager (and decorator) at the boundary to ``pallas_kernels``: a kernel's
    ``KernelError`` leaves it as the matching :class:`WNA16Error`, with the same message."""

    def __enter__(self):
        return self

    def __exit__(self, typ, value, tb):
        if value is not None and isinstance(value, _k.KernelError):
            raise from_kernel_error(value) from None
        return False

    def __call__(self, fn):
        import functools

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with kernel_errors():
                return fn(*args, **kwargs)
        return wrapped
