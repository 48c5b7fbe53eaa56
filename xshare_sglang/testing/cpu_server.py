"""Start SGLang's own server on the CPU engine: a test and development utility.

Usage::

    python -m xshare_sglang.testing.cpu_server [any sglang.launch_server argument ...]
    python -m xshare_sglang.testing.cpu_server --moe-pruner xshare --moe-pruner-k0 1 --moe-pruner-budget 2

The arguments go to ``python -m sglang.launch_server`` unchanged, after these are added where the
command line does not already give them:

* ``--model-path`` the tiny Qwen3-MoE model shipped in this package;
* :data:`CPU_DEFAULTS`: SGLang's CPU device, torch attention and sampling, no radix cache, a small
  KV cache, no warm-up request, no CUDA graphs.

The environment gets ``SGLANG_USE_CPU_ENGINE=1`` and, first on ``PYTHONPATH``, the folder of the
``sgl_kernel`` stand-in (the real package is CUDA-only).  Then this process *becomes* SGLang's launcher
(``os.execv``): same pid, same signals, same exit codes (2 for a bad flag).  What runs is SGLang's
own code and the installed plugin; only ``sgl_kernel`` is stood in for.  Not for production.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

#: Flags added unless the command line gives them (flag, its values).
CPU_DEFAULTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("--device", ("cpu",)),
    ("--attention-backend", ("torch_native",)),
    ("--sampling-backend", ("pytorch",)),
    ("--disable-radix-cache", ()),
    ("--max-total-tokens", ("4096",)),
    ("--skip-server-warmup", ()),
    ("--cuda-graph-backend-decode", ("disabled",)),
    ("--cuda-graph-backend-prefill", ("disabled",)),
)

#: Flags that name the model; without one the shipped tiny MoE model is served.
MODEL_FLAGS = ("--model-path", "--model")


def standin_path() -> Path:
    """The folder to put first on ``PYTHONPATH``: it holds the ``sgl_kernel`` stand-in package."""
    return Path(__file__).resolve().parent / "standin"


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def cpu_server_command(argv: Sequence[str], python: str | None = None) -> list[str]:
    """The full launcher command for ``argv``: SGLang's launcher, the user's arguments, then the CPU
    defaults the user did not give."""
    from ..tiny.tiny_model import tiny_model_dir

    command = [python or sys.executable, "-m", "sglang.launch_server", *argv]
    if not any(_given(argv, flag) for flag in MODEL_FLAGS):
        command += ["--model-path", str(tiny_model_dir())]
    for flag, values in CPU_DEFAULTS:
        if not _given(argv, flag):
            command += [flag, *values]
    return command


def cpu_server_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) with the CPU engine switched on and the stand-in first
    on ``PYTHONPATH``."""
    env = dict(os.environ if environ is None else environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    rest = [part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part and part != str(standin_path())]
    env["PYTHONPATH"] = os.pathsep.join([str(standin_path()), *rest])
    return env


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = cpu_server_command(argv)
    os.execve(command[0], command, cpu_server_env())


if __name__ == "__main__":
    main()
