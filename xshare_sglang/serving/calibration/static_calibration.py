"""Static-ranking calibration: drive a running SGLang server's expert-distribution recorder.

``xshare-sglang calibrate --url http://host:30000 -o ranking.json`` starts the recorder of a running
SGLang server, sends a workload through SGLang's own benchmark client (or waits while you send
traffic yourself), stops the recorder, has the server dump what it recorded, reads the dump and writes
the file that ``--moe-pruner moe-spec --moe-pruner-ranking static --moe-pruner-static-ranking-path``
reads.  ``--from-dump PATH`` converts a dump that already exists, without a server.  Reading dumps and
writing the ranking file live in :mod:`xshare_sglang.serving.calibration.recorder_dump`; this module holds the
server calls, the workload and the command line.

Run calibration with the pruner off (``--moe-pruner none`` or no pruner flag, and no
``--moe-pruner-config`` that sets a policy).  The plugin rewrites pruned picks to ``-1`` before
SGLang's recorder sees the top-k ids, and the recorder skips ids below zero, so a pruning server would
count only what it already keeps.  :func:`check_server` warns when the server's launch command turns
the pruner on; settings passed through the environment (``XSHARE_MOE_PRUNER_CONFIG``) do not appear
there.

What SGLang 0.5.23 records (``sglang/srt/eplb/expert_distribution.py``)
--------------------------------------------------------------------------
The server must be started with ``--expert-distribution-recorder-mode`` (``stat``, ``stat_approx``,
``per_pass`` or ``per_token``); ``stat`` is the one to use.  Without it the scheduler holds a no-op
recorder whose ``start_record`` raises ``"Please set ServerArgs.expert_distribution_recorder_mode to
use ExpertDistributionRecorder."`` (expert_distribution.py:202-205).  The scheduler does not catch it
(scheduler.py:2253, 6127-6137); its process logs "Scheduler hit an exception" and signals the launcher,
which shuts the whole server down (scheduler.py:6370-6373).  So this command reads ``/server_info``
first and refuses to touch the recorder of a server started without one.

``POST /start_expert_distribution_record``, ``/stop_...`` and ``/dump_...`` (http_server.py:1267-1297)
answer plain text, never data: the dump is written with ``torch.save`` on the *server's* disk, into
``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` (default ``/tmp``; expert_distribution.py:1038-1044,
environ.py:1337).  So the command takes that folder as ``--dump-dir`` (it must be visible from where
the command runs) and reads the dump that appeared there after it started recording: one file for
``stat`` / ``stat_approx``, one per rank for ``per_pass`` / ``per_token`` (see
:mod:`~xshare_sglang.serving.calibration.recorder_dump` for their layouts).  ``--enable-eplb`` resets the recorder
at every rebalance and is refused.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from ...calibration_file import StaticRanking
from ...errors import ConfigError
from ...files import InputFileError
from ...sglang_plugin.flags import CONFIG_FLAG, FLAG_PREFIX, VERIFY_FLAG, typed_settings_of_command
from ...sglang_plugin.settings import phase_policies
from ..datasets import CUSTOM_DATASETS, custom_conversations, write_custom_dataset
from .recorder_dump import (
    TOP_SHARE,
    CalibrationError,
    ExpertCounts,
    dump_paths,
    list_dumps,
    newest_dump,
    read_dump,
    write_static_ranking,
)
from .routing_stats import stats_from_trace

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
# MT-Bench ships no reference answers, so its requests need a fixed output length.
DEFAULT_MT_BENCH_OUTPUT_LEN = 256
# sglang/benchmark/datasets/custom.py refuses a fixed output length below this ("output_len too small").
MIN_OUTPUT_LEN = 4


# ------------------------------------------------------------------------------------ server side


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


Workload = Callable[[], None]


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


# ----------------------------------------------------------------------------------- command line

CALIBRATE_HELP = "count the experts SGLang's router picks per layer during a workload -> static-ranking JSON"
CALIBRATE_EPILOG = (
    "Start the server with --expert-distribution-recorder-mode stat --expert-distribution-recorder-buffer-size -1 "
    "and with the pruner OFF (--moe-pruner none): the plugin rewrites pruned picks to -1 before SGLang's recorder, "
    "which does not count them, so a pruning server biases the counts. SGLang writes the dump on the server's disk "
    f"into {RECORDER_DIR_ENV} (default {DEFAULT_DUMP_DIR}); --dump-dir must be that folder. Rows are indexed by "
    "layer id, so dense layers have rows of zeros. Use the file with --moe-pruner moe-spec --moe-pruner-ranking "
    "static --moe-pruner-static-ranking-path FILE --moe-pruner-max-experts B."
)


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``calibrate`` subcommand's flags."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--url", metavar="URL", help="the SGLang server to record, e.g. http://127.0.0.1:30000")
    source.add_argument(
        "--from-dump",
        metavar="PATH",
        nargs="+",
        help="convert existing recorder dump(s) instead: files (summed), or a folder (its newest dump); no server. "
        "per_token dumps also give the co-activation counts and budget curves",
    )
    source.add_argument(
        "--from-trace",
        metavar="PATH",
        nargs="+",
        help="count an xshare-trace instead (files, or folders of a server's --moe-pruner-trace-dir): counts, "
        "co-activation counts and budget curves; no server",
    )
    parser.add_argument(
        "-o",
        "--output",
        default="static_ranking.json",
        metavar="FILE",
        help="static-ranking file to write (default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="model name stored in the file (default: the server's model_path; none with --from-dump)",
    )
    parser.add_argument(
        "--dump-dir",
        metavar="DIR",
        default=os.environ.get(RECORDER_DIR_ENV, DEFAULT_DUMP_DIR),
        help=f"the server's {RECORDER_DIR_ENV}, as seen from here (default: %(default)s)",
    )
    parser.add_argument(
        "--dump-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for the dump file (default: %(default)s)",
    )
    parser.add_argument("--api-key", metavar="KEY", help="the server's API key, if it was started with one")
    parser.add_argument(
        "--dataset",
        choices=CUSTOM_DATASETS,
        default="mt-bench",
        help="workload from the shipped eval sets (default: %(default)s)",
    )
    parser.add_argument(
        "--num-prompts", type=int, metavar="N", help="requests to send (default: every prompt of --dataset)"
    )
    parser.add_argument(
        "--max-concurrency", type=int, default=32, metavar="C", help="requests in flight (default: %(default)s)"
    )
    parser.add_argument(
        "--output-len",
        type=int,
        metavar="L",
        help=f"tokens generated per request (default: {DEFAULT_MT_BENCH_OUTPUT_LEN} for mt-bench, the reference "
        "answer's length for gsm8k)",
    )
    parser.add_argument(
        "--tokenizer", metavar="NAME", help="tokenizer for the benchmark client (default: the server's)"
    )
    parser.add_argument(
        "--no-workload", action="store_true", help="send no traffic; record while you drive the server for --duration"
    )
    parser.add_argument("--duration", type=float, metavar="S", help="seconds to record with --no-workload")


def _check_flags(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag for values the command cannot use."""
    if args.url is not None and not re.match(r"^https?://[^/\s]+", args.url):
        raise ValueError(f"--url {args.url!r} is invalid: give http://host:port or https://host:port")
    for flag, value, minimum in (
        ("--num-prompts", args.num_prompts, 1),
        ("--max-concurrency", args.max_concurrency, 1),
        ("--output-len", args.output_len, MIN_OUTPUT_LEN),
    ):
        if value is not None and value < minimum:
            raise ValueError(f"{flag} {value} is invalid: must be an integer >= {minimum}")
    if args.duration is not None and not (args.duration >= 0 and args.duration != float("inf")):
        raise ValueError(f"--duration {args.duration} is invalid: must be a finite number of seconds >= 0")
    if args.dump_timeout < 0:
        raise ValueError(f"--dump-timeout {args.dump_timeout} is invalid: must be >= 0")
    if args.no_workload and args.duration is None:
        raise ValueError("--no-workload needs --duration S: how many seconds to record your own traffic")
    if args.duration is not None and not args.no_workload:
        raise ValueError("--duration is for --no-workload; the benchmark workload records until it finishes")
    if args.url is not None and not args.no_workload and args.num_prompts is not None:
        available = len(custom_conversations(args.dataset))
        if args.num_prompts > available:
            raise ValueError(
                f"--num-prompts {args.num_prompts} is invalid: --dataset {args.dataset} has {available} prompts"
            )
    if args.from_dump is not None or args.from_trace is not None:
        workload_flags = {
            "--no-workload": args.no_workload,
            "--num-prompts": args.num_prompts is not None,
            "--output-len": args.output_len is not None,
            "--tokenizer": args.tokenizer is not None,
            "--duration": args.duration is not None,
        }
        used = [flag for flag, given in workload_flags.items() if given]
        if used:
            source = "--from-dump" if args.from_dump is not None else "--from-trace"
            raise ValueError(f"{', '.join(used)}: workload flags need --url, not {source}")


