"""BENCHMARKS.md's generated blocks: each script owns the text between its ``<!-- name:begin -->``
and ``<!-- name:end -->`` markers and rewrites only that (one helper for every script)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def write_block(block: str, begin: str, end: str, path: Path = ROOT / "BENCHMARKS.md",
                after: str | None = None) -> None:
    """Replace the text from ``begin`` to ``end`` with ``block`` (which carries both markers); a
    file without them gets the block after the ``after`` marker if present, else at its end."""
    text = path.read_text()
    if begin in text and end in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    elif after is not None and after in text:
        i = text.index(after) + len(after)
        text = text[:i] + "\n\n" + block + "\n" + text[i:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)
