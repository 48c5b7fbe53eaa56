"""EAGLE-3 speculative decoding in a real ``python -m sglang.launch_server`` on the CPU engine.

The servers are ``xshare_sglang.testing.cpu_server`` (SGLang's own launcher, CPU flags, ``sgl_kernel``
stand-in) serving the shipped tiny Qwen3-MoE model with a tiny, untrained EAGLE-3 draft head made by
:func:`~xshare_sglang.testing.eagle_draft.make_tiny_eagle3_draft`.  EAGLE on SGLang's ``torch_native``
attention backend comes from ``xshare_sglang.testing.eagle_cpu`` (loaded by SGLang as a plugin only in
these CPU test servers).  One server runs at a time.

* Unpruned: speculative greedy decoding must reproduce a plain (non-speculative) server's greedy
  tokens exactly, and the server must report an acceptance length.
* Pruned verify (``xshare-spec``, per-request ``moe-spec``): the pruner proves itself, requests
  complete with the asked-for token counts, and ``/metrics`` carries its ``kept_experts`` gauges.
"""

from __future__ import annotations

import json

import pytest
import requests

from tests.live_server import LiveServer
from xshare_sglang.testing.eagle_draft import make_tiny_eagle3_draft

pytestmark = pytest.mark.live_server

NEW_TOKENS = 12
PROMPTS = ("The quick brown fox", "def fibonacci(n):", "Question: what is 12 plus 7? Answer:")
COMMON = ["--dtype", "float32", "--enable-metrics"]
NUM_EXPERTS = 32
PATCH_LINE = "xshare CPU testing: EAGLE on torch_native patched"


def eagle_flags(draft_dir) -> list[str]:
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(draft_dir),
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "2",
        "--speculative-num-draft-tokens",
        "4",
        "--page-size",
        "1",
    ]


PRUNED_VERIFY = {
    "xshare-spec": [
        "--moe-pruner",
        "xshare",
        "--moe-pruner-k0",
        "1",
        "--moe-pruner-budget",
        "2",
        "--moe-pruner-verify",
        "xshare-spec",
        "--moe-pruner-log-interval",
        "1",
    ],
    "moe-spec-request": [
        "--moe-pruner-config",
        json.dumps(
            {
                "policy": "none",
                "log_interval": 1,
                "verify": {"policy": "moe-spec", "max_experts": 3, "scope": "request"},
            }
        ),
    ],
}


def generate_all(server: LiveServer) -> list[dict]:
    return [server.generate(prompt, NEW_TOKENS) for prompt in PROMPTS]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_eagle3_draft(tmp_path_factory.mktemp("eagle3_draft"), seed=0)


@pytest.fixture(scope="module")
def plain_tokens(tmp_path_factory) -> list[list[int]]:
    """Greedy output ids of a plain (non-speculative) CPU server; the server is stopped at once."""
    server = LiveServer(COMMON, tmp_path_factory.mktemp("plain") / "server.log").start()
    try:
        return [answer["output_ids"] for answer in generate_all(server)]
    finally:
        server.stop()


# Class-scoped servers, started after the module-scoped plain run (pytest sets up wider scopes first),
# so no two servers of this file run at once.
@pytest.fixture(scope="class")
def eagle_server(draft_dir, tmp_path_factory):
    server = LiveServer([*COMMON, *eagle_flags(draft_dir)], tmp_path_factory.mktemp("eagle") / "server.log")
    server.start()
    yield server
    server.stop()


class TestEagle3Unpruned:
    def test_speculative_greedy_equals_plain_greedy(self, plain_tokens, eagle_server) -> None:
        answers = generate_all(eagle_server)
        assert [answer["output_ids"] for answer in answers] == plain_tokens
        for answer in answers:
            meta = answer["meta_info"]
            assert meta["completion_tokens"] == NEW_TOKENS
            # every decode step was a draft + verify round: at most NEW_TOKENS - 1 after the prefill token
            assert 0 < meta["spec_verify_ct"] <= NEW_TOKENS - 1
            assert meta["spec_accept_length"] >= 1.0
        assert PATCH_LINE in eagle_server.log()

    def test_server_reports_acceptance_length(self, eagle_server) -> None:
        eagle_server.generate(PROMPTS[0], NEW_TOKENS)
        info = requests.get(eagle_server.url + "/server_info", timeout=30).json()
        state = info["internal_states"][0]
        assert state["speculative_algorithm"] == "EAGLE3"
        assert state["avg_spec_accept_length"] >= 1.0


@pytest.fixture(scope="class", params=list(PRUNED_VERIFY))
def pruned_eagle_server(request, draft_dir, tmp_path_factory):
    name = request.param
    log = tmp_path_factory.mktemp(f"eagle-{name}") / "server.log"
    server = LiveServer([*COMMON, *eagle_flags(draft_dir), *PRUNED_VERIFY[name]], log).start()
    yield name, server
    server.stop()


class TestEagle3PrunedVerify:
    def test_pruned_verify_serves_and_reports(self, pruned_eagle_server) -> None:
        name, server = pruned_eagle_server
        assert server.policies(), f"{name}: no 'moe-pruner active: policy=' line in the log"
        answers = generate_all(server)
        for answer in answers:
            assert len(answer["output_ids"]) == NEW_TOKENS
            assert answer["meta_info"]["completion_tokens"] == NEW_TOKENS
            assert answer["meta_info"]["spec_verify_ct"] > 0
        kept = server.metrics().get("moe_pruner:kept_experts", {})
        assert kept, f"{name}: no moe_pruner:kept_experts gauge on /metrics"
        assert all(0 < value <= NUM_EXPERTS for value in kept.values())
        assert min(kept.values()) < NUM_EXPERTS, f"{name}: verify kept every expert: {kept}"
        assert server.alive()
