"""The examples run end to end: forward pass, optax steps that lower the loss, and quantized
expert buffers bit-identical after training."""

import importlib.util
import math
import os

import pytest

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["tiny_mixtral", "tiny_deepseek"])
def test_example_trains_and_keeps_experts_frozen(name, tmp_path):
    result = _load(name).main(steps=4, seed=int.from_bytes(os.urandom(4), "little"), workdir=str(tmp_path))
    losses = result["losses"]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.9 * losses[0], losses
    assert result["logits_shape"] == (4, 17, 64)
    # two MoE layers, each with at least codes and scales for w13 and w2 (zero points, g_idx and
    # the rest depend on the layout the device's backend converts to: 8 arrays on a Hopper GPU)
    assert result["num_frozen_arrays"] >= 8
    assert result["frozen_bit_identical"]


def test_finetune_model_example():
    """examples/finetune_model.py: a whole quantized model (a GPTQModel fixture) fine-tuned on
    norms, routers and LoRA adapters: the loss falls, the quantized arrays stay bit-identical,
    the embeddings and lm_head (not trainable there) do not move."""
    result = _load("finetune_model").main(steps=6)
    losses = result["losses"]
    assert all(math.isfinite(v) for v in losses), losses
    assert losses[-1] < 0.8 * losses[0], losses
    assert result["frozen_bit_identical"] and result["num_frozen_arrays"] >= 30
    assert result["untouched"] and result["num_trainable"] == 7040
