"""Bad files and bad arguments on the command line: exit 2 and one line naming the file or the flag.

Each case runs ``python -m xshare_sglang`` in a process of its own and checks the exit status, the
message, the absence of a traceback, and that torch's advice to load without ``weights_only`` (which
would run code from the file) is never passed on.  Most of such a process's time is its imports (torch,
SGLang): a few cases of each kind start a fresh interpreter as a user would, the others are forked
from one that imported the same modules and ran nothing (``tests/forked_runs.py``).

The server's launcher is held to the same rule: SGLang's own launcher with the plugin
(``python -m xshare_sglang.testing.cpu_server``, the shipped tiny model: 32 experts, top-4) refuses a
bad pruner setting, and one that contradicts the model's ``config.json``, at argument parsing, with
one line and none of the parser's usage text, the same way.  The checks against the model's
routing shape are also tested alone, with numbers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.forked_runs import run_forked
from xshare_sglang import PrunerConfig
from xshare_sglang.errors import ConfigError
from xshare_sglang.replay.route_csv import bundled_trace_path
from xshare_sglang.sglang_plugin.flags import HELP_HINT, TypedSettings, add_flags
from xshare_sglang.sglang_plugin.model_shape import (
    RoutingShape,
    check_layer_routing,
    check_ranking_layers,
    read_model_config,
    routing_shape,
    shape_refusal,
)
from xshare_sglang.testing.cpu_server import cpu_server_command, cpu_server_env
from xshare_sglang.tiny.tiny_model import tiny_eagle3_dir, tiny_model_dir

pytestmark = pytest.mark.cli_errors


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xshare_sglang", *argv], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _assert_clean_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    assert "weights_only" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A folder of broken inputs: a route CSV cut mid-row, pickled code, an empty and a cut archive."""
    folder = tmp_path_factory.mktemp("bad-files")
    text = bundled_trace_path("gemma").read_text()
    cut = text[: len(text) // 2]
    cut = cut[: cut.rindex(",") + 1]  # ends inside a row
    (folder / "cut.route.csv").write_text(cut)
    torch.save({"format": "xshare-trace", "payload": Path("not/a/tensor")}, folder / "pickled.pt")
    (folder / "empty.pt").write_bytes(b"")
    torch.save({"format": "xshare-trace", "version": 1, "x": torch.zeros(1000)}, folder / "whole.pt")
    (folder / "cut.pt").write_bytes((folder / "whole.pt").read_bytes()[:2000])
    (folder / "configs.json").write_text('[{"policy": "bogus"}]')
    return folder


FILE_CASES = [
    (["replay", "--trace", "cut.route.csv"], ["cut.route.csv", "line", "cut short"]),
    (["verify", "--trace", "cut.route.csv"], ["cut.route.csv", "line", "cut short"]),
    (["convert", "cut.route.csv", "out.pt"], ["cut.route.csv", "line", "cut short"]),
    (["convert", "missing.route.csv", "out.pt"], ["missing.route.csv", "no such file"]),
    (["replay", "--trace", "pickled.pt"], ["pickled.pt", "could run code"]),
    (["replay", "--trace", "empty.pt"], ["empty.pt", "empty"]),
    (["replay", "--trace", "cut.pt"], ["cut.pt", "cut short"]),
    (["calibrate", "--from-trace", "cut.pt"], ["cut.pt", "cut short"]),
    (["calibrate", "--from-dump", "pickled.pt"], ["pickled.pt", "could run code"]),
]
ARGUMENT_CASES = [
    (["spec-eval", "--requests", "0"], ["--requests 0", ">= 1"]),
    (["spec-eval", "--budgets", "0"], ["--budgets", "[1, 7]"]),
    (["spec-eval", "--budgets", "99"], ["--budgets", "[1, 7]"]),
    (["spec-eval", "--new-tokens", "0"], ["--new-tokens 0"]),
    (["replay", "--shapes", "1000x1"], ["--shapes 1000x1", "at most"]),
    (["replay", "--shapes", "8x0"], ["--shapes 8x0", ">= 1"]),
    (["verify", "--shapes", "300x4"], ["--shapes 300x4", "at most"]),
    (["replay", "--configs", "configs.json"], ["policy='bogus'", "choose one of"]),
    (["quality", "--study", "--configs", "configs.json"], ["--study and --configs"]),
]
#: Cases run as a user runs them, ``python -m xshare_sglang ...`` in a fresh interpreter: a file whose
#: content is refused (a route CSV cut short; pickled code, which torch's advice would load), a flag
#: value refused, a settings file whose content is refused.  Each of the others runs the same command
#: in a process of its own too, forked after one import of torch and the package
#: (``tests/forked_runs.py``).
OWN_PROCESS_CLI = (("file", 0), ("file", 4), ("argument", 0), ("argument", 7))


@pytest.fixture(scope="module")
def forked_cli(files, tmp_path_factory) -> dict[str, dict]:
    """Every case of :data:`FILE_CASES` and :data:`ARGUMENT_CASES` not in :data:`OWN_PROCESS_CLI`, as
    ``python -m xshare_sglang`` in a forked process, by ``kind-index``."""
    cases = {}
    for kind, table in (("file", FILE_CASES), ("argument", ARGUMENT_CASES)):
        for index, (argv, _) in enumerate(table):
            if (kind, index) not in OWN_PROCESS_CLI:
                cases[f"{kind}-{index}"] = {"module": "xshare_sglang", "args": argv, "cwd": str(files)}
    return run_forked(cases, tmp_path_factory.mktemp("cli-runs"), timeout_s=300)


def _run_case(kind: str, table: list, argv: list[str], needles: list[str], files: Path, request):
    index = table.index((argv, needles))
    if (kind, index) in OWN_PROCESS_CLI:
        return _run(*argv, cwd=files)
    forked = request.getfixturevalue("forked_cli")[f"{kind}-{index}"]
    return subprocess.CompletedProcess(argv, forked["returncode"], forked["stdout"], forked["stderr"])


@pytest.mark.parametrize(("argv", "needles"), FILE_CASES)
def test_bad_files_name_the_file(files, argv, needles, request) -> None:
    _assert_clean_error(_run_case("file", FILE_CASES, argv, needles, files, request), *needles)


@pytest.mark.parametrize(("argv", "needles"), ARGUMENT_CASES)
def test_bad_arguments_name_the_flag_before_any_work(files, argv, needles, request) -> None:
    result = _run_case("argument", ARGUMENT_CASES, argv, needles, files, request)
    _assert_clean_error(result, *needles)
    assert "k_max=" not in result.stdout and "configurations" not in result.stdout  # nothing was run


# ---------------------------------------------------------------- the server's launcher

LAUNCH = [sys.executable, "-m", "xshare_sglang.testing.cpu_server"]
#: A refusal at argument parsing takes a few seconds (most of it importing SGLang); a launch that got
#: as far as loading the model would take longer than this on the CPU engine.
REFUSAL_TIMEOUT_S = 120


def _ranking_file(path: Path, layers: int, experts: int) -> Path:
    counts = [[float(e + 1) for e in range(experts)] for _ in range(layers)]
    path.write_text(json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}))
    return path


