"""Reading part of a checkpoint: some routed experts of a layer (``load_layer(experts=...)``,
source and converted folders), a tensor-parallel slice's bytes alone, and the raw reads under
them (``SafetensorsFile.read_rows`` / ``read_slice``). What a process of a mesh spread over
several processes reads (tests/test_model_multiprocess.py) rests on these.

Each partial read is compared with the whole read cut the same way (bit for bit: these are
copies of stored bytes, nothing is computed); the bytes each read fetches are counted at the one
positioned-read function every read goes through. Hostile cases: the typed error naming the
argument and the value."""

import os

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from wna16_jax import safetensors_io
from wna16_jax.checkpoint import Checkpoint
from wna16_jax.errors import ConfigError, ShapeError, UnsupportedError
from wna16_jax.nn import QuantizedMoE
from wna16_jax.routing import MoERouting
from wna16_jax.safetensors_io import SafetensorsFile
from wna16_jax.serialize import ConvertedCheckpoint, convert_checkpoint
from wna16_jax.sharding import stack_tp_shards

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "quantizers")


@pytest.fixture
def counted(monkeypatch):
    """``{tensor name: bytes}`` of every positioned read of tensor data made while the test runs."""
    seen: dict[str, int] = {}
    real = safetensors_io._read_fully

    def spy(fd, buf, pos, path, name):
        seen[name] = seen.get(name, 0) + len(buf)
        return real(fd, buf, pos, path, name)

    monkeypatch.setattr(safetensors_io, "_read_fully", spy)
    return seen


@pytest.fixture(scope="module")
def random_file(tmp_path_factory):
    rng = np.random.default_rng()
    tensors = {"a": rng.standard_normal((7, 5, 3)).astype(np.float32),
               "b": rng.integers(-2**31, 2**31 - 1, (9, 4), dtype=np.int64).astype(np.int32),
               "c": rng.standard_normal(11).astype(np.float16)}
    path = str(tmp_path_factory.mktemp("st") / "t.safetensors")
    save_file(tensors, path)
    return SafetensorsFile(path), tensors


@pytest.mark.parametrize("name,axis,sl", [("a", 0, slice(2, 5)), ("a", 1, slice(1, 4)), ("a", 2, slice(0, 2)),
                                          ("b", 1, slice(2, 4)), ("b", 0, slice(8, 9)), ("c", 0, slice(3, 11)),
                                          ("a", 1, slice(2, 2))])
def test_read_slice_is_the_slice_and_reads_only_its_bytes(random_file, counted, name, axis, sl):
    f, tensors = random_file
    got = f.read_slice(name, axis, sl)
    want = tensors[name][(slice(None),) * axis + (sl,)]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    assert counted.get(name, 0) == want.nbytes


@pytest.mark.parametrize("rows", [[0], [1, 2, 3], [0, 2, 6], [6], list(range(7))])
def test_read_rows_are_the_rows_and_read_only_their_bytes(random_file, counted, rows):
    f, tensors = random_file
    got = f.read_rows("a", rows)
    np.testing.assert_array_equal(got, tensors["a"][rows])
    assert counted["a"] == tensors["a"][rows].nbytes


@pytest.mark.parametrize("call,needle", [
    (lambda f: f.read_slice("a", 3, slice(0, 1)), "no axis 3"),
    (lambda f: f.read_slice("a", 0, slice(0, 4, 2)), "step-1 slice"),
    (lambda f: f.read_rows("a", [2, 1]), "rows [2, 1]"),
    (lambda f: f.read_rows("a", [0, 7]), "rows [0, 7]"),
    (lambda f: f.read_rows("a", [3, 3]), "rows [3, 3]"),
])
def test_bad_partial_reads_are_shape_errors(random_file, call, needle):
    with pytest.raises(ShapeError) as e:
        call(random_file[0])
    assert needle in str(e.value) and "'a'" in str(e.value)


def _leaves(w):
    return [np.asarray(a) for a in jax.tree.leaves(w)]


@pytest.mark.parametrize("folder", ["awq-qwen3moe", "gptq-mixtral"])
def test_some_experts_of_a_source_layer(folder, counted):
    ckpt = Checkpoint(os.path.join(FIXTURES, folder))
    i = ckpt.moe_layer_indices[-1]
    whole = ckpt.load_layer(i)
    e = whole.experts.num_experts
    chosen = [1, e - 1]
    counted.clear()
    part = ckpt.load_layer(i, experts=chosen)
    assert part.experts.num_experts == 2
    for a, b in zip(_leaves(whole.experts), _leaves(part.experts)):
        np.testing.assert_array_equal(a[chosen], b)
    np.testing.assert_array_equal(part.router, whole.router)           # the router: all experts
    read = {int(n.split(".experts.")[1].split(".")[0]) for n in counted if ".experts." in n}
    assert read == set(chosen)
    routed = ckpt.load_routed_experts(i, experts=chosen)
    for a, b in zip(_leaves(part.experts), _leaves(routed)):
        np.testing.assert_array_equal(a, b)


