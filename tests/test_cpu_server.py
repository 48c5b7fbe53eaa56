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
