"""Converted folders are whole checkpoints: `wna16-jax convert` writes, beside the converted MoE
layers, config.json, generation_config.json, the tokenizer files and every non-expert tensor of
the source byte for byte; `ConvertedCheckpoint` reads them through `Checkpoint`'s reading
interface; hostile folders and sources give typed errors and write nothing."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from wna16_jax.backends import TABLE, Backend
from wna16_jax.checkpoint import Checkpoint
from wna16_jax.cli import main, run_inspect
from wna16_jax.errors import (ConfigError, CorruptFileError, MissingTensorError, UnexpectedTensorError,
                              UnsafePathError, UnsupportedError, ValueRangeError)
from wna16_jax.models.generation_config import read_generation_config
from wna16_jax.models.synthetic import RandomModelSpec, write_random_model
from wna16_jax.nn import QuantizedMoE
from wna16_jax.schemes import QuantScheme
from wna16_jax.serialize import ConvertedCheckpoint, convert_checkpoint, open_checkpoint
from wna16_jax.sharding import tp_shards_from_checkpoint

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "quantizers")
#: the files beside the tensors that a converted folder must carry when the source has them
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "chat_template.jinja", "additional_chat_templates/tool_use.jinja")
#: a routed expert's tensor, as the quantization tools name them (test-side, independent of the library)
ROUTED_EXPERT = re.compile(r"\.(block_sparse_moe|mlp)\.experts\.\d+\.")
#: the float64 reference's tolerance (tests/test_real_quantizers.py explains the measured errors)
FLOAT_RTOL = 1e-5
GPTQ = QuantScheme.from_quant_config({"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                      "sym": True})
#: the random model's non-expert files: a cap this small splits its tensors over several files
SMALL_CAP = 20_000

_apply = nnx.jit(lambda m, x: m(x))


# --------------------------------------------------------------------------- helpers


def _snapshot(root) -> dict:
    """Every entry below ``root``, links not followed: path -> (kind, mode, size, content hash or link target)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(d, name)
            st = os.lstat(p)
            if os.path.islink(p):
                what = ("link", os.readlink(p))
            elif os.path.isdir(p):
                what = ("dir", None)
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    what = ("file", hashlib.sha256(f.read()).hexdigest())
            else:
                what = ("other", None)
            out[os.path.relpath(p, root)] = (*what, st.st_mode, st.st_size)
    return out


def _raw_tensors(paths) -> dict[str, tuple[str, tuple, bytes]]:
    """name -> (dtype, shape, bytes) of every tensor of the safetensors files ``paths``, parsed
    here from the format (8-byte header length, JSON header, data) — not by the library."""
    out = {}
    for path in paths:
        with open(path, "rb") as f:
            raw = f.read()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__", None)
        for name, e in header.items():
            b, end = e["data_offsets"]
            assert name not in out, name
            out[name] = (e["dtype"], tuple(e["shape"]), raw[8 + n + b:8 + n + end])
    return out


def _source_files(src) -> list[str]:
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    return [os.path.join(src, n) for n in names]


def _manifest(folder) -> dict:
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)


def _with_umask(mask, fn):
    old = os.umask(mask)
    try:
        return fn()
    finally:
        os.umask(old)