def test_a_tp_slice_reads_the_sliced_tensors_bytes_alone(counted):
    """Rank 1 of 2 reads half of each N-split qweight and scales (gate / up) and of each K-split
    one (down), and equals the slice of the whole layer's."""
    ckpt = Checkpoint(os.path.join(FIXTURES, "gptq-mixtral"))
    i = ckpt.moe_layer_indices[0]
    ckpt.load_routed_experts(i, experts=[0])
    whole = dict(counted)
    counted.clear()
    ckpt.load_routed_experts(i, tp_size=2, tp_rank=1, experts=[0])
    for name, b in counted.items():
        if name.endswith((".qweight", ".scales")):
            assert b * 2 == whole[name], name
        else:                                                  # read only to be checked: whole
            assert b == whole[name], name


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("conv") / "xpu")
    convert_checkpoint(os.path.join(FIXTURES, "gptq-mixtral"), "xpu", out, progress=False)
    return ConvertedCheckpoint(out)


def test_some_experts_of_a_converted_layer(converted, counted):
    i = converted.moe_layer_indices[0]
    whole = converted.load_layer(i)
    counted.clear()
    part = converted.load_layer(i, experts=[0, 2, 3])
    assert type(part.experts) is type(whole.experts) and part.experts.num_experts == 3
    for a, b in zip(_leaves(whole.experts), _leaves(part.experts)):
        np.testing.assert_array_equal(a[[0, 2, 3]], b)
    np.testing.assert_array_equal(part.router, whole.router)
    got = sum(b for n, b in counted.items() if n.startswith("experts."))
    assert got * 4 == sum(a.nbytes for a in _leaves(whole.experts)) * 3


@pytest.mark.parametrize("experts,needle", [
    ([2, 1], "increasing order"), ([1, 1], "increasing order"), ([], "at least one"),
    ([0, 4], "experts[1] must be an integer"), ([-1], "experts[0] must be an integer"), ("01", "expected None or a sequence"),
    (3, "expected None or a sequence"), ([0.5], "experts[0] must be an integer"), ([True], "experts[0] must be an integer"),
])
def test_bad_expert_choices_are_config_errors(experts, needle, converted):
    ckpt = Checkpoint(os.path.join(FIXTURES, "gptq-mixtral"))      # 4 experts a layer
    i = ckpt.moe_layer_indices[0]
    for load in (lambda: ckpt.load_layer(i, experts=experts), lambda: ckpt.load_routed_experts(i, experts=experts),
                 lambda: converted.load_layer(converted.moe_layer_indices[0], experts=experts)):
        with pytest.raises(ConfigError) as e:
            load()
        assert needle in str(e.value), str(e.value)


def test_every_expert_chosen_is_the_whole_layer():
    ckpt = Checkpoint(os.path.join(FIXTURES, "gptq-mixtral"))
    i = ckpt.moe_layer_indices[0]
    for a, b in zip(_leaves(ckpt.load_layer(i).experts), _leaves(ckpt.load_layer(i, experts=range(4)).experts)):
        np.testing.assert_array_equal(a, b)


def test_a_layer_of_some_experts_runs_only_on_its_mesh():
    """A :class:`QuantizedMoE` holding some of its router's experts refuses to run unplaced (its
    experts' indices are not the router's), and ``expert_ids`` must count what it holds."""
    ckpt = Checkpoint(os.path.join(FIXTURES, "gptq-mixtral"))
    layer = ckpt.load_layer(ckpt.moe_layer_indices[0], experts=[1, 3])
    routing = MoERouting.of(ckpt.model_config)
    mlp = QuantizedMoE(layer.experts, layer.router, routing, expert_ids=[1, 3], backend="loader")
    assert mlp.num_experts == 4
    x = np.random.default_rng().standard_normal((3, mlp.hidden_size)).astype(np.float32)
    with pytest.raises(UnsupportedError) as e:
        mlp(x)
    assert "holds 2 of its router's 4 experts" in str(e.value)
    with pytest.raises(ShapeError) as e:
        QuantizedMoE(layer.experts, layer.router, routing, expert_ids=[0, 1, 3], backend="loader")
    assert "names 3 of the router's 4 experts, but experts holds 2" in str(e.value)
    with pytest.raises(ConfigError) as e:
        QuantizedMoE(layer.experts, layer.router, routing, expert_ids=[3, 1], backend="loader")
    assert "expert_ids" in str(e.value) and "[3, 1]" in str(e.value)


def test_stack_tp_shards_ranks():
    """The w2 bias is kept on rank 0 wherever rank 0 lies in the stack; bad ranks are refused."""
    rng = np.random.default_rng()
    from wna16_jax.checkpoint import DenseWeights

    def dense():
        return DenseWeights(rng.standard_normal((2, 8, 4)).astype(np.float32),
                            rng.standard_normal((2, 4, 4)).astype(np.float32), None,
                            rng.standard_normal((2, 4)).astype(np.float32), hidden_size=4, intermediate_size=4)

    a, b = dense(), dense()
    got = stack_tp_shards([a, b], ranks=[1, 0])
    np.testing.assert_array_equal(np.asarray(got.w2_bias[0]), 0)
    np.testing.assert_array_equal(np.asarray(got.w2_bias[1]), b.w2_bias)
    for ranks, needle in (([0], "expected 2 distinct ranks"), ([1, 1], "[1, 1]"), ([0, -1], "[0, -1]")):
        with pytest.raises(ConfigError) as e:
            stack_tp_shards([a, b], ranks=ranks)
        assert needle in str(e.value)
