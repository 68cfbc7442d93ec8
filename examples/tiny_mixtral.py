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

from flax import nnx  # noqa: E402

from tiny_moe_model import TinyMoELM, train  # noqa: E402
from wna16_jax.checkpoint import random_moe_layer, write_checkpoint  # noqa: E402
from wna16_jax.schemes import QuantScheme  # noqa: E402

VOCAB, E, H, I, LAYERS = 64, 8, 64, 128, 2


def main(steps: int = 8, seed: int = 0, workdir: str | None = None) -> dict:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(os.path.join(workdir or tmp, "tiny-mixtral-gptq"), QuantScheme("gptq", 4, 32, False),
                                [random_moe_layer(rng, E, H, I) for _ in range(LAYERS)],
                                model_type="mixtral", top_k=2)
        model = TinyMoELM(path, VOCAB, rngs=nnx.Rngs(seed))
    tokens = rng.integers(0, VOCAB, (4, 17), dtype=np.int32)
    result = train(model, tokens, steps=steps)
    print(f"tiny mixtral: backend {model.blocks[0].moe.backend}, logits {result['logits_shape']}, "
          f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, "
          f"{result['num_frozen_arrays']} frozen arrays bit-identical: {result['frozen_bit_identical']}")
    return result


if __name__ == "__main__":
    r = main()
    sys.exit(0 if r["frozen_bit_identical"] and r["losses"][-1] < r["losses"][0] else 1)
