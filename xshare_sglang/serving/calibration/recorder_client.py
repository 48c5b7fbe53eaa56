"""Recording on a running SGLang server: its info and recorder endpoints, and the dump a recording
leaves on disk.

What SGLang 0.5.23 records (``sglang/srt/eplb/expert_distribution.py``)
--------------------------------------------------------------------------
The server must be started with ``--expert-distribution-recorder-mode`` (``stat``, ``stat_approx``,
``per_pass`` or ``per_token``); ``stat`` is the one to use.  Without it the scheduler holds a no-op
recorder whose ``start_record`` raises ``"Please set ServerArgs.expert_distribution_recorder_mode to
use ExpertDistributionRecorder."`` (expert_distribution.py:202-205).  The scheduler does not catch it
(scheduler.py:2253, 6127-6137); its process logs "Scheduler hit an exception" and signals the launcher,
which shuts the whole server down (scheduler.py:6370-6373).  So ``xshare-sglang calibrate`` reads
``/server_info`` first (:mod:`~xshare_sglang.serving.calibration.server_checks`) and refuses to touch
the recorder of a server started without one.

``POST /start_expert_distribution_record``, ``/stop_...`` and ``/dump_...`` (http_server.py:1267-1297)
answer plain text, never data: the dump is written with ``torch.save`` on the *server's* disk, into
``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` (default ``/tmp``; expert_distribution.py:1038-1044,
environ.py:1337).  So the command takes that folder as ``--dump-dir`` (it must be visible from where
the command runs) and :func:`record_dump` returns the dump that appeared there after it started
recording: one file for ``stat`` / ``stat_approx``, one per rank for ``per_pass`` / ``per_token`` (see
:mod:`~xshare_sglang.serving.calibration.recorder_dump` for their layouts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import requests

from .recorder_dump import CalibrationError, list_dumps, newest_dump
from .workload import Workload

logger = logging.getLogger(__name__)

RECORDER_MODES: tuple[str, ...] = ("stat", "stat_approx", "per_pass", "per_token")
# SGLang's default for SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (sglang/srt/environ.py).
RECORDER_DIR_ENV = "SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR"
DEFAULT_DUMP_DIR = "/tmp"
START, STOP, DUMP = (
    "/start_expert_distribution_record",
    "/stop_expert_distribution_record",
    "/dump_expert_distribution_record",
)


class RecorderClient:
    """HTTP calls to one SGLang server: its info endpoints and the recorder endpoints.

    Parameters
    ----------
    url : str
        ``http(s)://host:port`` of the server.
    api_key : str, optional
        Sent as ``Authorization: Bearer`` (servers started with ``--api-key`` / ``--admin-api-key``).
    timeout : float
        Seconds to wait for the info and start/stop calls; the dump call waits ten times as long.
    """

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def _get_json(self, *paths: str) -> dict[str, Any] | None:
        for path in paths:
            try:
                response = requests.get(self.url + path, headers=self.headers, timeout=self.timeout)
            except requests.ConnectionError as exc:
                raise CalibrationError(
                    f"cannot reach an SGLang server at --url {self.url} ({type(exc).__name__}): is it running, "
                    "and is the address right?"
                ) from None
            except requests.RequestException as exc:
                raise CalibrationError(f"GET {self.url}{path} failed: {exc}") from None
            if response.status_code in (401, 403):
                raise CalibrationError(
                    f"GET {self.url}{path} was refused ({response.status_code}): pass the server's key as --api-key"
                )
            if response.status_code == 200:
                try:
                    data = response.json()
                except ValueError:
                    continue
                if isinstance(data, dict):
                    return data
        return None

    def server_info(self) -> dict[str, Any] | None:
        """``/server_info`` (``/get_server_info`` on servers with only the old name), or None."""
        return self._get_json("/server_info", "/get_server_info")

    def model_info(self) -> dict[str, Any] | None:
        """``/model_info`` (``/get_model_info``), or None."""
        return self._get_json("/model_info", "/get_model_info")

    def post(self, path: str, *, timeout: float | None = None) -> None:
        """POST one recorder endpoint; raise :class:`CalibrationError` unless it answers 200."""
        try:
            response = requests.post(self.url + path, headers=self.headers, timeout=timeout or self.timeout)
        except requests.RequestException as exc:
            hint = (
                ". A server started without --expert-distribution-recorder-mode shuts down when asked to record: "
                "restart it with --expert-distribution-recorder-mode stat --expert-distribution-recorder-buffer-size -1"
                if path == START
                else ""
            )
            raise CalibrationError(f"POST {self.url}{path} failed ({type(exc).__name__}: {exc}){hint}") from None
        if response.status_code != 200:
            hint = ": pass the server's key as --api-key" if response.status_code in (401, 403) else ""
            raise CalibrationError(
                f"POST {self.url}{path} answered {response.status_code} {response.text.strip()[:200]!r}{hint}"
            )


def record_dump(
    client: RecorderClient,
    dump_dir: str | os.PathLike[str],
    workload: Workload,
    *,
    expected_files: int = 1,
    dump_timeout: float = 30.0,
) -> list[Path]:
    """Record ``workload`` on the server and return the files of the dump it writes.

    Starts the recorder (which clears what it held), runs ``workload``, stops the recorder (also when
    the workload fails), asks for a dump, and waits up to ``dump_timeout`` seconds for the dump to
    appear in ``dump_dir``.  Only files that were not there before the start call count.

    Parameters
    ----------
    expected_files : int
        Files to wait for (one for ``stat``; one per rank for ``per_pass`` / ``per_token``).

    Raises
    ------
    CalibrationError
        A recorder call fails, or no new dump appears in ``dump_dir``.
    """
    folder = Path(dump_dir)
    before = {d.path.name for d in list_dumps(folder)}
    client.post(START)
    logger.info("recording expert selections on %s", client.url)
    try:
        workload()
    except BaseException:
        with contextlib.suppress(CalibrationError):  # the workload's error is the one to report
            client.post(STOP)
        raise
    client.post(STOP)
    client.post(DUMP, timeout=10 * client.timeout)
    deadline = time.monotonic() + dump_timeout
    while True:
        new = [d for d in list_dumps(folder) if d.path.name not in before]
        chosen = newest_dump(new)
        if len(chosen) >= expected_files or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if not chosen:
        raise CalibrationError(
            f"no new expert_distribution_recorder_*.pt file appeared in --dump-dir {folder} within {dump_timeout:g} s. "
            f"SGLang writes the dump on the server's machine into its {RECORDER_DIR_ENV} (default "
            f"{DEFAULT_DUMP_DIR}): pass that folder as --dump-dir, or copy the file here and convert it with "
            "--from-dump"
        )
    if len(chosen) < expected_files:
        logger.warning("found %d of %d per-rank dump files; reading those", len(chosen), expected_files)
    return [d.path for d in chosen]
