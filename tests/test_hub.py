"""wna16_jax.hub.resolve_model_dir: checkpoint folders, Hugging Face cache repository folders and hub
ids in the local cache, resolved offline.

Each test builds, in its temporary folder, a hub cache laid out as huggingface_hub lays it out:
blobs named by their hash (sha256 for large files, the git blob id for small ones), snapshot files
as relative symbolic links into ``../../blobs``, ``refs/<name>`` holding a commit id. Commit ids
and file contents are fresh random values, so a test that returned the wrong snapshot reads the
wrong ``config.json``. Every test checks that no network call was attempted and every hostile case
that nothing under the temporary folder changed."""

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import huggingface_hub
import huggingface_hub.constants
from huggingface_hub.errors import IncompleteSnapshotError

from wna16_jax.errors import (ConfigError, CorruptFileError, NotCachedError, UnsafePathError, UnsupportedError,
                              WNA16Error)
from wna16_jax.hub import resolve_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers


def _commit() -> str:
    return os.urandom(20).hex()


class CachedRepo:
    """One ``models--ORG--NAME`` folder of a hub cache; ``configs[commit]`` is the content each
    snapshot's ``config.json`` was given."""

    def __init__(self, cache: Path, repo_id: str, commits: int = 2):
        self.cache, self.repo_id = cache, repo_id
        self.dir = cache / ("models--" + repo_id.replace("/", "--"))
        for sub in ("blobs", "snapshots", "refs"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.commits = [_commit() for _ in range(commits)]
        self.configs = {}
        for commit in self.commits:
            config = json.dumps({"model_type": "qwen3_moe", "marker": os.urandom(8).hex()}).encode()
            self.configs[commit] = config
            self._add_file(commit, "config.json", config, large=False)
            self._add_file(commit, "model.safetensors", os.urandom(64), large=True)
            self._add_file(commit, "nested/tokenizer.json", os.urandom(16), large=False)

    def _add_file(self, commit: str, name: str, data: bytes, *, large: bool) -> None:
        blob = (hashlib.sha256(data).hexdigest() if large
                else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest())
        (self.dir / "blobs" / blob).write_bytes(data)
        link = self.dir / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(self.dir / "blobs" / blob, link.parent), link)

    def set_ref(self, name: str, content: str | bytes) -> Path:
        path = self.dir / "refs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content.encode() if isinstance(content, str) else content)
        return path

    def snapshot(self, commit: str) -> Path:
        return self.dir / "snapshots" / commit


def _config_of(folder: str) -> bytes:
    return (Path(folder) / "config.json").read_bytes()


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root``, folders included (a lookup must not even create an empty
    ``.locks`` folder), with its kind and content hash or link target; links are not followed."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link:" + os.readlink(p)
            elif os.path.isdir(p):
                out[rel] = "dir"
            else:
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


