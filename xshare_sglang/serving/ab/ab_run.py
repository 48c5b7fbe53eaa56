"""Execute an A/B plan and record every run as one JSON line.

``runs.jsonl`` in the output folder gets one record per session (how the server started and stopped)
and one per client run (the numbers), appended and flushed as they happen, so an interrupted run keeps
what it measured.  A session that fails (the server exits, never becomes healthy, or does not prove the
plugin active; a client run that kills the server) is recorded with its reason and the tail of the
server log; its arm is dropped from later repetitions, and every other arm goes on.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import re
import subprocess
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from ...provenance import package_commit
from ..datasets import CUSTOM_DATASETS, write_custom_dataset
from .ab_config import AbSettings
from .ab_plan import PROOF_PREFIX, ClientRun, Session, build_plan, dataset_file
from .ab_server import LaunchedServer, log_tail, proof_policies, pruner_metrics, server_info, wait_healthy, write_json

logger = logging.getLogger(__name__)

RUNS_FILE = "runs.jsonl"
# Numbers kept from a row of SGLang's benchmark client (sglang/benchmark/serving.py, its JSONL result).
SERVING_FIELDS = (
    "completed",
    "duration",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "output_throughput",
    "total_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2e_latency_ms",
    "median_e2e_latency_ms",
    "accept_length",
)
# Lines SGLang's few-shot GSM8K prints (sglang/test/few_shot_gsm8k.py).
_GSM8K_LINES = {
    "accuracy": re.compile(r"^Accuracy:\s*([0-9.]+)", re.M),
    "invalid": re.compile(r"^Invalid:\s*([0-9.]+)", re.M),
    "latency_s": re.compile(r"^Latency:\s*([0-9.]+)", re.M),
    "output_throughput": re.compile(r"^Output throughput:\s*([0-9.]+)", re.M),
}
PROOF_WAIT_S = 15.0


class SessionFailed(Exception):
    """The session's server could not be used; the message says why."""


def client_versions() -> dict[str, str | None]:
    """Versions of the packages on the client side of the run."""
    out: dict[str, str | None] = {}
    for name in ("sglang", "xshare-sglang", "torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def parse_serving_output(path: Path) -> dict[str, Any]:
    """The numbers of the last row SGLang's benchmark client appended to ``--output-file``."""
    if not path.is_file():
        raise ValueError(f"the benchmark client wrote no result to {path}")
    rows = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} is empty")
    row = json.loads(rows[-1])
    return {name: row.get(name) for name in SERVING_FIELDS}


def parse_gsm8k_output(text: str) -> dict[str, float]:
    """Accuracy, invalid share, latency and output throughput from few-shot GSM8K's printout."""
    out = {}
    for name, pattern in _GSM8K_LINES.items():
        found = pattern.findall(text)
        if found:
            out[name] = float(found[-1])
    if "accuracy" not in out:
        raise ValueError("few-shot GSM8K printed no 'Accuracy:' line")
    return out


