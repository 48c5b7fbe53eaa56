"""Map SGLang's forward modes to the pruner's phases (forward_batch_info.py:198, 0.5.23)."""

from __future__ import annotations


def phase_of(forward_mode) -> str | None:
    """``decode``, ``verify``, ``extend``, ``mixed``, or None for modes the pruner never touches
    (idle, draft extend, prebuilt, dLLM)."""
    if forward_mode is None:
        return None
    name = getattr(forward_mode, "name", str(forward_mode))
    return {
        "DECODE": "decode",
        "TARGET_VERIFY": "verify",
        "EXTEND": "extend",
        "SPLIT_PREFILL": "extend",
        "MIXED": "mixed",
    }.get(name)
