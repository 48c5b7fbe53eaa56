"""``python -m xshare_sglang.testing.cpu_server``: the command and environment it hands to SGLang."""

from __future__ import annotations

import os

from xshare_sglang.testing import CPU_DEFAULTS, cpu_server_command, cpu_server_env, standin_path
from xshare_sglang.tiny.tiny_model import tiny_model_dir


def test_defaults_are_added_only_where_missing() -> None:
    command = cpu_server_command(["--device=cpu", "--max-total-tokens", "8192", "--moe-pruner", "oea"], python="py")
    assert command[:3] == ["py", "-m", "sglang.launch_server"]
    assert command[3:7] == ["--device=cpu", "--max-total-tokens", "8192", "--moe-pruner"]
    # the user's values win, each default appears once, the shipped model is served
    assert command.count("--max-total-tokens") == 1 and "4096" not in command
    assert sum(arg.startswith("--device") for arg in command) == 1
    assert command[command.index("--model-path") + 1] == str(tiny_model_dir())
    for flag, values in CPU_DEFAULTS:
        if flag not in ("--device", "--max-total-tokens"):
            at = command.index(flag)
            assert command[at + 1 : at + 1 + len(values)] == list(values)


def test_a_given_model_is_kept() -> None:
    command = cpu_server_command(["--model-path", "/models/x"], python="py")
    assert command.count("--model-path") == 1 and "/models/x" in command
    assert "--model-path" not in cpu_server_command(["--model=/models/y"], python="py")


def test_environment_puts_the_standin_first_once() -> None:
    env = cpu_server_env({"PYTHONPATH": os.pathsep.join(["/a", str(standin_path()), "/b"]), "KEEP": "1"})
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["KEEP"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(standin_path()), "/a", "/b"]
    assert (standin_path() / "sgl_kernel" / "__init__.py").is_file()


def test_a_single_rank_server_gets_no_rank_settings() -> None:
    env = cpu_server_env({}, argv=["--moe-pruner", "xshare", "--tp-size", "1"])
    assert "SGLANG_NCCL_SO_PATH" not in env and "SGLANG_CPU_OMP_THREADS_BIND" not in env


def test_ranks_get_no_nccl_and_a_share_of_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    env = cpu_server_env({}, argv=["--tp-size", "2", "--ep-size", "2"])
    assert env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    nccl = env["SGLANG_NCCL_SO_PATH"]
    assert nccl.startswith(str(standin_path())) and not os.path.exists(nccl)
    # two nodes: SGLang binds against the ranks of the whole server on every node
    assert cpu_server_env({}, argv=["--tp=2", "--nnodes", "2"])["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    # the operator's own settings win
    given = cpu_server_env({"SGLANG_CPU_OMP_THREADS_BIND": "0-1|0-1", "SGLANG_NCCL_SO_PATH": "/x"}, argv=["--tp", "2"])
    assert given["SGLANG_CPU_OMP_THREADS_BIND"] == "0-1|0-1" and given["SGLANG_NCCL_SO_PATH"] == "/x"


def test_core_shares() -> None:
    from xshare_sglang.testing.cpu_server import server_ranks, threads_bind

    assert threads_bind(2, [0, 1, 2, 3]) == "0,2|1,3"
    assert threads_bind(4, [5, 6]) == "5|6|5|6"
    assert server_ranks(["--tp-size", "2", "--pp-size=2", "--dp", "3"]) == 12
    assert server_ranks(["--moe-pruner", "xshare"]) == 1
