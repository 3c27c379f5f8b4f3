"""Shared by the benchmark scripts: a printed table, a JSON result file, machine facts.

Each script prints one or more tables and writes ``bench/results/<name>.json`` (or
``--out``). Figures are compared as ratios measured in the same run: these machines are
shared and noisy, so absolute times are context, not claims.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT))


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"bench/{name}.py", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS / f"{name}.json",
                   help=f"where the JSON goes (default bench/results/{name}.json)")
    return p


def machine() -> dict:
    import psutil

    return {"python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "memory_bytes": psutil.virtual_memory().total,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def table(title: str, header: list[str], rows: list[list]) -> str:
    cells = [header] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    out = [title, line, "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), line]
    out += ["  ".join(_align(c, w, v) for c, w, v in zip(r, widths, row)).rstrip()
            for r, row in zip(cells[1:], rows)]
    text = "\n".join(out + [line, ""])
    print(text, flush=True)
    return text


def _align(cell: str, width: int, value) -> str:
    """Text to the left, figures to the right."""
    return cell.ljust(width) if isinstance(value, str) else cell.rjust(width)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def write(path: Path, name: str, args: argparse.Namespace, results: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
           "machine": machine(), "args": {k: _arg(v) for k, v in vars(args).items()},
           "results": results}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


def _arg(value) -> str:
    """An argument as recorded: a path inside the checkout relative to it (the record names
    the project's files, not the machine it ran on)."""
    if isinstance(value, Path) and value.is_absolute() and value.is_relative_to(ROOT):
        return value.relative_to(ROOT).as_posix()
    return str(value)


def median(values: list[float]) -> float:
    return statistics.median(values)


def p90(values: list[float]) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(0.9 * len(s)))]