def _random_source(path) -> str:
    """A Qwen2-MoE (a shared expert with its gate, a dense MLP layer, q/k/v biases) with a fresh
    seed, and a tokenizer, generation config and chat templates (one of them a link inside the
    folder, as the Hugging Face cache lays files out)."""
    write_random_model(path, RandomModelSpec(model_type="qwen2_moe", scheme=GPTQ, num_layers=2, intermediate_size=96,
                                             shared_expert_intermediate_size=64, mlp_only_layers=[1], vocab_size=96,
                                             hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=4,
                                             top_k=2, moe_intermediate_size=64),
                       seed=int(np.random.default_rng().integers(1 << 30)))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copyfile(os.path.join(FIXTURES, "awq-mixtral", name), os.path.join(path, name))
    os.makedirs(os.path.join(path, "blobs"))
    with open(os.path.join(path, "blobs", "template"), "w") as f:
        f.write("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    os.symlink(os.path.join("blobs", "template"), os.path.join(path, "chat_template.jinja"))
    os.makedirs(os.path.join(path, "additional_chat_templates"))
    with open(os.path.join(path, "additional_chat_templates", "tool_use.jinja"), "w") as f:
        f.write("{{ tools }}")
    return path


@dataclasses.dataclass
class Case:
    name: str
    src: str
    out: str
    backend: Backend
    umask: int
    cap: int | None
    before: dict                  # the source folder before the conversion


#: (source, backend, umask, max_file_bytes): two real-tool checkpoints (through the command
#: line) and a random whole model (through the API, its other tensors split over several files)
CASE_SPECS = {
    "gptq-descact-qwen3moe": (os.path.join(FIXTURES, "gptq-descact-qwen3moe"), Backend.MARLIN, 0o027, None),
    "awq-mixtral": (os.path.join(FIXTURES, "awq-mixtral"), Backend.HUMMING, 0o022, None),
    "random-qwen2": (None, Backend.CPU, 0o002, SMALL_CAP),
}


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("converted")
    out = {}
    for name, (src, backend, umask, cap) in CASE_SPECS.items():
        src = src or _random_source(str(root / "random-src"))
        before = _snapshot(src)
        dst = str(root / name)
        if cap is None:
            rc = _with_umask(umask, lambda: main(["convert", src, "--backend", backend.value, "--out", dst]))
            assert rc == 0
        else:
            _with_umask(umask, lambda: convert_checkpoint(src, backend, dst, progress=False, max_file_bytes=cap))
        out[name] = Case(name, src, dst, backend, umask, cap, before)
    return out


@pytest.fixture(params=sorted(CASE_SPECS))
def case(request, cases) -> Case:
    return cases[request.param]


# --------------------------------------------------------------------------- what the folder holds


def test_folder_holds_the_whole_model(case):
    """config.json, generation_config.json and the tokenizer files equal the source's byte for
    byte; the folder holds exactly the layer files, the non-expert files and the manifest."""
    m = _manifest(case.out)
    assert m["version"] == 4
    copied = [n for n in MODEL_FILES if os.path.exists(os.path.join(case.src, n))]
    assert "config.json" in copied and "tokenizer.json" in copied
    for name in copied:
        with open(os.path.join(case.src, name), "rb") as a, open(os.path.join(case.out, name), "rb") as b:
            assert a.read() == b.read(), name
        assert not os.path.islink(os.path.join(case.out, name)), name
    assert sorted(m["model"]["copied"]) == sorted(copied)
    layers = [e["file"] for e in m["layers"].values()]
    files = {os.path.relpath(os.path.join(d, f), case.out) for d, _, fs in os.walk(case.out) for f in fs}
    assert files == {"manifest.json", *copied, *layers, *m["model"]["tensor_files"]}
    with open(os.path.join(case.src, "config.json")) as f:
        assert ConvertedCheckpoint(case.out).config == json.load(f)


def test_every_non_expert_tensor_is_copied_byte_for_byte(case):
    """Every tensor of the source but the routed experts' is in the non-expert files with its
    name, dtype, shape and bytes; no routed expert tensor is; each file keeps to the size cap."""
    src = _raw_tensors(_source_files(case.src))
    want = {n: v for n, v in src.items() if not ROUTED_EXPERT.search(n)}
    assert any("self_attn" in n for n in want) and "model.embed_tokens.weight" in want
    assert len(want) < len(src)                       # the experts are left out
    m = _manifest(case.out)
    files = sorted(m["model"]["tensor_files"])
    got = _raw_tensors(os.path.join(case.out, f) for f in files)
    assert sorted(got) == sorted(want)
    for n, (dtype, shape, data) in want.items():
        assert got[n][0] == dtype and got[n][1] == shape, n
        assert got[n][2] == data, f"{n}: bytes differ"
    assert m["model"]["weight_map"] == {n: f for f in files for n in _raw_tensors([os.path.join(case.out, f)])}
    if case.cap is not None:
        assert len(files) > 1
        for f in files:
            sizes = [len(v[2]) for v in _raw_tensors([os.path.join(case.out, f)]).values()]
            assert sum(sizes) <= case.cap or len(sizes) == 1, (f, sizes)


def test_files_read_with_the_reference_reader(case):
    """The non-expert files are plain safetensors files: the format's own reader opens them."""
    from safetensors import safe_open

    for f in _manifest(case.out)["model"]["tensor_files"]:
        with safe_open(os.path.join(case.out, f), framework="np") as h:
            assert h.metadata() == {"format": "pt"} and len(list(h.keys())) >= 1


def test_permissions_follow_the_umask(case):
    """The folder (and its sub-folder) get 0o777 less the umask, every file 0o666 less the umask."""
    for d, dirs, files in os.walk(case.out):
        assert os.stat(d).st_mode & 0o7777 == 0o777 & ~case.umask, d
        for f in files:
            assert os.stat(os.path.join(d, f)).st_mode & 0o7777 == 0o666 & ~case.umask, f
    leftovers = [e for e in os.listdir(os.path.dirname(case.out)) if e.startswith(".")]
    assert leftovers == []                               # no temporary folder left


def test_the_source_is_untouched(case):
    assert _snapshot(case.src) == case.before


# --------------------------------------------------------------------------- reading interface


def test_reading_interface_matches_the_source(case):
    conv, ckpt = ConvertedCheckpoint(case.out), Checkpoint(case.src)
    assert isinstance(open_checkpoint(case.out), ConvertedCheckpoint)
    assert isinstance(open_checkpoint(case.src), Checkpoint)
    assert open_checkpoint(conv) is conv
    assert conv.config == ckpt.config and conv.quant_config == ckpt.quant_config
    assert conv.model_config == ckpt.model_config and conv.scheme == ckpt.scheme
    assert conv.moe_layer_indices == ckpt.moe_layer_indices and conv.backend is case.backend
    names = conv.tensor_names()
    assert names == sorted(n for n in ckpt.tensor_names() if not ROUTED_EXPERT.search(n))
    weight_map = _manifest(case.out)["model"]["weight_map"]
    for n in names:
        a, b = conv.tensor_info(n), ckpt.tensor_info(n)
        assert (a.dtype_name, a.shape) == (b.dtype_name, b.shape), n
        got, want = conv.read_tensor(n), ckpt.read_tensor(n)
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), n
        assert conv.locate(n) == f"{n} (in {weight_map[n]})"
    first, second = names[0], names[-1]
    dst = np.empty(conv.tensor_info(first).shape, ckpt.read_tensor(first).dtype)
    got = conv.read_many([(first, dst)], [second])
    assert set(got) == {second} and dst.tobytes() == ckpt.read_tensor(first).tobytes()
    assert got[second].tobytes() == ckpt.read_tensor(second).tobytes()


