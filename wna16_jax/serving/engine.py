"""The interface between the scheduler and a paged model engine, and per-request sampling options.

The scheduler (:mod:`wna16_jax.serving.scheduler`) owns the block pool's bookkeeping and decides
what runs; an :class:`Engine` owns the model, the KV block pool on the device and the compiled
programs, and runs what it is told. The only state they share is the pool's layout: block ``b``
holds the keys and values of ``block_size`` consecutive positions of whichever sequence's block
table lists ``b``.

The contract, beyond the signatures:

* **Block tables.** A row of ``max_blocks_per_seq`` int32 block ids; entry ``i`` holds positions
  ``i·block_size … (i+1)·block_size − 1`` of the sequence; unused entries are ``-1``. The
  scheduler lists a block in at most one live sequence's table, and never lists blocks
  ``0 … reserved_blocks − 1`` in a real row.
* **Prefill.** ``prefill`` gets ``C`` (``1 <= C <= max(chunk_sizes)``) tokens at positions
  ``start … start + C − 1`` whose earlier positions ``0 … start − 1`` were written by earlier calls
  for the same table. The engine runs it in the smallest compiled chunk length ``>= C`` (padding
  positions are not written), so the programs are bounded by ``len(chunk_sizes)``. With
  ``sample=True`` it returns the token for position ``start + C`` (sampling step 0, see below);
  with ``sample=False``, None. The scheduler also uses ``sample=False`` prefills to recompute a
  preempted sequence's cache from its prompt plus its generated tokens.
* **Decode.** ``decode`` gets ``n`` rows, ``n`` always one of ``batch_sizes`` (the scheduler pads
  to the smallest compiled size that holds its sequences). Row ``r`` writes ``tokens[r]`` at
  ``positions[r]`` and returns the token for ``positions[r] + 1``. A padding row has token 0,
  position 0, step 0, default :class:`SamplingParams` and the table ``[0, -1, -1, …]`` (a reserved
  block, so ``reserved_blocks >= 1``); it may write into block 0 and its output is ignored.
* **Sampling.** Row ``r`` draws with the key ``fold_in(key(seed), steps[r])``, where
  ``steps[r]`` is the number of tokens the sequence has generated so far (the prefill's draw is
  step 0): a sequence's tokens depend on its own seed and history only, never on its batch
  neighbours, and a preempted sequence resumes with the draws it would have made. The scheduler
  always passes a seed (a request without one gets a random seed when it is added).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Protocol, Sequence

import numpy as np

from ..errors import ConfigError, DTypeError, ShapeError
from ..fields import check_int, check_number

#: a seed is a signed 64-bit integer (what OpenAI's ``seed`` and ``jax.random.key`` take)
SEED_RANGE = (-(2**63), 2**63 - 1)


def _tuple_of(name: str, value, kind: type) -> tuple:
    """``value`` (a list or tuple, or one ``kind`` value) as a tuple of ``kind`` values."""
    if isinstance(value, kind):
        return (value,)
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise ConfigError(f"SamplingParams.{name}: expected a tuple of {kind.__name__} values, got "
                          f"{type(value).__name__} {value!r:.80}")
    return tuple(value)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (checked on construction: a field out of its
    range is a :class:`~wna16_jax.errors.ConfigError` naming it).

    ``temperature`` ``>= 0`` (0: greedy); ``top_p`` in ``(0, 1]`` (1: off); ``top_k`` ``>= 0``
    (0: off); ``seed``: a signed 64-bit integer, or None for a random one; ``max_tokens`` ``>= 1``
    tokens to generate at most; ``stop_token_ids``: tokens that end the sequence besides the
    engine's ``eos_token_ids`` (the stop token is the last generated token); ``stop``: strings
    that end the text (non-empty; the server detects them in the decoded text, the scheduler
    never looks at text)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        where = "SamplingParams"
        checked = {
            "temperature": check_number("temperature", self.temperature, low=0.0, where=where),
            "top_p": check_number("top_p", self.top_p, above=0.0, high=1.0, where=where),
            "top_k": check_int("top_k", self.top_k, low=0, where=where),
            "seed": None if self.seed is None else check_int("seed", self.seed, low=SEED_RANGE[0],
                                                            high=SEED_RANGE[1], where=where),
            "max_tokens": check_int("max_tokens", self.max_tokens, low=1, where=where),
            "stop_token_ids": tuple(check_int(f"stop_token_ids[{j}]", t, low=0, where=where)
                                    for j, t in enumerate(_tuple_of("stop_token_ids", self.stop_token_ids, int))),
            "stop": _tuple_of("stop", self.stop, str),
        }
        for j, s in enumerate(checked["stop"]):
            if not isinstance(s, str) or not s:
                raise ConfigError(f"{where}: field 'stop[{j}]' must be a non-empty string, got {s!r:.80}")
        for name, value in checked.items():          # normalized: plain ints / floats, tuples
            object.__setattr__(self, name, value)


def int_array(name: str, a, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` (a numpy integer array of ``shape``) as int64, or a typed error naming ``name``."""
    if not isinstance(a, np.ndarray):
        raise DTypeError(f"{name}: expected a numpy integer array, got {type(a).__name__}")
    if a.dtype.kind not in "iu":
        raise DTypeError(f"{name}: expected an integer array, got dtype {a.dtype}")
    if a.shape != shape:
        raise ShapeError(f"{name}: expected shape {shape}, got {a.shape}")
    return a.astype(np.int64)


