"""Continuous batching (wna16_jax.serving.scheduler) on the numpy FakeEngine (wna16_jax.serving.fake).

The FakeEngine keeps a real block pool and computes every token from what it reads back through
the block tables, so a scheduler that mixes, loses or reuses blocks changes the tokens. Every
request's tokens are compared with ``fake_generate`` (the same toy LM on one flat list, no
paging) under randomized arrival schedules, batch compositions, token budgets and pools small
enough to force preemption; the pool must be empty at the end. Also: the block allocator, cancel,
the bound on compiled shapes, a sabotaged allocator that the comparison catches (so the
comparison can fail), and hostile arguments (typed error naming the item, nothing queued,
inputs unmutated).
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from wna16_jax.errors import ConfigError, DTypeError, ShapeError, ValueRangeError, WNA16Error
from wna16_jax.serving import (BlockAllocator, OutOfBlocksError, QueueFullError, SamplingParams, Scheduler,
                               TokenEvent)
from wna16_jax.serving.fake import DEFAULT_VOCAB, FakeEngine, fake_generate

EOS = (7,)
#: every loop over steps stops here (a scheduler that stalls fails instead of hanging)
MAX_STEPS = 5000


def _random_request(rng: random.Random, engine: FakeEngine, scheduler: Scheduler):
    """A prompt of mixed length (crossing block boundaries) and random sampling that fits."""
    p = rng.randrange(1, min(3 * engine.block_size * 4, scheduler.max_model_len - 1))
    prompt = [rng.randrange(DEFAULT_VOCAB) for _ in range(p)]
    limit = scheduler.token_limit(p)
    sampled = rng.random() < 0.5
    sampling = SamplingParams(
        temperature=rng.choice([0.5, 1.0, 2.0]) if sampled else 0.0,
        top_p=rng.choice([1.0, 0.9, 0.5]), top_k=rng.choice([0, 0, 3]), seed=rng.randrange(2**40),
        max_tokens=rng.randrange(1, min(limit, 24) + 1),
        stop_token_ids=tuple(rng.sample(range(DEFAULT_VOCAB), 2)) if rng.random() < 0.3 else ())
    return prompt, sampling


def _run(scheduler: Scheduler, arrivals: list[list[tuple[str, list[int], SamplingParams]]]):
    """Add each step's arrivals before that step, step until done; the tokens and finish reason
    of every request as the events told them."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    handles = {}
    for step in range(MAX_STEPS):
        for rid, prompt, sampling in (arrivals[step] if step < len(arrivals) else ()):
            handles[rid] = scheduler.add(rid, prompt, sampling)
            tokens[rid] = []
        if step >= len(arrivals) and not scheduler.has_work:
            break
        for event in scheduler.step():
            assert isinstance(event, TokenEvent)
            assert event.request_id not in reasons, "a token after the request finished"
            tokens.setdefault(event.request_id, []).append(event.token)
            if event.finish_reason is not None:
                reasons[event.request_id] = event.finish_reason
    else:
        pytest.fail(f"the scheduler did not finish in {MAX_STEPS} steps")
    return tokens, reasons, handles


def _schedule(rng: random.Random, engine: FakeEngine, scheduler: Scheduler, count: int, spread: int):
    """``count`` random requests arriving at random steps in ``0 … spread``."""
    arrivals: list[list] = [[] for _ in range(spread + 1)]
    for i in range(count):
        prompt, sampling = _random_request(rng, engine, scheduler)
        arrivals[rng.randrange(spread + 1)].append((f"req-{i}", prompt, sampling))
    return arrivals


def _check_against_reference(arrivals, tokens, reasons, handles):
    for step in arrivals:
        for rid, prompt, sampling in step:
            want, why = fake_generate(prompt, sampling, eos_token_ids=EOS)
            assert tokens[rid] == want, rid
            assert reasons[rid] == why == handles[rid].finish_reason, rid
            assert handles[rid].output_ids == tuple(want) and handles[rid].finished


# (block_size, num_blocks, batch_sizes, chunk_sizes, max_blocks_per_seq, token_budget)
CONFIGS = [
    (4, 200, (1, 2, 4, 8), (4, 8, 16), 16, None),       # a roomy pool
    (4, 17, (1, 2, 4, 8), (4, 8, 16), 16, None),        # a small pool: preemption
    (3, 23, (2, 4), (5,), 20, 5),                        # tiny chunks, tight budget, odd block size
    (2, 34, (1, 3, 6), (1, 2, 8), 32, 7),                # 2-token blocks, 1-token chunks
    (8, 9, (1, 2, 4), (16, 32), 8, None),                # 8-token blocks, pool of 8 usable
]