def test_tokenizer_and_generation_config_read_from_the_folder(cases):
    from wna16_jax.models.tokenizer import load_tokenizer

    c = cases["awq-mixtral"]
    text = "the capital of france is"
    assert load_tokenizer(c.out).encode(text) == load_tokenizer(c.src).encode(text)
    vocab = Checkpoint(c.src).config["vocab_size"]
    assert read_generation_config(c.out, vocab_size=vocab) == read_generation_config(c.src, vocab_size=vocab)


def test_inspect_describes_a_converted_folder(case, capsys):
    assert run_inspect(case.out) == 0
    assert f"backend:    {case.backend.name}" in capsys.readouterr().out


# --------------------------------------------------------------------------- layers


def _source_moe(case, li):
    """The source's layer with its experts converted here in one piece (no chunks, no files)."""
    ckpt = Checkpoint(case.src)
    layer = ckpt.load_layer(li)
    experts = TABLE[case.backend].convert(ckpt.scheme, layer.experts.to_jax())
    return QuantizedMoE.from_layer(dataclasses.replace(layer, experts=experts), ckpt.model_config)


def test_from_checkpoint_equals_the_source_layer(case):
    """QuantizedMoE.from_checkpoint on the converted folder (a path and an opened folder) gives
    bit for bit the output of the source layer converted in memory; the real tools' layers also
    match their float64 reference."""
    rng = np.random.default_rng()
    conv = ConvertedCheckpoint(case.out)
    ref = None
    if os.path.isfile(os.path.join(case.src, "reference.npz")):
        with np.load(os.path.join(case.src, "reference.npz")) as z:
            ref = {k: z[k] for k in z.files}
    for li in conv.moe_layer_indices:
        x = (jnp.asarray(ref[f"layer{li}_x"]) if ref is not None
             else jnp.asarray(rng.standard_normal((12, conv.model_config.hidden_size)), jnp.float32))
        got, source = QuantizedMoE.from_checkpoint(case.out, li), _source_moe(case, li)
        assert type(got.expert_weights()) is type(source.expert_weights())
        y = np.asarray(_apply(got, x))
        assert np.isfinite(y).all() and np.abs(y).max() > 0
        np.testing.assert_array_equal(y, np.asarray(_apply(source, x)))
        np.testing.assert_array_equal(y, np.asarray(_apply(QuantizedMoE.from_checkpoint(conv, li), x)))
        if ref is not None:
            want = ref[f"layer{li}_out_float"]
            assert y.shape == want.shape
            err = np.abs(y.astype(np.float64) - want).max() / np.abs(want).max()
            assert err <= FLOAT_RTOL, err


