"""The traffic ``xshare-sglang calibrate`` records: SGLang's own benchmark client sending a shipped
eval set, or a wait while someone else sends traffic.

A :data:`Workload` is a callable run between the recorder's start and stop calls
(:func:`~xshare_sglang.serving.calibration.recorder_client.record_dump`).
:func:`benchmark_command` builds the ``python -m sglang.benchmark.serving`` command,
:func:`benchmark_workload` runs it in a folder of its own, :func:`idle_workload` only waits.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from .recorder_dump import CalibrationError

logger = logging.getLogger(__name__)

# MT-Bench ships no reference answers, so its requests need a fixed output length.
DEFAULT_MT_BENCH_OUTPUT_LEN = 256
# sglang/benchmark/datasets/custom.py refuses a fixed output length below this ("output_len too small").
MIN_OUTPUT_LEN = 4

#: The traffic recorded: run between the recorder's start and stop calls, raising to abort the recording.
Workload = Callable[[], None]


def benchmark_command(
    url: str,
    dataset_path: str | os.PathLike[str],
    *,
    output_file: str | os.PathLike[str],
    num_prompts: int,
    max_concurrency: int,
    output_len: int | None,
    model: str | None = None,
    tokenizer: str | None = None,
    python: str = sys.executable,
) -> list[str]:
    """The ``python -m sglang.benchmark.serving`` command that sends a ``custom`` dataset to ``url``.

    ``output_len`` None asks for as many tokens as each completion in the dataset has.  The client
    appends its result to ``output_file`` (without it, to a file it names in its working directory);
    local paths are made absolute, since :func:`benchmark_workload` runs it in a temporary folder.
    """
    cmd = [
        python,
        "-m",
        "sglang.benchmark.serving",
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--dataset-name",
        "custom",
        "--dataset-path",
        os.path.abspath(dataset_path),
        "--output-file",
        os.path.abspath(output_file),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(max_concurrency),
    ]
    if output_len is not None:
        cmd += ["--sharegpt-output-len", str(output_len)]
    if model:
        cmd += ["--model", _local_path_or_name(model)]
    if tokenizer:
        cmd += ["--tokenizer", _local_path_or_name(tokenizer)]
    return cmd


def _local_path_or_name(name: str) -> str:
    """``name`` made absolute when it is a local file or folder here; a model id unchanged."""
    return os.path.abspath(name) if os.path.exists(name) else name


def benchmark_client_available() -> bool:
    """Whether ``sglang`` (and with it ``sglang.benchmark.serving``) is installed here."""
    return importlib.util.find_spec("sglang") is not None


def benchmark_workload(cmd: Sequence[str], *, work_dir: str | os.PathLike[str], api_key: str | None = None) -> Workload:
    """A workload that runs SGLang's benchmark client (``cmd``) in ``work_dir`` (so that nothing it
    writes lands in the user's working directory) and fails unless it exits 0."""

    def run() -> None:
        env = dict(os.environ)
        if api_key:
            env["OPENAI_API_KEY"] = api_key  # what sglang.benchmark.serving sends as its bearer token
        logger.info("workload: %s", shlex.join(cmd))
        result = subprocess.run(list(cmd), env=env, cwd=work_dir, check=False)
        if result.returncode != 0:
            raise CalibrationError(
                f"SGLang's benchmark client exited with {result.returncode} ({shlex.join(cmd)}); "
                "fix it, or send traffic yourself with --no-workload --duration S"
            )

    return run


def idle_workload(duration: float) -> Workload:
    """A workload that only waits ``duration`` seconds while someone else sends traffic."""

    def run() -> None:
        logger.info("recording for %g s: send your traffic to the server now", duration)
        time.sleep(duration)

    return run
