"""A tiny attention-free MoE language model on frozen quantized experts (shared by the examples).

``embedding → n × [RMSNorm → QuantizedMoE → residual] → RMSNorm → head``. Embedding, norms,
head and the routers are ``nnx.Param`` (trainable); the experts are ``QuantizedExperts``
buffers that ``nnx.Optimizer(..., wrt=nnx.Param)`` never touches.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from wna16_jax.checkpoint import Checkpoint
from wna16_jax.nn import QuantizedMoE
from flax import nnx  # after wna16_jax, which lets Flax import on JAX 0.11


class MoEBlock(nnx.Module):
    def __init__(self, moe: QuantizedMoE, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(moe.hidden_size, rngs=rngs)
        self.moe = moe

    def __call__(self, x):
        return x + self.moe(self.norm(x))


class TinyMoELM(nnx.Module):
    def __init__(self, checkpoint_dir, vocab_size: int, *, backend=None, rngs: nnx.Rngs):
        ckpt = Checkpoint(checkpoint_dir)
        h = ckpt.model_config.hidden_size
        self.embed = nnx.Embed(vocab_size, h, rngs=rngs)
        self.blocks = nnx.List([MoEBlock(QuantizedMoE.from_checkpoint(ckpt, i, backend), rngs=rngs)
                                for i in ckpt.moe_layer_indices])
        self.final_norm = nnx.RMSNorm(h, rngs=rngs)
        self.head = nnx.Linear(h, vocab_size, rngs=rngs)

    def __call__(self, tokens):                      # [B, S] int → [B, S, V] logits
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_norm(x))


def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)   # grads of nnx.Param only
    optimizer.update(model, grads)
    return loss


def frozen_buffers(model) -> list[np.ndarray]:
    """Host copies of every non-Param leaf (the quantized experts and routing buffers)."""
    return [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))
            if hasattr(a, "dtype") and a.dtype != jax.dtypes.float0]


def train(model, tokens, *, steps: int, learning_rate: float = 3e-2) -> dict:
    optimizer = nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)
    before = frozen_buffers(model)
    logits = nnx.jit(lambda m, t: m(t))(model, tokens)
    assert bool(jnp.all(jnp.isfinite(logits))), "forward produced non-finite logits"
    losses = [float(train_step(model, optimizer, tokens)) for _ in range(steps)]
    losses.append(float(nnx.jit(loss_fn)(model, tokens)))
    after = frozen_buffers(model)
    identical = len(before) == len(after) > 0 and all(
        a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))
        for a, b in zip(before, after))
    return {"losses": losses, "logits_shape": tuple(logits.shape), "frozen_bit_identical": identical,
            "num_frozen_arrays": len(before)}


def build_and_train(name: str, path: str, vocab: int, rng: np.random.Generator, *, steps: int, seed: int):
    """Build :class:`TinyMoELM` from the checkpoint at ``path``, train it and print a summary."""
    model = TinyMoELM(path, vocab, rngs=nnx.Rngs(seed))
    tokens = rng.integers(0, vocab, (4, 17), dtype=np.int32)
    result = train(model, tokens, steps=steps)
    print(f"{name}: backend {model.blocks[0].moe.backend}, logits {result['logits_shape']}, "
          f"loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}, "
          f"{result['num_frozen_arrays']} frozen arrays bit-identical: {result['frozen_bit_identical']}")
    return model, result


def exit_code(result: dict) -> int:
    return 0 if result["frozen_bit_identical"] and result["losses"][-1] < result["losses"][0] else 1