@pytest.fixture(scope="module")
def server_files(tmp_path_factory) -> dict[str, str]:
    """Settings files for the launcher: a config over the model's top-k, one that is not JSON, and
    calibration files of the wrong width and of too few layers for the tiny model."""
    folder = tmp_path_factory.mktemp("bad-server-files")
    (folder / "k0.json").write_text(json.dumps({"policy": "xshare", "k0": 6}))
    (folder / "bad.json").write_text('{"policy": "xshare", ')
    return {
        "k0_config": str(folder / "k0.json"),
        "bad_config": str(folder / "bad.json"),
        "narrow": str(_ranking_file(folder / "narrow.json", layers=4, experts=16)),
        "short": str(_ranking_file(folder / "short.json", layers=2, experts=32)),
        "model": str(tiny_eagle3_dir()),
        "echo_log": str(folder / "echo-log"),
    }


STATIC = ["--moe-pruner", "moe-spec", "--moe-pruner-max-experts", "4", "--moe-pruner-ranking", "static"]

#: name -> (flags, what the error line must name, marks).
LAUNCH_CASES = {
    "k0-above-top-k": (
        ["--moe-pruner", "xshare", "--moe-pruner-k0", "8"],
        ["--moe-pruner-k0", "k0=8", "top_k=4", "config.json"],
        (),
    ),
    "k0-above-top-k-in-config-file": (
        ["--moe-pruner-config", "{k0_config}"],
        ["--moe-pruner-config", "k0=6", "top_k=4"],
        (),
    ),
    "ranking-of-other-width": (
        [*STATIC, "--moe-pruner-static-ranking-path", "{narrow}"],
        ["--moe-pruner-static-ranking-path", "ranks 16 experts per layer, the model has 32"],
        (),
    ),
    "ranking-of-too-few-layers": (
        [*STATIC, "--moe-pruner-static-ranking-path", "{short}"],
        ["--moe-pruner-static-ranking-path", "has 2 layers, but the model has MoE layer 3"],
        (),
    ),
    "unknown-policy": (["--moe-pruner", "bogus"], ["--moe-pruner", "'bogus'", "choose from"], ()),
    "negative-budget": (
        ["--moe-pruner", "xshare", "--moe-pruner-budget", "-3"],
        ["--moe-pruner-budget", "-3", ">= 0"],
        (),
    ),
    "depth-decay-not-a-number": (
        ["--moe-pruner", "xshare", "--moe-pruner-depth-decay", "x"],
        ["--moe-pruner-depth-decay", "'x'"],
        (),
    ),
    "config-file-not-json": (
        ["--moe-pruner-config", "{bad_config}"],
        ["--moe-pruner-config", "bad.json", "not valid JSON"],
        (),
    ),
    "unsupported-mode": (
        ["--moe-pruner", "xshare", "--enable-torch-compile"],
        ["--moe-pruner", "--enable-torch-compile"],
        (),
    ),
    "negative-k0": (
        ["--moe-pruner", "xshare", "--moe-pruner-k0", "-1"],
        ["--moe-pruner-k0", "must be >= 0, got -1"],
        (),
    ),
    "moe-spec-without-budget": (
        ["--moe-pruner", "moe-spec"],
        ["--moe-pruner-max-experts", "'moe-spec' needs max_experts"],
        (),
    ),
    "echo-with-adaptive-speculation": (
        [
            *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "{model}"),
            *("--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "4"),
            *("--speculative-adaptive", "--xshare-echo-log-dir", "{echo_log}"),
        ],
        ["--xshare-echo-log-dir", "cannot run with --speculative-adaptive"],
        (),
    ),
    "attention-dp": (
        ["--moe-pruner", "xshare", "--tp-size", "2", "--attn-dp-size", "2"],
        ["--moe-pruner", "attention data parallelism", "--attn-dp-size", "--moe-a2a-backend deepep"],
        (pytest.mark.sglang_modes,),
    ),
}
#: One case of each kind of refusal is started as a user starts it, ``python -m
#: xshare_sglang.testing.cpu_server`` (which becomes SGLang's launcher): a value the flag itself refuses
#: while SGLang parses, settings that do not validate together, a serving mode the pruner cannot
#: honour (its two ranks also give it an environment of its own), a setting the model's
#: ``config.json`` contradicts.  Each of the other cases runs SGLang's launcher on the command line
#: the CPU server builds, in a process of its own too, forked after one import of SGLang
#: (``tests/forked_runs.py``).
OWN_PROCESS = ("unknown-policy", "moe-spec-without-budget", "attention-dp", "k0-above-top-k")


