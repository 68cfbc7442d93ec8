"""A ``QuantizedMoE`` placed on a mesh through NNX's own sharding workflow gives the
single-device result: its frozen expert arrays carry partition metadata (``"experts"`` on the
expert axis, ``"intermediate"`` where the layout says which axis spans the intermediate size),
``nnx.get_partition_spec`` turns them into specs, and logical-axis rules map them onto an
8-device mesh (expert parallel) and a 4 × 2 mesh (experts × intermediate).

Runs in a subprocess with 8 fake CPU devices (this pytest process already initialised jax with
one); the subprocess prints one JSON object."""

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent(r'''
    import json
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    assert len(jax.devices()) == 8, jax.devices()
    from wna16_jax.writers import random_checkpoint_weights
    from wna16_jax.convert.tiles import convert_tiles
    from wna16_jax.nn import QuantizedExperts, QuantizedMoE
    from wna16_jax.routing import MoERouting
    from wna16_jax.schemes import QuantScheme

    seed = int(np.random.SeedSequence().entropy % 2**63)
    rng = np.random.default_rng(seed)
    E, H, I, T = 8, 128, 128, 24
    res = {"seed": seed, "specs": {}, "err": {}, "placed": {}}
    layouts = {
        "gptq": random_checkpoint_weights(rng, QuantScheme("gptq", 4, 32, False), E, H, I),
        "ct": random_checkpoint_weights(rng, QuantScheme("compressed-tensors", 4, 32, True), E, H, I),
    }
    layouts["tiles"] = convert_tiles(layouts["gptq"].to_jax()).to_numpy()
    # (each run compiles the layer once; the compressed-tensors layout's specs are checked only)
    RUNS = {"gptq": ("ep8", "ep4xtp2"), "ct": (), "tiles": ("ep4xtp2",)}
    router = (0.5 * rng.standard_normal((E, H))).astype(np.float32)
    # feature 0 of every token is positive and only expert 3's router row weighs it (strongly
    # negative): no token is routed to expert 3 (every placement must cope with empty experts)
    router[:, 0] = 0.0
    router[3, 0] = -50.0
    xh = rng.standard_normal((T, H))
    xh[:, 0] = 1.0 + np.abs(xh[:, 0])
    x = jnp.asarray(xh, jnp.float32)
    devs = np.array(jax.devices())

    def err(y, ref):
        y = np.asarray(y, np.float64); ref = np.asarray(ref, np.float64)
        if not np.all(np.isfinite(y)):
            return float("inf")
        return float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))

    for name, w in layouts.items():
        m = QuantizedMoE(w, router, MoERouting(top_k=2), backend="loader")
        _, ids = m.route(x)
        res.setdefault("empty_expert_3", bool(not np.any(np.asarray(ids) == 3)))
        ref = nnx.jit(lambda m, x: m(x))(m, x) if RUNS[name] else None
        specs = nnx.get_partition_spec(nnx.state(m, QuantizedExperts))
        flat = {"/".join(str(k) for k in path): v.get_value() for path, v in nnx.to_flat_state(specs)}
        res["specs"][name] = {k: [a for a in v] if v is not None else None for k, v in flat.items()}
        meshes = {"ep8": (Mesh(devs, ("ep",)), {"experts": "ep", "intermediate": None}),
                  "ep4xtp2": (Mesh(devs.reshape(4, 2), ("ep", "tp")), {"experts": "ep", "intermediate": "tp"})}
        for mesh_name in RUNS[name]:
            mesh, rules = meshes[mesh_name]
            state = nnx.state(m)
            pspecs = nnx.get_partition_spec(state)

            def to_mesh(spec):
                if not isinstance(spec, P):
                    return NamedSharding(mesh, P())
                return NamedSharding(mesh, P(*(rules.get(a) if a is not None else None for a in spec)))

            shardings = jax.tree.map(to_mesh, pspecs, is_leaf=lambda s: isinstance(s, P) or s is None)
            placed = jax.device_put(state, shardings)
            leaves = [v for v in jax.tree.leaves(nnx.state(placed, QuantizedExperts))]
            res["placed"][f"{name}_{mesh_name}"] = sorted({len(a.sharding.device_set) for a in leaves})
            m2 = nnx.merge(nnx.graphdef(m), placed)
            xs = jax.device_put(x, NamedSharding(mesh, P()))
            y = nnx.jit(lambda m, x: m(x))(m2, xs)
            res["err"][f"{name}_{mesh_name}"] = err(y, ref)
    print("RESULT " + json.dumps(res))
''')


def test_quantized_moe_placed_by_partition_metadata(tmp_path):
    env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=8").strip(), JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600,
                          cwd=str(tmp_path))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["empty_expert_3"], "the routing was meant to leave expert 3 empty"
    # every expert array names its expert axis; the layouts that say which axis spans I name it
    for name, specs in res["specs"].items():
        assert specs, name
        for path, spec in specs.items():
            assert spec is not None and spec[0] == "experts", (name, path, spec)
        assert any("intermediate" in spec for spec in specs.values()), (name, specs)
    gptq = res["specs"]["gptq"]
    assert gptq["experts/w13/qvalue"] == ["experts", None, "intermediate"], gptq
    assert gptq["experts/w2/qvalue"] == ["experts", "intermediate", None], gptq
    ct = res["specs"]["ct"]
    assert ct["experts/w13/qvalue"] == ["experts", "intermediate", None], ct
    # placed across the mesh (not replicated onto one device), and the same result: the XLA decode
    # in float32 on the CPU is exact up to the order of the sums
    assert set(res["err"]) == {"gptq_ep8", "gptq_ep4xtp2", "tiles_ep4xtp2"}, res["err"]
    for key, sizes in res["placed"].items():
        assert max(sizes) > 1, (key, sizes)
    for key, e in res["err"].items():
        assert e < 2e-6, f"{key}: relative error {e} (seed {res['seed']})"
