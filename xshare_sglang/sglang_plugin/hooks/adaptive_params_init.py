"""AFTER ``sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.__init__`` (checked:
adaptive_spec_params.py:276, built by eagle_worker_v2.py:1349 after the target worker, so after the
pruner's runtime; its per-bucket slots are ``_slots``; 0.5.23).

Why: operators of ``--speculative-adaptive`` want the step count in force per batch-size bucket next to
the experts each step reads; SGLang keeps it in this object and logs only its changes.
How: in the scheduler process that holds the pruner's runtime, keep a reference to the object
(``PrunerRuntime.adaptive``), log its buckets' step counts once and publish them as the
``moe_pruner:speculative_steps`` gauges.  The server-argument check builds one too, in a process
without a runtime: nothing happens there.
Remove when: SGLang exports its adaptive step counts as metrics.
"""

from __future__ import annotations

import logging

from ..runtime import adaptive_steps, get_runtime

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.__init__"
KIND = "after"


def hook(result, self, *args, **kwargs):
    runtime = get_runtime()
    if runtime is None:
        return None
    runtime.adaptive = self
    try:
        steps = adaptive_steps(self)
    except Exception as exc:  # the gauges stay unset; serving is unaffected
        runtime.record_fault("reading SGLang's adaptive speculation buckets", exc)
        return None
    logger.info("moe-pruner: --speculative-adaptive steps per batch-size bucket at start: %s", steps)
    if runtime.reporter is not None:
        runtime.reporter.export_adaptive_steps(steps)
    return None