def _launch_argv(name: str, server_files: dict[str, str]) -> list[str]:
    return [flag.format(**server_files) for flag in LAUNCH_CASES[name][0]]


@pytest.fixture(scope="module")
def forked_launches(server_files, tmp_path_factory) -> dict[str, dict]:
    """The cases not in :data:`OWN_PROCESS`, each run by SGLang's launcher in a forked process."""
    folder = tmp_path_factory.mktemp("launches")
    env = cpu_server_env()
    cases = {}
    for name in LAUNCH_CASES:
        if name in OWN_PROCESS:
            continue
        argv = _launch_argv(name, server_files)
        command = cpu_server_command(argv)
        assert command[1:3] == ["-m", "sglang.launch_server"], command
        assert cpu_server_env(argv=argv) == env, f"{name} needs an environment of its own: add it to OWN_PROCESS"
        (folder / name).mkdir()
        cases[name] = {"module": "sglang.launch_server", "args": command[3:], "cwd": str(folder / name)}
    return run_forked(cases, folder / "output", env, timeout_s=REFUSAL_TIMEOUT_S)


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("name", "needles"),
    [pytest.param(name, needles, marks=marks, id=name) for name, (_, needles, marks) in LAUNCH_CASES.items()],
)
def test_launcher_refuses_a_bad_setting_in_one_line(server_files, name, needles, request, tmp_path) -> None:
    """SGLang's launcher stops at argument parsing, before any process is spawned: exit code 2, one
    error line naming the flag, the value and what is allowed, and no usage text or traceback."""
    if name in OWN_PROCESS:
        argv = _launch_argv(name, server_files)
        start = time.monotonic()
        result = subprocess.run(
            [*LAUNCH, *argv], capture_output=True, text=True, timeout=REFUSAL_TIMEOUT_S, cwd=tmp_path
        )
        returncode, stderr, elapsed = result.returncode, result.stderr, time.monotonic() - start
    else:
        forked = request.getfixturevalue("forked_launches")[name]
        returncode, stderr, elapsed = forked["returncode"], forked["stderr"], forked["seconds"]
    assert returncode == 2, (returncode, stderr[-3000:])
    lines = stderr.splitlines()
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1, stderr[-3000:]
    assert not any(line.startswith("usage:") for line in lines), stderr[-3000:]
    assert "Traceback" not in stderr
    line = errors[0]
    assert line.startswith("sglang serve: error: ") and line.endswith(HELP_HINT), line
    assert lines[-1] == line, "nothing may run after the refusal"
    for needle in needles:
        assert needle.format(**server_files) in line, (needle, line)
    assert elapsed < REFUSAL_TIMEOUT_S


