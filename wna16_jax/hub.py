"""Where a model name points on disk: a checkpoint folder, a Hugging Face cache folder, or a hub id
that is already in the local Hugging Face cache. Nothing here downloads or touches the network.

:func:`resolve_model_dir` takes what a user types where a checkpoint is expected and returns the
folder that holds ``config.json`` and the weights, tried in this order:

1. **An existing folder** is returned as given, unless it is laid out as a hub cache repository
   (``models--ORG--NAME`` with ``snapshots/`` beside ``blobs/`` or ``refs/``, and no
   ``config.json``); then the snapshot its ref names is returned (step 2).
2. **A cache repository folder** resolves to ``snapshots/<commit>``: the commit is the revision
   itself when it is 40 hex digits, else the content of ``refs/<revision or main>``; with no
   revision and no ``refs/main``, the one snapshot there is; with several, the error lists them.
   A ref file is read size-bounded and must hold a commit id or the name of a snapshot folder,
   never a path; the snapshot returned lies inside the repository's ``snapshots/``.
3. **A hub id** (``ORG/NAME`` under the hub's naming rules) is resolved by huggingface_hub's own
   offline cache lookup (``snapshot_download(..., local_files_only=True)``), in the cache
   huggingface_hub picks (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
   ``~/.cache/huggingface/hub``) or in ``cache_dir``. huggingface_hub reads the ref file unbounded
   and joins its content and the revision into a path unchecked, so both are checked here first,
   and the folder it returns must lie inside the repository's ``snapshots/``. An id that is not
   cached raises :class:`~wna16_jax.errors.NotCachedError` naming the cache searched and the
   ``hf download`` command that fetches it.

huggingface_hub is imported only for step 3; folders work without it.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Any

from .errors import ConfigError, CorruptFileError, NotCachedError, UnsafePathError, UnsupportedError
from .fields import show_value

#: a commit id as the hub's cache names snapshot folders
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: one half of a hub id (huggingface_hub's documented rules, ``validate_repo_id``): ASCII letters,
#: digits, ``_``, ``-``, ``.``; 1 to 96 characters; neither starting nor ending with ``-`` or ``.``
_HUB_ID_PART = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?", re.ASCII)
#: one ``/``-separated part of a branch or tag name; none may be empty or start with ``.``
#: (which also keeps ``.`` and ``..`` out)
_REVISION_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*", re.ASCII)
_REVISION_MAX_CHARS = 255
#: a ref file holds one 40-hex commit id; anything longer is not a ref
_REF_MAX_BYTES = 256
#: the most folder names an error message lists
_LISTED = 20

_ACCEPTED = ("expected a checkpoint folder (with config.json), a Hugging Face cache folder "
             "(models--ORG--NAME) or a hub id (ORG/NAME) already in the local cache")


def resolve_model_dir(name_or_path: str | os.PathLike, *, revision: str | None = None,
                      cache_dir: str | os.PathLike | None = None) -> str:
    """The local folder a checkpoint is read from, for a folder, a Hugging Face cache repository
    folder, or a hub id ``ORG/NAME`` in the local cache (see the module doc for the rules).

    ``revision``: a branch, tag or commit id; it picks a snapshot of a cache folder or a hub id
    (``main`` when omitted), and is refused for a plain checkpoint folder, which has only one.
    ``cache_dir``: the hub cache to look a hub id up in, instead of the one huggingface_hub picks
    from ``HF_HUB_CACHE`` / ``HF_HOME``; folders given by path ignore it.

    Never downloads and never writes. Raises :class:`ConfigError` for an argument of the wrong
    type, an empty name, or a name that is neither a folder nor a hub id;
    :class:`NotCachedError` when the id or revision is not cached; :class:`CorruptFileError` /
    :class:`UnsafePathError` for a ref file that is not a commit id; :class:`UnsupportedError`
    for a hub id when huggingface_hub is not installed.
    """
    name = _path_text("name_or_path", name_or_path)
    revision = _check_revision(revision)
    cache = None if cache_dir is None else _path_text("cache_dir", cache_dir)
    if os.path.isdir(name):
        if _is_cache_repo(name):
            return _repo_snapshot(name, revision)
        if revision is not None:
            raise ConfigError(f"revision={revision!r}: picks a snapshot of a hub id or of a Hugging Face "
                              f"cache folder (models--ORG--NAME); {name!r} is a checkpoint folder, which "
                              "has only one")
        return name
    if os.path.lexists(name):
        raise ConfigError(f"{name!r}: not a folder; {_ACCEPTED}")
    if _is_hub_id(name):
        return _cached_hub_snapshot(name, revision, cache)
    raise ConfigError(f"{name!r}: no such folder, and not a hub id (ORG/NAME: letters, digits, '_', '-', "
                      f"'.', no '--' or '..'); {_ACCEPTED}")


def _path_text(argument: str, value: Any) -> str:
    """``value`` (a str or an ``os.PathLike`` naming a str path) as a non-empty str."""
    given = value
    if isinstance(value, os.PathLike):
        try:
            value = os.fspath(value)
        except TypeError:
            pass  # its __fspath__ returned neither str nor bytes: refused below by its type
    if not isinstance(value, str):
        via = f" (its __fspath__ gives {type(value).__name__})" if value is not given else ""
        raise ConfigError(f"{argument} must be a str or os.PathLike path, got {type(given).__name__} "
                          f"{show_value(given)}{via}")
    if not value:
        raise ConfigError(f"{argument} must not be empty; {_ACCEPTED}")
    return value


def _check_revision(revision: Any) -> str | None:
    """``revision`` unless it is not a branch, tag or commit name (it is joined into paths)."""
    if revision is None:
        return None
    rule = (f"a branch, tag or 40-hex commit id: at most {_REVISION_MAX_CHARS} characters, '/'-separated "
            "parts of letters, digits, '_', '-', '+', '.', none empty or starting with '.'")
    if not isinstance(revision, str):
        raise ConfigError(f"revision must be {rule}, got {type(revision).__name__} {show_value(revision)}")
    if len(revision) > _REVISION_MAX_CHARS or not all(
            _REVISION_PART.fullmatch(part) for part in revision.split("/")):
        raise ConfigError(f"revision must be {rule}, got {show_value(revision)}")
    return revision


def _is_hub_id(name: str) -> bool:
    """Whether ``name`` is a hub model id ``ORG/NAME`` under the hub's naming rules."""
    parts = name.split("/")
    return (len(parts) == 2 and all(_HUB_ID_PART.fullmatch(p) for p in parts)
            and "--" not in name and ".." not in name and not name.endswith(".git"))


