"""The pruner inside one SGLang scheduler process: its state, and the steps the routing hooks run.

State published by the forward hooks (:class:`ForwardScope`) says whether the current forward is one
to prune and how it is laid out; the routing hooks then, per MoE layer call of the target model:

1. :meth:`PrunerRuntime.begin_call` - is this layer call pruned?  (target model, pruned phase);
2. :meth:`PrunerRuntime.route` - the fused path, for every router the kernels reproduce: one or two
   launches compute the keep mask and each token's experts and weights inside it, plus the layer's
   metrics, and SGLang's own top-k does not run;
3. otherwise (a custom routing function, fused shared-expert slots, a per-call bias, a routing
   override) the masked path: :meth:`PrunerRuntime.select_and_mask` computes the keep mask and
   masks the logits (in place) and the bias (into a per-layer buffer) so SGLang's router chooses
   among the kept experts (``truncation`` coverage leaves them alone), and after it
   :meth:`PrunerRuntime.rewrite` sets leftover picks and padding rows to ``-1`` and counts the
   activated experts (the selection kernel counted the rest of the call's metrics);
4. where SGLang routes inside the MoE kernel (``TRITON_KERNEL`` / ``BYPASSED`` top-k formats, no
   ``select_experts`` call), the kernel path: :meth:`PrunerRuntime.mask_for_kernel` computes the keep
   mask (its kernel counting the call's selection metrics) and masked copies of the router inputs,
   SGLang routes those, and :meth:`PrunerRuntime.count_kernel_routing` adds the activated experts
   from what the routing produced.

Everything on the per-layer path is device work with static shapes: it runs eagerly, and it is
recorded into (and replayed from) SGLang's decode CUDA graphs.  A failure in step 2 leaves the
layer call unpruned (in step 3 and 4, a failure of the selection as well), is counted, and is
logged at most once a minute.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from ..break_even import GuardTable
from ..config import PHASES, PrunerConfig
from ..kernels import SelectionWorkspace, dependent_launch_supported, prune_route, select_keep_mask, workspace_key
from ..policies.apply import mask_router_inputs
from ..policies.call import RouterSpec, RoutingCall
from ..policies.rewrite import activated_experts, request_experts, rewrite_routing
from ..policies.routing import adopt_model_routing, model_routing_is_kept, route_logits
from ..policies.scores import sanitize_logits, valid_token_mask
from .settings import PluginSettings

#: Row of each phase in :attr:`PrunerRuntime.metrics`.
PHASE_INDEX: dict[str | None, int] = {phase: index for index, phase in enumerate(PHASES)}

logger = logging.getLogger(__name__)

FAULT_LOG_PERIOD_S = 60.0


@dataclass
class ForwardScope:
    """The forward being run, as the routing hooks need it.

    Attributes
    ----------
    phase : str or None
        ``decode``, ``verify``, ``extend``, ``mixed``, or None for modes never pruned.
    tokens_per_request : int
        D: rows ``[i*D, (i+1)*D)`` belong to request i (1 outside speculative verify).
    num_valid : Tensor [1] or None
        Real-token count on the device (CUDA graphs: refilled before each replay); None when
        every row is real (eager forwards).
    cfg : PrunerConfig or None
        The config of this phase; None when the forward is not pruned.
    token_weights : Tensor [T] float32 or None
        Vote weight of each row (speculative verify with depth decay; 0 = never accepted, does
        not vote and routes nowhere); None weighs every real row 1.
    """

    phase: str | None
    tokens_per_request: int = 1
    num_valid: torch.Tensor | None = None
    cfg: PrunerConfig | None = None
    token_weights: torch.Tensor | None = None
    weights_source: Callable[[], torch.Tensor] | None = field(default=None, repr=False)

    def resolve_weights(self) -> torch.Tensor | None:
        """:attr:`token_weights`, computed from :attr:`weights_source` on first use (eager verify:
        a forward that replays a CUDA graph never runs a layer hook, so it never pays for them)."""
        if self.weights_source is not None:
            source, self.weights_source = self.weights_source, None
            self.token_weights = source()
        return self.token_weights


@dataclass
class LayerState:
    """One MoE layer of the target model and its preallocated buffers."""

    layer_id: int
    row: int
    topk_config: Any  # SGLang's TopKConfig: identity marks the layer as the target model's
    num_experts: int
    top_k: int
    scoring: str
    keep: torch.Tensor
    expert_to_rank: torch.Tensor | None = None
    masked_bias: torch.Tensor | None = None
    fill_dropped: bool = False  # the layer's MoE backend cannot take -1: dropped slots get weight-0 ids
    router: RouterSpec | None = None  # the fused kernels replace this layer's router (None: masked path)
    #: A test hook: an int64 [2] tensor here receives the score totals (kept, all) of each select-only
    #: call.  None when serving, so the selection does no work for them.
    stats: torch.Tensor | None = None

    @cached_property
    def selection_router(self) -> RouterSpec:
        """The router the selection reads: the fused router, or on the masked path (where SGLang's own
        router routes afterwards) the layer's top-k and scoring alone."""
        return self.router if self.router is not None else RouterSpec(self.top_k, self.scoring)


