"""Differential timing of jitted programs: the time of a program of ``2R`` dependent calls less
that of the same program of ``R`` calls, divided by ``R``.

A jitted program costs something once per run whatever it holds — dispatch, argument handling,
waiting for the device at the end: 0.08–0.45 ms on the H200 (``docs/journal/notes.md`` v11).
Dividing one program's wall time by its ``R`` calls spreads that over the calls (8–45 µs per
1-token MoE layer at R = 10); the difference of two programs leaves it out.

    from benchmarks.timing import differential_us, pair_timer
    us = differential_us(lambda n: jax.jit(make_program(n)), args, reps=40)
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence


def pair_timer(build: Callable[[int], Callable], args: Sequence, reps: int) -> Callable[[], float]:
    """Compile and warm ``build(reps)`` and ``build(2 * reps)`` (each a jitted function of
    ``*args`` running that many dependent calls); returns a function that runs both once and
    returns the difference of their wall times in seconds: the time of ``reps`` calls, without
    what a program costs once. Several alternatives can be timed round-robin with it."""
    if reps < 1:
        raise ValueError(f"reps: expected at least 1, got {reps}")
    short, long = build(reps), build(2 * reps)
    for run in (short, long):
        _block(run(*args))

    def wall(run):
        t0 = time.perf_counter()
        _block(run(*args))
        return time.perf_counter() - t0

    def once():
        return wall(long) - wall(short)
    return once


def differential_us(build: Callable[[int], Callable], args: Sequence, reps: int, samples: int = 5) -> float:
    """µs per call: the median over ``samples`` of :func:`pair_timer`'s difference, / ``reps``."""
    once = pair_timer(build, args, reps)
    return statistics.median(once() for _ in range(samples)) / reps * 1e6


def _block(out):
    import jax

    return jax.block_until_ready(out)
