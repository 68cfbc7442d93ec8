"""Whole decoders on a mesh (``load_model(DIR, mesh=..., sharding=...)``) generate the single-device
model's tokens, greedy and seeded sampling, and their arrays really are split.

The runs are in subprocesses with 8 fake CPU devices (this pytest process already initialised
jax with one), each printing one JSON object; each check reads its part. Families: Qwen3-MoE (the
AWQ fixture), Mixtral (the GPTQ fixture, scanned layers), Qwen2-MoE, DeepSeek-V2 (a dense first
layer) and DeepSeek-V3 (q LoRA, grouped sigmoid routing) written by ``write_random_model``; each
on two of EP (``ep=8``), TP (``tp=2``) and EP x TP (``4 x 2``, ``2 x 2``), so that every family
and every mesh kind is run (a full product would take twice the compile time); two subprocesses
run half the families each, at once. Seeded sampling runs on three families (grouped-query,
scanned and latent attention): the sampler reads only the logits, which every run compares.

Tolerance of the logits: float32 on both sides, but the sums are taken in another order on the
mesh (the psum over TP ranks, the reduce-scatter over EP ranks, the row-parallel o_proj / down
partial sums): about 1e-7 relative per rounding, observed below 1e-6 of the logits' scale. A wrong
shard (a wrong expert slice, a missing reduction, a bias added twice) moves them by order 1e-2 or
more, so 1e-5 separates the two. Tokens are compared exactly; the prompts and seeds are fixed so a
near tie (a top-2 margin below the rounding) cannot make the check flaky, and the margin is checked.

The bad meshes are checked in this process, with ``AbstractMesh`` (no devices needed) and with the
safetensors reader replaced by one that fails: every error comes before any weight is read."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from jax.sharding import AbstractMesh, Mesh, PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "quantizers")
QWEN3, MIXTRAL = os.path.join(FIXTURES, "awq-qwen3moe"), os.path.join(FIXTURES, "gptq-mixtral")

# 8 host devices; the compile options trade run time for compile time (about half, on these tiny
# models), the same for the single-device model and the sharded ones
XLA_FLAGS = ("--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
             "--xla_cpu_use_fusion_emitters=false")

SCRIPT = textwrap.dedent(r'''
    import json, os, sys, time, warnings
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh
    assert len(jax.devices()) == 8, jax.devices()
    warnings.simplefilter("ignore")
    import wna16_jax as wj
    from wna16_jax.models.generation import programs
    from wna16_jax.models.mesh import MeshRules
    from wna16_jax.models.synthetic import RandomModelSpec, write_random_model
    from wna16_jax.schemes import QuantScheme

    tmp, fixtures = sys.argv[1], sys.argv[2]
    devs = np.array(jax.devices())
    g32 = QuantScheme.from_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                         "sym": True})
    awq32 = QuantScheme.from_quant_config({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                           "version": "gemm"})
    mla = dict(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    small = dict(vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_experts=8, top_k=2,
                 moe_intermediate_size=64, max_position_embeddings=256)
    specs = {
        "qwen2_moe": RandomModelSpec(model_type="qwen2_moe", scheme=g32, num_kv_heads=2, head_dim=16,
                                     shared_expert_intermediate_size=64, **small),
        "deepseek_v2": RandomModelSpec(model_type="deepseek_v2", scheme=g32, num_kv_heads=4, head_dim=24,
                                       intermediate_size=128, first_k_dense_replace=1, n_shared_experts=1, mla=mla,
                                       **small),
        "deepseek_v3": RandomModelSpec(model_type="deepseek_v3", scheme=awq32, num_kv_heads=4, head_dim=24,
                                       intermediate_size=128, first_k_dense_replace=1, n_shared_experts=1,
                                       mla={**mla, "q_lora_rank": 32},
                                       routing=dict(topk_method="noaux_tc", n_group=4, topk_group=2,
                                                    scoring_func="sigmoid", norm_topk_prob=True,
                                                    routed_scaling_factor=2.5), **small),
    }
    paths = {"qwen3_moe": os.path.join(fixtures, "awq-qwen3moe"), "mixtral": os.path.join(fixtures, "gptq-mixtral")}
    for name, spec in specs.items():
        if name in sys.argv[3].split(","):
            paths[name] = write_random_model(os.path.join(tmp, name), spec, seed=5)
    EP8, TP2 = (Mesh(devs, ("ep",)), None), (Mesh(devs[:2], ("tp",)), None)
    EPTP = (Mesh(devs.reshape(4, 2), ("ep", "tp")), None)
    # the Qwen3 fixture's experts (intermediate 128, groups of 128) cannot be split: EP only, TP elsewhere
    QWEN3_EPTP = (EPTP[0], MeshRules(expert_intermediate=None))
    MIXTRAL_EPTP = (Mesh(devs[:4].reshape(2, 2), ("ep", "tp")), {"ep_method": "all_to_all"})   # 4 experts
    CASES = {                                       # family: (scan_layers, {mesh name: (mesh, rules)})
        "qwen3_moe": (None, {"ep8": EP8, "ep4xtp2": QWEN3_EPTP}),
        "mixtral": (True, {"tp2": TP2, "ep2xtp2": MIXTRAL_EPTP}),
        "qwen2_moe": (None, {"tp2": TP2, "ep4xtp2": EPTP}),
        "deepseek_v2": (None, {"ep8": EP8, "ep4xtp2": EPTP}),
        "deepseek_v3": (None, {"tp2": TP2, "ep4xtp2": EPTP}),
    }
    CASES = {f: CASES[f] for f in sys.argv[3].split(",")}
    # seeded sampling on the EP x TP mesh of three families (grouped-query, scanned, latent attention):
    # the sampler reads only the logits, which every family's runs compare
    SAMPLED = {"qwen3_moe": "ep4xtp2", "mixtral": "ep2xtp2", "deepseek_v3": "ep4xtp2"}
    # served through the paged ModelEngine and the Scheduler (greedy) on one mesh of two families
    # (scanned grouped-query attention, latent attention), beside the single-device model served alike
    SERVED = {"mixtral": "ep2xtp2", "deepseek_v2": "ep4xtp2"}
    PROMPTS, NEW, MAX_LEN = [[1, 2, 3], [7, 5, 9, 11, 4]], 6, 16

    def serve(model):
        from wna16_jax.serving.engine import SamplingParams
        from wna16_jax.serving.model_engine import ModelEngine
        from wna16_jax.serving.scheduler import Scheduler

        engine = ModelEngine(model, block_size=4, num_blocks=16, batch_sizes=(1, 2), chunk_sizes=(8,),
                             max_model_len=MAX_LEN)
        scheduler = Scheduler(engine)
        for i, p in enumerate(PROMPTS):
            scheduler.add(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=NEW))
        out = {f"r{i}": [] for i in range(len(PROMPTS))}
        while scheduler.has_work:
            for event in scheduler.step():
                out[event.request_id].append(event.token)
        return [out[f"r{i}"] for i in range(len(PROMPTS))], engine._k, scheduler.stats().blocks_used
    SAMPLING = dict(key=11, temperature=0.9, top_p=0.95, top_k=40)

    def run(gen, **kw):
        toks, logits = [], []
        for t, lg in gen.stream(PROMPTS, NEW, stop_tokens=(), with_logits=True, **kw):
            toks.append(t.tolist()); logits.append(lg)
        return toks, np.stack(logits)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape or not np.all(np.isfinite(a)):
            return float("inf")
        return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

    def margin(logits):
        top = np.sort(logits, axis=-1)[..., -2:]
        return float((top[..., 1] - top[..., 0]).min() / np.abs(logits).max())

    def arrays(model):
        out = {}
        for path, v in nnx.to_flat_state(nnx.state(model)):
            for sub, a in jax.tree_util.tree_flatten_with_path(v.get_value())[0]:
                out["/".join(map(str, path)) + jax.tree_util.keystr(sub)] = a
        return out

    def leaf(found, *parts):
        return next(a for k, a in found.items() if all(p in k for p in parts))

    def facts(a):
        return {"spec": [x if x is None or isinstance(x, str) else list(x) for x in a.sharding.spec],
                "devices": len(a.sharding.device_set), "shape": list(a.shape),
                "shard": list(a.addressable_shards[0].data.shape)}

    def prefill_cache(gen, model):
        progs, leaves = programs(model)
        tokens, lengths = gen._padded(PROMPTS)
        key = jax.random.split(jax.random.key(0), gen.batch_size)
        _, _, cache = progs.prefill(leaves, jnp.asarray(tokens), jnp.asarray(lengths), key, jnp.float32(0),
                                    jnp.float32(1), jnp.int32(0), max_len=MAX_LEN, sample=False)
        return cache

    res = {"families": {}, "seconds": {}}
    for family, (scan, meshes) in CASES.items():
        clock = time.perf_counter()
        ref = wj.load_model(paths[family], dtype=jnp.float32, scan_layers=scan)
        g = wj.Generator(ref, batch_size=2, max_len=MAX_LEN)
        want, want_logits = run(g)
        want_s, want_s_logits = run(g, **SAMPLING) if family in SAMPLED else (None, None)
        ref_cache = np.asarray(prefill_cache(g, ref).k)
        ref_served = serve(ref)[0] if family in SERVED else None
        fam = res["families"][family] = {"scanned": bool(ref.scan_layers), "margin": margin(want_logits),
                                         "ref_plan": ref.mesh_plan is None, "meshes": {}}
        for name, (mesh, rules) in meshes.items():
            m = wj.load_model(paths[family], dtype=jnp.float32, scan_layers=scan, mesh=mesh, sharding=rules)
            gen = wj.Generator(m, batch_size=2, max_len=MAX_LEN)
            got, got_logits = run(gen)
            out = fam["meshes"][name] = {"tokens_equal": got == want, "logits_err": rel(got_logits, want_logits),
                                         "tokens": got}
            if SAMPLED.get(family) == name:
                got_s, got_s_logits = run(gen, **SAMPLING)
                out.update(sampled_equal=got_s == want_s, sampled_logits_err=rel(got_s_logits, want_s_logits),
                           sampled_differs_from_greedy=got_s != got)
            found = arrays(m)
            out["expert"] = facts(leaf(found, "mlp/experts/w13", "qvalue"))
            out["router"] = facts(leaf(found, "mlp/router"))
            out["embed"] = facts(leaf(found, "embed_tokens"))
            q = "self_attn/q_b_proj" if family == "deepseek_v3" else "self_attn/q_proj"
            out["q_proj"] = facts(leaf(found, q, "weight", "qvalue"))
            out["o_proj"] = facts(leaf(found, "self_attn/o_proj", "weight", "qvalue"))
            out["placement"] = str(next(l.mlp for l in m.layer_modules() if hasattr(l.mlp, "mesh_placement")
                                        and l.mlp.mesh_placement is not None).mesh_placement)
            out["init_cache"] = facts(m.init_cache(2, MAX_LEN).k)
            out["paged_cache"] = facts(m.init_paged_cache(4, 8).k)
            cache = prefill_cache(gen, m)
            out["program_cache"] = facts(cache.k)
            out["program_cache_err"] = rel(np.asarray(cache.k), ref_cache)
            if family == "mixtral" and name == "ep2xtp2":      # the command line's --mesh, on the same devices
                import io
                from wna16_jax.cli import run_generate

                def cli(spec):
                    o, e = io.StringIO(), io.StringIO()
                    run_generate(paths[family], prompt_ids=["1,2,3", "7,5,9,11,4"], max_new_tokens=NEW,
                                 dtype="float32", mesh=spec, use_stop=False, out=o, err=e)
                    return o.getvalue(), e.getvalue()

                out["cli"] = {"one": cli(None), "mesh": cli("ep2xtp2")}
            if SERVED.get(family) == name:
                served, pool, left = serve(m)
                out["served"] = {"equal": served == ref_served, "tokens": served, "pool": facts(pool), "blocks_left": left,
                                 "generator": [[int(t[r]) for t in want][:len(served[r])] for r in range(len(served))]}
        res["seconds"][family] = time.perf_counter() - clock
    print(json.dumps(res))
''')


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    env = {**os.environ, "XLA_FLAGS": XLA_FLAGS,
           "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tmp = str(tmp_path_factory.mktemp("mesh_models"))
    # two processes at once (the compiles are single-threaded): half the families each
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, tmp, FIXTURES, families], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for families in ("qwen3_moe,mixtral", "qwen2_moe,deepseek_v2,deepseek_v3")]
    res = {"families": {}, "seconds": {}}
    for p in procs:
        out, err = p.communicate(timeout=900)
        assert p.returncode == 0, err[-6000:]
        part = json.loads(out.strip().splitlines()[-1])
        for k in res:
            res[k].update(part[k])
    return res


def _meshes(runs):
    return [(f, n, r) for f, fam in runs["families"].items() for n, r in fam["meshes"].items()]


def test_every_family_and_mesh_kind_ran(runs):
    fams = runs["families"]
    assert set(fams) == {"qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3"}
    kinds = {"epxtp" if "x" in n else n.rstrip("0123456789") for _, n, _ in _meshes(runs)}
    assert kinds == {"ep", "tp", "epxtp"}
    assert fams["mixtral"]["scanned"] and not fams["qwen3_moe"]["scanned"]
    assert all(f["ref_plan"] for f in fams.values())            # the one-device model has no plan


def test_greedy_tokens_equal_the_single_device_model(runs):
    for family, name, r in _meshes(runs):
        assert runs["families"][family]["margin"] > 1e-4, family   # no near tie the rounding could flip
        assert r["tokens_equal"], (family, name, r["tokens"])


def test_logits_match_to_rounding(runs):
    for family, name, r in _meshes(runs):
        assert r["logits_err"] <= 1e-5, (family, name, r["logits_err"])


def test_seeded_sampling_equals_the_single_device_model(runs):
    sampled = [(f, n, r) for f, n, r in _meshes(runs) if "sampled_equal" in r]
    assert {f for f, _, _ in sampled} == {"qwen3_moe", "mixtral", "deepseek_v3"}
    for family, name, r in sampled:
        assert r["sampled_equal"], (family, name)
        assert r["sampled_logits_err"] <= 1e-5, (family, name, r["sampled_logits_err"])
        assert r["sampled_differs_from_greedy"], (family, name)     # it really sampled


def _axes(name):
    ep = {"ep8": 8, "ep4xtp2": 4, "ep2xtp2": 2}.get(name, 1)
    tp = 2 if "tp2" in name else 1
    return ep, tp


def test_routed_experts_are_split(runs):
    for family, name, r in _meshes(runs):
        ep, tp = _axes(name)
        e = r["expert"]
        expert_tp = tp > 1 and not (family == "qwen3_moe")        # the Qwen3 fixture's experts: EP only
        lead = [None] if runs["families"][family]["scanned"] else []
        want = lead + (["tp"] if expert_tp else []) + (["ep"] if ep > 1 else [])
        assert e["spec"] == want, (family, name, e)
        axis = len(lead) + (1 if expert_tp else 0)                 # the expert axis
        assert e["shard"][axis] * ep == e["shape"][axis], (family, name, e)
        if expert_tp:
            assert e["shape"][len(lead)] == tp and e["shard"][len(lead)] == 1
        assert e["devices"] == ep * tp, (family, name, e)
        assert f"ep_axis={'ep' if ep > 1 else None!r}" in r["placement"]
        assert f"tp_axis={'tp' if expert_tp else None!r}" in r["placement"]
        assert r["router"]["spec"] == [] and r["router"]["shard"] == r["router"]["shape"]


def test_embeddings_and_attention_are_split_over_tp(runs):
    for family, name, r in _meshes(runs):
        _, tp = _axes(name)
        if tp == 1:
            assert r["embed"]["spec"] == [] and r["q_proj"]["spec"] == [], (family, name)
            continue
        assert r["embed"]["spec"] == ["tp"] and r["embed"]["shard"][0] * 2 == r["embed"]["shape"][0]
        # the packed q rows (column parallel) and the o_proj columns (row parallel) of the checkpoint form
        q, o = r["q_proj"], r["o_proj"]
        assert "tp" in q["spec"] and "tp" in o["spec"], (family, name, q, o)
        n_axis, k_axis = q["spec"].index("tp"), o["spec"].index("tp")
        assert q["shard"][n_axis] * 2 == q["shape"][n_axis] and o["shard"][k_axis] * 2 == o["shape"][k_axis]
        assert n_axis != k_axis                                     # rows for q, columns for o


def test_the_paged_engine_serves_a_mesh_model(runs):
    """The paged ModelEngine under the Scheduler on a mesh (Mixtral, scanned, over ep2 x tp2;
    DeepSeek-V2's latent cache over ep4 x tp2) serves the single-device model's greedy tokens (and
    the Generator's, up to where the scheduler stops at an eos), its pool placed as the mesh's
    cache spec says (the KV heads over tp; the latent cache replicated), and every block freed."""
    for family, mesh in (("mixtral", "ep2xtp2"), ("deepseek_v2", "ep4xtp2")):
        got = runs["families"][family]["meshes"][mesh]["served"]
        assert got["equal"], (family, got)
        assert got["tokens"] == got["generator"] and all(got["tokens"]), (family, got)
        assert got["blocks_left"] == 0 and got["pool"]["devices"] > 1, (family, got)
        assert got["pool"]["spec"] == ([] if family == "deepseek_v2" else [None, None, "tp"]), (family, got)


def test_generate_command_line_on_a_mesh(runs):
    """``wna16-jax generate DIR --mesh ep2xtp2`` (this process's first 4 devices) prints the
    one-device command's tokens and says where the model was placed."""
    cli = runs["families"]["mixtral"]["meshes"]["ep2xtp2"]["cli"]
    (one, _), (mesh, err) = cli["one"], cli["mesh"]
    assert one and mesh == one, cli
    assert "on 4 devices as ep2xtp2" in err, err


def test_kv_cache_is_split_with_the_kv_heads(runs):
    for family, name, r in _meshes(runs):
        _, tp = _axes(name)
        latent = family.startswith("deepseek")
        for what in ("init_cache", "paged_cache", "program_cache"):
            c = r[what]
            if latent or tp == 1:                # the latent cache, or no TP: the heads are whole
                assert c["shard"][2] == c["shape"][2], (family, name, what, c)
            else:                                # the program's output may also split the batch over ep
                assert c["spec"][2] == "tp" and c["shard"][2] * tp == c["shape"][2], (family, name, what, c)
            if what != "program_cache":          # as init_cache makes them: exactly the rule's spec
                assert c["spec"] == ([None, None, "tp"] if tp > 1 and not latent else []), (family, name, what, c)
        assert r["program_cache_err"] <= 1e-5, (family, name, r["program_cache_err"])


# --------------------------------------------------------------------------- bad meshes, in this process


@pytest.fixture
def no_weight_reads(monkeypatch):
    """The safetensors reader fails: an error raised before any weight is read is unaffected."""
    from wna16_jax.safetensors_io import SafetensorsFile

    def read_into(self, name, *a, **k):
        raise AssertionError(f"weight {name!r} read before the mesh was checked")

    monkeypatch.setattr(SafetensorsFile, "read_into", read_into)


def _load(path, mesh, sharding=None, **kw):
    import wna16_jax as wj

    return wj.load_model(path, mesh=mesh, sharding=sharding, **kw)


@pytest.mark.parametrize("mesh, sharding, words", [
    (AbstractMesh((3,), ("ep",)), None, ["'ep'", "size 3", "num_experts = 8"]),
    (AbstractMesh((3, 1), ("ep", "tp")), None, ["'ep'", "size 3", "num_experts = 8"]),
    (AbstractMesh((3,), ("tp",)), {"expert_intermediate": None, "vocab": None},
     ["'tp'", "size 3", "num_attention_heads = 4"]),
    (AbstractMesh((4,), ("tp",)), {"expert_intermediate": None}, ["'tp'", "size 4", "num_key_value_heads = 2"]),
    (AbstractMesh((3,), ("tp",)), {"heads": None, "vocab": None}, ["'tp'", "size 3", "moe_intermediate_size = 128"]),
    # 128 / 2 = 64 is a whole number, but not a whole number of the fixture's groups of 128
    (AbstractMesh((2,), ("tp",)), None, ["'tp'", "size 2", "moe_intermediate_size = 128", "group size 128"]),
    (AbstractMesh((3,), ("tp",)), {"expert_intermediate": None, "heads": None}, ["'tp'", "size 3",
                                                                               "vocab_size = 320"]),
])
def test_a_mesh_that_does_not_divide_is_named_before_any_read(no_weight_reads, mesh, sharding, words):
    from wna16_jax.errors import ShapeError

    with pytest.raises(ShapeError) as e:
        _load(QWEN3, mesh, sharding)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_mixtral_names_its_experts_field(no_weight_reads):
    from wna16_jax.errors import ShapeError

    with pytest.raises(ShapeError, match=r"mesh axis 'ep' has size 8, which does not divide num_local_experts = 4"):
        _load(MIXTRAL, AbstractMesh((8,), ("ep",)))


def test_dense_mlp_intermediate_must_divide(tmp_path):
    from wna16_jax.errors import ShapeError
    from wna16_jax.models import DecoderConfig, check_mesh
    from wna16_jax.models.synthetic import RandomModelSpec, write_random_model
    from wna16_jax.schemes import QuantScheme

    spec = RandomModelSpec(model_type="qwen3_moe", scheme=QuantScheme("gptq", 4, 32, False), vocab_size=96,
                           hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                           top_k=2, moe_intermediate_size=64, intermediate_size=96, mlp_only_layers=(0,))
    path = write_random_model(str(tmp_path / "m"), spec, seed=int(np.random.default_rng().integers(1 << 30)))
    with open(os.path.join(path, "config.json")) as f:
        config = DecoderConfig.from_hf_config(json.load(f))
    with pytest.raises(ShapeError, match=r"mesh axis 'tp' has size 64, which does not divide intermediate_size = 96"):
        check_mesh(config, AbstractMesh((64,), ("tp",)), {"heads": None, "vocab": None, "expert_intermediate": None})
    plan = check_mesh(config, AbstractMesh((2, 2), ("ep", "tp")))       # 96 / 2 and the rest divide
    assert plan.size("mlp") == 2 and plan.size("experts") == 2


@pytest.mark.parametrize("sharding, words", [
    ({"heads": "model"}, ["sharding.heads", "'model'", "('ep', 'tp')"]),
    (lambda M: M(experts="expert"), ["sharding.experts", "'expert'", "does not exist"]),
    ({"experts_axis": "ep"}, ["experts_axis", "not MeshRules fields"]),
    ({"ep_method": "ring"}, ["sharding.ep_method", "'ring'"]),
    ({"experts": "tp", "expert_intermediate": "tp"}, ["experts and expert_intermediate", "'tp'"]),
    ("ep", ["sharding: expected None, a MeshRules or a mapping", "str"]),
])
def test_bad_rules_are_config_errors_before_any_read(no_weight_reads, sharding, words):
    from wna16_jax.errors import ConfigError
    from wna16_jax.models.mesh import MeshRules

    with pytest.raises(ConfigError) as e:
        _load(QWEN3, AbstractMesh((2, 2), ("ep", "tp")), sharding(MeshRules) if callable(sharding) else sharding)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_other_bad_arguments_before_any_read(no_weight_reads):
    import jax

    from wna16_jax.errors import ConfigError, UnsupportedError, WNA16Error

    with pytest.raises(ConfigError, match="mesh: expected a jax.sharding.Mesh, got str"):
        _load(QWEN3, "ep")
    with pytest.raises(ConfigError, match="sharding: given .* without a mesh"):
        _load(QWEN3, None, {"experts": "ep"})
    with pytest.raises(ConfigError, match=r"none of which the default rules use"):
        _load(QWEN3, AbstractMesh((2,), ("data",)))
    with pytest.raises(ConfigError, match="a jax.sharding.Mesh of devices"):         # divides, but has no devices
        _load(QWEN3, AbstractMesh((2, 2), ("ep", "tp")), {"expert_intermediate": None})
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("ep", "tp"))
    with pytest.raises(UnsupportedError, match="dequantized"):
        _load(QWEN3, one, dequantized=True)
    assert issubclass(ConfigError, WNA16Error) and issubclass(UnsupportedError, WNA16Error)


def test_leaf_rules_for_16bit_linears():
    """The rule table for 16-bit linears (the test checkpoints quantize every projection)."""
    import jax.numpy as jnp
    from flax import nnx

    from wna16_jax.models.mesh import MeshPlan, MeshRules, leaf_specs

    plan = MeshPlan(AbstractMesh((2, 4), ("ep", "tp")), MeshRules())
    w = nnx.Param(jnp.zeros((8, 12)))
    cases = {("layers", 0, "self_attn", "q_proj", "weight"): P("tp"),
             ("layers", 3, "self_attn", "k_proj", "bias"): P("tp"),
             ("layers", 0, "self_attn", "o_proj", "weight"): P(None, "tp"),
             ("stacked_layers", "self_attn", "q_proj", "weight"): P(None, "tp"),      # [L, N, K]: L whole
             ("layers", 1, "mlp", "gate_proj", "weight"): P("tp"),
             ("layers", 1, "mlp", "down_proj", "weight"): P(None, "tp"),
             ("embed_tokens",): P("tp"), ("lm_head", "weight"): P("tp"),
             ("norm", "weight"): P(), ("layers", 0, "mlp", "router"): P(),
             ("layers", 0, "self_attn", "kv_a_proj_with_mqa", "weight"): P()}
    for path, want in cases.items():
        assert leaf_specs(plan, path, nnx.Param(jnp.zeros((3, 8, 12))) if path[0] == "stacked_layers" else w) \
            == want, path
    odd = nnx.Param(jnp.zeros((6, 12)))                       # 6 rows over 4 devices: replicated
    assert leaf_specs(plan, ("layers", 0, "self_attn", "q_proj", "weight"), odd) == P()


def test_the_read_guard_sees_reads(no_weight_reads):
    """The guard the checks above run under does stop a load that gets as far as reading."""
    import jax

    with pytest.raises(AssertionError, match="read before the mesh was checked"):
        _load(QWEN3, Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("ep", "tp")))
