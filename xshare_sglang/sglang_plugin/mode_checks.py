"""SGLang serving modes the pruner cannot honour exactly, refused when the server arguments are parsed.

Each check reads the operator's arguments as typed (SGLang resolves defaults later, and keeps the
resolved values apart from ``ServerArgs``), and returns one message naming both flags and what to
do instead; the launch then ends with exit code 2.  What is refused, and why:

* attention data parallelism with the standard MoE path: the MoE layer sees the batch gathered
  from every DP rank, one padded slot per rank, while SGLang hands the router no count of real rows;
  the pruner would treat other ranks' tokens as padding and each rank could keep a different set
  of experts for the same tokens.  (With a DeepEP all-to-all each rank routes only its own tokens,
  and the pruner selects per rank: accepted.)
* all-to-all backends other than none / DeepEP: their dispatch of dropped (``-1``) slots and their
  expert numbering are not verified;
* shared-expert fusion forced next to a DeepEP all-to-all (``--enforce-shared-experts-fusion``, or
  ``--enable-waterfill`` which forces it): the shared expert takes per-rank slots and the routed ids
  are renumbered around them (the model-load check refuses the same layout when a model fuses on
  its own);
* elastic expert parallelism: it replaces SGLang's expert placement while serving, under the
  pruner's per-layer maps;
* pruning prefill (``extend`` / ``mixed`` phases) while SGLang captures prefill CUDA graphs: the
  graphs are captured without the pruner, so prefill would silently run unpruned;
* prefill-decode multiplexing (``--enable-pdmux``) with both a prefill phase and a decode-side phase
  pruned: SGLang then issues a decode forward and a prefill forward on two streams that run at the
  same time, and both would write the same layers' keep masks and metrics.  (Every other mode issues
  the routing calls of one process in order: the side streams of dual-stream MoE, two-batch and
  single-batch overlap, EAGLE's planning stream and the overlap scheduler fork and join around the
  shared expert or communication, never around two routing calls.  The selection kernels' scratch
  memory is kept per stream in any case.)
* ``--enable-deterministic-inference`` with any policy but ``none``: SGLang's deterministic mode
  promises that a request's output does not depend on the rest of the batch, and a keep mask chosen
  for the batch breaks that promise (docs/serving.md, "Batch dependence");
* ``xshare-ep`` without expert parallelism (``--ep-size 1``): its rounds balance the kept experts over
  expert-parallel ranks, and there are none (the model-load check refuses the same);
* ``--enable-torch-compile``: the compiled decode forward traces through the routing hooks (guards
  on the pruner's state, graph breaks around its kernels), which has not been shown to replay the
  same routing as an eager pruned forward; on the CPU engine its graph mode also needs an attention
  backend whose padded rows the pruner would count as real.
"""

from __future__ import annotations

from typing import Any

from .flag_table import FLAG_PREFIX, VERIFY_FLAG
from .settings import PluginSettings

#: ``--moe-a2a-backend`` values the pruner is exact with (standard dispatch, DeepEP).
ACCEPTED_A2A_BACKENDS = ("none", "deepep", "deepep_v2")
PREFILL_PHASES = ("extend", "mixed")
DECODE_PHASES = ("decode", "verify")
PHASES_FLAG = FLAG_PREFIX + "-phases"


def _value(args: Any, name: str, default: Any = None) -> Any:
    value = getattr(args, name, default)
    return default if value is None else getattr(value, "value", value)


def attention_dp_size(args: Any) -> int:
    """Attention data-parallel ranks as typed: ``--attn-dp-size``, or the deprecated spelling
    ``--enable-dp-attention --dp-size N``."""
    size = int(_value(args, "attn_dp_size", 1) or 1)
    if _value(args, "enable_dp_attention", False):
        size = max(size, int(_value(args, "dp_size", 1) or 1))
    return size


def prefill_graphs_on(args: Any) -> bool:
    """Whether SGLang may capture prefill CUDA graphs (its default on CUDA: the breakable backend)."""
    if str(_value(args, "device", "cuda") or "cuda") == "cpu":
        return False
    if _value(args, "disable_cuda_graph", False) or _value(args, "disable_prefill_cuda_graph", False):
        return False
    backend = _value(args, "cuda_graph_backend_prefill")
    if backend is None:
        config = _value(args, "cuda_graph_config")
        prefill = config.get("prefill") if isinstance(config, dict) else getattr(config, "prefill", None)
        backend = prefill.get("backend") if isinstance(prefill, dict) else getattr(prefill, "backend", None)
    return str(getattr(backend, "value", backend) or "").lower() != "disabled"


