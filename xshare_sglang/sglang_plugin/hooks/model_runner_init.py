"""AFTER ``sglang.srt.model_executor.model_runner.ModelRunner.__init__`` (checked:
model_runner.py:344; graphs are captured later, from scheduler.py:1124, 0.5.23).

Why: the pruner needs the loaded target model (its MoE layers, top-k, expert counts, routing
format) to check the config and allocate its buffers before any CUDA graph is captured, and it must
take part in those captures.
How: for the target ModelRunner only (never the draft worker): build the runtime (a config the
model cannot take stops the server here with a clear message), append a head hook and a tail hook to
``capture_head_hooks`` / ``capture_tail_hooks`` (called inside every decode/verify graph capture,
decode_cuda_graph_runner.py:1411 and :1470), verify every routing hook is in place and log the
proof-of-life line ``moe-pruner active: policy=... config=... hooks=[...]``; warn when the model class
left ``lm_head`` untied although the checkpoint asks for tying (see ``model_checks``).
Remove when: SGLang offers a model-loaded plugin event and a per-forward context plugins can extend.
"""

from __future__ import annotations

import logging
import os

import torch

from .. import liveness
from ..forward_phases import decode_graphs_on, pruned_phase, verify_widths
from ..metrics import MetricsReporter
from ..model_checks import untied_lm_head_problem
from ..model_layers import PrunerSetupError, build_runtime
from ..runtime import get_runtime, set_runtime
from ..settings import ADAPTIVE_ENV_VAR, settings_from_env
from ..verify_scope import graph_scope

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.__init__"
KIND = "after"


def capture_head(graph_runner, forward_batch) -> None:
    """Start of a decode/verify graph capture (and of its warm-up runs): publish the graph's scope."""
    runtime = get_runtime()
    if runtime is None:
        return
    buffer = runtime.num_valid_buffer
    if not (buffer.is_cuda and torch.cuda.is_current_stream_capturing()):
        # warm-up runs: every captured row is real; inside the capture the buffer must not be
        # written (the fill would be recorded and replayed over the real count)
        buffer.fill_(forward_batch.input_ids.shape[0])
    try:
        scope = graph_scope(runtime, graph_runner, forward_batch)
    except Exception as exc:  # this graph is captured unpruned rather than not at all
        runtime.record_fault(f"the capture of a {graph_runner.capture_forward_mode} graph", exc)
        scope = None
    key = (
        pruned_phase(graph_runner.capture_forward_mode, graph_runner.captured_req_width),
        forward_batch.input_ids.shape[0],
    )
    runtime.graph_pruned[key] = scope is not None and scope.cfg is not None
    runtime.enter(scope)


def capture_tail(graph_runner, out, forward_batch, num_tokens) -> None:
    runtime = get_runtime()
    if runtime is not None:
        runtime.leave(None)


def hook(result, self, *args, **kwargs):
    if self.is_draft_worker:
        return None
    settings = settings_from_env()
    if settings is None or not settings.active:
        return None
    _warn_untied_lm_head(self)
    if settings.echo_active:
        _start_echo(self)
    if not settings.enabled and settings.trace_dir is None:
        return None
    from sglang.srt.runtime_context import get_parallel

    from . import ADAPTIVE_HOOKS, ROUTING_HOOKS

    hooked = ROUTING_HOOKS + (ADAPTIVE_HOOKS if os.environ.get(ADAPTIVE_ENV_VAR) == "1" else ())
    missing = liveness.unhooked(hooked)
    if missing:
        raise PrunerSetupError(f"moe-pruner: hooks not in place, refusing to start: {', '.join(missing)}")
    parallel = get_parallel()
    runtime = build_runtime(settings, self.model, self.device, ep_size=parallel.moe_ep_size)
    runtime.runner = self
    runtime.reporter = MetricsReporter(
        runtime,
        prometheus=_metrics_enabled(),
        labels={"tp_rank": str(parallel.tp_rank)},
        draft_tokens=verify_widths(getattr(self, "server_args", None)),
    )
    if settings.trace_dir is not None:
        runtime.recorder = _trace_recorder(settings, runtime, self, rank=parallel.tp_rank)
    set_runtime(runtime)
    self.capture_head_hooks.append(capture_head)
    self.capture_tail_hooks.append(capture_tail)
    logger.info(
        "moe-pruner active: policy=%s config=%s layers=%d rank=%s hooks=[%s]",
        settings.policy_names(),
        settings.summary(),
        len(runtime.layers),
        rank_label(parallel),
        ", ".join(module.TARGET.rsplit(".", 2)[-2] + "." + module.TARGET.rsplit(".", 1)[-1] for module in hooked),
    )
    return None


