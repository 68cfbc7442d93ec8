"""Typed reads of configuration values: the one validator the library uses for every JSON object
it is handed (``config.json``, ``generation_config.json``, ``tokenizer_config.json``, a
manifest, a request body) and for the numbers a caller passes.

:class:`Fields` wraps one JSON object and a description of where it came from; each reader
(:meth:`~Fields.integer`, :meth:`~Fields.number`, :meth:`~Fields.flag`, :meth:`~Fields.string`,
:meth:`~Fields.integers`, :meth:`~Fields.object`) returns the value in its Python type or raises
:class:`~wna16_jax.errors.ConfigError` naming the file, the field, the rule and the value it
found. The rules are strict where JSON makes mistakes easy:

* a boolean is never a number (``true`` is not 1) and a number is never a boolean;
* a string is never a number (``"4096"`` is refused, not read as a size);
* numbers are finite (``NaN`` / ``Infinity``, which Python's ``json`` reads, are refused);
* an integer field takes an integral float (``8.0``) but not ``8.5``;
* bounds are inclusive unless named ``above`` / ``below`` (exclusive).

:func:`check_int`, :func:`check_number`, :func:`check_flag` and :func:`check_string` apply the same
rules to function arguments.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

import numpy as np

from .errors import ConfigError

#: the default of a reader that makes the field required
REQUIRED: Any = object()


def show_value(v: Any) -> str:
    """``repr(v)``, cut to 80 characters: how messages show a value they refuse."""
    s = repr(v)
    return s if len(s) <= 80 else s[:77] + "..."


def _is_bool(v: Any) -> bool:
    return isinstance(v, (bool, np.bool_))


def _as_int(v: Any) -> int | None:
    """``v`` as an int if it is an integer (or an integral finite float), else None."""
    if _is_bool(v):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer():
        return int(v)
    return None


def _as_number(v: Any) -> float | None:
    if _is_bool(v) or not isinstance(v, (int, float, np.integer, np.floating)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def _bounds_rule(low, high, above, below) -> str:
    parts = []
    if low is not None:
        parts.append(f">= {low}")
    if above is not None:
        parts.append(f"> {above}")
    if high is not None:
        parts.append(f"<= {high}")
    if below is not None:
        parts.append(f"< {below}")
    return " and ".join(parts)


def _in_bounds(x, low, high, above, below) -> bool:
    return ((low is None or x >= low) and (high is None or x <= high) and (above is None or x > above)
            and (below is None or x < below))


def _named(name: str, where: str | None) -> str:
    return f"{where}: field {name!r}" if where else name


def check_int(name: str, value: Any, *, low: int | None = None, high: int | None = None,
              where: str | None = None) -> int:
    """``value`` as an int, or a :class:`ConfigError` naming ``name`` (an argument, or a field of
    ``where``): an integer (not a bool, not a string, not a non-integral float) within
    ``[low, high]``."""
    got = _as_int(value)
    rule = _bounds_rule(low, high, None, None)
    if got is None or not _in_bounds(got, low, high, None, None):
        raise ConfigError(f"{_named(name, where)} must be an integer{' ' + rule if rule else ''}, "
                          f"got {show_value(value)}")
    return got


def check_expert_ids(value: Any, num_experts: int, name: str = "experts") -> tuple[int, ...] | None:
    """``value`` (None: every expert) as a tuple of distinct expert indices in increasing order,
    each in ``[0, num_experts)``, or a :class:`ConfigError` naming ``name``. Every expert listed
    also gives None (nothing is left out)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, Mapping)) or not hasattr(value, "__iter__"):
        raise ConfigError(f"{name}: expected None or a sequence of expert indices, got {show_value(value)}")
    ids = tuple(check_int(f"{name}[{j}]", v, low=0, high=num_experts - 1) for j, v in enumerate(value))
    if not ids or any(b <= a for a, b in zip(ids, ids[1:])):
        raise ConfigError(f"{name}: expected distinct expert indices in increasing order (at least one), "
                          f"got {show_value(list(ids))}")
    return None if len(ids) == num_experts else ids


def check_number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
                 above: float | None = None, below: float | None = None, where: str | None = None) -> float:
    """``value`` as a finite float within the bounds, or a :class:`ConfigError` naming ``name``."""
    got = _as_number(value)
    rule = _bounds_rule(low, high, above, below)
    if got is None or not _in_bounds(got, low, high, above, below):
        raise ConfigError(f"{_named(name, where)} must be a finite number{' ' + rule if rule else ''}, "
                          f"got {show_value(value)}")
    return got