def test_a_converted_folder_is_a_whole_model(case, capsys):
    """load_model on the converted folder: the source model's logits (float32; the converted MoE
    layers run their backend's layout, the rest is the source's bytes) and greedy tokens, and
    ``wna16-jax generate OUT`` runs it."""
    import warnings

    from wna16_jax.models import Generator, load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        conv, src = load_model(case.out, dtype=jnp.float32), load_model(case.src, dtype=jnp.float32)
    v = src.config.vocab_size
    toks = np.random.default_rng().integers(0, v, (1, 9)).astype(np.int32)
    a, b = np.asarray(conv(toks), np.float64), np.asarray(src(toks), np.float64)
    assert np.isfinite(a).all() and np.abs(a - b).max() <= 1e-4 * np.abs(b).max()
    prompt = [toks[0].tolist()]
    assert Generator(conv, batch_size=1, max_len=24).generate(prompt, 6) == \
        Generator(src, batch_size=1, max_len=24).generate(prompt, 6)
    assert main(["generate", case.out, "--prompt-ids", ",".join(map(str, prompt[0])), "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()


def test_older_manifest_versions_still_load_their_layers(tmp_path, cases):
    """A version-2 folder (only the layers) loads its layers as before; every whole-model part
    says the version lacks it."""
    c = cases["random-qwen2"]
    old = tmp_path / "v2"
    shutil.copytree(c.out, old)
    m = _manifest(old)
    for name in [*m["model"]["copied"], *m["model"]["tensor_files"]]:
        os.remove(old / name)
    del m["model"]
    m["version"] = 2
    (old / "manifest.json").write_text(json.dumps(m))
    conv = ConvertedCheckpoint(old)
    new = ConvertedCheckpoint(c.out)
    for li in conv.moe_layer_indices:
        a, b = conv.load_layer(li), new.load_layer(li)
        assert np.array_equal(a.router, b.router)
        for name, arr in a.experts.named_arrays().items():
            assert np.array_equal(np.asarray(arr), np.asarray(b.experts.named_arrays()[name])), name
    name = new.tensor_names()[0]
    for what, call in {"config": lambda: conv.config, "quant_config": lambda: conv.quant_config,
                       "tensor_names": conv.tensor_names, "tensor_info": lambda: conv.tensor_info(name),
                       "read_tensor": lambda: conv.read_tensor(name),
                       "read_many": lambda: conv.read_many([], [name])}.items():
        with pytest.raises(UnsupportedError) as e:
            call()
        assert "version 2" in str(e.value) and "manifest.json" in str(e.value), what
    assert conv.locate(name) == f"{name} (in ?)"


# --------------------------------------------------------------------------- hostile converted folders


def _edit(fn):
    """A mutation that edits the manifest with ``fn(manifest, folder)``."""
    def mutate(d):
        m = _manifest(d)
        fn(m, d)
        (d / "manifest.json").write_text(json.dumps(m))
    return mutate


def _first_file(d) -> str:
    return sorted(_manifest(d)["model"]["tensor_files"])[0]


def _record_size(m, d, name):
    m["model"]["copied" if name in m["model"]["copied"] else "tensor_files"][name]["bytes"] = \
        os.path.getsize(d / name)


def _truncate(name, keep_manifest_size=True):
    def mutate(d):
        name_ = name if name != "FIRST" else _first_file(d)
        size = os.path.getsize(d / name_)
        with open(d / name_, "r+b") as f:
            f.truncate(size - 16)
        if not keep_manifest_size:
            _edit(lambda m, d: _record_size(m, d, name_))(d)
    return mutate


def _link_out(name):
    def mutate(d):
        name_ = name if name != "FIRST" else _first_file(d)
        outside = d.parent / f"outside-{name_.replace('/', '_')}"
        shutil.copyfile(d / name_, outside)
        os.remove(d / name_)
        os.symlink(outside, d / name_)
    return mutate


def _edit_config(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts"] = 8
    (d / "config.json").write_text(json.dumps(cfg))
    _edit(lambda m, d: _record_size(m, d, "config.json"))(d)


def _move_one_tensor_to_an_unknown_file(m, d):
    name = sorted(m["model"]["weight_map"])[0]
    m["model"]["weight_map"][name] = "model-99999.safetensors"


def _list_an_absent_tensor(m, d):
    m["model"]["weight_map"]["model.evil.weight"] = _first_file(d)


def _unlist_a_tensor(m, d):
    first = _first_file(d)
    del m["model"]["weight_map"][next(n for n, f in sorted(m["model"]["weight_map"].items()) if f == first)]


def _rename_tensor_file(new):
    def edit(m, d):
        files = m["model"]["tensor_files"]
        first = _first_file(d)
        files[new] = files.pop(first)
        for n, f in m["model"]["weight_map"].items():
            if f == first:
                m["model"]["weight_map"][n] = new
    return _edit(edit)


#: case -> (mutation of a copy of the random model's converted folder, error, words the message names)
HOSTILE_FOLDERS = {
    "tensor-file-missing": (lambda d: os.remove(d / _first_file(d)), MissingTensorError, ["model-00001"]),
    "tensor-file-truncated": (_truncate("FIRST"), CorruptFileError, ["model-00001", "manifest records"]),
    "tensor-file-truncated-size-recorded": (_truncate("FIRST", keep_manifest_size=False), CorruptFileError,
                                            ["model-00001"]),
    "tensor-file-climbs-out": (_rename_tensor_file("../outside.safetensors"), UnsafePathError,
                               ["../outside.safetensors"]),
    "tensor-file-absolute": (_rename_tensor_file("/etc/passwd"), UnsafePathError, ["/etc/passwd"]),
    "tensor-file-link-out": (_link_out("FIRST"), UnsafePathError, ["model-00001", "outside"]),
    "weight-map-unknown-file": (_edit(_move_one_tensor_to_an_unknown_file), ConfigError,
                                ["weight_map", "model-99999.safetensors"]),
    "weight-map-absent-tensor": (_edit(_list_an_absent_tensor), MissingTensorError,
                                 ["model-00001", "model.evil.weight"]),
    "file-holds-unlisted-tensor": (_edit(_unlist_a_tensor), UnexpectedTensorError, ["model-00001", "weight_map"]),
    "config-missing": (lambda d: os.remove(d / "config.json"), MissingTensorError, ["config.json"]),
    "config-truncated": (_truncate("config.json"), CorruptFileError, ["config.json"]),
    "tokenizer-truncated": (_truncate("tokenizer.json"), CorruptFileError, ["tokenizer.json", "manifest records"]),
    "config-disagrees": (_edit_config, ConfigError, ["config.json", "num_experts", "8"]),
    "config-not-listed": (_edit(lambda m, d: m["model"]["copied"].pop("config.json")), ConfigError,
                          ["copied", "config.json"]),
    "tokenizer-link-out": (_link_out("tokenizer.json"), UnsafePathError, ["tokenizer.json", "outside"]),
    "layer-file-link-out": (_link_out("layer-00000.safetensors"), UnsafePathError, ["layer-00000.safetensors"]),
    "model-section-missing": (_edit(lambda m, d: m.pop("model")), ConfigError, ["'model'", "manifest.json"]),
    "bytes-negative": (_edit(lambda m, d: m["model"]["copied"]["tokenizer.json"].update(bytes=-1)), ConfigError,
                       ["tokenizer.json", "bytes", "-1"]),
    "bytes-bool": (_edit(lambda m, d: m["model"]["copied"]["config.json"].update(bytes=True)), ConfigError,
                   ["config.json", "bytes", "True"]),
    "weight-map-not-object": (_edit(lambda m, d: m["model"].update(weight_map=["a"])), ConfigError,
                              ["weight_map", "object"]),
}


def _read_everything(folder):
    conv = ConvertedCheckpoint(folder)
    conv.config
    for n in conv.tensor_names():
        conv.read_tensor(n)
    for li in conv.moe_layer_indices:
        conv.load_layer(li)


@pytest.mark.parametrize("name", sorted(HOSTILE_FOLDERS))
def test_hostile_converted_folders(tmp_path, cases, name):
    mutate, cls, words = HOSTILE_FOLDERS[name]
    d = tmp_path / "conv"
    shutil.copytree(cases["random-qwen2"].out, d, symlinks=True)
    mutate(d)
    before = _snapshot(tmp_path)
    with pytest.raises(cls) as e:
        _read_everything(d)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert _snapshot(tmp_path) == before


def test_the_unedited_copy_reads_cleanly(tmp_path, cases):
    """The unedited copy reads cleanly (so each refusal above is the edit's doing)."""
    d = tmp_path / "conv"
    shutil.copytree(cases["random-qwen2"].out, d, symlinks=True)
    _read_everything(d)


def test_tensor_reads_name_what_is_not_there(cases):
    conv = ConvertedCheckpoint(cases["random-qwen2"].out)
    expert = "model.layers.0.mlp.experts.0.gate_proj.qweight"
    for call in (conv.tensor_info, conv.read_tensor, lambda n: conv.read_many([], [n])):
        with pytest.raises(MissingTensorError, match=re.escape(expert)):
            call(expert)


# --------------------------------------------------------------------------- hostile sources and arguments


def _fifo(d):
    os.remove(d / "chat_template.jinja")
    os.mkfifo(d / "chat_template.jinja")


def _replace_with(name, make):
    def mutate(d):
        p = d / name
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
        make(d, p)
    return mutate


def _outside_file(d, p):
    outside = d.parent / "secret.json"
    outside.write_text('{"secret": 1}')
    os.symlink(outside, p)


def _outside_dir(d, p):
    outside = d.parent / "templates-outside"
    outside.mkdir()
    (outside / "evil.jinja").write_text("secret")
    os.symlink(outside, p)


#: case -> (mutation of a copy of the random source, error, words)
HOSTILE_SOURCES = {
    "tokenizer-link-out": (_replace_with("tokenizer.json", _outside_file), UnsafePathError,
                           ["tokenizer.json", "secret.json"]),
    "templates-dir-link-out": (_replace_with("additional_chat_templates", _outside_dir), UnsafePathError,
                               ["additional_chat_templates"]),
    "tokenizer-config-is-a-folder": (_replace_with("tokenizer_config.json", lambda d, p: p.mkdir()), ConfigError,
                                     ["tokenizer_config.json", "regular file"]),
    "generation-config-dangling-link": (_replace_with("generation_config.json",
                                                      lambda d, p: os.symlink("gone.json", p)),
                                        CorruptFileError, ["generation_config.json", "does not exist"]),
    "chat-template-is-a-fifo": (_fifo, ConfigError, ["chat_template.jinja", "regular file"]),
}


def _source_copy(tmp_path, cases):
    src = tmp_path / "work" / "src"
    shutil.copytree(cases["random-qwen2"].src, src, symlinks=True)
    return src


@pytest.mark.parametrize("name", sorted(HOSTILE_SOURCES))
def test_hostile_sources_write_nothing(tmp_path, cases, name):
    mutate, cls, words = HOSTILE_SOURCES[name]
    src = _source_copy(tmp_path, cases)
    mutate(src)
    before = _snapshot(tmp_path)
    with pytest.raises(cls) as e:
        convert_checkpoint(src, "cpu", tmp_path / "work" / "out", progress=False)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    assert _snapshot(tmp_path) == before                  # no output, no temporary folder, source as it was


@pytest.mark.parametrize("value", [0, -5, True, "4096", 2.5, None])
def test_max_file_bytes_is_checked(tmp_path, cases, value):
    src = _source_copy(tmp_path, cases)
    before = _snapshot(tmp_path)
    with pytest.raises(ConfigError, match="max_file_bytes"):
        convert_checkpoint(src, "cpu", tmp_path / "work" / "out", progress=False, max_file_bytes=value)
    assert _snapshot(tmp_path) == before


def test_a_converted_folder_is_not_a_source(tmp_path, cases):
    c = cases["random-qwen2"]
    before = _snapshot(tmp_path), _snapshot(c.out)
    with pytest.raises(ConfigError, match="manifest.json"):
        convert_checkpoint(c.out, "cpu", tmp_path / "again", progress=False)
    with pytest.raises(ConfigError, match="ConvertedCheckpoint"):
        convert_checkpoint(ConvertedCheckpoint(c.out), "cpu", tmp_path / "again", progress=False)
    with pytest.raises(ConfigError, match="src"):
        convert_checkpoint(123, "cpu", tmp_path / "again", progress=False)
    assert (_snapshot(tmp_path), _snapshot(c.out)) == before


def test_links_inside_the_source_are_copied_as_files(cases):
    """chat_template.jinja is a link inside the source (as in the Hugging Face cache): the
    converted folder holds a regular file with its content."""
    c = cases["random-qwen2"]
    out = os.path.join(c.out, "chat_template.jinja")
    assert os.path.islink(os.path.join(c.src, "chat_template.jinja")) and not os.path.islink(out)
    with open(os.path.join(c.src, "blobs", "template"), "rb") as a, open(out, "rb") as b:
        assert a.read() == b.read()


def _cache_snapshot(root, src) -> str:
    """``src`` laid out as a Hugging Face cache repository: every file a link from
    ``snapshots/<commit>/`` into ``blobs/``; returns the snapshot folder."""
    repo = root / "models--org--tiny"
    snap = repo / "snapshots" / ("ab" * 20)
    (repo / "blobs").mkdir(parents=True)
    for d, _, files in os.walk(src):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), src)
            blob = hashlib.sha256(rel.encode()).hexdigest()
            shutil.copyfile(os.path.join(d, f), repo / "blobs" / blob)
            (snap / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(repo / "blobs" / blob, (snap / rel).parent), snap / rel)
    return str(snap)


def test_a_cache_snapshot_is_copied_from_its_blob_store(tmp_path, cases):
    """A Hugging Face cache snapshot's files are links into the repository's blobs/: they are
    copied; a link elsewhere out of the snapshot is still refused, with nothing written."""
    c = cases["random-qwen2"]
    snap = _cache_snapshot(tmp_path / "cache", c.src)
    before = _snapshot(tmp_path / "cache")
    out = convert_checkpoint(snap, "cpu", tmp_path / "out", progress=False)
    for name in MODEL_FILES:
        assert not os.path.islink(os.path.join(out, name))
        with open(os.path.join(c.src, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    assert ConvertedCheckpoint(out).tensor_names() == ConvertedCheckpoint(c.out).tensor_names()
    assert _snapshot(tmp_path / "cache") == before
    secret = tmp_path / "cache" / "models--org--tiny" / "secret.json"
    secret.write_text("{}")
    os.remove(os.path.join(snap, "tokenizer_config.json"))
    os.symlink(secret, os.path.join(snap, "tokenizer_config.json"))
    before = _snapshot(tmp_path)
    with pytest.raises(UnsafePathError, match="tokenizer_config.json"):
        convert_checkpoint(snap, "cpu", tmp_path / "out2", progress=False)
    assert _snapshot(tmp_path) == before


def test_entry_points_that_take_a_converted_checkpoint_are_typed(cases):
    c = cases["random-qwen2"]
    conv = ConvertedCheckpoint(c.out)
    cases_ = [
        (lambda: QuantizedMoE.from_checkpoint(c.out, 0, "marlin"), ConfigError, ["cpu", "marlin"]),
        (lambda: QuantizedMoE.from_checkpoint(conv, 1), ValueRangeError, ["layer_index", "1"]),
        (lambda: QuantizedMoE.from_checkpoint(c.out, True), ValueRangeError, ["layer_index", "True"]),
        (lambda: QuantizedMoE.from_checkpoint(123, 0), ConfigError, ["path", "int"]),
        (lambda: Checkpoint(conv), ConfigError, ["ConvertedCheckpoint", "Checkpoint"]),
        (lambda: tp_shards_from_checkpoint(conv, 0, 2), ConfigError, ["Checkpoint", "ConvertedCheckpoint"]),
        (lambda: ConvertedCheckpoint(None), ConfigError, ["path", "NoneType"]),
        (lambda: open_checkpoint(3.5), ConfigError, ["path", "float"]),
    ]
    for call, cls, words in cases_:
        with pytest.raises(cls) as e:
            call()
        for w in words:
            assert w in str(e.value), (w, str(e.value))
