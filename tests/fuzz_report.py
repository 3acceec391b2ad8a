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


def reason(message: str) -> str:
    """A fallback warning's message with cluster ids and counts taken out (one key per reason)."""
    msg = str(message)
    if msg.startswith("vtc_jax: "):
        msg = msg[len("vtc_jax: "):]
    msg = _NUM.sub("N", msg)
    msg = re.sub(r"\((?:N, )*N(?:; )?", "(", msg)
    msg = re.sub(r"\s+", " ", msg).strip()
    return msg[:200]


def record_program(family: str) -> None:
    COUNTS["programs"] += 1
    COUNTS[f"programs/{family}"] += 1


def record_warnings(family: str, caught) -> None:
    from vtc_jax import VTCFallbackWarning
    seen = False
    for w in caught:
        if issubclass(w.category, VTCFallbackWarning):
            seen = True
            COUNTS["fallback_warnings"] += 1
            COUNTS[f"fallback/{reason(w.message)}"] += 1
    if seen:
        COUNTS["programs_with_fallback"] += 1
        COUNTS[f"programs_with_fallback/{family}"] += 1


def record_mismatch(family: str) -> None:
    COUNTS["mismatches"] += 1
    COUNTS[f"mismatches/{family}"] += 1


def record_exception(family: str, exc: BaseException) -> None:
    COUNTS["exceptions"] += 1
    COUNTS[f"exceptions/{family}/{type(exc).__name__}"] += 1


def write() -> None:
    """Append this process's counts to ``$VTC_FUZZ_REPORT`` (called from conftest at session end)."""
    path = os.environ.get("VTC_FUZZ_REPORT")
    if not path or not COUNTS:
        return
    line = {"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "pid": os.getpid(), "counts": dict(COUNTS)}
    with open(path, "a") as f:
        f.write(json.dumps(line, sort_keys=True) + "\n")



def summarize(path: str) -> str:
    total: Counter = Counter()
    with open(path) as f:
        for ln in f:
            if ln.strip():
                total.update(json.loads(ln)["counts"])
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
    return "\n".join(out)


if __name__ == "__main__":
    print(summarize(sys.argv[1]))
