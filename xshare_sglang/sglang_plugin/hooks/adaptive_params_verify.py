"""AROUND ``sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.on_verify_complete``
(checked: adaptive_spec_params.py:318, returns the new step count of the batch's bucket or None, called
after every verify from eagle_worker_v2.py:1767 with the accepted draft tokens per request; 0.5.23).

Why: the ``moe_pruner:speculative_steps`` gauges must follow SGLang's step changes (this is the one
place a bucket's step count changes); the expert-aware tiers need each verify's step count and
acceptance.
How: read the step count the batch's bucket ran with, run SGLang's update, then hand step count and
acceptance to the tiers (``PrunerRuntime.tiers``, with ``--moe-pruner-guard auto``), which may narrow
the buckets' candidates; on any change publish every bucket's step count again (host-side gauge sets
only).  A failure here is counted and leaves SGLang's update as it was.
Remove when: SGLang exports its adaptive step counts and takes a cost model for its tiers.
"""

from __future__ import annotations

from ..runtime import adaptive_steps, get_runtime

TARGET = "sglang.srt.speculative.adaptive_spec_params.AdaptiveSpeculativeParams.on_verify_complete"
KIND = "around"


def hook(original, self, num_correct_drafts_per_req, batch_size, *args, **kwargs):
    runtime = get_runtime()
    if runtime is None:
        return original(self, num_correct_drafts_per_req, batch_size, *args, **kwargs)
    ran = None
    try:
        ran = self.get_steps_for_batch(batch_size)
    except Exception as exc:
        runtime.record_fault("reading SGLang's adaptive step count", exc)
    result = original(self, num_correct_drafts_per_req, batch_size, *args, **kwargs)
    changed = result is not None
    try:
        if runtime.tiers is not None and ran is not None:
            changed |= runtime.tiers.on_verify(batch_size, ran, list(num_correct_drafts_per_req))
        if changed and runtime.reporter is not None:
            runtime.reporter.export_adaptive_steps(adaptive_steps(self))
            if runtime.tiers is not None:
                runtime.reporter.export_tiers(runtime.tiers.decisions)
    except Exception as exc:  # the tiers and gauges stay as they were; SGLang's update stands
        runtime.record_fault("the expert-aware speculation tiers", exc)
    return result
