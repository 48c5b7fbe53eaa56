"""The plugin inside a real, running ``python -m sglang.launch_server`` (CPU engine, shipped tiny MoE).

Each server is SGLang's own launcher in a subprocess (``xshare_sglang.testing.cpu_server``): the flag
parser with the plugin's flags, plugin loading in every process, the model build, the routing hooks,
the scheduler and the HTTP front end.  What a test asserts is what a client sees: tokens, log lines,
``/metrics`` and the trace files the server wrote.

Reference decoding is the project's transformers one (``RouterHook``: Hugging Face's own Qwen3-MoE
with the policy applied to its routers through ``select_experts_mask`` / ``route_within``), in float32
like the servers here, one request at a time.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.live_server import NO_CRASH_DIAGNOSTICS, LiveServer, traces_after
from xshare_sglang import PrunerConfig, route_within, select_experts_mask
from xshare_sglang.policies.rewrite import activated_experts, filler_ids
from xshare_sglang.replay.trace import load_trace
from xshare_sglang.tiny.tiny_demo import heldout_texts
from xshare_sglang.tiny.tiny_model import RouterHook, tiny_model_dir

pytestmark = pytest.mark.live_server

TOP_K = 4
NEW_TOKENS = 12
#: Settings that prune the tiny model (32 experts, top-4) even for a single request.
POLICIES = {
    "none": {"policy": "none"},
    "oea": {"policy": "oea", "k0": 1},
    "xshare": {"policy": "xshare", "k0": 1, "budget": 2},
    "xshare-threshold": {"policy": "xshare-threshold", "k0": 1, "tau": 0.5},
    "moe-spec": {"policy": "moe-spec", "max_experts": 3},
    "lynx": {"policy": "lynx"},
}
COMMON = ["--dtype", "float32", "--enable-metrics"]


def pruner_flags(fields: dict) -> list[str]:
    flags = ["--moe-pruner", fields["policy"]]
    for name, value in fields.items():
        if name != "policy":
            flags += [f"--moe-pruner-{name.replace('_', '-')}", str(value)]
    if fields["policy"] != "none":
        flags += ["--moe-pruner-log-interval", "1"]
    return flags


@torch.no_grad()
def reference_tokens(reference, cfg: PrunerConfig | None, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of transformers' model under ``cfg`` (None: unpruned), one request."""
    model, _ = reference
    ids = torch.tensor([prompt])
    with RouterHook(model, cfg=cfg):
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def post_ids(server: LiveServer, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    import requests

    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
    }
    response = requests.post(server.url + "/generate", json=body, timeout=120)
    response.raise_for_status()
    return response.json()["output_ids"]


# Class-scoped servers: each is stopped when its class is done.
@pytest.fixture(scope="class", params=list(POLICIES))
def policy_server(request, tmp_path_factory):
    name = request.param
    if POLICIES[name] == XSHARE:  # the traced server's settings: that server answers for them
        yield name, request.getfixturevalue("xshare_server")[0]
        return
    log = tmp_path_factory.mktemp(f"server-{name}") / "server.log"
    server = LiveServer([*COMMON, *pruner_flags(POLICIES[name])], log).start()
    yield name, server
    server.stop()


class TestPolicies:
    """One server per policy, plain decoding."""

    def test_policy_proves_itself_and_answers(self, policy_server, prompts, reference) -> None:
        _check_policy_answers(policy_server, prompts, reference)

    def test_greedy_tokens_match_transformers_reference(self, policy_server, prompts, reference) -> None:
        """One request at a time, the server's greedy tokens equal transformers' under the same policy."""
        name, server = policy_server
        cfg = None if name == "none" else PrunerConfig(**POLICIES[name])
        for prompt in prompts:
            assert post_ids(server, prompt) == reference_tokens(reference, cfg, prompt), f"prompt {prompt[:6]}..."