# ---------------------------------------------------------------- the checks, with numbers


def test_layer_check_refuses_k0_above_the_top_k() -> None:
    check_layer_routing(PrunerConfig(policy="xshare", k0=4), top_k=4, num_experts=32)
    with pytest.raises(ConfigError, match=r"PrunerConfig.k0=5 is invalid: must be <= the model's top_k=4") as refused:
        check_layer_routing(PrunerConfig(policy="xshare", k0=5), top_k=4, num_experts=32)
    assert refused.value.setting == "k0"
    check_layer_routing(PrunerConfig(policy="lynx", k0=5), top_k=4)  # no warm-up set: k0 is not used


def test_ranking_checks_take_the_model_width_and_last_layer(tmp_path) -> None:
    path = _ranking_file(tmp_path / "ranking.json", layers=2, experts=16)
    cfg = PrunerConfig(policy="moe-spec", max_experts=4, ranking="static", static_ranking_path=str(path))
    check_layer_routing(cfg, top_k=4, num_experts=16)
    check_ranking_layers(cfg, last_moe_layer=1)
    with pytest.raises(ConfigError, match="ranks 16 experts per layer, the model has 32") as refused:
        check_layer_routing(cfg, top_k=4, num_experts=32)
    assert refused.value.setting == "static_ranking_path"
    with pytest.raises(ConfigError, match="the file has 2 layers, but the model has MoE layer 2") as refused:
        check_ranking_layers(cfg, last_moe_layer=2)
    assert refused.value.setting == "static_ranking_path"
    check_ranking_layers(PrunerConfig(policy="xshare"), last_moe_layer=99)  # no calibration file


@pytest.mark.parametrize(
    ("config", "shape"),
    [
        (
            {"architectures": ["Qwen3MoeForCausalLM"], "num_experts_per_tok": 8, "num_experts": 128},
            RoutingShape(top_k=8, num_experts=128),
        ),
        (
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                **{"num_experts_per_tok": 8, "num_experts": 128, "num_hidden_layers": 48},
            },
            RoutingShape(top_k=8, num_experts=128, last_moe_layer=47),
        ),
        (
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                **{"num_experts_per_tok": 8, "n_routed_experts": 256, "num_hidden_layers": 61},
                **{"first_k_dense_replace": 3, "moe_layer_freq": 1},
            },
            RoutingShape(top_k=8, num_experts=256, last_moe_layer=60),
        ),
        (
            {
                "architectures": ["GptOssForCausalLM"],
                **{"experts_per_token": 4, "num_local_experts": 128, "num_hidden_layers": 36},
            },
            RoutingShape(top_k=4, num_experts=128, last_moe_layer=35),
        ),
        ({"architectures": ["HunYuanMoEV1ForCausalLM"], "moe_topk": [8, 8, 6]}, RoutingShape(top_k=6)),
        (
            {"architectures": ["Llama4ForConditionalGeneration"], "text_config": {"num_experts_per_tok": 1}},
            RoutingShape(top_k=1),
        ),
        ({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 32}, None),
        ({"num_experts_per_tok": 0}, None),
    ],
    ids=["qwen3-moe", "qwen3-moe-layers", "deepseek-v3", "gpt-oss", "per-layer-top-k", "multimodal", "dense", "zero"],
)
def test_routing_shape_from_config_values(config, shape) -> None:
    assert routing_shape(config) == shape


