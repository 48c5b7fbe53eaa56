"""Server configurations ECHO can run in, checked when the server arguments are parsed."""

from __future__ import annotations

from ..spec.echo import EchoCalibration
from ..spec.echo.settings import EchoSettings
from .flag_table import ECHO_FLAGS

EAGLE_ALGORITHMS = ("EAGLE", "EAGLE3")


def echo_unsupported_reason(server_args, echo: EchoSettings) -> str | None:
    """Why ``--xshare-echo-*`` cannot run with these server arguments; None when it can.

    The message names the flag to change.
    """
    flag = ECHO_FLAGS["calibration"] if echo.scheduling else ECHO_FLAGS["log_dir"]
    algorithm = str(getattr(server_args, "speculative_algorithm", None) or "").upper()
    if algorithm not in EAGLE_ALGORITHMS:
        return (
            f"{flag} needs EAGLE tree speculative decoding: --speculative-algorithm "
            f"{' or '.join(EAGLE_ALGORITHMS)}, got {algorithm or 'none'}"
        )
    steps = getattr(server_args, "speculative_num_steps", None)
    topk = getattr(server_args, "speculative_eagle_topk", None)
    draft_tokens = getattr(server_args, "speculative_num_draft_tokens", None)
    if not steps or not topk or not draft_tokens:
        return (
            f"{flag} needs the draft tree's shape set explicitly: --speculative-num-steps, "
            "--speculative-eagle-topk and --speculative-num-draft-tokens (SGLang otherwise chooses them later)"
        )
    if topk == 1:
        return (
            f"{flag} needs a draft tree, --speculative-eagle-topk > 1: with topk = 1 every request drafts one "
            "chain whose draft probabilities SGLang never computes, so there is no confidence to gate on"
        )
    if getattr(server_args, "speculative_adaptive", False):
        return f"{flag} cannot run with --speculative-adaptive (both decide the draft budget; adaptive needs topk = 1)"
    if getattr(server_args, "enable_multi_layer_eagle", False):
        return f"{flag} does not support --enable-multi-layer-eagle (its worker builds verify trees differently)"
    if int(getattr(server_args, "pp_size", 1) or 1) > 1:
        return f"{flag} does not support pipeline parallelism (--pp-size > 1 rebuilds verify trees on every stage)"
    if draft_tokens - 1 > topk + (steps - 1) * topk * topk:
        return f"{flag}: --speculative-num-draft-tokens {draft_tokens} exceeds the {steps}-step top-{topk} tree"
    if echo.scheduling:
        try:
            calibration = EchoCalibration.load(echo.calibration)
        except ValueError as exc:
            return f"{ECHO_FLAGS['calibration']}: {exc}"
        if calibration.num_steps != steps:
            return (
                f"{ECHO_FLAGS['calibration']}: calibrated for {calibration.num_steps} draft steps, the server drafts "
                f"{steps} (--speculative-num-steps); recalibrate with a log of this configuration"
            )
        if echo.budget is not None and echo.budget > draft_tokens - 1:
            return (
                f"{ECHO_FLAGS['budget']} {echo.budget}: at most --speculative-num-draft-tokens minus 1 "
                f"({draft_tokens - 1}) nodes fit a request's verify slots"
            )
    return None
