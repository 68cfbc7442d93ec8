"""Hostile input on the model surface: config.json values, load_model arguments, the eager
forward's token ids, and the tensors a family needs. Each case gets a typed error naming the
field or argument (or, where accepting is right, a warning that says what was done)."""

import copy
import json
import math
import os
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wna16_jax.errors import (ConfigError, DTypeError, MissingTensorError, ShapeError, UnsupportedError,
                              ValueRangeError, WNA16Error)
from wna16_jax.models import load_model
from wna16_jax.models.config import DecoderConfig

FIX = os.path.join(os.path.dirname(__file__), "fixtures")
QWEN3 = os.path.join(FIX, "quantizers", "awq-qwen3moe")
MIXTRAL = os.path.join(FIX, "quantizers", "gptq-mixtral")
DSV3 = os.path.join(FIX, "hf_deepseek", "v3-awq")


def _raw(folder):
    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)


RAW = {"qwen3": _raw(QWEN3), "mixtral": _raw(MIXTRAL), "dsv3": _raw(DSV3)}

# (family, field, value, words the message must hold); value DELETE removes the field
DELETE = object()
CASES = [
    ("qwen3", "model_type", ["qwen3_moe"], "model_type"),
    ("qwen3", "model_type", 7, "model_type"),
    ("qwen3", "model_type", "llama", "not supported"),
    ("qwen3", "num_hidden_layers", math.inf, "num_hidden_layers"),
    ("qwen3", "num_hidden_layers", math.nan, "num_hidden_layers"),
    ("qwen3", "num_hidden_layers", 10 ** 9, "num_hidden_layers"),
    ("qwen3", "num_hidden_layers", 0, "num_hidden_layers"),
    ("qwen3", "num_hidden_layers", 2.5, "num_hidden_layers"),
    ("qwen3", "num_hidden_layers", True, "num_hidden_layers"),
    ("qwen3", "num_hidden_layers", "2", "num_hidden_layers"),
    ("qwen3", "num_hidden_layers", DELETE, "num_hidden_layers"),
    ("qwen3", "vocab_size", -5, "vocab_size"),
    ("qwen3", "vocab_size", 1 << 40, "vocab_size"),
    ("qwen3", "hidden_size", "big", "hidden_size"),
    ("qwen3", "hidden_size", None, "hidden_size"),
    ("qwen3", "num_attention_heads", 0, "num_attention_heads"),
    ("qwen3", "num_key_value_heads", 3, "num_key_value_heads"),
    ("qwen3", "num_key_value_heads", 1000, "num_key_value_heads"),
    ("qwen3", "head_dim", 7, "head_dim"),
    ("qwen3", "head_dim", -2, "head_dim"),
    ("qwen3", "moe_intermediate_size", "big", "moe_intermediate_size"),
    ("qwen3", "moe_intermediate_size", 1e30, "moe_intermediate_size"),
    ("qwen3", "num_experts", "8", "num_experts"),
    ("qwen3", "num_experts", 1.5, "num_experts"),
    ("qwen3", "num_experts", 1 << 40, "num_experts"),
    ("qwen3", "num_experts_per_tok", 0, "num_experts_per_tok"),
    ("qwen3", "num_experts_per_tok", 10 ** 6, "num_experts_per_tok"),
    ("qwen3", "num_experts_per_tok", DELETE, "num_experts_per_tok"),
    ("qwen3", "norm_topk_prob", "yes", "norm_topk_prob"),
    ("qwen3", "norm_topk_prob", 1, "norm_topk_prob"),
    ("qwen3", "max_position_embeddings", True, "max_position_embeddings"),
    ("qwen3", "max_position_embeddings", "4096", "max_position_embeddings"),
    ("qwen3", "max_position_embeddings", 0, "max_position_embeddings"),
    ("qwen3", "max_position_embeddings", math.inf, "max_position_embeddings"),
    ("qwen3", "rms_norm_eps", 0, "rms_norm_eps"),
    ("qwen3", "rms_norm_eps", -1e-6, "rms_norm_eps"),
    ("qwen3", "rms_norm_eps", "1e-6", "rms_norm_eps"),
    ("qwen3", "rms_norm_eps", math.nan, "rms_norm_eps"),
    ("qwen3", "rope_theta", 0, "rope_theta"),
    ("qwen3", "rope_theta", math.inf, "rope_theta"),
    ("qwen3", "rope_theta", [1e6], "rope_theta"),
    ("qwen3", "rope_scaling", "yarn", "rope_scaling"),
    ("qwen3", "rope_scaling", {"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
    ("qwen3", "rope_scaling", {"rope_type": "linear"}, "factor"),
    ("qwen3", "rope_scaling", {"rope_type": "linear", "factor": 0}, "factor"),
    ("qwen3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "beta_fast": "x"}, "beta_fast"),
    ("qwen3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "truncate": False}, "truncate"),
    ("qwen3", "rope_scaling", {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": True},
     "original_max_position_embeddings"),
    ("qwen3", "rope_parameters", [1], "rope_parameters"),
    ("qwen3", "rope_parameters", {"full": {"rope_theta": 1e4}, "sliding": {"rope_theta": 1e4}}, "per-layer"),
    ("qwen3", "hidden_act", "gelu", "hidden_act"),
    ("qwen3", "hidden_act", 3, "hidden_act"),
    ("qwen3", "attention_bias", "no", "attention_bias"),
    ("qwen3", "tie_word_embeddings", 0, "tie_word_embeddings"),
    ("qwen3", "decoder_sparse_step", 0, "decoder_sparse_step"),
    ("qwen3", "mlp_only_layers", [0, 99], "mlp_only_layers"),
    ("qwen3", "mlp_only_layers", "0", "mlp_only_layers"),
    ("qwen3", "mlp_only_layers", [True], "mlp_only_layers"),
    ("qwen3", "use_sliding_window", True, "use_sliding_window"),
    ("qwen3", "use_sliding_window", "true", "use_sliding_window"),
    ("qwen3", "eos_token_id", -1, "eos_token_id"),
    ("qwen3", "eos_token_id", 10 ** 9, "eos_token_id"),
    ("qwen3", "eos_token_id", "2", "eos_token_id"),
    ("qwen3", "eos_token_id", [1, "2"], "eos_token_id"),
    ("qwen3", "bos_token_id", 1.5, "bos_token_id"),
    ("qwen3", "scoring_func", "relu", "scoring_func"),
    ("mixtral", "sliding_window", 0, "sliding_window"),
    ("mixtral", "sliding_window", "4096", "sliding_window"),
    ("mixtral", "num_local_experts", 0, "num_local_experts"),
    ("mixtral", "num_local_experts", DELETE, "num_local_experts"),
    ("dsv3", "routed_scaling_factor", 0, "routed_scaling_factor"),
    ("dsv3", "routed_scaling_factor", -2.5, "routed_scaling_factor"),
    ("dsv3", "routed_scaling_factor", math.inf, "routed_scaling_factor"),
    ("dsv3", "routed_scaling_factor", "2.5", "routed_scaling_factor"),
    ("dsv3", "kv_lora_rank", DELETE, "kv_lora_rank"),
    ("dsv3", "kv_lora_rank", 0, "kv_lora_rank"),
    ("dsv3", "qk_rope_head_dim", 7, "qk_rope_head_dim"),
    ("dsv3", "q_lora_rank", "16", "q_lora_rank"),
    ("dsv3", "first_k_dense_replace", -1, "first_k_dense_replace"),
    ("dsv3", "first_k_dense_replace", 10 ** 6, "first_k_dense_replace"),
    ("dsv3", "moe_layer_freq", 0, "moe_layer_freq"),
    ("dsv3", "n_group", 3, "n_group"),
    ("dsv3", "topk_group", 100, "topk_group"),
    ("dsv3", "topk_method", 5, "topk_method"),
    ("dsv3", "n_shared_experts", -1, "n_shared_experts"),
    ("dsv3", "rope_interleave", "yes", "rope_interleave"),
    ("dsv3", "num_nextn_predict_layers", -1, "num_nextn_predict_layers"),
    ("dsv3", "intermediate_size", DELETE, "intermediate_size"),
]


@pytest.mark.parametrize("family, field, value, words", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_config_values(family, field, value, words):
    raw = copy.deepcopy(RAW[family])
    before = copy.deepcopy(raw)
    if value is DELETE:
        raw.pop(field, None)
    else:
        raw[field] = value
    mutated = copy.deepcopy(raw)
    with pytest.raises((ConfigError, UnsupportedError)) as e:
        DecoderConfig.from_hf_config(raw)
    assert words in str(e.value) and "config.json" in str(e.value), str(e.value)
    assert raw == mutated and RAW[family] == before              # nothing mutated


def test_the_fixture_configs_parse_once_with_the_moe_facts_composed():
    """The three base configs parse (the hostile cases fail for their mutation alone), and the MoE
    facts ride in the one config."""
    for family, raw in RAW.items():
        c = DecoderConfig.from_hf_config(raw)
        assert c.moe is not None and c.moe.hidden_size == c.hidden_size, family
    dsv3 = DecoderConfig.from_hf_config(RAW["dsv3"])
    assert dsv3.moe.routed_scaling_factor == RAW["dsv3"]["routed_scaling_factor"] and dsv3.moe.grouped


@pytest.mark.parametrize("kw, err, words", [
    (dict(dtype="bogus"), DTypeError, "dtype"),
    (dict(dtype=jnp.int32), DTypeError, "dtype"),
    (dict(param_dtype=jnp.int32), DTypeError, "param_dtype"),
    (dict(param_dtype="complex64"), DTypeError, "param_dtype"),
    (dict(scan_layers="yes"), ConfigError, "scan_layers"),
    (dict(dequantized="no"), ConfigError, "dequantized"),
    (dict(revision="main"), ConfigError, "revision"),
])
def test_load_arguments(kw, err, words):
    before = _tree(QWEN3)
    kept = copy.deepcopy(kw)
    with pytest.raises(err) as e:
        load_model(QWEN3, **kw)
    assert words in str(e.value)
    assert _tree(QWEN3) == before and kw == kept               # nothing written, the arguments unchanged


def _tree(folder):
    """Every file under ``folder`` with its size and modification time."""
    return sorted((os.path.relpath(os.path.join(d, f), folder), os.stat(os.path.join(d, f)).st_size,
                   os.stat(os.path.join(d, f)).st_mtime_ns) for d, _, fs in os.walk(folder) for f in fs)


def test_load_path_arguments(tmp_path):
    for bad in (None, 3, str(tmp_path / "missing"), ""):
        with pytest.raises(WNA16Error):
            load_model(bad)
    with pytest.raises(ConfigError, match="config.json"):
        load_model(str(tmp_path))
    assert os.listdir(tmp_path) == []                          # nothing created where it looked


@pytest.fixture(scope="module")
def qwen3():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_model(QWEN3, dtype=jnp.float32)


def test_eager_forward_token_ids(qwen3):
    v = qwen3.config.vocab_size
    for bad, err in (([[v]], ValueRangeError), ([[-1]], ValueRangeError), ([[1.0, 2.0]], DTypeError),
                     ([1, 2, 3], ShapeError), ([[1, 2], [3]], ShapeError), (np.zeros((1, 2, 2), np.int32), ShapeError),
                     ([[True]], DTypeError), (jnp.asarray([[v + 3]]), ValueRangeError)):
        with pytest.raises(err) as e:
            qwen3(bad)
        assert "tokens" in str(e.value)
    with pytest.raises(ShapeError, match="positions"):
        qwen3([[1, 2]], positions=[[0]])
    with pytest.raises(ValueRangeError, match="positions"):
        qwen3([[1, 2]], positions=[[0, -1]])
    logits = np.asarray(qwen3([[1, v - 1]]))
    assert logits.shape == (1, 2, v) and np.isfinite(logits).all()
    # under jit the ids are traced: not checked, and the program still compiles and runs
    assert np.isfinite(np.asarray(jax.jit(lambda t: qwen3(t))(jnp.asarray([[1, 2]])))).all()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _edit_config(folder, **kw):
    p = os.path.join(folder, "config.json")
    with open(p) as f:
        raw = json.load(f)
    raw.update(kw)
    with open(p, "w") as f:
        json.dump(raw, f)


def test_fewer_layers_in_the_config_than_the_tensors_warns(tmp_path):
    """Layers past num_hidden_layers are not loaded, with a warning naming them (the MoE layers
    the config keeps must still be where it puts them)."""
    folder = _copy(MIXTRAL, tmp_path / "m")
    _edit_config(folder, num_hidden_layers=1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = load_model(folder, dtype=jnp.float32)
    assert m.config.num_layers == 1
    assert any("past num_hidden_layers=1" in str(x.message) and "[1]" in str(x.message) for x in w), \
        [str(x.message) for x in w]


def test_tied_embeddings_with_a_stored_lm_head_warn(tmp_path):
    """tie_word_embeddings=true with an lm_head present: lm_head is the embedding matrix, as
    transformers ties them, and the warning says the stored one is not read."""
    folder = _copy(MIXTRAL, tmp_path / "m")
    _edit_config(folder, tie_word_embeddings=True)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        m = load_model(folder, dtype=jnp.float32)
    assert m.lm_head is None
    assert any("tie_word_embeddings" in str(x.message) and "not read" in str(x.message) for x in w)
    want = np.asarray(m.embed_tokens[...], np.float64)
    h = np.random.default_rng().standard_normal((3, m.config.hidden_size)).astype(np.float32)
    got = np.asarray(m.logits(jnp.asarray(h)), np.float64)
    assert np.abs(got - h.astype(np.float64) @ want.T).max() <= 1e-4 * np.abs(got).max()


def test_moe_layer_without_the_config_s_moe_facts_is_refused(tmp_path):
    folder = _copy(QWEN3, tmp_path / "m")
    _edit_config(folder, num_experts=0)
    with pytest.raises(ConfigError, match="no routed experts"):
        load_model(folder)


def test_missing_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = _copy(QWEN3, tmp_path / "m")
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    for fname in files:
        t = load_file(os.path.join(folder, fname))
        if "model.norm.weight" in t:
            del t["model.norm.weight"]
            save_file(t, os.path.join(folder, fname))
            idx = os.path.join(folder, "model.safetensors.index.json")
            if os.path.isfile(idx):
                with open(idx) as f:
                    j = json.load(f)
                j["weight_map"].pop("model.norm.weight")
                with open(idx, "w") as f:
                    json.dump(j, f)
    with pytest.raises(MissingTensorError, match="model.norm.weight"):
        load_model(folder)
