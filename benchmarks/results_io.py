"""Machine-readable benchmark results: ``benchmarks/results.json``.

The file is a JSON list of records, one per (run, shape, token count)::

    {"date": "2026-11-30", "machine": "2-core CPU, jax 0.10.2",
     "command": "python benchmarks/xla_formulations.py --shapes cpu",
     "shape": "qwen3-like (64, 8, 512, 256)", "dims": [64, 8, 512, 256], "tokens": 8,
     "ms": {"gather": 67.04, "dense": 68.84, "blocked": 34.92, "ragged_dot": 85.17},
     "floor_ms": null, "notes": "..."}

``ms`` maps each alternative that was measured to its time in milliseconds (an alternative that
was not measured, e.g. skipped for memory, is simply absent); ``floor_ms`` (optional) is the
performance floor for that shape and token count. Other keys (``dims``, ``notes``, ``auto_picks``)
are optional and kept verbatim. ``benchmarks/RESULTS.md`` stays the human-readable log.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

REQUIRED = ("date", "machine", "command", "shape", "tokens", "ms")


def validate_record(record: Mapping[str, Any]) -> dict:
    """Return ``record`` as a plain dict after checking its required fields; raise ``ValueError``."""
    if not isinstance(record, Mapping):
        raise ValueError(f"record: expected a JSON object, got {type(record).__name__}")
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise ValueError(f"record: missing field(s) {missing} (required: {list(REQUIRED)})")
    for k in ("date", "machine", "command", "shape"):
        if not isinstance(record[k], str) or not record[k]:
            raise ValueError(f"record.{k}: expected a non-empty string, got {record[k]!r}")
    if isinstance(record["tokens"], bool) or not isinstance(record["tokens"], int) or record["tokens"] < 0:
        raise ValueError(f"record.tokens: expected a non-negative integer, got {record['tokens']!r}")
    ms = record["ms"]
    if not isinstance(ms, Mapping):
        raise ValueError(f"record.ms: expected an object alternative -> milliseconds, got {ms!r}")
    for name, v in ms.items():
        if not _positive_number(v):
            raise ValueError(f"record.ms[{name!r}]: expected a positive finite number, got {v!r}")
    floor = record.get("floor_ms")
    if floor is not None and not _positive_number(floor):
        raise ValueError(f"record.floor_ms: expected a positive finite number or null, got {floor!r}")
    return dict(record)


def _positive_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0)


def load_results(path: str | os.PathLike) -> list[dict]:
    """Read and validate every record of a results file (``FileNotFoundError`` if absent)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, list):
        raise ValueError(f"{os.fspath(path)}: expected a JSON list of records, got {type(data).__name__}")
    return [validate_record(r) for r in data]


def append_results(path: str | os.PathLike, record: Mapping[str, Any] | list) -> None:
    """Append one record (or a list of records) to the results file, creating it if needed.

    The file is rewritten (one record per line, so appends diff cleanly) through a temporary
    file and an atomic rename.
    """
    new = [validate_record(r) for r in (record if isinstance(record, list) else [record])]
    records = load_results(path) if os.path.exists(path) else []
    records.extend(new)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(r, ensure_ascii=False) for r in records) + "\n]\n")
    os.replace(tmp, path)


def append_markdown(path: str | os.PathLike, title: str, script: str, argv: list[str], description: str,
                    table: list[str]) -> None:
    """Append a dated section (title, device, exact command, description, table) to RESULTS.md."""
    import datetime

    import jax

    with open(path, "a") as f:
        f.write(f"\n## {title}, {datetime.date.today()} ({jax.devices()[0].device_kind}, jax {jax.__version__})\n\n"
                f"Command: `PYTHONPATH=$PWD python3 benchmarks/{script} {' '.join(argv)}`. {description}\n\n"
                + "\n".join(table) + "\n")


__all__ = ["append_markdown", "append_results", "load_results", "validate_record", "REQUIRED"]
