"""``xshare-sglang quality``: arguments, the table and the files of the teacher-forced comparison."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path

from ..cli_common import _configs_file, _console, _progress
from ..config import PrunerConfig

QUALITY_HELP = "teacher-forced quality of every policy on the tiny MoE model: KL, top-1 agreement, NLL change"

COLUMN_NOTES = (
    (
        "batch",
        "how the tokens reach the MoE layers: R requests per decode forward, or R requests x D tokens per "
        "verify forward (xshare-spec and per-request moe-spec)",
    ),
    ("kl", "KL(unpruned || pruned) of the next-token distribution, nats per token, mean [95% interval]"),
    ("top1_agree", "% of positions where the pruned model's most likely next token is the unpruned one's"),
    ("nll_delta", "negative log-likelihood of the true next token, pruned minus unpruned, nats per token"),
    ("experts", "experts one pruned MoE layer call reads, of those the same call reads unpruned"),
    ("speedup", "unpruned over pruned expert reads (the HBM-bandwidth model of the MoE layers only)"),
    (
        "accept_len",
        "verify policies: accepted draft tokens per request and step (bonus excluded) in real tree speculative "
        "decoding with the draft model, the target's verify forward pruned by the policy, mean [95% interval over "
        "requests] / the same with unpruned verify",
    ),
)


def add_quality_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="a shipped model, tiny (32 experts, top-4; the default) or e128 (128 experts, top-8), or the folder "
        "of a Qwen3-MoE checkpoint with heldout_{code,math,prose}.jsonl",
    )
    parser.add_argument("--configs", help="JSON file holding a list of PrunerConfig objects to compare")
    parser.add_argument(
        "--study",
        action="store_true",
        help="the Pareto study instead of the default list: every seed policy at several operating points and "
        "moe-spec with each new ranking and budget allocation, then which seed points each new one beats",
    )
    parser.add_argument(
        "--calibration",
        metavar="FILE",
        help="calibration file for the configurations that read one (moe-spec with --moe-pruner-budget-allocation "
        "calibrated or ranking coactivation); written first, from held-out text the evaluation never reads, when "
        "it does not exist (default: a temporary file)",
    )
    parser.add_argument("--requests", type=int, default=8, help="R, requests per forward (default: %(default)s)")
    parser.add_argument(
        "--draft-tokens", type=int, default=4, help="D, tokens per request in verify forwards (default: %(default)s)"
    )
    parser.add_argument("--windows", type=int, default=8, help="held-out windows per domain (default: %(default)s)")
    parser.add_argument(
        "--tokens", type=int, default=64, help="predicted tokens per window, a multiple of D (default: %(default)s)"
    )
    parser.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples (default: %(default)s)")
    parser.add_argument(
        "--draft",
        help="draft model folder for accept_len of the verify policies, or none (default: the shipped tiny draft "
        "when it shares the model's tokenizer)",
    )
    parser.add_argument("--json", help="also write every row to this JSON file")
    parser.add_argument("--plot-dir", help="write the Pareto plot (speed-up against top1_agree) into this folder")


def quality_handler(args: argparse.Namespace) -> int:
    """Validate every argument, then measure, print the table and write the files."""
    from rich.table import Table

    from .quality import QualitySettings, pareto_verdicts, quality_configs, run_quality, study_configs
    from .tiny_model import model_dir_arg

    settings = QualitySettings(
        requests=args.requests,
        draft_tokens=args.draft_tokens,
        windows_per_domain=args.windows,
        window_tokens=args.tokens,
        bootstrap=args.bootstrap,
    )
    model_dir = model_dir_arg(args.model)
    top_k, num_experts = _model_shape(model_dir)
    if args.study and args.configs:
        raise ValueError("--study and --configs: choose one (the study has its own list of configurations)")
    calibration = Path(args.calibration) if args.calibration else None
    if calibration is not None and calibration.is_dir():
        raise ValueError(f"--calibration {args.calibration}: is a folder, expected a file path")
    if args.configs and not Path(args.configs).is_file():
        raise ValueError(f"--configs {args.configs}: no such file")
    if args.json and Path(args.json).is_dir():
        raise ValueError(f"--json {args.json}: is a folder, expected a file path")
    if args.plot_dir and Path(args.plot_dir).exists() and not Path(args.plot_dir).is_dir():
        raise ValueError(f"--plot-dir {args.plot_dir}: is a file, expected a folder")
    draft_dir, draft_note = _draft_dir(args.draft, model_dir)
    temporary = None  # removed when the command ends (or, on an error, when it is collected)
    if calibration is None and not args.configs:
        import tempfile

        temporary = tempfile.TemporaryDirectory(prefix="xshare-quality-")
        calibration = Path(temporary.name) / "calibration.json"
    if calibration is not None and not calibration.exists():
        from .quality import calibrate_model_dir

        calibrate_model_dir(model_dir, settings, calibration)
    if args.configs:
        configs = _configs_file(args.configs)
    elif args.study:
        configs = study_configs(top_k, num_experts, calibration)
    else:
        configs = quality_configs(top_k, num_experts, calibration)
    if configs[0].policy != "none":
        configs = [PrunerConfig(policy="none"), *configs]

    from rich.console import Console

    console = Console(width=max(_console().width, 200))  # the intervals make a wide table
    console.print(
        f"[bold]{model_dir.name}[/bold] (top-{top_k} of {num_experts} experts): {3 * settings.windows_per_domain} "
        f"held-out windows (code, math, prose) x {settings.window_tokens} tokens, teacher-forced; "
        f"{len(configs)} configurations; {draft_note}"
    )
    with _progress(console) as progress:
        task = progress.add_task("configurations", total=len(configs))
        report = run_quality(
            configs,
            settings=settings,
            model_dir=model_dir,
            draft_dir=draft_dir,
            on_config_done=lambda: progress.advance(task),
        )
    rows, routing = report.rows, report.routing

    table = Table(title="teacher-forced quality per configuration (means over predicted tokens)", title_justify="left")
    columns = ("policy", "parameters", "batch", "kl", "top1_agree", "nll_delta", "experts", "speedup", "accept_len")
    for column in columns:
        table.add_column(
            column, justify="left" if column in ("policy", "parameters", "batch") else "right", no_wrap=True
        )
    for row in rows:
        table.add_row(
            row.policy,
            row.params.replace(" ranking=router", "").replace(" scope=batch", ""),
            row.batch,
            row.kl.fmt(".3f", sep=","),
            row.top1_agree.fmt(".1f", 100, sep=","),
            row.nll_delta.fmt("+.3f", sep=","),
            f"{row.experts:.1f}/{row.natural_experts:.1f}",
            f"{row.speedup:.2f}x",
            (
                f"{row.accept_len.fmt('.2f', sep=',')} / {row.unpruned_accept_len.mean:.2f}"
                if row.accept_len is not None
                else "-"
            ),
        )
    console.print(table)
    console.print(
        f"routing of the unpruned model on verify batches of R={routing.requests} x D={routing.draft_tokens}: "
        f"router entropy per layer {', '.join(f'{h:.2f}' for h in routing.entropy)} nats "
        f"(uniform: ln {routing.num_experts} = {math.log(routing.num_experts):.2f}); experts read per layer call "
        f"{', '.join(f'{u:.1f}' for u in routing.union)} of {routing.num_experts} (independent uniform picks: "
        f"{routing.uniform_union:.1f})"
    )
    for column, note in COLUMN_NOTES:
        console.print(f"  {column}: {note}")
    verdicts = pareto_verdicts(rows)
    for verdict in verdicts:
        outcome = "dominates the seed frontier" if verdict.dominates else "does not dominate the seed frontier"
        console.print(
            f"{verdict.family} ({verdict.batch}): {outcome}: beats {len(verdict.dominated)} seed frontier point(s)"
            + (f" ({'; '.join(verdict.dominated)})" if verdict.dominated else "")
            + f"; {len(verdict.beaten_by)} of its points beaten by a seed point"
            + " (beat: at least the same speed-up, top1_agree interval entirely above)"
        )
        if verdict.versus_router:
            counts = {
                word: sum(1 for _, w in verdict.versus_router if w == word) for word in ("better", "same", "worse")
            }
            console.print(
                f"  against plain moe-spec at the same budget: better at {counts['better']}, indistinguishable at "
                f"{counts['same']}, worse at {counts['worse']} of {len(verdict.versus_router)} budgets ("
                + ", ".join(f"B={b}: {w}" for b, w in verdict.versus_router)
                + ")"
            )
    if args.json:
        doc = report.as_dict()
        doc["verdicts"] = [dataclasses.asdict(v) | {"dominates": v.dominates} for v in verdicts]
        if args.calibration:
            doc["calibration"] = str(calibration)
        Path(args.json).write_text(json.dumps(doc, indent=2))
        console.print(f"wrote {args.json}")
    if args.plot_dir:
        from ..replay.plot import plot_pareto

        out = Path(args.plot_dir)
        out.mkdir(parents=True, exist_ok=True)
        panels: dict[str, list[dict]] = {}
        for row in rows:
            point = {"label": f"{row.policy} {row.params}", "top1_agree": row.top1_agree.mean, "speedup": row.speedup}
            panels.setdefault(row.batch, []).append(point)
        plot = plot_pareto(
            panels, out / "quality_pareto.png", model_dir.name, x_key="top1_agree", x_label="top-1 agreement (%)"
        )
        console.print(f"wrote {plot}")
        if args.study:
            from ..replay.plot import plot_study
            from .quality import is_new_family

            families: dict[str, list[dict]] = {}
            for row in rows:
                if row.policy == "none":
                    continue
                name = row.family if (is_new_family(row.family) or row.family == "moe-spec") else "seed policies"
                point = {
                    "top1_agree": row.top1_agree.mean,
                    "low": row.top1_agree.low,
                    "high": row.top1_agree.high,
                    "speedup": row.speedup,
                }
                families.setdefault(name, []).append(point)
            study = plot_study(
                families,
                out / "quality_study.png",
                f"{model_dir.name}: {rows[1].batch}",
                seeds=("seed policies", "moe-spec"),
            )
            console.print(f"wrote {study}")
    if temporary is not None:
        temporary.cleanup()
    return 0


def _model_shape(model_dir: Path) -> tuple[int, int]:
    try:
        config = json.loads((model_dir / "config.json").read_text())
        num_experts = config.get("num_experts", config.get("num_local_experts"))
        return int(config["num_experts_per_tok"]), int(num_experts)
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"--model {model_dir}: not a Qwen3-MoE checkpoint folder ({exc})") from None


def _draft_dir(value: str | None, model_dir: Path) -> tuple[Path | None, str]:
    """``--draft``: the draft folder for accept_len (None: not measured) and a line saying which."""
    from .spec_eval import default_draft_dir

    if value == "none":
        return None, "accept_len not measured (--draft none)"
    if value is not None:
        if not (Path(value) / "config.json").is_file():
            raise ValueError(f"--draft {value}: no model there (config.json missing); give a folder or none")
        return Path(value), f"accept_len with the draft model {value}"
    shipped = default_draft_dir()
    same = (shipped / "tokenizer.json").is_file() and (model_dir / "tokenizer.json").is_file()
    if same and (shipped / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes():
        return shipped, "accept_len with the shipped tiny draft model"
    return None, "accept_len not measured (no draft model with this model's tokenizer; see --draft)"
