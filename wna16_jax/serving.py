"""Token-count buckets for serving loops: a bounded number of compiled programs.

:func:`wna16_jax.moe.fused_moe` compiles itself, once per input shape. In a serving loop the
token count ``T`` changes from call to call, and every new ``T`` is a new program (seconds of
compilation each for a real layer). This module pads ``T`` up to one of a small, fixed set of
bucket sizes, runs the layer on the bucket and slices the result back to ``T`` rows, so a loop
over any token counts compiles at most one program per bucket it reaches::

    from wna16_jax.moe import fused_moe
    from wna16_jax.serving import BucketedMoE

    moe = BucketedMoE(fused_moe)                 # DEFAULT_BUCKETS: 1, 2, 4, ..., 512, then ×512
    for x, tw, ids in batches:                   # any T
        y = moe(x, tw, ids, weights, activation="silu")          # [T, H]

    layer = BucketedMoE(quantized_moe)           # a wna16_jax.nn.QuantizedMoE (routes itself)
    y = layer(x)                                 # [T, H] or [B, S, H]

Or by hand: ``b = bucket_size(t)``, ``pad_tokens(x, tw, ids, b)``, run, ``unpad_tokens(y, t)``.

**Padded rows.** Padded tokens have zero hidden states, router weight 0 and expert id
``fill_id`` (default 0, a valid id for every layer), so they are routed harmlessly: each token's
output depends on its own row only, and the padded rows are dropped. With the XLA executor the
real rows come out bit for bit the same whatever the padded rows hold (``tests/test_serving.py``).
Compared with the unpadded call, the real rows are the same up to float rounding: the program
runs at another row count, and the choices made from the token count (the formulation on
accelerators, :func:`~wna16_jax.moe.choose_formulation`; the blocked formulation's ``block_m``,
:func:`~wna16_jax.moe.default_block_m`; the row count of each GEMM) change the order of float32
sums. See the tests for the measured differences.

**Where to pad.** The padding and the final slice run on the host when the arrays are concrete
(numpy or committed JAX arrays), because any device operation on a ``[T, ...]`` array is itself
a program compiled per ``T``. Host arrays (the usual input of a serving step) are therefore
padded for free; a JAX array on an accelerator is copied to the host and back. Pad once where a
batch enters the device and keep the bucket shape through the model for the cheapest loop.
Inside a ``jax.jit`` trace the padding and slicing are traced operations of the enclosing program
(the shapes are static there, so bucketing only changes the program's row count).

:func:`count_compiles` counts XLA compilations in a block (``jax.monitoring`` events), to check
a loop's bound.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .errors import ConfigError, ShapeError


def power_of_two_buckets(max_size: int = 512, min_size: int = 1) -> tuple[int, ...]:
    """``(min_size, 2·min_size, …, max_size)``: powers of two (both ends must be powers of two)."""
    for name, v in (("min_size", min_size), ("max_size", max_size)):
        if not isinstance(v, (int, np.integer)) or v < 1 or v & (v - 1):
            raise ConfigError(f"{name}: expected a power of two >= 1, got {v!r}")
    if min_size > max_size:
        raise ConfigError(f"min_size {min_size} exceeds max_size {max_size}")
    out, b = [], int(min_size)
    while b <= max_size:
        out.append(b)
        b *= 2
    return tuple(out)


#: Powers of two 1…512; beyond 512 tokens, multiples of 512 (see :func:`bucket_size`).
DEFAULT_BUCKETS: tuple[int, ...] = power_of_two_buckets(512)


def check_buckets(buckets: Iterable[int]) -> tuple[int, ...]:
    """``buckets`` as a strictly increasing tuple of positive ints, or :class:`ConfigError`."""
    b = tuple(buckets)
    if not b or any(not isinstance(v, (int, np.integer)) or v < 1 for v in b):
        raise ConfigError(f"buckets: expected positive ints, got {b!r}")
    if any(x >= y for x, y in zip(b, b[1:])):
        raise ConfigError(f"buckets: expected strictly increasing sizes, got {b!r}")
    return tuple(int(v) for v in b)


def bucket_size(num_tokens: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The padded token count for ``num_tokens``: the smallest bucket ``>= num_tokens``; beyond
    the largest bucket ``L``, the smallest multiple of ``L`` that holds them (so a loop up to
    ``N`` tokens compiles at most ``len(buckets) + ceil(N / L) - 1`` programs). ``0`` tokens take
    the smallest bucket."""
    b = check_buckets(buckets)
    t = int(num_tokens)
    if t < 0:
        raise ShapeError(f"num_tokens: expected >= 0, got {num_tokens}")
    for v in b:
        if t <= v:
            return v
    top = b[-1]
    return -(-t // top) * top


def buckets_used(token_counts: Iterable[int], buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The sorted distinct bucket sizes that ``token_counts`` pad to: the programs a loop over
    them compiles (one per bucket, per layer and options)."""
    return tuple(sorted({bucket_size(t, buckets) for t in token_counts}))


def _is_traced(a) -> bool:
    return isinstance(a, jax.core.Tracer)


def pad_rows(a, rows: int, fill=0):
    """``a [T, ...]`` padded with ``fill`` to ``[rows, ...]`` (``rows >= T``; no copy when equal).

    Concrete arrays are padded on the host (no device program, so no compilation per ``T``) and
    returned as numpy arrays; traced arrays are padded with ``jnp`` inside the trace."""
    t = a.shape[0]
    if rows < t:
        raise ShapeError(f"cannot pad {t} rows to {rows}: the bucket is smaller than the batch")
    if rows == t:
        return a
    if _is_traced(a):
        return jnp.concatenate([a, jnp.full((rows - t,) + tuple(a.shape[1:]), fill, a.dtype)], axis=0)
    host = np.asarray(a)
    out = np.full((rows,) + host.shape[1:], fill, host.dtype)
    out[:t] = host
    return out


def pad_tokens(x, topk_weights, topk_ids, bucket: int, *, fill_id: int = 0):
    """``(x_p [bucket, H], tw_p [bucket, k], ids_p [bucket, k])``: the batch padded to ``bucket``
    tokens, padded rows harmless — zero hidden states, router weight 0, expert id ``fill_id``
    (a valid global expert id; 0 always is). The real rows are unchanged (see :func:`pad_rows`
    for where the padding runs)."""
    t = x.shape[0]
    if topk_weights.shape[0] != t or topk_ids.shape[0] != t:
        raise ShapeError(f"pad_tokens: x, topk_weights, topk_ids disagree on the token count: "
                         f"{x.shape[0]}, {topk_weights.shape[0]}, {topk_ids.shape[0]}")
    return pad_rows(x, bucket, 0), pad_rows(topk_weights, bucket, 0), pad_rows(topk_ids, bucket, fill_id)


def unpad_tokens(y, num_tokens: int):
    """The first ``num_tokens`` rows of ``y``. A concrete JAX array is sliced on the host and put
    back on its device (a device slice would be a program compiled per ``num_tokens``); numpy
    arrays and traced arrays are sliced directly."""
    if y.shape[0] == num_tokens:
        return y
    if _is_traced(y) or isinstance(y, np.ndarray):
        return y[:num_tokens]
    host = np.asarray(y)[:num_tokens]
    sharding = getattr(y, "sharding", None)
    if sharding is not None and sharding.is_fully_replicated:
        return jax.device_put(host, sharding)
    return jax.device_put(host)


def _unpad_tree(out, num_tokens: int):
    """:func:`unpad_tokens` on every array of ``out`` (an array, or a pytree of ``[rows, ...]`` arrays)."""
    return jax.tree.map(lambda y: unpad_tokens(y, num_tokens), out)


def _is_nnx_module(fn) -> bool:
    try:
        from . import _flax_compat  # noqa: F401 - before flax
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return False
    return isinstance(fn, nnx.Module)


_MODULE_CALL = None


def _module_call():
    """``nnx.jit`` of ``module(x)``: one compiled program per module graph and input shape."""
    global _MODULE_CALL
    if _MODULE_CALL is None:
        from . import _flax_compat  # noqa: F401 - before flax
        from flax import nnx

        _MODULE_CALL = nnx.jit(lambda module, x: module(x))
    return _MODULE_CALL


class BucketedMoE:
    """Run a MoE layer on bucketed token counts and slice the result back.

    ``fn`` is either

    * a routed layer function with :func:`~wna16_jax.moe.fused_moe`'s leading arguments —
      ``fn(x [T, H], topk_weights [T, k], topk_ids [T, k], *args, **kwargs) -> [T, H]``
      (``fused_moe``, :func:`~wna16_jax.autodiff.fused_moe_trainable`, or a jitted function of
      those arguments, which may return a pytree of ``[T, ...]`` arrays): call
      ``bucketed(x, tw, ids, weights, **options)``;
    * a layer that routes itself, ``fn(x) -> y`` with ``x [T, H]`` or ``[B, S, H]`` (a
      :class:`wna16_jax.nn.QuantizedMoE`: it runs through ``nnx.jit``, so its current state is
      used on every call): call ``bucketed(x)``; ``[B, S, H]`` is bucketed on ``B·S`` tokens.

    Padding follows :func:`pad_tokens` (``fill_id`` for the padded rows' expert ids); sizes follow
    :func:`bucket_size` on ``buckets``. ``fn`` must compile itself (``fused_moe`` does) or be
    jitted, else the bucketing saves nothing.
    """

    def __init__(self, fn: Callable, buckets: Sequence[int] = DEFAULT_BUCKETS, *, fill_id: int = 0):
        self.fn = fn
        self.buckets = check_buckets(buckets)
        self.fill_id = int(fill_id)
        self._module = _is_nnx_module(fn)

    def bucket(self, num_tokens: int) -> int:
        """The bucket ``num_tokens`` tokens run in."""
        return bucket_size(num_tokens, self.buckets)

    def __call__(self, hidden_states, topk_weights=None, topk_ids=None, *args, **kwargs):
        if (topk_weights is None) != (topk_ids is None):
            raise ConfigError("BucketedMoE: give both topk_weights and topk_ids (a routed layer function), "
                              "or neither (a layer that routes itself)")
        if getattr(hidden_states, "ndim", 0) < 2:
            raise ShapeError(f"hidden_states: expected shape (T, H) or (B, S, H), got "
                             f"{tuple(getattr(hidden_states, 'shape', ()))}")
        if topk_ids is None:
            return self._call_self_routed(hidden_states, *args, **kwargs)
        t = hidden_states.shape[0]
        b = self.bucket(t)
        xp, twp, idp = pad_tokens(hidden_states, topk_weights, topk_ids, b, fill_id=self.fill_id)
        return _unpad_tree(self.fn(xp, twp, idp, *args, **kwargs), t)

    def _call_self_routed(self, x, *args, **kwargs):
        lead, h = tuple(x.shape[:-1]), x.shape[-1]
        t = int(np.prod(lead))
        x2d = x.reshape(t, h) if len(lead) > 1 else x
        xp = pad_rows(x2d, self.bucket(t), 0)
        if self._module and not args and not kwargs:
            y = _module_call()(self.fn, xp)
        else:
            y = self.fn(xp, *args, **kwargs)
        y = _unpad_tree(y, t)
        if len(lead) > 1:
            y = jax.tree.map(lambda a: a.reshape(*lead, *a.shape[1:]), y)
        return y


def bucketed(fn: Callable | None = None, *, buckets: Sequence[int] = DEFAULT_BUCKETS, fill_id: int = 0):
    """``BucketedMoE(fn, buckets, fill_id=fill_id)``; also a decorator (``@bucketed`` or
    ``@bucketed(buckets=...)``)."""
    if fn is None:
        return lambda f: BucketedMoE(f, buckets, fill_id=fill_id)
    return BucketedMoE(fn, buckets, fill_id=fill_id)


# --------------------------------------------------------------------------- compile counting

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_lock = threading.Lock()
_compiles = 0
_listening = False


def _on_event(event: str, duration: float, **_: Any) -> None:
    global _compiles
    if event == _COMPILE_EVENT:
        with _lock:
            _compiles += 1


class CompileCount:
    """The number of XLA backend compilations since the :func:`count_compiles` block began
    (``count``; final once the block has exited)."""

    def __init__(self):
        self._start = _compiles
        self._end: int | None = None

    @property
    def count(self) -> int:
        return (_compiles if self._end is None else self._end) - self._start

    def __repr__(self) -> str:
        return f"CompileCount({self.count})"


@contextlib.contextmanager
def count_compiles():
    """``with count_compiles() as c: ...; c.count``: XLA compilations in the block, counted from
    ``jax.monitoring``'s backend-compile events (every program JAX compiles, including eager
    operations' small programs; a program loaded from the persistent compilation cache is not
    compiled and not counted). Counts the whole process (all threads)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True
    c = CompileCount()
    try:
        yield c
    finally:
        c._end = _compiles


__all__ = ["DEFAULT_BUCKETS", "power_of_two_buckets", "check_buckets", "bucket_size", "buckets_used",
           "pad_rows", "pad_tokens", "unpad_tokens", "BucketedMoE", "bucketed", "count_compiles",
           "CompileCount"]
