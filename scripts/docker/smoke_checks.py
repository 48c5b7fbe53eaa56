"""The checks of ``scripts/docker_smoke.sh`` (standard library only).

Each subcommand checks one thing about the image or the servers it runs, prints one line saying what it
saw (``check: ...``), and exits 1 with a line naming what was wrong otherwise (``health`` prints
nothing: it answers 0 or 1).  ``disk`` runs first, before the script installs or builds anything.  Those
that talk to the servers (``free-ports``, ``health``, ``completion``, ``counters``, ``namespace``) run
inside the servers' network namespace, in the container that holds it; the others read files on the host.

Usage::

    python3 scripts/docker/smoke_checks.py disk PATH NEED_GB
    python3 scripts/docker/smoke_checks.py free-ports N
    python3 scripts/docker/smoke_checks.py health URL
    python3 scripts/docker/smoke_checks.py proof-line LOG POLICY
    python3 scripts/docker/smoke_checks.py completion URL
    python3 scripts/docker/smoke_checks.py counters URL
    python3 scripts/docker/smoke_checks.py refusal EXIT_CODE STDERR_FILE FLAG
    python3 scripts/docker/smoke_checks.py namespace PORT [PORT ...]
    python3 scripts/docker/smoke_checks.py ab-results DIR BASELINE CANDIDATE
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import re
import shutil
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

#: Ports handed to the servers: below the kernel's ephemeral range, so that no outgoing connection made
#: between the check and the server's bind can take one.
PORT_RANGE = (20000, 29999)
#: The prompt and the number of tokens of the completion check (greedy).
PROMPT = "The capital of France is"
MAX_NEW_TOKENS = 8
#: The plugin's counters on /metrics that must have counted the completion (summed over layers and ranks).
COUNTERS = ("moe_pruner:layer_calls_total", "moe_pruner:pruned_forwards_total")
#: Seconds to wait for the counters to show the completion (the plugin reports every log interval).
COUNTER_WAIT_S = 30.0
PROOF_PREFIX = "moe-pruner active: policy="


class CheckFailed(Exception):
    """A check saw something other than what it expects; the message says what."""


def say(message: str) -> None:
    print(f"check: {message}", flush=True)


def http(url: str, payload: dict | None = None, timeout: float = 60.0) -> tuple[int, str]:
    """GET (or POST ``payload`` as JSON) ``url``: the status code and the body."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode("utf-8", errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode("utf-8", errors="replace")


# ------------------------------------------------------------------------------------------ the checks
def existing_folder(path: Path) -> Path:
    """``path`` (made absolute) if it exists, else its nearest parent that does.

    Docker's data folder is not there before a daemon first starts; the filesystem it will be made on
    is that of its nearest existing parent.
    """
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    return path


def free_disk(path: Path, need_gb: float, usage: Callable = shutil.disk_usage) -> float:
    """The free space, in 10^9 bytes, on the filesystem that holds ``path``: at least ``need_gb`` (0: any).

    ``usage`` is :func:`shutil.disk_usage` (its ``free``: what ``df`` shows as available).
    """
    measured = existing_folder(path)
    free_gb = usage(measured).free / 1e9
    where = f"the filesystem of {path}"
    if measured != Path(os.path.abspath(path)):
        where += f" (not there yet: measured at {measured})"
    if need_gb <= 0:
        say(f"{free_gb:.1f} GB free on {where}; not checked (0 GB asked for)")
    elif free_gb < need_gb:
        raise CheckFailed(
            f"{free_gb:.1f} GB free on {where}, the run needs {need_gb:g} GB; free some, or pass "
            "--min-free-gb GB to ask for another figure (0 skips this check)"
        )
    else:
        say(f"{free_gb:.1f} GB free on {where}, the run needs {need_gb:g} GB")
    return free_gb


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports in :data:`PORT_RANGE` that 127.0.0.1 could bind when checked."""
    chosen: list[int] = []
    candidates = list(range(PORT_RANGE[0], PORT_RANGE[1] + 1))
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        chosen.append(port)
        if len(chosen) == count:
            return chosen
    raise CheckFailed(f"found only {len(chosen)} free ports in {PORT_RANGE}")


def healthy(url: str) -> bool:
    """Whether ``url``/health answers 200 now."""
    try:
        return http(url + "/health", timeout=5)[0] == 200
    except (OSError, urllib.error.URLError):
        return False


def proof_line(log_text: str, policy: str) -> str:
    """The plugin's proof-of-life line for ``policy`` in a server log."""
    lines = [line for line in log_text.splitlines() if PROOF_PREFIX in line]
    if not lines:
        raise CheckFailed("the server log has no 'moe-pruner active' line: the plugin did not load")
    line = lines[0]
    found = line.split(PROOF_PREFIX, 1)[1].split()[0]
    if found != policy:
        raise CheckFailed(f"the proof-of-life line names policy {found!r}, expected {policy!r}: {line}")
    say(f"proof-of-life line: {line[line.index('moe-pruner active') :]}")
    return line


