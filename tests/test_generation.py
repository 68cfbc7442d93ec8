"""Generation defaults (``generation_config.json``), top-k sampling, and hostile input on the
generation API (``wna16_jax.models.generation``, ``wna16_jax.models.generation_config``).

One tiny random Qwen3-MoE (one layer, vocabulary 96, no ``max_position_embeddings``) is written
once per module with a ``generation_config.json`` that asks for sampling (do_sample, temperature
0.7, top_p 0.9, top_k 5) and declares its own eos ids; every compiled check shares one
``Generator(batch_size=2, max_len=32)``: one prefill (bucket 16) and one decode program each for
greedy and for sampling. The sampler itself is checked against a float64 numpy reference of the
same rule over thousands of keys in one compiled ``vmap``. Hostile inputs must raise a typed
error naming the argument (and index) before anything is compiled, leaving the inputs as they were.
"""

from __future__ import annotations

import copy
import json
import re
import os
import shutil
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wna16_jax.cli import main
from wna16_jax.errors import (ConfigError, CorruptFileError, DTypeError, ShapeError, ValueRangeError,
                              WNA16Error)
from wna16_jax.models import load_model
from wna16_jax.models.generation import (DEFAULT_MEMORY_BUDGET, Generator, as_prng_key, choose_tokens,
                                         device_memory_budget, generate, kv_cache_bytes, sampling_settings)
from wna16_jax.models.generation_config import (MAX_GENERATION_CONFIG_BYTES, GenerationDefaults,
                                                read_generation_config)
from wna16_jax.models.synthetic import RandomModelSpec, write_random_model
from wna16_jax.schemes import QuantScheme
from wna16_jax.serving import count_compiles

VOCAB = 96
TINY = dict(vocab_size=VOCAB, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16,
            num_experts=4, top_k=2, moe_intermediate_size=64)
SCHEME = QuantScheme.from_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                        "sym": True})
# the file's eos ids: odd ids, high first, so that greedy output meets one (config.json says 2)
FILE_EOS = list(range(VOCAB - 1, 0, -2))
GEN_CONFIG = {"bos_token_id": 1, "eos_token_id": FILE_EOS, "do_sample": True, "temperature": 0.7, "top_p": 0.9,
              "top_k": 5, "transformers_version": "5.17.0", "max_length": "ignored"}
DEEPSEEK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf_deepseek", "v3-awq")


