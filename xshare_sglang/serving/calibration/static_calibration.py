"""Static-ranking calibration: the ``xshare-sglang calibrate`` command line.

``xshare-sglang calibrate --url http://host:30000 -o ranking.json`` starts the recorder of a running
SGLang server, sends a workload through SGLang's own benchmark client (or waits while you send
traffic yourself), stops the recorder, has the server dump what it recorded, reads the dump and writes
the file that ``--moe-pruner moe-spec --moe-pruner-ranking static --moe-pruner-static-ranking-path``
reads.  ``--from-dump PATH`` converts a dump that already exists, without a server; ``--from-trace
PATH`` counts an ``xshare-trace``.  This module holds the command's flags, their checks, the choice
of source and the summary; the work is done in

* :mod:`~xshare_sglang.serving.calibration.server_checks`: what the server's ``/server_info`` must
  say before its recorder is touched (a recorder, no EPLB, the pruner off);
* :mod:`~xshare_sglang.serving.calibration.recorder_client`: the server's recorder endpoints and the
  dump a recording leaves in ``--dump-dir``;
* :mod:`~xshare_sglang.serving.calibration.workload`: the traffic recorded;
* :mod:`~xshare_sglang.serving.calibration.recorder_dump`: reading dumps and writing the ranking file.

Run calibration with the pruner off (``--moe-pruner none`` or no pruner flag, and no
``--moe-pruner-config`` that sets a policy): a pruning server would count only what it already keeps.
The public names of the modules above remain importable from here.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

from ...calibration_file import StaticRanking
from ...files import InputFileError
from ..datasets import CUSTOM_DATASETS, custom_conversations, write_custom_dataset
from .recorder_client import (
    DEFAULT_DUMP_DIR,
    DUMP,
    RECORDER_DIR_ENV,
    RECORDER_MODES,
    START,
    STOP,
    RecorderClient,
    record_dump,
)
from .recorder_dump import TOP_SHARE, CalibrationError, ExpertCounts, dump_paths, read_dump, write_static_ranking
from .routing_stats import stats_from_trace
from .server_checks import LaunchPruner, check_server, launch_pruner
from .workload import (
    DEFAULT_MT_BENCH_OUTPUT_LEN,
    MIN_OUTPUT_LEN,
    Workload,
    benchmark_client_available,
    benchmark_command,
    benchmark_workload,
    idle_workload,
)

__all__ = [
    "CALIBRATE_EPILOG",
    "CALIBRATE_HELP",
    "DEFAULT_DUMP_DIR",
    "DEFAULT_MT_BENCH_OUTPUT_LEN",
    "DUMP",
    "MIN_OUTPUT_LEN",
    "RECORDER_DIR_ENV",
    "RECORDER_MODES",
    "START",
    "STOP",
    "LaunchPruner",
    "RecorderClient",
    "Workload",
    "add_calibrate_arguments",
    "benchmark_client_available",
    "benchmark_command",
    "benchmark_workload",
    "calibrate_from_server",
    "calibrate_handler",
    "check_server",
    "counts_from_traces",
    "idle_workload",
    "launch_pruner",
    "record_dump",
]

logger = logging.getLogger(__name__)

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
