"""RandomModelSpec (every field checked, naming it) and write_random_model (a folder the
checkpoint reader takes, the same bytes for the same seed)."""

import hashlib
import json
import os

import numpy as np
import pytest

from wna16_jax.checkpoint import Checkpoint
from wna16_jax.errors import ConfigError
from wna16_jax.models.synthetic import MLA_FIELDS, RandomModelSpec, write_random_model
from wna16_jax.schemes import QuantScheme

GPTQ = QuantScheme("gptq", 4, 32, True)
BASE = dict(model_type="qwen2_moe", scheme=GPTQ, vocab_size=32, hidden_size=64, num_layers=2, num_heads=2,
            num_kv_heads=1, head_dim=32, num_experts=4, top_k=2, moe_intermediate_size=32)
MLA = dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)

BAD = [
    (dict(model_type="llama"), ["model_type", "qwen3_moe", "'llama'"]),
    (dict(scheme={"bits": 4}), ["scheme", "QuantScheme", "dict"]),
    (dict(vocab_size=0), ["vocab_size", ">= 1", "0"]),
    (dict(hidden_size=64.5), ["hidden_size", "64.5"]),
    (dict(num_layers=True), ["num_layers", "True"]),
    (dict(num_heads="2"), ["num_heads", "'2'"]),
    (dict(top_k=5), ["top_k", "<= 4", "5"]),
    (dict(decoder_sparse_step=0), ["decoder_sparse_step", ">= 1", "0"]),
    (dict(mlp_only_layers=[1]), ["intermediate_size", "required", "dense"]),
    (dict(mlp_only_layers=[2], intermediate_size=64), ["mlp_only_layers[0]", "<= 1", "2"]),
    (dict(mlp_only_layers="01"), ["mlp_only_layers", "sequence", "'01'"]),
    (dict(intermediate_size=0), ["intermediate_size", ">= 1", "0"]),
    (dict(shared_expert_intermediate_size=-1), ["shared_expert_intermediate_size", "-1"]),
    (dict(sliding_window=0), ["sliding_window", "0"]),
    (dict(max_position_embeddings=2.5), ["max_position_embeddings", "2.5"]),
    (dict(rope_theta=0.0), ["rope_theta", "> 0", "0.0"]),
    (dict(rope_theta=float("nan")), ["rope_theta", "finite", "nan"]),
    (dict(tie_word_embeddings=1), ["tie_word_embeddings", "true or false", "1"]),
    (dict(quantize_lm_head="yes"), ["quantize_lm_head", "'yes'"]),
    (dict(quantize_attention=1), ["quantize_attention", "1"]),
    (dict(norm_topk_prob=0), ["norm_topk_prob", "0"]),
    (dict(extra_config=[("a", 1)]), ["extra_config", "mapping", "list"]),
    (dict(routing="noaux_tc"), ["routing", "mapping", "'noaux_tc'"]),
    (dict(first_k_dense_replace=3), ["first_k_dense_replace", "<= 2", "3"]),
    (dict(n_shared_experts=-1), ["n_shared_experts", ">= 0", "-1"]),
    (dict(model_type="deepseek_v2"), ["mla", "deepseek_v2", "None"]),
    (dict(model_type="deepseek_v2", mla={**MLA, "v_head_dim": None}), ["mla", "v_head_dim", "None"]),
    (dict(model_type="deepseek_v2", mla={k: MLA[k] for k in MLA_FIELDS[1:]}), ["mla", "q_lora_rank"]),
]


@pytest.mark.parametrize("kw, fragments", BAD, ids=[str(c[0]) for c in BAD])
def test_spec_refuses_bad_fields(kw, fragments):
    with pytest.raises(ConfigError) as info:
        RandomModelSpec(**{**BASE, **kw})
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))


def test_spec_normalises_and_replaces():
    spec = RandomModelSpec(**{**BASE, "num_layers": np.int64(3), "mlp_only_layers": [np.int32(1)],
                              "intermediate_size": 64})
    assert type(spec.num_layers) is int and spec.mlp_only_layers == (1,) and type(spec.mlp_only_layers[0]) is int
    assert spec.sparse_layers() == [True, False, True]
    more = spec.replace(num_layers=4, decoder_sparse_step=2)
    assert (more.num_layers, more.sparse_layers(), spec.num_layers) == (4, [False, False, False, True], 3)
    with pytest.raises(ConfigError, match=r"replace: \['num_layer'\] are not fields"):
        spec.replace(num_layer=4)
    with pytest.raises(ConfigError, match="top_k"):
        spec.replace(top_k=0)
    ds = RandomModelSpec(**{**BASE, "model_type": "deepseek_v3", "mla": MLA, "first_k_dense_replace": 1,
                            "intermediate_size": 64})
    assert ds.sparse_layers() == [False, True] and ds.mla is MLA


def _digest(path):
    return {f: hashlib.sha256(open(os.path.join(path, f), "rb").read()).hexdigest() for f in sorted(os.listdir(path))}


def test_writer_writes_a_readable_folder_reproducibly(tmp_path):
    spec = RandomModelSpec(**{**BASE, "shared_expert_intermediate_size": 32, "mlp_only_layers": [1],
                              "intermediate_size": 48, "extra_config": {"rms_norm_eps": 1e-5}})
    seed = int(np.random.SeedSequence().entropy % 2**31)
    a = write_random_model(tmp_path / "a", spec, seed=seed)
    b = write_random_model(str(tmp_path / "b"), spec, seed=seed)
    c = write_random_model(tmp_path / "c", spec, seed=seed + 1)
    assert a == os.fspath(tmp_path / "a") and _digest(a) == _digest(b)
    shards = [f for f in _digest(a) if f.endswith(".safetensors")]
    assert len(shards) == 3 and all(_digest(a)[f] != _digest(c)[f] for f in shards)
    with open(os.path.join(a, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["num_hidden_layers"], cfg["mlp_only_layers"], cfg["rms_norm_eps"], cfg["num_experts"]) == (2, [1], 1e-5, 4)
    ckpt = Checkpoint(a)
    assert ckpt.moe_layer_indices == [0] and ckpt.scheme == GPTQ
    layer = ckpt.load_layer(0)
    assert layer.experts.num_experts == 4 and layer.shared_experts is not None


def test_writer_checks_its_arguments(tmp_path):
    spec = RandomModelSpec(**BASE)
    with pytest.raises(ConfigError, match="spec: expected a RandomModelSpec, got dict"):
        write_random_model(tmp_path / "x", dict(BASE))
    with pytest.raises(ConfigError, match="seed must be an integer >= 0, got -1"):
        write_random_model(tmp_path / "x", spec, seed=-1)
    with pytest.raises(ConfigError, match="progress must be true or false, got 'yes'"):
        write_random_model(tmp_path / "x", spec, progress="yes")
    assert not os.path.exists(tmp_path / "x")