@pytest.mark.parametrize("config", CONFIGS, ids=[f"bs{c[0]}-pool{c[1]}" for c in CONFIGS])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tokens_equal_unpaged_reference(config, seed):
    block_size, num_blocks, batch_sizes, chunk_sizes, width, budget = config
    engine = FakeEngine(eos_token_ids=EOS, block_size=block_size, num_blocks=num_blocks, batch_sizes=batch_sizes,
                        chunk_sizes=chunk_sizes, max_blocks_per_seq=width)
    scheduler = Scheduler(engine, max_queue=1000, token_budget=budget)
    rng = random.Random(1000 * seed + num_blocks)
    arrivals = _schedule(rng, engine, scheduler, count=30, spread=rng.choice([0, 10, 60]))
    snapshot = copy.deepcopy(arrivals)
    tokens, reasons, handles = _run(scheduler, arrivals)
    _check_against_reference(arrivals, tokens, reasons, handles)
    assert arrivals == snapshot                               # prompts not mutated
    stats = scheduler.stats()
    assert (stats.waiting, stats.running, stats.blocks_used) == (0, 0, 0)
    assert scheduler.allocator.num_free == scheduler.allocator.capacity
    assert stats.generated_tokens == sum(map(len, tokens.values()))
    assert len(engine.shapes) <= len(batch_sizes) + len(chunk_sizes)
    if num_blocks < 50:                                       # the small pools do preempt
        assert stats.preemptions > 0


def test_small_pool_preempts_and_recomputes_exactly():
    """A pool that holds about two sequences at full length: sequences are preempted (several
    times), recomputed from prompt + generated tokens, and still produce the reference tokens."""
    engine = FakeEngine(eos_token_ids=(), block_size=4, num_blocks=13, batch_sizes=(1, 2, 4, 8), chunk_sizes=(8,),
                        max_blocks_per_seq=12)
    scheduler = Scheduler(engine)
    rng = random.Random(5)
    arrivals = [[(f"r{i}", [rng.randrange(DEFAULT_VOCAB) for _ in range(rng.randrange(5, 14))],
                  SamplingParams(temperature=0.8 * (i % 2), seed=i, max_tokens=30)) for i in range(8)]]
    tokens, reasons, handles = _run(scheduler, arrivals)
    _check_against_reference(arrivals, tokens, reasons, handles)
    assert scheduler.preemptions >= 3
    assert sum(h.preemptions for h in handles.values()) == scheduler.preemptions
    assert scheduler.allocator.high_water == scheduler.allocator.capacity
    assert scheduler.stats().blocks_used == 0


def test_batch_composition_does_not_change_tokens():
    """The same requests served one at a time and all together give the same tokens."""
    rng = random.Random(11)
    requests = [([rng.randrange(DEFAULT_VOCAB) for _ in range(rng.randrange(1, 30))],
                 SamplingParams(temperature=1.0, top_p=0.9, seed=rng.randrange(2**30), max_tokens=12))
                for _ in range(12)]
    alone = []
    for j, (prompt, sampling) in enumerate(requests):
        tokens, _, _ = _run(Scheduler(FakeEngine(eos_token_ids=EOS)), [[(f"a{j}", prompt, sampling)]])
        alone.append(tokens[f"a{j}"])
    together, _, _ = _run(Scheduler(FakeEngine(eos_token_ids=EOS)),
                          [[(f"t{j}", p, s) for j, (p, s) in enumerate(requests)]])
    assert [together[f"t{j}"] for j in range(len(requests))] == alone


def test_seedless_request_gets_a_seed_and_is_reproducible_from_it():
    scheduler = Scheduler(FakeEngine())
    sampling = SamplingParams(temperature=1.0, max_tokens=10)
    handle = scheduler.add("r", [1, 2, 3], sampling)
    assert sampling.seed is None and isinstance(handle.sampling.seed, int)
    tokens, _, _ = _run(scheduler, [])
    assert tokens["r"] == list(handle.output_ids) == fake_generate([1, 2, 3], handle.sampling)[0]