def _is_cache_repo(folder: str) -> bool:
    """Whether ``folder`` is laid out as a hub cache repository rather than a checkpoint."""
    def sub(*parts):
        return os.path.join(folder, *parts)
    return (os.path.isdir(sub("snapshots")) and (os.path.isdir(sub("blobs")) or os.path.isdir(sub("refs")))
            and not os.path.exists(sub("config.json")))


def _names_under(folder: str, *, files: bool) -> list[str]:
    """Sorted names under ``folder`` (none when it is absent): its sub-folders, or (``files``)
    every file below it as a '/'-joined relative path — the snapshots and refs of a cache repo."""
    if not os.path.isdir(folder):
        return []
    try:
        if not files:
            with os.scandir(folder) as entries:
                return sorted(e.name for e in entries if e.is_dir())
        return sorted(os.path.relpath(os.path.join(d, f), folder).replace(os.sep, "/")
                      for d, _, fs in os.walk(folder) for f in fs)
    except OSError as e:
        raise ConfigError(f"{folder}: cannot be listed ({e.strerror or e})") from None


def _shown(names: list[str]) -> str:
    """``names`` for a message: the first :data:`_LISTED`, and how many more."""
    if not names:
        return "none"
    more = f", ... ({len(names) - _LISTED} more)" if len(names) > _LISTED else ""
    return ", ".join(names[:_LISTED]) + more


def _cache_contents(repo: str) -> str:
    refs = _names_under(os.path.join(repo, "refs"), files=True)
    snapshots = _names_under(os.path.join(repo, "snapshots"), files=False)
    return f"refs: {_shown(refs)}; snapshots: {_shown(snapshots)}"


def _read_ref(repo: str, ref: str, snapshots: list[str]) -> str | None:
    """The commit ``refs/<ref>`` of the cache repository ``repo`` names, None without that file.

    The file must lie inside ``refs/`` (symbolic links included), be at most
    :data:`_REF_MAX_BYTES` bytes of ASCII, and hold a 40-hex commit id or the name of one of
    ``snapshots``: never a path."""
    path = os.path.join(repo, "refs", *ref.split("/"))
    if not os.path.lexists(path):
        return None
    refs_real, real = os.path.realpath(os.path.join(repo, "refs")), os.path.realpath(path)
    if os.path.commonpath([refs_real, real]) != refs_real:
        raise UnsafePathError(f"{path}: resolves to {real}, outside {refs_real}; a ref is a file of the "
                              "cache folder")
    if not os.path.isfile(real):
        raise CorruptFileError(f"{path}: expected a file holding a 40-hex commit id, found a folder")
    try:
        with open(real, "rb") as f:
            data = f.read(_REF_MAX_BYTES + 1)
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(data) > _REF_MAX_BYTES:
        raise CorruptFileError(f"{path}: more than {_REF_MAX_BYTES} bytes; a ref file holds one 40-hex "
                               "commit id")
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise CorruptFileError(f"{path}: not ASCII text; expected a 40-hex commit id, got "
                               f"{show_value(data[:40])}") from None
    if _COMMIT.fullmatch(text) or text in snapshots:
        return text
    if "/" in text or "\\" in text or text.startswith("."):
        raise UnsafePathError(f"{path}: holds a path, {show_value(text)}; a ref names a commit (40 hex digits) "
                              "under snapshots/")
    raise CorruptFileError(f"{path}: expected a 40-hex commit id (or the name of a folder under "
                           f"snapshots/: {_shown(snapshots)}), got {show_value(text)}")


