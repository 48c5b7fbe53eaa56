"""Several ``python -m MODULE ...`` or ``python -c CODE`` runs, each in a process of its own, for the
price of one import.

Tests that run a command line in a fresh interpreter (exit status, stderr, no traceback; what a
plugin does once per process) spend most of each run importing torch and SGLang.  This runs many::

    python -m tests.forked_runs SPEC_JSON OUT_DIR

``SPEC_JSON`` maps a case name to ``{"module": M, "args": [...]}`` (``python -m M args``) or
``{"code": C}`` (``python -c C``), with ``"cwd"`` (default: this process's) and ``"env"``
(``{variable: value or None}``, set or removed in the case's process only; a variable read at import
time must instead be set for the whole run).  This process first imports what the first case's
module or code imports at its top (read from its source) and the modules ``--preload`` names; it
runs nothing else.  Then, per case, it forks.  The child sends its stdout and stderr to
``OUT_DIR/NAME.stdout`` and ``.stderr``, changes to the case's folder, and runs the module as
``python -m`` does (as ``__main__``, with ``sys.argv`` and ``sys.path[0]`` as there) or the code as
``python -c`` does.  Whatever ends the child ends it as it ends an interpreter: ``SystemExit`` with
its code, any other exception with Python's traceback on stderr and code 1, after the same exit
handlers (those registered by the imports, then the case's own).  A case still running after
``--timeout`` seconds (it went on to serve, or a lock held at the fork never came free) has its
process group killed and fails.

Most of a run's seconds after those first imports go to more imports (a plugin's hooks import their
targets' modules, which pull in much of SGLang).  So the first case's child writes down every
module it ended with, and this process imports them, in that order, before it forks the next
cases.  What those imports print (warnings) is then on this process's stderr, not on the later
cases': a test that checks a command's whole stderr keeps some cases in a fresh interpreter.

Prints one JSON object: per case ``{"returncode", "stdout", "stderr", "seconds"}``.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import importlib
import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_forked(
    cases: Mapping[str, dict],
    out: Path,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 120.0,
    preload: Sequence[str] = (),
) -> dict[str, dict]:
    """For a test: this script on ``cases`` in ``env`` (default: the test's environment), importing
    the modules of ``preload`` first; per case ``{"returncode", "stdout", "stderr", "seconds"}``."""
    command = [sys.executable, "-m", "tests.forked_runs", json.dumps(cases), str(out), "--timeout", str(timeout_s)]
    result = subprocess.run(
        [*command, *(f"--preload={name}" for name in preload)],
        capture_output=True,
        text=True,
        timeout=60 + timeout_s * (len(cases) + 1),
        cwd=ROOT,
        env=None if env is None else dict(env),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def top_imports(source: str) -> list[str]:
    """The absolute imports at the top level of ``source``, in order."""
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def first_imports(case: dict) -> list[str]:
    """What the case's module (its ``__main__`` when it is a package) or code imports at its top."""
    if "code" in case:
        return top_imports(case["code"])
    spec = importlib.util.find_spec(case["module"])
    if spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(case["module"] + ".__main__")
    return top_imports(Path(spec.origin).read_text(encoding="utf-8"))


def import_module_of(name: str) -> None:
    """Import the module that holds ``name`` (``package.module.Class.method``: its longest prefix that
    is a module)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        try:
            importlib.import_module(".".join(parts[:end]))
            return
        except ImportError:
            continue


def import_all(names: list[str]) -> None:
    """Import each module not imported yet, in the order given; one that does not import alone (an
    alias, a module made at run time) is left out."""
    for name in names:
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:  # the case imports it, if it needs it
                continue


def _write_modules(path: Path) -> None:
    path.write_text("\n".join(sys.modules) + "\n", encoding="utf-8")


def _become_the_case(case: dict, out: Path, modules: Path | None) -> None:
    """In the forked child: run the case as ``python -m`` or ``python -c`` runs it (then write the
    names of the imported modules to ``modules``, when given).  Returns only by an exception, which
    ends the child as it ends an interpreter."""
    os.setpgid(0, 0)
    if modules is not None:
        atexit.register(_write_modules, modules)  # before the case runs: after the case's own exit handlers
    for fd, suffix in ((1, ".stdout"), (2, ".stderr")):
        target = os.open(f"{out}{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(case.get("cwd") or os.getcwd())
    for name, value in case.get("env", {}).items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if "code" in case:
        sys.path[0] = ""  # what `python -c` puts first
        sys.argv = ["-c"]
        namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        sys.modules["__main__"] = type(sys)("__main__")
        sys.modules["__main__"].__dict__.update(namespace)
        exec(compile(case["code"], "<string>", "exec"), sys.modules["__main__"].__dict__)
    else:
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        sys.argv = [case["module"], *case.get("args", [])]  # run_module makes argv[0] the module's file
        runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def _wait(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", help='JSON: {name: {"module": M, "args": [...]} or {"code": C}, "cwd", "env"}')
    parser.add_argument("out", type=Path, help="folder for each case's stdout and stderr")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a case may run")
    parser.add_argument(
        "--preload", action="append", default=[], help="import the module of this (dotted) name first; repeatable"
    )
    options = parser.parse_args()
    cases = json.loads(options.cases)
    options.out = options.out.resolve()
    options.out.mkdir(parents=True, exist_ok=True)
    if cases:
        import_all(first_imports(next(iter(cases.values()))))
    for name in options.preload:
        import_module_of(name)

    results = {}
    modules = options.out / "modules.txt"
    for number, (name, case) in enumerate(cases.items()):
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            _become_the_case(case, options.out / name, modules if number == 0 else None)
        code = _wait(pid, options.timeout)
        seconds = time.monotonic() - started
        if number == 0 and modules.is_file():
            import_all(modules.read_text(encoding="utf-8").split())
        results[name] = {
            "returncode": code,
            "stdout": (options.out / f"{name}.stdout").read_text(encoding="utf-8", errors="replace"),
            "stderr": (options.out / f"{name}.stderr").read_text(encoding="utf-8", errors="replace"),
            "seconds": round(seconds, 2),
        }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
