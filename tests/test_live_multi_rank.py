"""The plugin live in servers of several ranks: tensor parallelism, expert parallelism, two nodes.

Every server is SGLang's own launcher on the CPU engine (``xshare_sglang.testing.cpu_server``), its
ranks real processes that talk over gloo, on the shipped tiny Qwen3-MoE model (4 attention heads, 2
KV heads, 32 experts of top-4: TP 2 and EP 2 divide it).  What is checked:

* keep-all (``k0`` = top-k, budget 0) at TP 2 answers with the unpruned TP 2 server's greedy tokens
  and logprobs, bit for bit, one request at a time and all prompts batched in one request;
* every pruned layer call's keep mask is the same on every rank: each rank records its own masks
  (``--moe-pruner-trace-dir``, every decode forward), and the files are compared after the traffic,
  at TP 2 / EP 2 with ``xshare-ep`` and with ``moe-spec``, and at TP 2 over two nodes;
* ``xshare-ep`` keeps what its rounds over the two ranks' experts keep: the recorded masks equal the
  torch reference run on the recorded logits with experts 0-15 on rank 0 and 16-31 on rank 1 (plus
  any expert SGLang's top-k picked on a tie, which the runtime joins by design), and show the
  rounds' balance and their stop at ``--moe-pruner-rank-budget`` x ranks;
* ``/metrics`` carries each rank's series (``tp_rank`` label) and each rank logs its proof-of-life
  line naming its rank; on two nodes each node's ``/metrics`` carries its own rank;
* a layout that contradicts the settings ends the launch with exit code 2 and one line;
* a rank killed under traffic stops the whole server within a bounded time, with SGLang's error in the
  log, and no request in flight is answered.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests
import torch

from tests.live_server import LAUNCH, LiveServer, traces_after
from xshare_sglang.config import PrunerConfig
from xshare_sglang.policies.api import select_experts_mask
from xshare_sglang.replay.trace import LayerCall, load_trace
from xshare_sglang.serving.ab.ab_server import launch_port
from xshare_sglang.tiny.tiny_demo import heldout_texts
from xshare_sglang.tiny.tiny_model import tiny_model_dir

pytestmark = [pytest.mark.live_server, pytest.mark.multi_rank]

NUM_EXPERTS = 32
TOP_K = 4
NEW_TOKENS = 12
ALONE = 3
KEEP_ALL = ["--moe-pruner", "xshare", "--moe-pruner-k0", str(TOP_K), "--moe-pruner-budget", "0"]
XSHARE = ["--moe-pruner", "xshare", "--moe-pruner-k0", "1", "--moe-pruner-budget", "4"]
RANK_BUDGET = 3
XSHARE_EP = ["--moe-pruner", "xshare-ep", "--moe-pruner-k0", "1", "--moe-pruner-rank-budget", str(RANK_BUDGET)]
MOE_SPEC = ["--moe-pruner", "moe-spec", "--moe-pruner-max-experts", "6"]
TP2 = ["--tp-size", "2"]
EP2 = ["--tp-size", "2", "--ep-size", "2"]
#: A rank killed mid-traffic: SGLang's survivors fail their next collective and the launcher tears
#: the server down (about 6 s on 2 cores); past this the test calls it a hang.
STOP_AFTER_KILL_S = 60.0


def _prompts(count: int) -> list[str]:
    """Held-out openings, code, math and prose in turn, cut to different lengths so that requests
    finish at different steps and the batch shrinks as they do."""
    texts = {domain: heldout_texts(tiny_model_dir(), domain) for domain in ("code", "math", "prose")}
    chosen = [texts[domain][i] for i in range(count) for domain in texts][:count]
    return [text[: 40 + 17 * i] for i, text in enumerate(chosen)]


def _traffic(server: LiveServer, prompts: list[str]) -> None:
    """The prompts as concurrent single requests (SGLang batches them as they arrive)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        for answers in pool.map(lambda text: server.greedy_logprobs(text, NEW_TOKENS), prompts):
            assert len(answers[0][0]) == NEW_TOKENS


