"""PrunerConfig: validation messages name the field, and round trips are lossless."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from xshare_sglang import POLICIES, PrunerConfig, select_experts_mask
from xshare_sglang.calibration_file import load_static_ranking

# DESIGN section 4, in its order.
DESIGN_FIELDS = [
    "policy",
    "k0",
    "budget",
    "request_budget",
    "rank_budget",
    "max_experts",
    "tau",
    "score",
    "coverage",
    "ranking",
    "static_ranking_path",
    "alpha",
    "beta",
    "phases",
    "min_tokens",
    "max_tokens",
]


def _ranking_file(tmp_path, counts, **extra):
    path = tmp_path / "ranking.json"
    doc = {"format": "xshare-sglang.static-ranking", "version": 1, "counts": counts, **extra}
    path.write_text(json.dumps(doc))
    return str(path)


# Added by issue 5 (speculative verify), after the DESIGN fields so positional order stays stable.
VERIFY_FIELDS = ["scope", "depth_decay"]
# Added by issue 20 (calibrated per-layer budgets).
CALIBRATED_FIELDS = ["budget_allocation"]


def test_field_names_are_design_section_4() -> None:
    assert list(PrunerConfig.field_names()) == DESIGN_FIELDS + VERIFY_FIELDS + CALIBRATED_FIELDS


def test_frozen() -> None:
    cfg = PrunerConfig(policy="xshare")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.budget = 3


@pytest.mark.parametrize(
    ("kwargs", "field", "hint"),
    [
        (
            {"policy": "xshare2"},
            "policy",
            "none, oea, xshare, xshare-threshold, xshare-spec, xshare-ep, moe-spec, lynx",
        ),
        ({"k0": -1}, "k0", ">= 0"),
        ({"k0": 1.5}, "k0", "integer"),
        ({"k0": True}, "k0", "integer"),
        ({"budget": -3}, "budget", ">= 0"),
        ({"request_budget": -1}, "request_budget", ">= 0"),
        ({"rank_budget": -2}, "rank_budget", ">= 0"),
        ({"max_experts": 0}, "max_experts", ">= 1"),
        ({"tau": 0.0}, "tau", "(0, 1]"),
        ({"tau": 1.5}, "tau", "(0, 1]"),
        ({"tau": float("nan")}, "tau", "finite"),
        ({"tau": "0.9"}, "tau", "number"),
        ({"alpha": 0.0}, "alpha", "> 0"),
        ({"alpha": -1.0}, "alpha", "> 0"),
        ({"beta": 0}, "beta", ">= 1"),
        ({"beta": 2.5}, "beta", "integer"),
        ({"score": "gate"}, "score", "topk, probs"),
        ({"coverage": "partial"}, "coverage", "substitution, truncation"),
        ({"ranking": "oracle"}, "ranking", "router, static"),
        ({"phases": ["decode", "prefill"]}, "phases", "decode, verify, extend, mixed"),
        ({"phases": []}, "phases", "non-empty"),
        ({"min_tokens": -1}, "min_tokens", ">= 0"),
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens", "max_tokens=4"),
        ({"policy": "moe-spec"}, "max_experts", "moe-spec"),
        ({"policy": "xshare", "ranking": "static"}, "ranking", "moe-spec"),
        (
            {"policy": "moe-spec", "max_experts": 8, "ranking": "static"},
            "static_ranking_path",
            "needs the calibration file",
        ),
        ({"static_ranking_path": "x.json"}, "static_ranking_path", "ranking='static'"),
    ],
)
def test_bad_values_name_the_field(kwargs, field, hint) -> None:
    with pytest.raises(ValueError) as info:
        PrunerConfig(**kwargs)
    message = str(info.value)
    assert f"PrunerConfig.{field}=" in message
    assert hint in message


@pytest.mark.parametrize(
    ("content", "hint"),
    [
        (None, "no such file"),
        ("{not json", "not a readable JSON file"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"format": "other", "version": 1, "counts": [[1]]}), "format"),
        (json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": []}), "non-empty"),
        (json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": [[1, 2], [3]]}), "same number"),
        (json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": [[1, -2]]}), ">= 0"),
        (json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "counts": [[1, "2"]]}), ">= 0"),
        (
            json.dumps({"format": "xshare-sglang.static-ranking", "version": 1, "num_experts": 3, "counts": [[1, 2]]}),
            "num_experts",
        ),
    ],
)
def test_static_ranking_file_errors(tmp_path, content, hint) -> None:
    path = tmp_path / "ranking.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as info:
        PrunerConfig(policy="moe-spec", max_experts=4, ranking="static", static_ranking_path=str(path))
    assert "PrunerConfig.static_ranking_path=" in str(info.value)
    assert hint in str(info.value)


def test_static_ranking_loads(tmp_path) -> None:
    path = _ranking_file(tmp_path, [[1, 2, 3], [0, 0, 7]], model="m")
    ranking = load_static_ranking(path)
    assert (ranking.num_layers, ranking.num_experts, ranking.model) == (2, 3, "m")
    cfg = PrunerConfig(policy="moe-spec", max_experts=2, ranking="static", static_ranking_path=path)
    assert cfg.static_ranking.counts[1] == (0.0, 0.0, 7.0)


def test_validate_for_model(tmp_path) -> None:
    cfg = PrunerConfig(policy="xshare", k0=3)
    cfg.validate_for_model(top_k=3)
    with pytest.raises(ValueError, match=r"PrunerConfig.k0=3 .*top_k=2"):
        cfg.validate_for_model(top_k=2)
    with pytest.raises(ValueError, match=r"PrunerConfig.k0=3 .*top_k=2"):
        select_experts_mask(torch.randn(4, 8), cfg, top_k=2)
    # k0 is irrelevant to policies without a warm-up
    PrunerConfig(policy="lynx", k0=5).validate_for_model(top_k=2)
    path = _ranking_file(tmp_path, [[1, 2, 3], [0, 0, 7]])
    static = PrunerConfig(policy="moe-spec", max_experts=2, ranking="static", static_ranking_path=path)
    static.validate_for_model(top_k=2, num_experts=3, num_layers=2)
    with pytest.raises(ValueError, match="ranks 3 experts per layer, the model has 4"):
        static.validate_for_model(top_k=2, num_experts=4)
    with pytest.raises(ValueError, match="has 2 layers, the model has 5"):
        static.validate_for_model(top_k=2, num_layers=5)
    with pytest.raises(ValueError, match="the model has 4"):
        select_experts_mask(torch.randn(4, 4), static, top_k=2, layer_id=0)


def test_select_experts_mask_argument_errors() -> None:
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="expert_to_rank"):
        select_experts_mask(logits, PrunerConfig(policy="xshare-ep"), top_k=2)
    with pytest.raises(ValueError, match=r"expert_to_rank must have shape \(8,\)"):
        select_experts_mask(logits, PrunerConfig(policy="xshare-ep"), top_k=2, expert_to_rank=torch.zeros(4))
    with pytest.raises(ValueError, match="tokens_per_request"):
        select_experts_mask(logits, PrunerConfig(policy="xshare-spec"), top_k=2, tokens_per_request=0)
    with pytest.raises(ValueError, match="scoring"):
        select_experts_mask(logits, PrunerConfig(policy="oea"), top_k=2, scoring="relu")
    with pytest.raises(ValueError, match="2-D"):
        select_experts_mask(logits[0], PrunerConfig(policy="oea"), top_k=2)
    with pytest.raises(ValueError, match="cfg must be a PrunerConfig"):
        select_experts_mask(logits, {"policy": "oea"}, top_k=2)


@pytest.mark.parametrize("policy", POLICIES)
def test_round_trips(tmp_path, policy) -> None:
    cfg = PrunerConfig(policy=policy, k0=1, budget=7, max_experts=9, tau=0.75, phases=("verify",), min_tokens=2)
    assert PrunerConfig.from_dict(cfg.to_dict()) == cfg
    assert PrunerConfig.from_json(cfg.to_json()) == cfg
    assert PrunerConfig.load(str(cfg)) == cfg
    path = tmp_path / "cfg.json"
    path.write_text(cfg.to_json())
    assert PrunerConfig.from_file(path) == cfg
    assert PrunerConfig.load(str(path)) == cfg
    assert json.loads(cfg.to_json())["phases"] == ["verify"]


def test_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match=r"no field\(s\) 'bugdet'.*the fields are policy, k0"):
        PrunerConfig.from_dict({"policy": "xshare", "bugdet": 4})


def test_load_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="not valid JSON"):
        PrunerConfig.load("{policy: xshare}")
    with pytest.raises(ValueError, match="does not exist"):
        PrunerConfig.load(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="JSON object"):
        PrunerConfig.from_json("[1]")


def test_phases_accept_comma_text_and_normalize() -> None:
    assert PrunerConfig(phases="verify, decode").phases == ("decode", "verify")
    assert PrunerConfig(phases=["mixed", "extend", "extend"]).phases == ("extend", "mixed")


def test_defaults_and_summary() -> None:
    cfg = PrunerConfig()
    assert cfg.policy == "none" and cfg.phases == ("decode", "verify")
    assert PrunerConfig(policy="moe-spec", max_experts=4).effective_score == "probs"
    assert PrunerConfig(policy="xshare").effective_score == "topk"
    assert PrunerConfig(policy="xshare", score="probs").effective_score == "probs"
    line = PrunerConfig(policy="xshare", k0=1, budget=8, max_experts=20).summary()
    assert line.startswith("policy=xshare k0=1 budget=8 max_experts=20 score=topk coverage=substitution")
