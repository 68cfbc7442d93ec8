"""Text generation with a preallocated KV cache: :class:`Generator` and :func:`generate`.

A :class:`Generator` is compiled for one batch size ``B`` and one cache length ``max_len``:

* **prefill** runs a batch of prompts right-padded to a length bucket ``P`` (powers of two from
  ``min_bucket`` up to ``max_len``, and ``max_len`` itself), writes their keys / values into the
  cache at slots ``0..P-1`` (cache slot = position) and returns each prompt's last-token logits:
  one compiled program per bucket reached;
* **decode** feeds one token per sequence at its own position (prompt length + steps so far),
  writes its keys / values at that slot and attends to every slot up to it: one program.

Padding never leaks into a real sequence: a row's queries only see slots at or before their
position, and a slot past a prompt's end is overwritten by that row's next token before any
query of the row reaches it. Rows of the batch beyond the prompts given are filler.

**Prompts**: a list of token-id lists (or tuples, or 1-D integer numpy / jax arrays), of any
lengths; a 2-D integer numpy / jax array (a batch of equal-length prompts); a 1-D one, or one
flat list of ints (``[1, 2, 3]``: *one* prompt of three tokens, recognised by an explicit check
that every element is an int; a list mixing ints and lists is refused).

**Token choice**: greedy (argmax), or sampling from ``softmax(logits / temperature)`` restricted
first to the ``top_k`` most likely tokens (``0``: no top-k), then, renormalized over those, to
the smallest set of most likely tokens whose probability reaches ``top_p`` (nucleus): the order
in which transformers' logits warpers apply them. Ties in probability are broken towards the
lower token id, as argmax breaks them, so top-k keeps exactly ``top_k`` tokens (transformers'
warper keeps every token tied with the ``top_k``-th). Each row samples with its own key
(:func:`row_keys`: ``fold_in(key, r)`` for row ``r`` of one key, or one key per prompt as given),
and its step ``i`` with ``fold_in(row key, i)``: a key gives the same tokens every run, and a
prompt's tokens never depend on the other prompts of its batch.

**Defaults** (arguments left ``None``) come from the model's ``config.generation``
(:class:`~wna16_jax.models.generation_config.GenerationDefaults`, read by ``load_model`` from
``generation_config.json``). Sampling only ever happens with a PRNG key the caller gave:

* ``key=None``: greedy, unless ``temperature > 0`` is passed, which is an error (no key);
* with a ``key``: ``temperature=None`` is the model's ``temperature`` if its ``do_sample`` is
  true, else ``0`` (greedy: ``do_sample=false`` means greedy whatever ``temperature`` says, as
  transformers applies it); an explicit ``temperature > 0`` samples whatever ``do_sample`` says;
* ``top_p=None`` / ``top_k=None``: the model's ``top_p`` / ``top_k`` (1.0 / 0 without the file);
* ``stop_tokens=None``: the model's ``config.eos_token_ids`` (``generation_config.json``'s, then
  ``config.json``'s); ``()``: no stop token. A sequence is finished once it produced one (the stop
  token is the last token of its output); generation ends when every sequence is finished or
  after ``max_new_tokens``.

``key``: a new-style key (``jax.random.key(seed)``), an old-style raw one (``uint32[2]``,
``jax.random.PRNGKey(seed)``: the same key data, so the same tokens) or an int seed in
``[0, 2**32)`` (``key=7`` is ``jax.random.key(7)``; seeds are 32-bit, larger ones would repeat).

**Sizes**: ``batch_size``, ``max_len`` (at most ``max_position_embeddings`` and ``2**31 - 1``:
positions are int32) and ``max_new_tokens`` are checked, and the KV cache's bytes
(:func:`kv_cache_bytes`) against a memory budget (:func:`device_memory_budget`: the device's free memory
where it reports it, else :data:`DEFAULT_MEMORY_BUDGET`; ``memory_budget=`` overrides it), before
anything is allocated or compiled. The budget covers the cache alone: the programs' temporaries
(and, on the CPU, where the decode step does not donate the cache, its second copy) come on top.

Everything about a request is checked in Python before anything is compiled: typed errors
(:class:`~wna16_jax.errors.ConfigError`, :class:`~wna16_jax.errors.ValueRangeError`,
:class:`~wna16_jax.errors.ShapeError`, :class:`~wna16_jax.errors.DTypeError`) name the argument
(and the index), the expected and the actual value; the inputs are never modified.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from .. import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from ..errors import ConfigError, DTypeError, ShapeError, ValueRangeError
from ..fields import check_int, check_number
from .config import DecoderConfig
from .decoder import MoEDecoder
from .generation_config import GenerationDefaults

#: the KV-cache budget, in bytes, where the device does not report its free memory (the CPU)
DEFAULT_MEMORY_BUDGET = 8 << 30
#: the longest cache: positions are int32
MAX_CACHE_LEN = 2**31 - 1
#: int seeds are 32-bit (``jax.random.key`` keeps the low 32 bits without x64)
MAX_SEED = 2**32 - 1


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _kind(v) -> str:
    return f"{type(v).__name__} {v!r}" if len(repr(v)) <= 60 else type(v).__name__


#: a Generator's cache holds a multiple of this many positions (a multiple of 16 below it): the
#: decode-attention kernels read whole blocks of 64 (or 32, 16) slots and refuse other lengths
CACHE_ALIGN = 64


def cache_len(max_len: int) -> int:
    """The positions a :class:`Generator`'s cache holds for ``max_len``: ``max_len`` rounded up to a
    multiple of :data:`CACHE_ALIGN` (of 16 below it). The slots past ``max_len`` are never written,
    and a row reads only its own positions, so the tokens do not depend on the rounding."""
    align = CACHE_ALIGN if max_len >= CACHE_ALIGN else 16
    return -(-int(max_len) // align) * align


def prompt_buckets(max_len: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Prefill lengths: ``min_bucket, 2·min_bucket, …`` below ``max_len``, then ``max_len``."""
    out, b = [], min_bucket
    while b < max_len:
        out.append(b)
        b *= 2
    out.append(max_len)
    return tuple(out)