def _rank_of(path: Path) -> int:
    return int(path.name.split("-")[1].removeprefix("r"))


def _masks_by_rank(folder: Path, ranks: int) -> dict[int, dict[tuple[int, int], LayerCall]]:
    """Rank -> {(forward step, layer): recorded call} from the folder's trace files, once every rank
    has written its own (each rank's recorder writes when its forwards stop, a few seconds apart)."""
    paths = traces_after(folder, set())
    deadline = time.monotonic() + 60.0
    while {_rank_of(path) for path in paths} != set(range(ranks)) and time.monotonic() < deadline:
        paths = traces_after(folder, set())
    by_rank: dict[int, dict[tuple[int, int], LayerCall]] = {}
    for path in paths:
        calls = by_rank.setdefault(_rank_of(path), {})
        for call in load_trace(path).calls:
            calls[(call.step, call.layer)] = call
    return by_rank


def _assert_ranks_agree(by_rank: dict[int, dict[tuple[int, int], LayerCall]], ranks: int) -> list[LayerCall]:
    """Every rank recorded the same forwards, and every pruned call's mask is equal on every rank;
    returns rank 0's pruned calls."""
    assert sorted(by_rank) == list(range(ranks)), f"trace files of ranks {sorted(by_rank)}, expected {ranks}"
    first = by_rank[0]
    for rank, calls in by_rank.items():
        assert calls.keys() == first.keys(), f"rank {rank} recorded other forwards than rank 0"
        for key, call in calls.items():
            assert torch.equal(call.logits, first[key].logits), f"rank {rank} routed other logits at {key}"
            if first[key].keep is None:
                assert call.keep is None, f"rank {rank} pruned {key}, rank 0 did not"
            else:
                assert call.keep is not None and torch.equal(call.keep, first[key].keep), (
                    f"forward {key[0]}, layer {key[1]}: rank {rank} kept "
                    f"{call.keep.nonzero().flatten().tolist() if call.keep is not None else None}, rank 0 kept "
                    f"{first[key].keep.nonzero().flatten().tolist()}"
                )
    pruned = [call for call in first.values() if call.keep is not None]
    assert len(pruned) >= 8 * 4, f"only {len(pruned)} pruned layer calls recorded"
    return pruned


def _ranks_in_log(server: LiveServer) -> set[str]:
    return {line.split(" rank=", 1)[1].split()[0] for line in server.log().splitlines() if "moe-pruner active:" in line}


def _metric_ranks(server: LiveServer) -> set[str]:
    samples = server.metrics().get("moe_pruner:kept_experts", {})
    return {dict(labels)["tp_rank"] for labels in samples}


def test_keep_all_at_tp2_answers_as_the_unpruned_tp2_server(tmp_path) -> None:
    prompts = _prompts(6)
    answers = {}
    for name, flags in (("unpruned", []), ("keep_all", KEEP_ALL)):
        server = LiveServer([*TP2, "--enable-metrics", *flags], tmp_path / f"{name}.log").start()
        try:
            alone = [server.greedy_logprobs(text, NEW_TOKENS)[0] for text in prompts[:ALONE]]
            answers[name] = (alone, server.greedy_logprobs(prompts, NEW_TOKENS))
            if flags:
                assert sorted(server.policies()) == ["xshare", "xshare"], server.policies()
                assert _ranks_in_log(server) == {"tp0/2,ep0/1", "tp1/2,ep0/1"}
                assert _metric_ranks(server) == {"0", "1"}
        finally:
            server.stop()
    (plain_alone, plain_batch), (kept_alone, kept_batch) = answers["unpruned"], answers["keep_all"]
    assert len(plain_batch) == len(prompts)
    for i, (plain, kept) in enumerate(zip(plain_alone, kept_alone, strict=True)):
        assert kept == plain, f"prompt {i} alone: keep-all at TP 2 answered otherwise than unpruned TP 2"
    for i, (plain, kept) in enumerate(zip(plain_batch, kept_batch, strict=True)):
        assert kept == plain, f"prompt {i} batched: keep-all at TP 2 answered otherwise than unpruned TP 2"


