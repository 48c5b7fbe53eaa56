"""The start-up guard (``--moe-pruner-guard auto``): time where pruning pays, before serving.

Runs once per target ModelRunner, after the runtime is built and before SGLang captures its CUDA
graphs.  For every real-token bucket each pruned phase will run (the decode graphs' batch sizes
where graphs are captured, powers of two up to the running-request limit otherwise; times D for
speculative verify; powers of two up to the prefill chunk for prefill and mixed batches), it times a
pass over up to :data:`MAX_TIMED_LAYERS` of the model's own MoE layers (SGLang's ``TopK`` then its
``FusedMoE``, on the real backend), unpruned and with the phase's config, selection included.  The
pure decision (:func:`xshare_sglang.break_even.decide`) keeps pruning only where it is faster by the
margin; the runtime then prunes a forward only when its bucket said so, and graphs are captured with
that decision.  Nothing is timed again while serving.

Router logits that reproduce the model's routing come from, in this order: ``--moe-pruner-guard-trace``
(recorded router logits of the same layers); the calibration file the config names (Gumbel top-k
draws from each layer's expert counts: experts are picked as often as calibration saw them); else
the layer's own router on its input.  Inputs follow a residual stream from rows of the embedding
table through the model's own MoE layers (attention skipped, see :func:`timed_layers`).  The log
says which.

Timing: wall clock on CPU, CUDA events on a GPU (eager launches: the selection's launch overhead
counts against pruning, so the decision errs towards "off").  Rounds go over every bucket, both
variants in alternating order, until ``--moe-pruner-guard-seconds`` is spent or :data:`MAX_ROUNDS`
rounds are done.  With several ranks every rank runs the same passes (the MoE layers may hold
collectives), the number of rounds is agreed from the slowest rank, and a bucket is pruned only if
every rank says so: tensor-parallel ranks must route alike.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..break_even import BucketTiming, GuardTable, decide, settled
from ..config import PrunerConfig
from .forward_phases import decode_graphs_on, verify_widths
from .model_layers import PrunerSetupError, find_moe_layers
from .runtime import ForwardScope, PrunerRuntime

logger = logging.getLogger(__name__)

MAX_TIMED_LAYERS = 8
MAX_ROUNDS = 5
MAX_PREFILL_BUCKET = 16384
SEED = 0


@dataclass(frozen=True)
class Bucket:
    """One bucket to time: a phase, its token count, and its rows per request (D)."""

    phase: str
    num_tokens: int
    tokens_per_request: int
    cfg: PrunerConfig


@dataclass
class TimedLayer:
    """One MoE layer the guard times: SGLang's modules and its router logits for the largest bucket."""

    layer_id: int
    topk: Any
    experts: Any
    router_logits: torch.Tensor  # [max tokens, E], the model's dtype
    hidden: torch.Tensor  # [max tokens, H], the layer's input, the model's dtype