def _typed(**flags) -> TypedSettings:
    typed = TypedSettings()
    for key, (value, source) in flags.items():
        typed.set(key.replace("__", "."), value, source)
    return typed


def test_shape_refusal_names_the_flag_that_set_the_value() -> None:
    typed = _typed(policy=("xshare", "--moe-pruner"), k0=(3, "--moe-pruner-k0"))
    settings = typed.build()
    assert shape_refusal(settings, RoutingShape(top_k=4), typed.blame, "m") is None
    message = shape_refusal(settings, RoutingShape(top_k=2), typed.blame, "org/model")
    assert message == (
        "--moe-pruner-k0: PrunerConfig.k0=3 is invalid: must be <= the model's top_k=2 "
        "(from the config.json of org/model)"
    )
    # the same words as the model-load check, which wraps the same error
    with pytest.raises(ConfigError) as refused:
        check_layer_routing(settings.pruner, top_k=2)
    assert str(refused.value) in message


def test_shape_refusal_blames_a_phase_override() -> None:
    typed = TypedSettings()
    config = {"policy": "xshare", "k0": 1, "verify": {"policy": "xshare-spec", "k0": 3}}
    typed.update(config, "--moe-pruner-config")
    message = shape_refusal(typed.build(), RoutingShape(top_k=2), typed.blame, "m")
    assert message is not None
    assert message.startswith("--moe-pruner-config: ") and "k0=3" in message
    assert "[config of the verify phase]" in message


@pytest.mark.sglang
def test_model_config_is_read_from_local_files_only() -> None:
    args = SimpleNamespace(model_path=str(tiny_model_dir()), json_model_override_args="{}")
    assert routing_shape(read_model_config(args)) == RoutingShape(top_k=4, num_experts=32, last_moe_layer=3)
    args.json_model_override_args = '{"num_experts_per_tok": 2}'  # SGLang applies these over config.json
    assert routing_shape(read_model_config(args)).top_k == 2
    start = time.monotonic()
    assert read_model_config(SimpleNamespace(model_path="xshare-sglang-tests/not-a-cached-model")) is None
    assert read_model_config(SimpleNamespace(model_path="s3://bucket/model")) is None
    assert time.monotonic() - start < 5  # no network


def test_flag_values_are_checked_without_the_usage_text(capsys) -> None:
    """A value a flag refuses ends the parse with one line; a parser that does not exit on errors
    gets argparse's error instead."""
    parser = argparse.ArgumentParser(prog="sglang serve")
    parser.add_argument("--other", type=int)
    add_flags(parser)
    args = parser.parse_args(["--moe-pruner", "xshare", "--moe-pruner-k0", "2", "--moe-pruner-phases", "decode"])
    assert (args.moe_pruner, args.moe_pruner_k0, args.moe_pruner_phases) == ("xshare", 2, ("decode",))
    for argv, words in (
        (["--moe-pruner-k0", "-1"], "argument --moe-pruner-k0: must be >= 0, got -1"),
        (["--moe-pruner", "sparse"], "argument --moe-pruner: invalid choice: 'sparse'"),
        (["--moe-pruner-guard-seconds", "0"], "argument --moe-pruner-guard-seconds: must be > 0"),
    ):
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args(argv)
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and "usage:" not in err, err
    quiet = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_flags(quiet)
    with pytest.raises(argparse.ArgumentError, match="must be >= 0"):
        quiet.parse_args(["--moe-pruner-k0", "-1"])
    assert "--moe-pruner {none,oea,xshare" in parser.format_help()
