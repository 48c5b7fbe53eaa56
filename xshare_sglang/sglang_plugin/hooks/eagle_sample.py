"""AFTER ``sglang.srt.speculative.eagle_utils.eagle_sample`` (checked: eagle_utils.py:521, returns
``(predict, accept_lens, accept_index)`` at l.854, called at eagle_worker_common.py:676; 0.5.23).

Why: ECHO's gates are calibrated offline from draft confidences paired with how much of each draft
was accepted; this is the first place both are known.
How: for verify inputs that carry an ECHO plan (set by the ``build_eagle_verify_input`` hook), hand
the confidence and ``accept_lens - 1`` (draft tokens accepted, the bonus excluded) to the log writer,
which samples, copies without blocking and writes on its own thread.  Nothing is returned, so the
result is SGLang's.
Remove when: SGLang logs per-depth draft confidences itself.
"""

from __future__ import annotations

from ..echo_runtime import get_echo_runtime
from .eagle_build_verify_input import PLAN_ATTRIBUTE

TARGET = "sglang.srt.speculative.eagle_utils.eagle_sample"
KIND = "after"


def hook(result, *args, **kwargs):
    runtime = get_echo_runtime()
    if runtime is None or runtime.log is None:
        return None
    verify_input = args[0] if args else kwargs.get("verify_input")
    plan = getattr(verify_input, PLAN_ATTRIBUTE, None)
    if plan is None:
        return None
    try:
        accept_lens = result[1]
        confidence = plan.confidence
        shape = (confidence.shape[1], int(verify_input.topk), int(verify_input.draft_token_num))
        runtime.log.offer(shape, confidence, accept_lens[: confidence.shape[0]] - 1)
    except Exception as exc:
        runtime.record_fault("logging an ECHO calibration record", exc)
    return None
