"""Checks of a running SGLang server before ``xshare-sglang calibrate`` touches its recorder.

:func:`check_server` reads the server's ``/server_info``: it refuses a server started without an
expert-distribution recorder (asked to record, such a server shuts down; see
:mod:`~xshare_sglang.serving.calibration.recorder_client`) or with EPLB, and warns when the recorder
keeps only the last passes or when the server's launch command turns the pruner on
(:func:`launch_pruner`).  Calibration must run with the pruner off: the plugin rewrites pruned picks
to ``-1`` before SGLang's recorder sees the top-k ids, and the recorder skips ids below zero, so a
pruning server would count only what it already keeps.  Settings passed through the environment
(``XSHARE_MOE_PRUNER_CONFIG``) do not appear in the launch command.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ...errors import ConfigError
from ...sglang_plugin.flag_table import CONFIG_FLAG, FLAG_PREFIX, VERIFY_FLAG
from ...sglang_plugin.launch_command import typed_settings_of_command
from ...sglang_plugin.settings import phase_policies
from .recorder_client import RECORDER_MODES
from .recorder_dump import CalibrationError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaunchPruner:
    """What a server's launch command says about the MoE pruner.

    Attributes
    ----------
    active : tuple of str
        Each place that sets a policy other than ``none``, as it reads in the command, e.g.
        ``"--moe-pruner xshare"``, ``"--moe-pruner-config policy xshare"`` or
        ``"--moe-pruner-config policy xshare-spec in the verify phase"``.
    unknown : str or None
        Why the command leaves the pruner undecided: a ``--moe-pruner-config`` that names a file (on
        the server's machine) or holds text that is not a JSON object; None when nothing is unknown.
    """

    active: tuple[str, ...] = ()
    unknown: str | None = None


def launch_pruner(launch_command: Any) -> LaunchPruner:
    """Where a server's launch command (``/server_info``'s ``launch_command``) turns the pruner on.

    The command's pruner flags are read by the plugin's own parser and merged as the server merged
    them (an explicit ``--moe-pruner`` over ``--moe-pruner-config``; a phase override's policy over
    the top-level one).  A ``--moe-pruner-config`` that names a file on the server's machine leaves
    the answer unknown.

    Parameters
    ----------
    launch_command : any
        The command as SGLang reports it; anything but a string reads as "no pruner".

    Returns
    -------
    LaunchPruner
    """
    if not isinstance(launch_command, str):
        return LaunchPruner()
    try:
        typed = typed_settings_of_command(launch_command)
    except ConfigError as exc:
        return LaunchPruner(unknown=str(exc))
    if typed is None:
        return LaunchPruner()
    active: list[str] = []
    for phase, (policy, key) in phase_policies(typed.data).items():
        if policy == "none":
            continue
        source, _ = typed.blame(key)
        if source in (FLAG_PREFIX, VERIFY_FLAG):  # the flag is the policy: "--moe-pruner xshare"
            where = f"{source} {policy}"
        else:
            where = f"{source} policy {policy}" + ("" if key == "policy" else f" in the {phase} phase")
        if where not in active:
            active.append(where)
    return LaunchPruner(active=tuple(active))


def check_server(info: dict[str, Any] | None, url: str) -> str | None:
    """Check a server's ``/server_info`` before touching its recorder.

    Parameters
    ----------
    info : dict or None
        The server's ``/server_info`` (None when it did not answer one).
    url : str
        For messages.

    Returns
    -------
    str or None
        The recorder mode, or None when the server does not report one (then the start call decides).

    Raises
    ------
    CalibrationError
        The server runs without a recorder, or with EPLB (which resets the recorder at every rebalance).
    """
    if info is None or "expert_distribution_recorder_mode" not in info:
        logger.warning(
            "%s does not report expert_distribution_recorder_mode in /server_info; trying the recorder anyway "
            "(a server started without --expert-distribution-recorder-mode stops when asked to record)",
            url,
        )
        return None
    mode = info.get("expert_distribution_recorder_mode")
    if mode is None:
        raise CalibrationError(
            f"the server at {url} was started without an expert-distribution recorder; restart it with "
            "--expert-distribution-recorder-mode stat --expert-distribution-recorder-buffer-size -1 "
            "(and the pruner off). Not calling the recorder endpoints: on such a server the scheduler raises "
            "'Please set ServerArgs.expert_distribution_recorder_mode' and the server shuts down."
        )
    if mode not in RECORDER_MODES:
        logger.warning("unknown recorder mode %r (SGLang 0.5.23 has %s)", mode, ", ".join(RECORDER_MODES))
    if info.get("enable_eplb"):
        raise CalibrationError(
            f"the server at {url} runs with --enable-eplb: every rebalance dumps and resets the recorder and "
            "moves experts, so the counts would cover only the passes since the last one. Calibrate on a "
            "server started without --enable-eplb."
        )
    buffer_size = info.get("expert_distribution_recorder_buffer_size")
    if mode in ("stat", "stat_approx") and isinstance(buffer_size, int) and buffer_size >= 0:
        logger.warning(
            "the recorder keeps only the last %d forward passes (--expert-distribution-recorder-buffer-size %d); "
            "older passes of the workload are overwritten. Start the server with "
            "--expert-distribution-recorder-buffer-size -1 to count all of them.",
            buffer_size,
            buffer_size,
        )
    pruner = launch_pruner(info.get("launch_command"))
    if pruner.active:
        logger.warning(
            "the server was launched with the pruner on (%s): pruned picks reach the recorder as -1 and are not "
            "counted, which biases the ranking towards what the pruner keeps. Calibrate with the pruner off: "
            "--moe-pruner none and no %s policy other than none.",
            "; ".join(pruner.active),
            CONFIG_FLAG,
        )
    if pruner.unknown is not None:
        logger.warning(
            "cannot tell whether the server runs the pruner: %s. If it sets a policy other than none, pruned "
            "picks reach the recorder as -1 and are not counted, which biases the ranking towards what the "
            "pruner keeps; calibrate with the pruner off.",
            pruner.unknown,
        )
    return mode