def _ep_server(flags: list[str], tmp_path: Path, name: str) -> tuple[LiveServer, Path]:
    traces = tmp_path / f"{name}-traces"
    args = [*EP2, "--enable-metrics", "--moe-pruner-log-interval", "5", *flags]
    args += ["--moe-pruner-trace-dir", str(traces), "--moe-pruner-trace-every", "1"]
    return LiveServer(args, tmp_path / f"{name}.log").start(), traces


def _warm_per_rank(call: LayerCall, owner: torch.Tensor, ranks: int) -> torch.Tensor:
    """Experts of each rank in the warm-up set (every row's top-1), shape [ranks]."""
    warm = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
    warm[call.logits.float().argmax(dim=-1)] = True
    return torch.bincount(owner[warm], minlength=ranks)


def _tie_joined(call: LayerCall, kept: torch.Tensor, extra: torch.Tensor) -> bool:
    """Every expert in ``extra`` ties, in some row, with a kept expert of that row's top-k: SGLang's
    top-k broke the tie the other way, and the runtime keeps the expert it routed to."""
    logits = call.logits.float()
    for expert in extra.nonzero().flatten().tolist():
        ties = (logits == logits[:, expert : expert + 1]) & kept[None, :]
        if not bool(ties.any()):
            return False
    return True


def test_xshare_ep_at_tp2_ep2_ranks_agree_within_the_rank_budget(tmp_path) -> None:
    server, traces = _ep_server(XSHARE_EP, tmp_path, "xshare_ep")
    try:
        assert _ranks_in_log(server) == {"tp0/2,ep0/2", "tp1/2,ep1/2"}
        _traffic(server, _prompts(6))
        pruned = _assert_ranks_agree(_masks_by_rank(traces, 2), ranks=2)
        assert _metric_ranks(server) == {"0", "1"}
        samples = server.metrics()["moe_pruner:layer_calls_total"]
        assert {dict(labels)["tp_rank"] for labels, value in samples.items() if value > 0} == {"0", "1"}
    finally:
        server.stop()
    cfg = PrunerConfig(policy="xshare-ep", k0=1, rank_budget=RANK_BUDGET)
    ranks = 2
    owner = torch.arange(NUM_EXPERTS) // (NUM_EXPERTS // ranks)
    exact = 0
    for call in pruned:
        reference = select_experts_mask(call.logits, cfg, top_k=TOP_K, expert_to_rank=owner)
        assert not bool((reference & ~call.keep).any()), f"layer {call.layer}: the server dropped a reference expert"
        extra = call.keep & ~reference
        if bool(extra.any()):
            assert _tie_joined(call, reference, extra), f"layer {call.layer}: kept {extra.nonzero()} beyond the rounds"
            continue
        exact += 1
        # the rounds, read from the mask: every rank adds one expert per round while it has activated
        # experts left; the rounds stop at the first that brings the total to rank_budget x ranks
        activated = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
        activated[call.logits.float().topk(TOP_K, dim=-1).indices.flatten()] = True
        warm = _warm_per_rank(call, owner, ranks)
        kept = torch.bincount(owner[call.keep], minlength=ranks)
        candidates = torch.bincount(owner[activated], minlength=ranks) - warm
        added = kept - warm
        rounds = int(added.max())
        assert torch.equal(added, torch.minimum(candidates, torch.tensor(rounds))), (
            f"layer {call.layer}: unbalanced rounds, added {added.tolist()} of {candidates.tolist()} per rank"
        )
        target = RANK_BUDGET * ranks
        before_last = int(warm.sum() + torch.minimum(candidates, torch.tensor(max(rounds - 1, 0))).sum())
        assert rounds == 0 or before_last < target, f"layer {call.layer}: a round past the rank budget"
        assert int(kept.sum()) >= target or torch.equal(added, candidates), f"layer {call.layer}: stopped early"
    assert exact >= len(pruned) // 2, f"only {exact} of {len(pruned)} calls free of ties"


