"""docs/benchmarks.md is shared by the benchmark tools: each rewrites only its own marked section."""

from __future__ import annotations

import os
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