def test_decode_batches_use_compiled_sizes_and_shapes_are_bounded():
    engine = FakeEngine(batch_sizes=(1, 4, 16), chunk_sizes=(2, 8, 32), num_blocks=400, max_blocks_per_seq=32)
    seen_rows = []
    decode = engine.decode

    def recording_decode(tokens, *args):
        seen_rows.append(len(tokens))
        return decode(tokens, *args)

    engine.decode = recording_decode
    scheduler = Scheduler(engine)
    rng = random.Random(3)
    _run(scheduler, _schedule(rng, engine, scheduler, count=40, spread=80))
    assert set(seen_rows) <= {1, 4, 16} and len(set(seen_rows)) >= 2
    assert len(engine.shapes) <= 3 + 3
    assert {kind for kind, _ in engine.shapes} == {"prefill", "decode"}


def test_cancel_frees_blocks_at_once():
    engine = FakeEngine(eos_token_ids=(), num_blocks=40, batch_sizes=(1, 2), chunk_sizes=(4,))
    scheduler = Scheduler(engine)
    prompts = {f"r{i}": [i + 1] * (5 + i) for i in range(4)}
    handles = {rid: scheduler.add(rid, p, SamplingParams(max_tokens=20)) for rid, p in prompts.items()}
    events = []
    for _ in range(6):
        events += scheduler.step()
    running = scheduler.stats()
    assert running.running == 2 and running.waiting == 2
    used = scheduler.allocator.num_used
    blocks_r0 = len(handles["r0"]._seq.blocks)
    assert blocks_r0 > 0
    assert scheduler.cancel("r0") and scheduler.cancel("r3")          # one running, one waiting
    assert scheduler.allocator.num_used == used - blocks_r0
    assert handles["r0"].finish_reason == handles["r3"].finish_reason == "cancelled"
    assert not scheduler.cancel("r0") and not scheduler.cancel("never-added") and not scheduler.cancel(5)
    produced_r0 = len(handles["r0"].output_ids)
    later = []
    for _ in range(MAX_STEPS):
        if not scheduler.has_work:
            break
        later += scheduler.step()
    assert {e.request_id for e in later} == {"r1", "r2"}
    assert len(handles["r0"].output_ids) == produced_r0 and not handles["r3"].output_ids
    for rid in ("r1", "r2"):
        assert list(handles[rid].output_ids) == fake_generate(prompts[rid], SamplingParams(max_tokens=20))[0]
    assert scheduler.stats().blocks_used == 0
    scheduler.add("r0", [1, 2], SamplingParams(max_tokens=1))         # a finished id can be reused
    assert scheduler.step()[0].finish_reason == "length"


class _LiveBlockOnGrowth(BlockAllocator):
    """Hands a block another sequence still holds to a decode that needs one more."""

    def allocate(self, n):
        out = super().allocate(n)
        if n == 1 and len(self._used) > 3:
            live = sorted(self._used - set(out))
            self._used.discard(out[0])
            self._free.append(out[0])
            out = [live[0]]
        return out


class _LiveBlockOnAdmission(BlockAllocator):
    """Puts a block another sequence still holds into an admitted prompt's blocks."""

    def allocate(self, n):
        out = super().allocate(n)
        if n > 1 and len(self._used) > n:
            live = sorted(self._used - set(out))
            self._used.discard(out[-1])
            self._free.append(out[-1])
            out[-1] = live[0]
        return out


class _SwapsTableEntries(Scheduler):
    """Swaps the first two blocks of a running sequence's table once (its history moves)."""

    swapped = False

    def _blocks_for_decodes(self):
        decoding = super()._blocks_for_decodes()
        for seq in decoding:
            if not self.swapped and len(seq.blocks) >= 2:
                seq.blocks[0], seq.blocks[1] = seq.blocks[1], seq.blocks[0]
                self.swapped = True
        return decoding


@pytest.mark.parametrize("sabotage", ["growth", "admission", "swap"])
def test_sabotaged_scheduler_is_caught(sabotage):
    """A scheduler that reuses a live block or scrambles a table: the engine refuses the batch,
    reads a slot never written, or the tokens differ from the reference (so the comparison of
    the tests above can fail)."""
    engine = FakeEngine(eos_token_ids=EOS, num_blocks=60)
    scheduler = (_SwapsTableEntries if sabotage == "swap" else Scheduler)(engine)
    if sabotage != "swap":
        scheduler.allocator = (_LiveBlockOnGrowth if sabotage == "growth" else _LiveBlockOnAdmission)(60, 1)
    arrivals = _schedule(random.Random(2), engine, scheduler, count=12, spread=5)
    try:
        tokens, _, _ = _run(scheduler, arrivals)
    except ValueRangeError as e:
        assert "block" in str(e) or "never written" in str(e)
        return
    wrong = [rid for step in arrivals for rid, p, s in step if tokens[rid] != fake_generate(p, s, eos_token_ids=EOS)[0]]
    assert wrong