class AbRunner:
    """Runs the sessions of one A/B plan.

    Parameters
    ----------
    settings : AbSettings
    echo : callable, optional
        Receives one line of progress per step (the CLI prints them).
    """

    def __init__(self, settings: AbSettings, echo: Callable[[str], None] | None = None) -> None:
        self.settings = settings
        self.echo = echo or (lambda line: logger.info("%s", line))
        self.sessions = build_plan(settings)
        self.runs_path = settings.output_dir / RUNS_FILE
        self.dropped: dict[str, str] = {}
        self._common = {"versions": client_versions(), "git_sha": package_commit(), "model_path": settings.model_path}

    # ---------------------------------------------------------------- records
    def _record(self, session: Session, record: str, **fields: Any) -> dict[str, Any]:
        row = {
            "record": record,
            "session": session.index,
            "repeat": session.repeat,
            "arm": session.arm.name,
            "baseline": session.arm.is_baseline,
            "policy": session.arm.expected_policy,
            "pruner": session.arm.pruner,
            "server_argv": list(session.launch_argv) if session.launch_argv is not None else None,
            "url": session.base_url,
            **self._common,
            "time": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            **fields,
        }
        with open(self.runs_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row, default=str) + "\n")
        return row

    def _record_run(self, session: Session, run: ClientRun, status: str, **fields: Any) -> None:
        self._record(
            session,
            run.kind,
            dataset=run.dataset,
            concurrency=run.concurrency,
            status=status,
            argv=list(run.argv),
            raw=str(run.output_path),
            **fields,
        )

    # ---------------------------------------------------------------- run
    def run(self) -> Path:
        """Run every session; returns the path of ``runs.jsonl``."""
        settings = self.settings
        settings.output_dir.mkdir(parents=True, exist_ok=True)
        write_json(settings.output_dir / "plan.json", self._plan_summary())
        for name in settings.datasets:
            if name in CUSTOM_DATASETS:
                write_custom_dataset(name, dataset_file(settings, name))
        for session in self.sessions:
            if session.arm.name in self.dropped:
                self._record(session, "session", status="skipped", error=self.dropped[session.arm.name])
                continue
            self._run_session(session)
        return self.runs_path

    def _plan_summary(self) -> dict[str, Any]:
        s = self.settings
        return {
            "model_path": s.model_path,
            "arms": [
                {
                    "name": a.name,
                    "baseline": a.is_baseline,
                    "pruner": a.pruner,
                    "server_args": list(a.server_args),
                    "url": a.url,
                }
                for a in s.arms
            ],
            "server_args": list(s.server_args),
            "concurrencies": list(s.concurrencies),
            "datasets": list(s.datasets),
            "repeats": s.repeats,
            "accuracy": s.accuracy,
            "sessions": len(self.sessions),
        }

    def _run_session(self, session: Session) -> None:
        settings = self.settings
        arm = session.arm
        session_dir = session.runs[0].output_path.parent if session.runs else settings.output_dir / "runs"
        session_dir.mkdir(parents=True, exist_ok=True)
        self.echo(f"[{session.index + 1}/{len(self.sessions)}] repetition {session.repeat}, arm {arm.name}")
        server = None
        started = time.monotonic()
        try:
            if session.launch_argv is not None:
                server = LaunchedServer(session.launch_argv, session.server_log)
                try:
                    server.start()
                except OSError as exc:
                    raise SessionFailed(f"cannot start {session.launch_argv[0]!r}: {exc}") from None
                problem = wait_healthy(session.base_url, settings.startup_timeout_s, alive=server.exit_reason)
                if problem is not None:
                    raise SessionFailed(f"the server did not become healthy: {problem}")
                self._check_launched_proof(session, server)
                confirmed = "log"
            else:
                problem = wait_healthy(session.base_url, min(settings.startup_timeout_s, 60.0))
                if problem is not None:
                    raise SessionFailed(f"the server is not healthy: {problem}")
                confirmed = self._check_url_proof(session)
            info = server_info(session.base_url)
            if info is not None:
                write_json(session_dir / "server_info.json", info)
            self._record(
                session,
                "session",
                status="started",
                plugin_confirmed=confirmed,
                server_version=(info or {}).get("version"),
                startup_s=round(time.monotonic() - started, 1),
            )
            self._run_clients(session, server, confirmed)
        except SessionFailed as exc:
            tail = log_tail(session.server_log)
            self.dropped[arm.name] = f"dropped after repetition {session.repeat}: {exc}"
            self._record(session, "session", status="failed", error=str(exc), log_tail=tail)
            self.echo(f"  FAILED: {exc}; arm {arm.name} is dropped from later repetitions")
        finally:
            if server is not None:
                outcome = server.stop(settings.stop_timeout_s)
                self._record(session, "session", status="stopped", stop=outcome)
                self.echo(f"  server {outcome}")

    def _check_launched_proof(self, session: Session, server: LaunchedServer) -> None:
        arm = session.arm
        deadline = time.monotonic() + PROOF_WAIT_S
        policies = proof_policies(server.log_text())
        while not arm.unpruned and not policies and time.monotonic() < deadline:
            time.sleep(0.5)
            policies = proof_policies(server.log_text())
        self._judge_proof(arm, policies, where=str(session.server_log))

    def _check_url_proof(self, session: Session) -> str:
        arm = session.arm
        if arm.server_log is not None:
            path = Path(arm.server_log)
            if not path.is_file():
                raise SessionFailed(f"--server-log {arm.name}={path}: no such file")
            self._judge_proof(arm, proof_policies(path.read_text(encoding="utf-8", errors="replace")), where=str(path))
            return "log"
        return "unconfirmed"

    @staticmethod
    def _judge_proof(arm, policies: list[str], where: str) -> None:
        if arm.unpruned:
            if policies:
                raise SessionFailed(
                    f"arm {arm.name!r} must run unpruned, but {where} has '{PROOF_PREFIX}{policies[0]}' (is a pruner "
                    "configured through the environment or the server flags?)"
                )
            return
        if not policies:
            raise SessionFailed(
                f"{where} has no '{PROOF_PREFIX}{arm.expected_policy}' line: the plugin is not active in this "
                "server (is xshare-sglang installed in the server's Python, and did SGLang load its plugins?)"
            )
        wrong = sorted(set(policies) - {arm.expected_policy})
        if wrong:
            raise SessionFailed(f"{where} shows policy={','.join(wrong)}, but the arm asks for {arm.expected_policy}")

    def _run_clients(self, session: Session, server: LaunchedServer | None, confirmed: str) -> None:
        for position, run in enumerate(session.runs):
            what = f"{run.dataset} c={run.concurrency}" if run.kind == "serving" else "GSM8K"
            started = time.monotonic()
            try:
                metrics = self._run_client(run)
            except (ValueError, OSError, subprocess.SubprocessError) as exc:
                self._record_run(session, run, "failed", error=str(exc), wall_s=round(time.monotonic() - started, 1))
                self.echo(f"  {what}: FAILED ({exc})")
                gone = server.exit_reason() if server is not None else None
                if gone is None and server is None:
                    gone = wait_healthy(session.base_url, 30.0)
                if gone is not None:
                    for later in session.runs[position + 1 :]:
                        self._record_run(session, later, "skipped", error=f"server gone: {gone}")
                    raise SessionFailed(f"the server went away during {what}: {gone}") from None
                continue
            pruner = pruner_metrics(session.base_url) if self.settings.enable_metrics or server is None else None
            if pruner is not None and session.arm.unpruned:
                raise SessionFailed(f"pruner-off arm {session.arm.name!r} reports moe_pruner metrics: it prunes")
            if pruner is not None and confirmed == "unconfirmed":
                confirmed = "metrics"
                self._record(session, "session", status="confirmed", plugin_confirmed="metrics")
            wall = round(time.monotonic() - started, 1)
            self._record_run(session, run, "ok", metrics=metrics, pruner_metrics=pruner, wall_s=wall)
            self.echo(f"  {what}: {self._headline(run, metrics)}")
        if confirmed == "unconfirmed" and not session.arm.unpruned:
            self.echo(
                f"  WARNING: could not confirm the pruner is active on {session.base_url} (give --server-log "
                f"{session.arm.name}=PATH, or start the server with --enable-metrics)"
            )

    @staticmethod
    def _headline(run: ClientRun, metrics: dict[str, Any]) -> str:
        if run.kind == "accuracy":
            return f"accuracy {metrics['accuracy']:.3f}"
        tput = metrics.get("output_throughput")
        return f"{tput:.1f} output tok/s" if isinstance(tput, int | float) else "no throughput"

    def _run_client(self, run: ClientRun) -> dict[str, Any]:
        run.output_path.parent.mkdir(parents=True, exist_ok=True)
        log_path = run.output_path.with_suffix(".log") if run.kind == "serving" else run.output_path
        if run.kind == "serving" and run.output_path.exists():
            run.output_path.unlink()  # the client appends
        try:
            with open(log_path, "wb") as log:
                done = subprocess.run(
                    run.argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    cwd=run.output_path.parent,
                    timeout=self.settings.run_timeout_s,
                    check=False,
                )
        except subprocess.TimeoutExpired:
            raise ValueError(f"timed out after {self.settings.run_timeout_s:g} s (log: {log_path})") from None
        if done.returncode != 0:
            raise ValueError(f"exit code {done.returncode}; last lines of {log_path}:\n{log_tail(log_path, 8)}")
        if run.kind == "serving":
            return parse_serving_output(run.output_path)
        return parse_gsm8k_output(log_path.read_text(encoding="utf-8", errors="replace"))
