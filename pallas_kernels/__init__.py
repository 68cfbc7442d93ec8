"""Pallas GPU kernels for wna16-jax (each with a plain-jnp reference beside it)."""