@contextlib.contextmanager
def no_writes(root: Path):
    before = _tree(root)
    yield
    assert _tree(root) == before


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """HF_HUB_OFFLINE=1, and every socket connection or name lookup is recorded and refused; the
    test fails if any was attempted (huggingface_hub would swallow the refusal and go on)."""
    attempts = []

    def refuse(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access in a test")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield
    assert attempts == []


@pytest.fixture
def work(tmp_path, monkeypatch):
    """The test's folder, also the working directory (so a relative ``ORG/NAME`` is no folder)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def repo(work):
    """A cached ``org/model`` with two snapshots; ``refs/main`` names the first, tag ``v1.0``
    the second."""
    r = CachedRepo(work / "cache", "org-1/Model_2.5-GPTQ-Int4")
    r.set_ref("main", r.commits[0])
    r.set_ref("v1.0", r.commits[1])
    return r


# --------------------------------------------------------------------------- accepted inputs


def test_checkpoint_folder_is_returned_as_given(work):
    ckpt = work / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text("{}")
    with no_writes(work):
        assert resolve_model_dir(str(ckpt)) == str(ckpt)
        assert resolve_model_dir(ckpt) == str(ckpt)          # os.PathLike
        assert resolve_model_dir("ckpt") == "ckpt"            # relative, unchanged
        assert resolve_model_dir(ckpt, cache_dir=work / "nowhere") == str(ckpt)


def test_a_folder_shadows_a_hub_id_of_the_same_name(work, repo):
    local = work / repo.repo_id
    local.mkdir(parents=True)
    assert resolve_model_dir(repo.repo_id, cache_dir=repo.cache) == repo.repo_id


def test_hub_id_resolves_to_the_main_snapshot(work, repo):
    with no_writes(work):
        got = resolve_model_dir(repo.repo_id, cache_dir=repo.cache)
    assert os.path.samefile(got, repo.snapshot(repo.commits[0]))
    assert _config_of(got) == repo.configs[repo.commits[0]]


@pytest.mark.parametrize("how", ["commit", "tag"])
def test_hub_id_revision_picks_another_snapshot(work, repo, how):
    revision = repo.commits[1] if how == "commit" else "v1.0"
    with no_writes(work):
        got = resolve_model_dir(repo.repo_id, revision=revision, cache_dir=str(repo.cache))
    assert os.path.samefile(got, repo.snapshot(repo.commits[1]))
    assert _config_of(got) == repo.configs[repo.commits[1]]


def test_hub_id_branch_with_slashes(work, repo):
    repo.set_ref("refs/pr/3", repo.commits[1])
    got = resolve_model_dir(repo.repo_id, revision="refs/pr/3", cache_dir=repo.cache)
    assert _config_of(got) == repo.configs[repo.commits[1]]


@pytest.mark.parametrize("revision, index", [(None, 0), ("v1.0", 1), ("commit1", 1)])
def test_cache_repo_folder_resolves_to_its_snapshot(work, repo, revision, index):
    revision = repo.commits[1] if revision == "commit1" else revision
    with no_writes(work):
        got = resolve_model_dir(repo.dir, revision=revision)
    assert got == os.path.join(str(repo.dir), "snapshots", repo.commits[index])
    assert _config_of(got) == repo.configs[repo.commits[index]]


def test_cache_repo_folder_through_a_symlink(work, repo):
    os.symlink(repo.dir, work / "alias")
    got = resolve_model_dir("alias")
    assert got == os.path.join("alias", "snapshots", repo.commits[0])
    assert _config_of(got) == repo.configs[repo.commits[0]]


def test_cache_repo_folder_without_refs_uses_its_single_snapshot(work):
    r = CachedRepo(work / "cache", "org/one", commits=1)
    with no_writes(work):
        got = resolve_model_dir(r.dir)
    assert _config_of(got) == r.configs[r.commits[0]]


def test_snapshot_folder_is_a_checkpoint_folder(work, repo):
    snap = repo.snapshot(repo.commits[1])
    assert resolve_model_dir(snap) == str(snap)


def test_default_cache_is_read_from_huggingface_hub_at_call_time(work, repo, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(repo.cache))
    with no_writes(work):
        got = resolve_model_dir(repo.repo_id)
    assert _config_of(got) == repo.configs[repo.commits[0]]


@pytest.mark.parametrize("variable", ["HF_HUB_CACHE", "HF_HOME"])
def test_environment_picks_the_default_cache(work, variable):
    """A fresh interpreter, where huggingface_hub reads the environment as it imports."""
    cache = work / "home" / "hub" if variable == "HF_HOME" else work / "elsewhere"
    r = CachedRepo(cache, "org/env-model", commits=1)
    r.set_ref("main", r.commits[0])
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HF_HOME", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME")}
    env.update({variable: str(work / "home" if variable == "HF_HOME" else cache), "HF_HUB_OFFLINE": "1",
                "PYTHONPATH": str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")})
    code = "from wna16_jax.hub import resolve_model_dir; print(resolve_model_dir('org/env-model'))"
    with no_writes(work):
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=work, capture_output=True, text=True,
                             timeout=120)
    assert out.returncode == 0, out.stderr
    assert os.path.samefile(out.stdout.strip(), r.snapshot(r.commits[0]))


# --------------------------------------------------------------------------- hostile inputs


def _raises(work, cls, *words, **kwargs):
    """resolve_model_dir(**kwargs) raises ``cls`` naming each of ``words``, writing nothing."""
    with no_writes(work), pytest.raises(cls) as info:
        resolve_model_dir(**kwargs)
    assert isinstance(info.value, WNA16Error)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
    return str(info.value)


def test_id_not_cached_names_id_cache_and_download_command(work, repo):
    msg = _raises(work, NotCachedError, "Qwen/Qwen3-30B-A3B-GPTQ-Int4", str(repo.cache),
                  "hf download Qwen/Qwen3-30B-A3B-GPTQ-Int4 --cache-dir",
                  name_or_path="Qwen/Qwen3-30B-A3B-GPTQ-Int4", cache_dir=repo.cache)
    assert "`hf download Qwen/Qwen3-30B-A3B-GPTQ-Int4 --cache-dir " + str(repo.cache) + "`" in msg


def test_id_not_cached_in_the_default_cache(work, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(work / "default-cache"))
    msg = _raises(work, NotCachedError, "org/absent", str(work / "default-cache"), "`hf download org/absent`",
                  name_or_path="org/absent")
    assert "--cache-dir" not in msg


def test_missing_cache_dir(work):
    _raises(work, NotCachedError, "org/x", str(work / "no-such-cache"), name_or_path="org/x",
            cache_dir=work / "no-such-cache")


def test_id_revision_not_cached(work, repo):
    _raises(work, NotCachedError, repo.repo_id, "'v9'", "refs: main, v1.0", repo.commits[0],
            "hf download " + repo.repo_id + " --revision v9", name_or_path=repo.repo_id, revision="v9",
            cache_dir=repo.cache)
    _raises(work, NotCachedError, repo.repo_id, "f" * 40, name_or_path=repo.repo_id, revision="f" * 40,
            cache_dir=repo.cache)


def test_id_without_refs_main_lists_its_snapshots(work):
    r = CachedRepo(work / "cache", "org/two")
    _raises(work, NotCachedError, "org/two", "'main'", r.commits[0], r.commits[1], "revision=",
            name_or_path="org/two", cache_dir=r.cache)


@pytest.mark.parametrize("via", ["id", "folder"])
def test_ref_names_a_missing_snapshot(work, repo, via):
    missing = _commit()
    repo.set_ref("main", missing)
    args = dict(name_or_path=repo.repo_id, cache_dir=repo.cache) if via == "id" else dict(name_or_path=repo.dir)
    _raises(work, NotCachedError, missing, repo.commits[0], **args)


@pytest.mark.parametrize("via", ["id", "folder"])
@pytest.mark.parametrize("content, cls, words", [
    ("../../..", UnsafePathError, ["refs/main", "'../../..'", "a path"]),
    ("/etc", UnsafePathError, ["refs/main", "'/etc'"]),
    (".", UnsafePathError, ["refs/main", "'.'"]),
    ("0" * 300, CorruptFileError, ["refs/main", "256 bytes"]),
    (b"\x00\xff\xfe" * 10, CorruptFileError, ["refs/main", "not ASCII"]),
    ("not-a-commit", CorruptFileError, ["refs/main", "'not-a-commit'", "40-hex"]),
    ("abc123\n", CorruptFileError, ["refs/main", "'abc123\\n'"]),
])
def test_hostile_ref_content(work, repo, via, content, cls, words):
    repo.set_ref("main", content)
    args = dict(name_or_path=repo.repo_id, cache_dir=repo.cache) if via == "id" else dict(name_or_path=repo.dir)
    _raises(work, cls, *words, **args)


def test_huge_ref_file_is_read_bounded(work, repo, monkeypatch):
    path = repo.set_ref("main", b"0" * 1_000_000)
    sizes = []
    real_open = open

    class Recording:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, n=-1):
            sizes.append(n)
            return self.f.read(n)

    def recording_open(file, *args, **kwargs):
        f = real_open(file, *args, **kwargs)
        return Recording(f) if os.path.realpath(file) == os.path.realpath(path) else f

    with monkeypatch.context() as patch, pytest.raises(CorruptFileError, match="refs/main"):
        patch.setattr("builtins.open", recording_open)
        resolve_model_dir(repo.dir)
    assert sizes and all(0 <= n <= 4096 for n in sizes)


@pytest.mark.parametrize("via", ["id", "folder"])
def test_ref_symlink_leaving_the_repo(work, repo, via):
    outside = work / "outside"
    outside.write_text(repo.commits[1])
    (repo.dir / "refs" / "main").unlink()
    os.symlink(outside, repo.dir / "refs" / "main")
    args = dict(name_or_path=repo.repo_id, cache_dir=repo.cache) if via == "id" else dict(name_or_path=repo.dir)
    _raises(work, UnsafePathError, "refs/main", os.path.realpath(outside), **args)


def test_ref_that_is_a_folder(work, repo):
    (repo.dir / "refs" / "main").unlink()
    (repo.dir / "refs" / "main").mkdir()
    _raises(work, CorruptFileError, "refs/main", "folder", name_or_path=repo.dir)


def test_snapshot_symlink_leaving_the_repo(work, repo):
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.json").write_text("{}")
    fake = _commit()
    os.symlink(elsewhere, repo.snapshot(fake))
    repo.set_ref("main", fake)
    _raises(work, UnsafePathError, fake, os.path.realpath(elsewhere), name_or_path=repo.dir)
    _raises(work, UnsafePathError, fake, os.path.realpath(elsewhere), name_or_path=repo.repo_id,
            cache_dir=repo.cache)


def test_two_snapshots_and_no_refs(work):
    r = CachedRepo(work / "cache", "org/two")
    msg = _raises(work, ConfigError, str(r.dir), "no refs/main", "snapshots/" + r.commits[0],
                  "snapshots/" + r.commits[1], "revision=", name_or_path=r.dir)
    assert "2 snapshots" in msg


def test_cache_repo_folder_revision_not_cached(work, repo):
    _raises(work, NotCachedError, str(repo.dir), "'v2'", "refs: main, v1.0", name_or_path=repo.dir,
            revision="v2")
    _raises(work, NotCachedError, "e" * 40, name_or_path=repo.dir, revision="e" * 40)


def test_empty_cache_repo_folder(work):
    empty = work / "models--org--empty"
    for sub in ("blobs", "snapshots", "refs"):
        (empty / sub).mkdir(parents=True)
    _raises(work, NotCachedError, str(empty), "no snapshot", name_or_path=empty)


@pytest.mark.parametrize("name", [
    "org/../../outside", "../outside", "org/..", "/org/name", "org//name", "org/name/extra",
    "org--x/name", "org/na..me", "-org/name", "org/name.", "org/name.git", "org/na me", "~/org",
    "org/caf\u00e9", "org/" + "a" * 97, "org\\name", "a\0b/c",
])
def test_names_that_are_neither_folders_nor_hub_ids(work, repo, name):
    _raises(work, ConfigError, repr(name), "not a hub id", "checkpoint folder", "ORG/NAME",
            name_or_path=name, cache_dir=repo.cache)


def test_a_file_is_not_a_folder(work):
    (work / "model.safetensors").write_bytes(b"x")
    _raises(work, ConfigError, "'model.safetensors'", "not a folder", name_or_path="model.safetensors")


@pytest.mark.parametrize("value", [None, 42, 3.5, b"org/name", ["org/name"], {"org": "name"}])
def test_non_string_name(work, value):
    _raises(work, ConfigError, "name_or_path", type(value).__name__, name_or_path=value)


def test_pathlike_returning_bytes(work):
    class BytesPath:
        def __fspath__(self):
            return b"org/name"

    _raises(work, ConfigError, "name_or_path", "BytesPath", name_or_path=BytesPath())


def test_empty_name(work):
    _raises(work, ConfigError, "name_or_path", "must not be empty", name_or_path="")
    _raises(work, ConfigError, "cache_dir", "must not be empty", name_or_path="org/x", cache_dir="")


@pytest.mark.parametrize("revision", ["../../etc", "/abs", "a//b", "main/", ".hidden", "a/../b", "",
                                      "x" * 256, "tag name", "v1\n", 7, b"main"])
def test_hostile_revision(work, repo, revision):
    _raises(work, ConfigError, "revision", name_or_path=repo.repo_id, revision=revision, cache_dir=repo.cache)
    _raises(work, ConfigError, "revision", name_or_path=repo.dir, revision=revision)


def test_revision_for_a_checkpoint_folder(work):
    (work / "ckpt").mkdir()
    _raises(work, ConfigError, "revision='v1.0'", "'ckpt'", "checkpoint folder", name_or_path="ckpt",
            revision="v1.0")


def test_non_string_cache_dir(work):
    _raises(work, ConfigError, "cache_dir", "int", name_or_path="org/x", cache_dir=5)


def test_incomplete_snapshot(work, repo, monkeypatch):
    """huggingface_hub's own verdict (a cached tree listing that names files the snapshot lacks)
    reaches the caller as NotCachedError with the download command."""
    snap = str(repo.snapshot(repo.commits[0]))

    def incomplete(*args, **kwargs):
        raise IncompleteSnapshotError("1 file(s) are missing (model-00002.safetensors)", snapshot_path=snap)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", incomplete)
    _raises(work, NotCachedError, repo.repo_id, snap, "incomplete", "model-00002.safetensors",
            "hf download " + repo.repo_id, name_or_path=repo.repo_id, cache_dir=repo.cache)


def test_folder_from_huggingface_hub_outside_the_repo_is_refused(work, repo, monkeypatch):
    other = CachedRepo(work / "cache", "org/other", commits=1)
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda *a, **k: str(other.snapshot(other.commits[0])))
    _raises(work, UnsafePathError, other.commits[0], str(repo.dir.name), name_or_path=repo.repo_id,
            cache_dir=repo.cache)


def test_without_huggingface_hub(work, repo, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)   # `import huggingface_hub` fails
    _raises(work, UnsupportedError, repo.repo_id, "pip install huggingface_hub", name_or_path=repo.repo_id,
            cache_dir=repo.cache)
    # folders, cache repository folders included, need no huggingface_hub
    assert _config_of(resolve_model_dir(repo.dir)) == repo.configs[repo.commits[0]]
