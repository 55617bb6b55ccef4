"""Tables and JSON for benchmark results. Torch-free: the scenario command and every torch benchmark use it.

Every benchmark produces one JSON document: `{"bench": name, "env": {...}, "rows": [...], "summary": {...}}`.
`rows` are flat dicts (one measured configuration each) and print as a table; `summary` holds derived ratios
and the target checks. Values are rounded for reading; nothing is rounded before a ratio is taken.
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Sequence


def format_value(value: Any) -> str:
    """A value as a table cell: None as '-', floats to ~4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 1000:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 0.01:
            return f"{value:.3f}"
        return f"{value:.2e}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """A plain-text table of `rows`; columns default to the union of keys in first-seen order."""
    if not rows:
        return "(no rows)"
    if columns is None:
        seen: dict[str, None] = {}
        for row in rows:
            for key in row:
                seen.setdefault(key, None)
        columns = list(seen)
    cells = [[format_value(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join([line, rule, *body])


def format_summary(summary: dict[str, Any]) -> str:
    """`key  value` lines, keys aligned."""
    width = max((len(k) for k in summary), default=0)
    return "\n".join(f"{k.ljust(width)}  {format_value(v)}" for k, v in summary.items())


def environment(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where a figure was measured: host, Python, plus what the caller adds (torch, device name, ...)."""
    env = {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()}
    env.update(extra or {})
    return env


def document(bench: str, rows: list[dict[str, Any]], summary: dict[str, Any], env: dict[str, Any],
             params: dict[str, Any]) -> dict[str, Any]:
    """The JSON document every benchmark writes."""
    return {"bench": bench, "env": env, "params": params, "rows": rows, "summary": summary}


def write_json(path: str | os.PathLike[str], doc: dict[str, Any]) -> Path:
    """Write through a temp file + rename so a killed benchmark never leaves half a JSON file."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.name, dir=target.parent)
    with os.fdopen(fd, "w") as fh:
        json.dump(_clean(doc), fh, indent=2, default=str, allow_nan=False)
        fh.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; results are meant to be read by whoever collects them
    os.replace(tmp, target)
    return target


def _clean(value: Any) -> Any:
    """Strict JSON: NaN/inf (a rate over zero time) become null; tuples and sets become lists."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_clean(v) for v in value]
    return value


def print_report(doc: dict[str, Any], columns: Iterable[str] | None = None, out: Any = None) -> None:
    """The table of rows, then the summary, as a person reads them."""
    out = out or sys.stdout
    print(f"== strata-engine bench {doc['bench']} ==", file=out)
    print(format_table(doc["rows"], list(columns) if columns else None), file=out)
    if doc.get("summary"):
        print("", file=out)
        print(format_summary(doc["summary"]), file=out)
