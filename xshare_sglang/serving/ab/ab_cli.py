"""``xshare-ab-compare``: A/B serving comparison of pruner configurations against the unpruned server.

Examples
--------
Launch each arm in turn on this node (two repetitions, the arms' order rotated by one each time)::

    xshare-ab-compare --model-path Qwen/Qwen3-30B-A3B --server-args "--tp 1 --moe-runner-backend triton" \\
        --candidate xshare --candidate moe-spec --concurrency 1 8 32 --dataset random-ids mt-bench

Servers you started yourself, one per arm (``--url NAME=URL``; the pruner-off arm is ``baseline``)::

    xshare-ab-compare --model-path Qwen/Qwen3-30B-A3B --candidate xshare \\
        --url baseline=http://gpu0:30000 --url xshare=http://gpu1:30000 --server-log xshare=/logs/xshare.log

Exit status: 0 when every session ran, 3 when some arm failed (the others' results are kept and
reported), 2 for invalid arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import logging
import shlex
import sys
from dataclasses import replace
from pathlib import Path

from ..datasets import DATASETS
from .ab_config import BASELINE_NAME, AbConfigError, AbSettings, Arm, candidate_arm, read_arms_file
from .ab_plan import build_plan, render_plan

logger = logging.getLogger(__name__)

EXIT_ARM_FAILED = 3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="xshare-ab-compare",
        description="A/B serving comparison: SGLang's benchmark client and few-shot GSM8K against the unpruned "
        "server and each pruner configuration, repeated with the order rotated, with a Markdown report and plots.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    what = parser.add_argument_group("what to compare")
    what.add_argument("--model-path", help="model of every server (also the client's --model)")
    what.add_argument(
        "--arms", metavar="FILE", help="YAML/JSON file of arms (see docs/serving.md, section A/B comparison)"
    )
    what.add_argument(
        "--candidate",
        action="append",
        default=[],
        metavar="SPEC",
        help="a candidate arm: a policy name, or a JSON object of --moe-pruner-config fields (optional 'name')",
    )
    what.add_argument("--server-args", default="", metavar="FLAGS", help="launch flags common to every arm")
    servers = parser.add_argument_group("servers")
    servers.add_argument(
        "--url",
        action="append",
        default=[],
        metavar="NAME=URL",
        help="use a server you started for arm NAME instead of launching one (give one per arm)",
    )
    servers.add_argument(
        "--server-log",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="log file of a --url server, checked for the plugin's proof-of-life line",
    )
    servers.add_argument(
        "--launch-command", default=f"{sys.executable} -m sglang.launch_server", help="how to start a server"
    )
    servers.add_argument("--host", default="127.0.0.1", help="host launched servers listen on")
    servers.add_argument("--port", type=int, default=30000, help="port launched servers listen on")
    servers.add_argument("--no-metrics", action="store_true", help="do not add --enable-metrics to launched servers")
    servers.add_argument("--startup-timeout", type=float, default=1800.0, metavar="S", help="seconds to become healthy")
    servers.add_argument("--run-timeout", type=float, default=3600.0, metavar="S", help="seconds per client run")
    servers.add_argument("--stop-timeout", type=float, default=60.0, metavar="S", help="seconds before SIGKILL")
    load = parser.add_argument_group("workload")
    load.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="N", help="max concurrency")
    load.add_argument("--dataset", nargs="+", default=["random-ids"], choices=DATASETS, help="serving workloads")
    load.add_argument("--repeats", type=int, default=2, help="repetitions of every arm (the order rotates each time)")
    load.add_argument(
        "--num-prompts", type=int, default=None, help="prompts per run (default: max(32, 8 x concurrency))"
    )
    load.add_argument("--random-input-len", type=int, default=1024, help="random-ids prompt tokens")
    load.add_argument("--random-output-len", type=int, default=256, help="random-ids output tokens")
    load.add_argument("--output-len", type=int, default=256, help="output tokens per MT-Bench request")
    load.add_argument("--tokenizer", default=None, help="client tokenizer (default: --model-path)")
    load.add_argument("--seed", type=int, default=1, help="prompt sampling seed (same for every arm)")
    acc = parser.add_argument_group("accuracy (SGLang's few-shot GSM8K on the shipped test split)")
    acc.add_argument("--no-accuracy", action="store_true", help="skip the GSM8K run")
    acc.add_argument("--gsm8k-questions", type=int, default=200)
    acc.add_argument("--gsm8k-shots", type=int, default=5)
    acc.add_argument("--gsm8k-parallel", type=int, default=64)
    acc.add_argument("--gsm8k-max-new-tokens", type=int, default=512)
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", default=None, help="results folder (default: ab-results/<UTC time>)")
    out.add_argument("--dry-run", action="store_true", help="print every command the run would execute, run nothing")
    out.add_argument("--report", metavar="DIR", help="only rebuild summary.md and the plots from DIR/runs.jsonl")
    out.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return parser


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name or not rest:
            raise AbConfigError(f"{flag} {value!r}: expected NAME=VALUE")
        if name in out:
            raise AbConfigError(f"{flag}: arm {name!r} given twice")
        out[name] = rest
    return out


def settings_from_args(args: argparse.Namespace) -> AbSettings:
    """Validated settings from the parsed flags (raises AbConfigError naming the flag)."""
    arms: list[Arm] = []
    common: tuple[str, ...] = ()
    model = args.model_path
    if args.arms:
        doc = read_arms_file(args.arms)
        arms += doc["arms"]
        common = doc["server_args"]
        model = model or doc["model_path"]
    arms += [candidate_arm(spec) for spec in args.candidate]
    try:
        common = (*common, *shlex.split(args.server_args))
    except ValueError as exc:
        raise AbConfigError(f"--server-args: cannot split into flags ({exc})") from None
    urls = _pairs(args.url, "--url")
    logs = _pairs(args.server_log, "--server-log")
    if urls:
        if not any(arm.is_baseline for arm in arms):
            arms.insert(0, Arm(name=BASELINE_NAME))
        names = {arm.name for arm in arms}
        for name in [*urls, *logs]:
            if name not in names:
                raise AbConfigError(f"--url/--server-log: no arm named {name!r}; arms: {', '.join(sorted(names))}")
        missing = sorted(names - set(urls))
        if missing:
            raise AbConfigError(f"--url: every arm needs a server; missing {', '.join(missing)}")
        arms = [replace(arm, url=urls[arm.name], server_log=logs.get(arm.name)) for arm in arms]
    elif logs:
        raise AbConfigError("--server-log: only for servers given by --url")
    output_dir = args.output_dir or Path("ab-results") / _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    try:
        launch = tuple(shlex.split(args.launch_command))
    except ValueError as exc:
        raise AbConfigError(f"--launch-command: cannot split ({exc})") from None
    return AbSettings(
        model_path=model or "",
        arms=tuple(arms),
        output_dir=Path(output_dir),
        server_args=common,
        concurrencies=tuple(args.concurrency),
        datasets=tuple(args.dataset),
        repeats=args.repeats,
        num_prompts=args.num_prompts,
        random_input_len=args.random_input_len,
        random_output_len=args.random_output_len,
        output_len=args.output_len,
        accuracy=not args.no_accuracy,
        gsm8k_questions=args.gsm8k_questions,
        gsm8k_shots=args.gsm8k_shots,
        gsm8k_parallel=args.gsm8k_parallel,
        gsm8k_max_new_tokens=args.gsm8k_max_new_tokens,
        tokenizer=args.tokenizer,
        host=args.host,
        port=args.port,
        launch_command=launch,
        enable_metrics=not args.no_metrics,
        startup_timeout_s=args.startup_timeout,
        run_timeout_s=args.run_timeout,
        stop_timeout_s=args.stop_timeout,
        seed=args.seed,
    )


def write_report(folder: Path) -> tuple[Path, list[Path]]:
    """Write ``summary.md``, ``summary.json`` and the plots of the run in ``folder``."""
    from .ab_plot import plot_pareto, plot_throughput
    from .ab_report import read_runs, render_markdown, summarize
    from .ab_server import write_json

    summary = summarize(read_runs(folder))
    markdown = folder / "summary.md"
    markdown.write_text(render_markdown(summary), encoding="utf-8")
    write_json(folder / "summary.json", summary.to_dict())
    plots = plot_throughput(summary, folder) + plot_pareto(summary, folder)
    return markdown, plots


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if args.report:
        try:
            markdown, plots = write_report(Path(args.report))
        except ValueError as exc:
            parser.error(f"--report: {exc}")
        print(markdown.read_text(encoding="utf-8"))
        print(f"wrote {markdown} and {len(plots)} plot(s)")
        return 0
    try:
        settings = settings_from_args(args)
    except AbConfigError as exc:
        parser.error(str(exc))
    if args.dry_run:
        print(render_plan(settings, build_plan(settings)), end="")
        return 0
    from .ab_run import AbRunner

    runner = AbRunner(settings, echo=print)
    try:
        runner.run()
    except KeyboardInterrupt:
        print("interrupted: the report covers the runs finished so far", file=sys.stderr)
    markdown, plots = write_report(settings.output_dir)
    print()
    print(markdown.read_text(encoding="utf-8"))
    print(f"wrote {settings.output_dir / 'runs.jsonl'}, {markdown} and {len(plots)} plot(s)")
    return EXIT_ARM_FAILED if runner.dropped else 0


if __name__ == "__main__":
    sys.exit(main())