# --------------------------------------------------------------------------- the allocator


def test_block_allocator_bookkeeping():
    a = BlockAllocator(10, reserved=2)
    assert (a.capacity, a.num_free, a.num_used, a.high_water) == (8, 8, 0, 0)
    x = a.allocate(3)
    assert len(set(x)) == 3 and min(x) >= 2
    y = a.allocate(5)
    assert not set(x) & set(y) and a.num_free == 0 and a.high_water == 8
    with pytest.raises(OutOfBlocksError, match="asked for 1 blocks, but only 0 of 8"):
        a.allocate(1)
    a.free(x)
    assert a.num_used == 5 and a.high_water == 8
    assert sorted(a.allocate(3)) == sorted(x)                       # freed blocks come back first
    assert a.allocate(0) == []


@pytest.mark.parametrize("blocks, match", [
    ([1], r"blocks\[0\]: block 1 is not one this pool hands out"),           # reserved
    ([10], r"blocks\[0\]: block 10 is not one this pool hands out"),         # past the pool
    ([-1], r"blocks\[0\]: block -1 is not one"),
    ([9], r"blocks\[0\]: block 9 is not in use"),                             # never allocated
    ("DOUBLE", r"blocks\[1\]: block \d+ is not in use"),                      # twice in one call
    ("AGAIN", r"blocks\[0\]: block \d+ is not in use"),                       # freed before
])
def test_block_allocator_refuses_bad_frees(blocks, match):
    a = BlockAllocator(10, reserved=2)
    held = a.allocate(3)
    if blocks == "DOUBLE":
        blocks = [held[0], held[0]]
    elif blocks == "AGAIN":
        a.free([held[2]])
        blocks = [held[2]]
    used, request = a.num_used, list(blocks)
    with pytest.raises(ValueRangeError, match=match):
        a.free(blocks)
    assert a.num_used == used and blocks == request                 # nothing freed, input intact


