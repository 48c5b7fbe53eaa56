"""On a lent GPU: the plugin in a live SGLang server, three arms, in one device call of at most 9 minutes.

Each arm starts ``python -m xshare_sglang.testing.gpu_server`` (SGLang 0.5.23 from the carried
``.device_bundle``, the CUDA ``sgl_kernel`` stand-in, a Qwen3-30B-A3B-shaped model with random
weights), checks its proof-of-life line and ``/metrics``, runs SGLang's own benchmark client
(``sglang.benchmark.serving``, random token ids) at each concurrency, and stops the server:

* ``unpruned``: no ``--moe-pruner`` (no proof line expected, no ``moe_pruner`` series);
* ``xshare``: ``--moe-pruner xshare --moe-pruner-k0 2 --moe-pruner-budget 12``;
* ``moe-spec+guard``: ``--moe-pruner moe-spec --moe-pruner-max-experts 32 --moe-pruner-guard auto``
  (the guard's table is kept from the log).

Writes into ``--out`` (the device tool's ``$OUT``) at most 8 files: ``serve_check.log`` (what the
script did), ``serve_results.md`` and ``serve_results.json`` (output throughput and inter-token
latency per arm and concurrency), ``guard_table.txt`` (the guard's lines), and the last 200 lines of
each server log (``server_<arm>.log``).  The weights are random, so routing is close to uniform: the
ratios show what the budget buys on this hardware, not answer quality.

    PYTHONPATH=. python3 scripts/gpu_serve_check.py --out "$OUT" [--concurrency 1,16,64] [--budget 500]

Build the bundle first, here: ``python scripts/device_bundle.py`` (then carry ``.device_bundle``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
ARMS = {
    "unpruned": [],
    "xshare": ["--moe-pruner", "xshare", "--moe-pruner-k0", "2", "--moe-pruner-budget", "12"],
    "moe-spec+guard": ["--moe-pruner", "moe-spec", "--moe-pruner-max-experts", "32", "--moe-pruner-guard", "auto"],
}
PROOF = re.compile(r"moe-pruner active: policy=(\S+)")


def free_port() -> int:
    """A free port below the ephemeral range, which nothing else is handed while the server starts."""
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    return get_free_port_below_ephemeral(low=10000, high=21999)


def wait_healthy(url: str, process: subprocess.Popen, deadline: float) -> str | None:
    """None once ``/health`` answers 200; the reason otherwise (exit, or time out)."""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"the server exited with code {process.returncode}"
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return None
        except requests.RequestException:
            pass
        time.sleep(2)
    return "the server was not healthy in time"


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def client_env() -> dict[str, str]:
    """The server's environment (bundle site and stand-in on PYTHONPATH) for SGLang's client."""
    from xshare_sglang.testing import gpu_server

    bundle = ROOT / gpu_server.BUNDLE_DIR
    site = gpu_server.prepare_site(bundle)
    return gpu_server.gpu_server_env(bundle, site)


def bench(url: str, model_dir: Path, concurrency: int, prompts: int, out_file: Path, env, timeout_s: float) -> dict:
    """One run of SGLang's benchmark client; the numbers of its JSONL row."""
    argv = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--backend",
        "sglang",
        "--base-url",
        url,
        "--model",
        str(model_dir),
        "--tokenizer",
        str(model_dir),
        "--dataset-name",
        "random-ids",
        "--random-input-len",
        "256",
        "--random-output-len",
        "128",
        "--random-range-ratio",
        "1.0",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(concurrency),
        "--request-rate",
        "inf",
        "--seed",
        "1",
        "--output-file",
        str(out_file),
    ]
    subprocess.run(argv, env=env, check=True, timeout=timeout_s, capture_output=True, text=True)
    row = json.loads(out_file.read_text().splitlines()[-1])
    return {key: row.get(key) for key in ("completed", "output_throughput", "mean_itl_ms", "median_itl_ms")}


