"""One configuration path: typed errors that know their setting, one merge of flags over the config
over the environment with each key's source, one parse per process, the calibration file read once,
and a launch command read by the plugin's own parser."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from xshare_sglang import PrunerConfig
from xshare_sglang.errors import ConfigError
from xshare_sglang.serving.calibration.static_calibration import launch_pruner
from xshare_sglang.sglang_plugin.flags import (
    CONFIG_FLAG,
    ECHO_FLAGS,
    FLAG_PREFIX,
    VERIFY_FLAG,
    add_flags,
    launch_command_words,
    settings_from_args,
    typed_settings,
)
from xshare_sglang.sglang_plugin.settings import ENV_VAR, PluginSettings, phase_policies, settings_from_env


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return parser.parse_args(list(argv))


def _ranking_file(path, counts) -> str:
    doc = {"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts}
    path.write_text(json.dumps(doc))
    return str(path)


# ---------------------------------------------------------------------- typed errors


@pytest.mark.parametrize(
    ("build", "setting"),
    [
        (lambda: PrunerConfig(k0=-1), "k0"),
        (lambda: PrunerConfig(policy="moe-spec"), "max_experts"),
        (lambda: PrunerConfig(policy="xshare", ranking="static"), "ranking"),
        (lambda: PrunerConfig.from_dict({"policy": "xshare", "bugdet": 3}), "bugdet"),
        (lambda: PluginSettings.from_dict({"policy": "xshare", "log_interval": -1}), "log_interval"),
        (
            lambda: PluginSettings.from_dict({"policy": "xshare", "verify": {"policy": "moe-spec"}}),
            "verify.max_experts",
        ),
        (lambda: PluginSettings.from_dict({"policy": "xshare", "verify": {"k0": -2}}), "verify.k0"),
        (lambda: PluginSettings.from_dict({"policy": "xshare", "phases": "decode", "verify": {"k0": 1}}), "verify"),
        (lambda: PluginSettings.from_dict({"echo": {"budget": 2.0}}), "echo.budget"),
        (lambda: PluginSettings.from_dict({"echo": {"log_every": 3}}), "echo.log_every"),
        (lambda: PluginSettings.from_dict({"trace_every": 3}), "trace_every"),
        (lambda: PluginSettings.from_dict({"policy": "xshare", "metrics_every": 0}), "metrics_every"),
        (lambda: PluginSettings.from_dict({"policy": "xshare", "metrics_every": True}), "metrics_every"),
        (lambda: PluginSettings.from_dict({"log_interval": 0, "metrics_every": 2}), "metrics_every"),
    ],
)
def test_every_config_error_names_its_setting(build, setting) -> None:
    with pytest.raises(ConfigError) as info:
        build()
    assert info.value.setting == setting


def test_model_checks_are_remembered_per_shape_and_still_refuse_other_shapes() -> None:
    cfg = PrunerConfig(policy="xshare", k0=3)
    cfg.validate_for_model(top_k=4, num_experts=64)
    cfg.validate_for_model(top_k=4, num_experts=64)
    assert cfg._accepted_models == {(4, 64, None)}
    with pytest.raises(ConfigError, match="k0") as info:
        cfg.validate_for_model(top_k=2, num_experts=64)
    assert info.value.setting == "k0" and cfg._accepted_models == {(4, 64, None)}


# ---------------------------------------------------------------------- one merge, with sources


def test_flags_win_over_the_config_which_wins_over_the_environment() -> None:
    environment = {"policy": "oea", "k0": 3, "budget": 9, "log_interval": 7, "verify": {"policy": "oea"}}
    args = _args(
        CONFIG_FLAG,
        '{"policy": "xshare", "k0": 1, "verify": {"policy": "xshare-spec", "request_budget": 2}}',
        "--moe-pruner-budget",
        "4",
        VERIFY_FLAG,
        "oea",
    )
    typed = typed_settings(args, environment)
    assert typed.data == {
        "policy": "xshare",
        "k0": 1,
        "budget": 4,
        "log_interval": 7,
        "verify": {"policy": "oea", "request_budget": 2},
    }
    assert typed.sources == {
        "policy": CONFIG_FLAG,
        "k0": CONFIG_FLAG,
        "log_interval": ENV_VAR,
        "verify": CONFIG_FLAG,
        "verify.policy": VERIFY_FLAG,
        "budget": "--moe-pruner-budget",
    }
    settings = typed.build()
    assert settings.config_for("decode").budget == 4 and settings.config_for("verify").policy == "oea"
    assert settings.config_for("verify").request_budget == 2


@pytest.mark.parametrize(
    ("environment", "argv", "message"),
    [
        # the flag typed for the setting at fault: its own message after the flag
        (None, ["--moe-pruner", "xshare", "--moe-pruner-tau", "1.5"], "--moe-pruner-tau: PrunerConfig.tau=1.5 is"),
        # nobody set it: the flag that would
        (None, ["--moe-pruner", "moe-spec"], "--moe-pruner-max-experts: PrunerConfig.max_experts=None is"),
        # set inside an override the config gave: the config flag, with the phase in the message
        (
            None,
            [CONFIG_FLAG, '{"policy": "xshare", "verify": {"policy": "moe-spec"}}'],
            f"{CONFIG_FLAG}: verify phase:",
        ),
        # an override blamed as a whole, set by a flag inside it
        (
            None,
            ["--moe-pruner", "xshare", "--moe-pruner-phases", "decode", VERIFY_FLAG, "oea"],
            f"{VERIFY_FLAG}: verify:",
        ),
        ({"policy": "xshare", "tau": 7}, [], f"{ENV_VAR}: PrunerConfig.tau=7 is invalid"),
        (None, [ECHO_FLAGS["max_width"], "2"], f"{ECHO_FLAGS['max_width']}: budget=/default_width=/max_width="),
        (None, [CONFIG_FLAG, "{bad"], f"{CONFIG_FLAG}: not valid JSON"),
    ],
)
def test_an_error_names_the_flag_or_variable_that_set_the_value(environment, argv, message) -> None:
    with pytest.raises(ConfigError) as info:
        settings_from_args(_args(*argv), environment)
    assert str(info.value).startswith(message), str(info.value)


def test_a_flag_overrides_a_bad_value_below_it() -> None:
    settings = settings_from_args(_args("--moe-pruner-tau", "0.5"), {"policy": "xshare-threshold", "tau": 7})
    assert settings.pruner.policy == "xshare-threshold" and settings.pruner.tau == 0.5


def test_nothing_typed_is_no_settings() -> None:
    assert settings_from_args(_args(), None) is None
    assert settings_from_args(_args(), {}) is None


# ---------------------------------------------------------------------- parsed once


def test_a_process_parses_the_environment_once() -> None:
    text = json.dumps({"policy": "xshare", "k0": 1, "verify": {"policy": "xshare-spec"}})
    first = settings_from_env({ENV_VAR: text})
    assert settings_from_env({ENV_VAR: text}) is first
    assert settings_from_env({ENV_VAR: text.replace('"k0": 1', '"k0": 2')}) is not first
    with pytest.raises(ConfigError, match=f"^{ENV_VAR}: PrunerConfig.k0=-1"):
        settings_from_env({ENV_VAR: '{"k0": -1}'})


def test_the_calibration_file_is_read_once_per_version(tmp_path) -> None:
    path = _ranking_file(tmp_path / "ranking.json", [[3, 2, 1, 0]])
    base = dict(policy="moe-spec", max_experts=2, ranking="static", static_ranking_path=path)
    settings = PluginSettings.from_dict({**base, "verify": {"max_experts": 3}})
    decode, verify = settings.config_for("decode"), settings.config_for("verify")
    assert verify.max_experts == 3 and decode.static_ranking is verify.static_ranking
    _ranking_file(tmp_path / "ranking.json", [[0, 1, 2, 3, 4]])
    os.utime(path, ns=(1, 1))  # a new version even within the file system's time resolution
    changed = PrunerConfig(**base)
    assert changed.static_ranking is not decode.static_ranking and changed.static_ranking.num_experts == 5


# ---------------------------------------------------------------------- launch commands


def test_launch_command_words_keep_json_whole() -> None:
    command = (
        'python -m sglang.launch_server --model-path m --moe-pruner-config {"policy": "xshare", "verify": '
        '{"policy": "oea"}} --moe-pruner-k0 1 --x={"a": 1} --q \'a b\' {bad'
    )
    assert launch_command_words(command) == [
        "python",
        "-m",
        "sglang.launch_server",
        "--model-path",
        "m",
        "--moe-pruner-config",
        '{"policy": "xshare", "verify": {"policy": "oea"}}',
        "--moe-pruner-k0",
        "1",
        '--x={"a": 1}',
        "--q",
        "a b",
        "{bad",
    ]


@pytest.mark.parametrize(
    "data",
    [
        {"policy": "xshare"},
        {"policy": "none", "verify": {"policy": "xshare-spec"}},
        {"policy": "oea", "phases": "decode,extend", "extend": {"policy": "lynx"}},
        {"policy": "xshare", "phases": ["verify"], "verify": {"k0": 1}},
        {},
    ],
)
def test_phase_policies_agree_with_the_validated_settings(data) -> None:
    settings = PluginSettings.from_dict(data)
    assert {phase: policy for phase, (policy, _) in phase_policies(data).items()} == {
        phase: cfg.policy for phase, cfg in settings.phase_configs().items()
    }


def test_launch_pruner_reads_the_command_as_the_server_did() -> None:
    base = "python -m sglang.launch_server --model-path m "
    assert launch_pruner(base + f"{FLAG_PREFIX} xshare --moe-pruner-k0 1").active == (f"{FLAG_PREFIX} xshare",)
    assert launch_pruner(base + f"{FLAG_PREFIX} none {VERIFY_FLAG} oea").active == (f"{VERIFY_FLAG} oea",)
    # a config whose own calibration file lives on the server: still read for its policy
    config = json.dumps({"policy": "moe-spec", "ranking": "static", "static_ranking_path": "/srv/r.json"})
    assert launch_pruner(base + f"{CONFIG_FLAG} {config}").active == (f"{CONFIG_FLAG} policy moe-spec",)
    only_decode = json.dumps({"policy": "xshare", "phases": "decode"})
    assert launch_pruner(base + f"{CONFIG_FLAG} {only_decode}").active == (f"{CONFIG_FLAG} policy xshare",)
    assert launch_pruner(base + f"{FLAG_PREFIX} none").active == ()
    assert launch_pruner(None) == launch_pruner(base)
    assert "do not parse" in launch_pruner(base + f"{FLAG_PREFIX} xshare2").unknown


def test_greedy_rankings_without_the_guard_are_warned_about(tmp_path) -> None:
    """moe-spec's coverage and co-activation rankings select with a serial greedy (measured at 16 µs to
    3 ms per layer call on an H200): a config that uses one, in any phase, with the guard off gets a
    warning that names the ranking, its cost and the guard flag; the guard on, or another ranking,
    gets none."""
    from xshare_sglang import PrunerConfig
    from xshare_sglang.sglang_plugin.settings import PluginSettings

    coverage = {"policy": "moe-spec", "max_experts": 8, "ranking": "coverage"}
    xshare = PrunerConfig(policy="xshare", k0=1, budget=8)
    verify_only = PluginSettings(pruner=xshare, phase_overrides={"verify": coverage})
    message = verify_only.selection_cost_warning()
    assert message is not None
    assert "ranking=coverage costs 24 µs" in message and "2957 at 512" in message
    assert "--moe-pruner-guard auto" in message and "coactivation" not in message
    assert PluginSettings(pruner=PrunerConfig(**coverage)).selection_cost_warning() is not None
    assert PluginSettings(pruner=xshare).selection_cost_warning() is None
    router = PrunerConfig(policy="moe-spec", max_experts=8)
    assert PluginSettings(pruner=router).selection_cost_warning() is None
    guarded = PluginSettings(pruner=PrunerConfig(**coverage), guard="auto")
    assert guarded.selection_cost_warning() is None
