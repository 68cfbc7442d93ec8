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

Token choice: greedy (``temperature=0``), or sampling from ``softmax(logits / temperature)``
restricted to the smallest set of most likely tokens whose probability reaches ``top_p``
(nucleus), with an explicit PRNG key (step ``i`` uses ``fold_in(key, i)``), so a key gives the
same tokens every run. ``stop_tokens``: a sequence is finished once it produced one (the stop
token is the last token of its output); generation ends when every sequence is finished or
after ``max_new_tokens``.

Everything about the request is checked in Python before anything is compiled: typed errors
(:class:`~wna16_jax.errors.ValueRangeError`, :class:`~wna16_jax.errors.ShapeError`,
:class:`~wna16_jax.errors.ConfigError`) name the item, the expected and the actual value.
"""

from __future__ import annotations

import functools
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from .. import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from ..errors import ConfigError, ShapeError, ValueRangeError
from .decoder import MoEDecoder


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def prompt_buckets(max_len: int, min_bucket: int = 16) -> tuple[int, ...]:
    """Prefill lengths: ``min_bucket, 2·min_bucket, …`` below ``max_len``, then ``max_len``."""
    out, b = [], min_bucket
    while b < max_len:
        out.append(b)
        b *= 2
    out.append(max_len)
    return tuple(out)


def choose_tokens(logits, key, temperature, top_p, *, sample: bool):
    """Next tokens ``[B]`` from float32 ``logits [B, V]``: argmax, or nucleus sampling (ties in
    probability broken towards the lower token id, as argmax does)."""
    if not sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = logits / jnp.maximum(temperature, jnp.float32(1e-6))
    order = jnp.argsort(-z, axis=-1, stable=True)
    zs = jnp.take_along_axis(z, order, axis=-1)
    p = jax.nn.softmax(zs, axis=-1)
    keep = (jnp.cumsum(p, axis=-1) - p) < top_p            # the most likely token is always kept
    zs = jnp.where(keep, zs, -jnp.inf)
    pick = jax.random.categorical(key, zs, axis=-1)
    return jnp.take_along_axis(order, pick[:, None], axis=-1)[:, 0].astype(jnp.int32)


class Programs:
    """The compiled steps of one model structure: ``prefill(leaves, tokens [B, P], lengths [B],
    key, temperature, top_p, max_len=, sample=) -> (next [B], logits [B, V], cache)`` and
    ``decode(leaves, cache, tokens [B], positions [B], key, step, temperature, top_p, sample=)
    -> (next, logits, cache)`` (``decode_donating`` reuses the cache's buffers). ``leaves``: the
    model state's arrays as :func:`programs` returns them (flattened once, not per step)."""

    def __init__(self, graphdef, treedef):
        def model_of(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        def prefill(leaves, tokens, lengths, key, temperature, top_p, *, max_len: int, sample: bool):
            model = model_of(leaves)
            b, p = tokens.shape
            cache = model.init_cache(b, max_len)
            positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32)[None], (b, p))
            h, cache = model.hidden_states(tokens, positions, cache, kv_len=p)
            last = jnp.take_along_axis(h, (lengths - 1)[:, None, None].astype(jnp.int32), axis=1)[:, 0]
            logits = model.logits(last)
            nxt = choose_tokens(logits, jax.random.fold_in(key, 0), temperature, top_p, sample=sample)
            return nxt, logits, cache

        def decode(leaves, cache, tokens, positions, key, step, temperature, top_p, *, sample: bool):
            model = model_of(leaves)
            h, cache = model.hidden_states(tokens[:, None], positions[:, None], cache)
            logits = model.logits(h[:, 0])
            nxt = choose_tokens(logits, jax.random.fold_in(key, step), temperature, top_p, sample=sample)
            return nxt, logits, cache

        self.prefill = jax.jit(prefill, static_argnames=("max_len", "sample"))
        self.decode = jax.jit(decode, static_argnames=("sample",))
        self.decode_donating = jax.jit(decode, static_argnames=("sample",), donate_argnames=("cache",))


@functools.lru_cache(maxsize=16)
def _programs_for(graphdef, treedef) -> Programs:
    return Programs(graphdef, treedef)


def programs(model: MoEDecoder) -> tuple[Programs, list]:
    """``(Programs, leaves)`` for ``model``'s current state: models of one structure share their
    compiled programs (one prefill per bucket and batch size, one decode)."""
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    return _programs_for(graphdef, treedef), leaves


