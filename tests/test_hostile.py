"""Hostile input: malformed checkpoints, indexes, manifests, configs, hand-built pytrees and CLI
calls. Every case asserts the typed error (a ``WNA16Error`` subclass), that the message names the
offending file / tensor / field, that nothing was written outside the test's temporary folder and
that the inputs were not mutated. Where the right answer is to accept an input (a format-legal
edge value, a symlinked shard), the case says so and checks the result."""

import hashlib
import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wna16_jax import routing
from wna16_jax.backends import TABLE, Backend
from wna16_jax.checkpoint import Checkpoint
from wna16_jax.writers import random_checkpoint_weights, random_moe_layer, write_checkpoint
from wna16_jax.cli import main
from wna16_jax.convert.cpu import convert_cpu
from wna16_jax.errors import (ConfigError, CorruptFileError, DTypeError, MissingTensorError, OutputPathError,
                              ShapeError, UnexpectedTensorError, UnsafePathError, UnsupportedError,
                              ValueRangeError, WNA16Error)
from wna16_jax.moe import fused_moe
from wna16_jax.schemes import QuantScheme
from wna16_jax.serialize import ConvertedCheckpoint, convert_checkpoint

E, H, I = 4, 128, 128
GPTQ = QuantScheme("gptq", 4, 64, False)
AWQ = QuantScheme("awq", 4, 64, True)
CT = QuantScheme("compressed-tensors", 4, 64, False)
LAYER0 = "model.layers.0.block_sparse_moe.experts"


# --------------------------------------------------------------------------- helpers


