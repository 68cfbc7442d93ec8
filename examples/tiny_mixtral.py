"""Tiny Mixtral-style model on a GPTQ int4 checkpoint: forward pass + a few optax steps.

Run: ``python3 examples/tiny_mixtral.py`` (seconds on a CPU).
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

VOCAB, E, H, I, LAYERS = 64, 8, 64, 128, 2


def main(steps: int = 8, seed: int = 0, workdir: str | None = None) -> dict:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(os.path.join(workdir or tmp, "tiny-mixtral-gptq"), QuantScheme("gptq", 4, 32, False),
                                [random_moe_layer(rng, E, H, I) for _ in range(LAYERS)],
                                model_type="mixtral", top_k=2)
        _, result = build_and_train("tiny mixtral", path, VOCAB, rng, steps=steps, seed=seed)
    return result


if __name__ == "__main__":
    sys.exit(exit_code(main()))