def _load(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the backend fallback warns by design
        return load_model(path, dtype=jnp.float32, **kw)


def _write_model(path, gen_config=None, **kw):
    write_random_model(path, RandomModelSpec(model_type="qwen3_moe", scheme=SCHEME, **{**TINY, **kw}), seed=11)
    if gen_config is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump(gen_config, f)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _write_model(str(tmp_path_factory.mktemp("gen") / "tiny"), GEN_CONFIG, max_position_embeddings=None)


@pytest.fixture(scope="module")
def model(model_dir):
    return _load(model_dir)


@pytest.fixture(scope="module")
def gen(model):
    return Generator(model, batch_size=2, max_len=32)


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """The same shape with max_position_embeddings=64 (only error paths run on it: no compile)."""
    return _load(_write_model(str(tmp_path_factory.mktemp("gen") / "limited"), max_position_embeddings=64))


def _prompts(rng, n=2, low=3, high=16):
    return [rng.integers(0, VOCAB, int(rng.integers(low, high))).tolist() for _ in range(n)]


# --------------------------------------------------------------------------- generation_config.json


def _write_gen(folder, text) -> str:
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "generation_config.json")
    with open(path, "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode())
    return path


def test_absent_file_gives_the_defaults(tmp_path):
    d = read_generation_config(tmp_path, vocab_size=VOCAB)
    assert d == GenerationDefaults() and (d.eos_token_ids, d.do_sample, d.top_k) == ((), False, 0)
    assert hash(d) == hash(GenerationDefaults())


def test_fields_are_read_with_their_defaults(tmp_path):
    _write_gen(tmp_path, json.dumps({"eos_token_id": [7, 3, 7], "do_sample": True, "top_p": 0.95, "top_k": 20.0,
                                     "temperature": None, "pad_token_id": "anything", "use_cache": True}))
    d = read_generation_config(tmp_path, vocab_size=VOCAB)
    assert d == GenerationDefaults(eos_token_ids=(7, 3), do_sample=True, temperature=1.0, top_p=0.95, top_k=20)
    _write_gen(tmp_path, json.dumps({"eos_token_id": 5}))        # a lone id
    assert read_generation_config(tmp_path, vocab_size=VOCAB).eos_token_ids == (5,)
    assert GenerationDefaults(eos_token_ids=(7, 3)).stop_token_ids((2, 3)) == (7, 3, 2)


BAD_FILES = [
    ('{"eos_token_id": "2"}', "eos_token_id"),
    ('{"eos_token_id": true}', "eos_token_id"),
    ('{"eos_token_id": [1, "x"]}', "eos_token_id"),
    ('{"eos_token_id": 96}', "eos_token_id"),
    ('{"eos_token_id": [-1]}', "eos_token_id"),
    ('{"eos_token_id": 1.5}', "eos_token_id"),
    ('{"eos_token_id": {"a": 1}}', "eos_token_id"),
    ('{"do_sample": "true"}', "do_sample"),
    ('{"do_sample": 1}', "do_sample"),
    ('{"temperature": -0.5}', "temperature"),
    ('{"temperature": "0.7"}', "temperature"),
    ('{"temperature": true}', "temperature"),
    ('{"temperature": NaN}', "temperature"),
    ('{"temperature": Infinity}', "temperature"),
    ('{"top_p": 0}', "top_p"),
    ('{"top_p": 1.5}', "top_p"),
    ('{"top_p": "0.9"}', "top_p"),
    ('{"top_k": -1}', "top_k"),
    ('{"top_k": 2.5}', "top_k"),
    ('{"top_k": "20"}', "top_k"),
    ('{"top_k": false}', "top_k"),
    ('[1, 2]', "expected a JSON object"),
    ('"text"', "expected a JSON object"),
]


@pytest.mark.parametrize("text,field", BAD_FILES, ids=[t for t, _ in BAD_FILES])
def test_bad_fields_are_refused_naming_file_and_field(tmp_path, text, field):
    path = _write_gen(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        read_generation_config(tmp_path, vocab_size=VOCAB)
    assert path in str(e.value) and field in str(e.value) and "got" in str(e.value)
    with open(path) as f:
        assert f.read() == text                                  # nothing rewritten
    assert os.listdir(tmp_path) == ["generation_config.json"]


@pytest.mark.parametrize("raw,words", [
    (b'{"top_k": 5', "not valid JSON"),
    (b'{"top_k": 5, "top_k": 6}', "appears twice"),
    (b'{"top_k": "\xff"}', "not UTF-8"),
])
def test_corrupt_files_name_the_file(tmp_path, raw, words):
    path = _write_gen(tmp_path, raw)
    with pytest.raises(CorruptFileError, match=words) as e:
        read_generation_config(tmp_path, vocab_size=VOCAB)
    assert path in str(e.value)


def test_an_oversized_file_is_refused_by_its_size(tmp_path):
    """Valid JSON padded past the limit: only the size can refuse it."""
    text = '{"top_k": 5}' + " " * MAX_GENERATION_CONFIG_BYTES
    path = _write_gen(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"at most {MAX_GENERATION_CONFIG_BYTES} bytes, got {len(text)} bytes") as e:
        read_generation_config(tmp_path, vocab_size=VOCAB)
    assert path in str(e.value) and os.path.getsize(path) == len(text)


def test_odd_paths_and_arguments_are_refused(tmp_path):
    os.makedirs(tmp_path / "dir" / "generation_config.json")
    with pytest.raises(ConfigError, match="generation_config.json must be a regular file"):
        read_generation_config(tmp_path / "dir", vocab_size=VOCAB)
    os.makedirs(tmp_path / "link")
    os.symlink(str(tmp_path / "missing.json"), str(tmp_path / "link" / "generation_config.json"))
    with pytest.raises(CorruptFileError, match="link to a file that does not exist"):
        read_generation_config(tmp_path / "link", vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="is not a folder"):
        read_generation_config(tmp_path / "nowhere", vocab_size=VOCAB)
    with pytest.raises(ConfigError, match="folder: expected a path"):
        read_generation_config(None, vocab_size=VOCAB)
    for bad in (0, True, "96"):
        with pytest.raises(ConfigError, match="vocab_size"):
            read_generation_config(tmp_path, vocab_size=bad)


def test_load_model_reads_the_defaults_and_joins_the_eos_ids(model):
    c = model.config
    assert c.generation == GenerationDefaults(eos_token_ids=tuple(FILE_EOS), do_sample=True, temperature=0.7,
                                              top_p=0.9, top_k=5)
    assert c.eos_token_ids == tuple(FILE_EOS) + (2,)              # generation_config's, then config.json's


def test_load_model_and_cli_refuse_a_bad_file_naming_the_field(model_dir, tmp_path, capsys):
    bad = str(tmp_path / "bad")
    shutil.copytree(model_dir, bad)
    path = _write_gen(bad, json.dumps({**GEN_CONFIG, "top_k": -3}))
    before = sorted(os.listdir(bad))
    with pytest.raises(ConfigError, match=r"generation_config.json: field 'top_k' must be an integer >= 0, got -3"):
        load_model(bad)
    assert main(["generate", bad, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and path in err and "top_k" in err
    assert sorted(os.listdir(bad)) == before


# --------------------------------------------------------------------------- sampling rule (float64 reference)


def _reference_probs(logits, temperature, top_p, top_k):
    """float64: softmax(logits / T) over the top_k most likely tokens (stable order: ties go to
    the lower id), renormalized, then cut to the smallest prefix whose mass reaches top_p.
    Returns (probabilities [V], the smallest gap between top_p < 1 and a prefix mass)."""
    z = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    k = len(z) if top_k <= 0 else min(top_k, len(z))
    zk = z[order[:k]]
    p = np.exp(zk - zk.max())
    p /= p.sum()
    before = np.cumsum(p) - p
    keep = before < top_p
    out = np.zeros(len(z))
    out[order[:k][keep]] = p[keep] / p[keep].sum()
    return out, float(np.abs(before - top_p).min()) if top_p < 1 else np.inf


@jax.jit
def _sample_many(logits, keys, temperature, top_p, top_k):
    rows = logits.shape[0]
    return jax.vmap(lambda k: choose_tokens(logits, jax.random.split(k, rows), temperature, top_p, top_k,
                                            sample=True))(keys)


ROWS, V, KEYS = 8, 24, 4000


def _rows_with_margin(rng, temperature, top_p, top_k):
    """Random logits, a row redrawn while top_p lies within 1e-3 of one of its prefix masses (float32
    rounding could then move the boundary); two rows get exact ties across the top-k boundary."""
    out = np.zeros((ROWS, V), np.float32)
    for i in range(ROWS):
        while True:
            row = (rng.standard_normal(V) * 2).astype(np.float32)
            if i < 2 and 0 < top_k < V:                 # tie the k-th and (k+1)-th most likely tokens
                order = np.argsort(-row, kind="stable")
                row[order[top_k]] = row[order[top_k - 1]]
            if _reference_probs(row, temperature, top_p, top_k)[1] > 1e-3:
                break
        out[i] = row
    return out


@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 1.0, 3), (0.7, 0.8, 5), (1.3, 0.6, 0), (1.0, 0.9, 1),
                                                     (0.9, 1.0, V + 7)])
def test_top_k_then_top_p_matches_the_float64_rule(temperature, top_p, top_k):
    """Over 4000 keys per seed, every sampled token lies in the reference's allowed set, and each
    token's frequency is its renormalized probability within 5 binomial standard deviations
    (+ 1/KEYS). Top-p applied before top-k, or without renormalizing, moves some probabilities by
    0.1 or more (far beyond the ~0.04 bound)."""
    for seed in range(3):
        rng = np.random.default_rng()
        logits = _rows_with_margin(rng, temperature, top_p, top_k)
        keys = jax.random.split(jax.random.key(int(rng.integers(1 << 31))), KEYS)
        got = np.asarray(_sample_many(jnp.asarray(logits), keys, jnp.float32(temperature), jnp.float32(top_p),
                                      jnp.int32(top_k)))
        assert got.shape == (KEYS, ROWS)
        for i in range(ROWS):
            want, _ = _reference_probs(logits[i], temperature, top_p, top_k)
            assert np.all(want[got[:, i]] > 0), (seed, i, sorted(set(got[:, i].tolist()) - set(np.flatnonzero(want))))
            freq = np.bincount(got[:, i], minlength=V) / KEYS
            tol = 5 * np.sqrt(want * (1 - want) / KEYS) + 1 / KEYS
            assert np.all(np.abs(freq - want) <= tol), (seed, i, np.abs(freq - want).max())
            if top_k == 1:
                assert np.all(got[:, i] == np.argmax(logits[i]))     # argmax, ties to the lower id


def test_top_k_comes_before_top_p_and_ties_go_to_the_lower_id():
    """probabilities (0.4, 0.3, 0.2, 0.1): top_k=2 renormalizes to (0.571, 0.429), so top_p=0.5 keeps
    token 0 alone (top-p first would keep 0 and 1). Tokens 3 and 5 tie for the second place: top_k=2
    keeps 3."""
    base = np.full(V, -40.0, np.float32)
    a = base.copy()
    a[:4] = np.log([0.4, 0.3, 0.2, 0.1])
    b = base.copy()
    b[[1, 3, 5]] = [2.0, 1.0, 1.0]
    logits = jnp.asarray(np.stack([a, b] * (ROWS // 2)))
    keys = jax.random.split(jax.random.key(int(np.random.default_rng().integers(1 << 31))), KEYS)
    got = np.asarray(_sample_many(logits, keys, jnp.float32(1), jnp.float32(0.5), jnp.int32(2)))
    assert set(got[:, 0].tolist()) == {0}
    assert set(got[:, 1].tolist()) == {1}                    # 1 alone reaches 0.5 (p = e/(e+1) = 0.73)
    got = np.asarray(_sample_many(logits, keys, jnp.float32(1), jnp.float32(1), jnp.int32(2)))
    assert set(got[:, 0].tolist()) == {0, 1} and set(got[:, 1].tolist()) == {1, 3}
    assert abs((got[:, 1] == 1).mean() - np.e / (np.e + 1)) < 0.03


def test_sampling_settings_follow_the_model_defaults():
    d = GenerationDefaults(do_sample=True, temperature=0.7, top_p=0.9, top_k=5)
    assert sampling_settings(d, keyed=False) == (False, 0.0, 0.9, 5)          # no key: greedy
    assert sampling_settings(d, keyed=True) == (True, 0.7, 0.9, 5)
    assert sampling_settings(d, 0, keyed=True)[0] is False                    # temperature=0: greedy
    assert sampling_settings(d, 1.5, 1, 0, keyed=True) == (True, 1.5, 1.0, 0)
    greedy_file = GenerationDefaults(do_sample=False, temperature=0.7)
    assert sampling_settings(greedy_file, keyed=True) == (False, 0.0, 1.0, 0)  # do_sample=false wins
    assert sampling_settings(greedy_file, 0.7, keyed=True)[0] is True          # an explicit temperature samples


def test_keys_in_every_accepted_form_are_the_same_key():
    want = jax.random.key_data(jax.random.key(7)).tolist()
    for k in (7, np.int64(7), jax.random.key(7), jax.random.PRNGKey(7), np.asarray(jax.random.PRNGKey(7))):
        assert jax.random.key_data(as_prng_key(k)).tolist() == want, k


# --------------------------------------------------------------------------- sizes


def _init_cache_bytes(model, b, t):
    shapes = jax.eval_shape(lambda: model.init_cache(b, t))          # nothing allocated
    return sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(shapes))


def test_kv_cache_bytes_is_init_caches_size(model):
    """Per-head keys and values (Qwen3) and DeepSeek's latent cache, unrolled and scanned."""
    deepseek = _load(DEEPSEEK)
    scanned = _load(DEEPSEEK, scan_layers=True)
    for m in (model, deepseek, scanned):
        for b, t in ((1, 16), (3, 40)):
            assert kv_cache_bytes(m.config, b, t, m.dtype) == _init_cache_bytes(m, b, t) > 0
    assert kv_cache_bytes(model.config, 2, 8, jnp.bfloat16) * 2 == kv_cache_bytes(model.config, 2, 8, jnp.float32)
    c = deepseek.config
    assert kv_cache_bytes(c, 1, 1, jnp.float32) == c.num_layers * (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim) * 4


def test_the_cache_holds_whole_kernel_blocks(model):
    """A Generator's cache holds ``max_len`` rounded up to whole blocks of the decode-attention
    kernels (a multiple of 64, of 16 below 64), so that any ``max_len`` decodes on the kernel;
    the budget is checked against what is allocated, and the tokens are those of a Generator
    with a shorter cache (the extra slots are never written or attended to)."""
    from wna16_jax.models.generation import cache_len

    assert [cache_len(n) for n in (1, 15, 16, 17, 63, 64, 65, 100, 768, 769)] == [16, 16, 16, 32, 64, 64, 128,
                                                                                  128, 768, 832]
    g = Generator(model, batch_size=2, max_len=100)
    assert (g.max_len, g.cache_len) == (100, 128)
    assert g.cache_bytes == kv_cache_bytes(model.config, 2, 128, model.dtype)
    with pytest.raises(ValueRangeError, match="exceeds the cache length max_len=100"):
        g.generate([[5] * 90], 11)                     # max_len still bounds a request, not the rounding
    prompts = [[5, 6, 7, 8], [9, 10]]
    assert g.generate(prompts, 6) == Generator(model, batch_size=2, max_len=64).generate(prompts, 6)
    shapes = jax.eval_shape(lambda: model.init_cache(2, g.cache_len))
    assert shapes.k.shape[3] == 128


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        if isinstance(self.stats, Exception):
            raise self.stats
        return self.stats

    def __str__(self):
        return "fake:0"


def test_memory_budget_is_the_free_memory_or_the_default():
    assert device_memory_budget(_Device({"bytes_limit": 1000, "bytes_in_use": 400}))[0] == 600
    assert device_memory_budget(_Device(None))[0] == DEFAULT_MEMORY_BUDGET == 8 << 30
    assert device_memory_budget(_Device(NotImplementedError()))[0] == DEFAULT_MEMORY_BUDGET
    stats = jax.devices()[0].memory_stats()
    want = stats["bytes_limit"] - stats["bytes_in_use"] if stats else DEFAULT_MEMORY_BUDGET
    assert device_memory_budget()[0] == want


def test_memory_budget_argument_sets_the_limit(model):
    need = kv_cache_bytes(model.config, 1, 1 << 20, model.dtype)
    g = Generator(model, batch_size=1, max_len=1 << 20, memory_budget=need)     # nothing is allocated here
    assert g.cache_bytes == need
    with pytest.raises(ValueRangeError, match=rf"needs {need} bytes.*memory budget of {need - 1} bytes.*memory_budget"):
        Generator(model, batch_size=1, max_len=1 << 20, memory_budget=need - 1)


# --------------------------------------------------------------------------- compiled behaviour


def test_prompt_forms_are_equivalent(gen, model):
    """A list of lists, a tuple, 2-D numpy / jax arrays: one batch; a 1-D array and one flat list:
    one prompt (not one prompt per id)."""
    rng = np.random.default_rng()
    rows = rng.integers(0, VOCAB, (2, 9))
    want = gen.generate(rows.tolist(), 5, stop_tokens=())
    assert len(want) == 2 and all(len(o) == 5 for o in want)
    for form in (tuple(map(tuple, rows.tolist())), rows, rows.astype(np.int32), jnp.asarray(rows, jnp.int32),
                 [rows[0], jnp.asarray(rows[1])]):
        assert gen.generate(form, 5, stop_tokens=()) == want
    one = [want[0]]
    for form in (rows[0].tolist(), rows[0], jnp.asarray(rows[0])):
        assert gen.generate(form, 5, stop_tokens=()) == one
    assert generate(model, rows[0].tolist(), 5, batch_size=2, max_len=32, stop_tokens=()) == one


def test_stop_tokens_default_to_the_model_eos_ids(gen, model):
    rng = np.random.default_rng()
    prompts = _prompts(rng)
    free = gen.generate(prompts, 12, stop_tokens=())
    eos = set(model.config.eos_token_ids)
    assert any(t in eos for o in free for t in o), free        # half the vocabulary stops: some row meets one
    want = [o[:next((j + 1 for j, t in enumerate(o) if t in eos), len(o))] for o in free]
    assert gen.generate(prompts, 12) == want
    assert gen.generate(prompts, 12, stop_tokens=model.config.eos_token_ids) == want   # the README's spelling
    assert gen.check_request(prompts, 12).stop_tokens == model.config.eos_token_ids


def test_sampling_defaults_and_key_forms(gen):
    """With a key and no settings: the file's temperature / top_p / top_k; an int seed and an
    old-style key are that key; without a key, greedy; top_k=1 is greedy at any temperature."""
    rng = np.random.default_rng()
    prompts = _prompts(rng)
    seed = int(rng.integers(1 << 31))
    greedy = gen.generate(prompts, 6, stop_tokens=())
    assert gen.generate(prompts, 6, stop_tokens=(), key=None) == greedy
    want = gen.generate(prompts, 6, stop_tokens=(), key=jax.random.key(seed), temperature=0.7, top_p=0.9, top_k=5)
    for key in (seed, jax.random.key(seed), jax.random.PRNGKey(seed)):
        assert gen.generate(prompts, 6, stop_tokens=(), key=key) == want
    req = gen.check_request(prompts, 6, key=seed)
    assert (req.sample, req.temperature, req.top_p, req.top_k) == (True, 0.7, 0.9, 5)
    assert gen.generate(prompts, 6, stop_tokens=(), key=seed, temperature=50.0, top_k=1) == greedy
    hot = [gen.generate(prompts, 6, stop_tokens=(), key=seed + i, temperature=50.0, top_p=1.0, top_k=0)
           for i in range(3)]
    assert any(h != greedy for h in hot)          # near-uniform over 96 tokens: top_k=1 above is not vacuous


# --------------------------------------------------------------------------- hostile requests


# (error, words the message must hold, call(t)): t.m the shared model, t.lim the one with
# max_position_embeddings=64, t.g a Generator(t.m, batch_size=2, max_len=32), t.ok = [[5, 6, 7]]. Arrays
# are put on the device with jax.device_put (jnp.asarray would compile a copy inside the count).
HOSTILE = [
    (ConfigError, ["model", "NoneType"], lambda t: Generator(None, batch_size=1, max_len=8)),
    (ConfigError, ["model", "NoneType"], lambda t: generate(None, t.ok, 2)),
    (ConfigError, ["batch_size", "got 0"], lambda t: Generator(t.m, batch_size=0, max_len=8)),
    (ConfigError, ["batch_size", "True"], lambda t: Generator(t.m, batch_size=True, max_len=8)),
    (ConfigError, ["max_len", "'8'"], lambda t: Generator(t.m, batch_size=1, max_len="8")),
    (ConfigError, ["max_len", "2147483648"], lambda t: Generator(t.m, batch_size=1, max_len=2**31)),
    (ConfigError, ["min_bucket", "got 0"], lambda t: Generator(t.m, batch_size=1, max_len=8, min_bucket=0)),
    (ConfigError, ["memory_budget", "'1GB'"],
     lambda t: Generator(t.m, batch_size=1, max_len=8, memory_budget="1GB")),
    # the cache holds max_len rounded up to a multiple of 64 positions (2**31), 256 bytes each
    (ValueRangeError, ["max_len=2147483647", "batch_size=1", "549755813888 bytes", "2147483648 positions",
                       "memory budget"],
     lambda t: Generator(t.m, batch_size=1, max_len=2**31 - 1)),
    (ValueRangeError, ["max_len=1024", "batch_size=1000000", "memory budget"],
     lambda t: Generator(t.m, batch_size=10**6, max_len=1024)),
    (ValueRangeError, ["max_position_embeddings=64", "got 128"],
     lambda t: Generator(t.lim, batch_size=1, max_len=128)),
    (ValueRangeError, ["max_new_tokens", "2147483648", "2147483647"], lambda t: generate(t.m, t.ok, 2**31)),
    (ValueRangeError, ["max_new_tokens=268435456", "max_len=536870912", "memory budget"],
     lambda t: generate(t.m, t.ok, 2**28)),
    (ValueRangeError, ["prompt_ids_list[0]", "max_new_tokens 100000", "max_len=64"],
     lambda t: generate(t.lim, t.ok, 10**5)),
    (ConfigError, ["prompt_ids_list", "int"], lambda t: generate(t.m, 5, 4)),
    (ConfigError, ["prompts", "str", "tokenizer"], lambda t: t.g.generate("hello", 2)),
    (ConfigError, ["prompts", "NoneType"], lambda t: t.g.generate(None, 2)),
    (ConfigError, ["prompts", "dict"], lambda t: t.g.generate({0: [1]}, 2)),
    (ShapeError, ["prompts", "at least one prompt"], lambda t: t.g.generate([], 2)),
    (ValueRangeError, ["prompts[0]", "at least one token"], lambda t: t.g.generate([[]], 2)),
    (ShapeError, ["at most 2 sequences, got 3"], lambda t: t.g.generate(t.ok * 3, 2)),
    (DTypeError, ["prompts", "float32"], lambda t: t.g.generate(np.ones((2, 3), np.float32), 2)),
    (DTypeError, ["prompts", "bool"], lambda t: t.g.generate(np.ones(3, bool), 2)),
    (DTypeError, ["prompts", "float32"], lambda t: t.g.generate(jax.device_put(np.ones((1, 3), np.float32)), 2)),
    (DTypeError, ["prompts[1]", "float64"], lambda t: t.g.generate([[1], np.ones(2)], 2)),
    (ShapeError, ["prompts", "(1, 2, 3)"], lambda t: t.g.generate(np.ones((1, 2, 3), np.int32), 2)),
    (ShapeError, ["prompts[0]", "(1, 2)"], lambda t: t.g.generate([np.ones((1, 2), np.int32)], 2)),
    (ValueRangeError, ["prompts[1][2]", "[0, 96)", "got 96"],
     lambda t: t.g.generate(np.asarray([[1, 2, 3], [4, 5, 96]]), 2)),
    (ValueRangeError, ["prompts[1]", "got -1"], lambda t: t.g.generate(jax.device_put(np.asarray([5, -1])), 2)),
    (ConfigError, ["prompts[1]", "int 2"], lambda t: t.g.generate([[1], 2], 2)),
    (ConfigError, ["prompts[0]", "int 1"], lambda t: t.g.generate([1, [2, 3]], 2)),
    (DTypeError, ["prompts[0][1]", "[2]"], lambda t: t.g.generate([[1, [2]]], 2)),
    (DTypeError, ["prompts[0][0]", "True"], lambda t: t.g.generate([[True, 1]], 2)),
    (DTypeError, ["prompts[0][0]", "1.0"], lambda t: t.g.generate([[1.0, 2]], 2)),
    (ConfigError, ["prompts[0]", "bool"], lambda t: t.g.generate([True, False], 2)),
    (ValueRangeError, ["prompts[0][1]", "got 96"], lambda t: t.g.generate([[3, 96]], 2)),
    (ValueRangeError, ["prompts[0]: prompt length 30 + max_new_tokens 8 = 38", "max_len=32"],
     lambda t: t.g.generate([list(range(30))], 8)),
    (ConfigError, ["max_new_tokens", "got 0"], lambda t: t.g.generate(t.ok, 0)),
    (ConfigError, ["max_new_tokens", "None"], lambda t: t.g.generate(t.ok, None)),
    (ConfigError, ["max_new_tokens", "2.5"], lambda t: t.g.generate(t.ok, 2.5)),
    (ConfigError, ["max_new_tokens", "'3'"], lambda t: t.g.generate(t.ok, "3")),
    (ConfigError, ["temperature", "-1"], lambda t: t.g.generate(t.ok, 2, temperature=-1)),
    (ConfigError, ["temperature", "nan"], lambda t: t.g.generate(t.ok, 2, temperature=float("nan"))),
    (ConfigError, ["temperature", "'0.7'"], lambda t: t.g.generate(t.ok, 2, temperature="0.7")),
    (ConfigError, ["temperature", "True"], lambda t: t.g.generate(t.ok, 2, temperature=True)),
    (ConfigError, ["top_p", "got 0"], lambda t: t.g.generate(t.ok, 2, top_p=0)),
    (ConfigError, ["top_p", "1.5"], lambda t: t.g.generate(t.ok, 2, top_p=1.5)),
    (ConfigError, ["top_k", "-1"], lambda t: t.g.generate(t.ok, 2, top_k=-1)),
    (ConfigError, ["top_k", "1.5"], lambda t: t.g.generate(t.ok, 2, top_k=1.5)),
    (ConfigError, ["top_k", "'5'"], lambda t: t.g.generate(t.ok, 2, top_k="5")),
    (ConfigError, ["key: sampling", "None"], lambda t: t.g.generate(t.ok, 2, temperature=0.7)),
    (ConfigError, ["key", "str 'abc'"], lambda t: t.g.generate(t.ok, 2, key="abc")),
    (ConfigError, ["key", "float 3.0"], lambda t: t.g.generate(t.ok, 2, key=3.0)),
    (ConfigError, ["key", "got -1"], lambda t: t.g.generate(t.ok, 2, key=-1)),
    (ConfigError, ["key", "4294967296"], lambda t: t.g.generate(t.ok, 2, key=2**32)),
    (ConfigError, ["key", "bool"], lambda t: t.g.generate(t.ok, 2, key=True)),
    (DTypeError, ["key", "float32"], lambda t: t.g.generate(t.ok, 2, key=np.zeros(2, np.float32))),
    (ShapeError, ["key", "(3,)"], lambda t: t.g.generate(t.ok, 2, key=jax.device_put(np.zeros(3, np.uint32)))),
    (ShapeError, ["key", "(2,)"],
     lambda t: t.g.generate(t.ok, 2, key=jax.random.wrap_key_data(np.zeros((2, 2), np.uint32)))),
    (ConfigError, ["stop_tokens", "int 2"], lambda t: t.g.generate(t.ok, 2, stop_tokens=2)),
    (ConfigError, ["stop_tokens", "str"], lambda t: t.g.generate(t.ok, 2, stop_tokens="2")),
    (ValueRangeError, ["stop_tokens[1]", "[0, 96)", "got 999"], lambda t: t.g.generate(t.ok, 2, stop_tokens=[2, 999])),
    (ValueRangeError, ["stop_tokens[0]", "got -1"], lambda t: t.g.generate(t.ok, 2, stop_tokens=(-1,))),
    (DTypeError, ["stop_tokens[0]", "True"], lambda t: t.g.generate(t.ok, 2, stop_tokens=[True])),
    (DTypeError, ["stop_tokens[0]", "[2]"], lambda t: t.g.generate(t.ok, 2, stop_tokens=[[2]])),
    (DTypeError, ["stop_tokens", "float64"], lambda t: t.g.generate(t.ok, 2, stop_tokens=np.ones(2))),
    (ShapeError, ["stop_tokens", "(1, 2)"], lambda t: t.g.generate(t.ok, 2, stop_tokens=np.ones((1, 2), np.int32))),
    (ConfigError, ["callback", "int 5"], lambda t: t.g.generate(t.ok, 2, callback=5)),
]


@pytest.mark.parametrize("err,words,call", HOSTILE, ids=[f"{e.__name__}-{w[0]}-{i}" for i, (e, w, _) in
                                                      enumerate(HOSTILE)])
def test_hostile_requests_raise_typed_errors_before_compiling(model, limited, err, words, call):
    ok = [[5, 6, 7]]
    t = types.SimpleNamespace(m=model, lim=limited, g=Generator(model, batch_size=2, max_len=32), ok=ok)
    with count_compiles() as c:
        with pytest.raises(err) as e:
            call(t)
    assert isinstance(e.value, WNA16Error) and type(e.value) is err
    assert all(w in str(e.value) for w in words), (str(e.value), words)
    assert c.count == 0
    assert ok == [[5, 6, 7]]                                # the prompt given is as it was


def test_there_are_many_hostile_cases():
    assert len(HOSTILE) >= 20


def test_hostile_arrays_and_lists_are_not_modified(gen):
    """A batch whose second row is bad: the first row (list), the arrays and the stop list come
    back as they were."""
    rows = np.asarray([[1, 2, 3], [4, 5, 96]], np.int64)
    lists = [[1, 2, 3], [4, 5, 96]]
    stops = [2, 3]
    keep = (rows.copy(), copy.deepcopy(lists), list(stops))
    for p in (rows, lists, jnp.asarray(rows)):
        with pytest.raises(ValueRangeError, match=r"prompts\[1\]\[2\]"):
            gen.generate(p, 2, stop_tokens=stops)
    assert np.array_equal(rows, keep[0]) and lists == keep[1] and stops == keep[2]


# --------------------------------------------------------------------------- several steps per program


@pytest.mark.parametrize("k", [3, 8])
def test_several_decode_steps_per_program_give_the_one_step_tokens(model, gen, k):
    """``decode_steps=K``: K tokens per device program (a while_loop, stop tokens detected on the
    device), the same tokens as one step per program — greedy, seeded sampling with per-prompt
    keys, stop tokens met inside a block (one row stops, then the other), a filler row, a
    ``max_new_tokens`` that is not a multiple of K — and the same streamed steps."""
    rng = np.random.default_rng()
    many = Generator(model, batch_size=3, max_len=32, decode_steps=k)
    assert many.decode_steps == k and gen.decode_steps == 1
    prompts = _prompts(rng)
    for kw in (dict(), dict(temperature=0.9, top_p=0.9, top_k=7, key=int(rng.integers(1 << 31))),
               dict(temperature=1.2, key=[jax.random.key(int(s)) for s in rng.integers(1 << 31, size=2)])):
        free = gen.generate(prompts, 13, stop_tokens=(), **kw)
        assert many.generate(prompts, 13, stop_tokens=(), **kw) == free, kw
        stops = (free[0][4], free[1][9])                      # row 0 stops in block one, row 1 later
        want = gen.generate(prompts, 13, stop_tokens=stops, **kw)
        assert any(len(o) < 13 for o in want)
        assert many.generate(prompts, 13, stop_tokens=stops, **kw) == want, kw
        steps_one = [s.tolist() for s in gen.stream(prompts, 13, stop_tokens=stops, **kw)]
        assert [s.tolist() for s in many.stream(prompts, 13, stop_tokens=stops, **kw)] == steps_one
    assert many.generate(prompts[:1], 1) == gen.generate(prompts[:1], 1)


@pytest.mark.parametrize("value, err, words", [
    (0, ConfigError, "decode_steps"), (-2, ConfigError, "decode_steps"), (2.5, ConfigError, "decode_steps"),
    (True, ConfigError, "decode_steps"), ("4", ConfigError, "decode_steps"),
    (32, ValueRangeError, "decode_steps: 32 steps per program do not fit a cache of max_len=32"),
])
def test_bad_decode_steps_are_refused(model, value, err, words):
    with pytest.raises(err, match=re.escape(words)):
        Generator(model, batch_size=1, max_len=32, decode_steps=value)
