"""The command line around a chat model: `chat`, `generate` with several prompts and `--chat`,
hub ids and cache folders, `--version` / `--help`, a closed pipe and Ctrl-C.

The checkpoint is the tiny real-tool Mixtral fixture (GPTQ, 2 layers, vocab_size 320) given a
chat template: its tokenizer's vocabulary is extended with plain words up to 318 ids and the
ChatML markers ``<|im_start|>`` / ``<|im_end|>`` are added as special tokens (ids 318, 319), so
every id the model can produce decodes to its own word and a printed reply pins down its tokens.
``generation_config.json`` names ``<|im_end|>`` as an eos id, as chat checkpoints do. The
references are the library's Generator / generate on the ids the template renders."""

import argparse
import importlib.metadata
import io
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib

import jax
import pytest

from wna16_jax import cli
from wna16_jax.cli import CHAT_EXIT, build_parser, main, package_version
from wna16_jax.models import load_model, load_tokenizer
from wna16_jax.models.generation import Generator, generate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXTRAL = os.path.join(ROOT, "tests", "fixtures", "quantizers", "gptq-mixtral")
CHATML = ("{%- for m in messages %}{{- '<|im_start|>' ~ m['role'] ~ '\\n' ~ m['content'] ~ '<|im_end|>\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
#: markers the tiny vocabulary lacks: they encode as <unk>
INST = ("{{- bos_token }}{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '[INST] ' ~ m['content'] ~ "
        "' [/INST]' }}{%- else %}{{- ' ' ~ m['content'] ~ eos_token }}{%- endif %}{%- endfor %}")
WEIGHTS = ("config.json", "model.safetensors", "quantize_config.json")


def _chat_folder(folder, template, *, chatml_tokens: bool):
    """The Mixtral fixture's weights in ``folder`` with a chat template (see the module doc)."""
    os.makedirs(folder)
    for name in WEIGHTS + ("special_tokens_map.json",):
        shutil.copy(os.path.join(MIXTRAL, name), os.path.join(folder, name))
    with open(os.path.join(MIXTRAL, "tokenizer.json")) as f:
        tokenizer = json.load(f)
    vocab = tokenizer["model"]["vocab"]
    if chatml_tokens:
        vocab.update({f"w{i}": i for i in range(len(vocab), 318)})
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(MIXTRAL, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = template
    if chatml_tokens:
        config["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    generation = {"bos_token_id": 1, "do_sample": True, **({"eos_token_id": 319} if chatml_tokens else {})}
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump(generation, f)
    return folder


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    folder = _chat_folder(str(tmp_path_factory.mktemp("chat") / "tiny-chat"), CHATML, chatml_tokens=True)
    tok = load_tokenizer(folder)
    assert tok.token_id("<|im_start|>") == 318 and tok.token_id("<|im_end|>") == 319 and tok.id_limit == 320
    return folder


@pytest.fixture(scope="module")
def chat_model(chat_dir):
    return load_model(chat_dir, dtype="float32"), load_tokenizer(chat_dir)


def _reply(ids, stops):
    """The reply's tokens: the generated ones, less a final stop token."""
    return ids[:-1] if ids and ids[-1] in stops else ids


# --------------------------------------------------------------------------- chat


def test_chat_streams_each_turn_as_the_generator_gives_it(chat_dir, chat_model, monkeypatch, capsys):
    """Two user turns (a blank line skipped, `/exit` ends before the last line): each printed
    reply is what the Generator gives for the whole conversation rendered by the template, with
    the model's default sampling (do_sample, temperature 1) and turn i's key fold_in(key(seed), i);
    each reply's decoded text is the assistant turn the next rendering contains."""
    model, tok = chat_model
    stops = model.config.eos_token_ids
    assert stops == (319, 2)
    user = ["the cat sat near the river", "we go  to the old mill"]
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{user[0]}\n\n{user[1]}\r\n{CHAT_EXIT}\nnever read\n"))
    assert main(["chat", chat_dir, "--system", "a short text", "--max-new-tokens", "10", "--seed", "7",
                 "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    lines = out.split("\n")
    assert len(lines) == 3 and lines[2] == "", out

    gen = Generator(model, batch_size=1, max_len=256)
    messages = [{"role": "system", "content": "a short text"}]
    replies = []
    for turn, text in enumerate(user):
        messages.append({"role": "user", "content": text})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert ids[-2:] == [318, tok.unk_token_id]     # the header: the marker, then "assistant" (not a word here)
        got = gen.generate([ids], 10, key=jax.random.fold_in(jax.random.key(7), turn), stop_tokens=stops)[0]
        reply = _reply(got, stops)
        replies.append(reply)
        assert lines[turn].strip() == tok.decode(reply).strip()
        messages.append({"role": "assistant", "content": tok.decode(reply)})
    assert any(replies) and replies[0] != replies[1]
    assert "turn 1: " in err and "turn 2: " in err and "turn 3" not in err and "a cache of 256 tokens" in err


def test_chat_past_its_cache_is_an_error_naming_max_len(chat_dir, monkeypatch, capsys):
    """A turn whose conversation no longer fits the cache ends the chat with status 2 and one
    error line naming the prompt length and max_len; nothing is printed on stdout."""
    monkeypatch.setattr(sys, "stdin", io.StringIO("the cat sat near the river and the old mill\n"))
    assert main(["chat", chat_dir, "--max-len", "16", "--max-new-tokens", "8"]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2 and "a cache of 16 tokens" in lines[0], err
    assert lines[1].startswith("error: ValueRangeError") and "max_new_tokens 8" in lines[1] and "max_len=16" in lines[1]


def test_generate_chat_renders_one_user_turn(chat_dir, chat_model, capsys):
    """`generate --chat --system`: the prompt is rendered as [system, user] with the assistant's
    header; only the reply is printed, greedy as the library's generate gives it."""
    model, tok = chat_model
    assert main(["generate", chat_dir, "--chat", "--system", "we count", "--prompt", "the weights of one expert",
                 "--temperature", "0", "--max-new-tokens", "6", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    ids = tok.apply_chat_template([{"role": "system", "content": "we count"},
                                   {"role": "user", "content": "the weights of one expert"}])
    stops = model.config.eos_token_ids
    want = _reply(generate(model, [ids], 6, temperature=0, stop_tokens=stops)[0], stops)
    assert want and out.strip() == tok.decode(want).strip() and out.endswith("\n")
    assert err.count("\n") == 1 and f"prompt(s) of {len(ids)} tokens" in err


def test_template_markers_outside_the_vocabulary(tmp_path, chat_model, capsys):
    """A template whose markers ([INST]) the tiny vocabulary lacks: they encode as <unk> and
    the chat still runs, as the library renders and generates it."""
    folder = _chat_folder(str(tmp_path / "inst"), INST, chatml_tokens=False)
    model, _ = chat_model                  # the same weights; this folder's eos id is config.json's, 2
    tok = load_tokenizer(folder)
    ids = tok.apply_chat_template([{"role": "user", "content": "the cat"}])
    assert ids == [tok.bos_token_id, tok.unk_token_id, 58, 7, tok.unk_token_id]
    assert main(["generate", folder, "--chat", "--prompt", "the cat", "--temperature", "0", "--max-new-tokens", "4",
                 "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    want = _reply(generate(model, [ids], 4, temperature=0, stop_tokens=(2,))[0], (2,))
    assert out.strip() == tok.decode(want).strip()


def test_generation_stops_at_the_eos_ids_unprinted(tmp_path, chat_dir, chat_model, capsys):
    """A folder whose eos id is the third token greedy decoding gives: one prompt streams two
    tokens and stops (the eos is not printed); in a batch, the row that stops is printed first
    and the other runs to --max-new-tokens."""
    model, tok = chat_model
    text, other = "the cat sat near the river", "we go to the old mill"
    ids, other_ids = tok.encode(text), tok.encode(other)
    free = generate(model, [ids], 6, temperature=0, stop_tokens=())[0]
    eos = free[2]
    assert eos not in free[:2]
    folder = tmp_path / "stops"
    shutil.copytree(chat_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    assert main(["generate", str(folder), "--prompt", text, "--temperature", "0", "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out == tok.decode(ids + free[:2]) + "\n" and "3 new tokens" in err
    assert main(["generate", str(folder), "--prompt", other, "--prompt", text, "--temperature", "0",
                 "--max-new-tokens", "6"]) == 0
    lines = capsys.readouterr().out.split("\n")
    rest = generate(model, [other_ids], 6, temperature=0, stop_tokens=(eos,))[0]
    assert eos not in rest and len(rest) == 6
    assert lines == [f"[1] {tok.decode(ids + free[:2])}", f"[0] {tok.decode(other_ids + rest)}", ""]


# --------------------------------------------------------------------------- batches and hub ids


@pytest.fixture
def hub_cache(chat_dir, tmp_path, monkeypatch):
    """A Hugging Face cache in tmp_path holding `org/tiny-chat` at two commits (refs/main names
    the first); the hub module's default cache points there; any network use fails the test."""
    import huggingface_hub.constants

    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    repo = cache / "models--org--tiny-chat"
    commits = [os.urandom(20).hex() for _ in range(2)]
    for commit in commits:
        shutil.copytree(chat_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commits[0])
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.chdir(tmp_path)
    yield repo, commits
    assert attempts == []


def test_generate_batch_from_a_hub_id(hub_cache, chat_model, tmp_path, capsys):
    """`--prompt` and `--prompt-file` (blank lines skipped) make one batch; each prompt's text and
    completion is printed once, labelled with its index, and equals that prompt run alone."""
    repo, commits = hub_cache
    model, tok = chat_model
    (tmp_path / "prompts.txt").write_text("the cat sat\n\n  \nwe go to the river\r\n")
    prompts = ["one small stone", "the cat sat", "we go to the river"]
    assert main(["generate", "org/tiny-chat", "--prompt", prompts[0], "--prompt-file", "prompts.txt",
                 "--temperature", "0", "--max-new-tokens", "5", "--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    lines = out.strip("\n").split("\n")
    labelled = dict(line.split(" ", 1) for line in lines)
    assert len(lines) == 3 and sorted(labelled) == ["[0]", "[1]", "[2]"], out
    stops = model.config.eos_token_ids
    for i, text in enumerate(prompts):
        ids = tok.encode(text)
        alone = _reply(generate(model, [ids], 5, temperature=0, stop_tokens=stops)[0], stops)
        assert labelled[f"[{i}]"] == tok.decode(ids + alone)
    assert err.count("\n") == 1 and str(repo / "snapshots" / commits[0]) in err and "3 prompt(s)" in err


def test_inspect_resolves_cache_folders_and_revisions(hub_cache, capsys):
    repo, commits = hub_cache
    for argv, commit in ((["inspect", "org/tiny-chat"], commits[0]),
                         (["inspect", "org/tiny-chat", "--revision", commits[1]], commits[1]),
                         (["inspect", str(repo)], commits[0]),
                         (["inspect", str(repo), "--revision", commits[1]], commits[1])):
        assert main(argv) == 0, capsys.readouterr().err
        out = capsys.readouterr().out
        assert out.startswith(f"checkpoint: {repo / 'snapshots' / commit}\n") and "MoE layers: 2" in out
    assert main(["inspect", "org/absent"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: NotCachedError") and "org/absent" in err
    assert main(["generate", "org/tiny-chat", "--revision", "v9", "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NotCachedError" in err and "'v9'" in err


# --------------------------------------------------------------------------- --version and --help


def _pyproject_version():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_version_from_the_metadata_else_pyproject(monkeypatch, capsys):
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "7.8.9" if name == "wna16-jax" else None)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == "wna16-jax 7.8.9\n"

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert package_version() == _pyproject_version()


def _commands():
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_help_is_plain_text_with_every_default(capsys):
    """No RST markup in any --help; every argument has a help text; every option that has a
    default shows it."""
    parser, commands = _commands()
    assert set(commands) == {"demo", "inspect", "convert", "generate", "chat", "serve"}
    for p in [parser, *commands.values()]:
        text = p.format_help()
        assert "``" not in text and ":class:" not in text and ":func:" not in text
        actions = [a for a in p._actions if a.dest != "help"]
        assert all(a.help for a in actions), [a.dest for a in actions if not a.help]
        shown = [a for a in actions if a.option_strings and a.default is not argparse.SUPPRESS]
        assert text.count("(default:") == len(shown), text
    with pytest.raises(SystemExit) as e:
        main(["chat", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--top-k" in out and "--revision" in out and "{float32,bfloat16,float16}" in out


# --------------------------------------------------------------------------- pipes and signals


def _env():
    return dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_closed_pipe_ends_quietly():
    """stdout's reader gone before anything is written, and `inspect DIR | head -1`: no
    BrokenPipeError, no traceback, status 141 (or 0 when everything fit in the pipe)."""
    p = subprocess.Popen([sys.executable, "-m", "wna16_jax", "inspect", MIXTRAL], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=_env())
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == cli.EXIT_BROKEN_PIPE and err == "", err
    r = subprocess.run(["bash", "-c", f'set -o pipefail; "{sys.executable}" -m wna16_jax inspect "{MIXTRAL}" | head -1'],
                       capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode in (0, cli.EXIT_BROKEN_PIPE) and r.stderr == "", r.stderr
    assert r.stdout == f"checkpoint: {MIXTRAL}\n"


def test_ctrl_c_while_chat_waits_for_input(chat_dir):
    """SIGINT while chat reads stdin: status 130, one short line, no traceback."""
    p = subprocess.Popen([sys.executable, "-m", "wna16_jax", "chat", chat_dir], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    try:
        deadline = time.monotonic() + 120
        ready = ""
        while "loaded" not in ready and time.monotonic() < deadline:
            if select.select([p.stderr], [], [], 1.0)[0]:
                ready = p.stderr.readline()
                assert ready, "chat exited before it was ready"
        assert "loaded" in ready and "/exit" in ready
        time.sleep(0.2)                   # inside readline by now (any point in main ends the same way)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == cli.EXIT_INTERRUPTED and out == "" and err == "interrupted\n", err