def _snapshot(root) -> dict[str, str]:
    """Every file under ``root`` (symlinks not followed) with its content hash."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p):
                out[os.path.relpath(p, root)] = "link:" + os.readlink(p)
            else:
                with open(p, "rb") as fh:
                    out[os.path.relpath(p, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """One tiny checkpoint per format, written once; tests copy them."""
    root = tmp_path_factory.mktemp("templates")
    rng = np.random.default_rng(0)
    out = {}
    for name, scheme, mt in (("gptq", GPTQ, "mixtral"), ("awq", AWQ, "qwen3_moe"), ("ct", CT, "mixtral"),
                             ("gptq_sharded", GPTQ, "mixtral")):
        layers = [random_moe_layer(rng, E, H, I)] * (2 if name == "gptq_sharded" else 1)
        write_checkpoint(root / name, scheme, layers, model_type=mt,
                         max_shard_bytes=60_000 if name == "gptq_sharded" else None)
    out.update({n: root / n for n in ("gptq", "awq", "ct", "gptq_sharded")})
    return out


class Sandbox:
    """A copy of a template inside ``tmp/work``; ``check()`` asserts that nothing outside
    ``allowed`` changed and that the checkpoint folder is unmodified unless edited by the test."""

    def __init__(self, tmp_path, template):
        self.tmp = tmp_path
        self.dir = tmp_path / "work" / "ckpt"
        shutil.copytree(template, self.dir)
        self.outside = tmp_path / "outside"
        self.outside.mkdir()
        (self.outside / "secret.safetensors").write_bytes(b"not yours")
        self.before = None

    def freeze(self):
        """Snapshot everything after the test has finished preparing its hostile input."""
        self.before = _snapshot(self.tmp)
        return self

    def check(self, allowed=()):
        after = _snapshot(self.tmp)
        changed = {k for k in set(self.before) | set(after) if self.before.get(k) != after.get(k)}
        bad = {k for k in changed if not any(k.startswith(a) for a in allowed)}
        assert not bad, f"files written or changed outside what the call may touch: {sorted(bad)}"

    # -- editing helpers
    @property
    def st(self):
        return self.dir / "model.safetensors"

    def config(self, fn):
        p = self.dir / "config.json"
        cfg = json.loads(p.read_text())
        fn(cfg)
        p.write_text(json.dumps(cfg))

    def header(self, fn, path=None):
        """Rewrite a safetensors header: ``fn(header_dict) -> dict | bytes``; data unchanged."""
        path = path or self.st
        raw = path.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + n])
        new = fn(header)
        hb = new if isinstance(new, bytes) else json.dumps(new).encode()
        path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])

    def tensors(self, fn):
        from safetensors.numpy import load_file, save_file

        t = load_file(self.st)
        fn(t)
        save_file(t, self.st, metadata={"format": "pt"})


def _raises(cls, call, *words):
    with pytest.raises(cls) as ei:
        call()
    msg = str(ei.value)
    assert isinstance(ei.value, WNA16Error)
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


def _load(path):
    return Checkpoint(path).load_layer(0)


# --------------------------------------------------------------------------- corrupt safetensors


CORRUPT = {
    # name: (edit on the sandbox, words the message must hold)
    "truncated": (lambda s: s.st.write_bytes(s.st.read_bytes()[:-1000]), ["model.safetensors", "past the end"]),
    "empty": (lambda s: s.st.write_bytes(b""), ["model.safetensors", "too short"]),
    "seven_bytes": (lambda s: s.st.write_bytes(b"\x01" * 7), ["model.safetensors", "too short"]),
    "header_past_end": (lambda s: s.st.write_bytes(struct.pack("<Q", 10_000) + b"{}"),
                        ["model.safetensors", "header length 10000"]),
    "header_absurd": (lambda s: s.st.write_bytes(struct.pack("<Q", 2**63) + b"{}" * 8),
                      ["model.safetensors", "exceeds"]),
    "header_not_json": (lambda s: s.header(lambda h: b"{this is not json"), ["model.safetensors", "JSON"]),
    "header_not_utf8": (lambda s: s.header(lambda h: b"\xff\xfe{}"), ["model.safetensors", "UTF-8"]),
    "header_a_list": (lambda s: s.header(lambda h: [1, 2]), ["model.safetensors", "object"]),
    "unknown_dtype": (lambda s: s.header(lambda h: {**h, f"{LAYER0}.0.w1.qweight": {
        **h[f"{LAYER0}.0.w1.qweight"], "dtype": "Q4_K"}}), ["w1.qweight", "Q4_K"]),
    "shape_bytes_mismatch": (lambda s: s.header(lambda h: {**h, f"{LAYER0}.0.w1.scales": {
        **h[f"{LAYER0}.0.w1.scales"], "shape": [3, 128]}}), ["w1.scales", "needs"]),
    "negative_dim": (lambda s: s.header(lambda h: {**h, f"{LAYER0}.0.w1.scales": {
        **h[f"{LAYER0}.0.w1.scales"], "shape": [-2, 128]}}), ["w1.scales", "non-negative"]),
    "offsets_out_of_range": (lambda s: s.header(lambda h: {**h, f"{LAYER0}.0.w2.qweight": {
        **h[f"{LAYER0}.0.w2.qweight"], "data_offsets": [10**9, 10**9 + 4 * 16 * 128]}}),
        ["w2.qweight", "past the end"]),
    "offsets_three": (lambda s: s.header(lambda h: {**h, f"{LAYER0}.0.w2.qweight": {
        **h[f"{LAYER0}.0.w2.qweight"], "data_offsets": [0, 1, 2]}}), ["w2.qweight", "data_offsets"]),
    "offsets_reversed": (lambda s: s.header(lambda h: {**h, f"{LAYER0}.0.w2.qweight": {
        **h[f"{LAYER0}.0.w2.qweight"], "data_offsets": h[f"{LAYER0}.0.w2.qweight"]["data_offsets"][::-1]}}),
        ["w2.qweight", "begin <= end"]),
    "overlap": (lambda s: s.header(lambda h: {**h, f"{LAYER0}.1.w2.qweight": {
        **h[f"{LAYER0}.1.w2.qweight"], "data_offsets": h[f"{LAYER0}.0.w2.qweight"]["data_offsets"]}}),
        ["model.safetensors", "overlap"]),
    "duplicate_key": (lambda s: s.header(lambda h: json.dumps(h)[:-1].encode()
                                         + b', "' + f"{LAYER0}.0.w1.scales".encode() + b'": '
                                         + json.dumps(h[f"{LAYER0}.0.w1.scales"]).encode() + b"}"),
                      ["model.safetensors", "twice"]),
    "metadata_not_strings": (lambda s: s.header(lambda h: {**h, "__metadata__": {"format": 3}}),
                             ["model.safetensors", "__metadata__"]),
    "entry_not_object": (lambda s: s.header(lambda h: {**h, f"{LAYER0}.0.w1.g_idx": "nope"}),
                         ["w1.g_idx", "object"]),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_safetensors(tmp_path, templates, case):
    s = Sandbox(tmp_path, templates["gptq"])
    edit, words = CORRUPT[case]
    edit(s)
    s.freeze()
    _raises(CorruptFileError, lambda: _load(s.dir), *words)
    s.check()


def test_inspect_truncated_shard_prints_one_line(tmp_path, templates, capsys):
    s = Sandbox(tmp_path, templates["gptq"])
    s.st.write_bytes(s.st.read_bytes()[:-1000])
    s.freeze()
    assert main(["inspect", str(s.dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: CorruptFileError") and "model.safetensors" in err[0]
    s.check()


def test_truncated_data_after_valid_header(tmp_path, templates):
    """A shard cut inside a tensor the header promised: refused when the header is read."""
    s = Sandbox(tmp_path, templates["gptq"])
    raw = s.st.read_bytes()
    s.st.write_bytes(raw[:len(raw) // 2])
    s.freeze()
    _raises(CorruptFileError, lambda: _load(s.dir), "model.safetensors", "truncated")
    s.check()


# --------------------------------------------------------------------------- index files


def _index(s):
    p = s.dir / "model.safetensors.index.json"
    return p, json.loads(p.read_text())


def _edit_index(s, fn):
    p, doc = _index(s)
    new = fn(doc)
    p.write_text(new if isinstance(new, str) else json.dumps(new))


def _first(doc):
    return sorted(doc["weight_map"])[0]


@pytest.mark.parametrize("target, cls, words", [
    ("../outside/secret.safetensors", UnsafePathError, ["..", "weight_map"]),
    ("sub/../../outside/secret.safetensors", UnsafePathError, [".."]),
    ("/etc/passwd", UnsafePathError, ["/etc/passwd"]),
    ("ABS_OUTSIDE", UnsafePathError, ["secret.safetensors"]),
    ("..\\outside\\secret.safetensors", UnsafePathError, ["backslash"]),
    ("", UnsafePathError, ["non-empty string"]),
    (7, UnsafePathError, ["7"]),
    (None, UnsafePathError, ["None"]),
    ("pytorch_model.bin", UnsafePathError, ["pytorch_model.bin", "pickled"]),
    ("model-00009-of-00009.safetensors", MissingTensorError, ["model-00009-of-00009.safetensors"]),
])
def test_index_entries(tmp_path, templates, target, cls, words):
    s = Sandbox(tmp_path, templates["gptq_sharded"])
    if target == "ABS_OUTSIDE":
        target = str(s.outside / "secret.safetensors")
    _edit_index(s, lambda d: {**d, "weight_map": {**d["weight_map"], _first(d): target}})
    s.freeze()
    msg = _raises(cls, lambda: Checkpoint(s.dir), *words)
    assert "model.safetensors.index.json" in msg
    s.check()


@pytest.mark.parametrize("text, words", [
    ("{not json", ["not valid JSON"]),
    ("[1, 2]", ["weight_map"]),
    ('{"weight_map": []}', ["weight_map"]),
    ('{"weight_map": {}}', ["weight_map"]),
    ('{"metadata": {}}', ["weight_map"]),
    ('{"weight_map": {"a": "x.safetensors", "a": "y.safetensors"}}', ["twice"]),
    ("\udcff", ["UTF-8"]),
])
def test_index_documents(tmp_path, templates, text, words):
    s = Sandbox(tmp_path, templates["gptq_sharded"])
    p, _ = _index(s)
    p.write_bytes(text.encode("utf-8", "surrogateescape"))
    s.freeze()
    _raises(CorruptFileError, lambda: Checkpoint(s.dir), "model.safetensors.index.json", *words)
    s.check()


def test_index_promises_a_tensor_the_shard_lacks(tmp_path, templates):
    s = Sandbox(tmp_path, templates["gptq_sharded"])
    _, doc = _index(s)
    name = f"{LAYER0}.2.w3.scales"
    other = next(f for f in set(doc["weight_map"].values()) if f != doc["weight_map"][name])
    _edit_index(s, lambda d: {**d, "weight_map": {**d["weight_map"], name: other}})
    s.freeze()
    _raises(MissingTensorError, lambda: _load(s.dir), name, other)
    s.check()


def test_symlinked_shards_are_followed(tmp_path, templates):
    """Accepted: the Hugging Face cache lays snapshots out as links into a blob store. The names
    in the index stay inside the folder; the links may point anywhere. Same result as the copy."""
    s = Sandbox(tmp_path, templates["gptq_sharded"])
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for f in sorted(os.listdir(s.dir)):
        if f.endswith(".safetensors"):
            shutil.move(s.dir / f, blobs / f)
            os.symlink(blobs / f, s.dir / f)
    s.freeze()
    got = _load(s.dir)
    want = _load(templates["gptq_sharded"])
    for a, b in zip(jax.tree_util.tree_leaves(got.experts), jax.tree_util.tree_leaves(want.experts)):
        np.testing.assert_array_equal(a, b)
    s.check()


def test_symlinked_checkpoint_folder(tmp_path, templates):
    """Accepted: the folder itself may be a link."""
    link = tmp_path / "link"
    os.symlink(templates["gptq"], link)
    np.testing.assert_array_equal(_load(link).router, _load(templates["gptq"]).router)


@pytest.mark.parametrize("files", [["pytorch_model.bin"], ["model.pt", "config.json"]])
def test_only_pickled_weights_are_refused(tmp_path, templates, files):
    s = Sandbox(tmp_path, templates["gptq"])
    os.remove(s.st)
    for f in files:
        if f != "config.json":
            (s.dir / f).write_bytes(b"\x80\x04pickled")
    s.freeze()
    _raises(UnsupportedError, lambda: Checkpoint(s.dir), "never", "unpickle", files[0])
    s.check()


# --------------------------------------------------------------------------- converted manifests


@pytest.fixture(scope="module")
def converted(templates, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "marlin"
    convert_checkpoint(templates["awq"], "marlin", out, progress=False)
    return out


def _manifest(s):
    p = s.dir / "manifest.json"
    return p, json.loads(p.read_text())


def _edit_manifest(s, fn):
    p, m = _manifest(s)
    new = fn(m)
    p.write_text(new if isinstance(new, str) else json.dumps(new))


def _set(path, value):
    def fn(m):
        node = m
        for k in path[:-1]:
            node = node[k]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return m
    return fn


MANIFESTS = {
    "class_is_a_library_function": (_set(["layers", "0", "experts", "class"],
                                         "wna16_jax.serialize:convert_checkpoint"), ConfigError,
                                    ["convert_checkpoint", "layouts"]),
    "class_is_os_system": (_set(["layers", "0", "experts", "class"], "os:system"), ConfigError, ["os:system"]),
    "class_unknown_name": (_set(["layers", "0", "experts", "class"], "EvilWeights"), ConfigError, ["EvilWeights"]),
    "class_not_a_string": (_set(["layers", "0", "experts", "class"], ["x"]), ConfigError, ["class"]),
    "file_climbs_out": (_set(["layers", "0", "file"], "../../outside/secret.safetensors"), UnsafePathError,
                        ["..", "layers['0'].file"]),
    "file_absolute": (_set(["layers", "0", "file"], "/etc/passwd"), UnsafePathError, ["/etc/passwd"]),
    "file_missing": (_set(["layers", "0", "file"], "layer-00099.safetensors"), MissingTensorError,
                     ["layer-00099.safetensors"]),
    "backend_unknown": (_set(["backend"], "TPU_MAGIC"), ConfigError, ["backend", "TPU_MAGIC"]),
    "backend_missing": (_set(["backend"], KeyError), ConfigError, ["backend"]),
    "layers_missing": (_set(["layers"], KeyError), ConfigError, ["layers"]),
    "layers_bad_key": (_set(["layers"], {"zero": {}}), ConfigError, ["layers"]),
    "layer_entry_not_object": (_set(["layers", "0"], 5), ConfigError, ["layers['0']"]),
    "scheme_unknown_field": (_set(["scheme", "evil"], 1), ConfigError, ["evil"]),
    "scheme_bits_3": (_set(["scheme", "bits"], 3), ConfigError, ["bits", "3"]),
    "scheme_bits_string": (_set(["scheme", "bits"], "4"), ConfigError, ["bits"]),
    "version_99": (_set(["version"], 99), ConfigError, ["version 99"]),
    "meta_missing_key": (_set(["layers", "0", "experts", "meta", "hidden_size"], KeyError), ConfigError, ["meta"]),
    "tensors_unknown_field": (_set(["layers", "0", "experts", "tensors", "evil"], {"shape": [1], "dtype": "int32"}),
                              ConfigError, ["evil"]),
    "tensor_shape_differs": (_set(["layers", "0", "experts", "tensors", "w13_qweight", "shape"], [99, 1]),
                             ShapeError, ["w13_qweight"]),
    "meta_hidden_size_wrong": (_set(["layers", "0", "experts", "meta", "hidden_size"], 256), ShapeError,
                               ["hidden size"]),
    "model_config_not_int": (_set(["model_config", "num_experts"], "four"), ConfigError, ["num_experts"]),
    "model_config_unknown": (_set(["model_config", "evil"], 1), ConfigError, ["evil"]),
    "routing_not_object": (_set(["model_config", "routing"], 5), ConfigError, ["model_config.routing", "5"]),
    "routing_unknown": (_set(["model_config", "routing", "evil"], 1), ConfigError, ["model_config.routing", "evil"]),
    "routing_top_k_zero": (_set(["model_config", "routing", "top_k"], 0), ConfigError, ["model_config.top_k", "0"]),
    "routing_top_k_missing": (_set(["model_config", "routing", "top_k"], KeyError), ConfigError,
                              ["model_config", "incomplete", "top_k"]),
    "routing_top_k_past_experts": (_set(["model_config", "routing", "top_k"], 99), ConfigError, ["top_k", "99"]),
    "routing_scoring_unknown": (_set(["model_config", "routing", "scoring_func"], "relu"), ConfigError,
                                ["scoring_func", "relu"]),
    "routing_flag_not_bool": (_set(["model_config", "routing", "renormalize"], "yes"), ConfigError,
                              ["renormalize", "yes"]),
    "not_json": (lambda m: "{]", CorruptFileError, ["manifest.json", "JSON"]),
    "a_list": (lambda m: "[]", CorruptFileError, ["manifest.json", "object"]),
}


@pytest.mark.parametrize("case", sorted(MANIFESTS))
def test_manifests(tmp_path, converted, case):
    s = Sandbox(tmp_path, converted)
    edit, cls, words = MANIFESTS[case]
    _edit_manifest(s, edit)
    s.freeze()
    _raises(cls, lambda: ConvertedCheckpoint(s.dir).load_layer(0), *words)
    s.check()


def test_layer_file_with_a_foreign_tensor(tmp_path, converted):
    from safetensors.numpy import load_file, save_file

    s = Sandbox(tmp_path, converted)
    f = s.dir / "layer-00000.safetensors"
    t = load_file(f)
    t["evil"] = np.zeros(3, np.float32)
    save_file(t, f)
    s.freeze()
    _raises(UnexpectedTensorError, lambda: ConvertedCheckpoint(s.dir).load_layer(0), "evil")
    s.check()


def test_converted_round_trip_carries_model_config(tmp_path, converted, templates):
    conv = ConvertedCheckpoint(converted)
    assert conv.model_config == Checkpoint(templates["awq"]).model_config


def test_a_version_3_manifest_with_flat_routing_is_still_read(tmp_path, converted, templates):
    """Versions 1-3 wrote the routing fields flat in ``model_config``; version 4 nests them.
    A manifest rewritten the old way reads to the same config and the same layer."""
    s = Sandbox(tmp_path, converted)

    def flatten(m):
        m["version"] = 3
        m["model_config"].update(m["model_config"].pop("routing"))
        return m
    _edit_manifest(s, flatten)
    s.freeze()
    old, new = ConvertedCheckpoint(s.dir), ConvertedCheckpoint(converted)
    assert old.version == 3 and old.model_config == new.model_config == Checkpoint(templates["awq"]).model_config
    a, b = old.load_layer(0), new.load_layer(0)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.experts), jax.tree.leaves(b.experts)))
    s.check()


# --------------------------------------------------------------------------- config.json vs tensors


CONFIGS = {
    "num_experts_too_many": (lambda c: c.update(num_experts=6), ConfigError, ["num_experts", "6", "4"]),
    "hidden_size_wrong": (lambda c: c.update(hidden_size=256), ConfigError, ["hidden_size", "256", "128"]),
    "intermediate_wrong": (lambda c: c.update(moe_intermediate_size=64), ConfigError,
                           ["moe_intermediate_size", "64", "128"]),
    "num_experts_string": (lambda c: c.update(num_experts="eight"), ConfigError, ["num_experts", "eight"]),
    "num_experts_fraction": (lambda c: c.update(num_experts=4.5), ConfigError, ["num_experts", "4.5"]),
    "num_experts_bool": (lambda c: c.update(num_experts=True), ConfigError, ["num_experts", "True"]),
    "top_k_above_experts": (lambda c: c.update(num_experts_per_tok=9), ConfigError, ["num_experts_per_tok", "9"]),
    "top_k_zero": (lambda c: c.update(num_experts_per_tok=0), ConfigError, ["num_experts_per_tok"]),
    "scoring_unknown": (lambda c: c.update(scoring_func="magic"), ConfigError, ["scoring_func", "magic"]),
    "norm_topk_not_bool": (lambda c: c.update(norm_topk_prob="yes"), ConfigError, ["norm_topk_prob"]),
    "no_quantization": (lambda c: c.pop("quantization_config"), ConfigError, ["quantization_config"]),
    "bits_3": (lambda c: c["quantization_config"].update(bits=3), ConfigError, ["bits", "3"]),
    "group_size_zero": (lambda c: c["quantization_config"].update(group_size=0), ConfigError, ["group_size"]),
    "group_size_string": (lambda c: c["quantization_config"].update(group_size="128"), ConfigError, ["group_size"]),
    "quant_method_unknown": (lambda c: c["quantization_config"].update(quant_method="fp8"), ConfigError,
                             ["quant_method", "fp8"]),
    "dynamic_bad_regex": (lambda c: c["quantization_config"].update(dynamic={"-:(": {}}), ConfigError,
                          ["dynamic", "regular expression"]),
    "dynamic_skips_experts": (lambda c: c["quantization_config"].update(dynamic={"-:.*experts.*": {}}),
                              ConfigError, ["not quantized", "dynamic"]),
    "dynamic_experts_differ": (lambda c: c["quantization_config"].update(dynamic={r".*\.w2$": {"bits": 8}}),
                               ConfigError, ["mix", "8-bit", "4-bit"]),
}


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_configs(tmp_path, templates, case):
    # the model-size cases use the Qwen3-MoE checkpoint (num_experts, moe_intermediate_size);
    # the quantization cases the GPTQ one (GPTQModel's ``dynamic`` rules are GPTQ's)
    quant = case in ("no_quantization", "bits_3", "group_size_zero", "group_size_string", "quant_method_unknown") \
        or case.startswith("dynamic")
    s = Sandbox(tmp_path, templates["gptq" if quant else "awq"])
    edit, cls, words = CONFIGS[case]
    s.config(edit)
    s.freeze()
    _raises(cls, lambda: _load(s.dir), *words)
    s.check()


def test_config_json_not_json_or_not_object(tmp_path, templates):
    s = Sandbox(tmp_path, templates["gptq"])
    (s.dir / "config.json").write_text("{nope")
    s.freeze()
    _raises(CorruptFileError, lambda: Checkpoint(s.dir), "config.json", "JSON")
    (s.dir / "config.json").write_text("[]")
    _raises(ConfigError, lambda: Checkpoint(s.dir), "config.json", "object")


def _ct_groups(**groups):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {name: {"targets": targets, "weights": {
                "num_bits": bits, "type": "int", "symmetric": True, "strategy": "group" if g else "channel",
                "group_size": g}} for name, (targets, bits, g) in groups.items()}}


def test_mixed_precision_compressed_tensors_loads(tmp_path, templates):
    """Accepted: attention at 8 bits, experts at 4 bits (an llm-compressor recipe). The experts'
    group is the one whose targets match their Linear names; the result equals the uniform load."""
    s = Sandbox(tmp_path, templates["ct"])
    s.config(lambda c: c.update(quantization_config=_ct_groups(
        attention=(["re:.*self_attn.*"], 8, None), experts=(["re:.*experts.*"], 4, 64))))
    s.freeze()
    ckpt = Checkpoint(s.dir)
    assert ckpt.scheme.bits == 4 and ckpt.scheme.group_size == 64
    assert ckpt.quant_config.scheme_for("model.layers.0.self_attn.q_proj").bits == 8
    assert ckpt.quant_config.scheme_for("lm_head") is None
    got, want = ckpt.load_layer(0), _load(templates["ct"])
    for a, b in zip(jax.tree_util.tree_leaves(got.experts), jax.tree_util.tree_leaves(want.experts)):
        np.testing.assert_array_equal(a, b)
    s.check()


@pytest.mark.parametrize("groups, words", [
    # gate/up at 4-bit g64, down at 8-bit: the experts mix schemes → both groups named
    (dict(gate_up=(["re:.*w[13]$"], 4, 64), down=(["re:.*w2$"], 8, None)), ["gate_up", "down", "mix"]),
    # experts matched by no group
    (dict(attention=(["re:.*self_attn.*"], 4, 64)), ["not quantized", "no config group"]),
    # two groups claim the experts at the same rank with different schemes
    (dict(a=(["re:.*experts.*"], 4, 64), b=(["re:.*experts.*"], 8, None)), ["equally", "a", "b"]),
])
def test_mixed_schemes_refused(tmp_path, templates, groups, words):
    s = Sandbox(tmp_path, templates["ct"])
    s.config(lambda c: c.update(quantization_config=_ct_groups(**groups)))
    s.freeze()
    _raises(ConfigError, lambda: Checkpoint(s.dir), *words)
    s.check()


def test_ignored_experts_refused(tmp_path, templates):
    s = Sandbox(tmp_path, templates["ct"])
    s.config(lambda c: c["quantization_config"].update(ignore=["re:.*experts.*"]))
    s.freeze()
    _raises(ConfigError, lambda: Checkpoint(s.dir), "experts.0.w1", "ignore")
    s.check()


# --------------------------------------------------------------------------- tensor values


@pytest.mark.parametrize("bad, proj", [(np.nan, "w2"), (np.inf, "w1"), (-np.inf, "w3")])
def test_non_finite_scales(tmp_path, templates, bad, proj):
    """The check runs over the layer's stacked scales; the message still names the tensor (gate,
    up or down) as the file names it."""
    s = Sandbox(tmp_path, templates["gptq"])
    name = f"{LAYER0}.2.{proj}.scales"
    s.tensors(lambda t: t.__setitem__(name, np.where(np.arange(t[name].size).reshape(t[name].shape) == 5,
                                                     np.float16(bad), t[name]).astype(np.float16)))
    s.freeze()
    _raises(ValueRangeError, lambda: _load(s.dir), name, "finite", "at [")
    s.check()


def test_non_finite_router(tmp_path, templates):
    s = Sandbox(tmp_path, templates["gptq"])
    name = "model.layers.0.block_sparse_moe.gate.weight"
    s.tensors(lambda t: t.__setitem__(name, np.full_like(t[name], np.nan)))
    s.freeze()
    _raises(ValueRangeError, lambda: _load(s.dir), name, "NaN")
    s.check()


def test_symmetric_zero_points_must_be_implicit(tmp_path, templates):
    s = Sandbox(tmp_path, templates["gptq"])
    name = f"{LAYER0}.1.w3.qzeros"
    s.tensors(lambda t: t.__setitem__(name, np.zeros_like(t[name])))
    s.freeze()
    _raises(ValueRangeError, lambda: _load(s.dir), name, "sym=true")
    s.check()


def test_compressed_tensors_weight_shape_checked(tmp_path, templates):
    s = Sandbox(tmp_path, templates["ct"])
    name = f"{LAYER0}.0.w1.weight_shape"
    s.tensors(lambda t: t.__setitem__(name, np.array([I, 5 * H], np.int64)))
    s.freeze()
    _raises(ShapeError, lambda: _load(s.dir), name)
    s.check()


def test_zero_scales_are_format_legal(tmp_path, templates):
    """Accepted: a zero scale is legal (the group's weights are zero). The result must be the
    float64 reference with those weights zeroed, not an error."""
    s = Sandbox(tmp_path, templates["gptq"])
    name = f"{LAYER0}.0.w1.scales"
    s.tensors(lambda t: t.__setitem__(name, np.zeros_like(t[name])))
    s.freeze()
    layer = _load(s.dir)
    w13, _ = layer.experts.dequantize(np.float64)
    assert np.all(np.asarray(w13)[0, :I] == 0) and np.any(np.asarray(w13)[0, I:] != 0)
    s.check()


def test_edge_codes_accepted(tmp_path, templates):
    """Accepted: every packed word is format-legal (all codes 0 or all 15 decode to ±8·scale)."""
    s = Sandbox(tmp_path, templates["gptq"])
    name = f"{LAYER0}.3.w2.qweight"
    s.tensors(lambda t: t.__setitem__(name, np.full_like(t[name], -1)))   # 0xFFFFFFFF: every code 15
    s.freeze()
    layer = _load(s.dir)
    _, w2 = layer.experts.dequantize(np.float64)
    sc = np.repeat(np.asarray(layer.experts.w2_scales[3], np.float64), GPTQ.group_size, axis=0).T
    np.testing.assert_array_equal(np.asarray(w2)[3], 7 * sc)
    s.check()


def test_one_dtype_per_tensor_kind(tmp_path, templates):
    """Scales are stacked per layer in the file's dtype: one expert's float32 scales among fp16
    ones would be rounded silently, so they are refused, naming both tensors."""
    s = Sandbox(tmp_path, templates["gptq"])
    name = f"{LAYER0}.2.w3.scales"
    s.tensors(lambda t: t.__setitem__(name, t[name].astype(np.float32)))
    s.freeze()
    _raises(DTypeError, lambda: _load(s.dir), name, "F32", "F16", f"{LAYER0}.0.w1.scales")
    s.check()


def test_int64_g_idx_accepted(tmp_path, templates):
    """Accepted: GPTQ's g_idx may be stored as int64; it loads as the int32 one does."""
    want = _load(templates["gptq"]).experts
    s = Sandbox(tmp_path, templates["gptq"])
    s.tensors(lambda t: t.update({k: v.astype(np.int64) for k, v in t.items() if k.endswith("g_idx")}))
    s.freeze()
    got = _load(s.dir).experts
    for f in want.array_fields():
        a, b = getattr(want, f), getattr(got, f)
        assert (a is None) == (b is None)
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    s.check()


def test_act_order_g_idx_beyond_int32(tmp_path):
    """An int64 act-order g_idx that would wrap to a valid index when stacked as int32."""
    path = tmp_path / "work" / "ckpt"
    write_checkpoint(path, QuantScheme("gptq", 4, 64, False, desc_act=True),
                     [random_moe_layer(np.random.default_rng(3), E, H, I)])
    s = Sandbox(tmp_path / "sb", path)
    name = f"{LAYER0}.1.w2.g_idx"

    def edit(t):
        t.update({k: v.astype(np.int64) for k, v in t.items() if k.endswith("g_idx")})
        t[name] = t[name] + (1 << 32)
    s.tensors(edit)
    s.freeze()
    _raises(ValueRangeError, lambda: _load(s.dir), name, "int32")
    s.check()


# --------------------------------------------------------------------------- hand-built pytrees


def _hand_built(scheme=GPTQ, **replace):
    w = random_checkpoint_weights(np.random.default_rng(1), scheme, E, H, I)
    return w.replace(**replace)


def _route(t=6):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
    tw, ids = routing.fused_topk(jnp.asarray(rng.standard_normal((t, E)), jnp.float32), 2, renormalize=True)
    return x, tw, ids


def test_hand_built_scales_one_group_short():
    w = _hand_built()
    short = _hand_built(w2_scales=w.w2_scales[:, :-1])
    before = [np.array(a) for a in jax.tree_util.tree_leaves(short)]
    _raises(ShapeError, lambda: convert_cpu(GPTQ, short), "w2_scales")
    x, tw, ids = _route()
    _raises(ShapeError, lambda: fused_moe(x, tw, ids, short), "w2_scales")
    _raises(ShapeError, lambda: TABLE[Backend.MARLIN].convert(GPTQ, short), "w2_scales")
    for a, b in zip(before, jax.tree_util.tree_leaves(short)):       # nothing mutated
        np.testing.assert_array_equal(a, b)


def test_hand_built_float_qweight():
    w = _hand_built()
    bad = w.replace(w13_qweight=w.w13_qweight.astype(np.float32))
    _raises(DTypeError, lambda: convert_cpu(GPTQ, bad), "w13_qweight", "int32", "float32")
    x, tw, ids = _route()
    _raises(DTypeError, lambda: fused_moe(x, tw, ids, bad), "w13_qweight")


def test_hand_built_missing_and_extra_fields():
    w = _hand_built(AWQ)
    _raises(MissingTensorError, lambda: convert_cpu(AWQ, w.replace(w2_qzeros=None)), "w2_qzeros")
    g = _hand_built()
    extra = g.replace(w13_g_idx=np.zeros((E, H), np.int32))
    _raises(UnexpectedTensorError, lambda: TABLE[Backend.CPU].convert(GPTQ, extra), "w13_g_idx")


def test_layout_fields_by_unknown_names():
    """Building or changing a layout by flat names refuses a name it does not have (a vLLM name of
    another layout, a typo), naming the class, the name and the names it has; the input is unchanged."""
    w = _hand_built()
    _raises(ConfigError, lambda: w.replace(w13_weight=w.w13_qweight), "CheckpointWeights.replace", "'w13_weight'",
            "w13_qweight")
    fields = {n: getattr(w, n) for n in w.flat_names() if getattr(w, n) is not None}
    _raises(ConfigError, lambda: type(w).of(**fields, w13_scale=w.w13_scales, scheme=w.scheme, hidden_size=H,
                                            intermediate_size=w.intermediate_size), "CheckpointWeights.of", "'w13_scale'")
    changed = w.replace(w13_scales=w.w13_scales * 2)
    assert changed.w13_scales is not w.w13_scales and np.array_equal(changed.w13_scales, 2 * w.w13_scales)
    assert np.array_equal(w.w13_scales, _hand_built().w13_scales)                # the input is unchanged


def test_convert_with_another_scheme():
    w = _hand_built()
    _raises(ConfigError, lambda: TABLE[Backend.CPU].convert(AWQ, w), "scheme")


def test_fused_moe_refuses_foreign_weights():
    x, tw, ids = _route()
    _raises(ConfigError, lambda: fused_moe(x, tw, ids, {"w13": np.zeros(3)}), "weights", "dict")


def test_backend_layout_with_wrong_metadata():
    w = TABLE[Backend.MARLIN].convert(GPTQ, _hand_built().to_jax())
    bad = w.replace(hidden_size=2 * H)
    x, tw, ids = _route()
    x2 = jnp.zeros((6, 2 * H), jnp.float32)
    _raises(ShapeError, lambda: fused_moe(x2, tw, ids, bad), "MarlinWeights")
    del x


def test_hand_built_bad_weights_never_give_nan():
    """The same layer built correctly runs and is finite (the refusals above are not blanket)."""
    x, tw, ids = _route()
    y = jax.jit(fused_moe)(x, tw, ids, _hand_built().to_jax())
    assert np.isfinite(np.asarray(y)).all()


# --------------------------------------------------------------------------- the CLI


def _convert(src, out, *extra):
    return main(["convert", str(src), "--backend", "marlin", "--out", str(out), *extra])


def test_cli_out_is_the_source(tmp_path, templates, capsys):
    s = Sandbox(tmp_path, templates["gptq"]).freeze()
    assert _convert(s.dir, s.dir) == 2
    assert "OutputPathError" in capsys.readouterr().err
    assert _convert(s.dir, s.dir / "inside") == 2
    assert _convert(s.dir, s.dir / "." / "sub" / "..") == 2
    s.check()


def test_cli_out_is_a_file(tmp_path, templates, capsys):
    s = Sandbox(tmp_path, templates["gptq"])
    target = tmp_path / "work" / "a_file"
    target.write_text("keep me")
    s.freeze()
    assert _convert(s.dir, target) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "OutputPathError" in err[0] and "not a folder" in err[0]
    s.check()


def test_cli_out_not_empty_needs_overwrite(tmp_path, templates, capsys):
    s = Sandbox(tmp_path, templates["gptq"])
    out = tmp_path / "work" / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    s.freeze()
    assert _convert(s.dir, out) == 2
    assert "not empty" in capsys.readouterr().err
    s.check()
    assert _convert(s.dir, out, "--overwrite") == 0
    assert not (out / "old.txt").exists() and (out / "manifest.json").exists()
    s.check(allowed=("work/out/",))
    assert sorted(os.listdir(tmp_path / "work")) == ["ckpt", "out"]        # no temporary folder left


def test_cli_out_containing_the_source(tmp_path, templates, capsys):
    s = Sandbox(tmp_path, templates["gptq"]).freeze()
    assert _convert(s.dir, tmp_path / "work", "--overwrite") == 2
    assert "contains the source" in capsys.readouterr().err
    s.check()


@pytest.mark.parametrize("opts, words", [
    (["--expert-chunk", "0"], "--expert-chunk"),
    (["--expert-chunk", "-3"], "--expert-chunk"),
    (["--tp-size", "0"], "tp_size"),
    (["--tp-rank", "5"], "tp_rank"),
    (["--tp-size", "-1"], "tp_size"),
    (["--input-dtype", "float64"], "--input-dtype"),
])
def test_cli_numeric_options(tmp_path, templates, capsys, opts, words):
    s = Sandbox(tmp_path, templates["gptq"]).freeze()
    assert _convert(s.dir, tmp_path / "work" / "out", *opts) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]
    assert not (tmp_path / "work" / "out").exists()
    s.check()


