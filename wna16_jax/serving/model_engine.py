"""The paged model engine: a :class:`~wna16_jax.models.MoEDecoder` behind the serving
:class:`~wna16_jax.serving.engine.Engine` interface (:class:`ModelEngine`).

::

    engine = ModelEngine(load_model(path))                 # the pool sized from the free memory
    scheduler = Scheduler(engine)                          # or server.create_app(engine, tok, name)

**The pool.** One :class:`~wna16_jax.models.kv_cache.KVCache` pool of ``num_blocks`` blocks of
``block_size`` positions for every layer (:meth:`MoEDecoder.init_paged_cache`), allocated once
and written in place by every program (donated where the backend donates, not on the CPU).
:attr:`~ModelEngine.bytes_per_block` is one block of every layer's keys and values;
:attr:`~ModelEngine.pool_bytes` the whole pool. ``num_blocks=None`` takes what the memory budget
holds — ``memory_budget`` bytes, by default :data:`POOL_FRACTION` of the device's free memory
(:func:`~wna16_jax.models.generation.device_memory_budget`, read after the model is loaded) — but
never more than the scheduler can use at once (``reserved_blocks`` plus ``max(batch_sizes)``
sequences of ``max_model_len``). ``max_model_len`` (a multiple of ``block_size``) defaults to
the model's ``max_position_embeddings`` capped at :data:`DEFAULT_MAX_MODEL_LEN`, and to what the
pool holds when that is less.

**The programs.** One prefill program per chunk size and one decode program per batch size,
each per table width (:attr:`~ModelEngine.table_widths`), whatever the sampling mix: at most
``(len(chunk_sizes) + len(batch_sizes)) * len(table_widths)`` compilations, each the first time
its shape is used. A step passes the programs the first ``w`` entries of its rows' block tables,
``w`` the smallest width that holds the longest row of the step, so attention reads the blocks of
the step's longest sequence (rounded up to its width), not ``max_model_len`` positions a row:
on an NVIDIA GPU the paged decode kernel (:mod:`wna16_jax.attention`) reads only each row's own
blocks within that width, elsewhere XLA gathers the width's blocks and masks the later slots.
The default widths are ``max_blocks_per_seq`` divided by 8, 4, 2 and 1 (rounded up), so a
short sequence's step reads an eighth of the table. The model's state is flattened once, here:
the engine serves the weights the model had when it was made.

**Sampling.** Row ``r`` draws with ``fold_in(key(seed), step)`` (:func:`seed_key`), as
:meth:`Generator.generate(..., key=[seed_key(seed)]) <wna16_jax.models.Generator.generate>`
draws, so a request's tokens are the ones :class:`~wna16_jax.models.Generator` gives its prompt
alone. A seed in ``[0, 2**32)`` is ``jax.random.key(seed)``; any other signed 64-bit seed is the
key whose data are the two 32-bit words of its two's complement, high word first
(``jax.random.wrap_key_data([seed >> 32 & 0xFFFFFFFF, seed & 0xFFFFFFFF])``: what
``jax.random.key(seed)`` gives with 64-bit integers enabled). Temperature-0 rows take the argmax;
a program whose rows are all greedy skips the sampler's sort (``lax.cond``).

Every argument is checked on the host before anything runs: a wrong shape, dtype, token, block
id, position or step is a typed error naming it (a real row naming a reserved block, a position
whose block is missing, a block in two rows of one decode); inputs are never modified.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .. import _flax_compat  # noqa: F401 - lets Flax import on JAX 0.11 (before flax)
from flax import nnx

from ..errors import ConfigError, ShapeError, UnsupportedError, ValueRangeError
from ..fields import check_int
from ..models.decoder import MoEDecoder
from ..models.generation import choose_tokens, device_memory_budget, step_keys
from ..models.kv_cache import KVCache, cache_bytes
from .buckets import check_buckets
from .engine import SEED_RANGE, SamplingParams, decode_arrays, int_array

#: the longest default context: attention reads a row's whole table every step, so a longer one
#: costs every decode step (pass ``max_model_len`` for more)
DEFAULT_MAX_MODEL_LEN = 4096
#: the share of the device's free memory a pool sized from it takes (the rest: the programs'
#: temporaries)
POOL_FRACTION = 0.9
_WORD = 0xFFFFFFFF


# --------------------------------------------------------------------------- seeds


def seed_words(seed: int) -> tuple[int, int]:
    """``(high, low)``: the two 32-bit words of the signed 64-bit ``seed``'s two's complement."""
    s = check_int("seed", seed, low=SEED_RANGE[0], high=SEED_RANGE[1]) & ((1 << 64) - 1)
    return s >> 32, s & _WORD


def seed_key(seed: int):
    """The PRNG key a request with ``seed`` draws with (see the module doc): ``jax.random.key(seed)``
    for a seed in ``[0, 2**32)``, else the key of its two words."""
    high, low = seed_words(seed)
    if high == 0:
        return jax.random.key(low)
    return jax.random.wrap_key_data(jnp.asarray([high, low], jnp.uint32))


def _row_keys(words):
    """``[n]`` keys of ``words [n, 2]`` uint32 (:func:`seed_key` of each row, in a program)."""
    small = jax.random.key_data(jax.vmap(jax.random.key)(words[:, 1]))
    return jax.random.wrap_key_data(jnp.where((words[:, 0] == 0)[:, None], small, words))


def _check_key_impl() -> None:
    raw = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))
    if raw.shape != (2,) or raw.dtype != jnp.uint32:
        raise UnsupportedError(f"jax_default_prng_impl: the engine maps 64-bit seeds to uint32[2] key data, but "
                               f"the default PRNG implementation's keys are {raw.dtype}{list(raw.shape)} "
                               f"({jax.config.jax_default_prng_impl}); use threefry2x32")


# --------------------------------------------------------------------------- the programs


def _next_tokens(model, h, words, steps, temperature, top_p, top_k):
    """The tokens after hidden states ``h [n, H]``: greedy rows the argmax, the others sampled
    with their step's key; the sort is skipped when every row is greedy."""
    logits = model.logits(h)
    keys = step_keys(_row_keys(words), steps)

    def choose(sample):
        return lambda: choose_tokens(logits, keys, temperature, top_p, top_k, sample=sample)

    return jax.lax.cond(jnp.any(temperature > 0), choose(True), choose(False))


