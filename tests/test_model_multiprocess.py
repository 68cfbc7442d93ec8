"""A decoder on a mesh of two processes (``jax.distributed.initialize`` on 127.0.0.1, JAX's CPU
collectives) generates the single-device model's tokens.

The test starts two subprocesses of 4 fake CPU devices each; both build one global mesh of the 8
devices, load a fixture with ``load_model(DIR, mesh=mesh)`` (each process supplying only its own
devices' shards, :func:`wna16_jax.models.mesh.put_global`) and run :class:`wna16_jax.Generator`
greedy, each printing one JSON object. The reference is the one-device model of this pytest
process. Cases: Qwen3-MoE (the AWQ fixture, its experts whole: groups of 128 = the intermediate
size) expert parallel over ``ep = 8`` with a batch of 8 rows, whose outputs the program leaves
split over the processes (the Generator gathers them); Mixtral (the GPTQ fixture, scanned layers)
over ``ep = 4 x tp = 2``, the experts' intermediate size split over ``tp`` too. Before that, with
every weight read made to fail: the two processes are given the same devices in another order
each, and process 1 a mesh of process 0's devices alone: ``ConfigError`` before any weight is
read. Logits: float32, summed in another order on the mesh (see tests/test_model_mesh.py), so
within 1e-5 of their scale; tokens exactly. The processes print to files, not pipes (a process
blocked on a full pipe would hold the other at its next collective); both are killed, and their
stderr shown, past :data:`TIMEOUT_S`.

Each process reads only the routed experts its devices hold (the tensors every read names, and
their bytes: the rest of the checkpoint whole, half of the experts' bytes). With the tp axis
across the processes (``ep = 4 x tp = 2``, each process one TP rank), each reads its rank's
slice of every expert, its half of the embedding and lm_head rows and its heads' slice of the
attention: Mixtral's GPTQ attention (packed words and scales; the check-only tensors whole),
an act-order GPTQ Qwen3-MoE's, and a random Qwen3-MoE's 16-bit attention (rows and columns)."""

import json
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
import types
import warnings

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "quantizers")
XLA_FLAGS = ("--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
             "--xla_cpu_use_fusion_emitters=false")
PROMPTS, NEW, MAX_LEN = [[1, 2, 3], [7, 5, 9, 11, 4]], 6, 16
#: family: (fixture folder, scan_layers, batch size)
FAMILIES = {"qwen3_moe": ("awq-qwen3moe", None, 8), "mixtral": ("gptq-mixtral", True, 2),
            "mixtral_tp": ("gptq-mixtral", True, 2), "attn16_tp": (None, None, 2),
            "descact_tp": ("gptq-descact-qwen3moe", False, 2)}   # None: the synthetic folder
TIMEOUT_S = 150

