"""The plugin as SGLang loads it: entry point, flags, exit codes, config hand-off to spawned processes,
and what ``register()`` does in each situation.  Each test runs in a process of its own, since plugin
loading and hook application happen once per process: a fresh interpreter, or for some of the
``register()`` cases a process forked from one that imported the same modules but never loaded the plugin
(``tests/forked_runs.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.forked_runs import run_forked
from xshare_sglang.sglang_plugin import hooks
from xshare_sglang.sglang_plugin.flags import ECHO_FLAGS, FIELD_FLAGS, GUARD_FLAGS, TRACE_FLAGS
from xshare_sglang.sglang_plugin.settings import ENV_VAR

pytestmark = pytest.mark.sglang

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    environ.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        timeout=timeout,
        cwd=str(ROOT),
    )


def parse_in_fresh_process(cases: dict[str, list[str]]) -> dict[str, list]:
    """SGLang's ``prepare_server_args`` (plugins loaded) on each argv, in one fresh interpreter.

    Returns, per case, ``[exit code, stderr]`` when parsing stopped the launch and ``[None, the
    published plugin config]`` when the plugin accepted it (SGLang's own later checks aside).
    """
    code = f"""
        import contextlib, io, json, os
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import prepare_server_args
        load_plugins()
        out = {{}}
        for name, argv in {cases!r}.items():
            os.environ.pop("{ENV_VAR}", None)
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                try:
                    prepare_server_args(["--model-path", "unused", *argv])
                    out[name] = [None, os.environ.get("{ENV_VAR}", "")]
                except SystemExit as exc:
                    out[name] = [exc.code, err.getvalue()]
                except Exception as exc:  # SGLang's own checks, after the plugin accepted and published
                    published = os.environ.get("{ENV_VAR}")
                    out[name] = [None, published] if published else ["error", repr(exc)]
        print("RESULT" + json.dumps(out))
    """
    result = _python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.split("RESULT", 1)[1])


def assert_refused(report: dict[str, list], expected: dict[str, str]) -> None:
    """Every expected case ended the launch with exit code 2 and its message fragment."""
    for name, fragment in expected.items():
        code, stderr = report[name]
        assert code == 2, (name, stderr)
        assert fragment in stderr, (name, stderr)


def test_entry_point_is_registered() -> None:
    from importlib.metadata import entry_points

    found = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert found.get("xshare_sglang") == "xshare_sglang.sglang_plugin:register"


def test_launch_server_help_lists_every_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    flags = [
        "--moe-pruner",
        "--moe-pruner-config",
        "--moe-pruner-log-interval",
        "--moe-pruner-metrics-every",
        "--moe-pruner-verify",
        *TRACE_FLAGS.values(),
        *GUARD_FLAGS.values(),
        *ECHO_FLAGS.values(),
        *(s.flag for s in FIELD_FLAGS),
    ]
    for flag in flags:
        assert f"{flag} " in result.stdout or f"{flag}\n" in result.stdout, flag
    assert "{none,oea,xshare,xshare-threshold,xshare-spec,xshare-ep,moe-spec,lynx}" in result.stdout


def test_bad_value_ends_the_launch_with_exit_code_2() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", "unused", "--moe-pruner", "moe-spec"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert "error: --moe-pruner-max-experts:" in result.stderr and "needs max_experts" in result.stderr


def test_parsing_errors_name_the_flag() -> None:
    cases = {
        "k0": ["--moe-pruner-k0", "-1"],
        "tau": ["--moe-pruner", "xshare", "--moe-pruner-tau", "1.5"],
        "policy": ["--moe-pruner", "xshare2"],
        "phases": ["--moe-pruner-phases", "decode,prefill"],
        "config": ["--moe-pruner-config", "{bad"],
        "unknown_key": ["--moe-pruner-config", '{"policy": "xshare", "bugdet": 3}'],
        "ranking": ["--moe-pruner", "xshare", "--moe-pruner-ranking", "static"],
        "verify": ["--moe-pruner-verify", "xshare-tree"],
        "verify_phase": ["--moe-pruner", "xshare", "--moe-pruner-phases", "decode", "--moe-pruner-verify", "oea"],
        "verify_override": [
            "--moe-pruner-config",
            '{"policy": "xshare", "verify": {"policy": "moe-spec"}}',
        ],
        "scope": ["--moe-pruner-scope", "tree"],
        "depth_decay": ["--moe-pruner", "xshare", "--moe-pruner-depth-decay", "0"],
        "guard": ["--moe-pruner", "xshare", "--moe-pruner-guard", "always"],
        "guard_margin": ["--moe-pruner", "xshare", "--moe-pruner-guard", "auto", "--moe-pruner-guard-margin", "1"],
        "guard_seconds": ["--moe-pruner", "xshare", "--moe-pruner-guard", "auto", "--moe-pruner-guard-seconds", "0"],
        "guard_alone": ["--moe-pruner-guard", "auto"],
        "guard_margin_off": ["--moe-pruner", "xshare", "--moe-pruner-guard-margin", "0.1"],
        "metrics_every": ["--moe-pruner", "xshare", "--moe-pruner-metrics-every", "0"],
        "metrics_every_off": [
            "--moe-pruner",
            "xshare",
            "--moe-pruner-log-interval",
            "0",
            "--moe-pruner-metrics-every",
            "4",
        ],
    }
    report = parse_in_fresh_process(cases)
    expected = {
        "k0": "argument --moe-pruner-k0: must be >= 0",
        "tau": "--moe-pruner-tau: PrunerConfig.tau=1.5 is invalid",
        "policy": "argument --moe-pruner: invalid choice: 'xshare2'",
        "phases": "argument --moe-pruner-phases:",
        "config": "--moe-pruner-config: not valid JSON",
        "unknown_key": "'bugdet'",
        "ranking": "--moe-pruner-ranking: PrunerConfig.ranking='static' is invalid",
        "verify": "argument --moe-pruner-verify: invalid choice: 'xshare-tree'",
        "verify_phase": "--moe-pruner-verify: verify: an override was given for phase 'verify', which is not pruned",
        "verify_override": "--moe-pruner-config: verify phase: PrunerConfig.max_experts=None is invalid",
        "scope": "argument --moe-pruner-scope: invalid choice: 'tree'",
        "depth_decay": "--moe-pruner-depth-decay: PrunerConfig.depth_decay=0.0 is invalid",
        "guard": "argument --moe-pruner-guard: invalid choice: 'always'",
        "guard_margin": "--moe-pruner-guard-margin: guard_margin=1.0 is invalid: must lie in [0, 1)",
        "guard_seconds": "argument --moe-pruner-guard-seconds: must be > 0",
        "guard_alone": "--moe-pruner-guard: guard='auto' has nothing to time",
        "guard_margin_off": "--moe-pruner-guard-margin: guard_margin= has no effect with guard='off'",
        "metrics_every": "argument --moe-pruner-metrics-every: must be >= 1, got 0",
        "metrics_every_off": "--moe-pruner-metrics-every: metrics_every=4 has no effect with log_interval=0",
    }
    assert_refused(report, expected)


def test_config_reaches_a_spawned_child(tmp_path) -> None:
    code = """
        import json, os, pickle, multiprocessing as mp
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import prepare_server_args

        def child(server_args, queue):
            from xshare_sglang.sglang_plugin import settings_from_env
            queue.put([server_args._moe_pruner_config, os.environ.get("XSHARE_MOE_PRUNER_CONFIG"),
                       settings_from_env().pruner.summary()])

        if __name__ == "__main__":
            load_plugins()
            args = prepare_server_args([
                "--model-path", "unused", "--moe-pruner", "xshare-spec",
                "--moe-pruner-config", '{"k0": 1, "request_budget": 3}',
                "--moe-pruner-budget", "2", "--moe-pruner-phases", "verify", "--moe-pruner-log-interval", "50",
                "--moe-pruner-metrics-every", "4",
            ])
            copy = pickle.loads(pickle.dumps(args))
            ctx = mp.get_context("spawn")
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(copy, queue))
            proc.start()
            seen = queue.get(timeout=240)
            proc.join()
            print("RESULT" + json.dumps({"attr": args._moe_pruner_config, "child": seen}))
    """
    script = tmp_path / "spawn_child.py"
    script.write_text(textwrap.dedent(code))
    environ = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=environ, timeout=300, cwd=str(ROOT)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("RESULT", 1)[1])
    config = json.loads(report["attr"])
    # explicit flags win over --moe-pruner-config, which fills what the flags leave unset
    assert config["policy"] == "xshare-spec" and config["k0"] == 1 and config["request_budget"] == 3
    assert config["budget"] == 2 and config["phases"] == ["verify"] and config["log_interval"] == 50
    assert config["metrics_every"] == 4
    attr, env, summary = report["child"]
    assert attr == report["attr"] and env == report["attr"]
    assert summary.startswith("policy=xshare-spec k0=1 request_budget=3 budget=2")


REGISTER = """
    import json, logging
    logging.basicConfig(level=logging.INFO)
    from xshare_sglang.sglang_plugin import hooks, liveness, register
    try:
        register()
        register()  # idempotent
        status = "ok"
    except SystemExit as exc:
        status = f"exit {exc.code}"
    print("RESULT" + json.dumps({
        "status": status,
        "cli_unhooked": liveness.unhooked(hooks.CLI_HOOKS) if status == "ok" else None,
        "routing_unhooked": liveness.unhooked(hooks.ROUTING_HOOKS) if status == "ok" else None,
    }))