class _Programs:
    """The jitted steps over the flattened model: ``prefill(leaves, k, v, tokens [1, C],
    positions [1, C], table [1, M], last, words, temperature, top_p, top_k) -> (token [1], k, v)``
    (``last``: the index of the chunk's last real token) and ``decode(leaves, k, v, tokens [n],
    positions [n], tables [n, M], words, steps, temperature, top_p, top_k) -> (tokens [n], k, v)``;
    ``k``, ``v``: the pool's arrays, donated where the backend donates."""

    def __init__(self, graphdef, treedef):
        def model_of(leaves):
            return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))

        def prefill(leaves, k, v, tokens, positions, table, last, words, temperature, top_p, top_k):
            model = model_of(leaves)
            h, cache = model.hidden_states(tokens, positions, KVCache(k, v, table))
            row = jax.lax.dynamic_index_in_dim(h, last, axis=1, keepdims=False)
            steps = jnp.zeros((1,), jnp.int32)
            return _next_tokens(model, row, words, steps, temperature, top_p, top_k), cache.k, cache.v

        def decode(leaves, k, v, tokens, positions, tables, words, steps, temperature, top_p, top_k):
            model = model_of(leaves)
            h, cache = model.hidden_states(tokens[:, None], positions[:, None], KVCache(k, v, tables))
            return _next_tokens(model, h[:, 0], words, steps, temperature, top_p, top_k), cache.k, cache.v

        donate = () if jax.default_backend() == "cpu" else (1, 2)
        self.prefill = jax.jit(prefill, donate_argnums=donate)
        self.decode = jax.jit(decode, donate_argnums=donate)


