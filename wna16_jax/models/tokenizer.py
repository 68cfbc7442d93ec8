"""A checkpoint folder's tokenizer as transformers 5 loads it: ``tokenizer.json`` through the
``tokenizers`` package, the special tokens and chat templates of ``tokenizer_config.json``.

``pip install "wna16-jax[models]"`` brings ``tokenizers`` (and ``jinja2`` for chat templates; both
are imported lazily). Only these files inside the folder are read, nothing is written or
downloaded: ``tokenizer.json`` (required), ``tokenizer_config.json``, ``special_tokens_map.json``,
``chat_template.jinja``, ``additional_chat_templates/*.jinja`` and ``config.json`` (its
``vocab_size`` only). A file larger than its cap (:data:`MAX_TOKENIZER_JSON_BYTES`,
:data:`MAX_CONFIG_BYTES`) is refused by its size, before it is read.

What transformers does (observed with transformers 5.25 and ``AutoTokenizer.from_pretrained``;
``tests/fixtures/tokenizers/*/reference.json`` holds the evidence), and so what this class does:

* ``encode(text)`` adds the special tokens of ``tokenizer.json``'s post-processor (a Llama /
  Mixtral ``<s>``, DeepSeek's ``<｜begin▁of▁sentence｜>``; nothing for Qwen);
  ``add_special_tokens=False`` turns that off. ``tokenizer_config.json``'s ``add_bos_token`` /
  ``add_eos_token`` change nothing: transformers 5 drops both whenever the folder has a
  ``tokenizer.json`` (they are still read, type-checked and exposed). Truncation and padding
  stored in ``tokenizer.json`` are not applied (transformers resets both on every call).
* The named special tokens (``bos_token``, ``eos_token``, ``unk_token``, ``sep_token``,
  ``pad_token``, ``cls_token``, ``mask_token``, and other string ``*_token`` fields: a string, or
  an AddedToken object ``{"content": ..., "lstrip": ..., ...}``), ``extra_special_tokens`` /
  ``additional_special_tokens`` and ``added_tokens_decoder`` entries that ``tokenizer.json``
  lacks are added to the vocabulary (in memory), so that text containing them encodes as those
  tokens. ``special_tokens_map.json``, when ``tokenizer_config.json`` has no
  ``added_tokens_decoder``, overrides the named tokens (transformers' legacy rule).
* Chat templates: ``tokenizer_config.json``'s ``chat_template`` is a string or a list of
  ``{"name", "template"}`` objects; a ``chat_template.jinja`` file (the default template) and
  ``additional_chat_templates/<name>.jinja`` files take priority: when any such file exists,
  the config's ``chat_template`` is not used at all. :meth:`Tokenizer.apply_chat_template`
  renders one (:mod:`wna16_jax.models.chat_template`: the sandbox and its bounds) and encodes
  the text *without* adding special tokens, as transformers does, so a template that writes
  ``bos_token`` itself gets one BOS, not two.

Where transformers would silently ignore a malformed field (``add_bos_token: "yes"``,
``chat_template: 5``) this class refuses it with a :class:`~wna16_jax.errors.ConfigError` naming
the file and the field. Not emulated: the tokenizer classes of transformers that rebuild the
pipeline from ``tokenizer.json``'s vocabulary (``LlamaTokenizer`` with a Metaspace
``tokenizer.json``, ``Qwen2Tokenizer``): here ``tokenizer.json``'s own normalizer,
pre-tokenizer and decoder are used, as transformers' generic ``TokenizersBackend`` uses them.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Iterable, Mapping

from ..errors import ConfigError, CorruptFileError, UnsupportedError
from ..fields import Fields, check_int
from ..safetensors_io import load_json
from .chat_template import ChatTemplate, checked_messages, plain_value

#: a larger ``tokenizer.json`` is refused before it is read (real ones are up to ~30 MB)
MAX_TOKENIZER_JSON_BYTES = 256 * 2**20
#: the cap of ``tokenizer_config.json``, ``special_tokens_map.json``, ``config.json`` and a
#: ``.jinja`` template file
MAX_CONFIG_BYTES = 16 * 2**20
#: the named special tokens transformers knows (its ``SPECIAL_TOKENS_ATTRIBUTES``)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: the files read from the folder
TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP = "tokenizer.json", "tokenizer_config.json", \
    "special_tokens_map.json"
CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"

_INSTALL = "pip install 'wna16-jax[models]'"
#: an AddedToken object's flags (all optional booleans)
_TOKEN_FLAGS = ("lstrip", "rstrip", "single_word", "normalized", "special")
#: apply_chat_template arguments of transformers that are not supported here (refused, never
#: passed on to the template as variables)
_UNSUPPORTED_CHAT_ARGS = ("conversation", "chat_template", "continue_final_message", "return_dict", "return_tensors",
                          "return_assistant_tokens_mask", "padding", "truncation", "max_length", "tokenizer_kwargs",
                          "sanitize_control_tokens", "messages", "add_generation_prompt")


def regular_file_size(path: str, cap: int, what: str) -> int | None:
    """The size of ``path`` if it exists (None if not); refused if it is not a regular file or
    is larger than ``cap`` bytes — by its size, before anything is read."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise CorruptFileError(f"{path}: {what} is a link to a file that does not exist") from None
        return None
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"{path}: {what} must be a regular file")
    if st.st_size > cap:
        raise ConfigError(f"{path}: {what} must be at most {cap} bytes, got {st.st_size} bytes")
    return st.st_size