SCRIPT = textwrap.dedent(r'''
    import json, os, sys, time, warnings
    pid, port, fixtures = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    import jax
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                               initialization_timeout=60)
    import jax.numpy as jnp, numpy as np
    from flax import nnx
    from jax.sharding import Mesh
    warnings.simplefilter("ignore")
    import wna16_jax as wj
    from wna16_jax.errors import ConfigError
    from wna16_jax.safetensors_io import SafetensorsFile

    assert (jax.process_count(), len(jax.devices()), len(jax.local_devices())) == (2, 8, 4)
    PROMPTS, NEW, MAX_LEN = json.loads(sys.argv[4])
    SYNTHETIC = sys.argv[5]                  # a random Qwen3-MoE with 16-bit attention (the test writes it)
    devs = np.array(jax.devices())
    res = {"process": pid, "families": {}, "seconds": {}}

    def refused(mesh):
        """The ConfigError of a load on ``mesh`` (None: it loaded), with every weight read failing."""
        read_into = SafetensorsFile.read_into
        def guard(self, name, *a, **k):
            raise AssertionError(f"weight {name!r} read before the mesh was checked")
        SafetensorsFile.read_into = guard
        try:
            wj.load_model(os.path.join(fixtures, "awq-qwen3moe"), mesh=mesh)
            return None
        except ConfigError as e:
            return str(e)
        finally:
            SafetensorsFile.read_into = read_into

    # the processes given meshes of the same devices in another order: refused in both
    res["other_order"] = refused(Mesh(devs if pid == 0 else devs[::-1], ("ep",)))
    if pid == 1:                         # a mesh of the other process's devices: refused
        res["bad_mesh"] = refused(Mesh(devs[:4], ("ep",)))

    import re
    from wna16_jax import safetensors_io
    read_fully = safetensors_io._read_fully
    seen = []                      # (tensor name, bytes) of every positioned read of tensor data

    def spy(fd, buf, pos, path, name):
        seen.append((name, len(buf)))
        return read_fully(fd, buf, pos, path, name)

    safetensors_io._read_fully = spy

    CASES = {"qwen3_moe": ("awq-qwen3moe", None, 8, Mesh(devs, ("ep",)), None),
             "mixtral": ("gptq-mixtral", True, 2, Mesh(devs.reshape(4, 2), ("ep", "tp")), None),
             # tp across the processes: each holds every expert, but one TP rank of them and of the vocabulary
             "mixtral_tp": ("gptq-mixtral", True, 2, Mesh(devs.reshape(2, 4).T, ("ep", "tp")), None),
             # 16-bit attention, heads split over tp across the processes: each reads its heads' slice
             "attn16_tp": (SYNTHETIC, None, 2, Mesh(devs.reshape(2, 4).T, ("ep", "tp")), None),
             # act-order GPTQ (desc_act) attention and experts, their slices over tp across the processes
             "descact_tp": ("gptq-descact-qwen3moe", False, 2, Mesh(devs.reshape(2, 4).T, ("ep", "tp")), None)}
    for family, (folder, scan, batch, mesh, rules) in CASES.items():
        clock = time.perf_counter()
        seen.clear()
        m = wj.load_model(os.path.join(fixtures, folder), dtype=jnp.float32, scan_layers=scan, mesh=mesh,
                          sharding=rules)
        experts_read = sorted({int(x[1]) for n, _ in seen for x in [re.search(r"\.experts\.(\d+)\.", n)] if x})
        reads = {"experts": experts_read, "bytes": sum(b for _, b in seen)}
        gen = wj.Generator(m, batch_size=batch, max_len=MAX_LEN)
        toks, logits = [], []
        for t, lg in gen.stream(PROMPTS, NEW, stop_tokens=(), with_logits=True):
            toks.append(t.tolist()); logits.append(np.asarray(lg).tolist())
        w13 = next(a for p, v in nnx.to_flat_state(nnx.state(m)) if "mlp/experts/w13" in "/".join(map(str, p))
                   for a in jax.tree.leaves(v.get_value()))
        res["families"][family] = {
            "tokens": toks, "logits": logits,
            "expert": {"shape": list(w13.shape), "spec": [x if x is None or isinstance(x, str) else list(x)
                                                          for x in w13.sharding.spec],
                       "fully_addressable": w13.is_fully_addressable, "devices": len(w13.sharding.device_set),
                       "local_shards": len(w13.addressable_shards),
                       "on_local_devices": sorted(s.device.id for s in w13.addressable_shards)
                                           == sorted(d.id for d in jax.local_devices()),
                       "owners": sorted({d.process_index for d in w13.sharding.device_set}),
                       "shard": list(w13.addressable_shards[0].data.shape)}}
        res["families"][family]["reads"] = reads
        if m.layers:
            att = {n: getattr(m.layers[0].self_attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
            att = {n: (lin.weight.get_value(), lin) for n, lin in att.items()
                   if type(lin).__name__ in ("DenseLinear", "QuantizedLinear")}
        else:                                    # scanned: the stacked state, [L, ...]
            st = m.stacked_layers["self_attn"]
            att = {n: (st[n]["weight"].get_value(), None) for n in ("q_proj", "k_proj", "v_proj", "o_proj") if n in st}
        res["families"][family]["attention"] = {
            name: {"spec": [x if x is None or isinstance(x, str) else list(x) for x in w.sharding.spec],
                   "fully_addressable": w.is_fully_addressable, "shape": list(w.shape),
                   "global": None if lin is None else [lin.out_features, lin.in_features]}
            for name, (v, lin) in att.items() for w in [getattr(v, "qvalue", v)]}
        emb = m.embed_tokens.get_value()
        res["families"][family]["vocab"] = {
            "spec": [x if x is None or isinstance(x, str) else list(x) for x in emb.sharding.spec],
            "fully_addressable": emb.is_fully_addressable,
            "shard": list(emb.addressable_shards[0].data.shape),
            "rows": sorted({(s.index[0].start or 0, s.index[0].stop or emb.shape[0]) for s in emb.addressable_shards})}
        res["seconds"][family] = time.perf_counter() - clock
    print(json.dumps(res))
''')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> str:
    """A random Qwen3-MoE checkpoint (GPTQ int4 g128 experts) whose attention linears are 16-bit,
    as checkpoints that quantize only the experts store them (Kimi-K2's release does)."""
    from wna16_jax.models.synthetic import RandomModelSpec, write_random_model
    from wna16_jax.schemes import QuantScheme

    path = str(tmp_path_factory.mktemp("attn16") / "qwen3-attn16")
    scheme = QuantScheme.from_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                            "desc_act": False})
    write_random_model(path, RandomModelSpec(
        model_type="qwen3_moe", scheme=scheme, vocab_size=256, hidden_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=32, num_experts=8, top_k=2, moe_intermediate_size=256, quantize_attention=False),
        seed=3)
    return path


