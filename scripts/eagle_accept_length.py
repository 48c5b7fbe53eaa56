"""SGLang's accepted length with an EAGLE-3 head at fixed step counts, on live CPU servers.

For each step count in ``--steps``, start a CPU test server (``xshare_sglang.testing.cpu_server``:
SGLang's own launcher with the CPU flags and the ``sgl_kernel`` stand-in) serving the shipped tiny
Qwen3-MoE with ``--speculative-algorithm EAGLE3 --speculative-eagle-topk 1`` and the head, send the
first ``--prompts`` held-out openings of each domain one at a time (greedy, ``--new-tokens`` tokens,
EOS ignored), and record SGLang's ``spec_accept_length`` of each answer (1 + accepted draft tokens per
verify, averaged over the request's verifies).  One JSON line per step count on stdout and in
``--out``.  CPU numbers: they say how often the head's drafts are accepted, nothing about speed.

Usage::

    python scripts/eagle_accept_length.py --steps 1 2 3 --out docs/spec-runs/eagle3_accept_length.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from xshare_sglang.serving.ab.ab_server import LaunchedServer, launch_port, wait_healthy  # noqa: E402
from xshare_sglang.tiny.tiny_demo import heldout_texts  # noqa: E402
from xshare_sglang.tiny.tiny_model import tiny_eagle3_dir, tiny_model_dir  # noqa: E402

DOMAINS = ("code", "math", "prose")


def measure(head: Path, steps: int, prompts: list[str], new_tokens: int, log: Path) -> dict:
    port = launch_port()
    url = f"http://127.0.0.1:{port}"
    argv = [
        sys.executable,
        "-m",
        "xshare_sglang.testing.cpu_server",
        *("--dtype", "float32", "--page-size", "1", "--host", "127.0.0.1", "--port", str(port)),
        *("--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(head)),
        *("--speculative-eagle-topk", "1", "--speculative-num-steps", str(steps)),
        *("--speculative-num-draft-tokens", str(steps + 1)),
    ]
    server = LaunchedServer(argv, log)
    server.start()
    try:
        problem = wait_healthy(url, 300.0, server.exit_reason)
        if problem is not None:
            raise SystemExit(f"steps {steps}: the server did not start ({problem}); see {log}")
        lengths = []
        for text in prompts:
            body = {
                "text": text,
                "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
            }
            answer = requests.post(url + "/generate", json=body, timeout=300).json()
            lengths.append(answer["meta_info"]["spec_accept_length"])
    finally:
        server.stop(30.0)
    return {
        "steps": steps,
        "mean_accept_length": sum(lengths) / len(lengths),
        "per_prompt": [round(x, 3) for x in lengths],
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "head": str(head.relative_to(REPO) if head.is_relative_to(REPO) else head),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head", type=Path, default=tiny_eagle3_dir(), help="EAGLE-3 head folder")
    parser.add_argument("--steps", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--prompts", type=int, default=4, help="held-out openings per domain")
    parser.add_argument("--prompt-chars", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, help="also write the JSON lines here")
    args = parser.parse_args()
    prompts = [
        text[: args.prompt_chars] for d in DOMAINS for text in heldout_texts(tiny_model_dir(), d)[: args.prompts]
    ]
    lines = []
    with tempfile.TemporaryDirectory() as folder:
        for steps in args.steps:
            record = measure(args.head.resolve(), steps, prompts, args.new_tokens, Path(folder) / f"steps{steps}.log")
            lines.append(json.dumps(record))
            print(lines[-1], flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