def _check_inside_snapshots(folder: str, repo: str) -> str:
    """``folder`` unless, symbolic links followed, it is not a folder directly inside ``repo``'s
    ``snapshots/``."""
    snapshots_real, real = os.path.realpath(os.path.join(repo, "snapshots")), os.path.realpath(folder)
    if os.path.dirname(real) != snapshots_real or not os.path.isdir(real):
        raise UnsafePathError(f"{folder}: resolves to {real}, which is not a snapshot folder inside "
                              f"{snapshots_real}")
    return folder


def _repo_snapshot(repo: str, revision: str | None) -> str:
    """The snapshot folder of the cache repository folder ``repo`` for ``revision`` (module doc,
    step 2)."""
    snapshots = _names_under(os.path.join(repo, "snapshots"), files=False)
    if revision is not None and _COMMIT.fullmatch(revision):
        commit, source = revision, f"revision={revision!r}"
    else:
        ref = revision or "main"
        commit, source = _read_ref(repo, ref, snapshots), os.path.join(repo, "refs", *ref.split("/"))
    if commit is None:
        if revision is not None:
            raise NotCachedError(f"{repo}: revision {revision!r} is not cached: no refs/{revision} "
                                 f"({_cache_contents(repo)}); pass one of the snapshots' commit ids as "
                                 "revision=")
        if len(snapshots) == 1:
            commit = snapshots[0]
        elif not snapshots:
            raise NotCachedError(f"{repo}: the cache folder holds no snapshot ({_cache_contents(repo)})")
        else:
            raise ConfigError(f"{repo}: no refs/main, and {len(snapshots)} snapshots: "
                              f"{_shown(['snapshots/' + s for s in snapshots])}; choose one with "
                              "revision='<commit>'")
    elif commit not in snapshots:
        raise NotCachedError(f"{source}: names commit {commit}, but {repo} has no snapshots/{commit} "
                             f"({_cache_contents(repo)})")
    return _check_inside_snapshots(os.path.join(repo, "snapshots", commit), repo)


def _download_command(repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    """The ``hf`` command (huggingface_hub's CLI) that puts ``repo_id`` into the cache."""
    command = f"hf download {repo_id}"
    if revision is not None:
        command += f" --revision {shlex.quote(revision)}"
    if cache_dir is not None:
        command += f" --cache-dir {shlex.quote(cache_dir)}"
    return command


def _cached_hub_snapshot(repo_id: str, revision: str | None, cache_dir: str | None) -> str:
    """The cached snapshot folder of the hub id ``repo_id`` (module doc, step 3)."""
    try:
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError:
        raise UnsupportedError(f"{repo_id!r} reads as a Hugging Face hub id, and finding it in the hub cache "
                               "needs huggingface_hub: pip install huggingface_hub (a checkpoint folder "
                               "needs nothing more)") from None
    cache = os.path.expanduser(cache_dir) if cache_dir is not None else constants.HF_HUB_CACHE
    repo = os.path.join(cache, "models--" + repo_id.replace("/", "--"))
    download = _download_command(repo_id, revision, cache_dir)
    if not os.path.isdir(repo):
        raise NotCachedError(f"hub id {repo_id!r} is not in the Hugging Face cache {cache} (no folder "
                             f"{os.path.basename(repo)}); nothing is downloaded here: fetch it with "
                             f"`{download}`, or pass a checkpoint folder")
    named = None
    if revision is None or not _COMMIT.fullmatch(revision):
        # huggingface_hub reads this file unbounded and joins its content into a path: check it first
        ref = revision or "main"
        named = _read_ref(repo, ref, _names_under(os.path.join(repo, "snapshots"), files=False))
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except errors.LocalEntryNotFoundError as e:
        incomplete = getattr(e, "snapshot_path", None)  # IncompleteSnapshotError (huggingface_hub 2.x)
        if incomplete:
            raise NotCachedError(f"hub id {repo_id!r}: the cached snapshot {incomplete} is incomplete ({e}); "
                                 f"complete it with `{download}`") from None
        found = f"refs/{ref} names commit {named}, which has no snapshot; " if named else ""
        raise NotCachedError(f"hub id {repo_id!r}: revision {revision or 'main'!r} is not in the cache "
                             f"folder {repo} ({found}{_cache_contents(repo)}); pass a cached commit as "
                             f"revision=, or fetch it with `{download}`") from None
    except errors.HFValidationError as e:
        raise ConfigError(f"hub id {repo_id!r}: refused by huggingface_hub: {e}") from None
    return _check_inside_snapshots(folder, repo)


__all__ = ["resolve_model_dir"]