def _server_workload(args: argparse.Namespace, client: RecorderClient, model_info: dict, work_dir: Path) -> Workload:
    if args.no_workload:
        return idle_workload(args.duration)
    if not benchmark_client_available():
        raise CalibrationError(
            "the workload runs SGLang's benchmark client (python -m sglang.benchmark.serving), but sglang is not "
            "installed here; install it, or send traffic yourself with --no-workload --duration S"
        )
    num_prompts = args.num_prompts if args.num_prompts is not None else len(custom_conversations(args.dataset))
    output_len = args.output_len
    if output_len is None and args.dataset == "mt-bench":
        output_len = DEFAULT_MT_BENCH_OUTPUT_LEN
    dataset_path = write_custom_dataset(args.dataset, work_dir / f"{args.dataset}.jsonl")
    cmd = benchmark_command(
        client.url,
        dataset_path,
        output_file=work_dir / "benchmark.jsonl",
        num_prompts=num_prompts,
        max_concurrency=args.max_concurrency,
        output_len=output_len,
        model=model_info.get("model_path"),
        tokenizer=args.tokenizer or model_info.get("tokenizer_path") or model_info.get("model_path"),
    )
    return benchmark_workload(cmd, work_dir=work_dir, api_key=args.api_key)


def _expected_files(mode: str | None, info: dict | None) -> int:
    if mode not in ("per_pass", "per_token") or not info:
        return 1
    size = info.get("tp_size")
    return size if isinstance(size, int) and size > 0 else 1


