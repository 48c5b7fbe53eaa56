"""``xshare-sglang``: the project's command line (``python -m xshare_sglang`` works too).

Subcommands
-----------
demo    replay the shipped routing traces through every policy and print the tables.
verify  the same for speculative verify batches (R requests x D draft tokens): batch-level against
        per-request policies, optionally with depth-decayed votes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from .config import PrunerConfig
from .replay.demo import DEFAULT_SHAPES, VERIFY_SHAPES

logger = logging.getLogger(__name__)


def _demo(args: argparse.Namespace) -> int:
    from .replay import default_configs

    return _replay(args, default_configs)


def _verify(args: argparse.Namespace) -> int:
    from .replay import verify_configs

    def configs(top_k: int, num_experts: int) -> list[PrunerConfig]:
        chosen = verify_configs(top_k, num_experts)
        if args.depth_decay is None:
            return chosen
        return [
            cfg if cfg.policy in ("none", "lynx") else dataclasses.replace(cfg, depth_decay=args.depth_decay)
            for cfg in chosen
        ]

    return _replay(args, configs)


def _replay(args: argparse.Namespace, config_factory) -> int:
    from rich.console import Console
    from rich.table import Table

    from .replay import BatchShape, bundled_trace_path, load_route_csv, replay_trace

    shapes = [BatchShape.parse(text) for text in args.shapes.split(",")]
    console = Console(width=max(Console().width, 110))
    all_rows = []
    for name in args.trace:
        path = bundled_trace_path(name) if not name.endswith(".csv") else Path(name)
        trace = load_route_csv(path)
        configs = (
            [PrunerConfig.load(item) for item in json.loads(Path(args.configs).read_text())]
            if args.configs
            else config_factory(trace.top_k, trace.num_experts)
        )
        console.print(
            f"\n[bold]{trace.name}[/bold]: {trace.model}, {trace.num_layers} layers, "
            f"E={trace.num_experts}, top-k={trace.top_k}, {trace.num_tokens} decode tokens"
        )
        for shape in shapes:
            rows = replay_trace(trace, shape, configs)
            if not rows:
                console.print(f"  {shape}: sequence too short, skipped")
                continue
            table = Table(
                title=f"{trace.name}, {shape.requests} requests x {shape.tokens_per_request} tokens "
                f"({rows[0].layer_calls} layer calls)",
                title_justify="left",
            )
            for column in ("policy", "parameters", "activated", "kept", "retained mass", "top-1 kept"):
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
                )
            console.print(table)
            all_rows += rows
    console.print(
        "activated = distinct experts the routed tokens use per layer call (mean); kept = size of the "
        "keep mask; retained mass = share of the natural top-k router weight on kept experts.\n"
        "The traces list each token's top-k experts only, so a token cannot move to an unlisted "
        "expert: substitution acts as truncation, and lynx (which remaps within a token's scored "
        "experts) keeps every listed expert."
    )
    if args.json:
        Path(args.json).write_text(json.dumps([row.as_dict() for row in all_rows], indent=2))
        console.print(f"wrote {args.json}")
    return 0


def _add_replay_arguments(parser: argparse.ArgumentParser, *, default_shapes: tuple[str, ...]) -> None:
    """The options every trace-replay subcommand takes."""
    parser.add_argument(
        "--trace",
        nargs="+",
        default=["gptoss", "gemma"],
        help="bundled trace names (gptoss, gemma) or paths of route_trace v1 CSV files",
    )
    parser.add_argument("--shapes", default=",".join(default_shapes), help="batch shapes RxD, comma-separated")
    parser.add_argument("--configs", help="JSON file holding a list of PrunerConfig objects to compare")
    parser.add_argument("--json", help="also write every row to this JSON file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xshare-sglang", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="replay the shipped routing traces through every policy")
    _add_replay_arguments(demo, default_shapes=DEFAULT_SHAPES)
    demo.set_defaults(handler=_demo)
    verify = sub.add_parser(
        "verify",
        help="replay speculative verify batches (R requests x D draft tokens) through the verify policies",
    )
    _add_replay_arguments(verify, default_shapes=VERIFY_SHAPES)
    verify.add_argument(
        "--depth-decay",
        type=float,
        default=None,
        metavar="X",
        help="weigh the vote of the token at depth d of its request by X**d, in (0, 1] (default: off)",
    )
    verify.set_defaults(handler=_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
