"""How much a request's greedy output depends on the rest of its batch, on the live CPU server.

For each arm (unpruned; a batch-level policy; keep-all), one CPU server (SGLang's launcher on the
shipped tiny MoE model) answers 20 held-out prompts one at a time, then all 20 in one batched
request, and the script counts the prompts whose tokens, and whose logprobs, are identical both
ways.  CPU only; nothing here is a timing.

    python scripts/batch_dependence.py [--dtype float32] [--new-tokens 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import requests

from xshare_sglang.serving.ab.ab_server import LaunchedServer, launch_port, log_tail, server_env, wait_healthy
from xshare_sglang.tiny.tiny_demo import heldout_texts
from xshare_sglang.tiny.tiny_model import load_tiny_model, tiny_model_dir

ARMS = {
    "unpruned": [],
    "xshare k0=1 budget=2": ["--moe-pruner", "xshare", "--moe-pruner-k0", "1", "--moe-pruner-budget", "2"],
    "keep-all (xshare k0=4 budget=0)": ["--moe-pruner", "xshare", "--moe-pruner-k0", "4", "--moe-pruner-budget", "0"],
}


def prompts(count: int = 20, length: int = 24) -> list[list[int]]:
    """The held-out openings the live keep-all test sends: code, math and prose in turn."""
    _, tokenizer = load_tiny_model()
    texts = {domain: heldout_texts(tiny_model_dir(), domain) for domain in ("code", "math", "prose")}
    chosen = [texts[domain][i] for i in range(-(-count // len(texts))) for domain in texts][:count]
    return [tokenizer(text)["input_ids"][:length] for text in chosen]


def generate(url: str, input_ids, new_tokens: int) -> list[tuple[list[int], list[float]]]:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True},
        "return_logprob": True,
    }
    response = requests.post(url + "/generate", json=body, timeout=600)
    response.raise_for_status()
    answers = response.json()
    answers = answers if isinstance(answers, list) else [answers]
    return [(a["output_ids"], [e[0] for e in a["meta_info"]["output_token_logprobs"]]) for a in answers]


def run_arm(flags: list[str], dtype: str, batch: list[list[int]], new_tokens: int, log: Path) -> tuple[int, int]:
    port = launch_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "xshare_sglang.testing.cpu_server", "--dtype", dtype, *flags]
    server = LaunchedServer([*argv, "--host", "127.0.0.1", "--port", str(port)], log, env=server_env())
    server.start()
    try:
        problem = wait_healthy(url, 300.0, server.exit_reason, poll_s=1.0)
        if problem is not None:
            raise SystemExit(f"{problem}\n{log_tail(log, 40)}")
        alone = [generate(url, prompt, new_tokens)[0] for prompt in batch]
        together = generate(url, batch, new_tokens)
    finally:
        server.stop(30.0)
    tokens = sum(a[0] == b[0] for a, b in zip(alone, together, strict=True))
    logprobs = sum(a[1] == b[1] for a, b in zip(alone, together, strict=True))
    return tokens, logprobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    batch = prompts()
    with tempfile.TemporaryDirectory() as folder:
        for i, (name, flags) in enumerate(ARMS.items()):
            tokens, logprobs = run_arm(flags, args.dtype, batch, args.new_tokens, Path(folder) / f"{i}.log")
            print(
                f"{name}, {args.dtype}: alone vs batched with the other {len(batch) - 1}: identical tokens "
                f"{tokens}/{len(batch)}, identical logprobs {logprobs}/{len(batch)}"
            )


if __name__ == "__main__":
    main()
