"""The paged model engine (wna16_jax.serving.model_engine) on the real tools' fixtures: the
scheduler driving a ModelEngine gives every request exactly the tokens ``Generator`` gives its
prompt alone (greedy and seeded sampling, interleaved arrivals, chunked prompts, preemption,
blocks reused, stale pool contents); a bounded number of compiled programs; the paged read
against the contiguous model and the fixtures' transformers logits; seeds; the pool's size;
hostile arguments; and one OpenAI-compatible server on a loopback port driven by the official
client.

Models: ``awq-qwen3moe`` (AutoAWQ; also its tokenizer, for the server), ``gptq-mixtral``
(GPTQModel) and ``v2-lite-gptq`` (DeepSeek-V2, latent cache), float32 on the CPU.
"""

from __future__ import annotations

import functools
import os
import socket
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wna16_jax.errors import ConfigError, DTypeError, ShapeError, ValueRangeError, WNA16Error
from wna16_jax.models import load_model
from wna16_jax.models.generation import Generator
from wna16_jax.models.kv_cache import KVCache
from wna16_jax.serving import count_compiles
from wna16_jax.serving.engine import SamplingParams
from wna16_jax.serving.model_engine import ModelEngine, _row_keys, seed_key, seed_words
from wna16_jax.serving.scheduler import Scheduler

HERE = os.path.dirname(os.path.abspath(__file__))
QWEN = os.path.join(HERE, "fixtures", "quantizers", "awq-qwen3moe")
MIXTRAL = os.path.join(HERE, "fixtures", "quantizers", "gptq-mixtral")
DEEPSEEK = os.path.join(HERE, "fixtures", "hf_deepseek", "v2-lite-gptq")
#: the engine the scheduler tests share: 16 usable blocks of 4 positions (64 tokens), contexts of
#: 64, so three requests of about 30 tokens cannot all hold their blocks at once (preemption)
ENGINE = dict(block_size=4, num_blocks=17, batch_sizes=(1, 2, 4), chunk_sizes=(4, 16), max_model_len=64)
#: scheduler steps a workload may take (every loop here is bounded)
MAX_STEPS = 400
#: seconds any one wait of the server test may take
DEADLINE = 60.0
# The paged logits against the contiguous model: the same float32 computation, gathered in
# another order (measured below 2e-6 relative); against the fixtures' transformers float32
# logits the bound of tests/test_models.py (LOGITS_TOL, 9x its measurements). A wrong block or
# position moves logits by order one.
PAGED_TOL = 2e-5
LOGITS_TOL = 5e-5


