"""``benchmarks/generate.py`` (the whole-model GPU benchmark) runs end to end on the CPU at its
tiny settings, so it does not rot between GPU sessions. Timings here mean nothing and are not
checked; the table's shape, the floor's byte count and the appended section are."""

import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from benchmarks import generate as bench
from wna16_jax.models import load_model, write_random_model
from wna16_jax.models.synthetic import RandomModelSpec
from wna16_jax.schemes import QuantScheme


def test_generate_benchmark_smoke(tmp_path, capsys):
    out_md = tmp_path / "RESULTS.md"
    assert bench.main(["--models", "tiny", "--layers", "1", "--batch", "1", "--prompt", "16", "--new", "6",
                       "--reps", "1", "--decode-steps", "1", "3", "--append", str(out_md)]) == 0
    rows = [line for line in out_md.read_text().splitlines() if line.startswith("| tiny")]
    assert len(rows) == 3 and "dequantized" in rows[2]
    assert "GPTQ int4, 1 steps / program" in rows[0] and "GPTQ int4, 3 steps / program" in rows[1]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == len(bench.HEADER.strip("|").split("|"))
        prefill, tps, step, floor, ratio = (float(c) for c in cells[3:8])
        assert all(math.isfinite(v) and v > 0 for v in (prefill, tps, step, floor, ratio)), row
        assert cells[8].endswith("%")
    assert "--models tiny" in out_md.read_text()
    assert "decode tok/s" in capsys.readouterr().out


def test_floor_counts_every_touched_weight_once(tmp_path):
    """With a batch so large that every expert is touched, the floor's bytes are all the model's
    weights except the embedding table, plus one embedding row per token."""
    spec = RandomModelSpec(scheme=QuantScheme.from_quant_config(bench.GPTQ_4BIT_G128), **bench.SHAPES["tiny"])
    path = write_random_model(tmp_path / "m", spec.replace(num_layers=1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(path, dtype=jnp.float32)
    everything = bench._nbytes(nnx.state(model))
    embed = bench._nbytes(model.embed_tokens[...])
    batch = 10**6
    row = model.config.hidden_size * 2
    assert bench.touched_bytes(model, batch) == everything - embed + batch * row
    one = bench.touched_bytes(model, 1)
    assert one < everything - embed                               # top-2 of 8 experts
    assert bench.without_moe(model).layers[0].self_attn is model.layers[0].self_attn
    assert jax.tree.leaves(nnx.state(bench.without_moe(model), bench.QuantizedExperts)) == []


def test_floor_of_a_scanned_model_copies_nothing(tmp_path):
    """The floor of a scanned model counts the same bytes as the unrolled model's and creates no
    device array (slicing each layer out of the stacks would hold a second copy of the weights
    while the script reads the memory in use)."""
    spec = RandomModelSpec(scheme=QuantScheme.from_quant_config(bench.GPTQ_4BIT_G128), **bench.SHAPES["tiny"])
    path = write_random_model(tmp_path / "m", spec.replace(num_layers=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scanned = load_model(path, dtype=jnp.bfloat16, scan_layers=True)
        unrolled = load_model(path, dtype=jnp.bfloat16, scan_layers=False)
    assert scanned.scan_layers and not unrolled.scan_layers
    before = {id(a) for a in jax.live_arrays()}
    got = [bench.touched_bytes(scanned, b) for b in (1, 8, 10**6)]
    assert {id(a) for a in jax.live_arrays()} <= before
    assert got == [bench.touched_bytes(unrolled, b) for b in (1, 8, 10**6)]


def test_scanned_model_without_moe_shares_its_stacks(tmp_path):
    """The MoE-share variant of a scanned model keeps the model's stacks (no device array is
    created: slicing the layers out, as before, held a second copy of every layer) and computes
    what the unrolled model without its MoE computes."""
    import numpy as np

    spec = RandomModelSpec(scheme=QuantScheme.from_quant_config(bench.GPTQ_4BIT_G128), **bench.SHAPES["tiny"])
    path = write_random_model(tmp_path / "m", spec.replace(num_layers=3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scanned = load_model(path, dtype=jnp.float32, scan_layers=True)
        unrolled = load_model(path, dtype=jnp.float32, scan_layers=False)
    before = {id(a) for a in jax.live_arrays()}
    bare = bench.without_moe(scanned)
    assert {id(a) for a in jax.live_arrays()} <= before
    assert bare.scan_layers and jax.tree.leaves(nnx.state(bare, bench.QuantizedExperts)) == []
    kept = {id(a) for a in jax.tree.leaves(scanned.stacked_layers)}
    assert {id(a) for a in jax.tree.leaves(bare.stacked_layers)} < kept
    tokens = jnp.asarray(np.random.default_rng().integers(0, scanned.config.vocab_size, (2, 7)))
    run = nnx.jit(lambda m, t: m(t))
    got, want = np.asarray(run(bare, tokens)), np.asarray(run(bench.without_moe(unrolled), tokens))
    full = np.asarray(run(scanned, tokens))
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert np.abs(full - want).max() > 1e-2 * np.abs(want).max()         # the MoE did contribute


def test_live_arrays_printout(capsys):
    """The memory printout lists the live arrays (a 64 MiB one among them, named by dtype, shape
    and size) and their total (what the allocator's count of bytes in use is compared with)."""
    x = jnp.ones((4096, 4096), jnp.float32)
    bench.print_live_arrays("t", show=len(jax.live_arrays()))
    out = capsys.readouterr().out
    assert out.startswith("# t; live arrays ") and "float32[4096, 4096] 0.06 GiB" in out
    total = float(out.split("live arrays ")[1].split(" GiB")[0])
    assert total >= x.nbytes / 2**30 - 0.005
