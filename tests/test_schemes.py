"""QuantScheme parsing: fixtures modelled on the quantization_config blocks of public MoE
checkpoints (written here by hand), round trips, and the error cases."""

import pytest

from wna16_jax.errors import ConfigError, WNA16Error
from wna16_jax.schemes import QuantMethod, QuantScheme

# Modelled on Qwen/Qwen3-30B-A3B-GPTQ-Int4 (GPTQModel export).
QWEN3_GPTQ_INT4 = {
    "bits": 4,
    "checkpoint_format": "gptq",
    "damp_percent": 0.01,
    "desc_act": False,
    "group_size": 128,
    "lm_head": False,
    "meta": {"damp_auto_increment": 0.0025, "quantizer": ["gptqmodel:2.2.0"], "static_groups": False,
             "true_sequential": True},
    "pack_dtype": "int32",
    "quant_method": "gptq",
    "static_groups": False,
    "sym": True,
    "true_sequential": True,
}

# Modelled on a Mixtral-8x7B AutoAWQ INT4 export (hugging-quants style).
MIXTRAL_AWQ = {
    "bits": 4,
    "group_size": 128,
    "modules_to_not_convert": ["gate"],
    "quant_method": "awq",
    "version": "gemm",
    "zero_point": True,
}

# Modelled on an llm-compressor W4A16 MoE export (e.g. a Qwen3-30B-A3B quantized.w4a16).
CT_W4A16_MOE = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": "weight",
                "block_structure": None,
                "dynamic": False,
                "group_size": 128,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "global_compression_ratio": None,
    "ignore": ["lm_head", "re:.*mlp.gate$"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
    "sparsity_config": {},
}

# DeepSeek-style GPTQ with act-order (desc_act) and 8-bit channelwise variants.
GPTQ_DESC_ACT = dict(QWEN3_GPTQ_INT4, desc_act=True, group_size=64)
GPTQ_8BIT_CHANNEL = dict(QWEN3_GPTQ_INT4, bits=8, group_size=-1)


def test_qwen3_gptq():
    s = QuantScheme.from_hf_config({"model_type": "qwen3_moe", "quantization_config": QWEN3_GPTQ_INT4})
    assert (s.method, s.bits, s.group_size, s.zero_point, s.act_order) == (QuantMethod.GPTQ, 4, 128, False, False)
    assert s.weight_type == "uint4b8" and s.weight_key == "kInt4Static" and s.pack_factor == 8
    assert s.gptq_zeros_minus_one and s.true_sequential and not s.static_groups
    assert s.num_groups(2048) == 16


def test_mixtral_awq():
    s = QuantScheme.from_quant_config(MIXTRAL_AWQ)
    assert (s.method, s.bits, s.group_size, s.zero_point) == (QuantMethod.AWQ, 4, 128, True)
    assert s.weight_type == "uint4" and s.weight_key == "kInt4Static"  # quirk Q2
    assert s.ignore == ("gate",)


def test_ct_w4a16_moe():
    s = QuantScheme.from_quant_config(CT_W4A16_MOE)
    assert (s.method, s.bits, s.group_size, s.zero_point, s.act_order) == (
        QuantMethod.COMPRESSED_TENSORS, 4, 128, False, False)
    assert s.ct_actorder == "weight" and s.ct_strategy == "group"  # "weight" is format-identical
    assert s.ignore == ("lm_head", "re:.*mlp.gate$")
    assert s.weight_key == "kInt4Static"


def test_variants():
    s = QuantScheme.from_quant_config(GPTQ_DESC_ACT)
    assert s.act_order and s.desc_act and s.group_size == 64
    s = QuantScheme.from_quant_config(GPTQ_8BIT_CHANNEL)
    assert (s.bits, s.group_size, s.weight_type, s.weight_key, s.num_groups(4096)) == (
        8, -1, "uint8b128", "kInt8Static", 1)
    # desc_act with channelwise groups has no effect on the layout
    assert not QuantScheme.from_quant_config(dict(GPTQ_8BIT_CHANNEL, desc_act=True)).act_order
    ct = {**CT_W4A16_MOE, "config_groups": {"g": {**CT_W4A16_MOE["config_groups"]["group_0"],
                                                  "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                              "strategy": "group", "group_size": 32,
                                                              "actorder": "group"}}}}
    s = QuantScheme.from_quant_config(ct)
    assert s.zero_point and s.act_order and s.weight_key == "kInt4Static32Asym" and s.weight_type == "uint4"
    ch = {**CT_W4A16_MOE, "config_groups": {"g": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}}}}
    s = QuantScheme.from_quant_config(ch)
    assert (s.bits, s.group_size, s.ct_strategy) == (8, -1, "channel")
    # older compressed-tensors files call the block "compression_config"
    assert QuantScheme.from_hf_config({"compression_config": CT_W4A16_MOE}).method is QuantMethod.COMPRESSED_TENSORS
    v2 = QuantScheme.from_quant_config(dict(QWEN3_GPTQ_INT4, checkpoint_format="gptq_v2", sym=False))
    assert v2.zero_point and not v2.gptq_zeros_minus_one


