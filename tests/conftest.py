import os

os.environ.setdefault("JAX_PLATFORMS", "cpu") if not os.environ.get("WNA16_TEST_GPU") else None

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