# --------------------------------------------------------------------------- sizes


def _table_width(model: MoEDecoder, block_size: int, max_model_len: Any) -> int:
    """Blocks per sequence: ``max_model_len / block_size``, or the default's (module doc)."""
    limit = model.config.max_position_embeddings
    if max_model_len is None:
        top = min(limit or DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_MODEL_LEN)
        if top < block_size:
            raise ConfigError(f"block_size: {block_size} positions exceed the model's context "
                              f"(max_position_embeddings={limit}); use a smaller block_size")
        return top // block_size
    n = check_int("max_model_len", max_model_len, low=block_size, high=limit)
    if n % block_size:
        raise ConfigError(f"max_model_len: expected a multiple of block_size={block_size}, got {n} "
                          f"(e.g. {n // block_size * block_size} or {-(-n // block_size) * block_size})")
    return n // block_size


def _table_widths(widths: Any, top: int) -> tuple[int, ...]:
    """The compiled table widths: ``widths`` checked (increasing, at most ``top``) with ``top``
    added when missing (a row may always use its whole table); None: ``top`` / 8, 4, 2, 1."""
    if widths is None:
        return tuple(sorted({-(-top // d) for d in (8, 4, 2, 1)}))
    w = check_buckets(widths, "table_widths")
    if w[-1] > top:
        raise ConfigError(f"table_widths: expected widths of at most max_blocks_per_seq = {top} blocks, "
                          f"got {w[-1]}")
    return w if w[-1] == top else (*w, top)


def _width_of(widths: tuple[int, ...], blocks: int) -> int:
    return next(w for w in widths if w >= blocks)


def _budget(memory_budget: Any) -> tuple[int, str]:
    if memory_budget is not None:
        return check_int("memory_budget", memory_budget, low=1), "the memory_budget argument"
    free, source = device_memory_budget()
    return int(free * POOL_FRACTION), f"{POOL_FRACTION:g} of {source}"


def _plan_pool(num_blocks: Any, width: int, explicit_len: bool, reserved: int, max_batch: int,
               per_block: int, budget: tuple[int, str]) -> tuple[int, int]:
    """``(num_blocks, width)``: the pool and the table width, checked against the budget."""
    limit, source = budget
    fit = limit // per_block
    need = reserved + (width if explicit_len else 1)
    if num_blocks is None:
        if fit < need:
            raise ValueRangeError(
                f"memory_budget: the KV pool needs at least {need} blocks ({reserved} reserved + "
                f"{need - reserved} for one sequence) of {per_block} bytes = {need * per_block} bytes, more "
                f"than the budget of {limit} bytes ({source}); lower max_model_len or block_size")
        num_blocks = min(fit, reserved + max_batch * width)
    else:
        num_blocks = check_int("num_blocks", num_blocks, low=reserved + 1)
        if num_blocks > fit:
            raise ValueRangeError(f"num_blocks: {num_blocks} blocks of {per_block} bytes = {num_blocks * per_block} "
                                  f"bytes exceed the memory budget of {limit} bytes ({source}); at most {fit}")
    return num_blocks, width if explicit_len else min(width, num_blocks - reserved)


# --------------------------------------------------------------------------- argument checks


def _in_range(name: str, a: np.ndarray, low: int, high: int, what: str) -> None:
    bad = np.flatnonzero((a < low) | (a > high))
    if bad.size:
        j = np.unravel_index(bad[0], a.shape)
        raise ValueRangeError(f"{name}[{', '.join(map(str, j))}]: {what} must be in {low} … {high}, got {a[j]}")


def _sampling(name: str, s: Any) -> SamplingParams:
    if not isinstance(s, SamplingParams):
        raise ConfigError(f"{name}: expected a SamplingParams, got {type(s).__name__}")
    if s.seed is None and s.temperature > 0:
        raise ConfigError(f"{name}.seed: sampling (temperature {s.temperature}) needs a seed, got None "
                          "(the scheduler picks one for a request without)")
    return s


class ModelEngine:
    """A paged :class:`~wna16_jax.serving.engine.Engine` running ``model`` (see the module doc).

    ``block_size``: positions per KV block; ``num_blocks``: the pool's blocks, reserved ones
    included (None: from ``memory_budget``); ``batch_sizes`` / ``chunk_sizes``: the compiled
    decode batches and prefill chunk lengths (strictly increasing); ``max_model_len``: the
    context, a multiple of ``block_size`` at most ``max_position_embeddings`` (None: the
    default); ``reserved_blocks``: blocks ``0 … reserved_blocks − 1``, where padding rows write
    (``>= 1``); ``memory_budget``: the bytes the pool may take; ``table_widths``: the compiled
    block-table widths in blocks (module doc; the full width is always one). A bad value, or a budget that
    does not hold the reserved blocks and one sequence, is a typed error naming it, before the
    pool is allocated."""

    def __init__(self, model: MoEDecoder, *, block_size: int = 16, num_blocks: int | None = None,
                 batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), chunk_sizes: Sequence[int] = (16, 64, 256),
                 max_model_len: int | None = None, reserved_blocks: int = 1, memory_budget: int | None = None,
                 table_widths: Sequence[int] | None = None):
        if not isinstance(model, MoEDecoder):
            raise ConfigError(f"model: expected a MoEDecoder (wna16_jax.load_model), got {type(model).__name__}")
        _check_key_impl()
        self.block_size = check_int("block_size", block_size, low=1)
        self.batch_sizes = check_buckets(batch_sizes, "batch_sizes")
        self.chunk_sizes = check_buckets(chunk_sizes, "chunk_sizes")
        self.reserved_blocks = check_int("reserved_blocks", reserved_blocks, low=1)
        c = model.config
        width = _table_width(model, self.block_size, max_model_len)
        self.bytes_per_block = cache_bytes(c.num_layers, 1, self.block_size, model.cache_shapes(), model.dtype)
        self.num_blocks, self.max_blocks_per_seq = _plan_pool(
            num_blocks, width, max_model_len is not None, self.reserved_blocks, self.batch_sizes[-1],
            self.bytes_per_block, _budget(memory_budget))
        self.table_widths = _table_widths(table_widths, self.max_blocks_per_seq)
        self.vocab_size = int(c.vocab_size)
        self.eos_token_ids = tuple(int(t) for t in c.eos_token_ids)
        self.model = model
        graphdef, state = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(state)
        self._programs = _Programs(graphdef, treedef)
        pool = model.init_paged_cache(self.num_blocks, self.block_size)
        self._k, self._v = pool.k, pool.v

    # ------------------------------------------------------------------ facts
    @property
    def max_model_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    @property
    def pool_bytes(self) -> int:
        """Bytes of the KV pool (every layer's keys and values of every block)."""
        return self.num_blocks * self.bytes_per_block

    def __repr__(self) -> str:
        return (f"ModelEngine({self.model.config.family}, {self.num_blocks} blocks of {self.block_size} "
                f"({self.pool_bytes / 2**20:.1f} MiB), max_model_len={self.max_model_len}, "
                f"batch_sizes={self.batch_sizes}, chunk_sizes={self.chunk_sizes}, table_widths={self.table_widths})")

    def table_width(self, blocks: int) -> int:
        """The compiled table width (in blocks) a step whose longest row needs ``blocks`` uses."""
        return _width_of(self.table_widths, check_int("blocks", blocks, low=1, high=self.max_blocks_per_seq))

    def warm_up(self) -> None:
        """Compile every program a server can use (each decode batch size and prefill chunk
        size, at each table width) by running it once on the pool's first blocks. Call it before
        the first request (``wna16-jax serve --warm-up`` does): it writes into those blocks, whose
        data is then stale and never read (a sequence writes a position before reading it)."""
        r, bs, width = self.reserved_blocks, self.block_size, self.max_blocks_per_seq
        greedy = SamplingParams()
        for w in self.table_widths:
            table = np.full(width, -1, np.int64)
            table[:w] = np.arange(r, r + w)
            pos = (w - 1) * bs
            for n in self.batch_sizes:
                tables = np.full((n, width), -1, np.int64)
                tables[:, 0] = 0
                tables[0] = table
                tokens, positions, steps = (np.zeros(n, np.int64) for _ in range(3))
                positions[0] = pos
                self.decode(tokens, positions, tables, [greedy] * n, steps)
            for low, c in zip((0, *self.chunk_sizes), self.chunk_sizes):
                n = min(c, w * bs)                  # a chunk of bucket c (more than `low` tokens)
                if n > low:                         # ending at the width's last position
                    self.prefill(np.zeros(n, np.int64), w * bs - n, table, greedy, True)

    # ------------------------------------------------------------------ checks
    def _check_table(self, name: str, table: np.ndarray, length: int) -> None:
        """A real row's table: the blocks of positions ``0 … length − 1`` handed-out blocks, each
        once; the other entries unused (-1) or handed-out blocks."""
        _in_range(name, table, -1, self.num_blocks - 1, "a block id (-1: unused)")
        used = table[:-(-length // self.block_size)]
        bad = np.flatnonzero(used < self.reserved_blocks)
        if bad.size:
            j = int(bad[0])
            raise ValueRangeError(f"{name}[{j}]: positions {j * self.block_size} … need a block of the pool "
                                  f"({self.reserved_blocks} … {self.num_blocks - 1}), got {int(used[j])}")
        rest = table[len(used):]
        if ((rest >= 0) & (rest < self.reserved_blocks)).any():
            raise ValueRangeError(f"{name}: names a reserved block (0 … {self.reserved_blocks - 1}) in a real row")
        if len(np.unique(used)) != len(used):
            raise ValueRangeError(f"{name}: names a block twice for positions 0 … {length - 1}")

    def _is_padding(self, r: int, table: np.ndarray, token: int, position: int, step: int) -> bool:
        """Whether row ``r`` is a padding row (the contract's exact form); a row that names a
        reserved block first and is not one is refused."""
        if not 0 <= table[0] < self.reserved_blocks:
            return False
        if table[0] != 0 or (table[1:] != -1).any() or token or position or step:
            raise ValueRangeError(f"block_tables[{r}]: a row naming reserved block {int(table[0])} must be a "
                                  "padding row (table [0, -1, …], token 0, position 0, step 0)")
        return True

    def _sampling_arrays(self, sampling: Sequence[SamplingParams], names: Sequence[str]):
        """``(words [n, 2] uint32, temperature, top_p float32, top_k int32)`` of the rows' settings."""
        rows = [_sampling(name, s) for name, s in zip(names, sampling)]
        words = np.asarray([seed_words(0 if s.seed is None else s.seed) for s in rows], np.uint32)
        return (words, np.asarray([s.temperature for s in rows], np.float32),
                np.asarray([s.top_p for s in rows], np.float32),
                np.asarray([min(s.top_k, self.vocab_size) for s in rows], np.int32))

    # ------------------------------------------------------------------ the interface
    def prefill(self, tokens: np.ndarray, start: int, block_table: np.ndarray, sampling: SamplingParams,
                sample: bool) -> int | None:
        """One chunk of one sequence (the :class:`~wna16_jax.serving.engine.Engine` contract): run
        in the smallest chunk size that holds it, the padding tokens at position -1 (written
        nowhere); with ``sample``, the token for position ``start + C`` (step 0), else None
        (nothing is read back)."""
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
            raise ShapeError(f"tokens: expected a 1-D numpy array, got {type(tokens).__name__} "
                             f"{getattr(tokens, 'shape', '')}")
        c = len(tokens)
        if not 1 <= c <= self.chunk_sizes[-1]:
            raise ShapeError(f"tokens: a chunk holds 1 … {self.chunk_sizes[-1]} tokens, got {c}")
        ids = int_array("tokens", tokens, (c,))
        _in_range("tokens", ids, 0, self.vocab_size - 1, "a token id")
        start = check_int("start", start, low=0, high=self.max_model_len - c)
        table = int_array("block_table", block_table, (self.max_blocks_per_seq,))
        self._check_table("block_table", table, start + c)
        if not isinstance(sample, (bool, np.bool_)):
            raise ConfigError(f"sample: expected a bool, got {type(sample).__name__}")
        arrays = self._sampling_arrays([sampling], ["sampling"])
        size = next(s for s in self.chunk_sizes if s >= c)
        padded = np.zeros((1, size), np.int32)
        padded[0, :c] = ids
        positions = np.full((1, size), -1, np.int32)
        positions[0, :c] = np.arange(start, start + c)
        width = _width_of(self.table_widths, -(-(start + c) // self.block_size))
        out, self._k, self._v = self._programs.prefill(
            self._leaves, self._k, self._v, padded, positions, table[None, :width].astype(np.int32),
            np.int32(c - 1), *arrays)
        return int(np.asarray(out)[0]) if sample else None

    def _decode_inputs(self, tokens, positions, block_tables, sampling, steps):
        """The decode arguments checked, as the program's int32 arrays (and the sampling arrays)."""
        ids, pos, st, tables = decode_arrays(self, tokens, positions, block_tables, steps)
        n = len(ids)
        _in_range("tokens", ids, 0, self.vocab_size - 1, "a token id")
        _in_range("positions", pos, 0, self.max_model_len - 1, "a position (max_model_len - 1 at most)")
        _in_range("steps", st, 0, self.max_model_len, "a sampling step")
        if isinstance(sampling, (str, bytes)) or not isinstance(sampling, Sequence) or len(sampling) != n:
            raise ConfigError(f"sampling: expected a sequence of {n} SamplingParams, got {type(sampling).__name__}"
                              f"{' of ' + str(len(sampling)) if isinstance(sampling, Sequence) else ''}")
        real = [r for r in range(n) if not self._is_padding(r, tables[r], ids[r], pos[r], st[r])]
        for r in real:
            self._check_table(f"block_tables[{r}]", tables[r], int(pos[r]) + 1)
        owned = np.concatenate([tables[r][tables[r] >= 0] for r in real] or [np.zeros(0, np.int64)])
        if len(np.unique(owned)) != len(owned):
            raise ValueRangeError("block_tables: a block is in two rows of one batch")
        arrays = self._sampling_arrays(sampling, [f"sampling[{r}]" for r in range(n)])
        width = _width_of(self.table_widths, max([int(pos[r]) // self.block_size + 1 for r in real], default=1))
        return (ids.astype(np.int32), pos.astype(np.int32), tables[:, :width].astype(np.int32), arrays[0],
                st.astype(np.int32), *arrays[1:])

    def decode(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
               sampling: Sequence[SamplingParams], steps: np.ndarray) -> np.ndarray:
        """One token for each of ``n`` rows (``n`` one of :attr:`batch_sizes`; the
        :class:`~wna16_jax.serving.engine.Engine` contract): ``int32 [n]``."""
        args = self._decode_inputs(tokens, positions, block_tables, sampling, steps)
        out, self._k, self._v = self._programs.decode(self._leaves, self._k, self._v, *args)
        return np.asarray(out)


__all__ = ["ModelEngine", "seed_key", "seed_words", "DEFAULT_MAX_MODEL_LEN", "POOL_FRACTION"]