# ---------------------------------------------------------------------------------------- buckets
def powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to ``limit``, and ``limit`` itself."""
    limit = max(1, int(limit))
    return sorted({1 << i for i in range(limit.bit_length()) if 1 << i <= limit} | {limit})


def plan_buckets(
    phase_configs: dict[str, PrunerConfig],
    *,
    batch_sizes: Sequence[int],
    draft_tokens: int | Sequence[int],
    prefill_tokens: int,
) -> list[Bucket]:
    """The buckets of every pruned phase.

    Parameters
    ----------
    phase_configs : dict of str to PrunerConfig
        The config of each phase the server prunes (policy ``none`` is skipped).
    batch_sizes : sequence of int
        Decode batch sizes: the CUDA-graph buckets, or powers of two up to the request limit.
    draft_tokens : int or sequence of int
        D of speculative verify, or every D the server may verify with (``--speculative-adaptive``:
        one per candidate step count); values below 2 verify nothing.  A token count several D reach
        is one bucket, timed at the largest such D (the guard judges a forward by its token count).
    prefill_tokens : int
        The largest prefill chunk (prefill and mixed buckets are powers of two up to it).
    """
    widths = sorted({int(d) for d in ([draft_tokens] if isinstance(draft_tokens, int) else draft_tokens) if d > 1})
    buckets = []
    for phase, cfg in phase_configs.items():
        if cfg.policy == "none":
            continue
        if phase == "decode":
            buckets += [Bucket(phase, bs, 1, cfg) for bs in sorted(set(batch_sizes))]
        elif phase == "verify" and widths:
            by_tokens = {bs * d: d for d in widths for bs in set(batch_sizes)}  # the largest D wins
            buckets += [Bucket(phase, n, d, cfg) for n, d in sorted(by_tokens.items())]
        elif phase in ("extend", "mixed"):
            buckets += [Bucket(phase, n, 1, cfg) for n in powers_of_two(min(prefill_tokens, MAX_PREFILL_BUCKET))]
    return buckets


def server_buckets(runner, phase_configs: dict[str, PrunerConfig]) -> list[Bucket]:
    """:func:`plan_buckets` for the server ``runner`` belongs to, as SGLang resolved its settings.

    A speculative server's target model verifies and never decodes: its decode phase is not timed,
    unless ``--speculative-adaptive`` may run 0 steps (a verify of one token per request, pruned as
    decode).  Under ``--speculative-adaptive`` verify is timed at every candidate step count's D.
    """
    server_args = runner.server_args
    draft_tokens = verify_widths(server_args)
    if draft_tokens and 1 not in draft_tokens:
        phase_configs = {phase: cfg for phase, cfg in phase_configs.items() if phase != "decode"}
    if decode_graphs_on(server_args):
        from sglang.srt.model_executor.runner.base_cuda_graph_runner import get_batch_sizes_to_capture

        batch_sizes, _ = get_batch_sizes_to_capture(runner, max(1, runner.decode_num_tokens_per_req()))
    else:
        batch_sizes = powers_of_two(runner.req_to_token_pool.size)
    prefill = getattr(server_args, "chunked_prefill_size", None) or getattr(server_args, "max_prefill_tokens", 0)
    return plan_buckets(
        phase_configs, batch_sizes=batch_sizes, draft_tokens=draft_tokens, prefill_tokens=int(prefill or 8192)
    )


# ---------------------------------------------------------------------------------------- inputs
def _module_named(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _embedding(model: torch.nn.Module) -> torch.nn.Module | None:
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            return getter()
        except (AttributeError, NotImplementedError):
            pass
    return _module_named(model, "model.embed_tokens")


@torch.no_grad()
def _hidden_states(model: torch.nn.Module, num_tokens: int, hidden_size: int, device) -> torch.Tensor:
    """Float32 hidden states [num_tokens, H]: rows of the model's embedding table for random token ids
    (random normal rows when the table is not found)."""
    embed = _embedding(model)
    gen = torch.Generator(device="cpu").manual_seed(SEED)
    weight = getattr(embed, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.shape[-1] == hidden_size:
        vocab = int(getattr(embed, "org_vocab_size", None) or weight.shape[0])
        ids = torch.randint(0, vocab, (num_tokens,), generator=gen).to(device)
        return embed(ids).to(torch.float32)
    return torch.randn(num_tokens, hidden_size, generator=gen).to(device)


def _rms_normalised(states: torch.Tensor, decoder_layer: torch.nn.Module | None) -> torch.Tensor:
    """The layer's MoE input scale: unit RMS, times the post-attention norm's weight where it has one."""
    out = states * torch.rsqrt(states.pow(2).mean(dim=-1, keepdim=True) + 1e-6)
    norm = getattr(decoder_layer, "post_attention_layernorm", None)
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.shape == (states.shape[-1],):
        out = out * weight.to(out.dtype)
    return out


def _gumbel_logits(counts: Sequence[float], num_tokens: int, device, gen: torch.Generator) -> torch.Tensor:
    """Float32 logits [num_tokens, E] whose top-k is a draw without replacement with probability
    proportional to ``counts`` (Gumbel top-k); an expert calibration never saw keeps a small chance
    (a thousandth of the mean count)."""
    weights = torch.tensor(counts, dtype=torch.float64)
    weights = weights + 1e-3 * weights.mean().clamp(min=1.0)
    uniform = torch.rand(num_tokens, len(counts), generator=gen, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    gumbel = -torch.log(-torch.log(uniform))
    return (weights.log()[None, :] + gumbel).to(torch.float32).to(device)


def _trace_logits(trace, row: int, num_experts: int, num_tokens: int, device, gen) -> torch.Tensor | None:
    rows = [call.router_logits(num_experts) for call in trace.calls if call.layer == row and call.num_rows]
    if not rows:
        return None
    table = torch.cat(rows).to(torch.float32)
    pick = torch.randint(0, table.shape[0], (num_tokens,), generator=gen)
    return table[pick].to(device)


def timed_layers(
    runtime: PrunerRuntime,
    model: torch.nn.Module,
    num_tokens: int,
    *,
    trace_path: str | None,
    calibration_counts: Sequence[Sequence[float]] | None,
) -> tuple[list[TimedLayer], str]:
    """Up to :data:`MAX_TIMED_LAYERS` evenly spaced MoE layers, each with ``num_tokens`` rows of its
    input and router logits, and where the logits came from.

    The inputs follow a residual stream: rows of the embedding table for random token ids, to which
    each MoE layer in turn adds its own (unpruned) output; a layer reads the stream RMS-normalised
    (times its post-attention norm's weight, where it has one); a layer without a router module
    adds nothing.  Attention is skipped: the stream
    is a stand-in for real hidden states that routes about as diversely (a layer's router on raw
    embedding rows picks far fewer distinct experts than it does on real traffic, which would make
    pruning look useless).  Without a trace or a calibration file, the router logits are the
    layer's own router on that input.
    """
    layers = find_moe_layers(model)
    if not layers:
        raise PrunerSetupError("moe-pruner guard: the model has no MoE layers to time")
    step = max(1, math.ceil(len(layers) / MAX_TIMED_LAYERS))
    timed_rows = set(range(0, len(layers), step)[:MAX_TIMED_LAYERS])
    first = layers[0].experts
    parameter = next(first.parameters(), None)
    dtype = parameter.dtype if parameter is not None and parameter.is_floating_point() else torch.float32
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        dtype = next((p.dtype for p in model.parameters() if p.dtype in (torch.bfloat16, torch.float16)), torch.float32)
    device = runtime.device
    hidden_size = int(getattr(first, "hidden_size", 0) or 0) or _embedding_width(model)
    stream = _hidden_states(model, num_tokens, hidden_size, device)
    names = {id(module): name for name, module in model.named_modules()}
    gen = torch.Generator(device="cpu").manual_seed(SEED + 1)
    trace = None
    if trace_path is not None:
        from ..replay.trace import load_trace, load_trace_dir

        trace = load_trace_dir(trace_path) if Path(trace_path).is_dir() else load_trace(trace_path)
        source = f"router logits recorded in {trace_path}"
    elif calibration_counts is not None:
        source = "draws from the calibration file's expert counts"
    else:
        source = "the model's routers on a residual stream of its own MoE layers from embedding rows"
    out = []
    previous = runtime.enter(None)  # the stream runs unpruned
    try:
        for row, (topk, num_experts, experts) in enumerate(layers):
            if row > max(timed_rows):
                break
            name = names.get(id(topk), "")
            block = _module_named(model, name.rsplit(".", 1)[0]) if "." in name else None
            decoder = _module_named(model, name.rsplit(".", 2)[0]) if name.count(".") >= 2 else None
            layer_input = _rms_normalised(stream, decoder).to(dtype)
            own_logits = _router_logits(block, layer_input)
            if row in timed_rows:
                logits = own_logits
                if trace is not None:
                    logits = _trace_logits(trace, row, num_experts, num_tokens, device, gen)
                    if logits is None:
                        raise PrunerSetupError(
                            f"moe-pruner guard: {trace_path} holds no router logits of MoE layer {topk.layer_id} "
                            f"(row {row}); record the trace on this model with --moe-pruner-trace-dir"
                        )
                elif calibration_counts is not None:
                    logits = _gumbel_logits(calibration_counts[topk.layer_id], num_tokens, device, gen)
                elif logits is None:
                    raise PrunerSetupError(
                        "moe-pruner guard: no router (a 'gate' or 'router' module) found next to MoE layer "
                        f"{topk.layer_id}; give the guard recorded router logits with --moe-pruner-guard-trace"
                    )
                if logits.shape != (num_tokens, num_experts):
                    raise PrunerSetupError(
                        f"moe-pruner guard: router logits of shape {tuple(logits.shape)} for MoE layer "
                        f"{topk.layer_id}, expected ({num_tokens}, {num_experts})"
                    )
                out.append(TimedLayer(topk.layer_id, topk, experts, logits.to(dtype).contiguous(), layer_input))
            if own_logits is not None and row < max(timed_rows):
                with torch.no_grad():
                    update = experts(layer_input, topk(layer_input, own_logits))
                stream = stream + _all_ranks(update, experts).to(torch.float32)
    finally:
        runtime.leave(previous)
    return out, source


def _router_logits(block: torch.nn.Module | None, layer_input: torch.Tensor) -> torch.Tensor | None:
    """The layer's own router logits on ``layer_input``; None when no router module is next to it
    (``gate`` in most SGLang MoE blocks, ``router`` in GPT-OSS's)."""
    gate = getattr(block, "gate", None)
    if gate is None:
        gate = getattr(block, "router", None)
    if gate is None:
        return None
    with torch.no_grad():
        result = gate(layer_input)
    return result[0] if isinstance(result, tuple) else result


def _all_ranks(update: torch.Tensor, experts: torch.nn.Module) -> torch.Tensor:
    """The MoE output summed over tensor-parallel ranks where the layer leaves that to its caller."""
    if getattr(experts, "reduce_results", True):
        return update
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
    except ImportError:
        return update
    if get_tensor_model_parallel_world_size() <= 1:
        return update
    return tensor_model_parallel_all_reduce(update)


def _embedding_width(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    width = getattr(config, "hidden_size", None)
    if not width:
        raise PrunerSetupError("moe-pruner guard: cannot tell the model's hidden size")
    return int(width)


# ---------------------------------------------------------------------------------------- timing
class _Clock:
    """Seconds of one pass: CUDA events on a GPU, wall clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, work: Callable[[], None]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            work()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        began = time.perf_counter()
        work()
        return time.perf_counter() - began


def _pass(runtime: PrunerRuntime, layers: list[TimedLayer], bucket: Bucket, pruned: bool):
    """One pass over the timed layers for ``bucket``, pruned or not."""
    scope = ForwardScope(
        phase=bucket.phase, tokens_per_request=bucket.tokens_per_request, cfg=bucket.cfg if pruned else None
    )

    def work() -> None:
        previous = runtime.enter(scope)
        try:
            with torch.no_grad():
                for layer in layers:
                    states = layer.hidden[: bucket.num_tokens]
                    output = layer.topk(states, layer.router_logits[: bucket.num_tokens])
                    layer.experts(states, output)
        finally:
            runtime.leave(previous)

    return work


class _Ranks:
    """Agreement between the ranks of a multi-process server (a no-op with one process)."""

    def __init__(self) -> None:
        self.group = None
        distributed = torch.distributed
        if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
            try:
                from sglang.srt.distributed import get_world_group

                self.group = get_world_group().cpu_group
            except Exception:  # SGLang's groups are not set up: the default group spans every rank
                self.group = distributed.group.WORLD

    def _reduce(self, values: list[float], op) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        torch.distributed.all_reduce(tensor, op=op, group=self.group)
        return tensor.tolist()

    def slowest(self, seconds: float) -> float:
        """The largest of every rank's ``seconds``."""
        if self.group is None:
            return seconds
        return self._reduce([seconds], torch.distributed.ReduceOp.MAX)[0]

    def all_agree(self, flags: list[bool]) -> list[bool]:
        """Each flag, True only where it is True on every rank."""
        if self.group is None or not flags:
            return flags
        return [value > 0.5 for value in self._reduce([float(f) for f in flags], torch.distributed.ReduceOp.MIN)]


def time_buckets(
    runtime: PrunerRuntime,
    layers: list[TimedLayer],
    buckets: list[Bucket],
    *,
    budget_s: float,
    margin: float,
    ranks: _Ranks | None = None,
    clock: _Clock | None = None,
) -> list[BucketTiming]:
    """Time every bucket unpruned and pruned, in rounds, within ``budget_s`` seconds.

    A warm-up pass of each (bucket, variant) comes first (compilation, caches, first-touch
    allocations), smallest bucket first, while the budget lasts.  Rounds then stop at
    :data:`MAX_ROUNDS`, when the next round would overrun the budget, or once every bucket is settled
    (more timings could not change its decision).  A bucket left with too few timings stays off.
    """
    ranks = ranks or _Ranks()
    clock = clock or _Clock(runtime.device)
    began = time.perf_counter()
    unpruned: list[list[float]] = [[] for _ in buckets]
    pruned: list[list[float]] = [[] for _ in buckets]
    failed: dict[int, str] = {}

    def timings() -> list[BucketTiming]:
        return [
            BucketTiming(b.phase, b.num_tokens, tuple(unpruned[i]), tuple(pruned[i]), note=failed.get(i, ""))
            for i, b in enumerate(buckets)
        ]

    def run(i: int, prune: bool, timed: bool) -> None:
        faults = runtime.faults
        work = _pass(runtime, layers, buckets[i], prune)
        if timed:
            (pruned if prune else unpruned)[i].append(clock.time(work))
        else:
            work()
        if prune and runtime.faults > faults:
            failed[i] = "the selection failed while it was timed"

    # with --moe-pruner-metrics-every the timed calls skip the metrics, as the forwards a sampling
    # server mostly serves do
    with runtime.unsampled():
        warmed = 0  # buckets warmed up within the budget; the others are never timed (and stay off)
        while warmed < len(buckets) and ranks.slowest(time.perf_counter() - began) < budget_s:
            run(warmed, False, timed=False)
            run(warmed, True, timed=False)
            warmed += 1
        round_s = ranks.slowest(time.perf_counter() - began) / 2  # the warm-up was about two rounds' work
        rounds = 0
        while rounds < MAX_ROUNDS and ranks.slowest(time.perf_counter() - began) + round_s <= budget_s:
            if all(ranks.all_agree([all(settled(t, margin) for t in timings())])):
                break
            round_began = time.perf_counter()
            for i in range(warmed):
                for prune in (False, True) if (rounds + i) % 2 == 0 else (True, False):
                    run(i, prune, timed=True)
            rounds += 1
            round_s = ranks.slowest(time.perf_counter() - round_began)
    runtime.metrics.zero_()  # the timed calls are not served traffic
    return timings()


# ---------------------------------------------------------------------------------------- entry
def run_guard(runtime: PrunerRuntime, runner) -> GuardTable:
    """Time, decide, log and publish the guard's table for the server of ``runner``."""
    settings = runtime.settings
    began = time.perf_counter()
    configs = {phase: cfg for phase, cfg in settings.phase_configs().items() if cfg.policy != "none"}
    buckets = server_buckets(runner, configs)
    if not buckets:
        raise PrunerSetupError("moe-pruner guard: no bucket to time (no pruned phase this server runs)")
    counts = None
    ranking = next((cfg.static_ranking for cfg in configs.values() if cfg.static_ranking is not None), None)
    if ranking is not None:
        counts = ranking.counts
    layers, source = timed_layers(
        runtime,
        runner.model,
        max(bucket.num_tokens for bucket in buckets),
        trace_path=settings.guard_trace,
        calibration_counts=counts,
    )
    ranks = _Ranks()
    timings = time_buckets(
        runtime, layers, buckets, budget_s=settings.guard_seconds, margin=settings.guard_margin, ranks=ranks
    )
    decisions = decide(timings, settings.guard_margin)
    agreed = ranks.all_agree([decision.prune for decision in decisions])
    decisions = tuple(
        decision if decision.prune == prune else replace(decision, prune=False, reason="another rank did not gain")
        for decision, prune in zip(decisions, agreed, strict=True)
    )
    forced = settings.test_guard_pruned
    if forced is not None:
        decisions = tuple(
            replace(d, prune=(d.phase, d.num_tokens) in forced, reason=f"{d.reason}; forced for a test")
            for d in decisions
        )
    table = GuardTable(decisions, seconds=time.perf_counter() - began, source=source, timed_layers=len(layers))
    _log(table, layers, timings)
    untimed = sorted(phase for phase in configs if not table.guards(phase))
    if untimed:
        logger.info("moe-pruner guard: phases %s are not run by this server's target model: never pruned", untimed)
    return table


def _log(table: GuardTable, layers: list[TimedLayer], timings: list[BucketTiming]) -> None:
    rounds = max((len(t.unpruned_s) for t in timings), default=0)
    kept = sum(decision.prune for decision in table.decisions)
    logger.info(
        "moe-pruner guard: timed MoE layers %s on %s, %d rounds in %.1f s: pruning kept in %d of %d buckets",
        [layer.layer_id for layer in layers],
        table.source,
        rounds,
        table.seconds,
        kept,
        len(table.decisions),
    )
    for decision in table.decisions:
        logger.info(
            "moe-pruner guard: %s %d tokens: unpruned %s, pruned %s: %s (%s)",
            decision.phase,
            decision.num_tokens,
            _ms(decision.unpruned_s),
            _ms(decision.pruned_s),
            "on" if decision.prune else "off",
            decision.reason,
        )


def _ms(seconds: float | None) -> str:
    return "not timed" if seconds is None else f"{seconds * 1e3:.3f} ms"
