"""Shared pytest configuration: hypothesis profiles (the CI profile runs the full example counts);
on a machine without an NVIDIA GPU, XLA's CPU backend compiles without LLVM optimization; under
pytest-xdist, workers do not preallocate GPU memory."""

import os
import shutil

# The CPU suite's time is mostly compiling small programs, which LLVM's optimization passes
# slow down; the semantics are the same without them (no fast-math either way). Set before
# any backend starts; subprocess tests pass the variable on. Not on a GPU machine, whose tests
# compile the kernels as users get them.
_FLAGS = os.environ.get("XLA_FLAGS", "")
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in _FLAGS:
    os.environ["XLA_FLAGS"] = (_FLAGS + " --xla_backend_optimization_level=0").strip()

# Each xdist worker is its own process: with JAX's default preallocation (75% of the GPU) the
# second worker on a GPU has no memory left. An explicit setting is kept.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

from hypothesis import HealthCheck, settings

import wna16_jax._flax_compat  # noqa: F401 - lets the test modules import Flax on JAX 0.11

settings.register_profile(
    "ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