def _folder(family: str, synthetic: str) -> str:
    return FAMILIES[family][0] or synthetic


@pytest.fixture(scope="module")
def runs(tmp_path_factory, synthetic):
    env = {**os.environ, "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    port, args = str(_free_port()), json.dumps([PROMPTS, NEW, MAX_LEN])
    tmp = tmp_path_factory.mktemp("two_processes")
    # output to files, not pipes: a process blocked on a full pipe would hold the other at its
    # next collective (or at the shutdown barrier) while this one waits on the first
    files = [(open(tmp / f"out{i}", "w+"), open(tmp / f"err{i}", "w+")) for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(i), port, FIXTURES, args, synthetic], stdout=o, stderr=e,
                              text=True, env=env, cwd=ROOT) for i, (o, e) in enumerate(files)]
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        late = [p.poll() is None for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = []
    for o, e in files:
        o.seek(0), e.seek(0)
        texts.append((o.read(), e.read()))
        o.close(), e.close()
    stderr = "\n----\n".join(f"process {i}:\n{e[-4000:]}" for i, (_, e) in enumerate(texts))
    if any(late):
        pytest.fail(f"the two processes did not finish in {TIMEOUT_S} s; their stderr:\n{stderr}")
    if any(p.returncode for p in procs):
        pytest.fail(f"exit codes {[p.returncode for p in procs]}; stderr:\n{stderr}")
    # the JSON object is the last line of stdout (Gloo prints its connections there too)
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in texts]


@pytest.fixture(scope="module")
def reference(synthetic):
    import jax.numpy as jnp

    import wna16_jax as wj
    from wna16_jax.backends import BackendFallbackWarning

    res = {}
    for family, (_, scan, _) in FAMILIES.items():
        with warnings.catch_warnings():          # the act-order experts run on the XLA executor here
            warnings.simplefilter("ignore", BackendFallbackWarning)
            m = wj.load_model(os.path.join(FIXTURES, _folder(family, synthetic)), dtype=jnp.float32,
                              scan_layers=scan)
        gen = wj.Generator(m, batch_size=2, max_len=MAX_LEN)
        toks, logits = [], []
        for t, lg in gen.stream(PROMPTS, NEW, stop_tokens=(), with_logits=True):
            toks.append(t.tolist())
            logits.append(lg)
        res[family] = (toks, np.stack(logits))
    return res