def read_text_file(path: str, cap: int, what: str) -> str:
    """A file already checked by :func:`regular_file_size`, read (at most ``cap`` bytes) as UTF-8."""
    try:
        with open(path, "rb") as f:
            raw = f.read(cap + 1)
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot read {what} ({e.strerror or e})") from None
    if len(raw) > cap:
        raise ConfigError(f"{path}: {what} must be at most {cap} bytes (it grew while being read)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CorruptFileError(f"{path}: {what} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def _json_fields(folder: str, name: str) -> Fields | None:
    path = os.path.join(folder, name)
    if regular_file_size(path, MAX_CONFIG_BYTES, name) is None:
        return None
    return Fields(load_json(path, what=name), path)


class _Token:
    """A special token read from a config: its text and, for an AddedToken object, its flags
    (None for a plain string)."""

    __slots__ = ("content", "flags")

    def __init__(self, content: str, flags: Mapping[str, bool] | None):
        self.content, self.flags = content, None if flags is None else dict(flags)

    def added_token(self, tokenizers, *, special: bool):
        """The ``tokenizers.AddedToken`` transformers registers for it: a plain string is special
        and not normalized; an object keeps its flags (``special`` defaulting to false and
        ``normalized`` to not special), made special when ``special``."""
        if self.flags is None:
            return tokenizers.AddedToken(self.content, special=True, normalized=False)
        flags = dict(self.flags)
        own = flags.pop("special", False)
        flags.setdefault("normalized", not own)
        return tokenizers.AddedToken(self.content, special=own or special, **flags)


def _token_value(f: Fields, key: str, value: Any, *, entry: int | None = None, strict: bool = True,
                 force_special: bool = False) -> _Token | None:
    """``value`` (the field ``key`` of ``f``, or its list entry ``entry``) as a special token: a
    string, or an AddedToken object with a string ``content`` (optional ``"__type": "AddedToken"``
    and boolean flags). ``strict``: anything else is an error; otherwise None (a field that is not
    a token). ``force_special``: the object is special whatever its flag says."""
    if isinstance(value, str):
        return _Token(value, None)
    if isinstance(value, Mapping) and (strict or value.get("__type") == "AddedToken"):
        obj = Fields(value, f"{f.where}: {key}" + ("" if entry is None else f"[{entry}]"))
        if obj.string("__type", "AddedToken") != "AddedToken":
            raise obj.fail("__type", "must be 'AddedToken'")
        flags = {flag: obj.flag(flag) for flag in _TOKEN_FLAGS if flag in obj}
        if force_special:
            flags["special"] = True
        return _Token(obj.string("content"), flags)
    if strict:
        rule = "must be a string or an AddedToken object {\"content\": ...}"
        raise f.fail(key, rule if entry is None else f"entry {entry} {rule}", value)
    return None


def _named_tokens(f: Fields, *, force_special: bool = False) -> dict[str, _Token]:
    """The named special tokens of one config: the standard names, then other ``*_token`` fields
    holding a token (transformers' model-specific tokens), then a mapping ``extra_special_tokens``."""
    out = {}
    for key in SPECIAL_TOKEN_NAMES:
        if key in f:
            out[key] = _token_value(f, key, f.get(key), force_special=force_special)
    for key, value in f.data.items():
        if key.endswith("_token") and key not in out and value is not None:
            token = _token_value(f, key, value, strict=False, force_special=force_special)
            if token is not None:
                out[key] = token
    if isinstance(f.get("extra_special_tokens"), Mapping):
        ef = f.object("extra_special_tokens")
        out.update({k: _token_value(ef, k, v, force_special=force_special) for k, v in ef.data.items()
                    if v is not None})
    return out


def _extra_tokens(f: Fields) -> list[_Token]:
    """``extra_special_tokens`` (or, without it, ``additional_special_tokens``) as a list."""
    key = "extra_special_tokens" if "extra_special_tokens" in f else "additional_special_tokens"
    value = f.get(key)
    if value is None or isinstance(value, Mapping) and key == "extra_special_tokens":
        return []
    if not isinstance(value, (list, tuple)):
        raise f.fail(key, "must be a list of tokens (strings or AddedToken objects)")
    return [_token_value(f, key, v, entry=i) for i, v in enumerate(value)]


def _declared_added_tokens(f: Fields) -> list[tuple[int, _Token]]:
    """``added_tokens_decoder``: ``{"<id>": {"content": ..., flags}}`` as (id, token), by id."""
    decoder = f.object("added_tokens_decoder")
    if decoder is None:
        return []
    out = []
    for key, value in decoder.data.items():
        token_id = int(key) if isinstance(key, str) and key.isdigit() and len(key) <= 10 else None
        if token_id is None:
            raise decoder.fail(key, "must be keyed by a token id (a decimal integer string)", key)
        if not isinstance(value, Mapping):
            raise decoder.fail(key, "must be an AddedToken object {\"content\": ...}")
        out.append((token_id, _token_value(decoder, key, value)))
    return sorted(out, key=lambda item: item[0])


def _config_templates(f: Fields) -> dict[str, tuple[str, str]]:
    """``tokenizer_config.json``'s ``chat_template`` — a string (the default template) or a list
    of ``{"name", "template"}`` objects (names unique) — as name -> (source, where)."""
    value = f.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": (value, f"{f.where}: chat_template")}
    rule = "must be a string or a list of {\"name\": str, \"template\": str} objects"
    if not isinstance(value, (list, tuple)):
        raise f.fail("chat_template", rule)
    out = {}
    for i, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise f.fail("chat_template", f"{rule} (entry {i} is a {type(item).__name__})")
        entry = Fields(item, f"{f.where}: chat_template[{i}]")
        name, template = entry.string("name"), entry.string("template")
        if name in out:
            raise entry.fail("name", "must be unique among the chat templates")
        out[name] = (template, f"{f.where}: chat_template {name!r}")
    return out


def _file_templates(folder: str) -> dict[str, tuple[str, str]]:
    """``chat_template.jinja`` (as "default") and ``additional_chat_templates/<name>.jinja``, as
    name -> (source, path)."""
    paths = {"default": os.path.join(folder, CHAT_TEMPLATE_FILE)}
    extra = os.path.join(folder, CHAT_TEMPLATE_DIR)
    if os.path.isdir(extra):
        paths.update((e[:-len(".jinja")], os.path.join(extra, e)) for e in sorted(os.listdir(extra))
                     if e.endswith(".jinja") and not e.startswith("."))
    return {name: (read_text_file(p, MAX_CONFIG_BYTES, os.path.basename(p)), p) for name, p in paths.items()
            if regular_file_size(p, MAX_CONFIG_BYTES, os.path.basename(p)) is not None}


def _model_vocab_size(folder: str) -> int:
    """``config.json``'s ``vocab_size`` (or its ``text_config``'s), 0 when absent: the model's
    embedding may have more rows than the tokenizer has tokens, and the ids of those rows decode
    to nothing (as in transformers) rather than being refused."""
    f = _json_fields(folder, "config.json")
    if f is None:
        return 0
    size = f.integer("vocab_size", None, low=1)
    if size is None and f.object("text_config") is not None:
        size = f.object("text_config").integer("vocab_size", None, low=1)
    return size or 0


def _check_text(name: str, text: Any) -> None:
    """``text`` must be a string the tokenizer can take: valid Unicode (no lone surrogate)."""
    if not isinstance(text, str):
        raise ConfigError(f"{name}: expected a string, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{name}: not valid Unicode (a lone surrogate {text[e.start]!r} at position "
                          f"{e.start})") from None


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected True or False, got {type(value).__name__} {value!r}"[:200])
    return value


class Tokenizer:
    """The tokenizer of a checkpoint folder (see the module doc).

    ``encode(text, add_special_tokens=True) -> list[int]``, ``decode(ids) -> str``,
    :meth:`stream_decoder` for printing text as tokens arrive, :meth:`apply_chat_template`.
    Attributes: ``bos_token`` / ``eos_token`` / ``unk_token`` / ``pad_token`` (str or None) and
    their ``*_id`` (int or None), ``special_tokens_map`` (every named special token present, as
    transformers passes them to a chat template), ``add_bos_token`` / ``add_eos_token`` (as the
    config states them, or None), ``chat_template`` (the default template, or None),
    ``chat_templates`` (every template by name) and ``id_limit`` (ids below it decode: the larger
    of the tokenizer's id space and ``config.json``'s ``vocab_size``)."""

    def __init__(self, folder: str | os.PathLike):
        try:
            folder = os.fspath(folder)
        except TypeError:
            raise ConfigError(f"folder: expected a path (str or os.PathLike), got {type(folder).__name__}") from None
        if not os.path.isdir(folder):
            raise ConfigError(f"folder: {folder!r} is not a folder (expected a checkpoint folder)")
        path = os.path.join(folder, TOKENIZER_JSON)
        if regular_file_size(path, MAX_TOKENIZER_JSON_BYTES, TOKENIZER_JSON) is None:
            raise ConfigError(f"{TOKENIZER_JSON}: not found in {folder!r} (give token ids instead)")
        try:
            import tokenizers
        except ImportError:
            raise UnsupportedError(f"{TOKENIZER_JSON}: reading it needs the 'tokenizers' package ({_INSTALL}), "
                                   "which is not installed") from None
        text = read_text_file(path, MAX_TOKENIZER_JSON_BYTES, TOKENIZER_JSON)
        try:
            self._tok = tokenizers.Tokenizer.from_str(text)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - the library's parse error (or a Rust panic), as a typed one
            raise ConfigError(f"{path}: not a tokenizer the 'tokenizers' package reads "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        del text
        self._tok.no_truncation()
        self._tok.no_padding()
        self.folder, self.path = folder, path

        config = _json_fields(folder, TOKENIZER_CONFIG) or Fields({}, os.path.join(folder, TOKENIZER_CONFIG))
        self.add_bos_token: bool | None = config.flag("add_bos_token", None)
        self.add_eos_token: bool | None = config.flag("add_eos_token", None)
        declared = _declared_added_tokens(config)
        named = _named_tokens(config)
        extra = _extra_tokens(config)
        legacy = _json_fields(folder, SPECIAL_TOKENS_MAP) if "added_tokens_decoder" not in config else None
        if legacy is not None:
            named.update(_named_tokens(legacy, force_special=True))
            extra += _extra_tokens(legacy)
        self._register(tokenizers, declared, named, extra, config.where)
        self._special = {name: token.content for name, token in named.items()}

        # template files, when there are any, replace the config's templates altogether (which
        # are still checked)
        config_templates = _config_templates(config)
        self._templates = _file_templates(folder) or config_templates
        self._compiled: dict[str, Any] = {}
        self.id_limit = max(self._tokenizer_id_limit(), _model_vocab_size(folder))

    # ------------------------------------------------------------------ loading

    def _register(self, tokenizers, declared, named, extra, where: str) -> None:
        """Add the tokens the config declares and ``tokenizer.json`` lacks (see the module doc),
        in transformers' order: ``added_tokens_decoder`` by id, the named tokens, the extra ones.
        A declared id that the token does not get is refused (transformers would silently give it
        another)."""
        present = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        for token_id, token in declared:
            if token.content not in present:
                self._tok.add_tokens([token.added_token(tokenizers, special=False)])
                present.add(token.content)
            got = self._tok.token_to_id(token.content)
            if got != token_id:
                raise ConfigError(f"{where}: field 'added_tokens_decoder' declares {token.content!r} as id {token_id}, "
                                  f"but {TOKENIZER_JSON} gives it id {got}")
        for token in [*named.values(), *extra]:
            if token.content not in present:
                self._tok.add_special_tokens([token.added_token(tokenizers, special=True)])
                present.add(token.content)

    def _tokenizer_id_limit(self) -> int:
        n = self._tok.get_vocab_size(with_added_tokens=True)
        added = self._tok.get_added_tokens_decoder()
        return max([n, *(i + 1 for i in added)])

    # ------------------------------------------------------------------ special tokens

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self._special)

    def _special_id(self, name: str) -> int | None:
        token = self._special.get(name)
        return None if token is None else self._tok.token_to_id(token)

    bos_token = property(lambda self: self._special.get("bos_token"))
    eos_token = property(lambda self: self._special.get("eos_token"))
    unk_token = property(lambda self: self._special.get("unk_token"))
    pad_token = property(lambda self: self._special.get("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    @property
    def chat_template(self) -> str | None:
        """The default chat template (the only one, or the one named "default"), or None."""
        entry = self._templates.get("default")
        return None if entry is None else entry[0]

    @property
    def chat_templates(self) -> dict[str, str]:
        return {name: source for name, (source, _) in self._templates.items()}

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The token ids of ``text``; ``add_special_tokens``: those of ``tokenizer.json``'s
        post-processor (a BOS for Llama / Mixtral / DeepSeek folders), as transformers adds them."""
        add = _check_flag("add_special_tokens", add_special_tokens)
        return self._encode("text", text, add)

    def _encode(self, name: str, text: Any, add_special_tokens: bool) -> list[int]:
        _check_text(name, text)
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def _checked_ids(self, ids: Any, name: str = "ids") -> list[int]:
        """``ids`` as a list of ints in ``[0, id_limit)``; refusals name the index and value."""
        if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable):
            raise ConfigError(f"{name}: expected a sequence of token ids, got {type(ids).__name__}")
        if hasattr(ids, "tolist") and hasattr(ids, "dtype"):           # numpy / jax arrays
            if getattr(ids, "ndim", 1) != 1 or getattr(ids.dtype, "kind", "i") not in "iu":
                raise ConfigError(f"{name}: expected a 1-D integer array of token ids, got shape "
                                  f"{tuple(ids.shape)} dtype {ids.dtype}")
            ids = ids.tolist()
        return [check_int(f"{name}[{i}]", t, low=0, high=self.id_limit - 1) for i, t in enumerate(ids)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids``: integers in ``[0, id_limit)`` (ids past the tokenizer's own
        vocabulary but within the model's ``vocab_size`` decode to nothing, as in transformers)."""
        skip = _check_flag("skip_special_tokens", skip_special_tokens)
        return self._tok.decode(self._checked_ids(ids), skip_special_tokens=skip)

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (a token's text, special or not), None when the vocabulary lacks it."""
        _check_text("token", token)
        return self._tok.token_to_id(token)

    def stream_decoder(self, prefix=()):
        """A function ``push(token_id) -> str`` returning the text each new token adds after
        ``decode(prefix)`` (the whole sequence is re-decoded, so spacing and multi-token
        characters come out as ``decode`` gives them)."""
        ids = self._checked_ids(prefix, "prefix")
        shown = [self._tok.decode(ids, skip_special_tokens=False)]

        def push(token_id: int) -> str:
            ids.append(check_int("token_id", token_id, low=0, high=self.id_limit - 1))
            text = self._tok.decode(ids, skip_special_tokens=False)
            if text.startswith(shown[0]):
                new = text[len(shown[0]):]
            else:
                new = text[len(os.path.commonprefix([text, shown[0]])):]
            shown[0] = text
            return new

        return push

    # ------------------------------------------------------------------ chat

    def _template(self, name: str | None, tools: Any):
        """The compiled template: ``name``, else (as transformers picks) the only / "default"
        one, or "tool_use" when tools are given and the folder has one."""
        if not self._templates:
            raise ConfigError(f"{self.folder}: this tokenizer has no chat template (no 'chat_template' in "
                              f"{TOKENIZER_CONFIG}, no {CHAT_TEMPLATE_FILE})")
        if name is None:
            name = "tool_use" if tools is not None and "tool_use" in self._templates else "default"
            if name not in self._templates:
                raise ConfigError(f"{self.folder}: the chat templates are named {sorted(self._templates)} and none "
                                  "is 'default': pass template_name=")
        elif not isinstance(name, str) or name not in self._templates:
            raise ConfigError(f"template_name: expected one of {sorted(self._templates)}, got {name!r}")
        if name not in self._compiled:
            self._compiled[name] = ChatTemplate(*self._templates[name])
        return self._compiled[name]

    def apply_chat_template(self, messages, /, *, add_generation_prompt: bool = True, tokenize: bool = True,
                            template_name: str | None = None, **kwargs) -> list[int] | str:
        """``messages`` (a list of ``{"role": str, "content": str}`` mappings) rendered with the
        folder's chat template, as transformers renders it; ``tokenize``: the text's token ids
        (encoded without adding special tokens, as transformers does), else the text.

        The template sees ``messages``, ``add_generation_prompt`` (true: end with the header of
        the assistant's turn), ``tools`` and ``documents`` (None unless given), every named special
        token (``bos_token``, ``eos_token``, ...) and the extra keyword arguments (plain data:
        ``enable_thinking=False``, ``tools=[...]``; they override the special tokens).
        ``template_name`` picks one of :attr:`chat_templates`. transformers' own options
        (``continue_final_message``, ``return_dict``, ...) are refused rather than passed on."""
        for key in _UNSUPPORTED_CHAT_ARGS:
            if key in kwargs:
                raise UnsupportedError(f"apply_chat_template: argument {key!r} is not supported"
                                       + (" (pick a folder template with template_name=)" if key == "chat_template"
                                          else ""))
        generation = _check_flag("add_generation_prompt", add_generation_prompt)
        tokenize = _check_flag("tokenize", tokenize)
        extra = {k: plain_value(k, v) for k, v in kwargs.items()}
        template = self._template(template_name, extra.get("tools"))
        variables = {**self._special, "tools": None, "documents": None, **extra,
                     "messages": checked_messages(messages), "add_generation_prompt": generation}
        text = template.render(variables)
        return self._encode("the rendered chat", text, False) if tokenize else text


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    """The :class:`Tokenizer` of a checkpoint folder."""
    return Tokenizer(folder)


__all__ = ["Tokenizer", "load_tokenizer", "MAX_TOKENIZER_JSON_BYTES", "MAX_CONFIG_BYTES", "SPECIAL_TOKEN_NAMES",
           "read_text_file", "regular_file_size"]