@functools.lru_cache(maxsize=None)
def _model(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the backend fallback warns by design
        return load_model(path, dtype=jnp.float32)


@pytest.fixture(scope="module")
def qwen():
    return _model(QWEN)


@pytest.fixture(scope="module")
def engine(qwen):
    return ModelEngine(qwen, **ENGINE)


@pytest.fixture(scope="module")
def generator(qwen):
    return Generator(qwen, batch_size=1, max_len=64)


def _reference(gen: Generator, prompt, sp: SamplingParams) -> list[int]:
    """The tokens ``Generator`` gives ``prompt`` alone, with the request's seed as its key,
    stopping where the scheduler stops: on the model's eos tokens or the request's own."""
    key = None if sp.temperature == 0 else [seed_key(sp.seed)]
    stop = tuple(gen.model.config.eos_token_ids or ()) + tuple(sp.stop_token_ids)
    return gen.generate([list(prompt)], sp.max_tokens, key=key, temperature=sp.temperature, top_p=sp.top_p,
                        top_k=sp.top_k, stop_tokens=stop)[0]


def _serve(scheduler: Scheduler, arrivals: dict[int, list]) -> dict[str, object]:
    """Run ``scheduler`` until idle, adding ``arrivals[step]`` = ``[(id, prompt, sampling), ...]``
    before step ``step``; the handles by request id."""
    handles, step = {}, 0
    while step <= max(arrivals) or scheduler.has_work:
        for rid, prompt, sp in arrivals.get(step, ()):
            handles[rid] = scheduler.add(rid, prompt, sp)
        scheduler.step()
        step += 1
        assert step < MAX_STEPS, "the scheduler did not finish"
    assert all(h.finished for h in handles.values())
    return handles


def _workload(rng, vocab: int) -> dict[int, list]:
    """Five requests arriving at steps 0, 2 and 4: prompts longer than one chunk (20, 18), a
    shared prefix with different suffixes (a and b), greedy and seeded sampling with different
    temperatures / top_p / top_k, seeds inside and outside 32 bits, one negative."""
    a = rng.integers(0, vocab, 20).tolist()
    b = a[:12] + rng.integers(0, vocab, 6).tolist()
    return {
        0: [("a", a, SamplingParams(max_tokens=12)),
            ("c", rng.integers(0, vocab, 7).tolist(),
             SamplingParams(temperature=1.3, top_k=7, seed=2**40 + int(rng.integers(1 << 20)), max_tokens=10))],
        2: [("b", b, SamplingParams(temperature=0.7, top_p=0.9, seed=int(rng.integers(1 << 32)), max_tokens=12))],
        4: [("d", rng.integers(0, vocab, 3).tolist(), SamplingParams(max_tokens=9)),
            ("e", rng.integers(0, vocab, 14).tolist(),
             SamplingParams(temperature=0.9, top_p=0.8, top_k=20, seed=-int(rng.integers(1, 1 << 40)), max_tokens=12))],
    }


def _check_against_generator(gen, handles, arrivals):
    for requests in arrivals.values():
        for rid, prompt, sp in requests:
            want = _reference(gen, prompt, sp)
            assert list(handles[rid].output_ids) == want, (rid, handles[rid].preemptions)


def _poison(engine: ModelEngine, rng) -> None:
    """Fill the pool with large finite garbage: a read of a stale or foreign slot changes tokens."""
    engine._k = jnp.asarray(rng.standard_normal(engine._k.shape) * 1e3, engine._k.dtype)
    engine._v = jnp.asarray(rng.standard_normal(engine._v.shape) * 1e3, engine._v.dtype)


# --------------------------------------------------------------------------- (a) (b) the scheduler


def test_scheduled_requests_get_the_generator_tokens(engine, generator, qwen):
    """Interleaved requests through the scheduler (chunked prompts, preemption: the pool holds
    two of them at a time) get exactly the tokens each gets alone from Generator; the first run
    compiles at most one program per chunk size and batch size, and a second run of the same
    shapes — on a pool full of stale blocks and garbage, the blocks reused — compiles none and
    again matches."""
    rng = np.random.default_rng()
    vocab = qwen.config.vocab_size
    first = _workload(rng, vocab)
    scheduler = Scheduler(engine)
    with count_compiles() as c:
        handles = _serve(scheduler, first)
    assert engine.table_widths == (2, 4, 8, 16)            # 64 positions in blocks of 4: 16 / 8, 4, 2, 1
    assert c.count <= (len(engine.chunk_sizes) + len(engine.batch_sizes)) * len(engine.table_widths)
    assert scheduler.preemptions > 0 and any(h.preemptions for h in handles.values())
    _check_against_generator(generator, handles, first)
    assert scheduler.stats().blocks_used == 0

    second = _workload(rng, vocab)
    _poison(engine, rng)
    scheduler = Scheduler(engine)
    with count_compiles() as c:
        handles = _serve(scheduler, second)
    assert c.count == 0
    assert scheduler.preemptions > 0
    _check_against_generator(generator, handles, second)


def test_requests_never_see_each_others_blocks(engine, generator, qwen):
    """Two requests with the same 16-token prefix (4 whole blocks) and different suffixes run
    side by side, then a third reuses the first's freed blocks with the other's suffix: each
    gets its own Generator tokens, and they differ (a shared or stale block would be seen)."""
    rng = np.random.default_rng()
    vocab = qwen.config.vocab_size
    prefix = rng.integers(0, vocab, 16).tolist()
    x, y = prefix + rng.integers(0, vocab, 3).tolist(), prefix + rng.integers(0, vocab, 3).tolist()
    greedy = SamplingParams(max_tokens=8)
    scheduler = Scheduler(engine)
    arrivals = {0: [("x", x, greedy), ("y", y, greedy)]}
    handles = _serve(scheduler, arrivals)
    _check_against_generator(generator, handles, arrivals)
    later = {0: [("z", y, greedy)]}
    handles.update(_serve(scheduler, later))
    assert handles["z"].output_ids == handles["y"].output_ids
    assert handles["x"].output_ids != handles["y"].output_ids


def test_latent_cache_model_through_the_scheduler():
    """DeepSeek-V2 (the latent cache: one latent and one rotary key per position) through a
    ModelEngine: a prompt of two chunks and a later, shorter one, greedy, decoded in batches of two
    (a padding row while one runs alone), equal to Generator."""
    model = _model(DEEPSEEK)
    eng = ModelEngine(model, block_size=4, num_blocks=9, batch_sizes=(2,), chunk_sizes=(8,), max_model_len=32)
    assert eng.eos_token_ids == tuple(model.config.eos_token_ids)
    rng = np.random.default_rng()
    vocab = model.config.vocab_size
    eos = set(model.config.eos_token_ids)
    prompts = [rng.integers(0, vocab, n).tolist() for n in (11, 5)]
    arrivals = {0: [("p", prompts[0], SamplingParams(max_tokens=6))],
                1: [("q", prompts[1], SamplingParams(max_tokens=6))]}
    handles = _serve(Scheduler(eng), arrivals)
    gen = Generator(model, batch_size=1, max_len=32)
    for rid, prompt, sp in arrivals[0] + arrivals[1]:
        want = gen.generate([prompt], sp.max_tokens, stop_tokens=tuple(eos))[0]
        assert list(handles[rid].output_ids) == want, rid


def test_scanned_model_through_the_scheduler(tmp_path):
    """A scanned decoder (its layers one ``lax.scan``, the paged pool riding in the carry, bound
    to each layer inside the scan) through a ModelEngine: two interleaved requests, greedy and
    seeded, equal to Generator on the same scanned model."""
    from wna16_jax.models import write_random_model
    from wna16_jax.models.synthetic import RandomModelSpec
    from wna16_jax.schemes import QuantScheme

    spec = RandomModelSpec(model_type="qwen3_moe", scheme=QuantScheme("gptq", 4, 32, False), vocab_size=96,
                           hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                           top_k=2, moe_intermediate_size=32)
    rng = np.random.default_rng()
    path = write_random_model(str(tmp_path / "m"), spec, seed=int(rng.integers(1 << 30)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the backend fallback warns by design
        model = load_model(path, dtype=jnp.float32, scan_layers=True)
    assert model.scan_layers and model.num_scanned_layers == 3
    eng = ModelEngine(model, block_size=4, num_blocks=13, batch_sizes=(2,), chunk_sizes=(8,), max_model_len=24)
    arrivals = {0: [("p", rng.integers(0, 96, 10).tolist(), SamplingParams(max_tokens=6))],
                1: [("q", rng.integers(0, 96, 5).tolist(),
                     SamplingParams(temperature=0.8, top_p=0.9, seed=int(rng.integers(1 << 32)), max_tokens=6))]}
    handles = _serve(Scheduler(eng), arrivals)
    _check_against_generator(Generator(model, batch_size=1, max_len=24), handles, arrivals)


# --------------------------------------------------------------------------- (c) the paged read


def test_paged_write_and_read_through_a_scrambled_table_are_exact():
    """Keys and values written through a table of scrambled blocks (chunk padding at position
    -1) read back exactly where a contiguous cache holds them; the padding wrote nothing."""
    rng = np.random.default_rng()
    layers, blocks, bs, n, d, m = 2, 11, 4, 2, 8, 4
    pool = KVCache.paged(layers, blocks, bs, ((n, d), (n, d)), jnp.float32)
    pool = KVCache(jnp.asarray(rng.standard_normal(pool.k.shape), jnp.float32),
                   jnp.asarray(rng.standard_normal(pool.v.shape), jnp.float32), pool.block_table)
    before = np.asarray(pool.k)
    table = np.full((1, m), -1, np.int32)
    table[0, :3] = rng.permutation(np.arange(1, blocks))[:3]
    k = rng.standard_normal((1, n, 12, d)).astype(np.float32)
    v = rng.standard_normal((1, n, 12, d)).astype(np.float32)
    positions = np.arange(12, dtype=np.int32)[None].copy()
    positions[0, 10:] = -1                                      # padding: written nowhere
    cache = pool.with_block_table(table).at_layer(1)
    cache = cache.update(jnp.asarray(k), jnp.asarray(v), jnp.asarray(positions))
    keys, vals, kpos = cache.read(None, jnp.float32)
    np.testing.assert_array_equal(np.asarray(keys)[0, :, :10], k[0, :, :10])
    np.testing.assert_array_equal(np.asarray(vals)[0, :, :10], v[0, :, :10])
    np.testing.assert_array_equal(np.asarray(kpos)[0], np.arange(m * bs))
    after = np.asarray(cache.k)
    touched = np.zeros(blocks, bool)
    touched[table[0, :3]] = True
    np.testing.assert_array_equal(after[0], before[0])          # the other layer
    np.testing.assert_array_equal(after[1, ~touched], before[1, ~touched])
    written = after[1, table[0, 2]][:, 2:]                      # block 3's slots 2, 3: positions 10, 11
    np.testing.assert_array_equal(written, before[1, table[0, 2]][:, 2:])


@nnx.jit
def _paged_chunk(model, k, v, tokens, positions, table):
    h, cache = model.hidden_states(tokens, positions, KVCache(k, v, table))
    return model.logits(h), cache.k, cache.v


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


@pytest.mark.parametrize("path, ref_key", [(QWEN, "logits_float"), (MIXTRAL, "logits_float"),
                                           (DEEPSEEK, "logits")])
def test_paged_logits_equal_the_contiguous_model(path, ref_key):
    """The fixture's prompt in two padded chunks through a table of scrambled blocks, on a pool
    of garbage: every position's logits equal ``model(tokens)`` (no cache) and the fixture's
    transformers float32 logits."""
    model = _model(path)
    with np.load(os.path.join(path, "reference.npz")) as z:
        ids, want = z["prompt_ids"].astype(np.int32), z[ref_key].astype(np.float64)
    rng = np.random.default_rng()
    blocks, bs = 9, 4
    pool = model.init_paged_cache(blocks, bs)
    k = jnp.asarray(rng.standard_normal(pool.k.shape) * 1e3, pool.k.dtype)
    v = jnp.asarray(rng.standard_normal(pool.v.shape) * 1e3, pool.v.dtype)
    table = np.full((1, 5), -1, np.int32)
    table[0, :3] = rng.permutation(np.arange(1, blocks))[:3]
    got = []
    for lo, hi in ((0, 6), (6, len(ids))):                      # chunks padded to 8 tokens
        tokens = np.zeros((1, 8), np.int32)
        positions = np.full((1, 8), -1, np.int32)
        tokens[0, :hi - lo], positions[0, :hi - lo] = ids[lo:hi], np.arange(lo, hi)
        logits, k, v = _paged_chunk(model, k, v, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(table))
        got.append(np.asarray(logits, np.float64)[0, :hi - lo])
    got = np.concatenate(got)
    plain = np.asarray(_forward(model, jnp.asarray(ids[None])), np.float64)[0]
    assert np.isfinite(got).all()
    scale = np.abs(want).max()
    assert np.abs(got - plain).max() <= PAGED_TOL * scale
    assert np.abs(got - want).max() <= LOGITS_TOL * scale
    assert np.abs(plain[1:] - plain[:-1]).max() > 100 * LOGITS_TOL * scale      # a shifted position would show


# --------------------------------------------------------------------------- seeds and sizes


def test_seed_keys():
    """A seed in [0, 2**32) is ``jax.random.key(seed)``; another 64-bit seed the key of its two's
    complement words (what ``jax.random.key`` gives with x64); the program's keys are the same."""
    rng = np.random.default_rng()
    small = [0, int(rng.integers(1 << 32)), 2**32 - 1]
    big = [2**32, int(rng.integers(2**32, 2**63)), -1, -int(rng.integers(1, 2**63)), -(2**63), 2**63 - 1]
    for s in small:
        assert seed_words(s) == (0, s)
        np.testing.assert_array_equal(jax.random.key_data(seed_key(s)), jax.random.key_data(jax.random.key(s)))
    with jax.enable_x64():
        for s in big:
            np.testing.assert_array_equal(jax.random.key_data(seed_key(s)),
                                          jax.random.key_data(jax.random.key(s)))
    words = np.asarray([seed_words(s) for s in small + big], np.uint32)
    in_program = np.asarray(jax.random.key_data(jax.jit(_row_keys)(words)))
    np.testing.assert_array_equal(in_program, np.stack([jax.random.key_data(seed_key(s)) for s in small + big]))
    for bad in (2**63, -(2**63) - 1, 1.5, "7"):
        with pytest.raises(ConfigError, match="seed"):
            seed_words(bad)


def test_pool_size_from_the_budget(qwen):
    """bytes_per_block is one block of every layer's keys and values; a pool sized from a budget
    takes what it holds, capped at what the scheduler can use, and the default context shrinks
    to what a small pool holds."""
    c = qwen.config
    per_block = c.num_layers * 4 * 2 * c.num_kv_heads * c.head_dim * 4          # float32
    e = ModelEngine(qwen, block_size=4, memory_budget=per_block * 21 + 5, batch_sizes=(1, 2))
    assert (e.bytes_per_block, e.num_blocks) == (per_block, 21)
    assert e.pool_bytes == 21 * per_block == e._k.nbytes + e._v.nbytes
    assert e.max_model_len == 20 * 4                   # the default (256) shrinks to the 20 usable blocks
    e = ModelEngine(qwen, block_size=4, memory_budget=per_block * 10**4, batch_sizes=(1, 2))
    assert e.max_model_len == c.max_position_embeddings == 256
    assert e.num_blocks == 1 + 2 * 64                   # never more than two sequences can use
    with pytest.raises(ValueRangeError, match=r"memory_budget: the KV pool needs at least 2 blocks"):
        ModelEngine(qwen, block_size=4, memory_budget=per_block + 1)
    with pytest.raises(ValueRangeError, match=r"memory_budget: the KV pool needs at least 17 blocks"):
        ModelEngine(qwen, block_size=4, memory_budget=per_block * 16, max_model_len=64)


def test_steps_read_the_table_width_of_their_longest_row(qwen, monkeypatch):
    """A step passes its programs the smallest table width holding its longest row (prefill:
    the chunk's last position; decode: the longest real row), so a short sequence's steps read
    the first blocks of the table, not all of them; a user's widths get the full one added."""
    eng = ModelEngine(qwen, block_size=4, num_blocks=17, batch_sizes=(2,), chunk_sizes=(8,), max_model_len=64)
    assert ModelEngine(qwen, block_size=4, num_blocks=17, max_model_len=64, table_widths=(3,)).table_widths == (3, 16)
    seen = []
    for name in ("prefill", "decode"):
        run = getattr(eng._programs, name)
        monkeypatch.setattr(eng._programs, name,
                            lambda *a, run=run, name=name: seen.append((name, a[5].shape)) or run(*a))
    table = np.full(16, -1, np.int64)
    table[:3] = [5, 9, 2]
    greedy = SamplingParams(max_tokens=4)
    eng.prefill(np.arange(1, 7), 0, table, greedy, False)                 # positions 0 … 5: 2 blocks
    eng.prefill(np.arange(1, 5), 6, table, greedy, True)                  # … 9: 3 blocks
    pad = np.full(16, -1, np.int64)
    pad[0] = 0
    eng.decode(np.array([3, 0]), np.array([10, 0]), np.stack([table, pad]), [greedy, greedy], np.array([1, 0]))
    assert seen == [("prefill", (1, 2)), ("prefill", (1, 4)), ("decode", (2, 4))], seen


def test_warm_up_compiles_every_program_a_workload_uses(qwen):
    """``warm_up`` compiles each (batch size, width) decode and (chunk size, width) prefill that
    can occur, at most their product; a workload afterwards compiles nothing and still gets
    Generator's tokens (the warm-up's stale blocks are never read)."""
    eng = ModelEngine(qwen, block_size=4, num_blocks=17, batch_sizes=(1, 2), chunk_sizes=(8,), max_model_len=32)
    assert eng.table_widths == (1, 2, 4, 8)
    with count_compiles() as c:
        eng.warm_up()
    assert 0 < c.count <= (len(eng.batch_sizes) + len(eng.chunk_sizes)) * len(eng.table_widths)
    rng = np.random.default_rng()
    arrivals = {0: [("a", rng.integers(0, 320, 13).tolist(), SamplingParams(max_tokens=9))],
                2: [("b", rng.integers(0, 320, 3).tolist(),
                     SamplingParams(temperature=0.9, seed=int(rng.integers(1 << 32)), max_tokens=12))]}
    with count_compiles() as c:
        handles = _serve(Scheduler(eng), arrivals)
    assert c.count == 0
    _check_against_generator(Generator(qwen, batch_size=1, max_len=32), handles, arrivals)


# --------------------------------------------------------------------------- (d) hostile arguments


@pytest.mark.parametrize("kw, error, match", [
    (dict(block_size=0), ConfigError, "block_size"),
    (dict(block_size=2.5), ConfigError, "block_size"),
    (dict(block_size=True), ConfigError, "block_size"),
    (dict(block_size=512), ConfigError, "block_size: 512 positions exceed"),
    (dict(num_blocks=1), ConfigError, "num_blocks"),
    (dict(num_blocks=10**6, memory_budget=2**20), ValueRangeError, "num_blocks: 1000000 blocks"),
    (dict(batch_sizes=(4, 2)), ConfigError, "batch_sizes"),
    (dict(chunk_sizes=()), ConfigError, "chunk_sizes"),
    (dict(chunk_sizes="16"), ConfigError, "chunk_sizes"),
    (dict(max_model_len=512), ConfigError, "max_model_len"),
    (dict(max_model_len=30, block_size=4), ConfigError, "max_model_len: expected a multiple of block_size=4"),
    (dict(max_model_len=2, block_size=4), ConfigError, "max_model_len"),
    (dict(reserved_blocks=0), ConfigError, "reserved_blocks"),
    (dict(memory_budget=10), ValueRangeError, "memory_budget"),
    (dict(memory_budget="1GB"), ConfigError, "memory_budget"),
    (dict(table_widths=(4, 2)), ConfigError, "table_widths"),
    (dict(table_widths=(0, 4)), ConfigError, r"table_widths\[0\]"),
    (dict(table_widths="4"), ConfigError, "table_widths"),
    (dict(table_widths=(2, 99), block_size=4, max_model_len=64), ConfigError,
     "table_widths: expected widths of at most max_blocks_per_seq = 16 blocks, got 99"),
])
def test_hostile_engine_arguments(qwen, kw, error, match):
    with count_compiles() as c, pytest.raises(error, match=match):
        ModelEngine(qwen, **kw)
    assert c.count == 0


def test_engine_refuses_a_model_that_is_not_a_decoder():
    with pytest.raises(ConfigError, match="model: expected a MoEDecoder"):
        ModelEngine(object())


def _table(*blocks, width=16):
    t = np.full(width, -1, np.int32)
    t[:len(blocks)] = blocks
    return t


_TOK = np.arange(5, dtype=np.int32)
_SAMPLED = SamplingParams(temperature=0.5, seed=3)


@pytest.mark.parametrize("args, error, match", [
    ((list(range(5)), 0, _table(3, 4), SamplingParams(), True), ShapeError, "tokens: expected a 1-D numpy array"),
    ((_TOK.astype(np.float32), 0, _table(3, 4), SamplingParams(), True), DTypeError, "tokens: expected an integer"),
    ((_TOK[None], 0, _table(3, 4), SamplingParams(), True), ShapeError, "tokens"),
    ((_TOK[:0], 0, _table(3, 4), SamplingParams(), True), ShapeError, r"tokens: a chunk holds 1 … 16 tokens, got 0"),
    ((np.zeros(17, np.int32), 0, _table(*range(1, 6)), SamplingParams(), True), ShapeError, "got 17"),
    ((np.asarray([1, 320], np.int32), 0, _table(3), SamplingParams(), True), ValueRangeError,
     r"tokens\[1\]: a token id must be in 0 … 319, got 320"),
    ((np.asarray([-1], np.int64), 0, _table(3), SamplingParams(), True), ValueRangeError, r"tokens\[0\]"),
    ((_TOK, -1, _table(3, 4), SamplingParams(), True), ConfigError, "start"),
    ((_TOK, 60, _table(*range(1, 17)), SamplingParams(), True), ConfigError, "start"),
    ((_TOK, 0, _table(3, 4)[:8], SamplingParams(), True), ShapeError, r"block_table: expected shape \(16,\)"),
    ((_TOK, 0, _table(3, 4).astype(np.float64), SamplingParams(), True), DTypeError, "block_table"),
    ((_TOK, 0, _table(3, 17), SamplingParams(), True), ValueRangeError, r"block_table\[1\]: a block id"),
    ((_TOK, 0, _table(3, -2), SamplingParams(), True), ValueRangeError, r"block_table\[1\]"),
    ((_TOK, 0, _table(3), SamplingParams(), True), ValueRangeError, r"block_table\[1\]: positions 4 … need a block"),
    ((_TOK, 0, _table(0, 4), SamplingParams(), True), ValueRangeError, r"block_table\[0\]"),
    ((_TOK, 0, _table(3, 4, 0), SamplingParams(), True), ValueRangeError, "reserved block"),
    ((_TOK, 0, _table(3, 3), SamplingParams(), True), ValueRangeError, "names a block twice"),
    ((_TOK, 0, _table(3, 4), {"temperature": 0}, True), ConfigError, "sampling: expected a SamplingParams"),
    ((_TOK, 0, _table(3, 4), SamplingParams(temperature=0.5), True), ConfigError, "sampling.seed"),
    ((_TOK, 0, _table(3, 4), SamplingParams(), "yes"), ConfigError, "sample: expected a bool"),
])
def test_hostile_prefill_arguments(engine, args, error, match):
    copies = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
    with count_compiles() as c, pytest.raises(error, match=match):
        engine.prefill(*args)
    assert c.count == 0
    for a, b in zip(args, copies):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)


def _decode_args(**change):
    """A valid decode of 2 rows (blocks 3 and 5), with ``change``'s entries replaced."""
    args = dict(tokens=np.asarray([7, 9], np.int32), positions=np.asarray([2, 5], np.int32),
                block_tables=np.stack([_table(3), _table(5, 6)]), sampling=[SamplingParams(), _SAMPLED],
                steps=np.asarray([1, 2], np.int32))
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, match", [
    (dict(tokens=np.asarray([7, 9, 1], np.int32)), ShapeError, r"tokens: a decode batch has one of \(1, 2, 4\)"),
    (dict(tokens=np.asarray([7, 320], np.int32)), ValueRangeError, r"tokens\[1\]"),
    (dict(positions=np.asarray([2, 64], np.int32)), ValueRangeError, r"positions\[1\]: a position"),
    (dict(positions=np.asarray([-1, 5], np.int32)), ValueRangeError, r"positions\[0\]"),
    (dict(positions=np.asarray([2.0, 5.0])), DTypeError, "positions"),
    (dict(positions=np.asarray([2, 9], np.int32)), ValueRangeError, r"block_tables\[1\]\[2\]: positions 8 …"),
    (dict(steps=np.asarray([1, -1], np.int32)), ValueRangeError, r"steps\[1\]"),
    (dict(steps=np.asarray([1], np.int32)), ShapeError, "steps"),
    (dict(block_tables=np.stack([_table(3), _table(5, 6)])[:, :15]), ShapeError, "block_tables"),
    (dict(block_tables=np.stack([_table(3), _table(3, 6)])), ValueRangeError, "a block is in two rows"),
    (dict(block_tables=np.stack([_table(3), _table(5, 99)])), ValueRangeError, r"block_tables\[1\]\[1\]: a block id"),
    (dict(block_tables=np.stack([_table(3), _table(0)])), ValueRangeError, r"block_tables\[1\]: a row naming"),
    (dict(sampling=[SamplingParams()]), ConfigError, "sampling: expected a sequence of 2"),
    (dict(sampling=[SamplingParams(), SamplingParams(temperature=1.0)]), ConfigError, r"sampling\[1\].seed"),
    (dict(sampling="ab"), ConfigError, "sampling"),
])
def test_hostile_decode_arguments(engine, change, error, match):
    args = _decode_args(**change)
    copies = {k: a.copy() for k, a in args.items() if isinstance(a, np.ndarray)}
    with count_compiles() as c, pytest.raises(error, match=match):
        engine.decode(**args)
    assert c.count == 0
    for k, a in copies.items():
        np.testing.assert_array_equal(args[k], a)
    assert issubclass(error, WNA16Error)