def completion(url: str) -> dict:
    """A greedy completion of :data:`PROMPT` with exactly :data:`MAX_NEW_TOKENS` tokens."""
    payload = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True},
    }
    status, body = http(url + "/generate", payload, timeout=120)
    if status != 200:
        raise CheckFailed(f"/generate answered {status}: {body[:500]}")
    answer = json.loads(body)
    tokens = answer.get("meta_info", {}).get("completion_tokens")
    if tokens != MAX_NEW_TOKENS or not answer.get("text"):
        raise CheckFailed(f"/generate gave {tokens} tokens and text {answer.get('text')!r}: {body[:500]}")
    say(f"completion: {tokens} tokens, {PROMPT!r} -> {answer['text']!r}")
    return answer


def metric_sums(text: str, names: Iterable[str]) -> dict[str, float]:
    """The sum over every series of each family in ``names`` in a Prometheus text page (absent: no key)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if match and match.group(1) in names:
            sums[match.group(1)] = sums.get(match.group(1), 0.0) + float(match.group(3))
    return sums


def counters(url: str, wait_s: float = COUNTER_WAIT_S) -> dict[str, float]:
    """The plugin's :data:`COUNTERS` on ``url``/metrics, each above 0 (waits up to ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while True:
        status, body = http(url + "/metrics", timeout=10)
        if status != 200:
            raise CheckFailed(f"/metrics answered {status} (was the server started with --enable-metrics?)")
        sums = metric_sums(body, COUNTERS)
        missing = [name for name in COUNTERS if name not in sums]
        if missing:
            raise CheckFailed(f"/metrics has no {', '.join(missing)}: the plugin's metrics are not registered")
        if all(sums[name] > 0 for name in COUNTERS):
            say("/metrics counters: " + ", ".join(f"{name}={sums[name]:g}" for name in COUNTERS))
            return sums
        if time.monotonic() > deadline:
            raise CheckFailed(f"the plugin's counters stayed at {sums} after the completion")
        time.sleep(1)


def refusal(exit_code: int, stderr: str, flag: str) -> str:
    """A launch refused at argument parsing: exit code 2, one error line naming ``flag``, nothing after it."""
    lines = stderr.splitlines()
    errors = [line for line in lines if "error:" in line]
    if exit_code != 2:
        raise CheckFailed(f"exit code {exit_code}, expected 2; stderr ends:\n" + "\n".join(lines[-20:]))
    if len(errors) != 1 or lines[-1] != errors[0]:
        raise CheckFailed("expected one error line, last; stderr ends:\n" + "\n".join(lines[-20:]))
    if "Traceback" in stderr or any(line.startswith("usage:") for line in lines):
        raise CheckFailed("the refusal printed a traceback or the usage text")
    if flag not in errors[0]:
        raise CheckFailed(f"the error line does not name {flag}: {errors[0]}")
    say(f"bad flag refused: exit 2, one line: {errors[0]}")
    return errors[0]


def listening_sockets(table: str, family: int) -> list[tuple[str, int]]:
    """The listening TCP sockets of a ``/proc/net/tcp`` (``AF_INET``) or ``tcp6`` (``AF_INET6``) table."""
    found = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        local, state = fields[1], fields[3]
        if state != "0A":  # TCP_LISTEN
            continue
        address_hex, port_hex = local.split(":")
        raw = bytes.fromhex(address_hex)
        # the kernel prints each 32-bit word in host (little-endian) order
        raw = b"".join(raw[at : at + 4][::-1] for at in range(0, len(raw), 4))
        found.append((socket.inet_ntop(family, raw), int(port_hex, 16)))
    return found


def interfaces(dev_table: str) -> list[str]:
    """The interface names of a ``/proc/net/dev`` table."""
    return [line.split(":", 1)[0].strip() for line in dev_table.splitlines()[2:] if ":" in line]


