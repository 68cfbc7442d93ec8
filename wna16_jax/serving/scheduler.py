"""Continuous batching over a paged KV cache: plain Python around an :class:`~.engine.Engine`.

One :meth:`Scheduler.step` is one iteration of the serving loop:

1. **Blocks for the running decodes.** Each decoding sequence whose next position starts a new
   block gets one from the pool (oldest sequence first). When the pool is empty the *youngest*
   active sequence (latest :meth:`~Scheduler.add`) is preempted: its blocks are freed at once
   and it goes back to the front of the queue, to be recomputed later — its prompt plus the
   tokens it has generated are prefilled again (``sample=False``) and decoding goes on from its
   last token with the draws it would have made (the sampling key depends on the step only), so
   a preempted request's tokens are the same as if it had never been preempted.
2. **Admission.** Queued requests join in arrival order (the queue's head first, never skipped,
   so nothing starves) while an active slot is free (at most ``max(engine.batch_sizes)``
   sequences are active: prefilling or decoding) and the pool has the blocks of the head's whole
   prefill, which are allocated at once.
3. **Prefill chunks.** Each step spends at most ``token_budget`` tokens: one per decoding
   sequence, the rest on prefill chunks of at most ``max(engine.chunk_sizes)`` tokens each, for
   the admitted sequences in arrival order. A sequence whose prompt is done samples its first
   token from its last chunk and decodes from the next step on. ``token_budget`` defaults to
   ``max(batch_sizes) + max(chunk_sizes)`` and must exceed ``max(batch_sizes)``, so prefill
   always moves.
4. **One decode step** for every decoding sequence, padded to the smallest compiled batch size
   that holds them (padding rows as the engine contract describes).

A sequence finishes with reason ``"stop"`` when it generates one of the engine's
``eos_token_ids`` or its own ``stop_token_ids`` (that token is its last output token), or
``"length"`` at ``max_tokens``; its blocks are freed in the same step. Stop strings are text, so
they are the caller's (the HTTP server cancels the sequence when it sees one). The context
limit is checked when a request is added: ``len(prompt) + max_tokens`` must be at most
``max_model_len`` and the blocks that many tokens need at most the pool's usable blocks, so
every request that is accepted can finish, alone in the pool if need be.

New requests that do not fit wait in the queue (at most ``max_queue`` of them; one more is a
:class:`QueueFullError`). Nothing here starts a thread or is thread-safe: call every method from
one thread (the server runs them all in one worker thread).
"""

from __future__ import annotations

import collections
import dataclasses
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import ConfigError, ValueRangeError, WNA16Error
from ..fields import check_int
from .buckets import check_buckets
from .engine import SEED_RANGE, Engine, SamplingParams


class OutOfBlocksError(WNA16Error, RuntimeError):
    """The block pool has fewer free blocks than an allocation asks for."""


class QueueFullError(WNA16Error, RuntimeError):
    """The scheduler's queue already holds ``max_queue`` waiting requests."""


# --------------------------------------------------------------------------- the block pool