# --------------------------------------------------------------------------- (e) the server


def _served_text(tok, ids) -> str:
    """The text the server answers for generated ``ids``: the tokenizer's decoding of them."""
    return tok.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("folder", [QWEN, MIXTRAL, *(os.path.join(HERE, "fixtures", "tokenizers", n)
                                                      for n in ("qwen3-chatml", "mixtral-inst", "deepseek-v3"))])
def test_streamed_text_is_the_decoded_text(folder):
    """The server's incremental decoding (``server._TextStream``), token by token, concatenates
    to ``tok.decode(ids)`` for random id runs (ids outside a small vocabulary decode to nothing,
    byte-level pieces split characters): ``[16, 182, 129, 318, 63]`` on the Qwen3 fixture is
    'expert under' (three empty ids between two words keep the space the decoder puts there).
    Checked on the runs whose decoding never rewrites a character already decoded: a byte-
    fallback decoder (the Mixtral fixture) turns a valid byte it has shown into U+FFFD once an
    invalid byte joins its group, which no stream can take back; at least half the runs qualify."""
    from wna16_jax.models.tokenizer import load_tokenizer
    from wna16_jax.serving.server import _TextStream

    tok = load_tokenizer(folder)

    def streamed(ids):
        stream = _TextStream(tok, ())
        return "".join(stream.push(t) for t in ids) + stream.finish()

    if folder == QWEN:
        assert streamed([16, 182, 129, 318, 63]) == "expert under"
    rng = np.random.default_rng()
    vocab = tok.id_limit                 # every id decode takes (past the tokenizer's: nothing)
    checked = 0
    for _ in range(200):
        ids = rng.integers(0, vocab, int(rng.integers(1, 24))).tolist()
        texts = [tok.decode(ids[:n], skip_special_tokens=True) for n in range(1, len(ids) + 1)]
        if all(b.startswith(a.rstrip("\ufffd")) for a, b in zip(texts, texts[1:])):
            assert streamed(ids) == texts[-1], ids
            checked += 1
    assert checked >= 100, checked