def namespace(ports: Sequence[int], proc_net: Path = Path("/proc/net")) -> list[tuple[str, int]]:
    """This network namespace has only the loopback interface, and ``ports`` listen on loopback in it.

    Every listening socket is listed; one bound to every address (``0.0.0.0``, ``::``) is reachable
    only through the one interface, ``lo``.
    """
    names = interfaces((proc_net / "dev").read_text())
    if names != ["lo"]:
        raise CheckFailed(f"the servers' network namespace has interfaces {names}, expected only lo")
    bound = sorted(
        set(listening_sockets((proc_net / "tcp").read_text(), socket.AF_INET))
        | set(listening_sockets((proc_net / "tcp6").read_text(), socket.AF_INET6))
    )
    for port in ports:
        if not any(p == port and ipaddress.ip_address(address).is_loopback for address, p in bound):
            raise CheckFailed(f"nothing listens on 127.0.0.1:{port} (listening: {bound})")
    wildcard = [f"{address}:{port}" for address, port in bound if ipaddress.ip_address(address).is_unspecified]
    say(
        f"the servers' network namespace has only the loopback interface; {len(bound)} listening sockets, "
        f"the servers on {', '.join(f'127.0.0.1:{port}' for port in ports)}"
        + (f"; on every address of that namespace (lo only): {', '.join(wildcard)}" if wildcard else "")
    )
    return bound


def ab_results(folder: Path, baseline: str, candidate: str) -> dict:
    """``xshare-ab-compare`` served both arms and confirmed the candidate's plugin from its log."""
    rows = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines() if line.strip()]
    ok = {row["arm"] for row in rows if row.get("record") == "serving" and row.get("status") == "ok"}
    failed = [row for row in rows if row.get("status") in ("failed", "skipped")]
    if failed or ok != {baseline, candidate}:
        raise CheckFailed(f"serving runs ok for {sorted(ok)}, failed: {failed}")
    confirmed = {row["arm"]: row.get("plugin_confirmed") for row in rows if row.get("status") == "started"}
    if confirmed.get(candidate) != "log":
        raise CheckFailed(f"the candidate's plugin was not confirmed from its log: {confirmed}")
    if not (folder / "summary.md").is_file():
        raise CheckFailed("the A/B tool wrote no summary.md")
    say(f"A/B from the image: {len(rows)} records, serving ok for {baseline} and {candidate}, plugins {confirmed}")
    return {"records": len(rows), "confirmed": confirmed}


# ------------------------------------------------------------------------------------------ command line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    disk = commands.add_parser("disk")
    disk.add_argument("path", type=Path)
    disk.add_argument("need_gb", type=float)
    commands.add_parser("free-ports").add_argument("count", type=int)
    commands.add_parser("health").add_argument("url")
    proof = commands.add_parser("proof-line")
    proof.add_argument("log", type=Path)
    proof.add_argument("policy")
    commands.add_parser("completion").add_argument("url")
    commands.add_parser("counters").add_argument("url")
    refused = commands.add_parser("refusal")
    refused.add_argument("exit_code", type=int)
    refused.add_argument("stderr", type=Path)
    refused.add_argument("flag")
    commands.add_parser("namespace").add_argument("ports", type=int, nargs="+")
    ab = commands.add_parser("ab-results")
    ab.add_argument("folder", type=Path)
    ab.add_argument("baseline")
    ab.add_argument("candidate")
    args = parser.parse_args(argv)
    try:
        if args.command == "disk":
            free_disk(args.path, args.need_gb)
        elif args.command == "free-ports":
            print(" ".join(str(port) for port in free_ports(args.count)))
        elif args.command == "health":
            return 0 if healthy(args.url) else 1
        elif args.command == "proof-line":
            proof_line(args.log.read_text(encoding="utf-8", errors="replace"), args.policy)
        elif args.command == "completion":
            completion(args.url)
        elif args.command == "counters":
            counters(args.url)
        elif args.command == "refusal":
            refusal(args.exit_code, args.stderr.read_text(encoding="utf-8", errors="replace"), args.flag)
        elif args.command == "namespace":
            namespace(args.ports)
        elif args.command == "ab-results":
            ab_results(args.folder, args.baseline, args.candidate)
    except CheckFailed as failure:
        print(f"check FAILED ({args.command}): {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