def _warn_untied_lm_head(runner) -> None:
    try:
        problem = untied_lm_head_problem(runner.model, runner.model_config.hf_config)
    except Exception as exc:  # a check that cannot run must not stop the server
        logger.debug("moe-pruner: lm_head tying not checked: %s", exc)
        return
    if problem is not None:
        logger.warning("moe-pruner: %s", problem)


def _start_echo(runner) -> None:
    """Prove the ECHO hooks are live, build the runtime and size its candidate buffers before the
    draft CUDA graphs are captured."""
    from ..echo_runtime import get_echo_runtime
    from . import ECHO_HOOKS

    missing = liveness.unhooked(ECHO_HOOKS)
    if missing:
        raise PrunerSetupError(f"xshare-echo: hooks not in place, refusing to start: {', '.join(missing)}")
    echo = get_echo_runtime()
    steps, topk, rows = draft_tree_limits()
    if echo is not None and steps and topk and topk > 1:
        echo.reserve(rows, steps, topk, runner.device)
        logger.info("xshare-echo: candidate buffers for %d draft rows (%d steps, top-%d)", rows, steps, topk)
    logger.info(
        "xshare-echo active: %s hooks=[%s]",
        "scheduling" if echo is not None and echo.calibration is not None else "logging only",
        ", ".join(module.TARGET.rsplit(".", 1)[-1] for module in ECHO_HOOKS),
    )


def draft_tree_limits() -> tuple[int, int, int]:
    """``(steps, topk, rows)`` of the EAGLE drafts this server runs, as SGLang resolved them.

    ``rows`` bounds the requests of one draft step, in a replayed draft graph (its largest batch,
    at most the decode graphs' ``max_bs``) and eagerly (at most the running-request limit): the
    bound SGLang sizes its own persistent draft buffers with.  The operator's ``ServerArgs`` hold only
    what was typed; resolved values live in SGLang's config bags.
    """
    from sglang.srt.runtime_context import get_exec, get_schedule, get_spec

    spec = get_spec()
    graphs = get_exec().graph.cuda_graph_config
    decode_max_bs = getattr(getattr(graphs, "decode", None), "max_bs", None) or 0
    rows = max(int(decode_max_bs), int(get_schedule().max_running_requests or 0), 1)
    return int(spec.speculative_num_steps or 0), int(spec.speculative_eagle_topk or 0), rows


def rank_label(parallel) -> str:
    """This process's place in the server, as the proof-of-life line names it: ``tp0/2,ep0/1``
    (tensor-parallel rank of size, expert-parallel rank of size), plus ``pp1/2`` under pipeline
    parallelism.  ``parallel`` is SGLang's ``get_parallel()`` (ModelRunner keeps no rank in 0.5.23)."""
    label = f"tp{parallel.tp_rank}/{parallel.tp_size},ep{parallel.moe_ep_rank}/{parallel.moe_ep_size}"
    pp_size = getattr(parallel, "pp_size", 1) or 1
    return label + (f",pp{parallel.pp_rank}/{pp_size}" if pp_size > 1 else "")


def _trace_recorder(settings, runtime, runner, *, rank: int):
    """The recorder of ``--moe-pruner-trace-dir``, described by the model's first MoE layer; ``rank``
    (the tensor-parallel rank) names its files."""
    from ...replay.trace import TraceMeta
    from ..model_layers import expert_bytes_by_layer
    from ..trace_recorder import TraceRecorder

    states = sorted(runtime.layers.values(), key=lambda state: state.row)
    sizes = expert_bytes_by_layer(runner.model)
    server_args = _server_args()
    meta = TraceMeta(
        model=str(getattr(server_args, "model_path", None) or type(runner.model).__name__),
        num_layers=len(states),
        num_experts=states[0].num_experts,
        top_k=states[0].top_k,
        expert_bytes=tuple(sizes.get(state.layer_id, 0) for state in states),
        scoring=states[0].scoring if states[0].scoring in ("softmax", "sigmoid") else "softmax",
        renormalize=bool(getattr(states[0].topk_config, "renormalize", True)),
    )
    recorder = TraceRecorder(
        settings.trace_dir,
        meta,
        every=settings.trace_every,
        max_bytes=settings.trace_max_mb * 2**20,
        rank=rank,
    )
    logger.info(
        "moe-pruner: recording router logits of 1 in %d eager decode/verify forwards into %s (up to %d MiB)",
        settings.trace_every,
        settings.trace_dir,
        settings.trace_max_mb,
    )
    if server_args is not None and decode_graphs_on(server_args):
        logger.warning(
            "moe-pruner: CUDA graphs are on, so decode forwards replayed from a graph are not recorded; "
            "add --disable-cuda-graph to a recording run"
        )
    return recorder


def _server_args():
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # no published server args (tests, offline use)
        return None


def _metrics_enabled() -> bool:
    try:
        from sglang.srt.runtime_context import get_server_args

        return bool(get_server_args().enable_metrics)
    except Exception:  # no published server args (tests, offline use)
        return False
