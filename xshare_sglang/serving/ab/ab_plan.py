"""The plan of an A/B run: which server each session starts and which client commands it runs.

A *session* is one arm in one repetition: launch the server (unless ``--url``), wait until it is
healthy, check the plugin's proof-of-life line, run SGLang's benchmark client once per dataset and
concurrency, run SGLang's few-shot GSM8K once, and stop the server.  Sessions run repetition by
repetition, each repetition in arm order (baseline, candidate 1, ..., baseline, candidate 1, ...), so slow
drift of the machine (clocks, temperature, other tenants) lands on every arm alike.

Every command is built here, as an argv list, so ``--dry-run`` prints exactly what the run executes.
The clients run with their session's folder as working directory (``few_shot_gsm8k`` writes
``tmp_output_gsm8k.txt`` there; it has no flag for it), so every path in their commands is absolute:
the output file, the dataset, and ``--model`` / ``--tokenizer`` where they name a local folder.
Nothing is written into the user's working directory.
"""

from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from ..datasets import CUSTOM_DATASETS, gsm8k_path
from .ab_config import AbSettings, Arm

PROOF_PREFIX = "moe-pruner active: policy="


@dataclass(frozen=True)
class ClientRun:
    """One client command of a session.

    Attributes
    ----------
    kind : {"serving", "accuracy"}
        SGLang's benchmark client, or its few-shot GSM8K evaluation.
    dataset : str
        Workload name (``gsm8k`` for the accuracy run).
    concurrency : int or None
        ``--max-concurrency`` of a serving run; None for the accuracy run.
    argv : tuple of str
        The command.
    output_path : Path
        Where its result lands (the client's JSONL, or its captured stdout for GSM8K).
    """

    kind: str
    dataset: str
    concurrency: int | None
    argv: tuple[str, ...]
    output_path: Path


@dataclass(frozen=True)
class Session:
    """One arm in one repetition.

    Attributes
    ----------
    index : int
        Position in the run, from 0.
    repeat : int
        Repetition, from 1.
    arm : Arm
    base_url : str
        Where the clients send requests.
    launch_argv : tuple of str or None
        The server command; None in ``--url`` mode.
    server_log : Path or None
        Where the launched server's output goes.
    runs : tuple of ClientRun
    """

    index: int
    repeat: int
    arm: Arm
    base_url: str
    launch_argv: tuple[str, ...] | None
    server_log: Path | None
    runs: tuple[ClientRun, ...]

    @property
    def label(self) -> str:
        return f"r{self.repeat}-{self.arm.name}"


def client_path(name: str) -> str:
    """``name`` made absolute when it is a local file or folder, so that a client run in another
    working directory finds it; anything else (a Hugging Face model id) unchanged."""
    return os.path.abspath(name) if os.path.exists(name) else name


def dataset_file(settings: AbSettings, name: str) -> Path:
    """The ``custom`` dataset file the run writes for a shipped workload."""
    return settings.output_dir / "datasets" / f"{name}.jsonl"


def launch_argv(settings: AbSettings, arm: Arm) -> tuple[str, ...]:
    """``python -m sglang.launch_server`` with the common flags, then the arm's own."""
    argv = [
        *settings.launch_command,
        "--model-path",
        settings.model_path,
        "--host",
        settings.host,
        "--port",
        str(settings.port),
        *settings.server_args,
    ]
    if settings.enable_metrics and "--enable-metrics" not in settings.server_args:
        argv.append("--enable-metrics")
    return (*argv, *arm.launch_flags())


def serving_argv(
    settings: AbSettings, session_dir: Path, base_url: str, arm: Arm, repeat: int, dataset: str, concurrency: int
) -> tuple[tuple[str, ...], Path]:
    """SGLang's benchmark client for one dataset and concurrency; returns (argv, its JSONL output)."""
    output = session_dir / f"serving-{dataset}-c{concurrency}.jsonl"
    argv = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--backend",
        "sglang",
        "--base-url",
        base_url,
        "--model",
        client_path(settings.model_path),
        "--tokenizer",
        client_path(settings.tokenizer or settings.model_path),
        "--num-prompts",
        str(settings.prompts_for(concurrency)),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--seed",
        str(settings.seed),
        "--output-file",
        os.path.abspath(output),
        "--tag",
        f"{arm.name}/r{repeat}",
    ]
    if dataset == "random-ids":
        argv += [
            "--dataset-name",
            "random-ids",
            "--random-input-len",
            str(settings.random_input_len),
            "--random-output-len",
            str(settings.random_output_len),
            "--random-range-ratio",
            "1.0",
        ]
    elif dataset in CUSTOM_DATASETS:
        argv += ["--dataset-name", "custom", "--dataset-path", os.path.abspath(dataset_file(settings, dataset))]
        if dataset == "mt-bench":
            argv += ["--sharegpt-output-len", str(settings.output_len)]
    else:  # settings validated the names
        raise AssertionError(dataset)
    return tuple(argv), output


