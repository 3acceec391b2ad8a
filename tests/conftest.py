"""Test-session setup. CPU only: with the CUDA plugin installed and no driver, JAX would otherwise try
(and noisily fail) to initialise a GPU. Must run before anything imports jax."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_sessionfinish(session, exitstatus):
    """The fuzz tests' tally (tests/fuzz_report.py) goes to $VTC_FUZZ_REPORT, one line per process."""
    import sys
    report = sys.modules.get("fuzz_report")
    if report is not None:
        report.write()
