"""Tiny DeepSeek-V3-style model on an AWQ int4 checkpoint: shared experts, sigmoid grouped
top-k routing with score-correction bias and routed scaling; forward pass + a few optax steps.

Run: ``python3 examples/tiny_deepseek.py`` (seconds on a CPU).
"""

from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiny_moe_model import build_and_train, exit_code  # noqa: E402
from wna16_jax.writers import random_moe_layer, write_checkpoint  # noqa: E402
from wna16_jax.schemes import QuantScheme  # noqa: E402

VOCAB, E, H, I, SHARED_I, LAYERS = 64, 8, 64, 64, 128, 2


def main(steps: int = 8, seed: int = 0, workdir: str | None = None) -> dict:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        layers = [random_moe_layer(rng, E, H, I, shared_intermediate=SHARED_I, score_bias=True)
                  for _ in range(LAYERS)]
        path = write_checkpoint(os.path.join(workdir or tmp, "tiny-deepseek-awq"), QuantScheme("awq", 4, 32, True),
                                layers, model_type="deepseek_v3", top_k=2, scoring_func="sigmoid",
                                num_expert_group=4, topk_group=2, routed_scaling_factor=2.5)
        model, result = build_and_train("tiny deepseek", path, VOCAB, rng, steps=steps, seed=seed)
    moe = model.blocks[0].moe
    assert moe.shared_experts is not None and moe.routing.num_expert_group == 4
    return result


if __name__ == "__main__":
    sys.exit(exit_code(main()))
