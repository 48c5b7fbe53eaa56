"""Start, watch, question and stop one SGLang server for the A/B tool.

A launched server runs in its own process group with its output in a log file, so that stopping it
(SIGTERM to the group, SIGKILL after a grace period) also ends SGLang's scheduler and detokenizer
processes, and the plugin's proof-of-life line can be read back from the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import requests

from ...sglang_plugin.settings import ENV_VAR
from .ab_plan import PROOF_PREFIX

logger = logging.getLogger(__name__)

_PROOF = re.compile(re.escape(PROOF_PREFIX) + r"(\S+)")
# The plugin's Prometheus gauges (``--enable-metrics``), one series per MoE layer and TP rank.
PRUNER_GAUGES = {
    "moe_pruner:activated_experts": "activated_experts",
    "moe_pruner:kept_experts": "kept_experts",
    "moe_pruner:retained_score_mass": "retained_score_mass",
}
#: per-layer count of pruned calls reported so far: 0 means the gauges of that layer are still unset
PRUNER_LAYER_CALLS = "moe_pruner:layer_calls_total"
#: the activated experts of speculative verify calls alone (per layer, label phase="verify"), and their calls
VERIFY_GAUGE = ("moe_pruner:phase_activated_experts", "moe_pruner:phase_layer_calls_total")


def server_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a launched server: the caller's, without the plugin's configuration variable.

    Arms set the pruner only through their flags; an inherited ``XSHARE_MOE_PRUNER_CONFIG`` would
    silently prune the baseline.
    """
    env = dict(os.environ if environ is None else environ)
    env.pop(ENV_VAR, None)
    return env


#: Ports :func:`launch_port` picks from: below the kernel's ephemeral range (where ``bind(0)`` and
#: outgoing connections take their ports) and below the 22000-29999 that SGLang draws its own
#: ``nccl_port`` from, so nothing else takes the port while the server starts.
LAUNCH_PORT_RANGE = (10000, 21999)


def launch_port() -> int:
    """A free TCP port for a server that binds it only once it has started.

    A port from ``bind(0)`` is an ephemeral one: in the seconds before the launched server binds it,
    any process may be handed it, for a listening socket or an outgoing connection (the CPU
    engine's gloo sockets do both), and the server then fails with "address already in use".  SGLang
    keeps the ports its children bind later out of that range for the same reason; this uses its
    helper, with :data:`LAUNCH_PORT_RANGE`.

    Returns
    -------
    int
        A port no socket was bound to when it was checked.
    """
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    low, high = LAUNCH_PORT_RANGE
    return get_free_port_below_ephemeral(low=low, high=high)


def proof_policies(log_text: str) -> list[str]:
    """The ``policy=`` values of every ``moe-pruner active`` line in a server log (one per TP rank)."""
    return _PROOF.findall(log_text)