def calibrate_from_server(args: argparse.Namespace) -> tuple[ExpertCounts, str | None]:
    """Record a workload on ``args.url`` and read the dump; returns the counts and the server's model."""
    client = RecorderClient(args.url, api_key=args.api_key)
    info = client.server_info()
    mode = check_server(info, client.url)
    model_info = client.model_info() or {}
    with tempfile.TemporaryDirectory(prefix="xshare-calibrate-") as work:
        workload = _server_workload(args, client, model_info, Path(work))
        paths = record_dump(
            client,
            args.dump_dir,
            workload,
            expected_files=_expected_files(mode, info),
            dump_timeout=args.dump_timeout,
        )
    counts = read_dump(paths)
    buffer_size = (info or {}).get("expert_distribution_recorder_buffer_size")
    if "stat" in counts.kinds and isinstance(buffer_size, int) and 0 <= buffer_size <= counts.forward_passes:
        logger.warning(
            "%d forward passes filled the recorder's circular buffer of %d: earlier passes were overwritten",
            counts.forward_passes,
            buffer_size,
        )
    return counts, model_info.get("model_path")


def counts_from_traces(paths: Sequence[str]) -> tuple[ExpertCounts, str | None]:
    """Counts and routing statistics of ``xshare-trace`` files or folders; returns them and the model
    the traces name."""
    from ...replay.trace import load_trace, load_trace_dir

    stats = None
    files, passes, model = [], 0, None
    for item in paths:
        path = Path(item)
        if not path.exists():
            raise InputFileError(f"--from-trace {item}: no such file or folder")
        trace = load_trace_dir(path) if path.is_dir() else load_trace(path)  # InputFileError: exit 2
        trace_stats = stats_from_trace(trace)
        if stats is None:
            stats = trace_stats
        else:
            try:
                stats.merge(trace_stats)
            except ValueError as exc:
                raise CalibrationError(f"--from-trace {item}: {exc}") from None
        files.append(path)
        passes += len({call.step for call in trace.calls})
        model = model or trace.meta.model
    assert stats is not None
    counts = ExpertCounts(
        counts=stats.counts(), forward_passes=passes, files=tuple(files), kinds=("trace",) * len(files), stats=stats
    )
    return counts, model


