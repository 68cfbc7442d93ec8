"""A checkpoint's ``tokenizer.json`` through the ``tokenizers`` package (imported lazily).

``pip install "wna16-jax[models]"`` brings ``tokenizers``. Only ``<folder>/tokenizer.json`` is
read; nothing is downloaded.
"""

from __future__ import annotations

import os

from ..errors import ConfigError, UnsupportedError


class Tokenizer:
    """``encode(text) -> list[int]`` (no special tokens added), ``decode(ids) -> str``, and
    :meth:`stream_decoder` for printing text as tokens arrive."""

    def __init__(self, folder: str | os.PathLike):
        folder = os.fspath(folder)
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise ConfigError(f"tokenizer.json: not found in {folder!r} (give token ids instead)")
        try:
            import tokenizers
        except ImportError:
            raise UnsupportedError("tokenizer.json: reading it needs the 'tokenizers' package "
                                   "(pip install 'wna16-jax[models]'), which is not installed") from None
        try:
            self._tok = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # noqa: BLE001 - the library's own parse error, as a typed one
            raise ConfigError(f"{path}: not a tokenizer the 'tokenizers' package reads "
                              f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        self.path = path

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ConfigError(f"text: expected a string, got {type(text).__name__}")
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def stream_decoder(self, prefix=()):
        """A function ``push(token_id) -> str`` returning the text each new token adds after
        ``decode(prefix)`` (the whole sequence is re-decoded, so spacing and multi-token
        characters come out as ``decode`` gives them)."""
        ids: list[int] = [int(i) for i in prefix]
        shown = [self.decode(ids)]

        def push(token_id: int) -> str:
            ids.append(int(token_id))
            text = self.decode(ids)
            if text.startswith(shown[0]):
                new = text[len(shown[0]):]
            else:
                new = text[len(os.path.commonprefix([text, shown[0]])):]
            shown[0] = text
            return new

        return push


def load_tokenizer(folder: str | os.PathLike) -> Tokenizer:
    return Tokenizer(folder)


__all__ = ["Tokenizer", "load_tokenizer"]
