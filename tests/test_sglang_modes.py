"""SGLang serving modes: each one the pruner accepts is exact, each one it cannot honour is refused.

One test (or group) per mode, marked ``sglang_modes``; each runs SGLang 0.5.23's own code on CPU and
failed before the change it covers.  The table in docs/sglang-modes.md points at these tests.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.sglang_helpers import apply_echo_hooks, apply_routing_hooks, runner_attributes, sglang_select_experts
from tests.test_sglang_cli import parse_in_fresh_process
from xshare_sglang import PrunerConfig, route_within, select_experts_mask
from xshare_sglang.policies.rewrite import RETAINED_ONE, selection_metrics
from xshare_sglang.sglang_plugin.metrics import MetricsReporter
from xshare_sglang.sglang_plugin.model_layers import make_layer_state, make_runtime
from xshare_sglang.sglang_plugin.runtime import ForwardScope, set_runtime
from xshare_sglang.sglang_plugin.settings import PluginSettings

pytestmark = [pytest.mark.sglang, pytest.mark.sglang_modes]

NUM_TOKENS, NUM_VALID, NUM_EXPERTS, TOP_K = 12, 10, 64, 8


def _logits(seed: int, num_tokens: int = NUM_TOKENS, num_experts: int = NUM_EXPERTS) -> torch.Tensor:
    return torch.randn(num_tokens, num_experts, generator=torch.Generator().manual_seed(seed)) * 1.5


def _softmax_config(layer_id: int = 0, **overrides):
    from sglang.srt.layers.moe.topk import TopKConfig

    fields = dict(top_k=TOP_K, renormalize=True, torch_native=True, scoring_func="softmax", layer_id=layer_id)
    fields.update(overrides)
    return TopKConfig(**fields)


def _publish(configs, pruner: PrunerConfig, *, num_experts: int = NUM_EXPERTS, phase: str = "decode", **plugin):
    states = {
        id(config): make_layer_state(config, layer_id=config.layer_id, row=row, num_experts=num_experts, device="cpu")
        for row, config in enumerate(configs)
    }
    runtime = make_runtime(PluginSettings(pruner=pruner, **plugin), states, "cpu")
    runtime.num_valid_buffer.fill_(NUM_VALID)
    runtime.enter(
        ForwardScope(phase=phase, num_valid=runtime.num_valid_buffer, cfg=runtime.config_for(phase)),
    )
    set_runtime(runtime)
    return runtime


def _as_sets(ids, weights, rows):
    return [{int(e): float(w) for e, w in zip(ids[t], weights[t], strict=True) if int(e) >= 0} for t in range(rows)]


def _assert_same_routing(ids, weights, want_ids, want_weights, rows) -> None:
    """Per token: the same experts, with the same weights (order inside a row aside)."""
    pairs = zip(_as_sets(ids, weights, rows), _as_sets(want_ids, want_weights, rows), strict=True)
    for t, (mine, ref) in enumerate(pairs):
        assert mine.keys() == ref.keys(), t
        for e in mine:
            assert mine[e] == pytest.approx(ref[e], abs=1e-5), (t, e)


@pytest.fixture(autouse=True)
def _hooks():
    apply_routing_hooks()
    yield
    set_runtime(None)


# ---------------------------------------------------------------------------------- coverage
@pytest.mark.parametrize("policy", [PrunerConfig(policy="xshare", k0=1, budget=3), PrunerConfig(policy="oea", k0=2)])
def test_truncation_coverage_keeps_natural_picks(policy) -> None:
    """``--moe-pruner-coverage truncation``: each token keeps its own top-k picks and weights, and only
    the picks outside the keep mask are dropped (no substitute expert, no renormalization) - exactly
    the reference's ``route_within(..., coverage="truncation")``, not substitution."""
    import dataclasses

    pruner = dataclasses.replace(policy, coverage="truncation")
    config = _softmax_config()
    _publish([config], pruner)
    logits = _logits(3)
    ids, weights = sglang_select_experts(config, logits)
    keep = select_experts_mask(logits, pruner, top_k=TOP_K, num_valid_tokens=NUM_VALID)
    assert keep.sum() < NUM_EXPERTS
    want_ids, want_weights = route_within(logits, keep, top_k=TOP_K, coverage="truncation", num_valid_tokens=NUM_VALID)
    _assert_same_routing(ids, weights, want_ids, want_weights, NUM_TOKENS)
    # truncation really differs from substitution here: some token lost a slot instead of a swap
    sub_ids, _ = route_within(logits, keep, top_k=TOP_K, coverage="substitution", num_valid_tokens=NUM_VALID)
    assert (ids[:NUM_VALID] < 0).sum() > (sub_ids[:NUM_VALID] < 0).sum()


# ---------------------------------------------------------------------------------- metrics
class _PendingEvent:
    """Stands in for ``torch.cuda.Event``: the copy completes when the test says so."""

    done = False

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return _PendingEvent.done

    def synchronize(self) -> None:
        raise AssertionError("the forward path waited for the device")


