"""The command line: `python -m wna16_jax demo` (the README's main job) and `inspect DIR`."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from wna16_jax.backends import Device
from wna16_jax.checkpoint import random_moe_layer, write_checkpoint
from wna16_jax.cli import main, run_inspect
from wna16_jax.schemes import QuantScheme

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_demo_runs_and_passes():
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "wna16_jax", "demo", "--tokens", "8"], capture_output=True,
                       text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "all results within tolerance" in out
    for name in ("AWQ g128", "GPTQ 4b g64 actorder", "CT 4b g64 asym", "MARLIN", "HUMMING"):
        assert name in out
    import jax

    selected = "CPU" if jax.default_backend() == "cpu" else "MARLIN"
    assert f" {selected} " in out          # the backend selected on this machine


@pytest.mark.parametrize("scheme", [QuantScheme("awq", 4, 64, True), QuantScheme("gptq", 4, 32, False, True)])
def test_inspect(tmp_path, scheme):
    write_checkpoint(tmp_path, scheme, [random_moe_layer(np.random.default_rng(), 4, 128, 128)] * 2,
                     model_type="qwen3_moe")
    buf = io.StringIO()
    assert run_inspect(str(tmp_path), out=buf, device=Device("cpu", "cpu")) == 0
    out = buf.getvalue()
    assert scheme.describe() in out and "MoE layers: 2 (0..1)" in out and "w13_qweight" in out
    for b in ("CPU", "XPU", "MARLIN", "BATCHED_MARLIN", "FLASHINFER_TRTLLM", "HUMMING"):
        assert b in out
    if scheme.act_order:
        assert "SELECTED (fallback" in out and "LOADER" in out and "act-order" in out
    else:
        assert "SELECTED" in out
    assert "needs an NVIDIA CUDA GPU" in out and "SM100" in out


def test_inspect_bad_dir(tmp_path, capsys):
    assert main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "ConfigError" in err and len(err.strip().splitlines()) == 1


def test_inspect_converted_folder(tmp_path):
    from wna16_jax.serialize import convert_checkpoint

    scheme = QuantScheme("awq", 4, 64, True)
    write_checkpoint(tmp_path / "src", scheme, [random_moe_layer(np.random.default_rng(), 4, 128, 128)],
                     model_type="qwen3_moe")
    convert_checkpoint(tmp_path / "src", "marlin", tmp_path / "out", progress=False)
    buf = io.StringIO()
    assert run_inspect(str(tmp_path / "out"), out=buf) == 0
    out = buf.getvalue()
    assert "backend:    MARLIN" in out and scheme.describe() in out and "4 experts" in out
    assert "experts.w13_qweight" in out and "MarlinWeights" in out
