"""``xshare-sglang``: the project's command line (``python -m xshare_sglang`` works too).

Subcommands
-----------
demo    batched greedy decoding with the shipped tiny MoE model under every policy: activated
        experts, agreement with unpruned decoding, held-out perplexity per domain, modeled speed-up.
replay  replay routing traces (shipped, recorded from the tiny model, or your own xshare-trace /
        route CSV files) through the policies in single-load, mixed-load and speculative batches.
verify  replay speculative verify batches (R requests x D draft tokens): batch-level against
        per-request policies, optionally with depth-decayed votes.
convert turn a public route_trace v1 CSV file into an xshare-trace file.
echo-calibrate
        ECHO's gates from a log of draft confidences and accepted lengths (``--xshare-echo-log-dir``
        or ``spec-eval``): per-depth AUC, Youden thresholds, sweet-spot depths -> calibration JSON.
spec-eval
        tree speculative decoding of the tiny MoE with its tiny draft on CPU: SGLang's node choice
        against ECHO at equal budgets (accepted tokens, utilization, verified nodes, experts).
quality teacher-forced quality of every policy on the tiny MoE model: KL to the unpruned next-token
        distribution, top-1 agreement, NLL change (bootstrap intervals), experts read, modeled speed-up.
calibrate
        per-layer expert counts from SGLang's expert-distribution recorder during a workload (or from
        an existing dump) -> the static-ranking file of ``--moe-pruner-ranking static``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .cli_common import _configs_file, _console, _progress
from .config import PrunerConfig
from .files import InputFileError
from .replay.configs import DEFAULT_SHAPES, VERIFY_SHAPES
from .tiny.spec_eval import add_spec_eval_arguments, spec_eval_handler

logger = logging.getLogger(__name__)

BUNDLED = ("gptoss", "gemma", "tiny")

# ----------------------------------------------------------------------------------------- demo


def _one_torch_thread() -> None:
    """Run torch's CPU work on one thread unless ``OMP_NUM_THREADS`` says otherwise: the tiny models'
    matrices are too small for intra-op threads to pay, and two threads on two cores wait on each
    other whenever another process takes a core (docs/offline.md, "The demo", has the timings)."""
    import os

    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


DEMO_COLUMNS = (
    ("experts", "distinct experts one decode MoE layer call reads, pruned / unpruned"),
    ("retained", "share of the tokens' natural top-k router weight that falls on kept experts"),
    (
        "kl",
        "held-out text read teacher-forced in decode batches: KL(unpruned || pruned) of the next-token "
        "distribution, nats per token, mean [95% bootstrap interval over windows]",
    ),
    ("top1_agree", "same text: % of positions whose most likely next token is the unpruned model's"),
    ("nll_delta", "same text: NLL of the true next token, pruned minus unpruned, nats per token"),
    ("speedup", "expert bytes read, unpruned over pruned (HBM-bandwidth model of the MoE layers only)"),
    (
        "greedy agree*",
        "secondary: free-running greedy tokens equal to unpruned decoding at the same position; one "
        "flipped token changes the rest, so this mostly shows how thin a tiny model's margins are",
    ),
)


def _demo(args: argparse.Namespace) -> int:
    from rich.table import Table

    from .replay.plot import plot_pareto
    from .tiny.tiny_demo import DemoSettings, demo_configs, run_demo
    from .tiny.tiny_model import model_dir_arg

    console = _console()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = DemoSettings.quick() if args.quick else DemoSettings()
    model_dir = model_dir_arg(args.model)
    try:
        model_config = json.loads((model_dir / "config.json").read_text())
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
        num_experts = model_config.get("num_experts", model_config.get("num_local_experts"))
        top_k, num_experts = model_config["num_experts_per_tok"], int(num_experts)
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--model {model_dir}: not a Qwen3-MoE checkpoint folder ({exc})") from None
    configs = _configs_file(args.configs) if args.configs else demo_configs(top_k, num_experts, quick=args.quick)
    if configs[0].policy != "none":
        configs = [PrunerConfig(policy="none"), *configs]
    _one_torch_thread()
    console.print(
        f"[bold]{model_dir.name}[/bold] ({model_config['num_hidden_layers']} layers, {num_experts} experts, "
        f"top-{top_k}): {3 * settings.prompts_per_domain} prompts "
        f"(code, math, prose) x {settings.new_tokens} greedy tokens, and {3 * settings.windows_per_domain} "
        f"held-out windows x {settings.window_tokens} tokens read teacher-forced, {settings.requests} per decode "
        "forward, and compared with the unpruned model position by position"
    )
    with _progress(console) as progress:
        task = progress.add_task("policies", total=len(configs))
        rows = run_demo(
            configs,
            settings=settings,
            model_dir=model_dir,
            trace_path=out / "tiny_moe.decode.trace.pt",
            on_config_done=lambda: progress.advance(task),
        )
    table = Table(
        title="tiny MoE decode, every policy (means over decode layer calls and tokens)", title_justify="left"
    )
    columns = ("policy", "parameters", "experts", "retained", "kl", "top1_agree", "nll_delta", "speedup")
    for column in (*columns, "greedy agree*"):
        table.add_column(column, justify="left" if column in ("policy", "parameters") else "right", no_wrap=True)
    for row in rows:
        table.add_row(
            row.policy,
            row.params.replace(" ranking=router", "").replace(" scope=batch", ""),
            f"{row.activated:.1f}/{row.baseline_activated:.1f}",
            f"{100 * row.retained_mass:.1f}%",
            row.kl.fmt(".2f", sep=","),
            row.top1_agree.fmt(".1f", 100, sep=","),
            row.nll_delta.fmt("+.2f", sep=","),
            f"{row.speedup:.2f}x",
            f"{100 * row.token_agreement:.1f}%",
        )
    console.print(table)
    for column, note in DEMO_COLUMNS:
        console.print(f"  {column}: {note}")
    points = [{"label": f"{r.policy} {r.params}", "top1_agree": r.top1_agree.mean, "speedup": r.speedup} for r in rows]
    plot = plot_pareto(
        {"decode batches, 3 domains": points},
        out / "demo_pareto.png",
        model_dir.name,
        x_key="top1_agree",
        x_label="teacher-forced top-1 agreement (%)",
    )
    (out / "demo.json").write_text(json.dumps([r.as_dict() for r in rows], indent=2))
    console.print(
        f"wrote {plot}, {out / 'demo.json'} and the unpruned run's router trace {out / 'tiny_moe.decode.trace.pt'} "
        f"(replay it: xshare-sglang replay --trace {out / 'tiny_moe.decode.trace.pt'} --scenario single,mixed)"
    )
    return 0


# --------------------------------------------------------------------------------------- replay


def _load_traces(names: list[str]):
    from .replay import bundled_trace_path, load_route_csv, load_trace, trace_from_route_csv
    from .replay.trace import load_trace_dir

    for name in names:
        if name == "tiny":
            from .tiny.tiny_demo import DemoSettings, record_tiny_trace

            yield record_tiny_trace(DemoSettings())
        elif name in ("gptoss", "gemma"):
            yield trace_from_route_csv(load_route_csv(bundled_trace_path(name)))
        elif name.endswith(".csv"):
            yield trace_from_route_csv(load_route_csv(name))
        elif Path(name).is_dir():
            yield load_trace_dir(name)
        else:
            if not Path(name).is_file():
                raise ValueError(f"--trace {name!r}: no such file or folder; use a path or one of {', '.join(BUNDLED)}")
            yield load_trace(name)


def _check_shapes_fit(traces, tables, shapes, scenarios, share) -> None:
    """Raise ``ValueError`` naming ``--shapes`` when a batch shape fits no batch of a trace, with the
    largest request count R that fits at the same D."""
    from .replay import BatchShape, build_batches

    for trace, table in zip(traces, tables, strict=True):
        by_source = table.sequences()
        for scenario in scenarios:
            if scenario == "mixed" and len(by_source) < 2:
                continue
            for shape in shapes:
                if build_batches(by_source, shape, scenario, share):
                    continue
                low, high = 0, shape.requests  # the largest R that fits lies in [low, high)
                while high - low > 1:
                    mid = (low + high) // 2
                    fits = build_batches(by_source, BatchShape(mid, shape.tokens_per_request), scenario, share)
                    low, high = (mid, high) if fits else (low, mid)
                hint = (
                    f"at most {low}x{shape.tokens_per_request}"
                    if low
                    else f"no R fits D={shape.tokens_per_request}; use a smaller D"
                )
                raise ValueError(
                    f"--shapes {shape}: trace {trace.name} has too few decode tokens for {shape.requests} requests "
                    f"of {shape.tokens_per_request} tokens in {scenario} batches ({hint})"
                )


def _replay_tables(args: argparse.Namespace, config_factory) -> int:
    from rich.table import Table

    from .replay import BatchShape, build_batches, replay_table, token_table
    from .replay.configs import with_depth_decay
    from .replay.cost import DEVICES
    from .replay.plot import plot_pareto

    console = _console()
    try:
        shapes = [BatchShape.parse(text) for text in args.shapes.split(",")]
    except ValueError as exc:
        raise ValueError(f"--shapes {args.shapes}: {exc}") from None
    scenarios = [s.strip() for s in args.scenario.split(",") if s.strip()]
    traces = list(_load_traces(args.trace))
    tables = [token_table(trace, "decode") for trace in traces]
    _check_shapes_fit(traces, tables, shapes, scenarios, args.share)
    plot_dir = Path(args.plot_dir) if args.plot_dir else None
    if plot_dir:
        plot_dir.mkdir(parents=True, exist_ok=True)
    all_rows = []
    for trace, table_of_tokens in zip(traces, tables, strict=True):
        meta = trace.meta
        configs = with_depth_decay(config_factory(meta.top_k, meta.num_experts), args.depth_decay)
        by_source = table_of_tokens.sequences()
        console.print(
            f"\n[bold]{trace.name}[/bold]: {meta.model}, {meta.num_layers} layers, E={meta.num_experts}, "
            f"top-k={meta.top_k}, {table_of_tokens.num_tokens} decode tokens from "
            f"{sum(map(len, by_source.values()))} requests, sources: {', '.join(by_source)}"
        )
        jobs = []
        for scenario in scenarios:
            for shape in shapes:
                if scenario == "mixed" and len(by_source) < 2:
                    console.print(f"  mixed-load skipped: {trace.name} has one source")
                    break
                batches = build_batches(by_source, shape, scenario, args.share)
                if not batches:
                    console.print(f"  {scenario} {shape}: sequences too short, skipped")
                    continue
                jobs.append((scenario, shape, batches))
        panels: dict[str, dict[str, list[dict]]] = {}
        with _progress(console) as progress:
            task = progress.add_task(f"{trace.name}", total=len(jobs) * len(configs))
            results = [
                replay_table(
                    table_of_tokens,
                    batches,
                    configs,
                    scenario=scenario,
                    shape=shape,
                    on_config_done=lambda task=task: progress.advance(task),
                )
                for scenario, shape, batches in jobs
            ]
        for (scenario, shape, _), rows in zip(jobs, results, strict=True):
            label = "mixed-load" if scenario == "mixed" else "single-load"
            kind = "speculative " if shape.tokens_per_request > 1 else ""
            table = Table(
                title=f"{trace.name}, {kind}{label}, {shape.requests} requests x {shape.tokens_per_request} tokens "
                f"({rows[0].layer_calls} layer calls)",
                title_justify="left",
            )
            columns = ["policy", "parameters", "activated", "kept", "retained mass", "top-1 kept", "speed-up"]
            columns += [f"MoE µs {d.name}" for d in DEVICES] if rows[0].modeled_us else []
            for column in columns:
                text = column in ("policy", "parameters")
                table.add_column(column, justify="left" if text else "right", no_wrap=True)
            for row in rows:
                table.add_row(
                    row.policy,
                    row.params,
                    f"{row.activated:.2f}",
                    f"{row.kept:.2f}",
                    f"{100 * row.retained_mass:.1f}%",
                    f"{100 * row.top1_kept:.1f}%",
                    f"{row.speedup:.2f}x",
                    *(f"{row.modeled_us[d.name]:.2f}" for d in DEVICES if row.modeled_us),
                )
            console.print(table)
            panels.setdefault(scenario, {})[f"{shape.requests} req x {shape.tokens_per_request} tok"] = [
                {"label": f"{r.policy} {r.params}", "retained_mass": r.retained_mass, "speedup": r.speedup}
                for r in rows
            ]
            all_rows += rows
        if plot_dir:
            for scenario, panel in panels.items():
                path = plot_pareto(panel, plot_dir / f"{trace.name}_{scenario}.png", f"{trace.name}, {scenario}-load")
                console.print(f"wrote {path}")
    console.print(
        "activated = distinct experts the routed tokens use per layer call (mean); kept = size of the keep mask; "
        "retained mass = share of the natural top-k router weight on kept experts; speed-up = expert bytes read, "
        "unpruned over pruned; MoE µs = activated experts x bytes per expert / peak HBM bandwidth "
        + "; ".join(f"{d.name} {d.hbm_bytes_per_second / 1e12:.2f} TB/s ({d.source})" for d in DEVICES)
        + ".\nTraces that list only each token's top-k cannot move a token to an unlisted expert: there substitution "
        "acts as truncation, and lynx keeps every listed expert."
    )
    if args.json:
        Path(args.json).write_text(json.dumps([row.as_dict() for row in all_rows], indent=2))
        console.print(f"wrote {args.json}")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from .replay import default_configs, sweep_configs

    if args.configs and args.sweep:
        raise ValueError("--configs and --sweep exclude each other: choose one")
    if args.sweep:
        try:
            values = [float(v) for v in args.values.split(",")]
        except (AttributeError, ValueError):
            raise ValueError(f"--values {args.values!r} is invalid: give numbers, e.g. --values 2,4,8,16") from None
        swept = sweep_configs(args.sweep, values)
        return _replay_tables(args, lambda top_k, e: [PrunerConfig(policy="none"), *swept])
    if args.configs:
        chosen = _configs_file(args.configs)
        return _replay_tables(args, lambda top_k, e: chosen)
    return _replay_tables(args, default_configs)


def _verify(args: argparse.Namespace) -> int:
    from .replay import verify_configs

    if args.configs:
        chosen = _configs_file(args.configs)
        return _replay_tables(args, lambda top_k, e: chosen)
    return _replay_tables(args, verify_configs)


def _convert(args: argparse.Namespace) -> int:
    from .replay import load_route_csv, trace_from_route_csv

    trace = trace_from_route_csv(load_route_csv(args.source, phase=args.phase))
    path = trace.save(args.out)
    meta = trace.meta
    _console().print(
        f"wrote {path}: {meta.model}, {len(trace.calls)} layer calls ({meta.num_layers} layers, E={meta.num_experts}, "
        f"top-k={meta.top_k}, top-k ids and weights only)"
    )
    return 0


def _echo_calibrate(args: argparse.Namespace) -> int:
    from .spec.echo import calibrate, read_echo_log
    from .spec.echo.report import calibration_table

    records = read_echo_log(args.log)
    calib = calibrate(records, auc_threshold=args.auc_threshold, min_samples=args.min_samples)
    calib.save(args.out)
    console = _console()
    console.print(calibration_table(calib))
    if not calib.gates:
        console.print("no depth separates accepted from rejected drafts well enough: ECHO will not truncate")
    console.print(
        f"gates: {', '.join(f'depth {d} > {t:.4g}' for d, t in sorted(calib.gates.items())) or 'none'}; "
        f"wrote {args.out}"
    )
    return 0


def _add_replay_arguments(parser: argparse.ArgumentParser, *, default_shapes: tuple[str, ...], traces: list[str]):
    """The options every trace-replay subcommand takes."""
    parser.add_argument(
        "--trace",
        nargs="+",
        default=traces,
        help="bundled traces (gptoss, gemma: public top-k traces; tiny: recorded now from the tiny model) "
        "or paths of xshare-trace (.pt) files, folders of them (one trace), or route_trace v1 (.csv) files",
    )
    parser.add_argument("--shapes", default=",".join(default_shapes), help="batch shapes RxD, comma-separated")
    parser.add_argument("--configs", help="JSON file holding a list of PrunerConfig objects to compare")
    parser.add_argument("--json", help="also write every row to this JSON file")
    parser.add_argument("--plot-dir", help="write a Pareto plot (PNG) per trace and scenario into this folder")
    parser.add_argument(
        "--depth-decay",
        type=float,
        default=None,
        metavar="X",
        help="weigh the vote of the token at depth d of its request by X**d, in (0, 1] (default: off)",
    )
    parser.add_argument("--share", type=float, default=0.25, help="mixed-load: share of slots from the focus source")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xshare-sglang", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="decode with the shipped tiny MoE model under every policy")
    demo.add_argument("--quick", action="store_true", help="three policies, short prompts (under 30 s)")
    demo.add_argument("--out", default="xshare-demo", help="folder for the plot, JSON and trace (default: %(default)s)")
    demo.add_argument(
        "--model",
        help="a shipped model, tiny (32 experts, top-4; the default) or e128 (128 experts, top-8), or the folder "
        "of a Qwen3-MoE checkpoint with heldout_{code,math,prose}.jsonl",
    )
    demo.add_argument("--configs", help="JSON file holding a list of PrunerConfig objects to compare")
    demo.set_defaults(handler=_demo)

    replay = sub.add_parser("replay", help="replay routing traces through the policies")
    _add_replay_arguments(replay, default_shapes=DEFAULT_SHAPES, traces=["gptoss", "gemma"])
    replay.add_argument(
        "--scenario", default="single", help="comma-separated: single (one source per batch), mixed (--share)"
    )
    replay.add_argument("--sweep", metavar="POLICY", help="compare one policy over --values of its size knob")
    replay.add_argument("--values", help="values of the swept knob, comma-separated (e.g. 2,4,8,16)")
    replay.set_defaults(handler=_replay)

    verify = sub.add_parser(
        "verify",
        help="replay speculative verify batches (R requests x D draft tokens) through the verify policies",
    )
    _add_replay_arguments(verify, default_shapes=VERIFY_SHAPES, traces=["gptoss", "gemma"])
    verify.set_defaults(handler=_verify, scenario="single")

    echo = sub.add_parser("echo-calibrate", help="ECHO gates from a log of draft confidences and acceptances")
    echo.add_argument("log", nargs="+", help="ECHO log files or folders (*.jsonl)")
    echo.add_argument("-o", "--out", default="echo_calibration.json", help="calibration file (default: %(default)s)")
    echo.add_argument(
        "--auc-threshold",
        type=float,
        default=0.75,
        help="intermediate depths are gated when their AUC reaches this; the first and last drafted depths "
        "when it beats 0.5 (default: %(default)s)",
    )
    echo.add_argument(
        "--min-samples",
        type=int,
        default=20,
        help="a depth needs this many accepted and rejected samples to be gated (default: %(default)s)",
    )
    echo.set_defaults(handler=_echo_calibrate)

    convert = sub.add_parser("convert", help="convert a route_trace v1 CSV file into an xshare-trace file")
    convert.add_argument("source", help="route_trace v1 CSV file")
    convert.add_argument("out", help="xshare-trace file to write (.pt)")
    convert.add_argument("--phase", default="decode", help="which steps to keep: decode or prefill (default: decode)")
    convert.set_defaults(handler=_convert)

    spec_eval = sub.add_parser("spec-eval", help="ECHO budgets in real tree speculative decoding (tiny MoE, CPU)")
    add_spec_eval_arguments(spec_eval)
    spec_eval.set_defaults(handler=spec_eval_handler)

    from .tiny.quality_cli import QUALITY_HELP, add_quality_arguments, quality_handler

    quality = sub.add_parser("quality", help=QUALITY_HELP)
    add_quality_arguments(quality)
    quality.set_defaults(handler=quality_handler)

    from .serving.calibration import static_calibration

    calibrate = sub.add_parser(
        "calibrate", help=static_calibration.CALIBRATE_HELP, epilog=static_calibration.CALIBRATE_EPILOG
    )
    static_calibration.add_calibrate_arguments(calibrate)
    calibrate.set_defaults(handler=static_calibration.calibrate_handler)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except InputFileError as exc:  # a file's content, not the command line: no usage text
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
