"""SGLang's adaptive speculation (``--speculative-adaptive``) served under the pruner, live on the CPU
engine: exact at every step count it passes through, pruned at each of them.

One server: the shipped tiny Qwen3-MoE target, its shipped trained EAGLE-3 head
(``data/tiny_eagle3``, ``scripts/train_tiny_eagle3.py``), top-k 1 and 3 steps to start,
with an adaptive config that lets SGLang move early (two warm-up verifies, a decision after every
verify) between 1 and 3 steps for single requests and between 0, 1 and 3 steps for batches of four
and more.  The pruner keeps every expert the tokens pick, at decode (``xshare``, k0 = top-k, budget 0)
and at verify (``xshare-spec``): the server must then answer exactly as a plain, non-speculative
server, token for token, one request at a time and under concurrent traffic, whatever step count is
in force, while every step count's forwards run pruned (its own counter on ``/metrics``: D = steps
+ 1, D = 1 being a 0-step verify pruned as a decode step) and ``/metrics`` shows the step count of
each batch bucket, the activated experts of each phase and the distinct experts per verify request.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.live_server import LiveServer, unpruned_args
from xshare_sglang.tiny.tiny_model import tiny_eagle3_dir

pytestmark = [pytest.mark.live_server, pytest.mark.adaptive_spec]

NEW_TOKENS = 16
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Question: what is 12 plus 7? Answer:",
    "Once upon a time",
    "import numpy as np",
    "The capital of France is",
    "1, 2, 3, 4,",
    "Dear team, the release",
]
CONCURRENCY = 8
#: Step counts per batch-size bucket: 1 request may run 1 or 3 steps, 4 and more 0, 1 or 3.  Batches of
#: four and more drop whatever the draft accepts (down hysteresis 2: every threshold 2 higher), then
#: probe 1 step again after each 0-step interval: the run passes through 3, 1 and 0 steps.
ADAPTIVE_CONFIG = {
    "1": {"candidate_steps": [1, 3], "warmup_batches": 2, "update_interval": 1},
    "4": {"candidate_steps": [0, 1, 3], "warmup_batches": 2, "update_interval": 1, "down_hysteresis": 2.0},
}
KEEP_ALL = [
    *("--moe-pruner", "xshare", "--moe-pruner-k0", "4", "--moe-pruner-budget", "0"),
    *("--moe-pruner-verify", "xshare-spec", "--moe-pruner-log-interval", "1"),
]
SWITCH = re.compile(r"Switch adaptive runtime state: steps (\d+) -> (\d+)")


@pytest.fixture(scope="module")
def plain_answers(live_servers) -> dict[str, list[int]]:
    """Greedy ids of the shared plain (non-speculative, unpruned) float32 server, one prompt at a time."""
    server = live_servers.server(unpruned_args("float32"), interpreter=False)
    return {prompt: server.generate(prompt, NEW_TOKENS)["output_ids"] for prompt in PROMPTS}


def start_adaptive_server(folder, adaptive_config: dict, pruner_flags: list[str]) -> LiveServer:
    """A float32 CPU server of the tiny target with the shipped EAGLE-3 head (top-k 1, 3 steps to
    start), ``--speculative-adaptive`` with ``adaptive_config``, and ``pruner_flags``."""
    config = folder / "adaptive.json"
    config.write_text(json.dumps(adaptive_config))
    flags = [
        *("--dtype", "float32", "--enable-metrics", "--page-size", "1"),
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(tiny_eagle3_dir())),
        *("--speculative-eagle-topk", "1", "--speculative-num-steps", "3", "--speculative-num-draft-tokens", "4"),
        *("--speculative-adaptive", "--speculative-adaptive-config", str(config)),
        *pruner_flags,
    ]
    return LiveServer(flags, folder / "server.log", interpreter=False).start()


@pytest.fixture(scope="module")
def adaptive_server(tmp_path_factory):
    server = start_adaptive_server(tmp_path_factory.mktemp("adaptive"), ADAPTIVE_CONFIG, KEEP_ALL)
    yield server
    server.stop()


def test_every_step_count_answers_as_the_plain_server(plain_answers, adaptive_server) -> None:
    """Alone, then eight at once, then alone again: every answer is the plain server's, token for
    token, while SGLang moves through 3, 1 and 0 steps and back."""
    server = adaptive_server
    assert server.policies() == ["xshare,xshare-spec"], "the pruner never proved itself active"
    alone = {prompt: server.generate(prompt, NEW_TOKENS) for prompt in PROMPTS[:3]}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        batched = dict(zip(PROMPTS, pool.map(lambda p: server.generate(p, NEW_TOKENS), PROMPTS), strict=True))
    again = {prompt: server.generate(prompt, NEW_TOKENS) for prompt in PROMPTS[3:5]}
    for label, answers in (("alone", alone), ("batched", batched), ("alone again", again)):
        for prompt, answer in answers.items():
            assert answer["output_ids"] == plain_answers[prompt], f"{label}: {prompt!r} differs from the plain server"
            assert answer["meta_info"]["completion_tokens"] == NEW_TOKENS
    log = server.log()
    switches = [(int(a), int(b)) for a, b in SWITCH.findall(log)]
    visited = {3} | {b for _, b in switches}
    assert {0, 1, 3} <= visited, f"the run passed through steps {sorted(visited)} only: {switches}"
    assert server.alive() and "selection failed" not in log


def test_metrics_show_each_step_count_pruned(adaptive_server) -> None:
    """Every step count ran pruned forwards (D = 1, 2, 4); the step count of each bucket, the activated
    experts of both phases and the distinct experts per verify request are on /metrics."""
    server = adaptive_server
    if not SWITCH.search(server.log()):  # run alone: make the traffic that moves the steps
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            list(pool.map(lambda p: server.generate(p, NEW_TOKENS), PROMPTS))
    metrics = server.metrics()
    forwards = {
        dict(labels)["draft_tokens"]: value
        for labels, value in metrics["moe_pruner:pruned_spec_forwards_total"].items()
    }
    assert set(forwards) == {"1", "2", "4"} and all(value > 0 for value in forwards.values()), forwards
    steps = {dict(labels)["batch_size"]: value for labels, value in metrics["moe_pruner:speculative_steps"].items()}
    assert set(steps) == {"1", "4"}, steps
    assert steps["1"] in (1.0, 3.0) and steps["4"] in (0.0, 1.0, 3.0)
    phases = {}
    for labels, value in metrics["moe_pruner:phase_activated_experts"].items():
        phases.setdefault(dict(labels)["phase"], []).append(value)
    assert set(phases) == {"decode", "verify"} and all(max(values) > 0 for values in phases.values()), phases
    per_request = metrics["moe_pruner:verify_request_experts"]
    assert per_request and all(0 < value <= 32 for value in per_request.values()), per_request
    calls = metrics["moe_pruner:phase_layer_calls_total"]
    assert all(value > 0 for value in calls.values()), calls


# Expert-aware tiers: the start-up guard on, with pruned verify (one expert beyond each token's own).
TIERED = [
    *("--moe-pruner", "xshare", "--moe-pruner-k0", "1", "--moe-pruner-budget", "2"),
    *("--moe-pruner-verify", "xshare-spec", "--moe-pruner-log-interval", "10"),
    *("--moe-pruner-guard", "auto", "--moe-pruner-guard-seconds", "20", "--max-running-requests", "8"),
]
#: SGLang's own moves, unforced: the tiers decide what it may move between.
TIERS_CONFIG = {
    "1": {"candidate_steps": [1, 3], "warmup_batches": 2, "update_interval": 1},
    "4": {"candidate_steps": [0, 1, 3], "warmup_batches": 2, "update_interval": 1},
}
TIER_LINE = re.compile(r"moe-pruner tiers: batch bucket (\d+): steps \[([\d, ]*)\] of \[([\d, ]*)\] \(([^)]*)\)")


@pytest.fixture(scope="module")
def tiered_server(tmp_path_factory):
    server = start_adaptive_server(tmp_path_factory.mktemp("adaptive-tiers"), TIERS_CONFIG, TIERED)
    yield server
    server.stop()


@pytest.mark.break_even
def test_expert_aware_tiers_decide_from_measured_costs(tiered_server) -> None:
    """The guard times the MoE stack of every bucket and step count at start-up; under traffic the
    tiers log each bucket's decision with the rates it rests on, and SGLang's step count of every
    bucket stays among the steps the tiers allow (gauges from start-up)."""
    server = tiered_server
    log = server.log()
    assert "moe-pruner tiers: expert-aware --speculative-adaptive tiers on" in log, log[-3000:]
    for bucket in TIERS_CONFIG:
        assert f"batch bucket {bucket}: " in log.split("the MoE stack per step:")[1].splitlines()[0]
    for _ in range(2):
        for prompt in PROMPTS[:3]:
            assert server.generate(prompt, NEW_TOKENS)["meta_info"]["completion_tokens"] == NEW_TOKENS
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            answers = list(pool.map(lambda p: server.generate(p, NEW_TOKENS), PROMPTS))
        assert all(answer["meta_info"]["completion_tokens"] == NEW_TOKENS for answer in answers)
    decided = {}
    for bucket, allowed, candidates, reason in TIER_LINE.findall(server.log()):
        decided[bucket] = ([int(s) for s in allowed.split(",") if s.strip()], [int(s) for s in candidates.split(",")])
        assert reason
    assert set(decided) == set(TIERS_CONFIG), decided
    metrics = server.metrics()
    allowed_gauge = {
        (dict(labels)["batch_size"], int(dict(labels)["steps"])): value
        for labels, value in metrics["moe_pruner:spec_tier_allowed"].items()
    }
    steps_gauge = {
        dict(labels)["batch_size"]: int(value) for labels, value in metrics["moe_pruner:speculative_steps"].items()
    }
    for bucket, (allowed, candidates) in decided.items():
        assert candidates == TIERS_CONFIG[bucket]["candidate_steps"]
        assert {s for s in candidates if allowed_gauge[(bucket, s)] == 1.0} == set(allowed)
        assert steps_gauge[bucket] in allowed, (bucket, steps_gauge, allowed)
    assert server.alive() and "selection failed" not in server.log()