def _check_policy_answers(policy_server, prompts, reference) -> None:
    """The proof-of-life line names the policy (and is absent with ``none``); ``/generate`` and the
    OpenAI-compatible ``/v1/completions`` answer the same greedy text; a pruning server exports the
    plugin's gauges, a kept-expert count within the policy's settings."""
    name, server = policy_server
    _, tokenizer = reference
    text = tokenizer.decode(prompts[0])
    generated = server.generate(text, NEW_TOKENS)
    completion = server.completion(text, NEW_TOKENS)
    assert generated["meta_info"]["completion_tokens"] == NEW_TOKENS
    assert completion["choices"][0]["text"] == generated["text"]
    assert completion["usage"]["completion_tokens"] == NEW_TOKENS
    metrics = server.metrics()
    if name == "none":
        assert server.policies() == []
        assert metrics == {}
        return
    assert server.policies() == [name]
    assert "tied embeddings" not in server.log()  # the shipped checkpoint stores lm_head
    kept = metrics["moe_pruner:kept_experts"]
    activated = metrics["moe_pruner:activated_experts"]
    assert sorted(dict(labels)["layer"] for labels in kept) == ["0", "1", "2", "3"]
    # one request: every policy keeps fewer experts than the model has; oea with k0=1 keeps 1 per
    # layer, xshare (k0=1, budget 2) at most 3, moe-spec exactly 3
    bound = {"oea": 1, "xshare": 3, "xshare-threshold": TOP_K, "moe-spec": 3, "lynx": TOP_K}[name]
    assert all(1 <= value <= bound for value in kept.values()), kept
    # a dropped slot gets a weight-0 expert on the CPU path: the layer reads max(kept, top-k) experts
    assert all(value == TOP_K for value in activated.values()), activated


# ---------------------------------------------------------------------- coverage
TRUNCATION = {"policy": "xshare", "k0": 1, "budget": 2, "coverage": "truncation"}


@pytest.fixture(scope="class")
def truncation_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server-truncation") / "server.log"
    server = LiveServer([*COMMON, *pruner_flags(TRUNCATION)], log).start()
    yield server
    server.stop()


@pytest.mark.sglang_modes
class TestTruncationCoverage:
    def test_server_truncates_instead_of_substituting(self, truncation_server, prompts, reference) -> None:
        """``--moe-pruner-coverage truncation``: the server answers transformers' greedy tokens under
        truncation (each token keeps its own picks inside the mask, no substitute), which differ from
        the substitution answer on some prompt; before, the server always substituted."""
        truncated = PrunerConfig(**TRUNCATION)
        substituted = PrunerConfig(**{**TRUNCATION, "coverage": "substitution"})
        differs = False
        for prompt in prompts:
            served = post_ids(truncation_server, prompt)
            assert served == reference_tokens(reference, truncated, prompt), f"prompt {prompt[:6]}..."
            differs |= served != reference_tokens(reference, substituted, prompt)
        assert differs, "pick prompts whose truncated and substituted decodings differ"
        assert "coverage=truncation" in truncation_server.log()


# ---------------------------------------------------------------------- batched serving, traces, faults
XSHARE = {"policy": "xshare", "k0": 1, "budget": 2}


@pytest.fixture(scope="module")
def xshare_server(tmp_path_factory):
    """An xshare server (``POLICIES["xshare"]``) that records every decode forward and has the fault
    switch: ``TestTracedServer``'s, and ``TestPolicies``' for xshare (recording changes no answer)."""
    folder = tmp_path_factory.mktemp("xshare-traced")
    fault = folder / "fault"
    config = json.dumps({"test_fault_file": str(fault)})
    args = [
        *COMMON,
        *pruner_flags(XSHARE),
        "--moe-pruner-config",
        config,
        "--moe-pruner-trace-dir",
        str(folder / "traces"),
        "--moe-pruner-trace-every",
        "1",
    ]
    server = LiveServer(args, folder / "server.log").start()
    yield server, folder / "traces", fault
    server.stop()


def _layer_activated(logits: torch.Tensor, keep: torch.Tensor) -> float:
    """Experts the server's CPU path reads for one layer call: routing inside ``keep``; a row with
    fewer than top-k kept experts gets weight-0 fillers in its empty slots (the first free kept
    experts, then the first free pruned ones), which the backend reads, so they count."""
    ids, _ = route_within(logits, keep, top_k=TOP_K, coverage="substitution", renormalize=True)
    empty = ids < 0
    ids = torch.where(empty, filler_ids(ids, keep, empty), ids)
    return float(activated_experts(ids, keep.numel()))


class TestTracedServer:
    """One xshare server recording every decode forward, with the test-only fault switch."""

    def test_concurrent_requests_replay_to_the_served_masks(self, xshare_server) -> None:
        _check_concurrent_replay(xshare_server)

    def test_injected_fault_falls_back_to_unpruned_routing(self, xshare_server, prompts, reference) -> None:
        _check_fault_fallback(xshare_server, prompts, reference)