def unsupported_mode_reason(args: Any, settings: PluginSettings) -> str | None:
    """Why the pruner cannot serve with these server arguments; None when it can."""
    if not settings.enabled:
        return None
    flag = FLAG_PREFIX
    a2a = str(_value(args, "moe_a2a_backend", "none") or "none")
    dp = attention_dp_size(args)
    if dp > 1 and a2a == "none":
        return (
            f"{flag} cannot run with attention data parallelism (--attn-dp-size / --enable-dp-attention "
            f"--dp-size {dp}) on the standard MoE path: the MoE layer sees every DP rank's tokens gathered "
            "with padding SGLang does not count, so the ranks could keep different experts for the same "
            "tokens. Serve without attention DP, or with --moe-a2a-backend deepep (each rank then prunes "
            "its own tokens)"
        )
    if a2a not in ACCEPTED_A2A_BACKENDS:
        return (
            f"{flag} does not support --moe-a2a-backend {a2a}: the pruner is verified with "
            f"{', '.join(ACCEPTED_A2A_BACKENDS)}. Use one of those, or serve without {flag}"
        )
    waterfill = _value(args, "enable_waterfill", False)
    if waterfill or (a2a != "none" and _value(args, "enforce_shared_experts_fusion", False)):
        option = "--enable-waterfill" if waterfill else f"--enforce-shared-experts-fusion with --moe-a2a-backend {a2a}"
        return (
            f"{flag} does not support {option}: the shared expert then takes "
            "per-rank expert slots whose renumbered ids the pruner does not map. Drop that option (or serve "
            f"without {flag})"
        )
    elastic = _value(args, "elastic_ep_backend")
    if elastic is not None and str(elastic) != "none":
        return (
            f"{flag} does not support elastic expert parallelism (--elastic-ep-backend {elastic}), which "
            "replaces the expert placement while serving; serve without one of the two"
        )
    ep_size = int(_value(args, "ep_size", 1) or 1)
    ep_phases = [phase for phase, cfg in settings.phase_configs().items() if cfg.policy == "xshare-ep"]
    if ep_phases and ep_size <= 1:
        source = flag if settings.pruner.policy == "xshare-ep" else VERIFY_FLAG
        return (
            f"{source} xshare-ep balances the kept experts over expert-parallel ranks, but this server runs "
            f"with --ep-size {ep_size}; use {source} xshare, or start with --ep-size > 1"
        )
    if _value(args, "enable_torch_compile", False):
        return (
            f"{flag} does not support --enable-torch-compile yet (compiled graphs through the routing hooks are "
            "not verified to route as the eager pruner does); serve without one of the two"
        )
    pruned_prefill = [p for p in PREFILL_PHASES if settings.config_for(p) is not None]
    pruned_decode = [p for p in DECODE_PHASES if settings.config_for(p) is not None]
    if pruned_prefill and pruned_decode and _value(args, "enable_pdmux", False):
        return (
            f"{PHASES_FLAG} {','.join(pruned_decode + pruned_prefill)} with --enable-pdmux: SGLang runs prefill and "
            "decode forwards at the same time on two streams, and both would write the same layers' pruning "
            f"state. Leave {', '.join(pruned_prefill)} out of {PHASES_FLAG} (the default phases are decode,verify), "
            "or serve without --enable-pdmux"
        )
    phase_configs = [settings.config_for(p) for p in (*DECODE_PHASES, *PREFILL_PHASES)]
    batch_level = sorted({cfg.policy for cfg in phase_configs if cfg is not None} - {"none"})
    if batch_level and _value(args, "enable_deterministic_inference", False):
        return (
            f"{flag} {','.join(batch_level)} with --enable-deterministic-inference: the pruner chooses one set of "
            "experts for the whole batch, so a request's output depends on what else is batched with it, "
            f"which deterministic inference exists to rule out. Serve without one of the two ({flag} none keeps "
            "the plugin loaded and prunes nothing)"
        )
    if pruned_prefill and prefill_graphs_on(args):
        return (
            f"{PHASES_FLAG} {','.join(pruned_prefill)}: SGLang captures its prefill CUDA graphs "
            "without the pruner, so prefill would run unpruned. Add --cuda-graph-backend-prefill disabled, "
            f"or leave {', '.join(pruned_prefill)} out of {PHASES_FLAG}"
        )
    return None
