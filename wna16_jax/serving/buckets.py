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
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import ConfigError, ShapeError, ValueRangeError
from ..fields import check_int, check_number


def power_of_two_buckets(max_size: int = 512, min_size: int = 1) -> tuple[int, ...]:
    """``(min_size, 2·min_size, …, max_size)``: powers of two (both ends must be powers of two)."""
    ends = {}
    for name, v in (("min_size", min_size), ("max_size", max_size)):
        ends[name] = check_int(name, v, low=1)
        if ends[name] & (ends[name] - 1):
            raise ConfigError(f"{name} must be a power of two, got {v!r}")
    min_size, max_size = ends["min_size"], ends["max_size"]
    if min_size > max_size:
        raise ConfigError(f"min_size {min_size} exceeds max_size {max_size}")
    out, b = [], min_size
    while b <= max_size:
        out.append(b)
        b *= 2
    return tuple(out)


#: Powers of two 1…512; beyond 512 tokens, multiples of 512 (see :func:`bucket_size`).
DEFAULT_BUCKETS: tuple[int, ...] = power_of_two_buckets(512)


def _sequence(name: str, value: Any) -> list:
    """``value`` (any iterable but a string or a mapping) as a list, or a ConfigError naming ``name``."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(f"{name}: expected a sequence of integers, got {type(value).__name__} {value!r:.80}")
    return list(value)


def check_buckets(buckets: Iterable[int], name: str = "buckets") -> tuple[int, ...]:
    """``buckets`` as a strictly increasing tuple of positive ints, or :class:`ConfigError` naming
    ``name`` (the argument or attribute that holds them)."""
    b = tuple(check_int(f"{name}[{j}]", v, low=1) for j, v in enumerate(_sequence(name, buckets)))
    if not b:
        raise ConfigError(f"{name}: expected at least one bucket size, got none")
    if any(x >= y for x, y in zip(b, b[1:])):
        raise ConfigError(f"{name}: expected strictly increasing sizes, got {b!r}")
    return b


def _count(name: str, value: Any) -> int:
    """A token count: an integer (:func:`~wna16_jax.fields.check_int`'s rules) that is ``>= 0``
    (a negative count is a :class:`ShapeError`, as a row count)."""
    t = check_int(name, value)
    if t < 0:
        raise ShapeError(f"{name}: expected >= 0, got {value!r}")
    return t


def _bucket_of(t: int, b: tuple[int, ...]) -> int:
    """:func:`bucket_size` of a checked count on checked buckets."""
    for v in b:
        if t <= v:
            return v
    top = b[-1]
    return -(-t // top) * top


def bucket_size(num_tokens: int, buckets: Sequence[int] = DEFAULT_BUCKETS) -> int:
    """The padded token count for ``num_tokens``: the smallest bucket ``>= num_tokens``; beyond
    the largest bucket ``L``, the smallest multiple of ``L`` that holds them (so a loop up to
    ``N`` tokens compiles at most ``len(buckets) + ceil(N / L) - 1`` programs). ``0`` tokens take
    the smallest bucket."""
    return _bucket_of(_count("num_tokens", num_tokens), check_buckets(buckets))


def buckets_used(token_counts: Iterable[int], buckets: Sequence[int] = DEFAULT_BUCKETS) -> tuple[int, ...]:
    """The sorted distinct bucket sizes that ``token_counts`` pad to: the programs a loop over
    them compiles (one per bucket, per layer and options)."""
    b = check_buckets(buckets)
    counts = _sequence("token_counts", token_counts)
    return tuple(sorted({_bucket_of(_count(f"token_counts[{j}]", t), b) for j, t in enumerate(counts)}))


def _is_traced(a) -> bool:
    return isinstance(a, jax.core.Tracer)


def _rows_of(name: str, a: Any) -> int:
    """The leading (token) axis length of array ``a``, or a ShapeError naming ``name``."""
    if getattr(a, "ndim", 0) < 1 or not hasattr(a, "dtype"):
        raise ShapeError(f"{name}: expected an array with a leading token axis, got "
                         f"{type(a).__name__} of shape {tuple(getattr(a, 'shape', ()))}")
    return int(a.shape[0])


def _checked_fill(name: str, fill: Any, dtype: Any):
    """``fill`` as a value that ``dtype`` holds exactly (an integer within the integer dtype's range,
    a finite number within the float dtype's range, a bool for bool), or a typed error naming it:
    padding never rounds, wraps or overflows."""
    dt = jnp.dtype(dtype)
    if jnp.issubdtype(dt, jnp.bool_):
        return bool(fill) if isinstance(fill, (bool, np.bool_)) else bool(check_int(name, fill, low=0, high=1))
    if jnp.issubdtype(dt, jnp.integer):
        v = check_int(name, fill)
        info = jnp.iinfo(dt)
        if not info.min <= v <= info.max:
            raise ValueRangeError(f"{name}: {v} does not fit the rows' dtype {dt} (values in "
                                  f"[{info.min}, {info.max}])")
        return v
    if jnp.issubdtype(dt, jnp.floating):
        v = check_number(name, fill)
        if abs(v) > float(jnp.finfo(dt).max):
            raise ValueRangeError(f"{name}: {v} does not fit the rows' dtype {dt} (magnitude at most "
                                  f"{float(jnp.finfo(dt).max)})")
        return v
    raise ConfigError(f"{name}: padding rows of dtype {dt} is not supported (integer, float or bool rows)")


def _pad(a, rows: Any, fill: Any, name: str, rows_name: str, fill_name: str):
    """:func:`pad_rows` with the names its errors give the array, the row count and the fill."""
    t = _rows_of(name, a)
    rows = check_int(rows_name, rows)
    fill = _checked_fill(fill_name, fill, a.dtype)
    if rows < t:
        raise ShapeError(f"{rows_name}: cannot pad the {t} rows of {name} to {rows}: the bucket is smaller "
                         "than the batch")
    if rows == t:
        return a
    if _is_traced(a):
        return jnp.concatenate([a, jnp.full((rows - t,) + tuple(a.shape[1:]), fill, a.dtype)], axis=0)
    host = np.asarray(a)
    out = np.full((rows,) + host.shape[1:], fill, host.dtype)
    out[:t] = host
    return out


def pad_rows(a, rows: int, fill=0):
    """``a [T, ...]`` padded with ``fill`` to ``[rows, ...]`` (``rows >= T``; no copy when equal).
    ``fill`` must be a value of ``a``'s dtype (never rounded or wrapped into it).

    Concrete arrays are padded on the host (no device program, so no compilation per ``T``) and
    returned as numpy arrays; traced arrays are padded with ``jnp`` inside the trace."""
    return _pad(a, rows, fill, "a", "rows", "fill")


def _fill_id(fill_id: Any) -> int:
    """``fill_id`` checked: an expert id is an integer ``>= 0``."""
    return check_int("fill_id", fill_id, low=0)


def pad_tokens(x, topk_weights, topk_ids, bucket: int, *, fill_id: int = 0):
    """``(x_p [bucket, H], tw_p [bucket, k], ids_p [bucket, k])``: the batch padded to ``bucket``
    tokens, padded rows harmless — zero hidden states, router weight 0, expert id ``fill_id``
    (a valid global expert id; 0 always is). The real rows are unchanged (see :func:`pad_rows`
    for where the padding runs)."""
    fill_id = _fill_id(fill_id)
    counts = [_rows_of(n, a) for n, a in (("x", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids))]
    if len(set(counts)) != 1:
        raise ShapeError(f"pad_tokens: x, topk_weights, topk_ids disagree on the token count: "
                         f"{counts[0]}, {counts[1]}, {counts[2]}")
    return (_pad(x, bucket, 0, "x", "bucket", "fill"), _pad(topk_weights, bucket, 0, "topk_weights", "bucket", "fill"),
            _pad(topk_ids, bucket, fill_id, "topk_ids", "bucket", "fill_id"))


def _unpad(y, num_tokens: Any, name: str):
    """:func:`unpad_tokens` with the name its errors give ``y``."""
    rows = _rows_of(name, y)
    num_tokens = _count("num_tokens", num_tokens)
    if num_tokens > rows:
        raise ShapeError(f"num_tokens: {num_tokens} exceeds the {rows} rows of {name}")
    if rows == num_tokens:
        return y
    if _is_traced(y) or isinstance(y, np.ndarray):
        return y[:num_tokens]
    host = np.asarray(y)[:num_tokens]
    sharding = getattr(y, "sharding", None)
    if sharding is not None and sharding.is_fully_replicated:
        return jax.device_put(host, sharding)
    return jax.device_put(host)


def unpad_tokens(y, num_tokens: int):
    """The first ``num_tokens`` rows of ``y`` (``0 <= num_tokens <= rows``). A concrete JAX array is
    sliced on the host and put back on its device (a device slice would be a program compiled per
    ``num_tokens``); numpy arrays and traced arrays are sliced directly."""
    return _unpad(y, num_tokens, "y")


def _unpad_tree(out, num_tokens: int):
    """:func:`unpad_tokens` on every array of ``out`` (an array, or a pytree of ``[rows, ...]`` arrays;
    errors name the leaf as ``output[...]``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, y: _unpad(y, num_tokens, f"output{jax.tree_util.keystr(path)}"), out)


def _is_nnx_module(fn) -> bool:
    try:
        from .. import _flax_compat  # noqa: F401 - before flax
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return False
    return isinstance(fn, nnx.Module)


_MODULE_CALL = None


def _module_call():
    """``nnx.jit`` of ``module(x)``: one compiled program per module graph and input shape."""
    global _MODULE_CALL
    if _MODULE_CALL is None:
        from .. import _flax_compat  # noqa: F401 - before flax
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

    Padding follows :func:`pad_tokens` (``fill_id`` for the padded rows' expert ids; when the
    layer refuses the padded ids and only the fill id can be at fault, the
    :class:`~wna16_jax.errors.ValueRangeError` names ``fill_id``); sizes follow
    :func:`bucket_size` on ``buckets``. ``fn`` must compile itself (``fused_moe`` does) or be
    jitted, else the bucketing saves nothing.
    """

    def __init__(self, fn: Callable, buckets: Sequence[int] = DEFAULT_BUCKETS, *, fill_id: int = 0):
        if not callable(fn):
            raise ConfigError(f"fn: expected a callable MoE layer (a routed layer function or a layer that "
                              f"routes itself), got {type(fn).__name__}")
        self.fn = fn
        self.buckets = check_buckets(buckets)
        self.fill_id = _fill_id(fill_id)
        self._module = _is_nnx_module(fn)

    def bucket(self, num_tokens: int) -> int:
        """The bucket ``num_tokens`` tokens run in."""
        return bucket_size(num_tokens, self.buckets)

    def __call__(self, hidden_states, topk_weights=None, topk_ids=None, *args, **kwargs):
        if (topk_weights is None) != (topk_ids is None):
            raise ConfigError("BucketedMoE: give both topk_weights and topk_ids (a routed layer function), "
                              "or neither (a layer that routes itself)")
        routed = topk_ids is not None
        if getattr(hidden_states, "ndim", 0) < 2 or (routed and hidden_states.ndim != 2):
            raise ShapeError(f"hidden_states: expected shape (T, H){'' if routed else ' or (B, S, H)'}, got "
                             f"{tuple(getattr(hidden_states, 'shape', ()))}")
        if not routed:
            return self._call_self_routed(hidden_states, *args, **kwargs)
        t = hidden_states.shape[0]
        b = self.bucket(t)
        xp, twp, idp = pad_tokens(hidden_states, topk_weights, topk_ids, b, fill_id=self.fill_id)
        try:
            out = self.fn(xp, twp, idp, *args, **kwargs)
        except ValueRangeError as err:
            if b > t and self._refuses_fill_id(topk_ids, err):
                raise ValueRangeError(f"fill_id: the {b - t} padded rows carry expert id {self.fill_id}, which the "
                                      f"layer refuses (fill_id must be a valid global expert id; 0 always is): "
                                      f"{err}") from err
            raise
        return _unpad_tree(out, t)

    def _refuses_fill_id(self, topk_ids, err: ValueRangeError) -> bool:
        """Whether the layer's refusal of the padded ``topk_ids`` can only be the fill id's fault: the
        real ids are concrete, none below 0, all below ``fill_id`` (so the padded batch's one new
        value is its largest id), and the error is about the ids' range."""
        if self.fill_id == 0 or _is_traced(topk_ids) or not str(err).startswith("topk_ids"):
            return False
        ids = np.asarray(topk_ids)
        return ids.size == 0 or bool(ids.min() >= 0 and ids.max() < self.fill_id)

    def _call_self_routed(self, x, *args, **kwargs):
        lead, h = tuple(x.shape[:-1]), x.shape[-1]
        t = int(np.prod(lead))
        x2d = x.reshape(t, h) if len(lead) > 1 else x
        xp = _pad(x2d, self.bucket(t), 0, "hidden_states", "bucket", "fill")
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
    if fn is None:                                  # checked now, not when the decorator is applied
        checked, fid = check_buckets(buckets), _fill_id(fill_id)
        return lambda f: BucketedMoE(f, checked, fill_id=fid)
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