def test_interrupted_conversion_leaves_nothing(tmp_path, templates, monkeypatch):
    import wna16_jax.serialize as ser

    s = Sandbox(tmp_path, templates["gptq_sharded"]).freeze()
    real = ser.convert_layer
    calls = []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(ser, "convert_layer", flaky)
    with pytest.raises(KeyboardInterrupt):
        convert_checkpoint(s.dir, "marlin", tmp_path / "work" / "out", progress=False)
    assert sorted(os.listdir(tmp_path / "work")) == ["ckpt"]     # no output, no temporary folder
    s.check()


def test_demo_out_must_be_new_or_empty(tmp_path, capsys):
    (tmp_path / "x").write_text("x")
    assert main(["demo", "--out", str(tmp_path)]) == 2
    assert "OutputPathError" in capsys.readouterr().err


def test_layer_index_and_tp_arguments(tmp_path, templates):
    ckpt = Checkpoint(templates["gptq"])
    _raises(ValueRangeError, lambda: ckpt.load_layer(3), "layer_index", "[0]")
    _raises(ConfigError, lambda: ckpt.load_layer(0, tp_size=0), "tp_size")
    _raises(ConfigError, lambda: ckpt.load_layer(0, tp_size=2, tp_rank=-1), "tp_rank")
    _raises(ConfigError, lambda: ckpt.load_layer(0, tp_size=2.0), "tp_size")
    _raises(ConfigError, lambda: Checkpoint(tmp_path / "nope"), "not a folder")