@pytest.mark.parametrize("qc", [QWEN3_GPTQ_INT4, MIXTRAL_AWQ, CT_W4A16_MOE, GPTQ_DESC_ACT, GPTQ_8BIT_CHANNEL])
def test_round_trip(qc):
    s = QuantScheme.from_quant_config(qc)
    assert QuantScheme.from_quant_config(s.to_quant_config()) == s
    with pytest.raises(Exception):
        s.bits = 8  # frozen


def test_from_pretrained(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": MIXTRAL_AWQ}))
    assert QuantScheme.from_pretrained(tmp_path).method is QuantMethod.AWQ
    with pytest.raises(ConfigError, match="config.json"):
        QuantScheme.from_pretrained(tmp_path / "missing")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        QuantScheme.from_pretrained(tmp_path)


@pytest.mark.parametrize("qc, field, value", [
    ({"quant_method": "bitsandbytes"}, "quant_method", "bitsandbytes"),
    (dict(QWEN3_GPTQ_INT4, bits=3), "bits", "3"),
    (dict(QWEN3_GPTQ_INT4, bits=2), "bits", "2"),
    (dict(MIXTRAL_AWQ, bits=8), "bits", "8"),
    (dict(MIXTRAL_AWQ, group_size=-1), "group_size", "-1"),
    (dict(MIXTRAL_AWQ, version="gemv"), "version", "gemv"),
    (dict(QWEN3_GPTQ_INT4, group_size=100), "group_size", "100"),
    (dict(QWEN3_GPTQ_INT4, group_size=True), "group_size", "True"),
    (dict(QWEN3_GPTQ_INT4, sym="yes"), "sym", "yes"),
    (dict(QWEN3_GPTQ_INT4, checkpoint_format="marlin"), "checkpoint_format", "marlin"),
    ({k: v for k, v in QWEN3_GPTQ_INT4.items() if k != "bits"}, "bits", "missing"),
    (dict(CT_W4A16_MOE, format="float-quantized"), "format", "float-quantized"),
    (dict(CT_W4A16_MOE, config_groups={}), "config_groups", "{}"),
])
def test_bad_configs(qc, field, value):
    with pytest.raises(ConfigError) as ei:
        QuantScheme.from_quant_config(qc)
    msg = str(ei.value)
    assert field in msg and value in msg
    assert isinstance(ei.value, WNA16Error) and isinstance(ei.value, ValueError)


def _ct_weights(**w):
    base = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
    base.update(w)
    return {**CT_W4A16_MOE, "config_groups": {"group_0": {"targets": ["Linear"], "weights": base}}}


@pytest.mark.parametrize("qc, field, value", [
    (_ct_weights(type="float"), "type", "float"),
    (_ct_weights(num_bits=2), "num_bits", "2"),
    (_ct_weights(strategy="tensor"), "strategy", "tensor"),
    (_ct_weights(actorder="dynamic"), "actorder", "dynamic"),
    ({**CT_W4A16_MOE, "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"},
                                              "input_activations": {"num_bits": 8}}}}, "input_activations", "8"),
    ({**CT_W4A16_MOE, "config_groups": {
        "a": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}},
        "b": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "config_groups", "different"),
])
def test_bad_ct_configs(qc, field, value):
    with pytest.raises(ConfigError) as ei:
        QuantScheme.from_quant_config(qc)
    assert field in str(ei.value) and value in str(ei.value)


def test_not_quantized():
    with pytest.raises(ConfigError, match="quantization_config"):
        QuantScheme.from_hf_config({"model_type": "mixtral"})
    with pytest.raises(ConfigError, match="bits"):
        QuantScheme("gptq", 5, 128, False)