def test_both_processes_ran_every_family(runs):
    assert [r["process"] for r in runs] == [0, 1]
    for r in runs:
        assert set(r["families"]) == set(FAMILIES)


def test_tokens_equal_the_single_device_model(runs, reference):
    for r in runs:
        for family, (want, _) in reference.items():
            assert r["families"][family]["tokens"] == want, (r["process"], family)


def test_logits_match_to_rounding(runs, reference):
    for r in runs:
        for family, (_, want) in reference.items():
            got = np.asarray(r["families"][family]["logits"], np.float64)
            assert got.shape == want.shape, (r["process"], family)
            err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            assert err <= 1e-5, (r["process"], family, err)


def test_each_process_holds_only_its_devices_shards(runs):
    for r in runs:
        q, m = r["families"]["qwen3_moe"]["expert"], r["families"]["mixtral"]["expert"]
        for e in (q, m):
            assert not e["fully_addressable"] and e["devices"] == 8, e
            assert e["local_shards"] == 4 and e["on_local_devices"] and e["owners"] == [0, 1], e
        assert q["spec"] == ["ep"] and q["shard"][0] * 8 == q["shape"][0]               # 8 experts, one a device
        # Mixtral (scanned): [L, tp, E, ...], the TP ranks over tp, the 4 experts over ep
        assert m["spec"] == [None, "tp", "ep"] and m["shape"][1] == 2 and m["shard"][1] == 1, m
        assert m["shard"][2] * 4 == m["shape"][2], m


#: the routed experts each process's devices hold: Qwen3-MoE's 8 over ep = 8 (process p has
#: devices 4p .. 4p + 3, one expert each); Mixtral's 4 over ep = 4 x tp = 2 (devices 2e, 2e + 1
#: hold expert e, one TP rank each)
OWNED = {"qwen3_moe": ([0, 1, 2, 3], [4, 5, 6, 7]), "mixtral": ([0, 1], [2, 3])}


def _file_bytes(folder: str, held) -> tuple[int, int, int]:
    """``(all tensors, routed-expert tensors, the held experts' g_idx and qzeros)``: bytes of the
    fixture's tensors, from the headers (a one-device load reads each tensor once: all of them)."""
    from wna16_jax.checkpoint import Checkpoint

    ckpt = Checkpoint(os.path.join(FIXTURES, folder))       # an absolute folder: itself
    size = {n: ckpt.tensor_info(n).end - ckpt.tensor_info(n).begin for n in ckpt.tensor_names()}
    meta = sum(b for n, b in size.items() if n.endswith((".g_idx", ".qzeros"))
               and any(f".experts.{e}." in n for e in held))
    return sum(size.values()), sum(b for n, b in size.items() if ".experts." in n), meta


def test_each_process_reads_only_the_experts_it_holds(runs):
    for family, owned in OWNED.items():
        for r in runs:
            total, experts, meta = _file_bytes(FAMILIES[family][0], owned[r["process"]])
            reads = r["families"][family]["reads"]
            assert reads["experts"] == owned[r["process"]], (family, r["process"], reads["experts"])
            # the rest of the model whole and half of the experts' bytes. Mixtral: each of its two
            # experts read as two TP slices, each slice's bytes alone, except the tensors read only
            # to be checked (GPTQ's symmetric qzeros, a natural g_idx), read whole for each slice
            want = total - experts // 2 + (meta if family == "mixtral" else 0)
            assert reads["bytes"] == want, (family, r["process"], reads["bytes"], want)


