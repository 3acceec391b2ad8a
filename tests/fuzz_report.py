"""Session-wide tally of the fuzz tests (``test_fuzz_optimize.py``, ``test_fuzz_families.py``).

Every fuzzed program goes through :func:`record_program`; mismatches, escaping exceptions and the
``VTCFallbackWarning`` messages (normalised into reasons) are counted in one module-level
:class:`collections.Counter` per process. With ``VTC_FUZZ_REPORT=path`` each pytest process appends
one JSON line with its counts to ``path`` at exit (under ``-n 2`` there is one line per worker);
``python tests/fuzz_report.py path`` adds the lines up and prints the summary.

Hypothesis re-runs a failing example while shrinking, so after a failure the mismatch/exception
counts include the shrinking runs (the count of *distinct* failures is in ``tests/FUZZ_REPROS.md``).
"""
from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter

COUNTS: Counter = Counter()

_NUM = re.compile(r"#\d+|\b\d+\b")
_TENSOR = re.compile(r"\bt\d+\b")
EXAMPLES: dict[str, str] = {}   # reason -> the shortest program source seen with it


def reason(message: str) -> str:
    """A fallback warning's message with cluster ids and counts taken out (one key per reason)."""
    msg = str(message)
    if msg.startswith("vtc_jax: "):
        msg = msg[len("vtc_jax: "):]
    msg = _TENSOR.sub("tN", _NUM.sub("N", msg))
    msg = re.sub(r"\((?:N, )*N(?:; )?", "(", msg)
    msg = re.sub(r"\s+", " ", msg).strip()
    return msg[:200]


def record_program(family: str) -> None:
    COUNTS["programs"] += 1
    COUNTS[f"programs/{family}"] += 1


def _example(key: str, source: str | None) -> None:
    if source is not None and (key not in EXAMPLES or len(source) < len(EXAMPLES[key])):
        EXAMPLES[key] = source


def record_warnings(family: str, caught, source: str | None = None, program_counted: bool = False) -> bool:
    """Tally the VTCFallbackWarnings of one ``optimize`` call (a donated-cache program makes two
    calls: each call's warnings count, the program counts once). Returns whether there were any."""
    from vtc_jax import VTCFallbackWarning
    seen = False
    for w in caught:
        if issubclass(w.category, VTCFallbackWarning):
            seen = True
            COUNTS["fallback_warnings"] += 1
            COUNTS[f"fallback/{reason(w.message)}"] += 1
            _example(f"fallback/{reason(w.message)}", source)
    if seen and not program_counted:
        COUNTS["programs_with_fallback"] += 1
        COUNTS[f"programs_with_fallback/{family}"] += 1
    return seen


def record_mismatch(family: str, source: str | None = None) -> None:
    COUNTS["mismatches"] += 1
    COUNTS[f"mismatches/{family}"] += 1
    _example(f"mismatches/{family}", source)


def record_exception(family: str, exc: BaseException, source: str | None = None) -> None:
    COUNTS["exceptions"] += 1
    key = f"exceptions/{family}/{type(exc).__name__}: {reason(str(exc).splitlines()[0] if str(exc) else '')}"
    COUNTS[key] += 1
    _example(key, source)


def write() -> None:
    """Append this process's counts to ``$VTC_FUZZ_REPORT`` (called from conftest at session end)."""
    path = os.environ.get("VTC_FUZZ_REPORT")
    if not path or not COUNTS:
        return
    line = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "pid": os.getpid(), "counts": dict(COUNTS),
            "examples": EXAMPLES}
    with open(path, "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")



def summarize(path: str, examples: bool = False) -> str:
    total: Counter = Counter()
    found: dict[str, str] = {}
    with open(path) as f:
        for ln in f:
            if ln.strip():
                rec = json.loads(ln)
                total.update(rec["counts"])
                for k, src in rec.get("examples", {}).items():
                    if k not in found or len(src) < len(found[k]):
                        found[k] = src
    out = [f"programs run:            {total['programs']}",
           f"mismatches:              {total['mismatches']}",
           f"escaping exceptions:     {total['exceptions']}",
           f"fallback warnings:       {total['fallback_warnings']} "
           f"(in {total['programs_with_fallback']} programs)"]
    for head in ("programs/", "mismatches/", "exceptions/", "programs_with_fallback/", "fallback/"):
        keys = sorted((k for k in total if k.startswith(head)), key=lambda k: -total[k])
        if keys:
            out.append(f"{head}")
            out += [f"  {total[k]:6d}  {k[len(head):]}" for k in keys]
    if examples:
        for k, src in sorted(found.items()):
            out += ["", f"# shortest program with {k}", src]
    return "\n".join(out)


if __name__ == "__main__":   # python tests/fuzz_report.py REPORT [--examples]
    print(summarize(sys.argv[1], "--examples" in sys.argv))
