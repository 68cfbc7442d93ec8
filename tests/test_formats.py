"""The format table (wna16_jax.formats) against the files the quantization tools wrote, and
against what the loader gave before the table existed."""

import glob
import hashlib
import json
import os

import numpy as np
import pytest

from wna16_jax import formats
from wna16_jax.checkpoint import Checkpoint, MatrixPart, read_matrix
from wna16_jax.schemes import QuantScheme
from wna16_jax.weights import CheckpointForm, QuantMatrix

ROOT = os.path.join(os.path.dirname(__file__), "fixtures")
FOLDERS = sorted(glob.glob(os.path.join(ROOT, "quantizers", "*")) + glob.glob(os.path.join(ROOT, "hf_deepseek", "*")))
HASHES = json.load(open(os.path.join(ROOT, "loaded_layer_hashes.json")))["layers"]


def _hash(a) -> str:
    a = np.asarray(a)
    return hashlib.sha1(a.tobytes() + str(a.dtype).encode() + str(a.shape).encode()).hexdigest()[:16]


def _modules(ckpt):
    """module → {suffix: name} of every quantized matrix in the checkpoint."""
    mods = {}
    for name in ckpt.tensor_names():
        mod, _, suffix = name.rpartition(".")
        mods.setdefault(mod, {})[suffix] = name
    return {m: t for m, t in mods.items() if any(q in t for q in formats.QUANTIZED_MARKERS)}


def _sizes(scheme, t, info):
    """(N, K) of a stored matrix from its qweight header (and compressed-tensors' weight_shape)."""
    q = info[formats.SUFFIXES[scheme.method]["qweight"]]
    pf = scheme.pack_factor
    if scheme.method.value == "awq":
        return q.shape[1] * pf, q.shape[0]
    if scheme.method.value == "gptq":
        return q.shape[1], q.shape[0] * pf
    return tuple(int(v) for v in t)


@pytest.mark.parametrize("folder", FOLDERS, ids=os.path.basename)
def test_the_table_lists_exactly_what_the_tools_stored(folder):
    ckpt = Checkpoint(folder)
    mods = _modules(ckpt)
    assert mods
    for mod, tensors in mods.items():
        scheme = ckpt.quant_config.scheme_for(mod) or ckpt.scheme
        info = {s: ckpt.tensor_info(n) for s, n in tensors.items()}
        shape = ckpt.read_tensor(tensors["weight_shape"]) if "weight_shape" in tensors else None
        n, k = _sizes(scheme, shape, info)
        table = {t.suffix: t for t in formats.tensors(scheme, n, k).values()}
        assert set(info) <= set(table), (mod, sorted(set(info) - set(table)))
        for suffix, t in info.items():
            assert tuple(t.shape) == table[suffix].shape and t.dtype_name in table[suffix].dtypes, (mod, suffix)
        for t in table.values():
            assert t.need != formats.REQUIRED or t.suffix in info, (mod, t.suffix)


@pytest.mark.parametrize("folder", FOLDERS, ids=os.path.basename)
def test_loaded_layers_are_what_the_loader_gave_before_the_table(folder):
    import jax

    ckpt = Checkpoint(folder)
    want = HASHES[os.path.basename(folder)]
    got = {}
    for i in ckpt.moe_layer_indices:
        layer = ckpt.load_layer(i)
        for tag, w in (("experts", layer.experts), ("shared", layer.shared_experts)):
            if w is not None:
                for path, a in jax.tree_util.tree_flatten_with_path(w)[0]:
                    got[f"L{i}.{tag}.{jax.tree_util.keystr(path)}"] = _hash(a)
    assert got == want


SCHEMES = [{"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"},
           {"quant_method": "gptq", "bits": 8, "group_size": 32, "desc_act": True, "sym": False},
           {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": False, "sym": True},
           {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
               "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                  "strategy": "group", "group_size": 32}}}}]


PREFIX = "model.layers.0.block_sparse_moe.experts.0"


@pytest.mark.parametrize("qc", SCHEMES, ids=lambda q: q["quant_method"] + str(q.get("bits", "")))
def test_pack_then_read_then_decode_gives_the_codes_back(tmp_path, qc):
    """A random matrix packed by the table, written, read by the one reader as two parts along N
    and decoded: the codes, scales, zero points and groups come back exactly."""
    from safetensors.numpy import save_file

    s = QuantScheme.from_quant_config(qc)
    rng = np.random.default_rng(3)
    k, parts = 96, (48, 48)
    ng = formats.num_groups(s, k)
    logical = []
    tensors = {}
    for j, n in enumerate(parts):
        codes = rng.integers(0, 1 << s.bits, (n, k))
        scales = (0.01 + rng.random((n, ng))).astype(np.float16)
        zeros = rng.integers(0, 1 << s.bits, (n, ng)) if s.zero_point else None
        g_idx = rng.permutation(formats.natural_g_idx(s, k)) if s.act_order else None
        if j and g_idx is not None:
            g_idx = logical[0][3]                   # the parts share one act-order
        logical.append((codes, scales, zeros, g_idx))
        for suffix, a in formats.pack(s, codes, scales, zeros, g_idx).items():
            tensors[f"{PREFIX}.{('w1', 'w3')[j]}.{suffix}"] = a
    tensors[f"{PREFIX}.w2.qweight"] = np.zeros((1, 1), np.int32)      # named, never read here
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "num_local_experts": 1, "num_experts_per_tok": 1, "hidden_size": k,
        "intermediate_size": parts[0], "quantization_config": qc}))
    ckpt = Checkpoint(tmp_path)
    mparts = [MatrixPart([{key.rsplit(".", 1)[1]: key for key in tensors if f".{proj}." in key}], n,
                         f"{PREFIX}.{proj}") for proj, n in zip(("w1", "w3"), parts)]
    m, bias = read_matrix(ckpt, s, mparts, k=k)
    assert isinstance(m, QuantMatrix) and isinstance(m.form, CheckpointForm) and bias is None
    lq = m.decode()
    np.testing.assert_array_equal(lq.codes[0], np.concatenate([p[0] for p in logical]))
    np.testing.assert_array_equal(lq.scales[0], np.concatenate([p[1] for p in logical]))
    if s.zero_point:
        np.testing.assert_array_equal(lq.zeros[0], np.concatenate([p[2] for p in logical]))
    else:
        assert lq.zeros is None
    if s.act_order:
        np.testing.assert_array_equal(lq.g_idx[0], logical[0][3])
