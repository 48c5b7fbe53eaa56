"""Start SGLang's own server on the CPU engine: a test and development utility.

Usage::

    python -m xshare_sglang.testing.cpu_server [any sglang.launch_server argument ...]
    python -m xshare_sglang.testing.cpu_server --moe-pruner xshare --moe-pruner-k0 1 --moe-pruner-budget 2

The arguments go to ``python -m sglang.launch_server`` unchanged, after these are added where the
command line does not already give them:

* ``--model-path`` the tiny Qwen3-MoE model shipped in this package;
* :data:`CPU_DEFAULTS`: SGLang's CPU device, torch attention and sampling, no radix cache, a small
  KV cache, no warm-up request, no CUDA graphs, and an idle scheduler that sleeps (without
  ``--sleep-on-idle`` it polls for requests on a full core while idle).

The environment gets ``SGLANG_USE_CPU_ENGINE=1`` and, first on ``PYTHONPATH``, the folder of the
``sgl_kernel`` stand-in (the real package is CUDA-only).  Two more settings make a server of several
ranks (``--tp-size``, ``--pp-size``, ``--dp-size``) start, on one node or several, unless the
environment gives them:

* ``SGLANG_NCCL_SO_PATH`` names a library that does not exist.  The CPU engine's collectives run over
  gloo, but SGLang 0.5.23 builds an NCCL communicator for every group of two or more ranks whenever
  ``libnccl`` loads (``parallel_state.py``, ``init_model_parallel_group``), and the CUDA build of torch
  ships it: the communicator then fails on the CPU device.  With no library SGLang disables it;
* ``SGLANG_CPU_OMP_THREADS_BIND`` gives each rank a share of the cores (``0|1`` for two ranks on two
  cores; ranks share cores when there are more ranks than cores).  Without it SGLang asks for a NUMA
  node per rank of the whole server, even on a node that runs one of them.

Then this process *becomes* SGLang's launcher (``os.execv``): same pid, same signals, same exit codes
(2 for a bad flag).  What runs is SGLang's own code and the installed plugin; only ``sgl_kernel`` is
stood in for, and, under expert parallelism, the CPU MoE loop is handed other ranks' slots as
experts of weight 0 (``standin/_ep_slots.py``).  Not for production.
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
    ("--sleep-on-idle", ()),
)

#: Flags that name the model; without one the shipped tiny MoE model is served.
MODEL_FLAGS = ("--model-path", "--model")

#: The flags whose product is the number of ranks SGLang binds to cores (its ``dp * tp * pp``).
RANK_FLAGS = (("--tp-size", "--tp"), ("--pp-size", "--pp"), ("--dp-size", "--dp"))


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


def _int_flag(argv: Sequence[str], names: Sequence[str], default: int = 1) -> int:
    """The last value given to any spelling in ``names`` (``--flag N`` or ``--flag=N``)."""
    value = default
    for at, arg in enumerate(argv):
        for name in names:
            if arg == name and at + 1 < len(argv):
                value = int(argv[at + 1])
            elif arg.startswith(name + "="):
                value = int(arg.split("=", 1)[1])
    return value


def server_ranks(argv: Sequence[str]) -> int:
    """SGLang's ``dp * tp * pp`` for ``argv``: the ranks of the whole server, over all its nodes (SGLang
    checks the core binding against that count on every node)."""
    ranks = 1
    for names in RANK_FLAGS:
        ranks *= _int_flag(argv, names)
    return ranks


def threads_bind(ranks: int, cores: Sequence[int]) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``ranks`` ranks on ``cores``: rank i gets every core j with
    ``j % ranks == i`` when there are enough cores, else core ``cores[i % len(cores)]``."""
    cores = sorted(cores)
    if len(cores) >= ranks:
        groups = [cores[i::ranks] for i in range(ranks)]
    else:
        groups = [[cores[i % len(cores)]] for i in range(ranks)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def cpu_server_env(environ: Mapping[str, str] | None = None, argv: Sequence[str] = ()) -> dict[str, str]:
    """``environ`` (default: this process's) with the CPU engine switched on and the stand-in first
    on ``PYTHONPATH``; for a server of several ranks (``argv``, the launcher's arguments), no NCCL and
    a share of the cores per rank, where ``environ`` does not set them."""
    env = dict(os.environ if environ is None else environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    rest = [part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part and part != str(standin_path())]
    env["PYTHONPATH"] = os.pathsep.join([str(standin_path()), *rest])
    ranks = server_ranks(argv)
    if ranks > 1:
        env.setdefault("SGLANG_NCCL_SO_PATH", str(standin_path() / "no-libnccl.so.2"))
        env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", threads_bind(ranks, sorted(os.sched_getaffinity(0))))
    return env


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = cpu_server_command(argv)
    os.execve(command[0], command, cpu_server_env(argv=argv))


if __name__ == "__main__":
    main()