@pytest.mark.parametrize("call, error, match", [
    (lambda: BlockAllocator(0), ConfigError, "num_blocks"),
    (lambda: BlockAllocator(4, reserved=4), ConfigError, "reserved"),
    (lambda: BlockAllocator(4).allocate(-1), ConfigError, "n must be"),
    (lambda: BlockAllocator(4).allocate(1.5), ConfigError, "n must be"),
    (lambda: BlockAllocator(4).free("12"), ConfigError, "blocks"),
    (lambda: BlockAllocator(4).free([True]), ConfigError, r"blocks\[0\]"),
])
def test_block_allocator_refuses_bad_arguments(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------- hostile arguments


def _huge_prompt(s):
    return [1] * s.max_model_len


HOSTILE_ADDS = [
    # (name, request_id, prompt, sampling, error, message)
    ("id-int", 5, [1, 2], SamplingParams(), ConfigError, "request_id"),
    ("id-empty", "", [1, 2], SamplingParams(), ConfigError, "request_id"),
    ("id-duplicate", "live", [1, 2], SamplingParams(), ConfigError, "'live' is already queued"),
    ("prompt-str", "x", "hello", SamplingParams(), ConfigError, "prompt_ids"),
    ("prompt-dict", "x", {0: 1}, SamplingParams(), ConfigError, "prompt_ids"),
    ("prompt-empty", "x", [], SamplingParams(), ValueRangeError, "prompt_ids: expected at least one token"),
    ("prompt-negative", "x", [1, -3], SamplingParams(), ConfigError, r"prompt_ids\[1\]"),
    ("prompt-past-vocab", "x", [DEFAULT_VOCAB], SamplingParams(), ConfigError, r"prompt_ids\[0\]"),
    ("prompt-float", "x", [1, 2.5], SamplingParams(), ConfigError, r"prompt_ids\[1\]"),
    ("prompt-bool", "x", [True], SamplingParams(), ConfigError, r"prompt_ids\[0\]"),
    ("prompt-2d", "x", np.ones((2, 2), np.int32), SamplingParams(), ConfigError, "prompt_ids: expected a 1-D"),
    ("prompt-float-array", "x", np.ones(3, np.float32), SamplingParams(), ConfigError, "prompt_ids"),
    ("sampling-dict", "x", [1], {"max_tokens": 3}, ConfigError, "sampling: expected a SamplingParams"),
    ("prompt-fills-context", "x", "HUGE", SamplingParams(max_tokens=1), ValueRangeError, "prompt_ids: the prompt has"),
    ("max-tokens-past-context", "x", [1] * 10, SamplingParams(max_tokens=60), ValueRangeError,
     "max_tokens: 10 prompt tokens \\+ max_tokens 60"),
    ("stop-token-past-vocab", "x", [1], SamplingParams(stop_token_ids=(DEFAULT_VOCAB + 3,)), ValueRangeError,
     r"stop_token_ids\[0\]"),
]


@pytest.mark.parametrize("case", HOSTILE_ADDS, ids=[c[0] for c in HOSTILE_ADDS])
def test_add_refuses(case):
    _, request_id, prompt, sampling, error, match = case
    scheduler = Scheduler(FakeEngine(max_blocks_per_seq=16))
    scheduler.add("live", [1, 2, 3], SamplingParams())
    if isinstance(prompt, str) and prompt == "HUGE":
        prompt = _huge_prompt(scheduler)
    before, kept = scheduler.stats(), copy.deepcopy(prompt)
    with pytest.raises(error, match=match) as info:
        scheduler.add(request_id, prompt, sampling)
    assert isinstance(info.value, WNA16Error)
    assert scheduler.stats() == before
    if isinstance(prompt, np.ndarray):
        assert np.array_equal(prompt, kept)
    else:
        assert prompt == kept


def test_add_refuses_more_blocks_than_the_pool():
    scheduler = Scheduler(FakeEngine(block_size=4, num_blocks=5, max_blocks_per_seq=16))   # 4 usable blocks
    assert scheduler.token_limit(10) == 7
    scheduler.add("fits", [1] * 10, SamplingParams(max_tokens=7))
    with pytest.raises(ValueRangeError, match="KV pool \\(4 blocks of 4\\) hold: max_tokens must be at most 7"):
        scheduler.add("x", [1] * 10, SamplingParams(max_tokens=8))
    with pytest.raises(ValueRangeError, match="prompt_ids: the prompt has 17 tokens.*at most 16 prompt tokens"):
        scheduler.add("y", [1] * 17, SamplingParams(max_tokens=1))


def test_full_queue_is_refused():
    scheduler = Scheduler(FakeEngine(), max_queue=2)
    scheduler.add("a", [1], SamplingParams())
    scheduler.add("b", [1], SamplingParams())
    with pytest.raises(QueueFullError, match="max_queue: 2 requests are already waiting"):
        scheduler.add("c", [1], SamplingParams())
    scheduler.step()                                      # both admitted: room again
    scheduler.add("c", [1], SamplingParams())


@pytest.mark.parametrize("field, value, match", [
    ("temperature", -0.1, "'temperature' must be a finite number >= 0.0"),
    ("temperature", float("nan"), "'temperature'"),
    ("temperature", "0.5", "'temperature'"),
    ("temperature", True, "'temperature'"),
    ("top_p", 0.0, "'top_p' must be a finite number > 0.0 and <= 1.0"),
    ("top_p", 1.5, "'top_p'"),
    ("top_k", -1, "'top_k' must be an integer >= 0"),
    ("top_k", 2.5, "'top_k'"),
    ("seed", 2**63, "'seed'"),
    ("seed", "7", "'seed'"),
    ("max_tokens", 0, "'max_tokens' must be an integer >= 1"),
    ("max_tokens", None, "'max_tokens'"),
    ("stop_token_ids", (-1,), r"'stop_token_ids\[0\]'"),
    ("stop_token_ids", "12", "stop_token_ids: expected a tuple"),
    ("stop", ("",), r"'stop\[0\]' must be a non-empty string"),
    ("stop", (3,), r"'stop\[0\]'"),
])
def test_sampling_params_refuse(field, value, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**{field: value})


def test_sampling_params_normalize():
    s = SamplingParams(temperature=1, top_k=np.int64(3), stop_token_ids=[5, 6], stop="END", seed=-4)
    assert s.temperature == 1.0 and type(s.top_k) is int and s.stop_token_ids == (5, 6) and s.stop == ("END",)


class _NoBlockSize:
    num_blocks = 10


@pytest.mark.parametrize("engine_kw, kwargs, match", [
    ({"reserved_blocks": 0}, {}, None),
    ({}, {"max_queue": 0}, "max_queue"),
    ({}, {"token_budget": 8}, "token_budget must be an integer >= 9"),
    ({}, {"token_budget": "9"}, "token_budget"),
])
def test_scheduler_refuses_bad_configuration(engine_kw, kwargs, match):
    if engine_kw:
        with pytest.raises(ConfigError, match="reserved_blocks"):
            FakeEngine(**engine_kw)
        engine = FakeEngine()
        engine.reserved_blocks = 0
        match = "engine.reserved_blocks must be an integer >= 1"
    else:
        engine = FakeEngine()
    with pytest.raises(ConfigError, match=match):
        Scheduler(engine, **kwargs)


def test_scheduler_refuses_engines_without_the_interface():
    with pytest.raises(ConfigError, match="lacks \\['block_size'"):
        Scheduler(_NoBlockSize())
    engine = FakeEngine()
    engine.batch_sizes = (4, 2)
    with pytest.raises(ConfigError, match="engine.batch_sizes: expected strictly increasing"):
        Scheduler(engine)
    engine = FakeEngine()
    engine.eos_token_ids = (DEFAULT_VOCAB,)
    with pytest.raises(ConfigError, match=r"engine.eos_token_ids\[0\]"):
        Scheduler(engine)


# --------------------------------------------------------------------------- the fake engine's own checks


def _table(engine, blocks):
    row = np.full(engine.max_blocks_per_seq, -1, np.int32)
    row[:len(blocks)] = blocks
    return row


def test_fake_engine_refuses_contract_violations():
    e = FakeEngine(block_size=4, batch_sizes=(1, 2), chunk_sizes=(4,))
    s = SamplingParams(seed=0)
    with pytest.raises(ShapeError, match="a chunk holds 1 … 4 tokens, got 5"):
        e.prefill(np.ones(5, np.int32), 0, _table(e, [1, 2]), s, True)
    with pytest.raises(ValueRangeError, match="block 0 cannot hold"):           # a reserved block
        e.prefill(np.ones(4, np.int32), 0, _table(e, [0]), s, True)
    with pytest.raises(ValueRangeError, match="block -1 cannot hold"):          # no block for position 4
        e.prefill(np.ones(2, np.int32), 3, _table(e, [1]), s, True)
    with pytest.raises(DTypeError, match="block_table"):
        e.prefill(np.ones(2, np.int32), 0, _table(e, [1]).astype(np.float32), s, True)
    assert e.prefill(np.ones(4, np.int32), 0, _table(e, [1]), s, False) is None
    with pytest.raises(ValueRangeError, match="position 4 was never written"):
        e.decode(np.ones(1, np.int32), np.array([5]), _table(e, [1, 2])[None], [s], np.zeros(1, np.int32))
    with pytest.raises(ShapeError, match="one of \\(1, 2\\) rows, got 3"):
        e.decode(np.ones(3, np.int32), np.zeros(3, np.int32), np.stack([_table(e, [1])] * 3), [s] * 3,
                 np.zeros(3, np.int32))
    with pytest.raises(ValueRangeError, match="block 1 is in rows 0 and 1"):
        e.decode(np.ones(2, np.int32), np.array([4, 4]), np.stack([_table(e, [1, 2]), _table(e, [1, 3])]), [s] * 2,
                 np.ones(2, np.int32))
    with pytest.raises(ValueRangeError, match="must be a padding row"):
        e.decode(np.ones(2, np.int32), np.array([4, 3]), np.stack([_table(e, [1, 2]), _table(e, [0, 3])]), [s] * 2,
                 np.ones(2, np.int32))
    with pytest.raises(ConfigError, match="sampling needs a seed"):
        e.prefill(np.ones(1, np.int32), 4, _table(e, [1, 2]), SamplingParams(temperature=1.0), True)


def test_fake_engine_reads_through_the_table():
    """The same tokens written into other blocks give the same next token; a changed earlier
    token (another sequence's block) gives a different one."""
    e = FakeEngine(block_size=4, chunk_sizes=(16,))
    prompt = np.arange(10, 20, dtype=np.int32)
    s = SamplingParams()
    a = e.prefill(prompt, 0, _table(e, [1, 2, 3]), s, True)
    b = e.prefill(prompt, 0, _table(e, [9, 5, 7]), s, True)
    assert a == b == fake_generate(prompt.tolist(), SamplingParams(max_tokens=1))[0][0]
    e.pool[5, 1] += 1                                         # another writer touched position 5
    assert e.decode(np.array([a], np.int32), np.array([10]), _table(e, [9, 5, 7])[None], [s],
                    np.ones(1, np.int32))[0] != fake_generate(prompt.tolist(), SamplingParams(max_tokens=2))[0][1]