# --------------------------------------------------------------------------- sizes


def kv_cache_bytes(config: DecoderConfig, batch_size: int, max_len: int, dtype) -> int:
    """Bytes of the KV cache :meth:`MoEDecoder.init_cache` makes: ``num_layers × batch_size ×
    max_len ×`` the bytes one position holds in one layer, which are ``2 × num_kv_heads ×
    head_dim`` values (keys and values), or for latent attention (DeepSeek) ``kv_lora_rank +
    qk_rope_head_dim`` (the normed latent and the shared rotary key), of ``dtype``."""
    per_value = np.dtype(jnp.dtype(dtype)).itemsize
    c = config
    values = (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) if c.mla is not None else 2 * c.num_kv_heads * c.head_dim
    return int(c.num_layers) * int(batch_size) * int(max_len) * values * per_value


def device_memory_budget(device=None) -> tuple[int, str]:
    """``(bytes, where they come from)``: the free memory ``device`` (default
    ``jax.local_devices()[0]``: this process's first device, ``jax.devices()[0]`` in one process)
    reports (``bytes_limit - bytes_in_use`` of ``memory_stats()``), or
    :data:`DEFAULT_MEMORY_BUDGET` where it reports none (the CPU)."""
    device = jax.local_devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except (NotImplementedError, RuntimeError, AttributeError):
        stats = None
    if stats and _is_int(stats.get("bytes_limit")) and _is_int(stats.get("bytes_in_use")):
        return max(int(stats["bytes_limit"]) - int(stats["bytes_in_use"]), 0), f"the free memory of {device}"
    return DEFAULT_MEMORY_BUDGET, f"DEFAULT_MEMORY_BUDGET: {device} reports no memory statistics"


def check_cache_fits(model: MoEDecoder, batch_size: int, max_len: int, budget: int | None = None, *,
                     origin: str = "", positions: int | None = None) -> int:
    """The KV cache's bytes (:func:`kv_cache_bytes` of ``model``'s config and dtype), or a
    :class:`ValueRangeError` naming ``batch_size``, ``max_len``, the bytes and the budget when
    they exceed ``budget`` (None: :func:`device_memory_budget`). ``origin`` says where ``max_len`` came
    from, for the message; ``positions``: what the cache holds per row, if more than ``max_len``
    (:func:`cache_len`)."""
    c = model.config
    t = max(int(max_len), int(positions or 0))
    need = kv_cache_bytes(c, batch_size, t, model.dtype)
    if budget is None:
        budget, source = device_memory_budget()
    else:
        source = "the memory_budget argument"
    if need > budget:
        per = need // (c.num_layers * batch_size * t)
        raise ValueRangeError(
            f"max_len={max_len}{origin}, batch_size={batch_size}: the KV cache needs {need} bytes "
            f"({need / 2**30:.3g} GiB = {c.num_layers} layers x {batch_size} sequences x {t} positions x "
            f"{per} bytes per position and layer), more than the memory budget of {budget} bytes "
            f"({budget / 2**30:.3g} GiB, {source}); lower max_len or batch_size, or pass memory_budget=")
    return need


def _check_model(model) -> MoEDecoder:
    if not isinstance(model, MoEDecoder):
        raise ConfigError(f"model: expected a MoEDecoder (wna16_jax.load_model), got {type(model).__name__}")
    return model