class _DeviceReads(torch.overrides.TorchFunctionMode):
    """Records every op that reads ``watched`` back to the host (what would block on a GPU)."""

    BLOCKING = frozenset({"to", "cpu", "item", "tolist", "numpy", "__bool__", "__float__", "__int__", "clone"})

    def __init__(self, watched: torch.Tensor) -> None:
        super().__init__()
        self.watched, self.reads, self.copies = watched, [], []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        touches = any(a is self.watched for a in args)
        if touches and name in self.BLOCKING:
            self.reads.append(name)
        if name == "copy_" and len(args) > 1 and args[1] is self.watched:
            self.copies.append(bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
        return func(*args, **kwargs)


def test_metrics_never_wait_for_the_device(monkeypatch, caplog) -> None:
    """The periodic metrics report takes a non-blocking copy into a host buffer and reads it on a
    later forward once the copy's event completed: no device-to-host read on the forward path, and
    the layer calls made while the copy is in flight are kept for the next report."""
    config = _softmax_config()
    runtime = _publish([config], PrunerConfig(policy="oea", k0=1))
    runtime.settings = PluginSettings(pruner=runtime.settings.pruner, log_interval=2)
    reporter = MetricsReporter(runtime, prometheus=False)
    reporter.asynchronous = True  # as with a CUDA device: copies complete later, signalled by an event
    monkeypatch.setattr(torch.cuda, "Event", _PendingEvent)
    _PendingEvent.done = False
    row = runtime.metrics_of("decode")[0]

    def forward(seed):
        sglang_select_experts(config, _logits(seed))
        with _DeviceReads(runtime.metrics) as watch:
            reporter.on_pruned_forward()
        return watch

    with caplog.at_level(logging.INFO, logger="xshare_sglang.sglang_plugin.metrics"):
        assert forward(0).reads == []
        watch = forward(1)  # the interval: snapshot taken, nothing read yet
        assert watch.reads == [] and watch.copies == [True]
        assert row.tolist() == [0.0, 0.0, 0.0, 0.0]  # zeroed in place after the copy
        assert not [r for r in caplog.records if "pruned forwards" in r.getMessage()]
        forward(2)  # copy still in flight: not read, and this call is kept in the accumulators
        assert row[3] == 1
        _PendingEvent.done = True
        watch = forward(3)  # copy complete: published; and this forward is the next interval
        assert watch.reads == [] and watch.copies == [True]
    lines = [r.getMessage() for r in caplog.records if "pruned forwards" in r.getMessage()]
    # the calls of forwards 2 and 3, made while the first copy was in flight, are in the second report
    assert len(lines) == 2 and all("2 layer calls" in line for line in lines)
    assert row[3] == 0


@pytest.mark.parametrize("policy", ["oea", "xshare"])
def test_metrics_every_n_adds_the_sampled_forwards_alone(policy) -> None:
    """``metrics_every=3``: the gate opens for pruned forwards 0, 3 and 6 and is closed for the
    others, and the layer's row then holds exactly the sum of what those three forwards add when every
    forward adds its metrics (same logits, same calls), the activated experts included; the report's
    means are over the sampled calls."""
    config = _softmax_config()
    pruner = PrunerConfig(policy=policy, k0=1, budget=3)
    every = _publish([config], pruner)
    assert every.metrics_gate is None
    reporter = MetricsReporter(every, prometheus=False)
    added = []
    for forward in range(7):
        before = every.metrics_of("decode")[0].clone()
        every.sample_metrics()
        sglang_select_experts(config, _logits(forward))
        reporter.on_pruned_forward()
        added.append(every.metrics_of("decode")[0] - before)
    assert all(int(a[3]) == 1 and int(a[0]) > 0 for a in added)
    sampled = _publish([config], pruner, metrics_every=3)
    reporter = MetricsReporter(sampled, prometheus=False)
    gates = []
    for forward in range(7):
        sampled.sample_metrics()
        gates.append(int(sampled.metrics_gate[0]))
        sglang_select_experts(config, _logits(forward))
        reporter.on_pruned_forward()
        want = sum(added[f] for f in range(forward + 1) if f % 3 == 0)
        assert sampled.metrics_of("decode")[0].tolist() == want.tolist(), forward
    assert gates == [1, 0, 0, 1, 0, 0, 1]
    summary = reporter.report()
    assert summary["layer_calls"] == 3
    assert summary["kept_experts"] == pytest.approx(float(sum(added[f][1] for f in (0, 3, 6))) / 3)


def test_activated_experts_added_outside_the_kernels_follow_the_gate() -> None:
    """Where SGLang routes the call itself (the masked path, routing inside the MoE kernel) the plugin
    adds the activated experts with torch: behind the same gate (0 while it is closed), and not at
    all when nothing reads the metrics."""
    config = _softmax_config()
    runtime = _publish([config], PrunerConfig(policy="oea", k0=1), metrics_every=2)
    layer = next(iter(runtime.layers.values()))
    for gate, activated, want in ((1, 5, 5), (0, 5, 5), (1, 7, 12)):
        runtime.metrics_gate.fill_(gate)
        runtime.add_activated(layer, torch.tensor(activated, dtype=torch.int64))
        assert int(runtime.metrics_of("decode")[0, 0]) == want
    quiet = _publish([config], PrunerConfig(policy="oea", k0=1), log_interval=0)
    quiet.add_activated(next(iter(quiet.layers.values())), torch.tensor(5, dtype=torch.int64))
    assert not quiet.metrics.any()


def test_the_guard_times_calls_with_the_gate_closed_and_puts_it_back() -> None:
    """``unsampled``: the calls inside see the gate closed (what the start-up guard times with
    sampled metrics); after, the gate holds what the sampling had set, open or closed.  Without a gate
    it does nothing."""
    config = _softmax_config()
    runtime = _publish([config], PrunerConfig(policy="oea", k0=1), metrics_every=2)
    for forwards, after in ((0, 1), (1, 0)):
        runtime.pruned_forwards = forwards
        runtime.sample_metrics()
        with runtime.unsampled():
            assert int(runtime.metrics_gate[0]) == 0
            sglang_select_experts(config, _logits(3))
        assert int(runtime.metrics_gate[0]) == after
    assert not runtime.metrics.any()  # the calls inside added nothing
    plain = _publish([config], PrunerConfig(policy="oea", k0=1))
    with plain.unsampled():
        sglang_select_experts(config, _logits(3))
    assert int(plain.metrics_of("decode")[0, 3]) == 1


def test_no_metrics_are_added_when_nothing_reads_them() -> None:
    """``log_interval`` 0 turns the report off: the layer calls then pass no metrics row (their kernels
    compile without it) and the row stays at 0, while the routing is unchanged."""
    config = _softmax_config()
    pruner = PrunerConfig(policy="xshare", k0=1, budget=3)
    counted = _publish([config], pruner)
    want = sglang_select_experts(config, _logits(5))
    assert int(counted.metrics_of("decode")[0, 3]) == 1
    quiet = _publish([config], pruner, log_interval=0)
    got = sglang_select_experts(config, _logits(5))
    assert quiet.metrics_row(next(iter(quiet.layers.values()))) is None
    assert not quiet.metrics.any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
def test_metrics_report_runs_without_host_sync_on_cuda() -> None:
    """On a GPU: CUDA's sync debug mode raises on any synchronizing call during the forward path."""
    config = _softmax_config()
    runtime = _publish([config], PrunerConfig(policy="oea", k0=1))
    runtime.metrics, runtime.request_metrics = runtime.metrics.cuda(), runtime.request_metrics.cuda()
    runtime.settings = PluginSettings(pruner=runtime.settings.pruner, log_interval=1)
    reporter = MetricsReporter(runtime, prometheus=False)
    published = []
    publish = reporter._publish
    reporter._publish = lambda sums, requests=None: published.append(sums) or publish(sums, requests)
    runtime.metrics_of("decode")[0, 3] = 5
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            reporter.on_pruned_forward()
            torch.cuda._sleep(1_000_000)  # device work after the copy: still nothing waits for it
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    reporter.report()
    assert sum(float(sums[:, 0, 3].sum()) for sums in published) == 5


# ---------------------------------------------------------------------------------- redundant experts
L_EXPERTS, REDUNDANT = 16, 4


def _model(config, *, num_experts: int, num_fused_shared_experts: int = 0):
    from tests.sglang_helpers import stand_in_experts, stand_in_topk

    model = torch.nn.Module()
    model.topk = stand_in_topk(config, layer_id=config.layer_id)
    model.experts = stand_in_experts(
        layer_id=config.layer_id, num_experts=num_experts, num_fused_shared_experts=num_fused_shared_experts
    )
    return model


def _placement(physical_to_logical: list[int], ep_size: int = 2):
    """SGLang's ``ExpertLocationMetadata`` for one layer, as ``--ep-num-redundant-experts`` builds it,
    and the matching ``ExpertLocationDispatchInfo`` (static dispatch: each logical expert goes to its
    last replica, so replicas really receive tokens)."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo

    p2l = torch.tensor([physical_to_logical])
    num_physical = p2l.shape[1]
    num_logical = int(p2l.max()) + 1
    l2all = torch.full((1, num_logical, num_physical), -1, dtype=torch.long)
    for slot, expert in enumerate(physical_to_logical):
        row = l2all[0, expert]
        row[int((row == -1).nonzero()[0, 0])] = slot
    valid = (l2all != -1).sum(-1)
    meta = ExpertLocationMetadata(
        physical_to_logical_map=p2l,
        physical_to_logical_map_cpu=p2l,
        logical_to_all_physical_map=l2all,
        logical_to_all_physical_map_cpu=l2all,
        logical_to_all_physical_map_num_valid=valid,
        ep_size=ep_size,
        logical_to_rank_dispatch_physical_map=None,
    )
    last_replica = l2all[0].gather(1, (valid[0] - 1)[:, None])[:, 0]
    info = ExpertLocationDispatchInfo("static", last_replica, l2all[0], valid[0], num_physical)
    return meta, info


@pytest.fixture
def placement(monkeypatch):
    from sglang.srt.runtime_context import get_resources

    resources = get_resources()

    def publish(physical_to_logical):
        meta, info = _placement(physical_to_logical)
        monkeypatch.setattr(resources, "expert_location_metadata", meta, raising=False)
        return meta, info

    yield publish


def test_redundant_experts_are_pruned_over_the_logical_experts(placement) -> None:
    """``--ep-num-redundant-experts 4``: ``FusedMoE`` holds 20 expert slots, the router scores the 16
    logical experts.  The runtime selects over the 16 (before: over 20, so every call failed the
    shape check and ran unpruned while the log said active), and each physical pick's logical expert
    is kept; tokens sent to a replica are still routed exactly as the reference routes them."""
    from xshare_sglang.sglang_plugin.model_layers import build_runtime

    physical_to_logical = [*range(L_EXPERTS), 0, 1, 2, 3]
    _, info = placement(physical_to_logical)
    config = _softmax_config(top_k=4)
    model = _model(config, num_experts=L_EXPERTS + REDUNDANT)
    pruner = PrunerConfig(policy="xshare", k0=1, budget=2)
    runtime = build_runtime(PluginSettings(pruner=pruner), model, "cpu")
    state = runtime.layers[id(config)]
    assert state.num_experts == L_EXPERTS
    runtime.num_valid_buffer.fill_(NUM_VALID)
    runtime.enter(ForwardScope(phase="decode", num_valid=runtime.num_valid_buffer, cfg=pruner))
    set_runtime(runtime)
    logits = _logits(5, num_experts=L_EXPERTS)
    logits[:, :4] += 2.0  # the replicated experts are popular: their replicas get picked
    ids, weights = sglang_select_experts(
        config, logits, expert_location_dispatch_info=info, num_token_non_padded=torch.tensor(NUM_VALID)
    )
    assert runtime.faults == 0
    keep = select_experts_mask(logits, pruner, top_k=4, num_valid_tokens=NUM_VALID)
    assert torch.equal(state.keep, keep) and keep.sum() < L_EXPERTS
    live = ids[:NUM_VALID]
    assert (live >= L_EXPERTS).any()  # replicas were used
    p2l = torch.tensor(physical_to_logical)
    logical = torch.where(live >= 0, p2l[live.clamp(min=0).long()], -1)
    assert keep[logical[logical >= 0]].all()
    want_ids, want_weights = route_within(logits, keep, top_k=4, num_valid_tokens=NUM_VALID)
    _assert_same_routing(logical, weights, want_ids, want_weights, NUM_VALID)
    assert (ids[NUM_VALID:] == -1).all()


def test_fused_shared_experts_are_never_pruned(placement) -> None:
    """Shared-expert fusion (global layout): SGLang appends the shared expert as the last column with
    id L; the pruner selects over the L routed experts and never drops the shared column."""
    from xshare_sglang.sglang_plugin.model_layers import build_runtime

    placement(list(range(L_EXPERTS)))
    config = _softmax_config(top_k=4)
    model = _model(config, num_experts=L_EXPERTS, num_fused_shared_experts=1)
    pruner = PrunerConfig(policy="xshare", k0=1, budget=2)
    runtime = build_runtime(PluginSettings(pruner=pruner), model, "cpu")
    state = runtime.layers[id(config)]
    assert state.num_experts == L_EXPERTS
    ids = torch.tensor([[3, 5, 9, 16], [1, 2, 4, L_EXPERTS]], dtype=torch.int32)
    weights = torch.full((2, 4), 0.25)
    state.keep.fill_(False)
    state.keep[[3, 1]] = True
    from xshare_sglang.sglang_plugin.runtime import ActiveCall

    runtime.rewrite(ActiveCall(state, None, masked=True, ids_physical=True), ids, weights)
    assert ids.tolist() == [[3, -1, -1, L_EXPERTS], [1, -1, -1, L_EXPERTS]]
    assert weights[:, 3].tolist() == [0.25, 0.25]


@pytest.mark.parametrize(
    ("fused_shared", "redundant", "a2a", "fragment"),
    [
        (1, 0, "deepep", "per-rank expert slots"),
        (1, REDUNDANT, "none", "--ep-num-redundant-experts"),
    ],
)
def test_unmappable_shared_expert_layouts_are_refused(
    placement, monkeypatch, fused_shared, redundant, a2a, fragment
) -> None:
    """Layouts whose expert ids the pruner cannot map back to the router's experts stop the server at
    model load with a message naming the flags: per-rank shared slots (DeepEP-class all-to-all with
    shared-expert fusion; ids renumbered as ``e + (e // L_local) * S``), and fused shared experts next
    to redundant replicas (SGLang's shared id L collides with the first replica slot)."""
    from sglang.srt.layers.moe import utils as moe_utils

    from xshare_sglang.sglang_plugin.model_layers import PrunerSetupError, build_runtime

    placement(list(range(L_EXPERTS)) + list(range(redundant)))
    monkeypatch.setattr(moe_utils, "uses_per_rank_fused_shared_slots", lambda: a2a == "deepep")
    config = _softmax_config(top_k=4)
    model = _model(config, num_experts=L_EXPERTS + redundant, num_fused_shared_experts=fused_shared)
    with pytest.raises(PrunerSetupError, match="disable-shared-experts-fusion") as refused:
        build_runtime(PluginSettings(pruner=PrunerConfig(policy="xshare", k0=1, budget=2)), model, "cpu")
    assert fragment in str(refused.value)


def test_recorder_sees_the_drops_not_renumbered_ids() -> None:
    """SGLang hands its expert-distribution recorder a separate tensor of physical routed ids when
    shared slots are appended or renumbered; the rewrite's drops reach it, its other ids stay."""
    from xshare_sglang.sglang_plugin.hooks import topk_post_process
    from xshare_sglang.sglang_plugin.runtime import ActiveCall

    config = _softmax_config(top_k=2)
    runtime = _publish([config], PrunerConfig(policy="oea", k0=1), num_experts=8)
    state = runtime.layers[id(config)]
    state.keep.fill_(False)
    state.keep[[1, 6]] = True
    runtime.call = ActiveCall(state, None, masked=True)
    renumbered = torch.tensor([[1, 7, 8], [6, 2, 8]], dtype=torch.int32)  # ids as the dispatcher sees them
    recorder = torch.tensor([[1, 6], [5, 2]], dtype=torch.int32)  # SGLang's physical ids before renumbering
    weights = torch.full((2, 3), 0.5)
    topk_post_process.hook((renumbered, weights, recorder))
    assert recorder.tolist()[1] == [5, -1]  # the drop mirrored, the physical id 5 not overwritten by 6


# ---------------------------------------------------------------------------------- ECHO under CUDA graphs
@pytest.fixture
def echo_hooks():
    from xshare_sglang.sglang_plugin.echo_runtime import set_echo_runtime

    apply_echo_hooks()
    yield
    set_echo_runtime(None)


def test_echo_buffers_sized_from_sglangs_resolved_limits(echo_hooks, monkeypatch, tmp_path) -> None:
    """ECHO's candidate buffers are sized, before any draft graph is captured, from the limits SGLang
    resolved (decode graphs' max batch, running-request limit, draft steps and top-k), not from the
    operator's raw ``ServerArgs`` (where ``cuda_graph_max_bs`` does not exist and the running-request
    limit is usually unset): before, they were sized for one row."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as runtime_context

    from xshare_sglang.sglang_plugin.echo_runtime import EchoRuntime, set_echo_runtime
    from xshare_sglang.sglang_plugin.hooks import model_runner_init
    from xshare_sglang.spec.echo.settings import EchoSettings

    graphs = SimpleNamespace(decode=SimpleNamespace(max_bs=160))
    monkeypatch.setattr(
        runtime_context, "get_exec", lambda: SimpleNamespace(graph=SimpleNamespace(cuda_graph_config=graphs))
    )
    monkeypatch.setattr(runtime_context, "get_schedule", lambda: SimpleNamespace(max_running_requests=48))
    monkeypatch.setattr(
        runtime_context, "get_spec", lambda: SimpleNamespace(speculative_num_steps=3, speculative_eagle_topk=4)
    )
    echo = EchoRuntime(EchoSettings(log_dir=str(tmp_path / "log")))
    set_echo_runtime(echo)
    raw_args = SimpleNamespace(speculative_num_steps=None, speculative_eagle_topk=None, max_running_requests=None)
    model_runner_init._start_echo(SimpleNamespace(server_args=raw_args, device="cpu"))
    scores = echo._stash[0]
    assert tuple(scores.shape) == (160, 4 + 2 * 16)


def test_echo_buffers_are_never_reallocated(echo_hooks, tmp_path) -> None:
    """Captured draft graphs copy into the candidate buffers on every replay, so the buffers are never
    replaced: an eager step with more requests than reserved is a counted fault whose candidates are
    refused (that step runs SGLang's own tree), and the buffers keep their memory (before, they were
    reallocated, leaving the graphs writing into freed memory)."""
    from tests.sglang_helpers import sglang_draft
    from xshare_sglang.sglang_plugin.echo_runtime import EchoRuntime
    from xshare_sglang.spec.echo.settings import EchoSettings

    echo = EchoRuntime(EchoSettings(log_dir=str(tmp_path / "log")))
    echo.reserve(4, 3, 2, "cpu")
    addresses = [t.data_ptr() for t in echo._stash]
    echo.stash(*sglang_draft(3, 2, 3, seed=1))
    fitting = echo.candidates(3, 3, 2)
    assert fitting is not None and fitting.scores.shape[0] == 3
    echo.stash(*sglang_draft(6, 2, 3, seed=2))  # more rows than reserved
    assert echo.faults == 1 and echo.candidates(6, 3, 2) is None
    echo.stash(*sglang_draft(6, 2, 3, seed=3))
    assert echo.candidates(4, 3, 2) is None  # a failed step is never served from older candidates
    assert [t.data_ptr() for t in echo._stash] == addresses
    echo.reserve(8, 3, 2, "cpu")  # a second reservation keeps the buffers too
    assert [t.data_ptr() for t in echo._stash] == addresses
    echo.stash(*sglang_draft(2, 2, 3, seed=4))
    assert echo.candidates(2, 3, 2) is not None


# ---------------------------------------------------------------------------------- launch refusals
def test_launch_refuses_modes_the_pruner_cannot_honour() -> None:
    """Exit 2 at launch, naming both flags and what to do instead: attention DP on the standard MoE path
    (both spellings), unverified all-to-all backends, elastic EP, prefill pruning while SGLang captures
    prefill CUDA graphs (its default on CUDA), torch.compile, and prefill-decode multiplexing with both
    prefill and decode pruned (two streams at once), and a batch-level policy in any phase under
    deterministic inference.  The same modes without the pruner, and the
    supported neighbours, are accepted."""
    pruner = ["--moe-pruner", "xshare"]
    extend = [*pruner, "--moe-pruner-phases", "decode,extend"]
    cases = {
        "attn_dp": [*pruner, "--tp-size", "2", "--attn-dp-size", "2"],
        "dp_attention": [*pruner, "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"],
        "mooncake": [*pruner, "--moe-a2a-backend", "mooncake"],
        "elastic": [*pruner, "--elastic-ep-backend", "mooncake"],
        "extend_graph": extend,
        "mixed_graph": [*pruner, "--moe-pruner-phases", "decode,mixed"],
        "torch_compile": [*pruner, "--enable-torch-compile"],
        "deepep_fusion": [*pruner, "--moe-a2a-backend", "deepep", "--enforce-shared-experts-fusion"],
        "waterfill": [*pruner, "--enable-waterfill"],
        "pdmux_both": [*extend, "--enable-pdmux", "--disable-overlap-schedule", "--chunked-prefill-size", "-1"],
        "deterministic": [*pruner, "--enable-deterministic-inference"],
        "deterministic_spec": [
            "--moe-pruner-config",
            '{"policy": "none", "verify": {"policy": "moe-spec", "max_experts": 16}}',
            "--enable-deterministic-inference",
        ],
        # accepted
        "attn_dp_unpruned": ["--tp-size", "2", "--attn-dp-size", "2"],
        "attn_dp_deepep": [*pruner, "--tp-size", "2", "--attn-dp-size", "2", "--moe-a2a-backend", "deepep"],
        "extend_eager": [*extend, "--cuda-graph-backend-prefill", "disabled"],
        "extend_cpu": [*extend, "--device", "cpu"],
        "tp2": [*pruner, "--tp-size", "2"],
        "torch_compile_unpruned": ["--enable-torch-compile"],
        "pdmux_decode_only": [*pruner, "--enable-pdmux", "--disable-overlap-schedule", "--chunked-prefill-size", "-1"],
        "deterministic_none": ["--moe-pruner", "none", "--enable-deterministic-inference"],
        "deterministic_unpruned": ["--enable-deterministic-inference"],
    }
    report = parse_in_fresh_process(cases)
    refused = {
        "attn_dp": ["--moe-pruner cannot run with attention data parallelism", "--moe-a2a-backend deepep"],
        "dp_attention": ["--dp-size 2", "attention data parallelism"],
        "mooncake": ["--moe-pruner does not support --moe-a2a-backend mooncake", "none, deepep, deepep_v2"],
        "elastic": ["--elastic-ep-backend mooncake"],
        "extend_graph": ["--moe-pruner-phases extend", "--cuda-graph-backend-prefill disabled"],
        "mixed_graph": ["--moe-pruner-phases mixed"],
        "torch_compile": ["--moe-pruner does not support --enable-torch-compile"],
        "deepep_fusion": ["--enforce-shared-experts-fusion with --moe-a2a-backend deepep", "per-rank"],
        "waterfill": ["--moe-pruner does not support --enable-waterfill"],
        "pdmux_both": ["--moe-pruner-phases decode,extend with --enable-pdmux", "two streams"],
        "deterministic": ["--moe-pruner xshare with --enable-deterministic-inference", "--moe-pruner none"],
        "deterministic_spec": ["--moe-pruner moe-spec with --enable-deterministic-inference"],
    }
    for name, fragments in refused.items():
        code, stderr = report[name]
        assert code == 2, (name, report[name])
        for fragment in fragments:
            assert fragment in stderr, (name, stderr)
    for name in set(cases) - set(refused):
        assert report[name][0] is None, (name, report[name])


# ---------------------------------------------------------------------------------- prefill graphs
class _PrefillGraph:
    """Stands in for SGLang's ``PrefillCudaGraphRunner``: a replay runs no Python routing hook."""

    def __init__(self, replays: bool) -> None:
        self.replays = replays

    def can_run_graph(self, forward_batch) -> bool:
        return self.replays

    def execute(self, forward_batch, **kwargs):
        return "graph"


class _Eager:
    """Stands in for SGLang's ``EagerRunner``: runs the model's router in Python, through the hooks."""

    def __init__(self, config) -> None:
        self.config = config

    def execute(self, forward_batch, pp_proxy_tensors=None):
        return sglang_select_experts(self.config, _logits(0))


@pytest.mark.parametrize("replays", [True, False], ids=["graph", "eager"])
def test_only_forwards_that_ran_pruned_routing_are_counted(monkeypatch, replays) -> None:
    """SGLang's own ``ModelRunner._forward_raw`` dispatching extend forwards with ``extend`` pruned:
    a replayed prefill graph (captured without the pruner) is not counted as pruned, an eager extend
    forward is (before, both were).  With ``metrics_every`` 2 the hook opens the metrics gate for the
    first of every two pruned forwards: of three eager forwards, the first and the third add their
    layer call's metrics."""
    import contextlib
    import json
    from types import SimpleNamespace

    import sglang.srt.model_executor.model_runner as model_runner_module
    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner

    from tests.sglang_helpers import stand_in_experts, stand_in_topk
    from xshare_sglang.sglang_plugin.hooks import model_runner_init
    from xshare_sglang.sglang_plugin.runtime import get_runtime
    from xshare_sglang.sglang_plugin.settings import ENV_VAR

    monkeypatch.setattr(
        runtime_context, "get_parallel", lambda: SimpleNamespace(tp_rank=0, tp_size=1, moe_ep_rank=0, moe_ep_size=1)
    )
    monkeypatch.setattr(
        model_runner_module, "get_model", lambda: SimpleNamespace(override=lambda **kw: contextlib.nullcontext())
    )
    settings = {"policy": "xshare", "k0": 1, "budget": 3, "log_interval": 1000, "phases": ["decode", "extend"]}
    settings["metrics_every"] = 2
    monkeypatch.setenv(ENV_VAR, json.dumps(settings))
    config = _softmax_config(top_k=4)
    model = torch.nn.Module()
    model.topk = stand_in_topk(config, layer_id=0)
    model.experts = stand_in_experts(layer_id=0, num_experts=NUM_EXPERTS)
    model.shared_experts_config = None  # read by SGLang's _forward_raw
    runner = object.__new__(ModelRunner)
    runner.__dict__.update(
        runner_attributes(model),
        attn_backend=None,
        decode_cuda_graph_runner=None,
        hisparse_coordinator=None,
        device_timer=None,
        prefill_cuda_graph_runner=_PrefillGraph(replays),
        eager_runner=_Eager(config),
        _prepare_eager_forward_batch=lambda fb: None,
        _maybe_execute_deferred_mamba_cow_and_clear=lambda fb: None,
        _extend_forward_kwargs=lambda fb, pp: {},
    )
    model_runner_init.hook(None, runner)
    runtime = get_runtime()
    forward_batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND,
        spec_info=None,
        token_indices_to_pool=None,
        global_num_tokens_cpu=None,
        moe_num_token_non_padded=lambda: None,
        req_pool_indices=None,
    )
    for _ in range(3):
        out = ModelRunner._forward_raw(runner, forward_batch, None)
    assert out.can_run_graph is replays
    assert runtime.pruned_forwards == (0 if replays else 3)
    assert int(runtime.metrics_of("extend")[0, 3]) == (
        0 if replays else 2
    )  # sampled layer calls that really ran pruned


# ---------------------------------------------------------------------------------- EPLB
def test_xshare_ep_follows_eplb_rebalances(placement) -> None:
    """``xshare-ep`` balances over the rank that holds each expert.  SGLang's EPLB rebalance updates
    its expert placement in place (``ExpertLocationMetadata.update``, run here as SGLang runs it);
    the owner table follows, in the same tensor that captured graphs read (before: stale forever),
    and the next selection balances over the new owners."""
    from xshare_sglang.sglang_plugin.model_layers import build_runtime

    meta, _ = placement(list(range(8)))  # 2 ranks x 4 slots: experts 0-3 on rank 0, 4-7 on rank 1
    config = _softmax_config(top_k=2)
    model = _model(config, num_experts=8)
    pruner = PrunerConfig(policy="xshare-ep", k0=1, rank_budget=2)
    runtime = build_runtime(PluginSettings(pruner=pruner), model, "cpu", ep_size=2)
    owners = runtime.layers[id(config)].expert_to_rank
    assert owners.tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    address = owners.data_ptr()
    rebalanced, _ = _placement([4, 5, 6, 7, 0, 1, 2, 3])  # the halves swap ranks
    apply_routing_hooks()
    set_runtime(runtime)
    meta.update(rebalanced, update_layer_ids=[0])
    assert owners.tolist() == [1, 1, 1, 1, 0, 0, 0, 0] and owners.data_ptr() == address
    # a placement object that is not SGLang's global one is ignored
    _placement(list(range(8)))[0].update(rebalanced, update_layer_ids=[0])
    assert owners.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    # the selection now balances over the new owners
    runtime.num_valid_buffer.fill_(NUM_VALID)
    runtime.enter(ForwardScope(phase="decode", num_valid=runtime.num_valid_buffer, cfg=pruner))
    logits = _logits(8, num_experts=8)
    sglang_select_experts(config, logits)
    want = select_experts_mask(
        logits, pruner, top_k=2, num_valid_tokens=NUM_VALID, expert_to_rank=torch.tensor([1, 1, 1, 1, 0, 0, 0, 0])
    )
    assert torch.equal(runtime.layers[id(config)].keep, want)


def test_expert_owners_agree_across_ranks_with_replicas(placement) -> None:
    """With redundant replicas, SGLang orders each expert's replica list per rank; the owner table is
    the lowest rank holding a replica, the same on every rank."""
    from xshare_sglang.sglang_plugin.model_layers import expert_owner_of

    meta, _ = placement([0, 1, 2, 3, 4, 5, 0, 1])  # replicas of 0 and 1 on rank 1
    first = expert_owner_of(0, meta)
    lists = meta.logical_to_all_physical_map_cpu
    lists[0, :2, :2] = lists[0, :2, :2].flip(-1)  # experts 0 and 1 list their rank-1 replica first
    assert torch.equal(expert_owner_of(0, meta), first)
    assert first.tolist() == [0, 0, 0, 0, 1, 1]


# ---------------------------------------------------------------------------------- routing variants
def test_llama4_routing_function_stays_in_the_mask() -> None:
    """Llama-4 routes with its own function (top-1 by logit, sigmoid weight, no renormalization)
    while its config keeps SGLang's default ``scoring_func="softmax"``: the layer is scored as sigmoid,
    every pick is a kept expert, and its weight is the sigmoid of the token's own logit."""
    from sglang.srt.models.llama4 import Llama4MoE

    config = _softmax_config(top_k=1, renormalize=False, custom_routing_function=Llama4MoE.custom_routing_function)
    pruner = PrunerConfig(policy="xshare", k0=0, budget=3, score="probs")
    runtime = _publish([config], pruner)
    state = runtime.layers[id(config)]
    state.stats = torch.zeros(2, dtype=torch.int64)  # the test hook: the select-only call's score totals
    assert state.scoring == "sigmoid"
    logits = _logits(11)
    ids, weights = sglang_select_experts(config, logits)
    keep = select_experts_mask(logits, pruner, top_k=1, num_valid_tokens=NUM_VALID, scoring="sigmoid")
    assert torch.equal(state.keep, keep) and keep.sum() == 3
    live = ids[:NUM_VALID, 0].long()
    assert keep[live].all()
    masked = logits[:NUM_VALID].masked_fill(~keep, float("-inf"))
    assert torch.equal(live, masked.argmax(dim=1))
    torch.testing.assert_close(weights[:NUM_VALID, 0], torch.sigmoid(logits[:NUM_VALID].gather(1, live[:, None]))[:, 0])
    # the call counted once: kept experts, retained mass and the call by the selection kernel, the
    # experts the final ids send a token to by the rewrite
    want = selection_metrics(keep, state.stats[0], state.stats[1])
    activated = len({int(e) for e in ids.flatten() if e >= 0})
    assert runtime.metrics_of("decode")[state.row].tolist() == [activated, 3, int(want[2]), 1]
    assert 0 < want[2] < RETAINED_ONE


def test_routing_functions_the_pruner_cannot_act_through_are_refused() -> None:
    """Grok hands its routing function the gate weights instead of router logits: every layer call
    would fail the shape check and run unpruned under an "active" log line.  Refused at model load."""
    import functools

    from sglang.srt.models import grok

    from tests.sglang_helpers import stand_in_topk
    from xshare_sglang.sglang_plugin.model_layers import MoeLayer, PrunerSetupError, check_model

    # built as Grok1MoE builds it
    function = functools.partial(grok.fused_moe_router_shim, 30.0)
    config = _softmax_config(top_k=2, renormalize=False, custom_routing_function=function)
    layer = MoeLayer(stand_in_topk(config, layer_id=0), NUM_EXPERTS, None)
    with pytest.raises(PrunerSetupError, match=r"fused_moe_router_shim.*gate weights"):
        check_model(PrunerConfig(policy="xshare", k0=1, budget=2), [layer], ep_size=1)


def test_tensor_parallel_ranks_keep_the_same_experts() -> None:
    """Under tensor parallelism every rank routes the same tokens from a replicated gate and sums its
    share of each expert: the ranks must keep the identical set.  Two ranks simulated as two runtimes,
    on logits full of exact ties (bf16-rounded, as a bf16 gate produces): identical keep masks,
    routing and metrics, call after call."""
    config = _softmax_config()
    pruner = PrunerConfig(policy="xshare", k0=1, budget=4)
    logits = (_logits(13) * 4).round() / 4  # many exact ties between experts
    results = []
    for _rank in range(2):
        runtime = _publish([config], pruner)
        calls = [sglang_select_experts(config, logits) for _ in range(3)]
        results.append((runtime.layers[id(config)].keep.clone(), calls, runtime.metrics.clone()))
    (keep0, calls0, metrics0), (keep1, calls1, metrics1) = results
    assert torch.equal(keep0, keep1) and keep0.sum() < NUM_EXPERTS
    for (ids0, w0), (ids1, w1) in zip(calls0 + calls1, calls1 + calls0, strict=True):
        assert torch.equal(ids0, ids1) and torch.equal(w0, w1)
    assert torch.equal(metrics0, metrics1)


def test_layers_that_never_ran_pruned_are_reported(caplog) -> None:
    """A layer whose router bypasses SGLang's ``select_experts`` (or whose selection fails on every
    call) runs unpruned while the others prune: the metrics report names it, once."""
    first, second = _softmax_config(layer_id=0), _softmax_config(layer_id=1)
    runtime = _publish([first, second], PrunerConfig(policy="oea", k0=1))
    reporter = MetricsReporter(runtime, prometheus=False)
    with caplog.at_level(logging.WARNING, logger="xshare_sglang.sglang_plugin.metrics"):
        sglang_select_experts(first, _logits(0))  # layer 1 never routes through the hooks
        reporter.report()
        sglang_select_experts(first, _logits(1))
        reporter.report()
        sglang_select_experts(first, _logits(2))
        sglang_select_experts(second, _logits(2))
        reporter.report()
    warnings = [r.getMessage() for r in caplog.records if "ran no pruned call" in r.getMessage()]
    assert len(warnings) == 1 and "[1]" in warnings[0]