class Generator:
    """Generation for ``model`` compiled for ``batch_size`` sequences and a cache of ``max_len``
    positions (see the module doc). The model's weights are read at each call, so a fine-tuned
    model generates with its current parameters."""

    def __init__(self, model: MoEDecoder, *, batch_size: int, max_len: int, min_bucket: int = 16):
        if not isinstance(model, MoEDecoder):
            raise ConfigError(f"model: expected a MoEDecoder, got {type(model).__name__}")
        for name, v in (("batch_size", batch_size), ("max_len", max_len), ("min_bucket", min_bucket)):
            if not _is_int(v) or v < 1:
                raise ConfigError(f"{name}: expected a positive integer, got {v!r}")
        limit = model.config.max_position_embeddings
        if limit is not None and max_len > limit:
            raise ValueRangeError(f"max_len: expected at most max_position_embeddings={limit} "
                                  f"(config.json), got {max_len}")
        self.model = model
        self.batch_size, self.max_len = int(batch_size), int(max_len)
        self.buckets = prompt_buckets(self.max_len, int(min_bucket))

    # ------------------------------------------------------------------ checks
    def check_request(self, prompts, max_new_tokens, temperature=0.0, top_p=1.0, key=None,
                      stop_tokens=()) -> list[list[int]]:
        """Validate a request (nothing is compiled); returns the prompts as lists of ints."""
        vocab = self.model.config.vocab_size
        if isinstance(prompts, np.ndarray) and prompts.ndim == 1:
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) and not isinstance(prompts, np.ndarray):
            raise ConfigError(f"prompts: expected a list of token-id lists, got {type(prompts).__name__}")
        if not 1 <= len(prompts) <= self.batch_size:
            raise ShapeError(f"prompts: this Generator is compiled for batches of at most "
                             f"{self.batch_size} sequences, got {len(prompts)}")
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")
        out = []
        for i, p in enumerate(prompts):
            ids = list(np.asarray(p).reshape(-1).tolist()) if not isinstance(p, (list, tuple)) else list(p)
            if not ids:
                raise ValueRangeError(f"prompts[{i}]: expected at least one token, got an empty prompt")
            for j, t in enumerate(ids):
                if not _is_int(t) or not 0 <= t < vocab:
                    raise ValueRangeError(f"prompts[{i}][{j}]: token id must be an integer in [0, {vocab}) "
                                          f"(vocab_size), got {t!r}")
            if len(ids) + max_new_tokens > self.max_len:
                raise ValueRangeError(f"prompts[{i}]: prompt length {len(ids)} + max_new_tokens "
                                      f"{max_new_tokens} = {len(ids) + max_new_tokens} exceeds the cache "
                                      f"length max_len={self.max_len}")
            out.append([int(t) for t in ids])
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
                not np.isfinite(temperature) or temperature < 0:
            raise ConfigError(f"temperature: expected a finite number >= 0, got {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise ConfigError(f"top_p: expected a number in (0, 1], got {top_p!r}")
        if temperature > 0 and key is None:
            raise ConfigError("key: sampling (temperature > 0) needs an explicit PRNG key, "
                              "e.g. jax.random.key(0); got None")
        for t in stop_tokens:
            if not _is_int(t) or not 0 <= t < vocab:
                raise ValueRangeError(f"stop_tokens: expected token ids in [0, {vocab}), got {t!r}")
        return out

    def bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    # ------------------------------------------------------------------ running
    def stream(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
               key=None, stop_tokens: Sequence[int] = (), with_logits: bool = False) -> Iterator[np.ndarray]:
        """Yield, per step, the new token of every prompt (``int64 [len(prompts)]``, ``-1`` for a
        sequence already finished) as soon as it is on the host; with ``with_logits``, the pair
        ``(tokens, logits)`` with the float32 logits ``[len(prompts), V]`` the tokens were chosen from."""
        ids = self.check_request(prompts, max_new_tokens, temperature, top_p, key, stop_tokens)
        n, b = len(ids), self.batch_size
        lengths = np.ones((b,), np.int32)
        lengths[:n] = [len(p) for p in ids]
        p = self.bucket(int(lengths.max()))
        tokens = np.zeros((b, p), np.int32)
        for i, row in enumerate(ids):
            tokens[i, :len(row)] = row
        sample = temperature > 0
        key = jax.random.key(0) if key is None else key
        temp, tp = jnp.float32(temperature), jnp.float32(top_p)
        stop = np.asarray(list(stop_tokens), np.int64)
        progs, leaves = programs(self.model)
        decode = progs.decode if jax.default_backend() == "cpu" else progs.decode_donating
        tok, logits, cache = progs.prefill(leaves, jnp.asarray(tokens), jnp.asarray(lengths), key, temp, tp,
                                           max_len=self.max_len, sample=sample)
        positions = jnp.asarray(lengths)
        done = np.zeros((n,), bool)
        for step in range(1, max_new_tokens + 1):
            nxt = None
            if step < max_new_tokens:        # dispatch the next step before reading this one back
                nxt = decode(leaves, cache, tok, positions, key, jnp.int32(step), temp, tp, sample=sample)
                positions = positions + 1
            host = np.asarray(tok)[:n].astype(np.int64)
            out = np.where(done, -1, host)
            done = done | np.isin(host, stop)
            yield (out, np.asarray(logits)[:n]) if with_logits else out
            if done.all() or nxt is None:
                return
            tok, logits, cache = nxt

    def generate(self, prompts, max_new_tokens: int, *, temperature: float = 0.0, top_p: float = 1.0,
                 key=None, stop_tokens: Sequence[int] = (),
                 callback: Callable[[int, np.ndarray], None] | None = None) -> list[list[int]]:
        """The generated tokens of every prompt (each list ends at its stop token, or has
        ``max_new_tokens`` tokens). ``callback(step, tokens)`` is called with every streamed step."""
        outs: list[list[int]] = []
        for step, toks in enumerate(self.stream(prompts, max_new_tokens, temperature=temperature, top_p=top_p,
                                                key=key, stop_tokens=stop_tokens)):
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
        ids = self.check_request(prompts, 1)
        n, b = len(ids), self.batch_size
        lengths = np.ones((b,), np.int32)
        lengths[:n] = [len(p) for p in ids]
        tokens = np.zeros((b, self.bucket(int(lengths.max()))), np.int32)
        for i, row in enumerate(ids):
            tokens[i, :len(row)] = row
        progs, leaves = programs(self.model)
        _, logits, _ = progs.prefill(leaves, jnp.asarray(tokens), jnp.asarray(lengths), jax.random.key(0),
                                     jnp.float32(0), jnp.float32(1), max_len=self.max_len, sample=False)
        return np.asarray(logits)[:n]


def default_max_len(prompts, max_new_tokens: int, minimum: int = 64) -> int:
    """The next power of two (at least ``minimum``) that holds the longest prompt plus
    ``max_new_tokens``."""
    need = max((len(p) for p in prompts), default=1) + int(max_new_tokens)
    m = minimum
    while m < need:
        m *= 2
    return m


def generate(model: MoEDecoder, prompt_ids_list, max_new_tokens: int, *, batch_size: int | None = None,
             max_len: int | None = None, temperature: float = 0.0, top_p: float = 1.0, key=None,
             stop_tokens: Sequence[int] = (), callback: Callable[[int, np.ndarray], None] | None = None
             ) -> list[list[int]]:
    """Generate up to ``max_new_tokens`` tokens after each prompt of ``prompt_ids_list`` (see
    :class:`Generator`; ``batch_size`` defaults to the number of prompts, ``max_len`` to
    :func:`default_max_len`). Returns one list of new token ids per prompt."""
    if not isinstance(prompt_ids_list, (list, tuple, np.ndarray)):
        raise ConfigError(f"prompt_ids_list: expected a list of token-id lists, got {type(prompt_ids_list).__name__}")
    prompts = [prompt_ids_list] if isinstance(prompt_ids_list, np.ndarray) and prompt_ids_list.ndim == 1 \
        else list(prompt_ids_list)
    if batch_size is None:
        batch_size = max(len(prompts), 1)
    if max_len is None:
        if not _is_int(max_new_tokens) or max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: expected a positive integer, got {max_new_tokens!r}")
        max_len = default_max_len([np.asarray(p).reshape(-1) for p in prompts], max_new_tokens)
        limit = model.config.max_position_embeddings
        if limit is not None:
            max_len = min(max_len, limit)
    gen = Generator(model, batch_size=batch_size, max_len=max_len)
    return gen.generate(prompts, max_new_tokens, temperature=temperature, top_p=top_p, key=key,
                        stop_tokens=stop_tokens, callback=callback)


__all__ = ["Generator", "generate", "choose_tokens", "prompt_buckets", "default_max_len", "programs", "Programs"]