@pytest.fixture(scope="module")
def moe_spec_server(tmp_path_factory):
    """A TP 2 / EP 2 server under ``moe-spec``: its ranks' masks are compared first, then one of its
    ranks is killed (:func:`test_a_killed_rank_stops_the_server`), which saves a start-up."""
    server, traces = _ep_server(MOE_SPEC, tmp_path_factory.mktemp("moe_spec"), "moe_spec")
    try:
        yield server, traces
    finally:
        server.stop()


def test_moe_spec_at_tp2_ep2_ranks_agree(moe_spec_server) -> None:
    server, traces = moe_spec_server
    _traffic(server, _prompts(6))
    pruned = _assert_ranks_agree(_masks_by_rank(traces, 2), ranks=2)
    assert max(int(call.keep.sum()) for call in pruned) <= 6 + TOP_K  # the budget, plus tie joins at most


def _scheduler_of_rank(server: LiveServer, rank: int) -> psutil.Process:
    children = psutil.Process(server.process.process.pid).children(recursive=True)
    matches = [p for p in children if f"scheduler_TP{rank}" in " ".join(p.cmdline() or [p.name()])]
    assert len(matches) == 1, f"scheduler of TP rank {rank}: {[p.cmdline() for p in children]}"
    return matches[0]


def test_a_killed_rank_stops_the_server(moe_spec_server) -> None:
    server, _ = moe_spec_server
    assert server.alive()
    victim = _scheduler_of_rank(server, 1)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
        body = {"text": "def add(a, b):", "sampling_params": params}
        futures = [
            pool.submit(requests.post, server.url + "/generate", json=body, timeout=STOP_AFTER_KILL_S * 2)
            for _ in range(4)
        ]
        time.sleep(2.0)
        assert not any(f.done() for f in futures), "the traffic ended before the kill"
        killed_at = time.monotonic()
        os.kill(victim.pid, signal.SIGKILL)
        while server.alive() and time.monotonic() - killed_at < STOP_AFTER_KILL_S:
            time.sleep(0.5)
        stopped_after = time.monotonic() - killed_at
        assert not server.alive(), f"the server still runs {STOP_AFTER_KILL_S:g} s after a rank was killed"
        for future in futures:
            try:
                response = future.result(timeout=30)
            except requests.RequestException:
                continue  # the connection closed under the request: nothing was served
            assert response.status_code != 200, "a request was answered after a rank died"
    log = server.log()  # the survivor's failed collective, then SGLang's launcher tearing down
    assert "gloo" in log and "child failed" in log, log[-3000:]
    assert stopped_after < STOP_AFTER_KILL_S


def test_two_nodes_on_one_machine_agree(tmp_path) -> None:
    traces = tmp_path / "traces"
    dist_port = launch_port()
    common = [*TP2, "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{dist_port}", "--enable-metrics", *XSHARE]
    common += ["--moe-pruner-trace-dir", str(traces), "--moe-pruner-trace-every", "1"]
    # node 1 answers /health on its own port once its rank is up (SGLang's dummy health server)
    nodes = [LiveServer([*common, "--node-rank", str(rank)], tmp_path / f"node{rank}.log") for rank in (1, 0)]
    node1, node0 = nodes
    node1.process.start()
    try:
        node0.start()
        node1.wait_ready()
        _traffic(node0, _prompts(6))
        _assert_ranks_agree(_masks_by_rank(traces, 2), ranks=2)
        assert _ranks_in_log(node0) == {"tp0/2,ep0/1"} and _ranks_in_log(node1) == {"tp1/2,ep0/1"}
        assert _metric_ranks(node0) == {"0"} and _metric_ranks(node1) == {"1"}
    finally:
        node0.stop()
        node1.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--moe-pruner", "xshare-ep"], "--moe-pruner xshare-ep balances the kept experts over expert-parallel"),
        ([*EP2, *XSHARE_EP[:2], "--moe-pruner-rank-budget", "17"], "--moe-pruner-rank-budget 17 is more than the 16"),
    ],
    ids=["xshare-ep-without-ep", "rank-budget-over-a-rank"],
)
def test_a_layout_the_settings_contradict_ends_the_launch(flags, message) -> None:
    result = subprocess.run([*LAUNCH, *flags], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
