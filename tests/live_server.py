"""A real ``sglang.launch_server`` on the CPU engine, started for a test and killed by its process group.

The server is ``python -m xshare_sglang.testing.cpu_server`` (SGLang's own launcher with the CPU
flags and the ``sgl_kernel`` stand-in) in a process group of its own; :meth:`LiveServer.stop` sends
SIGTERM to the group, then SIGKILL, so no scheduler or detokenizer outlives the test.  The A/B tool's
process handling (:class:`~xshare_sglang.serving.ab.ab_server.LaunchedServer`) does the work.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import requests

from xshare_sglang.serving.ab.ab_server import (
    LaunchedServer,
    launch_port,
    log_tail,
    proof_policies,
    server_env,
    wait_healthy,
)

#: The pruner flags of ``make serve-cpu`` (metrics on, a report every ``SERVE_CPU_LOG_INTERVAL`` forwards).
SERVE_CPU_LOG_INTERVAL = 10
SERVE_CPU_FLAGS = [
    "--enable-metrics",
    "--moe-pruner",
    "xshare",
    "--moe-pruner-k0",
    "1",
    "--moe-pruner-budget",
    "4",
    "--moe-pruner-log-interval",
    str(SERVE_CPU_LOG_INTERVAL),
]


def unpruned_args(dtype: str) -> list[str]:
    """Arguments of the unpruned server the live tests compare answers with, shared through
    :class:`LiveServerPool` (started ``interpreter=False``): no pruner flag, so the plugin is loaded
    and inactive."""
    return ["--dtype", dtype]


STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
LAUNCH = [sys.executable, "-m", "xshare_sglang.testing.cpu_server"]
#: SGLang's launcher, once a child of a stopped server has died, sleeps 5 s before it looks for live
#: schedulers to dump with py-spy (and for CUDA core dumps): every stop of a test server took that
#: long.  A CPU test server has no GPU and its tests read its log, so both are off.
NO_CRASH_DIAGNOSTICS = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class LiveServer:
    """One CPU server; ``args`` are ``sglang.launch_server`` arguments (host and port are added).
    ``interpreter=False`` starts it without ``TRITON_INTERPRET`` (see ``__init__``)."""

    def __init__(self, args: list[str], log_path: Path, *, interpreter: bool = True) -> None:
        self.port = launch_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**server_env(), **NO_CRASH_DIAGNOSTICS}
        if not interpreter:
            # as `make serve-cpu` runs: without the TRITON_INTERPRET=1 conftest sets for the kernel
            # tests, the selection runs the torch reference on CPU (same masks, several times faster)
            env.pop("TRITON_INTERPRET", None)
        self.process = LaunchedServer(
            [*LAUNCH, *args, "--host", "127.0.0.1", "--port", str(self.port)], log_path, env=env
        )

    def start(self) -> LiveServer:
        """Launch the server and wait until it answers ``/health``."""
        self.process.start()
        return self.wait_ready()

    def wait_ready(self) -> LiveServer:
        """Wait until the launched server answers ``/health``; stop it and raise with its log's tail if
        it exits or does not answer within ``STARTUP_TIMEOUT_S``."""
        problem = wait_healthy(self.url, STARTUP_TIMEOUT_S, self.process.exit_reason, poll_s=1.0)
        if problem is not None:
            self.stop()
            raise RuntimeError(f"{problem}\n--- server log ---\n{log_tail(self.process.log_path, 60)}")
        return self

    def stop(self) -> None:
        self.process.stop(STOP_TIMEOUT_S)

    def log(self) -> str:
        return self.process.log_text()

    def policies(self) -> list[str]:
        """The ``policy=`` of every proof-of-life line in the log."""
        return proof_policies(self.log())

    def alive(self) -> bool:
        return self.process.exit_reason() is None

    # ------------------------------------------------------------------ requests
    def generate(self, text: str, max_new_tokens: int, *, ignore_eos: bool = True) -> dict:
        """Greedy ``/generate``; returns SGLang's JSON answer."""
        body = {
            "text": text,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": ignore_eos},
        }
        response = requests.post(self.url + "/generate", json=body, timeout=120)
        response.raise_for_status()
        return response.json()

    def greedy_logprobs(self, prompt, max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        """Greedy tokens and their logprobs for one prompt or a batch sent in one request; a prompt is
        text or token ids (a batch: a list of either)."""
        body = {
            "input_ids" if _is_ids(prompt) else "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "return_logprob": True,
        }
        response = requests.post(self.url + "/generate", json=body, timeout=300)
        response.raise_for_status()
        answers = response.json()
        answers = answers if isinstance(answers, list) else [answers]
        return [
            (answer["output_ids"], [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
            for answer in answers
        ]

    def completion(self, prompt: str, max_tokens: int) -> dict:
        """Greedy OpenAI-compatible ``/v1/completions``."""
        body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = requests.post(self.url + "/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()

    def metrics(self) -> dict[str, dict[tuple, float]]:
        """Every ``moe_pruner:*`` sample on ``/metrics``: name -> {sorted label items: value}."""
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.url + "/metrics", timeout=30).text
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("moe_pruner:"):
                    out.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
        return out

    def wait_for_log(self, text: str, timeout_s: float = 30.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if text in self.log():
                return True
            time.sleep(0.5)
        return False


class LiveServerPool:
    """The servers several tests share: one start per configuration in a test run.

    :meth:`server` hands out the running server of a configuration (its arguments and whether it
    runs the Triton interpreter), starting it on first use.  A shared server is never stopped by a
    test; it serves every test that asks for its configuration and answers as if fresh (the tests
    that use one read only its answers and what they sent, never counters from its start).  At most
    ``keep`` shared servers run at a time: starting another stops the one used longest ago.  Each
    uses about 1.5 GB, and an idle one (``--sleep-on-idle``) no CPU.
    """

    def __init__(self, folder: Path, keep: int = 2) -> None:
        self.folder = folder
        self.keep = keep
        self._servers: dict[tuple, LiveServer] = {}  # in order of last use
        self.starts = 0

    def server(self, args: list[str], *, interpreter: bool = True) -> LiveServer:
        key = (tuple(args), interpreter)
        server = self._servers.pop(key, None)
        if server is None or not server.alive():
            while len(self._servers) >= self.keep:
                self._servers.pop(next(iter(self._servers))).stop()
            self.starts += 1
            log = self.folder / f"shared-{self.starts}" / "server.log"
            server = LiveServer(list(args), log, interpreter=interpreter).start()
        self._servers[key] = server
        return server

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


def _is_ids(prompt) -> bool:
    """Token ids (a list of ints, or a batch of such lists), not text."""
    first = prompt[0] if isinstance(prompt, list) and prompt else prompt
    return isinstance(first, int) or (isinstance(first, list) and bool(first) and isinstance(first[0], int))


def trace_files(folder: Path) -> set[str]:
    """Names of the complete trace files in ``folder`` (the recorder writes each under a temporary
    name and renames it)."""
    return {path.name for path in folder.glob("trace-*.pt")}


def traces_after(folder: Path, before: set[str], *, quiet_s: float = 5.0, timeout_s: float = 60.0) -> list[Path]:
    """The trace files once the recorder has written the traffic sent since ``before`` was listed.

    Called when that traffic has ended.  The recorder writes what it holds once no forward came for
    2 s (``trace_recorder.IDLE_FLUSH_S``), then builds and saves the file, which took about a second
    more on a 2-core CI machine.  So: at least one file not in ``before``, then no new file for
    ``quiet_s`` seconds counted from the end of the traffic or the last new file, whichever is later.
    """
    start = time.monotonic()
    seen, changed = trace_files(folder), start
    while True:
        time.sleep(0.25)
        now, files = time.monotonic(), trace_files(folder)
        if files != seen:
            seen, changed = files, now
        if seen - before and now - changed >= quiet_s:
            return sorted(folder / name for name in seen)
        if now - start > timeout_s:
            raise AssertionError(f"no trace file of the traffic in {folder} within {timeout_s:g} s ({sorted(seen)})")