"""


APPLY = """
    from sglang.srt.plugins.hook_registry import HookRegistry
    HookRegistry.apply_hooks()  # what load_plugins does after the plugins ran
    print("CLI" + json.dumps(liveness.unhooked(hooks.CLI_HOOKS)))
"""
#: name -> (XSHARE_MOE_PRUNER_CONFIG, whether the routing hooks are applied).
REGISTER_CASES = {
    "unset": (None, False),
    "none": ('{"policy": "none"}', False),
    "xshare": ('{"policy": "xshare", "budget": 4}', True),
    "coverage": ('{"policy": "moe-spec", "max_experts": 8, "ranking": "coverage"}', True),
}
BAD_ENVIRONMENT = '{"policy": "xshare", "tau": 7}'
#: Run as ``python -c`` in a fresh interpreter; the other register cases each run the same code in a
#: process of their own too, forked from one that imported what they import but ran none of it
#: (``tests/forked_runs.py``): the plugin is loaded, and its hooks applied, in each case's process.
REGISTER_OWN_PROCESS = ("xshare",)


@pytest.fixture(scope="module")
def forked_registers(tmp_path_factory) -> dict[str, dict]:
    """The register cases not in :data:`REGISTER_OWN_PROCESS`, and the refused environment
    (``bad-environment``), each in a forked process."""
    cases = {
        name: {"code": textwrap.dedent(REGISTER + APPLY), "cwd": str(ROOT), "env": {ENV_VAR: value}}
        for name, (value, _) in REGISTER_CASES.items()
        if name not in REGISTER_OWN_PROCESS
    }
    cases["bad-environment"] = {"code": textwrap.dedent(REGISTER), "cwd": str(ROOT), "env": {ENV_VAR: BAD_ENVIRONMENT}}
    environ = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    # the hooks' targets, which register() imports when it applies them (the hooks are not applied here)
    targets = [module.TARGET for module in (*hooks.CLI_HOOKS, *hooks.ROUTING_HOOKS, *hooks.ECHO_HOOKS)]
    return run_forked(cases, tmp_path_factory.mktemp("register"), environ, timeout_s=300, preload=targets)


def _register_run(name: str, code: str, env_value: str | None, request) -> subprocess.CompletedProcess:
    if name in REGISTER_OWN_PROCESS:
        return _python(code, env={ENV_VAR: env_value} if env_value else None)
    forked = request.getfixturevalue("forked_registers")[name]
    return subprocess.CompletedProcess(["python", "-c", code], forked["returncode"], forked["stdout"], forked["stderr"])


@pytest.mark.parametrize("name", list(REGISTER_CASES))
def test_register_applies_routing_hooks_only_when_asked(name, request) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: F401  (SGLang installed)

    env_value, routing = REGISTER_CASES[name]
    result = _register_run(name, REGISTER + APPLY, env_value, request)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("RESULT", 1)[1].splitlines()[0])
    assert report["status"] == "ok"
    assert json.loads(result.stdout.split("CLI", 1)[1].splitlines()[0]) == []
    all_routing = len(report["routing_unhooked"]) == 0
    none_routing = len(report["routing_unhooked"]) == len(hooks.ROUTING_HOOKS)
    assert all_routing if routing else none_routing
    if routing:
        assert "routing hooks in place" in result.stderr
    # the greedy coverage ranking, without the start-up guard, is warned about at launch (its measured
    # cost and the guard flag); the other configs are not
    coverage = env_value is not None and "coverage" in env_value
    assert ("ranking=coverage costs 24 µs" in result.stderr) == coverage, result.stderr[-2000:]
    assert ("--moe-pruner-guard auto" in result.stderr) == coverage


def test_register_refuses_a_bad_environment_config(request) -> None:
    result = _register_run("bad-environment", REGISTER, BAD_ENVIRONMENT, request)
    report = json.loads(result.stdout.split("RESULT", 1)[1])
    assert report["status"] == "exit 2"
    assert f"{ENV_VAR}: PrunerConfig.tau=7 is invalid" in result.stderr