def test_tp_across_processes_reads_one_rank_of_experts_and_vocabulary(runs):
    """``ep = 4 x tp = 2`` with the tp axis across the processes: each process reads every
    expert but only its TP rank's slice of each (the tensors read only to be checked whole), and
    only its half of the embedding and 16-bit lm_head rows; those leaves are global arrays of the
    whole vocabulary, split over tp."""
    from wna16_jax.checkpoint import Checkpoint

    ckpt = Checkpoint(os.path.join(FIXTURES, "gptq-mixtral"))
    vocab = sum(ckpt.tensor_info(n).end - ckpt.tensor_info(n).begin
                for n in ("model.embed_tokens.weight", "lm_head.weight"))
    # the quantized attention (XLA executor, checkpoint form) split over heads: each process reads
    # half of q / k / v's packed columns and scales and of o_proj's packed rows and groups; the
    # tensors read only to be checked (symmetric qzeros, a natural g_idx) whole
    attn = sum(ckpt.tensor_info(n).end - ckpt.tensor_info(n).begin for n in ckpt.tensor_names()
               if re.search(r"self_attn\.[qkvo]_proj\.(qweight|scales)$", n))
    total, experts, meta = _file_bytes("gptq-mixtral", range(4))
    for r in runs:
        f = r["families"]["mixtral_tp"]
        assert f["reads"]["experts"] == [0, 1, 2, 3], f["reads"]
        want = total - (experts - meta) // 2 - vocab // 2 - attn // 2
        assert f["reads"]["bytes"] == want, (r["process"], f["reads"]["bytes"], want)
        for name, spec in f["attention"].items():    # scanned GPTQ qweight [L, 1, K / 8, N]: N (q, k, v) or K (o) split
            assert spec["spec"] == ([None, None, "tp"] if name == "o_proj" else [None, None, None, "tp"]), (name, spec)
            assert not spec["fully_addressable"], (name, spec)
        assert set(f["attention"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}, f["attention"]
        v = f["vocab"]
        assert v["spec"] == ["tp"] and not v["fully_addressable"] and v["shard"][0] == 160, v
        assert v["rows"] == [[160 * r["process"], 160 * (r["process"] + 1)]], v
        # the Mixtral case above holds both tp ranks in each process: both halves (read whole)
        assert r["families"]["mixtral"]["vocab"]["rows"] == [[0, 160], [160, 320]]


def test_16bit_attention_over_tp_across_processes_reads_one_slice_of_each_head_matrix(runs, synthetic):
    """16-bit attention linears split over ``heads`` (tp, across the processes): each process
    reads its half of q / k / v's rows and of o_proj's columns (its bytes alone), beside one TP
    rank of every expert and half of the vocabulary; those weights are global arrays of the whole
    matrix split over tp, and the tokens are the single-device model's (the tokens test above)."""
    from wna16_jax.checkpoint import Checkpoint

    ckpt = Checkpoint(synthetic)
    size = {n: ckpt.tensor_info(n).end - ckpt.tensor_info(n).begin for n in ckpt.tensor_names()}
    attn = sum(b for n, b in size.items() if re.search(r"self_attn\.[qkvo]_proj\.weight$", n))
    vocab = size["model.embed_tokens.weight"] + size["lm_head.weight"]
    total, experts, meta = _file_bytes(synthetic, range(8))
    assert attn and all(not n.endswith(".qweight") for n in size if ".self_attn." in n)
    for r in runs:
        f = r["families"]["attn16_tp"]
        want = total - (experts - meta) // 2 - vocab // 2 - attn // 2
        assert f["reads"]["bytes"] == want, (r["process"], f["reads"]["bytes"], want)
        assert set(f["attention"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}, f["attention"]
        for name, spec in f["attention"].items():
            want_spec = [None, "tp"] if name == "o_proj" else ["tp"]
            assert spec["spec"] == want_spec and not spec["fully_addressable"], (name, spec)
            assert spec["shape"] == spec["global"], (name, spec)


def test_act_order_attention_over_tp_across_processes(runs):
    """Act-order GPTQ (the desc_act fixture, unrolled) over ``ep = 4 x tp = 2`` with tp across the
    processes: q / k / v (N) and o_proj (K: its whole scales, its g_idx cut) are global arrays split
    over tp, built from each process's slice, form and sizes the whole matrix's; the tokens are
    the single-device model's (the tokens test above)."""
    for r in runs:
        att = r["families"]["descact_tp"]["attention"]
        assert set(att) == {"q_proj", "k_proj", "v_proj", "o_proj"}, att
        for name, spec in att.items():                 # GPTQ qweight [1, K / 8, N]
            assert spec["spec"] == ([None, "tp"] if name == "o_proj" else [None, None, "tp"]), (name, spec)
            assert not spec["fully_addressable"], (name, spec)
            out, k = spec["global"]
            assert spec["shape"] == [1, k // 8, out], (name, spec)


def test_a_mesh_without_this_process_is_refused_before_any_read(runs):
    assert "bad_mesh" not in runs[0]
    msg = runs[1]["bad_mesh"]
    assert msg is not None, "process 1 loaded a model on a mesh of process 0's devices"
    assert "holds no device of this process (process 1 of 2)" in msg and "[0]" in msg, msg


def test_different_meshes_in_the_processes_are_refused_before_any_read(runs):
    for r in runs:
        msg = r["other_order"]
        assert msg is not None, r["process"]
        assert f"process {r['process']} of 2 was given a mesh" in msg and "the same mesh" in msg, msg


def test_bounded_in_time(runs):
    for r in runs:
        assert sum(r["seconds"].values()) < TIMEOUT_S, r["seconds"]


# --------------------------------------------------------------------------- the process checks, in this process


def _fake_run(monkeypatch, count: int, here: int):
    """``jax`` (as wna16_jax.models.mesh sees it) reporting ``count`` processes of 2 CPU devices each,
    this being process ``here``; returns the run's devices."""
    import jax

    from wna16_jax.models import mesh as mesh_mod

    class Dev(types.SimpleNamespace):
        __hash__ = object.__hash__
        __eq__ = object.__eq__

    devs = [Dev(id=i, platform="cpu", process_index=i // 2) for i in range(2 * count)]
    fake = types.SimpleNamespace(devices=lambda platform=None: devs, process_index=lambda: here,
                                 process_count=lambda platform=None: count)
    monkeypatch.setattr(mesh_mod, "jax", types.SimpleNamespace(**{**vars(jax), **vars(fake)}))
    return devs


def _mesh_of(devices):
    return types.SimpleNamespace(devices=np.array(devices, dtype=object))


def test_a_mesh_over_some_but_not_all_processes_is_a_config_error(monkeypatch):
    from wna16_jax.errors import ConfigError
    from wna16_jax.models.mesh import check_processes

    devs = _fake_run(monkeypatch, 3, 0)
    check_processes(_mesh_of(devs))                  # all three processes
    check_processes(_mesh_of(devs[:2]))              # this process alone: a model of its own
    with pytest.raises(ConfigError, match=r"spans processes \[0, 1\], but jax.process_count\(\) is 3: "
                                          r"processes \[2\] hold no device"):
        check_processes(_mesh_of(devs[:4]))
    with pytest.raises(ConfigError, match=r"holds no device of this process \(process 0 of 3\)"):
        check_processes(_mesh_of(devs[2:]))


def test_a_device_outside_the_run_is_a_config_error(monkeypatch):
    from wna16_jax.errors import ConfigError
    from wna16_jax.models.mesh import check_processes

    devs = _fake_run(monkeypatch, 1, 0)
    stranger = type(devs[0])(id=7, platform="cpu", process_index=0)
    with pytest.raises(ConfigError, match=r"are not among this run's 2 cpu devices"):
        check_processes(_mesh_of([devs[0], stranger]))
    with pytest.raises(ConfigError, match=r"mixes devices of several platforms \['cpu', 'gpu'\]"):
        check_processes(_mesh_of([devs[0], type(devs[0])(id=8, platform="gpu", process_index=0)]))
