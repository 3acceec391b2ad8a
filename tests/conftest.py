"""Test-session setup. CPU only: with the CUDA plugin installed and no driver, JAX would otherwise try
(and noisily fail) to initialise a GPU. Must run before anything imports jax."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    """Import vtc_jax in every process, pytest-xdist's controller included. The controller unpickles
    the workers' warnings (``VTCNotice``, ...) by importing their module from each worker's execnet
    thread; two threads importing the package for the first time at once met its partly
    initialised modules (a circular ``ImportError`` that ended a CI run on the jax 0.12 leg)."""
    import vtc_jax  # noqa: F401


def pytest_sessionfinish(session, exitstatus):
    """The fuzz tests' tally (tests/fuzz_report.py) goes to $VTC_FUZZ_REPORT, one line per process."""
    import sys
    report = sys.modules.get("fuzz_report")
    if report is not None:
        report.write()
