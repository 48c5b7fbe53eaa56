"""AFTER ``sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.on_verify_complete``
(checked: adaptive_spec_params.py:318, returns the new step count of the batch's bucket or None, called
after every verify from eagle_worker_v2.py:1767; 0.5.23).

Why: the ``moe_pruner:speculative_steps`` gauges must follow SGLang's step changes; this is the one
place a bucket's step count changes (switching buckets as the batch size moves changes none).
How: when SGLang reports a change, publish every bucket's step count again (a few host-side gauge
sets, only on a change).
Remove when: SGLang exports its adaptive step counts as metrics.
"""

from __future__ import annotations

from ..runtime import adaptive_steps, get_runtime

TARGET = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.on_verify_complete"
KIND = "after"


def hook(result, self, *args, **kwargs):
    runtime = get_runtime()
    if result is None or runtime is None or runtime.reporter is None:
        return None
    try:
        runtime.reporter.export_adaptive_steps(adaptive_steps(self))
    except Exception as exc:  # the gauges keep their last values; serving is unaffected
        runtime.record_fault("publishing the adaptive step counts", exc)
    return None