@dataclass
class ActiveCall:
    """One ``select_experts`` call of a pruned layer, from the select hook to the rewrite hook."""

    layer: LayerState
    num_valid: torch.Tensor | None
    masked: bool = False  # masked path: SGLang routes inside masked logits, the rewrite follows
    fused: bool = False  # fused path: the kernels routed this call; SGLang's router is skipped
    token_weights: torch.Tensor | None = None
    # SGLang maps the routed ids to physical expert slots (it was given an expert-location dispatch
    # info: EPLB, redundant experts, a non-trivial initial placement); the rewrite then reads each
    # id's logical expert from the placement's physical-to-logical map
    ids_physical: bool = False


@dataclass
class PrunerRuntime:
    """The pruner's state in one scheduler process (one target ModelRunner)."""

    settings: PluginSettings
    device: torch.device
    layers: dict[int, LayerState]  # keyed by id(topk_config)
    num_valid_buffer: torch.Tensor  # [1] int32, owned by the plugin, refilled before graph replays
    # [len(PHASES), num_layers, 4] int64, per phase of the forward (config.PHASES order) and layer: see
    # policies.rewrite.METRIC_COLUMNS
    metrics: torch.Tensor
    # [num_layers, 2] int64: speculative verify calls' distinct experts per request, summed, and the
    # requests (policies.rewrite.request_experts); None where no phase verifies
    request_metrics: torch.Tensor | None = None
    # --moe-pruner-metrics-every N > 1: [1] int32, 1 while the current forward adds its metrics (refilled
    # at a forward's start when the sampling turns it on or off); None: every forward adds them
    metrics_gate: torch.Tensor | None = None
    physical_to_logical: Any = None  # callable(layer_id) -> Tensor [P] or None
    runner: Any = None  # the target ModelRunner
    reporter: Any = None  # MetricsReporter
    recorder: Any = None  # TraceRecorder, with --moe-pruner-trace-dir
    scope: ForwardScope | None = None
    call: ActiveCall | None = None
    # verify graphs with vote weights: padded token count -> [T] bool, refilled before each replay
    acceptable_buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    # decode/verify graphs captured with a pruned scope, by (phase, padded token count)
    graph_pruned: dict[tuple[str | None, int], bool] = field(default_factory=dict)
    # the graph replayed in the current forward was captured pruned (set by the load_batch hook)
    replay_pruned: bool = False
    # --moe-pruner-guard auto: the buckets where pruning pays (None: prune every call the config covers)
    guard: GuardTable | None = None
    # SGLang's AdaptiveSpeculativeParams of this scheduler (--speculative-adaptive), None without it
    adaptive: Any = None
    # its expert-aware tiers (adaptive_tiers.AdaptiveTiers; with --moe-pruner-guard auto), None without
    tiers: Any = None
    faults: int = 0
    pruned_forwards: int = 0
    _last_fault_log: float = field(default=-FAULT_LOG_PERIOD_S, repr=False)
    _gate_open: bool = field(default=True, repr=False)  # what metrics_gate holds (it starts at 1)
    # one per (device, E, stream): two streams never share scratch memory
    _workspaces: dict[tuple[torch.device, int, int], SelectionWorkspace] = field(default_factory=dict, repr=False)
    # per device: launch the kernels of a call as programmatic dependents (Hopper and newer)
    _dependent_launch: dict[torch.device, bool] = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ metrics
    def metrics_row(self, layer: LayerState) -> torch.Tensor | None:
        """The layer's metrics row in the current forward's phase, which its calls add to; None when
        nothing reads the metrics (``log_interval`` 0): the calls then compile and run without them."""
        if self.settings.log_interval <= 0:
            return None
        return self.metrics[PHASE_INDEX.get(self.scope.phase if self.scope is not None else None, 0), layer.row]

    def metrics_of(self, phase: str) -> torch.Tensor:
        """The metrics rows of one phase, [num_layers, 4] int64 (a view)."""
        return self.metrics[PHASE_INDEX[phase]]

    def add_request_experts(self, layer: LayerState, topk_ids: torch.Tensor, num_ids: int) -> None:
        """In a speculative verify forward: add each request's distinct experts (its D rows' routed
        ids, ``topk_ids`` [T, k]) to the layer's request metrics, behind the metrics gate; nothing in
        other phases or with the metrics off."""
        scope = self.scope
        if self.request_metrics is None or scope is None or scope.phase != "verify" or self.metrics_row(layer) is None:
            return
        counts = request_experts(topk_ids, scope.tokens_per_request, num_ids)
        if self.metrics_gate is not None:
            counts = counts * self.metrics_gate[0]
        self.request_metrics[layer.row].add_(counts)

    def sample_metrics(self) -> None:
        """Open the metrics gate for a forward the sampling takes (every ``metrics_every``-th pruned
        forward, counting from the first), close it for the others: a fill on the current stream,
        ahead of the forward's layer calls (or its graph's replay), and only when the value changes.
        Not while a CUDA graph is captured (the graph reads the gate; it must not refill it)."""
        gate = self.metrics_gate
        if gate is None:
            return
        want = self.pruned_forwards % self.settings.metrics_every == 0
        if want == self._gate_open or (gate.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return
        gate.fill_(int(want))
        self._gate_open = want

    @contextlib.contextmanager
    def unsampled(self) -> Iterator[None]:
        """Layer calls inside run as those of the forwards the metrics sampling skips (the gate
        closed, where there is one): what the start-up guard times, since those are the forwards a
        sampling server mostly serves.  The gate is back as it was after."""
        gate = self.metrics_gate
        if gate is None:
            yield
            return
        gate.fill_(0)
        try:
            yield
        finally:
            gate.fill_(int(self._gate_open))

    def add_activated(self, layer: LayerState, activated: torch.Tensor) -> None:
        """Add a call's activated experts (an int64 scalar tensor on the device) to its layer's row,
        behind the metrics gate; nothing when the metrics are off."""
        row = self.metrics_row(layer)
        if row is None:
            return
        if self.metrics_gate is not None:
            activated = activated * self.metrics_gate[0]  # int64 by promotion: one op
        row[:1].add_(activated)  # in place: one device op (``+=`` on a slice would copy it back too)

    # ------------------------------------------------------------------ scopes
    def enter(self, scope: ForwardScope | None) -> ForwardScope | None:
        """Publish the scope of the forward about to run; returns the previous one."""
        previous, self.scope = self.scope, scope
        return previous

    def leave(self, previous: ForwardScope | None) -> None:
        self.scope = previous
        self.call = None

    def pruning_phase(self) -> bool:
        scope = self.scope
        return scope is not None and scope.cfg is not None

    def config_for(self, phase: str | None, num_tokens: int | None = None) -> PrunerConfig | None:
        """The config of ``phase``, None when that phase is not pruned, or (with the guard on) when
        pruning does not pay for forwards of ``num_tokens`` tokens."""
        cfg = self.settings.config_for(phase)
        if cfg is None or self.guard is None or num_tokens is None:
            return cfg
        return cfg if self.guard.prunes(phase, num_tokens) else None

    # ------------------------------------------------------------------ per layer call
    def begin_call(
        self, topk_config: Any, num_token_non_padded: torch.Tensor | None, *, ids_physical: bool = False
    ) -> ActiveCall | None:
        """Start a layer call; None when it is not to be pruned (draft model, phase, unknown layer)."""
        self.call = None
        if not self.pruning_phase():
            return None
        layer = self.layers.get(id(topk_config))
        if layer is None or layer.topk_config is not topk_config:
            return None
        num_valid = num_token_non_padded if num_token_non_padded is not None else self.scope.num_valid
        try:
            token_weights = self.scope.resolve_weights()
        except Exception as exc:  # the forward goes on unpruned
            self.record_fault(layer, exc)
            self.scope.cfg = None
            return None
        self.call = ActiveCall(layer, num_valid, token_weights=token_weights, ids_physical=ids_physical)
        return self.call

    def end_call(self) -> None:
        self.call = None

    def _workspace(self, logits: torch.Tensor) -> SelectionWorkspace:
        key = workspace_key(logits.shape[1], logits.device)
        if key not in self._workspaces:
            self._workspaces[key] = SelectionWorkspace(logits.shape[1], key[0])
        return self._workspaces[key]

    def dependent_launch(self, device: torch.device) -> bool:
        """Whether this device's pruned calls launch their kernels as programmatic dependents.

        On an H200 (docs/bench_selection.md, `aafee5e`) that took 1.1-2.8 us off every call of more
        than one launch, bit for bit the same results; GPUs below compute capability 9.0 and the
        interpreter launch as before.
        """
        if device not in self._dependent_launch:
            enabled = dependent_launch_supported(device)
            self._dependent_launch[device] = enabled
            if enabled:
                logger.info("xshare: pruned calls on %s launch their kernels as programmatic dependents", device)
        return self._dependent_launch[device]

    def routing_call(
        self, call: ActiveCall, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> RoutingCall:
        """The :class:`RoutingCall` of this layer call: its inputs checked once, against the layer.

        Raises on a test fault file, or inputs that do not fit the layer.
        """
        layer = call.layer
        fault_file = self.settings.test_fault_file
        if fault_file is not None and os.path.exists(fault_file):
            raise RuntimeError(f"fault injected for a test ({fault_file} exists)")
        if router_logits.dim() != 2 or router_logits.shape[1] != layer.num_experts:
            raise ValueError(f"router logits of shape {tuple(router_logits.shape)}, expected [T, {layer.num_experts}]")
        return RoutingCall(
            router_logits,
            layer.selection_router,
            tokens_per_request=self.scope.tokens_per_request,
            num_valid_tokens=call.num_valid,
            expert_to_rank=layer.expert_to_rank,
            layer_id=layer.layer_id,
            token_weights=call.token_weights,
            correction_bias=correction_bias,
        )

    def select_and_mask(
        self, call: ActiveCall, router_logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Keep mask of this call; with substitution coverage, router logits masked in place and the
        bias masked into a buffer (truncation coverage leaves both untouched).

        Never raises: on any error the inputs come back untouched and the call stays unpruned.
        """
        layer = call.layer
        try:
            self._select_into_layer(call, router_logits)
            if self.scope.cfg.coverage == "truncation":
                # every token keeps its natural routing; the rewrite drops the picks outside the mask
                call.masked = True
                return router_logits, correction_bias
            _, masked_bias = mask_router_inputs(
                router_logits,
                layer.keep,
                bias=correction_bias,
                out=router_logits,
                bias_out=_masked_bias_buffer(layer, correction_bias),
            )
        except Exception as exc:  # a pruner fault must never take the server down
            self.record_fault(layer, exc)
            return router_logits, correction_bias
        call.masked = True
        return router_logits, masked_bias

    def route(
        self,
        call: ActiveCall,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None,
        model_routing: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The fused path: keep mask, routed ids [T, k] int32 and weights [T, k] float32 of this call,
        with the layer's metrics accumulated.  None on any error (the call then runs unpruned).

        ``model_routing`` returns SGLang's own routing of the unmasked logits ([T, k] ids and
        weights); the hook passes it only where SGLang routes the layer with its torch-native top-k
        (the CPU engine), whose cost is small next to a CPU forward.  Rows whose own routing lies
        inside the keep mask then take it verbatim, so a mask that keeps every expert the tokens pick
        serves exactly what SGLang serves unpruned
        (:func:`~xshare_sglang.policies.routing.model_routing_is_kept`).  On CUDA SGLang's top-k
        would cost what the kernels save; there the kernels' weights differ from SGLang's by
        rounding only (docs/policies.md states the bound).
        """
        layer = call.layer
        dependent = False
        try:
            routing = self.routing_call(call, router_logits, correction_bias)
            dependent = self.dependent_launch(router_logits.device)
            ids, weights, keep = prune_route(
                routing,
                self.scope.cfg,
                fill_dropped=layer.fill_dropped,
                keep_out=layer.keep,
                metrics_row=self.metrics_row(layer),
                metrics_gate=self.metrics_gate if self.metrics_row(layer) is not None else None,
                workspace=self._workspace(router_logits),
                enable_pdl=dependent,
            )
            if model_routing is not None:
                model_ids, model_weights = model_routing()
                rows = model_routing_is_kept(router_logits, keep, routing.router, model_ids, model_weights)
                ids, weights, taken = adopt_model_routing(ids, weights, model_ids, model_weights, rows)
                # picks that tie with a kept expert join the mask (SGLang broke the tie the other way)
                num_experts = keep.shape[0]
                served = torch.where(taken[:, None] & (model_ids >= 0), model_ids.to(torch.int64), num_experts)
                joined = torch.zeros(num_experts + 1, dtype=torch.bool, device=keep.device)
                keep |= joined.scatter_(0, served.flatten(), True)[:num_experts]
        except Exception as exc:  # a pruner fault must never take the server down
            if dependent:
                # the next calls launch plainly: a driver or graph that refuses dependent launches
                # then costs one unpruned call, not every call
                self._dependent_launch[router_logits.device] = False
                logger.warning("xshare: dependent launches turned off on %s after a fault", router_logits.device)
            self.record_fault(layer, exc)
            return None
        try:
            self.add_request_experts(layer, ids, layer.num_experts)
        except Exception as exc:  # the call was routed; only its request metrics are lost
            self.record_fault(layer, exc)
        if self.recorder is not None and self.recorder.current is not None:
            self.recorder.record_keep(layer.row, layer.keep)
        return ids, weights

    def rewrite(self, call: ActiveCall, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Drop leftover picks of pruned experts and padding rows (in place); add the experts the
        rewritten ids activate to the layer's metrics (:meth:`select_and_mask`'s selection kernel
        added the kept experts, the retained mass and the call)."""
        if not call.masked:
            return
        layer = call.layer
        if self.recorder is not None and self.recorder.current is not None:
            self.recorder.record_keep(layer.row, layer.keep)
        p2l = None
        if call.ids_physical and self.physical_to_logical is not None:
            p2l = self.physical_to_logical(layer.layer_id)
        rewrite_routing(
            topk_ids,
            topk_weights,
            layer.keep,
            num_valid_tokens=call.num_valid,
            physical_to_logical=p2l,
            token_weights=call.token_weights,
            fill_dropped=layer.fill_dropped,
        )
        num_ids = layer.num_experts if p2l is None else p2l.shape[0]
        if self.metrics_row(layer) is not None:
            self.add_activated(layer, activated_experts(topk_ids, num_ids))
            self.add_request_experts(layer, topk_ids, num_ids)

    def _select_into_layer(self, call: ActiveCall, router_logits: torch.Tensor) -> None:
        """The call's keep mask into ``layer.keep`` (and, where a test set ``layer.stats``, its score
        totals there) in the select-only launch; raises on a fault, which the caller counts.  The
        selection kernel also adds the call's kept experts, retained mass and call count to the layer's
        metrics row; whoever routes the call adds its activated experts (:meth:`rewrite`,
        :meth:`count_kernel_routing`)."""
        layer = call.layer
        select_keep_mask(
            self.routing_call(call, router_logits),
            self.scope.cfg,
            out=layer.keep,
            stats_out=layer.stats,
            metrics_row=self.metrics_row(layer),
            metrics_gate=self.metrics_gate if self.metrics_row(layer) is not None else None,
            workspace=self._workspace(router_logits),
        )

    # ------------------------------------------------------------------ routing inside the MoE kernel
    def mask_for_kernel(
        self, call: ActiveCall, router_logits: torch.Tensor, correction_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Keep mask of a call SGLang routes inside the MoE kernel, and its router inputs masked.

        Parameters
        ----------
        call : ActiveCall
        router_logits : Tensor, shape [T, E]
            Left untouched.
        correction_bias : Tensor, shape [E], optional

        Returns
        -------
        (Tensor [T, E], Tensor [E] or None) or None
            A new tensor of masked logits, and the bias masked into the layer's buffer; None on any
            error (counted and logged): the call then runs unpruned on SGLang's own inputs.  Only
            substitution coverage can act here (the kernel leaves no step after its routing).
        """
        layer = call.layer
        try:
            if self.scope.cfg.coverage != "substitution":
                raise ValueError(f"{self.scope.cfg.coverage} coverage cannot act where the MoE kernel routes")
            self._select_into_layer(call, router_logits)
            masked = mask_router_inputs(
                router_logits, layer.keep, bias=correction_bias, bias_out=_masked_bias_buffer(layer, correction_bias)
            )
        except Exception as exc:  # a pruner fault must never take the server down
            self.record_fault(layer, exc)
            return None
        if self.recorder is not None and self.recorder.current is not None:
            self.recorder.record_keep(layer.row, layer.keep)
        return masked

    def count_kernel_routing(
        self,
        call: ActiveCall,
        *,
        expert_counts: torch.Tensor | None = None,
        masked_logits: torch.Tensor | None = None,
        masked_bias: torch.Tensor | None = None,
    ) -> None:
        """Add the activated experts of a call routed inside the MoE kernel to its layer's metrics row,
        on the device (:meth:`mask_for_kernel`'s selection kernel added the kept experts, the
        retained mass and the call itself).

        Activated experts come from the routing's own expert histogram ``expert_counts`` ([E] rows
        per expert, padding rows excluded: ``triton_kernels``' routing metadata), three small kernels,
        or, where the kernel routes out of sight, from the layer's reference router run on
        ``masked_logits`` [T, E] and ``masked_bias`` [E] (every expert a real token is sent to,
        weight-0 fillers of tokens with fewer than top-k kept experts included: the kernel reads
        them).  A failure is counted; the routing stands, and the call counts no activated experts.
        """
        layer = call.layer
        try:
            if expert_counts is None and masked_logits is None:
                raise ValueError("neither an expert histogram nor the masked logits of the call")
            if self.metrics_row(layer) is None:
                return  # nothing reads the metrics
            if expert_counts is not None:
                self.add_activated(layer, (expert_counts[: layer.num_experts] > 0).sum(dtype=torch.int64))
            else:
                router = layer.router if layer.router is not None else layer.selection_router
                bias = masked_bias if masked_bias is not None and masked_bias.dim() == 1 else None
                ids, _ = route_logits(
                    sanitize_logits(masked_logits),
                    torch.ones_like(layer.keep),
                    router,
                    coverage="substitution",
                    correction_bias=bias,
                )
                valid = valid_token_mask(ids.shape[0], call.num_valid, ids.device)[:, None]
                routed = torch.where(valid, ids, -1)
                self.add_activated(layer, activated_experts(routed, layer.num_experts))
                self.add_request_experts(layer, routed, layer.num_experts)
        except Exception as exc:  # the call was routed; only its activated count is lost
            self.record_fault(layer, exc)

    # ------------------------------------------------------------------ faults
    def record_fault(self, where: LayerState | str, exc: BaseException) -> None:
        """Count a pruner failure (the work it concerned goes on unpruned); log at most once a minute."""
        self.faults += 1
        now = time.monotonic()
        if now - self._last_fault_log >= FAULT_LOG_PERIOD_S:
            self._last_fault_log = now
            place = f"layer {where.layer_id}" if isinstance(where, LayerState) else where
            logger.error(
                "moe-pruner: selection failed in %s, routing left unpruned (%d failures so far): %s: %s",
                place,
                self.faults,
                type(exc).__name__,
                exc,
            )


def _masked_bias_buffer(layer: LayerState, correction_bias: torch.Tensor | None) -> torch.Tensor | None:
    """The layer's buffer [E] for its masked correction bias (allocated on first use); None without a
    one-dimensional bias."""
    if correction_bias is None or correction_bias.dim() != 1:
        return None
    if layer.masked_bias is None or layer.masked_bias.dtype != correction_bias.dtype:
        layer.masked_bias = torch.empty_like(correction_bias)
    return layer.masked_bias


def adaptive_steps(params: Any) -> dict[int, int]:
    """The step count in force per batch-size bucket of SGLang's ``AdaptiveSpeculativeParams``."""
    return {int(batch_size): int(slot.current_steps) for batch_size, slot in sorted(params._slots.items())}


_RUNTIME: PrunerRuntime | None = None


def get_runtime() -> PrunerRuntime | None:
    """The process's runtime, or None before the target model was loaded (or with the pruner off)."""
    return _RUNTIME


def set_runtime(runtime: PrunerRuntime | None) -> None:
    global _RUNTIME
    _RUNTIME = runtime