def log_tail(path: Path | None, lines: int = 20) -> str:
    """The last lines of a log file ('' if there is none)."""
    if path is None or not Path(path).is_file():
        return ""
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def get_json(base_url: str, path: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """GET a JSON endpoint; None when it is missing, fails or does not answer JSON."""
    try:
        response = requests.get(base_url + path, timeout=timeout)
        if response.status_code != 200:
            return None
        data = response.json()
    except (requests.RequestException, ValueError):
        return None
    return data if isinstance(data, dict) else None


def server_info(base_url: str) -> dict[str, Any] | None:
    """SGLang's ``/server_info`` (``/get_server_info`` on servers that only have the old name)."""
    return get_json(base_url, "/server_info") or get_json(base_url, "/get_server_info")


def pruner_metrics(base_url: str) -> dict[str, float] | None:
    """Means over layers and ranks of the plugin's gauges on ``/metrics``, or None when absent
    (``verify_activated_experts``: those of speculative verify calls alone, where the server verifies).

    The gauges hold the means of the plugin's last report interval, so read right after a benchmark
    run they describe that run's last forwards.  The plugin exports them at 0 from start-up: a layer
    whose ``moe_pruner:layer_calls_total`` is still 0 has not been reported yet and is left out
    (None when no layer has).
    """
    from prometheus_client.parser import text_string_to_metric_families

    try:
        response = requests.get(base_url + "/metrics", timeout=10)
    except requests.RequestException:
        return None
    if response.status_code != 200:
        return None
    gauges: dict[str, list[tuple[tuple, float]]] = {}
    calls: dict[tuple, float] = {}
    try:
        for family in text_string_to_metric_families(response.text):
            for sample in family.samples:
                labels = tuple(sorted(sample.labels.items()))
                key = PRUNER_GAUGES.get(sample.name)
                if key is not None:
                    gauges.setdefault(key, []).append((labels, float(sample.value)))
                elif sample.name == PRUNER_LAYER_CALLS:
                    calls[labels] = float(sample.value)
                elif sample.name in VERIFY_GAUGE and sample.labels.get("phase") == "verify":
                    if sample.name == VERIFY_GAUGE[0]:
                        gauges.setdefault("verify_activated_experts", []).append((labels, float(sample.value)))
                    else:
                        calls[labels] = float(sample.value)
    except ValueError as exc:
        logger.warning("cannot parse %s/metrics: %s", base_url, exc)
        return None
    # a plugin without the counter (older releases) exported the gauges only once reported
    values = {key: [value for labels, value in series if calls.get(labels, 1.0) > 0] for key, series in gauges.items()}
    values = {key: series for key, series in values.items() if series}
    if not values:
        return None
    return {key: sum(series) / len(series) for key, series in values.items()}


def wait_healthy(base_url: str, timeout_s: float, alive=lambda: None, poll_s: float = 2.0) -> str | None:
    """Poll ``/health_generate`` until it answers 200.

    Parameters
    ----------
    base_url : str
    timeout_s : float
        Give up after this long.
    alive : callable
        Returns None while the server process lives, else a reason it is gone (checked every poll).
    poll_s : float

    Returns
    -------
    str or None
        None when healthy; otherwise why not.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        gone = alive()
        if gone is not None:
            return gone
        try:
            if requests.get(base_url + "/health_generate", timeout=30).status_code == 200:
                return None
        except requests.RequestException:
            pass
        if time.monotonic() >= deadline:
            return f"no healthy answer from {base_url}/health_generate within {timeout_s:g} s"
        time.sleep(poll_s)


class LaunchedServer:
    """One server process started by the A/B tool.

    Parameters
    ----------
    argv : sequence of str
        The launch command.
    log_path : Path
        Receives the server's stdout and stderr.
    env : mapping, optional
        Its environment (default :func:`server_env`).
    """

    def __init__(self, argv, log_path: Path, env: Mapping[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = dict(env) if env is not None else server_env()
        self.process: subprocess.Popen | None = None
        self._log = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        try:
            self.process = subprocess.Popen(
                self.argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        except OSError:
            self._log.close()
            raise

    def exit_reason(self) -> str | None:
        """None while the process runs; otherwise how it ended."""
        if self.process is None:
            return "not started"
        code = self.process.poll()
        if code is None:
            return None
        return f"the server exited with code {code}" if code >= 0 else f"the server was killed by signal {-code}"

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace") if self.log_path.is_file() else ""

    def stop(self, timeout_s: float) -> str:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; returns how it ended."""
        if self.process is None:
            return "not started"
        outcome = "already exited"
        if self.process.poll() is None:
            outcome = "stopped by SIGTERM"
            self._signal_group(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                outcome = f"killed (SIGKILL) after {timeout_s:g} s"
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        # children that outlived the leader (SGLang's scheduler, detokenizer)
        self._signal_group(signal.SIGKILL)
        if self._log is not None:
            self._log.close()
            self._log = None
        return outcome

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, sig)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