def _check_concurrent_replay(xshare_server) -> None:
    """16 concurrent requests: every recorded layer call's keep mask equals the offline policy on the
    recorded router logits; batches really formed and were pruned below the unpruned union; the
    gauges on /metrics equal the last recorded forward, recomputed offline."""
    server, traces, _ = xshare_server
    texts = [text[:80] for domain in ("code", "math", "prose") for text in heldout_texts(tiny_model_dir(), domain)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda text: server.generate(text, 16), texts[:16]))
    assert all(answer["meta_info"]["completion_tokens"] == 16 for answer in answers)
    # then one request alone: the last forward has one row, which keeps k0 + budget = 3 of 4 picks,
    # so the gauges below cover the filled slot (the concurrent forwards alone end on 1 row only by
    # chance)
    assert server.generate(texts[0], 4)["meta_info"]["completion_tokens"] == 4
    assert server.wait_for_log("moe-pruner: ", 5)
    files = traces_after(traces, set())
    calls = [call for path in files for call in load_trace(path).calls]
    pruned = [call for call in calls if call.keep is not None]
    assert pruned, "no pruned layer call was recorded"
    cfg = PrunerConfig(**XSHARE)
    for call in pruned:
        want = select_experts_mask(call.logits.float(), cfg, top_k=TOP_K)
        assert torch.equal(call.keep, want), f"step {call.step} layer {call.layer}"
    batched = [call for call in pruned if call.num_rows >= 8]
    assert batched, f"the scheduler never decoded 8+ requests together (rows: {sorted({c.num_rows for c in pruned})})"
    for call in batched:
        natural = torch.unique(call.logits.float().topk(TOP_K, dim=-1).indices).numel()
        warmup = torch.unique(call.logits.float().argmax(dim=-1)).numel()
        assert int(call.keep.sum()) <= warmup + XSHARE["budget"]
        assert _layer_activated(call.logits.float(), call.keep) < natural
    # gauges: reported after every pruned forward, so they describe the last one
    last_step = max(call.step for call in pruned)
    metrics = server.metrics()
    last = [c for c in pruned if c.step == last_step]
    assert all(c.num_rows == 1 for c in last), f"the last recorded forward has {last[0].num_rows} rows"
    for call in last:
        labels = (("layer", str(call.layer)), ("tp_rank", "0"))
        assert metrics["moe_pruner:kept_experts"][labels] == int(call.keep.sum())
        assert metrics["moe_pruner:activated_experts"][labels] == _layer_activated(call.logits.float(), call.keep)


def _check_fault_fallback(xshare_server, prompts, reference) -> None:
    """While the test switch's file exists, selection raises inside the server: those requests are
    answered with unpruned routing (the transformers reference without a policy), the fallbacks are
    counted on /metrics and logged, and once the file is gone pruning resumes."""
    server, _, fault = xshare_server
    prompt = prompts[1]
    pruned = reference_tokens(reference, PrunerConfig(**XSHARE), prompt)
    unpruned = reference_tokens(reference, None, prompt)
    assert pruned != unpruned, "pick a prompt whose pruned and unpruned decodings differ"
    assert post_ids(server, prompt) == pruned
    fault.write_text("on")
    try:
        assert post_ids(server, prompt) == unpruned
        fallbacks = server.metrics()["moe_pruner:selection_fallbacks_total"]
        assert sum(fallbacks.values()) >= 4 * (NEW_TOKENS - 1)  # every layer of every decode forward
        assert server.wait_for_log("selection failed in layer 0, routing left unpruned")
    finally:
        fault.unlink()
    assert post_ids(server, prompt) == pruned
    assert server.alive()


def test_ab_compare_against_live_cpu_servers(tmp_path, monkeypatch) -> None:
    """The A/B tool launches two real CPU servers (pruner off, xshare), checks the plugin's proof line
    in each log, runs SGLang's benchmark and few-shot GSM8K clients, and writes its record, summary
    and plots.  The smallest traffic its checks need: a few requests per client, each arm batching."""
    for name, value in NO_CRASH_DIAGNOSTICS.items():  # the servers inherit them: no 5 s sleep at each stop
        monkeypatch.setenv(name, value)
    out = tmp_path / "ab"
    argv = [
        "--model-path", str(tiny_model_dir()), "--launch-command", f"{sys.executable} -m xshare_sglang.testing.cpu_server",
        "--candidate", json.dumps({"name": "xshare", **XSHARE, "log_interval": 1}), "--repeats", "1", "--concurrency", "2",
        "--dataset", "random-ids", "--random-input-len", "16", "--random-output-len", "8", "--num-prompts", "4",
        "--gsm8k-questions", "4", "--gsm8k-shots", "1", "--gsm8k-parallel", "2", "--gsm8k-max-new-tokens", "8",
        "--startup-timeout", "300", "--run-timeout", "300", "--stop-timeout", "30", "--output-dir", str(out),
    ]  # fmt: skip
    from xshare_sglang.serving.ab.ab_cli import main
    from xshare_sglang.serving.ab.ab_report import read_runs

    assert main(argv) == 0
    records = read_runs(out)
    started = [r["arm"] for r in records if r["record"] == "session" and r["status"] == "started"]
    assert started == ["baseline", "xshare"]
    assert {
        r["arm"]: r["plugin_confirmed"] for r in records if r["record"] == "session" and r["status"] == "started"
    } == {
        "baseline": "log",
        "xshare": "log",
    }
    serving = {r["arm"]: r for r in records if r["record"] == "serving" and r["status"] == "ok"}
    assert set(serving) == {"baseline", "xshare"}
    assert all(r["metrics"]["output_throughput"] > 0 for r in serving.values())
    assert not serving["baseline"].get("pruner_metrics")
    assert 0 < serving["xshare"]["pruner_metrics"]["kept_experts"] < 32
    accuracy = [r for r in records if r["record"] == "accuracy"]
    assert [r["status"] for r in accuracy] == ["ok", "ok"]
    summary = (out / "summary.md").read_text()
    assert "xshare" in summary and "baseline" in summary
    assert (out / "throughput_random-ids.png").stat().st_size > 0


