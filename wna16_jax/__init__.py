"""wna16-jax: int4/int8-weight mixture-of-experts checkpoints (AWQ, GPTQ, compressed-tensors) in JAX."""

__version__ = "0.1.0"
