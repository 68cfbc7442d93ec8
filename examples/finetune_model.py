"""Fine-tune a whole quantized MoE model: RMS norms, routers and a LoRA adapter, with optax.

The model is a tiny GPTQ int4 Qwen3-MoE written by GPTQModel (``tests/fixtures/quantizers``):
every attention projection and expert stays packed and frozen; the optimizer updates only the
norms, the routers and low-rank adapters added to the query and value projections. Prints the
loss falling, and checks that every quantized array is bit-identical after training.

Run: ``python3 examples/finetune_model.py`` (seconds on a CPU).
"""

from __future__ import annotations

import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from wna16_jax.models import QuantizedWeight, load_model  # noqa: E402
from wna16_jax.nn import QuantizedExperts  # noqa: E402
from flax import nnx  # noqa: E402 - after wna16_jax, which lets Flax import on JAX 0.11

CHECKPOINT = os.path.join(ROOT, "tests", "fixtures", "quantizers", "gptq-asym-qwen3moe")


class LoRA(nnx.Module):
    """``base(x) + scale · (x A) B``: ``A [K, r]`` random, ``B [r, N]`` zero (training starts at
    the base model)."""

    def __init__(self, base, rank: int, *, scale: float = 1.0, rngs: nnx.Rngs):
        self.base = base
        self.scale = scale
        self.lora_a = nnx.Param(jax.random.normal(rngs.params(), (base.in_features, rank)) / np.sqrt(base.in_features))
        self.lora_b = nnx.Param(jnp.zeros((rank, base.out_features)))

    def __call__(self, x):
        y = self.base(x)
        return y + (self.scale * (x.astype(jnp.float32) @ self.lora_a[...] @ self.lora_b[...])).astype(y.dtype)


def trainable(path, value) -> bool:
    """Norm weights, routers and the adapters (nothing else, and never the quantized weights)."""
    names = [str(p) for p in path]
    return isinstance(value, nnx.Param) and any(
        "norm" in n or n == "router" or n.startswith("lora_") for n in names)


def frozen_arrays(model) -> list[np.ndarray]:
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Any(QuantizedWeight, QuantizedExperts)))
            if hasattr(a, "dtype")]


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def main(steps: int = 8, seed: int = 0, learning_rate: float = 2e-2) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # unrolled layers (scan_layers=False): the adapters below are set on each layer's module
        model = load_model(CHECKPOINT, dtype=jnp.float32, param_dtype=jnp.float32, scan_layers=False)
    rngs = nnx.Rngs(seed)
    for layer in model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj, 4, rngs=rngs)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj, 4, rngs=rngs)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(3, model.config.vocab_size, (4, 17)), jnp.int32)
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=trainable)

    @nnx.jit
    def train_step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, trainable))(model, tokens)
        optimizer.update(model, grads)
        return loss

    before = frozen_arrays(model)
    fixed_before = [np.asarray(model.embed_tokens[...]), np.asarray(model.lm_head.weight[...])]
    losses = [float(train_step(model, optimizer, tokens)) for _ in range(steps)]
    losses.append(float(nnx.jit(loss_fn)(model, tokens)))
    after = frozen_arrays(model)
    identical = len(before) == len(after) > 0 and all(
        a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)) for a, b in zip(before, after))
    untouched = all(np.array_equal(a, b) for a, b in zip(
        fixed_before, [np.asarray(model.embed_tokens[...]), np.asarray(model.lm_head.weight[...])]))
    n_trainable = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(nnx.state(model, trainable)))
    print(f"fine-tuned {n_trainable} parameters (norms, routers, LoRA on q/v) of {model.config.family}: "
          f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; {len(before)} quantized arrays bit-identical: {identical}; "
          f"embeddings and lm_head untouched: {untouched}")
    return {"losses": losses, "frozen_bit_identical": identical, "num_frozen_arrays": len(before),
            "untouched": untouched, "num_trainable": n_trainable}


if __name__ == "__main__":
    r = main()
    sys.exit(0 if r["frozen_bit_identical"] and r["untouched"] and r["losses"][-1] < r["losses"][0] else 1)
