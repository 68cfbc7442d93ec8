"""A deterministic toy engine with a real block pool, and its unpaged reference, for tests.

:class:`FakeEngine` implements :class:`~wna16_jax.serving.engine.Engine` with numpy: its "KV
cache" is an array ``pool [num_blocks, block_size]`` of token ids, written through the block
tables it is given, and each next token is a function of the tokens it reads back *through the
table*: a hash of the position, the last few tokens and a position-weighted checksum of the whole
history. So a scheduler that mixes two sequences' blocks, loses a block, skips a prefill chunk or
reuses a live block changes the tokens that come out (or reads a never-written slot, which is an
error), and :func:`fake_generate` — the same function on one flat list, no paging — tells.

Sampling: with ``temperature == 0`` the most likely of eight candidate tokens (derived from the
hash); otherwise a draw among them with probabilities ``∝ exp(−rank / temperature)``, cut to the
first ``top_k`` (when ``top_k > 0``) and to the smallest prefix holding ``top_p`` of the mass, with
a uniform number from ``numpy.random.default_rng((seed, step))``: a row's tokens depend on its seed
and step only, as the engine contract asks.

The engine also checks what it is handed against the contract (shapes, dtypes, a real row never
naming a reserved block, no block in two rows of one decode, padding rows exactly as specified)
and records the compiled shapes it would use (:attr:`FakeEngine.shapes`).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ..errors import ConfigError, ShapeError, ValueRangeError
from ..fields import check_int
from .buckets import check_buckets
from .engine import SamplingParams, decode_arrays, int_array

_MASK = (1 << 64) - 1
#: candidate tokens per position (ranked: rank 0 is the greedy choice)
CANDIDATES = 8
#: the last tokens hashed individually (the whole history enters through a checksum)
WINDOW = 3
#: a vocabulary the size of the test tokenizers' (``tests/fixtures/tokenizers/qwen3-chatml``)
DEFAULT_VOCAB = 425


def _mix(h: int, v: int) -> int:
    """One round of a 64-bit multiply-xorshift hash of ``h`` and ``v``."""
    h = ((h ^ (v & _MASK)) * 0x9E3779B97F4A7C15) & _MASK
    h ^= h >> 29
    h = (h * 0xBF58476D1CE4E5B9) & _MASK
    return h ^ (h >> 32)


def _history_hash(history: np.ndarray) -> int:
    """The hash of a sequence's tokens at positions ``0 … len − 1`` (the next token's context)."""
    pos = np.arange(len(history), dtype=np.int64)
    checksum = int(np.sum((history.astype(np.int64) + 1) * ((pos * 40503 + 7) % 65521)))
    h = _mix(_mix(0x5EED, len(history)), checksum)
    for t in history[-WINDOW:]:
        h = _mix(h, int(t))
    return h


def next_token(history: np.ndarray, sampling: SamplingParams, step: int, vocab_size: int) -> int:
    """The toy LM: the token after ``history`` (see the module doc)."""
    h = _history_hash(history)
    candidates = [_mix(h, j + 1) % vocab_size for j in range(CANDIDATES)]
    if sampling.temperature == 0.0:
        return candidates[0]
    keep = CANDIDATES if sampling.top_k == 0 else min(sampling.top_k, CANDIDATES)
    probs = np.exp(-np.arange(keep) / sampling.temperature)
    probs /= probs.sum()
    cut = int(np.searchsorted(np.cumsum(probs), sampling.top_p * (1 - 1e-12))) + 1
    probs = probs[:min(cut, keep)]
    u = np.random.default_rng((sampling.seed & _MASK, step)).random() * probs.sum()
    return candidates[min(int(np.searchsorted(np.cumsum(probs), u, side="right")), len(probs) - 1)]


def fake_generate(prompt: Sequence[int], sampling: SamplingParams, *, vocab_size: int = DEFAULT_VOCAB,
                  eos_token_ids: Sequence[int] = ()) -> tuple[list[int], str]:
    """``(tokens, finish_reason)`` that a :class:`FakeEngine` with this vocabulary and eos ids
    generates for ``prompt`` served alone, without paging: up to ``max_tokens`` tokens, ending
    early (reason ``"stop"``, the stop token included) at an eos or stop token, else ``"length"``.
    Sampling needs a seed (a scheduler picks one for a request without)."""
    if sampling.temperature > 0 and sampling.seed is None:
        raise ConfigError("sampling.seed: fake_generate samples with a seed (temperature > 0), got None")
    stops = set(eos_token_ids) | set(sampling.stop_token_ids)
    history = [check_int(f"prompt[{j}]", t, low=0, high=vocab_size - 1) for j, t in enumerate(prompt)]
    out: list[int] = []
    while len(out) < sampling.max_tokens:
        token = next_token(np.asarray(history, np.int64), sampling, len(out), vocab_size)
        out.append(token)
        history.append(token)
        if token in stops:
            return out, "stop"
    return out, "length"


class FakeEngine:
    """A numpy :class:`~wna16_jax.serving.engine.Engine` (see the module doc). Every constant of
    the interface is a keyword; ``shapes`` is the set of programs it ran — ``("decode", n)`` and
    ``("prefill", chunk size)`` — and ``calls`` counts the calls."""

    def __init__(self, *, vocab_size: int = DEFAULT_VOCAB, eos_token_ids: Sequence[int] = (), block_size: int = 4,
                 num_blocks: int = 64, reserved_blocks: int = 1, batch_sizes: Sequence[int] = (1, 2, 4, 8),
                 chunk_sizes: Sequence[int] = (4, 8, 16), max_blocks_per_seq: int = 16):
        self.vocab_size = check_int("vocab_size", vocab_size, low=1)
        self.eos_token_ids = tuple(check_int(f"eos_token_ids[{j}]", t, low=0, high=self.vocab_size - 1)
                                   for j, t in enumerate(eos_token_ids))
        self.block_size = check_int("block_size", block_size, low=1)
        self.num_blocks = check_int("num_blocks", num_blocks, low=2)
        self.reserved_blocks = check_int("reserved_blocks", reserved_blocks, low=1, high=self.num_blocks - 1)
        self.batch_sizes = check_buckets(batch_sizes, "batch_sizes")
        self.chunk_sizes = check_buckets(chunk_sizes, "chunk_sizes")
        self.max_blocks_per_seq = check_int("max_blocks_per_seq", max_blocks_per_seq, low=1)
        self.pool = np.full((self.num_blocks, self.block_size), -1, np.int64)
        self.shapes: set[tuple[str, int]] = set()
        self.calls = 0

    @property
    def max_model_len(self) -> int:
        return self.max_blocks_per_seq * self.block_size

    # ------------------------------------------------------------------ the pool through a table

    def _check_table(self, name: str, table: np.ndarray, positions: int) -> None:
        """A real row's table: blocks the pool hands out for the first ``positions`` positions."""
        used = table[:math.ceil(positions / self.block_size)]
        bad = used[(used < self.reserved_blocks) | (used >= self.num_blocks)]
        if bad.size:
            raise ValueRangeError(f"{name}: block {int(bad[0])} cannot hold a sequence's positions (blocks "
                                  f"{self.reserved_blocks} … {self.num_blocks - 1}; unused entries -1)")

    def _slots(self, table: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return table[positions // self.block_size], positions % self.block_size

    def _write(self, table: np.ndarray, start: int, tokens: np.ndarray) -> None:
        blocks, offsets = self._slots(table, np.arange(start, start + len(tokens)))
        self.pool[blocks, offsets] = tokens

    def _next(self, name: str, table: np.ndarray, length: int, sampling: SamplingParams, step: int) -> int:
        """The token after positions ``0 … length − 1``, read back through ``table``."""
        blocks, offsets = self._slots(table, np.arange(length))
        history = self.pool[blocks, offsets]
        if (history < 0).any():
            raise ValueRangeError(f"{name}: position {int(np.argmax(history < 0))} was never written "
                                  "(a lost or skipped block)")
        if sampling.temperature > 0 and sampling.seed is None:
            raise ConfigError(f"{name}: sampling needs a seed (the scheduler picks one), got None")
        return next_token(history, sampling, step, self.vocab_size)

    def _check_tokens(self, name: str, tokens: np.ndarray) -> None:
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            raise ValueRangeError(f"{name}: token ids must be in 0 … {self.vocab_size - 1}")

    # ------------------------------------------------------------------ the interface

    def prefill(self, tokens: np.ndarray, start: int, block_table: np.ndarray, sampling: SamplingParams,
                sample: bool) -> int | None:
        if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
            raise ShapeError(f"tokens: expected a 1-D numpy array, got {type(tokens).__name__} "
                             f"{getattr(tokens, 'shape', '')}")
        c = len(tokens)
        tokens = int_array("tokens", tokens, (c,))
        if not 1 <= c <= self.chunk_sizes[-1]:
            raise ShapeError(f"tokens: a chunk holds 1 … {self.chunk_sizes[-1]} tokens, got {c}")
        start = check_int("start", start, low=0, high=self.max_model_len - c)
        table = int_array("block_table", block_table, (self.max_blocks_per_seq,))
        self._check_tokens("tokens", tokens)
        self._check_table("block_table", table, start + c)
        self.shapes.add(("prefill", next(s for s in self.chunk_sizes if s >= c)))
        self.calls += 1
        self._write(table, start, tokens)
        return self._next("block_table", table, start + c, sampling, 0) if sample else None

    def _is_padding(self, table: np.ndarray, token: int, position: int, step: int) -> bool:
        """A padding row (the contract's exact form), or a real row (checked)."""
        if table[0] >= self.reserved_blocks or table[0] < 0:
            return False
        if not (table[0] == 0 and (table[1:] == -1).all() and token == 0 and position == 0 and step == 0):
            raise ValueRangeError(f"block_tables: a row naming reserved block {int(table[0])} must be a padding row "
                                  "(table [0, -1, ...], token 0, position 0, step 0)")
        return True

    def decode(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
               sampling: Sequence[SamplingParams], steps: np.ndarray) -> np.ndarray:
        tokens, positions, steps, tables = decode_arrays(self, tokens, positions, block_tables, steps)
        n = len(tokens)
        if len(sampling) != n or not all(isinstance(s, SamplingParams) for s in sampling):
            raise ConfigError(f"sampling: expected {n} SamplingParams, got {len(sampling)} values")
        self._check_tokens("tokens", tokens)
        if positions.min() < 0 or positions.max() >= self.max_model_len:
            raise ValueRangeError(f"positions: must be in 0 … {self.max_model_len - 1}")
        real = [r for r in range(n) if not self._is_padding(tables[r], tokens[r], positions[r], steps[r])]
        owned: dict[int, int] = {}
        for r in real:
            self._check_table(f"block_tables[{r}]", tables[r], positions[r] + 1)
            for b in tables[r][:positions[r] // self.block_size + 1].tolist():
                if owned.setdefault(b, r) != r:
                    raise ValueRangeError(f"block_tables: block {b} is in rows {owned[b]} and {r} of one batch")
        self.shapes.add(("decode", n))
        self.calls += 1
        for r in real:
            self._write(tables[r], int(positions[r]), tokens[r:r + 1])
        out = np.zeros(n, np.int32)
        for r in real:
            out[r] = self._next(f"block_tables[{r}]", tables[r], int(positions[r]) + 1, sampling[r], int(steps[r]))
        return out


__all__ = ["FakeEngine", "fake_generate", "next_token", "DEFAULT_VOCAB"]