# --------------------------------------------------------------------------- request arguments


@dataclasses.dataclass(frozen=True)
class Prompts:
    """Checked prompts: ``rows`` of token ids and, per row, the ``labels`` messages name it by
    (``"prompts[1]"``; ``"prompts"`` for a single 1-D prompt)."""

    rows: tuple[tuple[int, ...], ...]
    labels: tuple[str, ...]


def _token_error(label: str, j: int, t, vocab: int):
    rule = f"token id must be an integer in [0, {vocab}) (vocab_size), got {t!r}"
    if not _is_int(t):
        return DTypeError(f"{label}[{j}]: {rule} ({type(t).__name__})")
    return ValueRangeError(f"{label}[{j}]: {rule}")


def _array_row(label: str, a: np.ndarray, vocab: int) -> tuple[int, ...]:
    bad = np.flatnonzero((a < 0) | (a >= vocab))
    if bad.size:
        raise _token_error(label, int(bad[0]), a[bad[0]].item(), vocab)
    return tuple(int(t) for t in a.tolist())


def _list_row(label: str, row, vocab: int) -> tuple[int, ...]:
    for j, t in enumerate(row):
        if not _is_int(t) or not 0 <= t < vocab:
            raise _token_error(label, j, t, vocab)
    return tuple(int(t) for t in row)


def _integer_array(name: str, a) -> np.ndarray:
    if not jax.dtypes.issubdtype(a.dtype, jnp.integer):
        raise DTypeError(f"{name}: expected an integer array of token ids, got dtype {a.dtype}")
    return np.asarray(a)


def as_prompts(prompts, vocab_size: int, *, name: str = "prompts") -> Prompts:
    """``prompts`` (see the module doc) checked against ``vocab_size``; errors name ``name``
    and the index. An already checked :class:`Prompts` is returned as it is."""
    if isinstance(prompts, Prompts):
        return prompts
    if isinstance(prompts, (np.ndarray, jax.Array)):
        a = _integer_array(name, prompts)
        if a.ndim == 1:
            rows = ((name, a),)
        elif a.ndim == 2:
            rows = tuple((f"{name}[{i}]", r) for i, r in enumerate(a))
        else:
            raise ShapeError(f"{name}: expected a 1-D array (one prompt) or a 2-D one (a batch of prompts), "
                             f"got shape {a.shape}")
    elif isinstance(prompts, (list, tuple)):
        if prompts and all(_is_int(t) for t in prompts):
            rows = ((name, prompts),)                       # one flat list of ids: one prompt
        else:
            rows = tuple((f"{name}[{i}]", r) for i, r in enumerate(prompts))
    else:
        raise ConfigError(f"{name}: expected a list of token-id lists or an integer array, got "
                          f"{type(prompts).__name__}" + (" (encode text with the tokenizer first)"
                                                         if isinstance(prompts, str) else ""))
    if not rows:
        raise ShapeError(f"{name}: expected at least one prompt, got none")
    out = []
    for label, r in rows:
        if isinstance(r, (np.ndarray, jax.Array)):
            a = _integer_array(label, r)
            if a.ndim != 1:
                raise ShapeError(f"{label}: expected a 1-D array of token ids, got shape {a.shape}")
            ids = _array_row(label, a, vocab_size)
        elif isinstance(r, (list, tuple)):
            ids = _list_row(label, r, vocab_size)
        else:
            raise ConfigError(f"{label}: expected a list of token ids (a flat list of ints is one prompt; "
                              f"ints and lists cannot mix), got {_kind(r)}")
        if not ids:
            raise ValueRangeError(f"{label}: expected at least one token, got an empty prompt")
        out.append(ids)
    return Prompts(tuple(out), tuple(label for label, _ in rows))


def as_prng_key(key):
    """``key`` as one new-style PRNG key: a ``jax.random.key`` (shape ``()``), an old-style raw
    key (``uint32`` of the default implementation's key shape, ``[2]``) or an int seed in
    ``[0, 2**32)``; anything else is a typed error naming ``key``."""
    if _is_int(key):
        return jax.random.key(check_int("key", key, low=0, high=MAX_SEED))
    if isinstance(key, (np.ndarray, jax.Array)):
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            if key.shape != ():
                raise ShapeError(f"key: expected one PRNG key (shape ()), got a key array of shape {key.shape}")
            return key
        raw = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
        if key.dtype != raw.dtype:
            raise DTypeError(f"key: expected a jax.random.key, a raw {raw.dtype}{list(raw.shape)} key or an int "
                             f"seed, got an array of dtype {key.dtype}")
        if key.shape != raw.shape:
            raise ShapeError(f"key: a raw key must have shape {raw.shape}, got shape {key.shape}")
        return jax.random.wrap_key_data(jnp.asarray(key))
    raise ConfigError(f"key: expected a jax.random.key(seed), a raw uint32[2] key (jax.random.PRNGKey) or an int "
                      f"seed in [0, {MAX_SEED}], got {_kind(key)}")


