"""Shared pytest configuration: hypothesis profiles (the CI profile runs the full example counts)."""

import os

from hypothesis import HealthCheck, settings

import wna16_jax._flax_compat  # noqa: F401 - lets the test modules import Flax on JAX 0.11

settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
