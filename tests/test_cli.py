"""The command line: `python -m wna16_jax demo` (the README's main job) and `inspect DIR`."""

import io
import os
import subprocess
import sys

import numpy as np
import pytest

from wna16_jax.backends import Device
from wna16_jax.writers import random_moe_layer, write_checkpoint
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


# --------------------------------------------------------------------------- generate

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "quantizers")


def test_generate_streams_the_reference_tokens(capsys):
    """`generate DIR --prompt TEXT` (the checkpoint's tokenizer.json) and `--prompt-ids`: the
    greedy continuation is the float reference's, printed as text / ids, timing on stderr."""
    from wna16_jax.models.tokenizer import load_tokenizer

    case = os.path.join(FIXTURES, "awq-qwen3moe")             # no eos in its config: no early stop
    ref = np.load(os.path.join(case, "reference.npz"))
    tok = load_tokenizer(case)
    assert main(["generate", case, "--prompt", str(ref["prompt_text"]), "--max-new-tokens", "12",
                 "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    want = tok.decode(np.concatenate([ref["prompt_ids"], ref["generated_ids"][:12]]))
    assert out.strip() == want.strip()
    assert "12 new tokens" in err and "tokens/s" in err
    ids = ",".join(str(i) for i in ref["prompt_ids"][:6])
    assert main(["generate", case, "--prompt-ids", ids, "--max-new-tokens", "3", "--temperature", "0.9",
                 "--top-p", "0.8", "--seed", "1", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.strip().split(",")
    assert out[:6] == ids.split(",") and len(out) == 9 and all(0 <= int(t) < 320 for t in out)


@pytest.mark.parametrize("args,words", [
    (["--prompt-ids", "1,2,999"], ["ValueRangeError", "prompts[0][2]", "[0, 320)", "999"]),
    (["--prompt-ids", "1,x"], ["ConfigError", "--prompt-ids"]),
    (["--prompt-ids", "1", "--max-new-tokens", "300"], ["ValueRangeError", "max_len"]),
    ([], ["ConfigError", "--prompt"]),
])
def test_generate_bad_input_is_one_line_exit_2(capsys, args, words):
    assert main(["generate", os.path.join(FIXTURES, "gptq-mixtral"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