def test_openai_client_against_a_model_engine(engine, generator, qwen):
    """``wna16_jax.serving.server`` over a ModelEngine and the fixture's tokenizer, on a loopback
    port, driven by the official client: a greedy completion of a text prompt and a seeded,
    streamed one of token ids give Generator's tokens, decoded."""
    from server_helpers import BackgroundServer
    from wna16_jax.models.tokenizer import load_tokenizer
    from wna16_jax.serving.server import create_app

    tok = load_tokenizer(QWEN)
    rng = np.random.default_rng()
    text = "the quick brown fox jumps over the lazy dog"
    ids = rng.integers(0, qwen.config.vocab_size, 9).tolist()
    seed = int(rng.integers(1 << 32))
    greedy_want = _reference(generator, tok.encode(text), SamplingParams(max_tokens=10))
    sampled_want = _reference(generator, ids, SamplingParams(temperature=0.8, top_p=0.95, top_k=40, seed=seed,
                                                             max_tokens=10))
    with BackgroundServer(create_app(engine, tok, "awq-qwen3moe"), deadline=DEADLINE) as srv:
        client = srv.client()
        r = client.completions.create(model="awq-qwen3moe", prompt=text, max_tokens=10, temperature=0)
        assert r.choices[0].text == _served_text(tok, greedy_want)
        assert r.usage.completion_tokens == len(greedy_want) and r.choices[0].finish_reason == "length"
        stream = client.completions.create(model="awq-qwen3moe", prompt=ids, max_tokens=10, temperature=0.8,
                                           top_p=0.95, seed=seed, stream=True, extra_body={"top_k": 40})
        assert "".join(c.choices[0].text for c in stream if c.choices) == _served_text(tok, sampled_want)
        assert client.models.list().data[0].max_model_len == engine.max_model_len