def decode_arrays(engine: "Engine", tokens, positions, block_tables, steps):
    """A decode call's arrays checked against the contract's shapes: ``(tokens, positions,
    steps, block_tables)`` as int64, the row count one of ``engine.batch_sizes``."""
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1:
        raise ShapeError(f"tokens: expected a 1-D numpy array, got {type(tokens).__name__} "
                         f"{getattr(tokens, 'shape', '')}")
    n = len(tokens)
    if n not in engine.batch_sizes:
        raise ShapeError(f"tokens: a decode batch has one of {engine.batch_sizes} rows, got {n}")
    ids, pos, st = (int_array(name, a, (n,)) for name, a in
                    (("tokens", tokens), ("positions", positions), ("steps", steps)))
    return ids, pos, st, int_array("block_tables", block_tables, (n, engine.max_blocks_per_seq))


class Engine(Protocol):
    """A paged model engine (see the module doc for the contract). Attributes are constants."""

    #: tokens per KV block
    block_size: int
    #: blocks in the pool, reserved ones included
    num_blocks: int
    #: blocks ``0 … reserved_blocks − 1`` are the engine's (padding rows write there); never handed out
    reserved_blocks: int
    #: the compiled decode batch sizes, ascending (a decode call has exactly one of them rows)
    batch_sizes: tuple[int, ...]
    #: the compiled prefill chunk lengths, ascending (a chunk runs in the smallest one that holds it)
    chunk_sizes: tuple[int, ...]
    #: width of a block table; ``max_model_len = max_blocks_per_seq * block_size``
    max_blocks_per_seq: int
    #: token ids are ``0 … vocab_size − 1``
    vocab_size: int
    #: the tokens that end a sequence (finish reason "stop")
    eos_token_ids: tuple[int, ...]

    def prefill(self, tokens: np.ndarray, start: int, block_table: np.ndarray, sampling: SamplingParams,
                sample: bool) -> int | None:
        """One chunk of one sequence's prompt: ``tokens [C]`` at positions ``start … start + C − 1``,
        written into the blocks of ``block_table [max_blocks_per_seq]``; with ``sample``, the next
        token (step 0), else None."""
        ...

    def decode(self, tokens: np.ndarray, positions: np.ndarray, block_tables: np.ndarray,
               sampling: Sequence[SamplingParams], steps: np.ndarray) -> np.ndarray:
        """One token for each of ``n`` rows: ``tokens [n]`` at ``positions [n]`` through
        ``block_tables [n, max_blocks_per_seq]``, row ``r`` sampled with ``sampling[r]`` at step
        ``steps[r]``; returns ``[n]`` token ids."""
        ...


__all__ = ["Engine", "SamplingParams", "SEED_RANGE", "decode_arrays", "int_array"]