def row_keys(key, num_prompts: int, batch_size: int):
    """The ``[batch_size]`` PRNG keys of a request's rows: ``key`` one key (or seed) for every
    prompt, row ``r`` drawing with ``fold_in(key, r)``; or a list / tuple of one key (or seed) per
    prompt, used as given (so a prompt sampled with key ``k`` gets the same tokens whatever its
    batch: the server's requests do). None (greedy): keys never read."""
    if key is None:
        return jnp.broadcast_to(jax.random.key(0), (batch_size,))
    if isinstance(key, (list, tuple)):
        if len(key) != num_prompts:
            raise ShapeError(f"key: a list of keys needs one key per prompt ({num_prompts}), got {len(key)}")
        given = [as_prng_key(k) for k in key]
        filler = [given[0]] * (batch_size - num_prompts)          # padding rows: never read back
        return jnp.stack(given + filler)
    return step_keys(jnp.broadcast_to(as_prng_key(key), (batch_size,)), jnp.arange(batch_size))


def as_stop_tokens(stop_tokens, default: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """``stop_tokens`` as a tuple of ids in ``[0, vocab_size)``: a list / tuple / 1-D integer
    array; ``None``: ``default``; a lone int or a string is refused (wrap one id: ``[2]``)."""
    if stop_tokens is None:
        return tuple(default)
    if isinstance(stop_tokens, (np.ndarray, jax.Array)):
        a = _integer_array("stop_tokens", stop_tokens)
        if a.ndim != 1:
            raise ShapeError(f"stop_tokens: expected a 1-D array of token ids, got shape {a.shape}")
        stop_tokens = a.tolist()
    if not isinstance(stop_tokens, (list, tuple)):
        raise ConfigError(f"stop_tokens: expected a list of token ids (one id as [id]; () for none), "
                          f"got {_kind(stop_tokens)}")
    for j, t in enumerate(stop_tokens):
        if not _is_int(t):
            raise DTypeError(f"stop_tokens[{j}]: expected a token id (an integer), got {_kind(t)}")
        if not 0 <= t < vocab_size:
            raise ValueRangeError(f"stop_tokens[{j}]: expected a token id in [0, {vocab_size}) (vocab_size), "
                                  f"got {t!r}")
    return tuple(int(t) for t in stop_tokens)


def sampling_settings(defaults: GenerationDefaults, temperature=None, top_p=None, top_k=None, *,
                      keyed: bool) -> tuple[bool, float, float, int]:
    """``(sample, temperature, top_p, top_k)`` for a request: the arguments checked, the ones left
    None taken from ``defaults`` as the module doc says (``keyed``: the caller gave a key)."""
    if temperature is not None:
        t = check_number("temperature", temperature, low=0)
    else:
        t = defaults.temperature if keyed and defaults.do_sample else 0.0
    p = defaults.top_p if top_p is None else check_number("top_p", top_p, above=0, high=1)
    k = defaults.top_k if top_k is None else check_int("top_k", top_k, low=0)
    return t > 0, t, p, k


def _per_row(x):
    """A scalar setting as is; a per-row one ``[B]`` as a column ``[B, 1]``."""
    x = jnp.asarray(x)
    return x if x.ndim == 0 else x[:, None]


def choose_tokens(logits, keys, temperature, top_p, top_k=0, *, sample: bool):
    """Next tokens ``[B]`` from float32 ``logits [B, V]``: argmax, or sampling at ``temperature``
    from the ``top_k`` most likely tokens (``top_k <= 0``: all), then from the smallest set of
    those whose renormalized probability reaches ``top_p``; ties broken towards the lower token
    id, as argmax breaks them (the most likely token is always kept). ``keys [B]``: one PRNG key
    per row (a row's draw depends on its key alone, never on its batch neighbours); the settings
    are scalars or per-row ``[B]`` (a row of temperature 0 takes the argmax)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not sample:
        return greedy
    temperature, top_p, top_k = _per_row(temperature), _per_row(top_p), _per_row(top_k)
    z = logits / jnp.maximum(temperature, jnp.float32(1e-6))
    order = jnp.argsort(-z, axis=-1, stable=True)
    zs = jnp.take_along_axis(z, order, axis=-1)
    rank = jnp.arange(z.shape[-1], dtype=jnp.int32)
    in_top_k = (top_k <= 0) | (rank < top_k)
    zs = jnp.where(in_top_k, zs, -jnp.inf)
    p = jax.nn.softmax(zs, axis=-1)
    keep = in_top_k & ((jnp.cumsum(p, axis=-1) - p) < top_p)
    zs = jnp.where(keep, zs, -jnp.inf)
    pick = jax.vmap(jax.random.categorical)(keys, zs)
    picked = jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature.reshape(-1) <= 0, greedy, picked) if temperature.ndim else picked


def step_keys(keys, steps):
    """Row ``r``'s key for its sampling step ``steps[r]`` (or one step for every row):
    ``fold_in(keys[r], step)``."""
    steps = jnp.broadcast_to(jnp.asarray(steps, jnp.uint32), keys.shape)
    return jax.vmap(jax.random.fold_in)(keys, steps)


#: :class:`Generator`'s default ``decode_steps`` (one step per program: the K-step program is
#: kept off by default until it is measured faster on the GPU, benchmarks/generate.py --decode-steps)
DEFAULT_DECODE_STEPS = 1


class Programs:
    """The compiled steps of one model structure: ``prefill(leaves, tokens [B, P], lengths [B],
    keys, temperature, top_p, top_k=0, max_len=, sample=) -> (next [B], logits [B, V], cache)`` and
    ``decode(leaves, cache, tokens [B], positions [B], keys, step, temperature, top_p, top_k=0,
    sample=) -> (next, logits, cache)`` (``decode_donating`` reuses the cache's buffers; the
    sampling settings are :func:`choose_tokens`'; ``keys [B]``: one key per row, folded with the
    step by :func:`step_keys`). ``leaves``: the model state's arrays as
    :func:`programs` returns them (flattened once, not per step)."""

    def __init__(self, graphdef, treedef):
        def model_of(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        def prefill(leaves, tokens, lengths, keys, temperature, top_p, top_k=0, *, max_len: int, sample: bool):
            model = model_of(leaves)
            b, p = tokens.shape
            cache = model.init_cache(b, max_len)
            positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
            h, cache = model.hidden_states(tokens, positions, cache, kv_len=p)
            last = jnp.take_along_axis(h, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
            logits = model.logits(last)
            nxt = choose_tokens(logits, step_keys(keys, 0), temperature, top_p, top_k, sample=sample)
            return nxt, logits, cache

        def decode(leaves, cache, tokens, positions, keys, step, temperature, top_p, top_k=0, *, sample: bool):
            model = model_of(leaves)
            h, cache = model.hidden_states(tokens[:, None], positions[:, None], cache)
            logits = model.logits(h[:, 0])
            nxt = choose_tokens(logits, step_keys(keys, step), temperature, top_p, top_k, sample=sample)
            return nxt, logits, cache

        def decode_steps(leaves, cache, tokens, positions, keys, step, limit, done, stops, temperature, top_p,
                         top_k=0, *, k: int, sample: bool):
            model = model_of(leaves)
            out = jnp.full((k,) + tokens.shape, -1, jnp.int32)

            def go(c):
                return (c[0] < limit) & ~jnp.all(c[4])

            def body(c):
                i, tok, pos, cache, done, out = c
                h, cache = model.hidden_states(tok[:, None], pos[:, None], cache)
                nxt = choose_tokens(model.logits(h[:, 0]), step_keys(keys, step + i), temperature, top_p, top_k,
                                    sample=sample)
                out = out.at[i].set(jnp.where(done, -1, nxt))
                return i + 1, nxt, pos + 1, cache, done | jnp.isin(nxt, stops), out

            _, tok, positions, cache, done, out = jax.lax.while_loop(
                go, body, (jnp.int32(0), tokens, positions, cache, done, out))
            return out, tok, positions, done, cache

        self.prefill = jax.jit(prefill, static_argnames=("max_len", "sample"))
        self.decode = jax.jit(decode, static_argnames=("sample",))
        self.decode_donating = jax.jit(decode, static_argnames=("sample",), donate_argnames=("cache",))
        self.decode_steps = jax.jit(decode_steps, static_argnames=("k", "sample"))
        self.decode_steps_donating = jax.jit(decode_steps, static_argnames=("k", "sample"), donate_argnames=("cache",))


@functools.lru_cache(maxsize=16)
def _programs_for(graphdef, treedef) -> Programs:
    return Programs(graphdef, treedef)


def programs(model: MoEDecoder) -> tuple[Programs, list]:
    """``(Programs, leaves)`` for ``model``'s current state: models of one structure share their
    compiled programs (one prefill per bucket and batch size, one decode)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return _programs_for(graphdef, treedef), leaves


def _host(x) -> np.ndarray:
    """``x`` on the host. A global array split over the devices of several processes (a model on
    a mesh of several processes) is gathered from all of them: a collective, which every process
    reaches in the same order, as each runs the same generation loop."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


@dataclasses.dataclass(frozen=True)
class Request:
    """A checked request (:meth:`Generator.check_request`): the prompts, ``max_new_tokens``, the
    sampling settings resolved against the model's defaults (``sample``: not greedy; ``top_k``:
    ``0`` for off), the rows' PRNG keys (:func:`row_keys`; never read when greedy)
    and the stop tokens."""

    prompts: Prompts
    max_new_tokens: int
    sample: bool
    temperature: float
    top_p: float
    top_k: int
    keys: Any
    stop_tokens: tuple[int, ...]


class Generator:
    """Generation for ``model`` compiled for ``batch_size`` sequences and a cache of ``max_len``
    positions (see the module doc). The model's weights are read at each call, so a fine-tuned
    model generates with its current parameters.

    ``memory_budget``: the bytes the KV cache may take (default :func:`device_memory_budget`); a larger
    cache is refused here, before anything is allocated.

    ``decode_steps``: tokens decoded per device program (default :data:`DEFAULT_DECODE_STEPS`).
    With ``K > 1`` one program runs up to ``K`` decode steps in a ``while_loop`` (sampling from the
    same per-step keys, stop tokens detected on the device, the loop left once every sequence has
    stopped), and the host reads ``K`` tokens per round trip: the tokens are the one-step path's.
    ``stream(..., with_logits=True)`` always runs one step per program (it returns every step's
    logits)."""

    def __init__(self, model: MoEDecoder, *, batch_size: int, max_len: int, min_bucket: int = 16,
                 memory_budget: int | None = None, decode_steps: int | None = None):
        _check_model(model)
        batch_size = check_int("batch_size", batch_size, low=1)
        max_len = check_int("max_len", max_len, low=1, high=MAX_CACHE_LEN)
        min_bucket = check_int("min_bucket", min_bucket, low=1)
        budget = None if memory_budget is None else check_int("memory_budget", memory_budget, low=1)
        limit = model.config.max_position_embeddings
        if limit is not None and max_len > limit:
            raise ValueRangeError(f"max_len: expected at most max_position_embeddings={limit} "
                                  f"(config.json), got {max_len}")
        k = DEFAULT_DECODE_STEPS if decode_steps is None else check_int("decode_steps", decode_steps, low=1)
        if k >= max_len:
            raise ValueRangeError(f"decode_steps: {k} steps per program do not fit a cache of max_len={max_len} "
                                  f"positions (at most {max_len - 1})")
        self.decode_steps = k
        self.cache_len = cache_len(max_len)
        self.cache_bytes = check_cache_fits(model, batch_size, max_len, budget, positions=self.cache_len)
        self.model = model
        self.batch_size, self.max_len = batch_size, max_len
        self.buckets = prompt_buckets(self.max_len, min_bucket)

    # ------------------------------------------------------------------ checks
    def check_request(self, prompts, max_new_tokens, temperature=None, top_p=None, key=None, stop_tokens=None, *,
                      top_k=None) -> Request:
        """Check a request and resolve its defaults (nothing is compiled or allocated): the
        :class:`Request` :meth:`stream` runs. Arguments as :meth:`stream`'s."""
        c = self.model.config
        checked = as_prompts(prompts, c.vocab_size)
        if len(checked.rows) > self.batch_size:
            raise ShapeError(f"prompts: this Generator is compiled for batches of at most "
                             f"{self.batch_size} sequences, got {len(checked.rows)}")
        n = check_int("max_new_tokens", max_new_tokens, low=1)
        for label, ids in zip(checked.labels, checked.rows):
            if len(ids) + n > self.max_len:
                raise ValueRangeError(f"{label}: prompt length {len(ids)} + max_new_tokens {n} = {len(ids) + n} "
                                      f"exceeds the cache length max_len={self.max_len}")
        sample, t, p, k = sampling_settings(c.generation, temperature, top_p, top_k, keyed=key is not None)
        if key is None and sample:
            raise ConfigError("key: sampling (temperature > 0) needs an explicit PRNG key, "
                              "e.g. jax.random.key(0) or an int seed; got None")
        stops = as_stop_tokens(stop_tokens, c.eos_token_ids, c.vocab_size)
        keys = row_keys(key, len(checked.rows), self.batch_size)   # last: making a key compiles once
        return Request(checked, n, sample, t, p, k, keys, stops)

    def bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def _padded(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens [B, bucket], lengths [B])``: the rows right-padded, filler rows of length 1."""
        lengths = np.ones((self.batch_size,), np.int32)
        lengths[:len(rows)] = [len(r) for r in rows]
        tokens = np.zeros((self.batch_size, self.bucket(int(lengths.max()))), np.int32)
        for i, row in enumerate(rows):
            tokens[i, :len(row)] = row
        return tokens, lengths

    # ------------------------------------------------------------------ running
    def stream(self, prompts, max_new_tokens: int, *, temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, key=None, stop_tokens: Sequence[int] | None = None,
               with_logits: bool = False) -> Iterator[np.ndarray]:
        """Yield, per step, the new token of every prompt (``int64 [len(prompts)]``, ``-1`` for a
        sequence already finished) as soon as it is on the host; with ``with_logits``, the pair
        ``(tokens, logits)`` with the float32 logits ``[len(prompts), V]`` the tokens were chosen from.

        ``prompts``, ``key``, and the defaults of ``temperature``, ``top_p``, ``top_k`` and
        ``stop_tokens`` (None: the model's): see the module doc. The request is checked when
        this is called, before the first step."""
        req = self.check_request(prompts, max_new_tokens, temperature, top_p, key, stop_tokens, top_k=top_k)
        return self._run(req, with_logits)

    def _run(self, req: Request, with_logits: bool) -> Iterator[np.ndarray]:
        if self.decode_steps > 1 and not with_logits:
            return self._run_steps(req)
        return self._run_one(req, with_logits)

    def _run_steps(self, req: Request) -> Iterator[np.ndarray]:
        """:meth:`_run_one` with ``decode_steps`` tokens per program: the next block is dispatched
        before this one is read back; ``done`` (filler rows done from the start) stays on the device."""
        rows = req.prompts.rows
        n, k = len(rows), self.decode_steps
        tokens, lengths = self._padded(rows)
        sample, key = req.sample, req.keys
        temp, tp = jnp.float32(req.temperature), jnp.float32(req.top_p)
        tk = jnp.int32(min(req.top_k, self.model.config.vocab_size))
        stop = np.asarray(req.stop_tokens, np.int64)
        stops = jnp.asarray(req.stop_tokens or (-1,), jnp.int32)        # -1: no token is ever -1
        progs, leaves = programs(self.model)
        run = progs.decode_steps if jax.default_backend() == "cpu" else progs.decode_steps_donating
        tok, _, cache = progs.prefill(leaves, jnp.asarray(tokens), jnp.asarray(lengths), key, temp, tp, tk,
                                      max_len=self.cache_len, sample=sample)
        host = _host(tok)[:n].astype(np.int64)
        done = np.isin(host, stop)
        yield host
        if done.all() or req.max_new_tokens == 1:
            return
        dev_done = jnp.asarray(np.concatenate([done, np.ones(self.batch_size - n, bool)]))
        positions, step = jnp.asarray(lengths), 1

        def block(step, tok, positions, dev_done, cache):
            limit = min(k, req.max_new_tokens - step)
            return run(leaves, cache, tok, positions, key, jnp.int32(step), jnp.int32(limit), dev_done, stops,
                       temp, tp, tk, k=k, sample=sample), limit

        pending = block(step, tok, positions, dev_done, cache)
        while pending is not None:
            (outs, tok, positions, dev_done, cache), limit = pending
            step += limit
            pending = block(step, tok, positions, dev_done, cache) if step < req.max_new_tokens else None
            for row in _host(outs)[:limit, :n].astype(np.int64):
                out = np.where(done, -1, row)
                done = done | np.isin(row, stop)
                yield out
                if done.all():
                    return

    def _run_one(self, req: Request, with_logits: bool) -> Iterator[np.ndarray]:
        rows = req.prompts.rows
        n = len(rows)
        tokens, lengths = self._padded(rows)
        sample, key = req.sample, req.keys
        temp, tp = jnp.float32(req.temperature), jnp.float32(req.top_p)
        tk = jnp.int32(min(req.top_k, self.model.config.vocab_size))
        stop = np.asarray(req.stop_tokens, np.int64)
        progs, leaves = programs(self.model)
        decode = progs.decode if jax.default_backend() == "cpu" else progs.decode_donating
        tok, logits, cache = progs.prefill(leaves, jnp.asarray(tokens), jnp.asarray(lengths), key, temp, tp, tk,
                                           max_len=self.cache_len, sample=sample)
        positions = jnp.asarray(lengths)
        done = np.zeros((n,), bool)
        for step in range(1, req.max_new_tokens + 1):
            nxt = None
            if step < req.max_new_tokens:        # dispatch the next step before reading this one back
                nxt = decode(leaves, cache, tok, positions, key, jnp.int32(step), temp, tp, tk, sample=sample)
                positions = positions + 1
            host = _host(tok)[:n].astype(np.int64)
            out = np.where(done, -1, host)
            done = done | np.isin(host, stop)
            yield (out, _host(logits)[:n]) if with_logits else out
            if done.all() or nxt is None:
                return
            tok, logits, cache = nxt

    def generate(self, prompts, max_new_tokens: int, *, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, key=None,
                 stop_tokens: Sequence[int] | None = None,
                 callback: Callable[[int, np.ndarray], None] | None = None) -> list[list[int]]:
        """The generated tokens of every prompt (each list ends at its stop token, or has
        ``max_new_tokens`` tokens); arguments as :meth:`stream`'s. ``callback(step, tokens)`` is
        called with every streamed step."""
        if callback is not None and not callable(callback):
            raise ConfigError(f"callback: expected a function callback(step, tokens) or None, got {_kind(callback)}")
        outs: list[list[int]] = []
        for step, toks in enumerate(self.stream(prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                                                top_k=top_k, key=key, stop_tokens=stop_tokens)):
            if not outs:
                outs = [[] for _ in toks]
            if callback is not None:
                callback(step, toks)
            for o, t in zip(outs, toks):
                if t >= 0:
                    o.append(int(t))
        return outs

    def prefill_logits(self, prompts) -> np.ndarray:
        """float32 last-token logits ``[len(prompts), V]`` of the prefill program (for checks)."""
        rows = self.check_request(prompts, 1, stop_tokens=()).prompts.rows
        tokens, lengths = self._padded(rows)
        progs, leaves = programs(self.model)
        _, logits, _ = progs.prefill(leaves, jnp.asarray(tokens), jnp.asarray(lengths), row_keys(None, 0, self.batch_size),
                                     jnp.float32(0), jnp.float32(1), jnp.int32(0), max_len=self.cache_len,
                                     sample=False)
        return _host(logits)[:len(rows)]


def default_max_len(prompts, max_new_tokens: int, minimum: int = 64) -> int:
    """The next power of two (at least ``minimum``) that holds the longest prompt plus
    ``max_new_tokens``."""
    need = max((len(p) for p in prompts), default=1) + int(max_new_tokens)
    m = minimum
    while m < need:
        m *= 2
    return m


def generate(model: MoEDecoder, prompt_ids_list, max_new_tokens: int, *, batch_size: int | None = None,
             max_len: int | None = None, temperature: float | None = None, top_p: float | None = None,
             top_k: int | None = None, key=None, stop_tokens: Sequence[int] | None = None,
             callback: Callable[[int, np.ndarray], None] | None = None,
             memory_budget: int | None = None) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` tokens after each prompt of ``prompt_ids_list`` (see
    :class:`Generator` and the module doc for the prompts, the key and the defaults;
    ``batch_size`` defaults to the number of prompts, ``max_len`` to :func:`default_max_len`,
    capped at ``max_position_embeddings``). Returns one list of new token ids per prompt."""
    _check_model(model)
    prompts = as_prompts(prompt_ids_list, model.config.vocab_size, name="prompt_ids_list")
    n = check_int("max_new_tokens", max_new_tokens, low=1)
    if batch_size is None:
        batch_size = len(prompts.rows)
    if max_len is None:
        max_len = default_max_len(prompts.rows, n)
        limit = model.config.max_position_embeddings
        if limit is not None:
            max_len = min(max_len, limit)
        else:                      # name max_new_tokens, which this max_len comes from
            budget = None if memory_budget is None else check_int("memory_budget", memory_budget, low=1)
            longest = max(len(r) for r in prompts.rows)
            if max_len > MAX_CACHE_LEN:
                raise ValueRangeError(f"max_new_tokens: the longest prompt ({longest}) + max_new_tokens ({n}) "
                                      f"needs a cache of more than {MAX_CACHE_LEN} positions (int32 positions)")
            check_cache_fits(model, check_int("batch_size", batch_size, low=1), max_len, budget,
                             origin=f" (the longest prompt, {longest}, + max_new_tokens={n}, rounded up)")
    gen = Generator(model, batch_size=batch_size, max_len=max_len, memory_budget=memory_budget)
    return gen.generate(prompts, n, temperature=temperature, top_p=top_p, top_k=top_k, key=key,
                        stop_tokens=stop_tokens, callback=callback)


__all__ = ["Generator", "Request", "Prompts", "generate", "choose_tokens", "prompt_buckets", "default_max_len",
           "programs", "Programs", "kv_cache_bytes", "device_memory_budget", "check_cache_fits", "as_prompts",
           "as_prng_key", "row_keys", "step_keys", "as_stop_tokens", "sampling_settings", "DEFAULT_MEMORY_BUDGET", "MAX_CACHE_LEN",
           "MAX_SEED"]
