"""Command line: ``vtc-jax demo | explain PATH[:FN] | kernels [PATH[:FN]]``.

Heavy modules (jax, the pipeline) are imported inside the subcommands so that ``--help`` is instant
and a broken stage only breaks the subcommand that needs it.

A user file for ``explain``/``kernels`` defines the function (default name ``step``, else ``main``)
and ``example_args()`` returning the positional args as a tuple, or ``(args, kwargs)``, or a dict of
kwargs. The file is imported as a module with its directory on ``sys.path``, like a script.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

DEFAULT_FUNCTIONS = ("step", "main")


class CliError(Exception):
    """A user-facing error: printed without a traceback, exit status 2."""


def split_target(spec: str) -> tuple[Path, str | None]:
    """``path/to/file.py:fn`` -> (path, "fn"); a bare path -> (path, None)."""
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isidentifier() and head:
        return Path(head), tail
    return Path(spec), None


def load_target(spec: str, args_fn: str = "example_args"
                ) -> tuple[Callable, tuple, dict[str, Any]]:
    """Import the file named in ``spec`` and return (fn, args, kwargs) from its ``args_fn()``."""
    path, name = split_target(spec)
    if not path.is_file():
        raise CliError(f"no such file: {path}")
    mod_name = "_vtc_user_" + "".join(c if c.isalnum() else "_" for c in path.stem)
    sys.path.insert(0, str(path.resolve().parent))
    spec_ = importlib.util.spec_from_file_location(mod_name, path)
    if spec_ is None or spec_.loader is None:
        raise CliError(f"cannot import {path} (not a Python file?)")
    module = importlib.util.module_from_spec(spec_)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up here
    spec_.loader.exec_module(module)
    candidates = (name,) if name else DEFAULT_FUNCTIONS
    fn = next((getattr(module, n) for n in candidates if callable(getattr(module, n, None))), None)
    if fn is None:
        raise CliError(f"{path} defines no function {' or '.join(map(repr, candidates))}"
                       " (choose one with PATH:FN)")
    make_args = getattr(module, args_fn, None)
    if not callable(make_args):
        raise CliError(f"{path} defines no {args_fn}(): add one returning the example "
                       "positional args as a tuple (or (args, kwargs))")
    args, kwargs = _normalise_args(make_args())
    return fn, args, kwargs


def _normalise_args(value: Any) -> tuple[tuple, dict[str, Any]]:
    if isinstance(value, dict):
        return (), dict(value)
    if (isinstance(value, (tuple, list)) and len(value) == 2
            and isinstance(value[0], (tuple, list)) and isinstance(value[1], dict)):
        return tuple(value[0]), dict(value[1])
    if isinstance(value, (tuple, list)):
        return tuple(value), {}
    return (value,), {}


def _api(name: str) -> Callable:
    """``vtc_jax.<name>`` or a clear error while that part of the package does not exist."""
    fn = getattr(importlib.import_module("vtc_jax"), name, None)
    if fn is None:
        raise CliError(f"vtc_jax.{name} is not available in this build")
    return fn


def cmd_demo(ns: argparse.Namespace) -> int:
    rc = importlib.import_module("vtc_jax.demo").run()
    return rc if isinstance(rc, int) else 0


def cmd_explain(ns: argparse.Namespace) -> int:
    fn, args, kwargs = load_target(ns.target, ns.args_fn)
    report = _api("explain")(fn)(*args, **kwargs)
    print(str(report))
    return 0


def cmd_kernels(ns: argparse.Namespace) -> int:
    """Cross-lower for CUDA, compile every Triton kernel offline, print the resource table.

    Without a target: the library's templates, from ``vtc_jax.kernels.examples()`` yielding
    ``(name, kernel_call, args)`` in the ``check_kernel`` convention (``kernel_call(*args, backend=)``).
    """
    from vtc_jax import offline, testing
    jobs: list[tuple[str, Any]] = []
    if ns.target:
        fn, args, kwargs = load_target(ns.target, ns.args_fn)
        if not ns.no_optimize:
            fn = _api("optimize")(fn)
        jobs.append((ns.target, testing.cross_lower(lambda a, k: fn(*a, **k), args, kwargs)))
    else:
        kernels = importlib.import_module("vtc_jax.kernels")
        if not hasattr(kernels, "examples"):
            raise CliError("vtc_jax.kernels has no examples() yet: give a PATH[:FN] instead")
        for name, kernel_call, args in kernels.examples():
            jobs.append((name, testing.cross_lower(
                functools.partial(kernel_call, backend="triton"), *args)))
    results = []
    for label, lowered in jobs:
        for r in offline.compile_lowered(lowered, arch=ns.arch):
            results.append(r if ns.target or r.name == label
                           else dataclasses.replace(r, name=f"{label}/{r.name}"))
    if not results:
        print("no Triton kernels in the lowered module")
        return 1
    print(offline.format_table(results, gpu=ns.gpu))
    bad = [r for r in results if not r.fits(ns.gpu) or r.spills]
    return 1 if bad else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vtc-jax", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the built-in demo").set_defaults(run=cmd_demo)
    e = sub.add_parser("explain", help="show what VTC would do to a function in a file")
    e.add_argument("target", metavar="PATH[:FN]")
    e.add_argument("--args-fn", default="example_args", help="builds the example args")
    e.set_defaults(run=cmd_explain)
    k = sub.add_parser("kernels", help="compile Triton kernels offline: registers, spills, smem")
    k.add_argument("target", metavar="PATH[:FN]", nargs="?")
    k.add_argument("--args-fn", default="example_args")
    k.add_argument("--no-optimize", action="store_true",
                   help="lower FN as written (it calls pallas kernels itself)")
    k.add_argument("--arch", default="9.0", help="compute capability Triton targets")
    k.add_argument("--gpu", default="sm_90", help="shared-memory limit to check against")
    k.set_defaults(run=cmd_kernels)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.run(ns)
    except CliError as e:
        print(f"vtc-jax: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if (e.name or "").startswith("vtc_jax"):
            print(f"vtc-jax: error: {e.name} is not available in this build", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