class BlockAllocator:
    """The free list of a pool of ``num_blocks`` KV blocks, of which ``0 … reserved − 1`` are never
    handed out. Freed blocks are reused first (last in, first out), so a block freed too early is
    soon overwritten, and a test sees it. Freeing a block twice, a reserved block or a block that
    is not the pool's is a :class:`~wna16_jax.errors.ValueRangeError` naming it."""

    def __init__(self, num_blocks: int, reserved: int = 1):
        self.num_blocks = check_int("num_blocks", num_blocks, low=1)
        self.reserved = check_int("reserved", reserved, low=0, high=self.num_blocks - 1)
        self._free = list(range(self.num_blocks - 1, self.reserved - 1, -1))    # pop() gives the lowest first
        self._used: set[int] = set()
        self.high_water = 0

    @property
    def capacity(self) -> int:
        """The blocks that can be handed out (the pool less the reserved ones)."""
        return self.num_blocks - self.reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks handed out and not yet freed."""
        return len(self._used)

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks off the free list, or :class:`OutOfBlocksError` (nothing allocated)."""
        n = check_int("n", n, low=0)
        if n > len(self._free):
            raise OutOfBlocksError(f"n: asked for {n} blocks, but only {len(self._free)} of {self.capacity} are free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        self.high_water = max(self.high_water, len(self._used))
        return out

    def free(self, blocks: Iterable[int]) -> None:
        """Return ``blocks`` to the pool. Every block is checked before any is freed."""
        if isinstance(blocks, (str, bytes, Mapping)) or not isinstance(blocks, Iterable):
            raise ConfigError(f"blocks: expected a sequence of block ids, got {type(blocks).__name__}")
        ids = [check_int(f"blocks[{j}]", b) for j, b in enumerate(blocks)]
        seen: set[int] = set()
        for j, b in enumerate(ids):
            if not self.reserved <= b < self.num_blocks:
                raise ValueRangeError(f"blocks[{j}]: block {b} is not one this pool hands out (blocks "
                                      f"{self.reserved} … {self.num_blocks - 1})")
            if b not in self._used or b in seen:
                raise ValueRangeError(f"blocks[{j}]: block {b} is not in use (freed twice, or never allocated)")
            seen.add(b)
        self._used.difference_update(ids)
        self._free.extend(reversed(ids))


# --------------------------------------------------------------------------- requests


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """One token generated for ``request_id``; ``finish_reason`` is ``"stop"`` or ``"length"``
    on its last token (a ``"stop"`` token is the eos / stop token itself), else None."""

    request_id: str
    token: int
    finish_reason: str | None = None


@dataclasses.dataclass(frozen=True)
class SchedulerStats:
    """A snapshot of the scheduler: requests ``waiting`` in the queue, sequences ``running``
    (prefilling or decoding), KV blocks in use and usable, tokens generated since the start,
    preemptions since the start."""

    waiting: int
    running: int
    blocks_used: int
    blocks_total: int
    generated_tokens: int
    preemptions: int


_WAITING, _PREFILLING, _DECODING, _FINISHED = "waiting", "prefilling", "decoding", "finished"


class _Sequence:
    """A request's mutable state (the scheduler's own; callers see a :class:`RequestHandle`)."""

    __slots__ = ("request_id", "prompt", "sampling", "arrival", "state", "output", "blocks", "computed",
                 "finish_reason", "preemptions")

    def __init__(self, request_id: str, prompt: tuple[int, ...], sampling: SamplingParams, arrival: int):
        self.request_id, self.prompt, self.sampling, self.arrival = request_id, prompt, sampling, arrival
        self.state = _WAITING
        self.output: list[int] = []
        self.blocks: list[int] = []
        self.computed = 0                     # positions of prefill_target() already in the cache
        self.finish_reason: str | None = None
        self.preemptions = 0

    def prefill_target(self) -> tuple[int, ...]:
        """The tokens to prefill: the prompt, plus for a recomputed sequence every generated
        token but the last (which the next decode feeds)."""
        return self.prompt + tuple(self.output[:-1])

    def table(self, width: int) -> np.ndarray:
        row = np.full(width, -1, np.int32)
        row[:len(self.blocks)] = self.blocks
        return row


class RequestHandle:
    """A read-only view of one request: ``request_id``, ``prompt_ids``, ``sampling`` (with the
    seed the scheduler picked when the request had none), ``output_ids`` so far, ``finished``,
    ``finish_reason`` (``"stop"``, ``"length"``, ``"cancelled"`` or None) and ``preemptions``."""

    __slots__ = ("_seq",)

    def __init__(self, seq: _Sequence):
        self._seq = seq

    request_id = property(lambda self: self._seq.request_id)
    prompt_ids = property(lambda self: self._seq.prompt)
    sampling = property(lambda self: self._seq.sampling)
    output_ids = property(lambda self: tuple(self._seq.output))
    finished = property(lambda self: self._seq.state == _FINISHED)
    finish_reason = property(lambda self: self._seq.finish_reason)
    preemptions = property(lambda self: self._seq.preemptions)

    def __repr__(self) -> str:
        return (f"RequestHandle({self.request_id!r}, state={self._seq.state}, prompt={len(self.prompt_ids)} tokens, "
                f"output={len(self._seq.output)} tokens, finish_reason={self.finish_reason!r})")


def _engine_constants(engine: Any) -> dict[str, Any]:
    """The engine's constants, checked (a missing or bad one is a ConfigError naming it)."""
    missing = [a for a in ("block_size", "num_blocks", "reserved_blocks", "batch_sizes", "chunk_sizes",
                           "max_blocks_per_seq", "vocab_size", "eos_token_ids", "prefill", "decode")
               if not hasattr(engine, a)]
    if missing:
        raise ConfigError(f"engine: expected the Engine interface, {type(engine).__name__} lacks {missing}")
    num_blocks = check_int("engine.num_blocks", engine.num_blocks, low=2)
    vocab = check_int("engine.vocab_size", engine.vocab_size, low=1)
    eos = engine.eos_token_ids
    if isinstance(eos, (str, bytes, Mapping)) or not isinstance(eos, Iterable):
        raise ConfigError(f"engine.eos_token_ids: expected a tuple of token ids, got {type(eos).__name__}")
    return {
        "block_size": check_int("engine.block_size", engine.block_size, low=1),
        "num_blocks": num_blocks,
        "reserved": check_int("engine.reserved_blocks", engine.reserved_blocks, low=1, high=num_blocks - 1),
        "batch_sizes": check_buckets(engine.batch_sizes, "engine.batch_sizes"),
        "chunk_sizes": check_buckets(engine.chunk_sizes, "engine.chunk_sizes"),
        "width": check_int("engine.max_blocks_per_seq", engine.max_blocks_per_seq, low=1),
        "vocab": vocab,
        "eos": frozenset(check_int(f"engine.eos_token_ids[{j}]", t, low=0, high=vocab - 1)
                         for j, t in enumerate(eos)),
    }


def _blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class Scheduler:
    """Continuous batching of requests over ``engine`` (see the module doc for the policy).

    ``max_queue``: requests that may wait at once (``>= 1``); ``token_budget``: tokens one step
    computes at most (decodes plus prefill chunks; default ``max(batch_sizes) + max(chunk_sizes)``,
    at least ``max(batch_sizes) + 1``).

    :meth:`add` a request, :meth:`step` until :attr:`has_work` is false, :meth:`cancel` at any
    time between steps. Request ids are unique among unfinished requests."""

    def __init__(self, engine: Engine, *, max_queue: int = 256, token_budget: int | None = None):
        c = _engine_constants(engine)
        self.engine = engine
        self.block_size, self.batch_sizes, self.chunk_sizes = c["block_size"], c["batch_sizes"], c["chunk_sizes"]
        self.width, self.vocab_size, self._stop_ids = c["width"], c["vocab"], c["eos"]
        self.max_model_len = self.width * self.block_size
        self.max_running = self.batch_sizes[-1]
        self.max_chunk = self.chunk_sizes[-1]
        self.max_queue = check_int("max_queue", max_queue, low=1)
        self.token_budget = (self.max_running + self.max_chunk if token_budget is None else
                             check_int("token_budget", token_budget, low=self.max_running + 1))
        self.allocator = BlockAllocator(c["num_blocks"], c["reserved"])
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._active: list[_Sequence] = []             # prefilling or decoding, in arrival order
        self._live: dict[str, _Sequence] = {}
        self._arrivals = 0
        self.generated_tokens = 0
        self.preemptions = 0

    # ------------------------------------------------------------------ requests in and out

    def _checked_prompt(self, prompt_ids: Any) -> tuple[int, ...]:
        if isinstance(prompt_ids, (str, bytes, Mapping)) or not isinstance(prompt_ids, Iterable):
            raise ConfigError(f"prompt_ids: expected a sequence of token ids, got {type(prompt_ids).__name__}")
        if isinstance(prompt_ids, np.ndarray):
            if prompt_ids.ndim != 1 or prompt_ids.dtype.kind not in "iu":
                raise ConfigError(f"prompt_ids: expected a 1-D integer array, got shape {prompt_ids.shape} "
                                  f"dtype {prompt_ids.dtype}")
            prompt_ids = prompt_ids.tolist()
        prompt = tuple(check_int(f"prompt_ids[{j}]", t, low=0, high=self.vocab_size - 1)
                       for j, t in enumerate(prompt_ids))
        if not prompt:
            raise ValueRangeError("prompt_ids: expected at least one token, got an empty prompt")
        return prompt

    def token_limit(self, prompt_len: int) -> int:
        """The largest ``max_tokens`` a prompt of ``prompt_len`` tokens may ask: what the context
        and the pool's usable blocks hold (the last generated token is never fed back, so it needs
        no KV slot); 0 when the prompt itself does not fit."""
        p = check_int("prompt_len", prompt_len, low=0)
        return max(0, min(self.max_model_len - p, self.allocator.capacity * self.block_size - p + 1))

    def _check_fits(self, prompt: tuple[int, ...], sampling: SamplingParams) -> None:
        """The context and pool limits (see the module doc)."""
        p, m = len(prompt), sampling.max_tokens
        limit = self.token_limit(p)
        if limit < 1:
            longest = min(self.max_model_len - 1, self.allocator.capacity * self.block_size)
            raise ValueRangeError(f"prompt_ids: the prompt has {p} tokens, but the context ({self.max_model_len} "
                                  f"tokens) and the KV pool ({self.allocator.capacity} blocks of {self.block_size}) "
                                  f"hold at most {longest} prompt tokens (and one generated token)")
        if m > limit:
            raise ValueRangeError(f"max_tokens: {p} prompt tokens + max_tokens {m} exceed what the context "
                                  f"({self.max_model_len} tokens) and the KV pool ({self.allocator.capacity} blocks "
                                  f"of {self.block_size}) hold: max_tokens must be at most {limit}")
        for j, t in enumerate(sampling.stop_token_ids):
            if t >= self.vocab_size:
                raise ValueRangeError(f"stop_token_ids[{j}]: token {t} is outside the vocabulary "
                                      f"(0 … {self.vocab_size - 1})")

    def add(self, request_id: str, prompt_ids: Iterable[int], sampling: SamplingParams = SamplingParams()
            ) -> RequestHandle:
        """Queue a request; its tokens come out of later :meth:`step` calls as :class:`TokenEvent`
        values. A prompt the context cannot hold with ``max_tokens`` more tokens, one asking more
        blocks than the pool has, a bad argument or a full queue is a typed error (nothing is
        queued). A request without a seed gets a random one here."""
        if not isinstance(request_id, str) or not request_id:
            raise ConfigError(f"request_id: expected a non-empty string, got {type(request_id).__name__} "
                              f"{request_id!r:.80}")
        if request_id in self._live:
            raise ConfigError(f"request_id: {request_id!r:.80} is already queued or running")
        if not isinstance(sampling, SamplingParams):
            raise ConfigError(f"sampling: expected a SamplingParams, got {type(sampling).__name__}")
        prompt = self._checked_prompt(prompt_ids)
        self._check_fits(prompt, sampling)
        if len(self._waiting) >= self.max_queue:
            raise QueueFullError(f"max_queue: {len(self._waiting)} requests are already waiting (the queue holds "
                                 f"{self.max_queue}); retry later")
        if sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=secrets.randbelow(SEED_RANGE[1] + 1))
        seq = _Sequence(request_id, prompt, sampling, self._arrivals)
        self._arrivals += 1
        self._waiting.append(seq)
        self._live[request_id] = seq
        return RequestHandle(seq)

    def cancel(self, request_id: str) -> bool:
        """Drop a queued or running request and free its blocks now; False when no unfinished
        request has this id (already finished, cancelled or never added)."""
        seq = self._live.get(request_id) if isinstance(request_id, str) else None
        if seq is None:
            return False
        if seq.state == _WAITING:
            self._waiting.remove(seq)
        else:
            self._active.remove(seq)
        self._finish(seq, "cancelled")
        return True

    def _finish(self, seq: _Sequence, reason: str) -> None:
        self.allocator.free(seq.blocks)
        seq.blocks = []
        seq.state, seq.finish_reason = _FINISHED, reason
        del self._live[seq.request_id]

    # ------------------------------------------------------------------ state

    @property
    def has_work(self) -> bool:
        """Whether a request is waiting or running."""
        return bool(self._waiting or self._active)

    def stats(self) -> SchedulerStats:
        """A snapshot of the queue, the running sequences, the pool and the counters."""
        return SchedulerStats(len(self._waiting), len(self._active), self.allocator.num_used,
                              self.allocator.capacity, self.generated_tokens, self.preemptions)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> list[TokenEvent]:
        """One scheduler iteration (see the module doc); the tokens it generated, in order."""
        events: list[TokenEvent] = []
        decoding = self._blocks_for_decodes()
        self._admit()
        self._prefill(self.token_budget - len(decoding), events)
        self._decode(decoding, events)
        return events

    def _preempt_youngest(self) -> _Sequence:
        """Free the youngest active sequence's blocks and put it back at the queue's front."""
        seq = self._active.pop()
        self.allocator.free(seq.blocks)
        seq.blocks, seq.computed, seq.state = [], 0, _WAITING
        seq.preemptions += 1
        self.preemptions += 1
        self._waiting.appendleft(seq)
        return seq

    def _blocks_for_decodes(self) -> list[_Sequence]:
        """The decoding sequences of this step, each with the block its next position needs
        (preempting the youngest active sequences when the pool is empty)."""
        for seq in [s for s in self._active if s.state == _DECODING]:
            if seq.state != _DECODING:                      # preempted by an older one's need
                continue
            position = len(seq.prompt) + len(seq.output) - 1
            while len(seq.blocks) <= position // self.block_size:
                if self.allocator.num_free:
                    seq.blocks += self.allocator.allocate(1)
                elif self._preempt_youngest() is seq:
                    break
        return [s for s in self._active if s.state == _DECODING]

    def _admit(self) -> None:
        while self._waiting and len(self._active) < self.max_running:
            seq = self._waiting[0]
            need = _blocks_for(len(seq.prefill_target()), self.block_size)
            if need > self.allocator.num_free:
                break
            self._waiting.popleft()
            seq.blocks = self.allocator.allocate(need)
            seq.state, seq.computed = _PREFILLING, 0
            self._active.append(seq)
        # arrival order among the active ones: a resumed (older) sequence goes before younger ones
        self._active.sort(key=lambda s: s.arrival)

    def _prefill(self, budget: int, events: list[TokenEvent]) -> None:
        for seq in [s for s in self._active if s.state == _PREFILLING]:
            target = seq.prefill_target()
            while budget > 0 and seq.computed < len(target):
                c = min(len(target) - seq.computed, self.max_chunk, budget)
                last = seq.computed + c == len(target)
                fresh = not seq.output
                token = self.engine.prefill(np.asarray(target[seq.computed:seq.computed + c], np.int32),
                                            seq.computed, seq.table(self.width), seq.sampling, last and fresh)
                seq.computed += c
                budget -= c
                if last:
                    seq.state = _DECODING
                    if fresh:
                        self._append(seq, token, events)
            if budget <= 0:
                return

    def _decode(self, decoding: list[_Sequence], events: list[TokenEvent]) -> None:
        n = len(decoding)
        if not n:
            return
        rows = next(b for b in self.batch_sizes if b >= n)
        tokens = np.zeros(rows, np.int32)
        positions = np.zeros(rows, np.int32)
        steps = np.zeros(rows, np.int32)
        tables = np.full((rows, self.width), -1, np.int32)
        tables[n:, 0] = 0                                   # padding rows: the reserved block 0
        sampling = [SamplingParams()] * rows
        for r, seq in enumerate(decoding):
            tokens[r], positions[r] = seq.output[-1], len(seq.prompt) + len(seq.output) - 1
            steps[r], tables[r], sampling[r] = len(seq.output), seq.table(self.width), seq.sampling
        out = self.engine.decode(tokens, positions, tables, sampling, steps)
        for r, seq in enumerate(decoding):
            self._append(seq, out[r], events)

    def _append(self, seq: _Sequence, token: Any, events: list[TokenEvent]) -> None:
        token = check_int("engine output token", token, low=0, high=self.vocab_size - 1)
        seq.output.append(token)
        self.generated_tokens += 1
        reason = ("stop" if token in self._stop_ids or token in seq.sampling.stop_token_ids
                  else "length" if len(seq.output) >= seq.sampling.max_tokens else None)
        if reason is not None:
            self._active.remove(seq)
            self._finish(seq, reason)
        events.append(TokenEvent(seq.request_id, token, reason))


__all__ = ["BlockAllocator", "OutOfBlocksError", "QueueFullError", "RequestHandle", "Scheduler", "SchedulerStats",
           "TokenEvent"]