def test_tied_checkpoint_is_reported_at_start(tmp_path) -> None:
    """The tiny model saved the way it was trained (tied embeddings, no ``lm_head.weight``): SGLang's
    Qwen3-MoE class does not tie, and the plugin says so at start-up."""
    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied-tiny-moe"
    tied.mkdir()
    for path in tiny_model_dir().iterdir():
        if path.suffix in (".json",) and path.name != "config.json":
            (tied / path.name).write_bytes(path.read_bytes())
    config = json.loads((tiny_model_dir() / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    weights = load_file(tiny_model_dir() / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tied / "model.safetensors", metadata={"format": "pt"})
    server = LiveServer(["--model-path", str(tied), *pruner_flags(XSHARE)], tmp_path / "server.log").start()
    try:
        assert "the checkpoint asks for tied embeddings" in server.log()
        assert "Qwen3MoeForCausalLM keeps a separate lm_head" in server.log()
    finally:
        server.stop()


def test_tiny_draft_model_matches_transformers(tmp_path) -> None:
    """The shipped tiny draft (dense Qwen3, tied embeddings, which SGLang's Qwen3 class does tie) gives
    the same greedy tokens under SGLang as under transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft_dir = tiny_model_dir().parent / "tiny_draft"
    model = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(draft_dir)
    prompts = [tokenizer(heldout_texts(tiny_model_dir(), d)[0])["input_ids"][:24] for d in ("code", "prose")]
    server = LiveServer(["--model-path", str(draft_dir), "--dtype", "float32"], tmp_path / "server.log").start()
    try:
        for prompt in prompts:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([prompt]),
                    max_new_tokens=NEW_TOKENS,
                    min_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            assert post_ids(server, prompt) == out[0, len(prompt) :].tolist()
    finally:
        server.stop()


# ---------------------------------------------------------------------- calibrated budgets, coverage
CALIBRATED = {"policy": "moe-spec", "max_experts": 3, "ranking": "coverage", "budget_allocation": "calibrated"}


@pytest.fixture(scope="class")
def calibrated_server(tmp_path_factory):
    """A server reading a calibration file whose curves give layer 0 one expert and share the rest of
    the 4 x 3 budget over layers 1-3 (a saturated curve against three linear ones)."""
    folder = tmp_path_factory.mktemp("server-calibrated")
    linear = [b / 32 for b in range(33)]
    saturated = [0.0, 0.99, *(min(1.0, 0.99 + 0.005 * b) for b in range(1, 32))]
    calibration = folder / "calibration.json"
    doc = {
        "format": "xshare-sglang.static-ranking",
        "version": 1,
        "counts": [[1.0] * 32] * 4,
        "budget_curves": [saturated, linear, linear, linear],
    }
    calibration.write_text(json.dumps(doc))
    fields = {**CALIBRATED, "static_ranking_path": str(calibration)}
    server = LiveServer([*COMMON, *pruner_flags(fields)], folder / "server.log").start()
    yield server, PrunerConfig(**fields)
    server.stop()


class TestCalibratedCoverage:
    def test_server_keeps_each_layers_budget_and_matches_transformers(
        self, calibrated_server, prompts, reference
    ) -> None:
        """``--moe-pruner-ranking coverage --moe-pruner-budget-allocation calibrated``: the server keeps
        the per-layer budgets the file gives (1, 4, 4, 3 experts), and one request at a time answers
        transformers' greedy tokens under the same settings."""
        server, cfg = calibrated_server
        assert server.policies() == ["moe-spec"]
        for prompt in prompts:
            assert post_ids(server, prompt) == reference_tokens(reference, cfg, prompt), f"prompt {prompt[:6]}..."
        kept = {dict(labels)["layer"]: value for labels, value in server.metrics()["moe_pruner:kept_experts"].items()}
        assert kept == {"0": 1, "1": 4, "2": 4, "3": 3}