# --------------------------------------------------------------------------- the serve command

_SERVE_MAIN = """
import sys
from wna16_jax.cli import Parser
from wna16_jax.serving.cli import add_serve_parser, run_serve
parser = Parser(prog="wna16-jax")
add_serve_parser(parser.add_subparsers(dest="command", required=True))
sys.exit(run_serve(parser.parse_args(sys.argv[1:])))
"""


def _serve_args(*argv):
    from wna16_jax.cli import Parser
    from wna16_jax.serving.cli import add_serve_parser

    parser = Parser(prog="wna16-jax")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["serve", *argv])


def test_serve_command_options():
    """``--max-batch N`` compiles decodes for the powers of two below N and N; ``--kv-blocks``
    (alias ``--num-blocks``) sizes the pool; ``--warm-up`` is off unless asked."""
    from wna16_jax.serving.cli import _checked_options, batch_sizes

    args = _serve_args(QWEN, "--max-batch", "12", "--kv-blocks", "40", "--warm-up")
    opts = _checked_options(args)
    assert opts["batch_sizes"] == (1, 2, 4, 8, 12) and opts["num_blocks"] == 40 and args.warm_up
    assert _checked_options(_serve_args(QWEN))["batch_sizes"] == (1, 2, 4, 8, 16, 32)
    assert not _serve_args(QWEN).warm_up
    assert batch_sizes(1) == (1,) and batch_sizes(16) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize("argv, match", [
    ((QWEN, "--port", "0"), "--port"),
    ((QWEN, "--port", "http"), "argument --port: invalid int value"),
    ((QWEN, "--block-size", "0"), "--block-size"),
    ((QWEN, "--num-blocks", "1"), "--kv-blocks must be an integer >= 2, got 1"),
    ((QWEN, "--kv-blocks", "1"), "--kv-blocks"),
    ((QWEN, "--max-batch", "0"), "--max-batch"),
    ((QWEN, "--max-batch", "100000"), "--max-batch"),
    ((QWEN, "--max-batch", "2.5"), "argument --max-batch: invalid int value"),
    ((QWEN, "--max-model-len", "-4"), "--max-model-len"),
    ((QWEN, "--dtype", "int4"), "argument --dtype: invalid choice"),
    ((QWEN, "--host", ""), "--host"),
    ((QWEN, "--model-name", ""), "--model-name"),
    ((DEEPSEEK,), "serve: .* has no tokenizer.json"),
    ((os.path.join(HERE, "no-such-folder"),), "no-such-folder"),
])
def test_serve_command_refuses_bad_options_before_loading(argv, match):
    from wna16_jax.serving.cli import run_serve

    with pytest.raises(WNA16Error, match=match):
        run_serve(_serve_args(*argv))


