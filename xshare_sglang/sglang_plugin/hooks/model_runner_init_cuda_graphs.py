"""BEFORE ``sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs`` (checked:
model_runner.py:1170, called from scheduler.py:1124 after the KV-cache pools and attention backends
exist, on every device, also where no graph is captured; 0.5.23).

Why: ``--moe-pruner-guard auto`` must time the model's MoE layers on the real backend with the
server's own request limit, which SGLang resolves only when it allocates the KV-cache pools (after
``ModelRunner.__init__``), and it must decide before any decode graph is captured, so that each graph
is captured with its bucket's decision.
How: for the target ModelRunner only, once (a later recapture keeps the first decision): run the guard
(``guard.run_guard``) into ``PrunerRuntime.guard`` and publish its gauges; under
``--speculative-adaptive`` (SGLang built its ``AdaptiveSpeculativeParams`` with the workers, before
this) start the expert-aware tiers from the guard's timings (``adaptive_tiers``).  A guard that cannot time
stops the server with a message instead of serving on a guess.
Remove when: SGLang offers a plugin event between memory-pool allocation and graph capture.
"""

from __future__ import annotations

from ..model_layers import PrunerSetupError
from ..runtime import get_runtime

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_cuda_graphs"
KIND = "before"


def hook(self, *args, **kwargs):
    runtime = get_runtime()
    if runtime is None or runtime.runner is not self or runtime.guard is not None:
        return None
    if runtime.settings.guard != "auto":
        return None
    from ..guard import run_guard

    try:
        runtime.guard = run_guard(runtime, self)
    except PrunerSetupError:
        raise
    except Exception as exc:
        raise PrunerSetupError(
            f"moe-pruner guard: timing the MoE layers failed ({type(exc).__name__}: {exc}); start without "
            "--moe-pruner-guard, or with a --moe-pruner-guard-trace recorded on this model"
        ) from exc
    if runtime.reporter is not None:
        runtime.reporter.export_guard(runtime.guard)
    if runtime.adaptive is not None:
        from ..adaptive_tiers import start_tiers

        start_tiers(runtime)
    return None
