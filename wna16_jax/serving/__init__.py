"""Serving: bounded compiles, continuous batching over a paged KV cache, an OpenAI-compatible server.

* :mod:`~wna16_jax.serving.buckets` — token-count buckets (:class:`BucketedMoE`,
  :func:`bucket_size`, :func:`count_compiles`, ...): a serving loop compiles a bounded number of
  programs.
* :mod:`~wna16_jax.serving.engine` — the interface a paged model engine implements
  (:class:`Engine`) and the per-request :class:`SamplingParams`.
* :mod:`~wna16_jax.serving.scheduler` — plain-Python continuous batching over an engine
  (:class:`Scheduler`, :class:`BlockAllocator`).
* :mod:`~wna16_jax.serving.model_engine` — :class:`~wna16_jax.serving.model_engine.ModelEngine`,
  the engine over a whole :class:`~wna16_jax.models.MoEDecoder`: one paged KV pool, one compiled
  program per prefill chunk size and decode batch size; import it by name (it loads Flax).
* :mod:`~wna16_jax.serving.fake` — :class:`~wna16_jax.serving.fake.FakeEngine`, a numpy toy
  engine with a real block pool, and its unpaged reference, for tests.
* :mod:`~wna16_jax.serving.server` — the HTTP server (FastAPI + uvicorn, the ``serve`` extra);
  import it by name: it is not imported here, so this package needs neither.
* :mod:`~wna16_jax.serving.cli` — the ``wna16-jax serve`` subcommand.
"""

from .buckets import (DEFAULT_BUCKETS, BucketedMoE, CompileCount, bucket_size, bucketed, buckets_used,
                      check_buckets, count_compiles, pad_rows, pad_tokens, power_of_two_buckets, unpad_tokens)
from .engine import Engine, SamplingParams
from .scheduler import (BlockAllocator, OutOfBlocksError, QueueFullError, RequestHandle, Scheduler,
                        SchedulerStats, TokenEvent)

__all__ = ["DEFAULT_BUCKETS", "power_of_two_buckets", "check_buckets", "bucket_size", "buckets_used",
           "pad_rows", "pad_tokens", "unpad_tokens", "BucketedMoE", "bucketed", "count_compiles",
           "CompileCount", "Engine", "SamplingParams", "BlockAllocator", "OutOfBlocksError", "QueueFullError",
           "RequestHandle", "Scheduler", "SchedulerStats", "TokenEvent"]