def calibrate_handler(args: argparse.Namespace) -> int:
    """``xshare-sglang calibrate``: record or convert, write the ranking, print a summary."""
    _check_flags(args)
    try:
        if args.from_dump is not None:
            paths = [p for item in args.from_dump for p in dump_paths(item)]
            counts, server_model = read_dump(paths), None
        elif args.from_trace is not None:
            counts, server_model = counts_from_traces(args.from_trace)
        else:
            counts, server_model = calibrate_from_server(args)
        model = args.model or server_model
        ranking = write_static_ranking(counts, args.output, model)
    except CalibrationError as exc:
        raise SystemExit(f"xshare-sglang calibrate: {exc}") from None
    _print_summary(counts, ranking, Path(args.output))
    return 0


def _print_summary(counts: ExpertCounts, ranking: StaticRanking, output: Path) -> None:
    from rich.console import Console

    console = Console(width=max(Console().width, 170))
    shares = counts.top_share(TOP_SHARE)
    layers = counts.counted_layers()
    k = min(TOP_SHARE, counts.num_experts)
    console.print(
        f"wrote {output}: {ranking.num_layers} layers x {ranking.num_experts} experts"
        + (f" ({ranking.model})" if ranking.model else "")
        + f", {counts.selections:,} expert selections over {counts.forward_passes:,} recorded forward passes, from "
        + ", ".join(f"{p} ({kind})" for p, kind in zip(counts.files, counts.kinds, strict=True))
    )
    console.print(
        f"layers with selections: {len(layers)} of {counts.num_layers} (rows are indexed by layer id; "
        "dense layers keep rows of zeros)"
    )
    if shares:
        ordered = sorted(shares.items(), key=lambda item: item[1])
        (low_layer, low), (high_layer, high) = ordered[0], ordered[-1]
        median = ordered[len(ordered) // 2][1]
        console.print(
            f"share of a layer's selections on its {k} most-picked experts: min {100 * low:.1f}% (layer {low_layer}), "
            f"median {100 * median:.1f}%, max {100 * high:.1f}% (layer {high_layer}); uniform would be "
            f"{100 * k / counts.num_experts:.1f}%"
        )
    console.print(
        f"use it: --moe-pruner moe-spec --moe-pruner-ranking static --moe-pruner-static-ranking-path {output} "
        "--moe-pruner-max-experts B"
    )
    if counts.stats is not None:
        example = min(16, counts.num_experts)
        budgets = ranking.layer_budgets(example)
        shown = ", ".join(f"{layer}:{budgets[layer]}" for layer in layers)
        console.print(
            f"co-activation counts and budget curves written; with --moe-pruner-max-experts {example} the calibrated "
            f"per-layer budgets are {shown}"
        )
        console.print(
            f"use them: --moe-pruner moe-spec --moe-pruner-static-ranking-path {output} --moe-pruner-max-experts B "
            "--moe-pruner-budget-allocation calibrated and/or --moe-pruner-ranking coactivation"
        )