def check_flag(name: str, value: Any, *, where: str | None = None) -> bool:
    """``value`` as a bool, or a :class:`ConfigError` naming ``name``: True or False (not 0 / 1)."""
    if not _is_bool(value):
        raise ConfigError(f"{_named(name, where)} must be true or false, got {show_value(value)}")
    return bool(value)


def check_string(name: str, value: Any, *, choices: Iterable[str] | None = None, where: str | None = None) -> str:
    """``value`` as a str (one of ``choices`` where given), or a :class:`ConfigError` naming ``name``."""
    options = None if choices is None else tuple(choices)
    if not isinstance(value, str):
        rule = "must be a string" + (f" (one of {list(options)})" if options else "")
        raise ConfigError(f"{_named(name, where)} {rule}, got {show_value(value)}")
    if options is not None and value not in options:
        raise ConfigError(f"{_named(name, where)} must be one of {list(options)}, got {show_value(value)}")
    return value


class Fields:
    """Typed, checked reads of the fields of one JSON object (see the module doc).

    ``where`` names the object in messages (``"config.json"``, ``"config.json: rope_scaling"``,
    a file path). A reader's ``default`` is returned when the field is absent or null;
    :data:`REQUIRED` (the default) makes it an error to leave the field out."""

    def __init__(self, data: Any, where: str):
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__} {show_value(data)}")
        self.data, self.where = data, where

    def __contains__(self, key: str) -> bool:
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        """The raw value (unchecked), ``default`` when absent or null."""
        v = self.data.get(key)
        return default if v is None else v

    def first(self, *keys: str) -> str | None:
        """The first of ``keys`` that is present (not null), or None."""
        return next((k for k in keys if k in self), None)

    def _missing(self, key: str, default: Any):
        if default is REQUIRED:
            raise ConfigError(f"{self.where}: field {key!r} is required, but missing")
        return default

    def fail(self, key: str, rule: str, value: Any = REQUIRED) -> ConfigError:
        """The error for ``key``: ``{where}: field 'key' {rule}, got {value}``."""
        v = self.data.get(key) if value is REQUIRED else value
        return ConfigError(f"{self.where}: field {key!r} {rule}, got {show_value(v)}")

    def integer(self, key: str, default: Any = REQUIRED, *, low: int | None = None,
                high: int | None = None) -> Any:
        v = self.data.get(key)
        if v is None:
            return self._missing(key, default)
        return check_int(key, v, low=low, high=high, where=self.where)

    def number(self, key: str, default: Any = REQUIRED, *, low: float | None = None, high: float | None = None,
               above: float | None = None, below: float | None = None) -> Any:
        v = self.data.get(key)
        if v is None:
            return self._missing(key, default)
        return check_number(key, v, low=low, high=high, above=above, below=below, where=self.where)

    def flag(self, key: str, default: Any = REQUIRED) -> Any:
        v = self.data.get(key)
        if v is None:
            return self._missing(key, default)
        return check_flag(key, v, where=self.where)

    def string(self, key: str, default: Any = REQUIRED, *, choices: Iterable[str] | None = None) -> Any:
        v = self.data.get(key)
        if v is None:
            return self._missing(key, default)
        return check_string(key, v, choices=choices, where=self.where)

    def integers(self, key: str, default: Any = (), *, low: int | None = None, high: int | None = None,
                 scalar: bool = False, most: int | None = None) -> Any:
        """A list of integers (each within the bounds) as a tuple; ``scalar``: a lone integer
        reads as a one-element list (``eos_token_id: 2``). ``most``: the longest list taken."""
        v = self.data.get(key)
        if v is None:
            return self._missing(key, default)
        if scalar and _as_int(v) is not None:
            v = [v]
        rule = _bounds_rule(low, high, None, None)
        want = f"must be {'an integer or ' if scalar else ''}a list of integers{' ' + rule if rule else ''}"
        if not isinstance(v, (list, tuple)):
            raise self.fail(key, want)
        if most is not None and len(v) > most:
            raise self.fail(key, f"must list at most {most} entries", f"{len(v)} entries")
        out = []
        for x in v:
            i = _as_int(x)
            if i is None or not _in_bounds(i, low, high, None, None):
                raise self.fail(key, want, v)
            out.append(i)
        return tuple(out)

    def object(self, key: str, default: Any = None) -> Any:
        """A nested object as :class:`Fields` (``where``: ``"{where}: {key}"``), ``default`` when
        absent or null."""
        v = self.data.get(key)
        if v is None:
            return self._missing(key, default)
        if not isinstance(v, Mapping):
            raise self.fail(key, "must be an object")
        return Fields(v, f"{self.where}: {key}")


__all__ = ["Fields", "REQUIRED", "check_expert_ids", "check_flag", "check_int", "check_number", "check_string", "show_value"]
