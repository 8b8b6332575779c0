"""docs/benchmarks.md is shared by the benchmark tools: each rewrites only its own marked section."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Callable, Hashable
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_section(name: str, body: str) -> None:
    """Replace the `<!-- name:start -->` ... `<!-- name:end -->` block (or append it), atomically."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    if start in text and end in text:
        text = text[: text.index(start)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    tmp = DOC.with_name(DOC.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, DOC)


def merge_rows(path: Path, rows: list[dict], case: Callable[[dict], Hashable], order: Callable[[dict], tuple]) -> list[dict]:
    """This run's rows with the rows earlier runs left in `path` (JSON lines) for other cases, sorted by `order` and
    written back: a benchmark runs in chunks short enough to hold the machine quiet, and a case run again replaces its rows."""
    done = {case(r) for r in rows}
    kept = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    merged = sorted([r for r in kept if case(r) not in done] + rows, key=order)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in merged))
    return merged


def cpu_model() -> str:
    """The processor's name as Linux gives it (the tables compare hosts), else the platform's."""
    try:
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or "unknown processor"