def accuracy_argv(settings: AbSettings, base_url: str) -> tuple[str, ...]:
    """SGLang's few-shot GSM8K evaluation on the shipped test split (no download)."""
    parts = urlsplit(base_url)
    return (
        sys.executable,
        "-m",
        "sglang.test.few_shot_gsm8k",
        "--host",
        parts.hostname or settings.host,
        "--port",
        str(parts.port or (443 if parts.scheme == "https" else 80)),
        "--data-path",
        os.path.abspath(gsm8k_path()),
        "--num-questions",
        str(settings.gsm8k_questions),
        "--num-shots",
        str(settings.gsm8k_shots),
        "--parallel",
        str(settings.gsm8k_parallel),
        "--max-new-tokens",
        str(settings.gsm8k_max_new_tokens),
    )


def build_plan(settings: AbSettings) -> list[Session]:
    """Every session of the run, in execution order.

    Repetition r runs the arms rotated by r - 1 places (A B C, then B C A, then C A B), so that over
    a full rotation every arm runs once in every position: a machine that drifts over a run, or a
    session that runs slower after another, does not favour whichever arm always came first.
    """
    sessions = []
    arms = list(settings.arms)
    for repeat in range(1, settings.repeats + 1):
        shift = (repeat - 1) % len(arms)
        for arm in arms[shift:] + arms[:shift]:
            index = len(sessions)
            session_dir = settings.output_dir / "runs" / f"{index:03d}-r{repeat}-{arm.name}"
            base_url = arm.url.rstrip("/") if arm.url is not None else settings.base_url
            runs = []
            for dataset in settings.datasets:
                for concurrency in settings.concurrencies:
                    argv, output = serving_argv(settings, session_dir, base_url, arm, repeat, dataset, concurrency)
                    runs.append(ClientRun("serving", dataset, concurrency, argv, output))
            if settings.accuracy:
                runs.append(
                    ClientRun("accuracy", "gsm8k", None, accuracy_argv(settings, base_url), session_dir / "gsm8k.txt")
                )
            log = settings.output_dir / "servers" / f"{index:03d}-r{repeat}-{arm.name}.log"
            sessions.append(
                Session(
                    index=index,
                    repeat=repeat,
                    arm=arm,
                    base_url=base_url,
                    launch_argv=None if arm.url is not None else launch_argv(settings, arm),
                    server_log=None if arm.url is not None else log,
                    runs=tuple(runs),
                )
            )
    return sessions


def render_plan(settings: AbSettings, sessions: list[Session]) -> str:
    """The ``--dry-run`` text: every command in order, as a shell would run it, with the checks between."""
    lines = [
        f"# A/B plan: {len(settings.arms)} arms x {settings.repeats} repetitions = {len(sessions)} sessions; "
        f"results in {settings.output_dir}",
        f"# arms: {', '.join(arm.name + (' (pruner off)' if arm.unpruned else '') for arm in settings.arms)}",
    ]
    for name in settings.datasets:
        if name in CUSTOM_DATASETS:
            lines.append(f"# write {dataset_file(settings, name)} from the shipped {name} set")
    for session in sessions:
        arm = session.arm
        lines.append("")
        lines.append(f"# session {session.index + 1}/{len(sessions)}: repetition {session.repeat}, arm {arm.name}")
        if session.launch_argv is not None:
            lines.append(f"{shlex.join(session.launch_argv)} > {session.server_log} 2>&1 &")
            limit = settings.startup_timeout_s
            lines.append(f"# wait until GET {session.base_url}/health_generate answers 200 (at most {limit:g} s)")
        else:
            lines.append(f"# server started by you: GET {session.base_url}/health_generate must answer 200")
        if arm.unpruned:
            lines.append(f"# check: the server log has no '{PROOF_PREFIX}' line (the pruner is off)")
        else:
            lines.append(f"# check: the server log has '{PROOF_PREFIX}{arm.expected_policy}', else the arm is dropped")
        for run in session.runs:
            lines.append(shlex.join(run.argv))
        if session.launch_argv is not None:
            lines.append(f"# stop: SIGTERM to the server's process group, SIGKILL after {settings.stop_timeout_s:g} s")
    return "\n".join(lines) + "\n"
