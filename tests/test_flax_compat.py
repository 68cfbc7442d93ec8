"""Flax imports and runs where JAX's hijax lacks the names Flax defines its primitives from."""

import subprocess
import sys
import textwrap

import jax.experimental.hijax as hijax

from wna16_jax import _flax_compat


def test_stand_ins_only_for_missing_names():
    """Names this JAX has are left as JAX defines them; only missing ones get a stand-in."""
    for name in _flax_compat.NAMES:
        obj = getattr(hijax, name)
        assert (obj.__module__ == _flax_compat.__name__) == (name in _flax_compat.ADDED), name


def test_flax_runs_a_model_when_jax_lacks_the_names():
    """A fresh interpreter with the four names removed from hijax (as in JAX 0.11): importing
    wna16_jax's model code first lets Flax import, and a jitted NNX forward and gradient through
    a loaded quantized model run and are finite."""
    code = textwrap.dedent("""
        import jax.experimental.hijax as h
        for n in ("HiPrimitive", "AvalQDD", "AvalMutableQDD", "MutableHiType"):
            if hasattr(h, n):
                delattr(h, n)
        try:
            import flax.nnx
            raise SystemExit("flax imported without the names: this test would not test anything")
        except (AttributeError, ImportError, TypeError):
            pass
        import sys
        for m in [m for m in sys.modules if m == "flax" or m.startswith("flax.")]:
            del sys.modules[m]
        import tempfile
        import jax, jax.numpy as jnp, numpy as np
        from wna16_jax.models import load_model, write_random_model
        from wna16_jax.models.synthetic import RandomModelSpec
        from wna16_jax.schemes import QuantScheme
        from flax import nnx
        d = tempfile.mkdtemp()
        path = write_random_model(d + "/m", RandomModelSpec(
            model_type="qwen3_moe", scheme=QuantScheme("gptq", 4, 128, False), vocab_size=128, hidden_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=4, top_k=2,
            moe_intermediate_size=128), seed=3)
        model = load_model(path)
        tokens = jnp.asarray(np.random.default_rng().integers(0, 128, (2, 5)))

        @nnx.jit
        def loss(model, tokens):
            return jnp.mean(model(tokens) ** 2)

        val, grads = nnx.jit(nnx.value_and_grad(lambda m, t: jnp.mean(m(t) ** 2)))(model, tokens)
        leaves = jax.tree.leaves(grads)
        assert np.isfinite(float(loss(model, tokens))) and np.isfinite(float(val))
        assert leaves and all(np.isfinite(np.asarray(x)).all() for x in leaves)
        print("OK", len(leaves))
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout + res.stderr
