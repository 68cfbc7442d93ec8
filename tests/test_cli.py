"""The command line: `python -m wna16_jax demo` (the README's main job), `inspect DIR`, `generate`
on a real-tool checkpoint, and bad command lines (each one stderr line, exit status 2, nothing
written). Chat, batches, hub ids, --version / --help, pipes and Ctrl-C: tests/test_cli_chat.py."""

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
    # the folder's generation_config.json says do_sample: --temperature 0 asks for greedy
    assert main(["generate", case, "--prompt", str(ref["prompt_text"]), "--max-new-tokens", "12",
                 "--temperature", "0", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    want = tok.decode(np.concatenate([ref["prompt_ids"], ref["generated_ids"][:12]]))
    assert out.strip() == want.strip()
    assert "12 new tokens" in err and "tokens/s" in err
    ids = ",".join(str(i) for i in ref["prompt_ids"][:6])
    assert main(["generate", case, "--prompt-ids", ids, "--max-new-tokens", "3", "--temperature", "0.9",
                 "--top-p", "0.8", "--seed", "1", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out.strip().split(",")
    assert out[:6] == ids.split(",") and len(out) == 9 and all(0 <= int(t) < 320 for t in out)


def test_expected_fallback_is_one_line_on_stderr(capsys):
    """On a CPU, a scheme no backend converts runs the loader layout on the XLA executor: the
    normal route, said in one line (no Python source line), counted over the model's MoE layers."""
    case = os.path.join(FIXTURES, "ct-w8a16-qwen3moe")
    assert main(["generate", case, "--prompt-ids", "1,2,3", "--max-new-tokens", "1", "--temperature", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    warned = [line for line in err if line.startswith("warning: ")]
    assert len(warned) == 1, err
    assert "2 of 2 MoE layers" in warned[0] and "8-bit" in warned[0] and "cpu: cpu" not in warned[0]
    assert not any("cli.py" in line or "load_model(" in line for line in err), err


# --------------------------------------------------------------------------- hostile command lines

#: a tiny real-tool checkpoint: vocab_size 320, max_position_embeddings 256, eos id 2, a
#: tokenizer.json but no chat template
MIXTRAL = os.path.join(FIXTURES, "gptq-mixtral")
HUGE_SEED = str(2**80)


def _tree(root) -> dict:
    """Every entry under ``root`` with its kind and content hash (a write anywhere changes it)."""
    import hashlib

    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """The Mixtral checkpoint without its tokenizer files."""
    import shutil

    folder = tmp_path_factory.mktemp("no_tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors", "quantize_config.json"):
        shutil.copy(os.path.join(MIXTRAL, name), folder / name)
    return folder


G = ["generate", "{mixtral}"]
IDS = [*G, "--prompt-ids", "1,2"]


@pytest.mark.parametrize("args,words", [
    # --prompt-ids: parsed before anything is loaded
    ([*G, "--prompt-ids", "1,,2"], ["ConfigError", "--prompt-ids", "entry 1", "empty"]),
    ([*G, "--prompt-ids", ""], ["ConfigError", "--prompt-ids", "entry 0", "empty"]),
    ([*G, "--prompt-ids", "1,x"], ["ConfigError", "--prompt-ids", "entry 1", "'x'"]),
    ([*G, "--prompt-ids", "1,2.5"], ["ConfigError", "--prompt-ids", "'2.5'"]),
    ([*G, "--prompt-ids", "1,-3"], ["ConfigError", "--prompt-ids[1]", ">= 0", "-3"]),
    ([*G, "--prompt-ids", "1_0"], ["ConfigError", "--prompt-ids", "'1_0'"]),
    # ids past the vocabulary, and cache sizes: the library's checks, after the load, one line
    ([*G, "--prompt-ids", "1,2,999"], ["ValueRangeError", "--prompt-ids[2]", "[0, 320)", "999"]),
    ([*G, "--prompt-ids", "1", "--prompt-ids", "2,320"], ["ValueRangeError", "--prompt-ids[1][1]", "320"]),
    ([*IDS, "--max-new-tokens", "300"], ["ValueRangeError", "max_new_tokens 300", "max_len=256"]),
    ([*IDS, "--max-len", "1000"], ["ValueRangeError", "max_len", "max_position_embeddings=256", "1000"]),
    # which prompts
    (G, ["ConfigError", "--prompt", "got none"]),
    ([*G, "--prompt", "the cat", "--prompt-ids", "1"], ["ConfigError", "--prompt-ids", "not both"]),
    ([*IDS, "--chat"], ["ConfigError", "--chat", "--prompt-ids"]),
    ([*G, "--prompt", "the cat", "--system", "be brief"], ["ConfigError", "--system", "--chat"]),
    ([*G, "--prompt", "the cat", "--chat"], ["ConfigError", "--chat", "no chat template", "gptq-mixtral"]),
    ([*G, "--prompt", ""], ["ConfigError", "--prompt", "no tokens", "''"]),
    (["generate", "{notok}", "--prompt", "hi"], ["ConfigError", "tokenizer.json", "--prompt-ids", "no_tokenizer"]),
    (["generate", "WRONGDIR", "--prompt", "hi"], ["ConfigError", "'WRONGDIR'", "no such folder"]),
    (["generate", "{tmp}/missing", "--prompt-ids", "1"], ["ConfigError", "missing", "no such folder"]),
    # --prompt-file
    ([*G, "--prompt-file", "missing.txt"], ["ConfigError", "--prompt-file", "missing.txt", "no such file"]),
    ([*G, "--prompt-file", "{tmp}/folder"], ["ConfigError", "--prompt-file", "folder", "regular file"]),
    ([*G, "--prompt-file", "blank.txt"], ["ConfigError", "--prompt-file", "blank.txt", "no prompt"]),
    ([*G, "--prompt-file", "latin1.txt"], ["CorruptFileError", "--prompt-file", "latin1.txt", "UTF-8"]),
    # numbers
    ([*IDS, "--seed", HUGE_SEED], ["ConfigError", "--seed", HUGE_SEED, "4294967295"]),
    ([*IDS, "--seed", "-1"], ["ConfigError", "--seed", "-1"]),
    ([*IDS, "--seed", "x"], ["ConfigError", "--seed", "'x'"]),
    ([*IDS, "--temperature", "-1"], ["ConfigError", "temperature", "-1"]),
    ([*IDS, "--temperature", "nan"], ["ConfigError", "temperature", "nan"]),
    ([*IDS, "--top-p", "0"], ["ConfigError", "top_p", "> 0"]),
    ([*IDS, "--top-p", "1.5"], ["ConfigError", "top_p", "1.5"]),
    ([*IDS, "--top-k", "-2"], ["ConfigError", "top_k", "-2"]),
    ([*IDS, "--top-k", "2.5"], ["ConfigError", "--top-k", "'2.5'"]),
    ([*IDS, "--max-new-tokens", "0"], ["ConfigError", "--max-new-tokens", "0"]),
    ([*IDS, "--max-len", "0"], ["ConfigError", "--max-len", "0"]),
    ([*IDS, "--dtype", "float64"], ["ConfigError", "--dtype", "float64", "bfloat16"]),
    ([*IDS, "--revision", "../x"], ["ConfigError", "revision", "../x"]),
    ([*IDS, "--revision", "main"], ["ConfigError", "revision='main'", "checkpoint folder"]),
    ([*IDS, "--bogus"], ["ConfigError", "unrecognized arguments", "--bogus"]),
    # --mesh: the spec, then the devices this process has (one CPU device here), before any weight
    ([*IDS, "--mesh", "tp2x"], ["ConfigError", "--mesh", "epN, tpN or epNxtpM", "'tp2x'"]),
    ([*IDS, "--mesh", "ep0"], ["ConfigError", "--mesh", "at least 1", "'ep0'"]),
    ([*IDS, "--mesh", "ep4xtp2"], ["ConfigError", "--mesh", "needs 8 devices", "has 1"]),
    (["serve", "{mixtral}", "--mesh", "tp9"], ["ConfigError", "--mesh", "needs 9 devices", "has 1"]),
    # chat
    (["chat", "{mixtral}"], ["ConfigError", "chat", "no chat template", "gptq-mixtral"]),
    (["chat", "{notok}"], ["ConfigError", "chat", "tokenizer.json", "no_tokenizer"]),
    (["chat", "{mixtral}", "--seed", HUGE_SEED], ["ConfigError", "--seed", HUGE_SEED]),
    (["chat", "{mixtral}", "--top-p", "2"], ["ConfigError", "top_p", "2"]),
    # the other commands
    (["inspect", "WRONGDIR"], ["ConfigError", "'WRONGDIR'", "no such folder"]),
    (["convert", "{mixtral}", "--backend", "nope", "--out", "out"], ["ConfigError", "backend", "'nope'"]),
    (["convert", "{mixtral}", "--backend", "marlin", "--out", "out", "--input-dtype", "fp4"],
     ["ConfigError", "--input-dtype", "'fp4'"]),
    (["convert", "{mixtral}", "--backend", "cpu", "--out", "out", "--expert-chunk", "0"],
     ["ConfigError", "--expert-chunk", "0"]),
    (["convert", "{mixtral}", "--out", "out"], ["ConfigError", "--backend", "required"]),
    (["demo", "--tokens", "0"], ["ConfigError", "--tokens", "0"]),
    (["demo", "--seed", "-5"], ["ConfigError", "--seed", "-5"]),
    ([], ["ConfigError", "COMMAND", "required"]),
    (["serve"], ["ConfigError", "serve", "required", "DIR"]),
    (["bogus"], ["ConfigError", "invalid choice", "'bogus'"]),
])
def test_bad_command_line_is_one_line_exit_2(tmp_path, monkeypatch, capsys, no_tokenizer, args, words):
    """Each bad command line exits with status 2 and one stderr line naming the argument, file or
    folder; nothing is printed on stdout and nothing is written (the working folder, the
    checkpoint and the other inputs are unchanged)."""
    (tmp_path / "blank.txt").write_text("\n   \n\r\n")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    subst = {"{mixtral}": MIXTRAL, "{notok}": str(no_tokenizer), "{tmp}": str(tmp_path)}
    argv = []
    for a in args:
        for k, v in subst.items():
            a = a.replace(k, v)
        argv.append(a)
    before = [_tree(tmp_path), _tree(MIXTRAL), _tree(no_tokenizer)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert all(w in err for w in words), err
    assert [_tree(tmp_path), _tree(MIXTRAL), _tree(no_tokenizer)] == before


def test_prompt_file_is_refused_by_its_size_before_it_is_read(tmp_path, monkeypatch, capsys):
    """A --prompt-file over the cap is refused from its size (the file is never opened)."""
    import builtins

    from wna16_jax import cli

    path = tmp_path / "prompts.txt"
    path.write_text("the cat sat\n" * 3)
    monkeypatch.setattr(cli, "MAX_PROMPT_FILE_BYTES", 20)
    opened = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda f, *a, **k: opened.append(os.fspath(f)) or real_open(f, *a, **k))
    assert main(["generate", MIXTRAL, "--prompt-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompt-file" in err and "at most 20 bytes" in err and "36 bytes" in err, err
    assert str(path) not in opened
