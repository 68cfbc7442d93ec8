"""A checkpoint's generation defaults (``generation_config.json``): :class:`GenerationDefaults`.

Hugging Face checkpoints carry, beside ``config.json``, a ``generation_config.json`` with the
tokens generation stops at and the sampling settings the model was tuned for (Qwen3:
``do_sample: true, temperature: 0.6, top_p: 0.95, top_k: 20``; many checkpoints only
``bos_token_id`` / ``eos_token_id``). :func:`read_generation_config` reads it with
:class:`~wna16_jax.fields.Fields`, so every field it uses is type-checked and bounded and a
refusal names the file, the field, the rule and the value.

Fields read, and how generation applies them (:mod:`wna16_jax.models.generation`):

* ``eos_token_id`` (an id or a list of ids in ``[0, vocab_size)``): the default stop tokens.
  transformers' ``generate`` stops at these; :func:`~wna16_jax.models.load_model` joins them with
  ``config.json``'s ``eos_token_id`` into ``DecoderConfig.eos_token_ids``
  (:meth:`GenerationDefaults.stop_token_ids`).
* ``do_sample`` (default false): false means greedy, whatever ``temperature`` says (as
  transformers applies it: the sampling settings below are then not used).
* ``temperature`` (>= 0, default 1.0), ``top_p`` (in ``(0, 1]``, default 1.0), ``top_k``
  (an integer >= 0, default 0: off): the sampling settings when ``do_sample`` is true.

A field that is absent (or null) takes the default above. For ``top_k`` that is "off", as the
file says nothing about it; transformers' ``GenerationConfig`` class itself defaults to
``top_k=50``, which is *not* applied here: only what the checkpoint states is a default.

Fields not read (ignored, not checked): ``bos_token_id`` / ``pad_token_id`` (the generator
neither prepends nor pads with them: prompts are the token ids given, padding rows are masked),
``max_length`` / ``max_new_tokens`` (the caller states ``max_new_tokens``: it sizes the KV cache
and the compiled programs), and everything else (``transformers_version``, ``use_cache``, ...).
"""

from __future__ import annotations

import dataclasses
import os

from ..errors import ConfigError, CorruptFileError
from ..fields import Fields, check_int
from ..safetensors_io import load_json

#: the file read from a checkpoint folder
GENERATION_CONFIG = "generation_config.json"
#: a larger file is refused before it is read (real ones are a few hundred bytes)
MAX_GENERATION_CONFIG_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """The generation defaults of a checkpoint (hashable: part of the model's static config).

    ``eos_token_ids``: ``generation_config.json``'s ``eos_token_id`` as a tuple (duplicates
    dropped, order kept; may be empty). ``do_sample``: sample (true) or pick greedily (false).
    ``temperature`` / ``top_p`` / ``top_k``: the sampling settings used when ``do_sample`` is
    true and the caller gives none (``top_k = 0``: no top-k). ``GenerationDefaults()`` is what a
    folder without the file gets: no stop token of its own, greedy.
    """

    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def stop_token_ids(self, config_eos_token_ids: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The tokens generation stops at: these defaults' ``eos_token_ids`` (the ones
        transformers' generation stops at) followed by those of ``config_eos_token_ids``
        (``config.json``'s) not already listed. Stopping at either never runs past an end of
        sequence that one of the two files declares."""
        return tuple(dict.fromkeys(tuple(self.eos_token_ids) + tuple(config_eos_token_ids)))


def read_generation_config(folder: str | os.PathLike, *, vocab_size: int) -> GenerationDefaults:
    """The :class:`GenerationDefaults` of ``<folder>/generation_config.json``, or
    ``GenerationDefaults()`` when the folder has no such file.

    Refused, with a :class:`~wna16_jax.errors.ConfigError` naming the file: a ``folder`` that is
    not a folder, a file larger than :data:`MAX_GENERATION_CONFIG_BYTES` (by its size, before
    reading), a path that is not a regular file, a top level that is not a JSON object, and any
    field of the module doc with the wrong type or out of range (token ids in
    ``[0, vocab_size)``). Unreadable, non-UTF-8 or invalid JSON (or a duplicated key): a
    :class:`~wna16_jax.errors.CorruptFileError` naming the file. Only this one file inside
    ``folder`` is read.
    """
    vocab_size = check_int("vocab_size", vocab_size, low=1)
    try:
        folder = os.fspath(folder)
    except TypeError:
        raise ConfigError(f"folder: expected a path (str or os.PathLike), got {type(folder).__name__}") from None
    if not os.path.isdir(folder):
        raise ConfigError(f"folder: {folder!r} is not a folder (expected a checkpoint folder)")
    path = os.path.join(folder, GENERATION_CONFIG)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise CorruptFileError(f"{path}: {GENERATION_CONFIG} is a link to a file that does not exist") from None
        return GenerationDefaults()
    except OSError as e:
        raise CorruptFileError(f"{path}: cannot read {GENERATION_CONFIG} ({e.strerror or e})") from None
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: {GENERATION_CONFIG} must be a regular file")
    if st.st_size > MAX_GENERATION_CONFIG_BYTES:
        raise ConfigError(f"{path}: {GENERATION_CONFIG} must be at most {MAX_GENERATION_CONFIG_BYTES} bytes, "
                          f"got {st.st_size} bytes")
    f = Fields(load_json(path, what=GENERATION_CONFIG), path)
    eos = f.integers("eos_token_id", (), low=0, high=vocab_size - 1, scalar=True)
    return GenerationDefaults(
        eos_token_ids=tuple(dict.fromkeys(eos)),
        do_sample=f.flag("do_sample", False),
        temperature=f.number("temperature", 1.0, low=0),
        top_p=f.number("top_p", 1.0, above=0, high=1),
        top_k=f.integer("top_k", 0, low=0))


__all__ = ["GenerationDefaults", "read_generation_config", "GENERATION_CONFIG", "MAX_GENERATION_CONFIG_BYTES"]