def test_serve_command_serves_until_interrupted(generator, qwen):
    """``serve DIR --port P`` in a subprocess: it answers the official client with Generator's
    greedy tokens, and Ctrl-C (SIGINT) stops it with status 0."""
    import signal
    import subprocess
    import sys

    import openai

    from wna16_jax.models.tokenizer import load_tokenizer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", _SERVE_MAIN, "serve", QWEN, "--port", str(port), "--block-size",
                             "8", "--max-model-len", "128", "--max-batch", "2", "--dtype", "float32", "--model-name",
                             "tiny"],
                            stderr=subprocess.PIPE, text=True)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=DEADLINE)
        deadline = time.monotonic() + DEADLINE
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                models = client.models.list().data
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline, "the server did not start"
                time.sleep(0.2)
        assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == 128
        ids = np.random.default_rng().integers(0, qwen.config.vocab_size, 6).tolist()
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
        want = _reference(generator, ids, SamplingParams(max_tokens=6))
        assert r.choices[0].text == _served_text(load_tokenizer(QWEN), want)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert f"serving 'tiny' on http://127.0.0.1:{port}/v1" in err


# --------------------------------------------------------------------------- the benchmark


def test_serve_benchmark_smoke(capsys):
    """``benchmarks/serve.py --tiny`` runs end to end on the CPU (timings mean nothing here and
    are not checked; the table's shape and that every request finished are)."""
    from benchmarks import serve as bench

    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 1
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert len(cells) == len(bench.HEADER.strip("|").split("|"))
    assert cells[1:4] == [str(bench.TINY[k]) for k in ("requests", "prompt", "new")]
    numbers = [float(c.replace(",", "")) for c in cells[4:]]
    assert all(np.isfinite(numbers)) and numbers[0] > 0 and numbers[1] > 0


def test_serve_benchmark_mix_smoke(capsys):
    """``benchmarks/serve.py --tiny --mix`` replays its request mix at each stream count beside the
    static Generator batch, through the scheduler and through the HTTP server (a client process of
    the official ``openai`` package streaming completions from a loopback port): one row per way
    and count (printed as each ends, then as one table), every request finished (the script exits
    otherwise), finite numbers, the goal line printed for the server (timings mean nothing on the
    CPU and are not checked)."""
    from benchmarks import serve as bench

    assert bench.main(["--tiny", "--mix"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    want = [(via, str(s)) for s in bench.TINY_MIX["streams"] for via in ("scheduler", "http")]
    assert rows[:len(want)] == rows[len(want):], out                # the live rows, then the table
    assert [tuple(c.strip() for c in r.split("|")[2:4]) for r in rows[len(want):]] == want, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(bench.MIX_HEADER.strip("|").split("|"))
        numbers = [float(c) for c in cells[5:-1]] + ([] if cells[-1] == "–" else [float(cells[-1])])
        assert all(np.isfinite(numbers)) and numbers[0] > 0 and numbers[4] > 0, row   # tokens/s, TPOT p50
    assert "static Generator, batch 2" in out and "goal at 2 streams through the http" in out