def run_arm(name: str, flags: list[str], args, log, deadline: float) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server_log = args.out / f"server_{name.replace('+', '_')}.log"
    argv = [sys.executable, "-m", "xshare_sglang.testing.gpu_server", *flags, "--enable-metrics"]
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    result: dict = {"arm": name, "flags": " ".join(flags), "runs": []}
    launched = time.monotonic()
    with open(args.work / f"{name}.log", "w") as sink:
        process = subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        problem = wait_healthy(url, process, min(deadline, time.monotonic() + args.startup_s))
        text = (args.work / f"{name}.log").read_text(errors="replace")
        if problem is not None:
            result["error"] = problem
            return result
        result["startup_s"] = round(time.monotonic() - launched, 1)
        proofs = sorted(set(PROOF.findall(text)))
        result["proof"] = proofs
        metrics = requests.get(url + "/metrics", timeout=10).text
        result["moe_pruner_series"] = sorted(
            {line.split("{")[0] for line in metrics.splitlines() if line.startswith("moe_pruner")}
        )
        if "guard" in name:
            (args.out / "guard_table.txt").write_text(
                "\n".join(line for line in text.splitlines() if "guard" in line.lower()) + "\n"
            )
        model_dir = next((ROOT / ".device_bundle" / "models").iterdir())
        env = client_env()
        for concurrency in args.concurrency:
            left = deadline - time.monotonic()
            if left < 30:
                log(f"{name}: c={concurrency} skipped, {left:.0f}s left")
                break
            prompts = max(8, concurrency * 4)
            out_file = args.work / f"{name}-c{concurrency}.jsonl"
            try:
                numbers = bench(url, model_dir, concurrency, prompts, out_file, env, left - 10)
            except (subprocess.SubprocessError, OSError, ValueError) as exc:
                numbers = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            result["runs"].append({"concurrency": concurrency, "prompts": prompts, **numbers})
            log(f"{name}: c={concurrency}: {numbers}")
    finally:
        stop(process)
        lines = (args.work / f"{name}.log").read_text(errors="replace").splitlines()
        server_log.write_text("\n".join(lines[-200:]) + "\n")
    return result


def table(results: list[dict]) -> str:
    rows = [
        "| arm | concurrency | output tok/s | mean ITL ms | median ITL ms | vs unpruned |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    base = {r["concurrency"]: r.get("output_throughput") for r in results[0]["runs"]} if results else {}
    for result in results:
        if "error" in result:
            rows.append(f"| {result['arm']} | - | {result['error']} | | | |")
        for run in result["runs"]:
            tput, ref = run.get("output_throughput"), base.get(run["concurrency"])
            ratio = f"{tput / ref:.2f}x" if tput and ref else "-"
            rows.append(
                f"| {result['arm']} | {run['concurrency']} | {tput} | {run.get('mean_itl_ms')} | "
                f"{run.get('median_itl_ms')} | {ratio} |"
            )
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-serve-out")))
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--budget", type=float, default=500.0, help="seconds for all arms")
    parser.add_argument("--startup-s", type=float, default=150.0, help="seconds a server may take to start")
    parser.add_argument("--arms", default=",".join(ARMS))
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_serve_check"
    args.work.mkdir(parents=True, exist_ok=True)
    check_log = args.out / "serve_check.log"

    def log(line: str) -> None:
        with open(check_log, "a") as sink:
            sink.write(line + "\n")

    arms = [a for a in args.arms.split(",") if a]
    results = []
    started = time.monotonic()
    for i, name in enumerate(arms):
        # each arm gets an equal share of what is left
        deadline = time.monotonic() + (args.budget - (time.monotonic() - started)) / (len(arms) - i)
        log(f"arm {name}: {ARMS[name]} (up to {deadline - time.monotonic():.0f}s)")
        results.append(run_arm(name, ARMS[name], args, log, deadline))
        (args.out / "serve_results.json").write_text(json.dumps(results, indent=2) + "\n")
        (args.out / "serve_results.md").write_text(table(results))
    log(f"done in {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
