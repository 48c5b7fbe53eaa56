"""The A/B orchestrator end to end against the test STAND-IN server (tests/standin_server.py, not
SGLang): it launches the stand-in per arm, the arms' order rotated each repetition, runs SGLang's REAL benchmark client and
few-shot GSM8K client against it, records, summarizes and plots; arms whose server does not prove the
plugin active, or crashes during the benchmark, are dropped while the others' results are kept.  The
summary is recomputed here from the clients' own raw output files.

The full run starts from an empty working directory, with a relative ``--model-path`` and
``--output-dir``, and must leave that directory empty: SGLang's clients write files where they run
(``python -m sglang.benchmark.serving`` appends its result to ``{backend}_{MMDD}_{prompts}_{in}_{out}.jsonl``
unless ``--output-file`` names one, ``python -m sglang.test.few_shot_gsm8k`` always writes
``tmp_output_gsm8k.txt``, it has no flag for it), so the tool runs every client in its session's folder
with absolute paths in its command, the shipped workload's file included.  ``xshare-sglang
calibrate``'s counterpart is in ``tests/test_static_calibration.py``."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.standin_server import (
    STANDIN_ACCEPT_LENGTH,
    STANDIN_ACTIVATED_EXPERTS,
    STANDIN_EXIT_CODE,
    STANDIN_PRUNED_ACCEPT_LENGTH,
    expected_gsm8k_accuracy,
)
from xshare_sglang.provenance import package_commit
from xshare_sglang.serving.ab import ab_run as ab_runner
from xshare_sglang.serving.ab.ab_cli import EXIT_ARM_FAILED, main
from xshare_sglang.serving.ab.ab_report import read_runs
from xshare_sglang.serving.ab.ab_server import (
    LAUNCH_PORT_RANGE,
    LaunchedServer,
    launch_port,
    proof_policies,
    wait_healthy,
)

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parent.parent
STANDIN = f"{sys.executable} {REPO / 'tests' / 'standin_server.py'}"
TINY = str(REPO / "xshare_sglang" / "data" / "tiny_moe")
QUESTIONS = 20


#: How often the tests poll a starting server: the tool's 2 s, a wait every session pays, is for SGLang.
POLL_S = 0.2


def common_flags(out: str, port: int, model: str) -> list[str]:
    return [
        "--model-path", model, "--launch-command", STANDIN, "--port", str(port), "--output-dir", out,
        "--dataset", "mt-bench", "--output-len", "16", "--num-prompts", "8",
        "--gsm8k-questions", str(QUESTIONS), "--gsm8k-shots", "2", "--gsm8k-parallel", "4",
        "--startup-timeout", "60", "--run-timeout", "240", "--stop-timeout", "10",
    ]  # fmt: skip


def listing(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


@pytest.fixture(scope="module")
def ab_run(tmp_path_factory):
    """One full run: baseline, a working candidate, one whose plugin 'did not load', one that crashes;
    from an empty working directory, with the model and the output folder given relative to it.

    Two of the tool's waits, sized for SGLang's servers (which start in minutes, their plugin line
    written by scheduler processes), are shortened for the stand-in, which prints that line before it
    listens: the poll of a starting server (2 s), and how long the tool waits for the plugin's line
    of the arm whose stand-in never prints one (15 s)."""
    root = tmp_path_factory.mktemp("ab")
    cwd, out = root / "cwd", root / "result"
    cwd.mkdir()
    (root / "model").symlink_to(TINY, target_is_directory=True)
    arms = root / "arms.yaml"
    arms.write_text(
        "server_args: --tp 1 --speculative-algorithm EAGLE3 --standin-itl-ms 1 --standin-wrong-every 5\n"
        "arms:\n"
        "  - name: base\n"
        "  - name: xshare\n"
        "    pruner: {policy: xshare, k0: 1}\n"
        "    server_args: --standin-pruned-wrong-every 4\n"
        "  - name: noproof\n"
        "    pruner: {policy: lynx}\n"
        "    server_args: --standin-no-proof\n"
        "  - name: crash\n"
        "    pruner: {policy: oea}\n"
        "    server_args: --standin-fail crash-during-bench --standin-crash-after 3\n"
    )
    port = launch_port()
    started = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ab_runner, "wait_healthy", functools.partial(wait_healthy, poll_s=POLL_S))
        patch.setattr(ab_runner, "PROOF_WAIT_S", 1.0)
        patch.chdir(cwd)
        flags = common_flags("../result", port, "../model")
        code = main([*flags, "--arms", str(arms), "--concurrency", "4", "--repeats", "2"])
    return {
        "out": out,
        "cwd": cwd,
        "port": port,
        "code": code,
        "rows": read_runs(out),
        "wall_s": time.monotonic() - started,
    }


def test_exit_status_and_rotated_order(ab_run):
    assert ab_run["code"] == EXIT_ARM_FAILED
    sessions = [(r["session"], r["repeat"], r["arm"]) for r in ab_run["rows"] if r["record"] == "session"]
    order = list(dict.fromkeys(sessions))
    assert order == [
        (0, 1, "base"),
        (1, 1, "xshare"),
        (2, 1, "noproof"),
        (3, 1, "crash"),
        (4, 2, "xshare"),
        (5, 2, "noproof"),
        (6, 2, "crash"),
        (7, 2, "base"),
    ]
    # every launched server was stopped, and no stand-in or client outlives the run
    stopped = [r for r in ab_run["rows"] if r["record"] == "session" and r["status"] == "stopped"]
    assert sorted(r["session"] for r in stopped) == [0, 1, 2, 3, 4, 7]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(ab_run["out"]) not in ps
    port = f"--port {ab_run['port']} "
    assert not [line for line in ps.splitlines() if "standin_server.py" in line and port in line + " "]


def test_leaves_the_working_directory_empty(ab_run):
    """Nothing in the user's working directory; each client's files in its session's folder, under
    ``--output-dir``, and no result file under the client's own default name anywhere."""
    assert listing(ab_run["cwd"]) == [], f"left in the working directory: {listing(ab_run['cwd'])}"
    out = ab_run["out"]
    for session in ("000-r1-base", "001-r1-xshare", "004-r2-xshare", "007-r2-base"):
        files = set(os.listdir(out / "runs" / session))
        assert {"serving-mt-bench-c4.jsonl", "tmp_output_gsm8k.txt"} <= files, files
    assert not list(out.parent.glob("sglang_*.jsonl")) and not list(out.rglob("sglang_*.jsonl"))


def test_failed_arms_are_reported_and_dropped(ab_run):
    rows = ab_run["rows"]
    noproof = [r for r in rows if r["arm"] == "noproof" and r["record"] == "session" and r["status"] == "failed"]
    assert len(noproof) == 1 and noproof[0]["repeat"] == 1
    assert "no 'moe-pruner active: policy=lynx' line" in noproof[0]["error"]
    crash = [r for r in rows if r["arm"] == "crash" and r["record"] == "session" and r["status"] == "failed"]
    assert len(crash) == 1 and "went away" in crash[0]["error"] and "exited with code" in crash[0]["error"]
    first, *rest = [r for r in rows if r["arm"] == "crash" and r["record"] in ("serving", "accuracy")]
    assert first["status"] == "failed" and {r["status"] for r in rest} == {"skipped"}
    for arm in ("noproof", "crash"):
        skipped = [r for r in rows if r["arm"] == arm and r["repeat"] == 2]
        assert [r["status"] for r in skipped] == ["skipped"] and "dropped after repetition 1" in skipped[0]["error"]
        assert not [r for r in rows if r["arm"] == arm and r["record"] == "serving" and r["status"] == "ok"]
    summary = (ab_run["out"] / "summary.md").read_text()
    assert "arm noproof: failed:" in summary and "arm crash: skipped:" in summary


def test_records_hold_what_the_clients_and_server_reported(ab_run):
    ok = [r for r in ab_run["rows"] if r["status"] == "ok"]
    serving = [r for r in ok if r["record"] == "serving"]
    assert sorted((r["arm"], r["repeat"], r["concurrency"]) for r in serving) == sorted(
        (arm, rep, 4) for arm in ("base", "xshare") for rep in (1, 2)
    )
    for row in serving:
        assert row["metrics"]["completed"] == 8 and row["metrics"]["total_output_tokens"] == 8 * 16
        raw = json.loads((ab_run["cwd"] / row["raw"]).read_text().splitlines()[-1])  # relative to where it ran
        assert row["metrics"]["output_throughput"] == raw["output_throughput"]
        expected_accept = STANDIN_ACCEPT_LENGTH if row["arm"] == "base" else STANDIN_PRUNED_ACCEPT_LENGTH
        assert row["metrics"]["accept_length"] == expected_accept
        if row["arm"] == "xshare":
            assert row["pruner_metrics"]["activated_experts"] == pytest.approx(
                statistics.fmean(STANDIN_ACTIVATED_EXPERTS)
            )
        else:
            assert row["pruner_metrics"] is None
        assert row["server_argv"][row["server_argv"].index("--port") + 1] in row["url"]
        assert row["versions"]["sglang"] == "0.5.23" and row["model_path"] == "../model"
        assert row["git_sha"] == package_commit()
    accuracy = {(r["arm"], r["repeat"]): r["metrics"]["accuracy"] for r in ok if r["record"] == "accuracy"}
    assert accuracy == {
        ("base", 1): expected_gsm8k_accuracy(QUESTIONS, 5),
        ("base", 2): expected_gsm8k_accuracy(QUESTIONS, 5),
        ("xshare", 1): expected_gsm8k_accuracy(QUESTIONS, 4),
        ("xshare", 2): expected_gsm8k_accuracy(QUESTIONS, 4),
    }
    started = [r for r in ab_run["rows"] if r["record"] == "session" and r["status"] == "started"]
    assert {r["arm"]: r["plugin_confirmed"] for r in started} == {"base": "log", "xshare": "log", "crash": "log"}
    log = (ab_run["out"] / "servers" / "001-r1-xshare.log").read_text()
    assert proof_policies(log) == ["xshare"]


def test_summary_recomputed_from_raw_client_outputs(ab_run):
    out = ab_run["out"]
    tput = {}
    for path in (out / "runs").glob("*/serving-mt-bench-c*.jsonl"):
        session = path.parent.name  # NNN-rR-ARM
        _, rep, arm = session.split("-", 2)
        concurrency = int(re.search(r"-c(\d+)\.jsonl$", path.name).group(1))
        tput[(arm, int(rep[1:]), concurrency)] = json.loads(path.read_text().splitlines()[-1])["output_throughput"]
    assert len(tput) == 4  # the crashing arm's client wrote nothing
    summary = json.loads((out / "summary.json").read_text())
    rows = {(r["arm"], r["concurrency"]): r for r in summary["serving"]}
    for c in (4,):
        deltas = [tput[("xshare", rep, c)] / tput[("base", rep, c)] - 1 for rep in (1, 2)]
        row = rows[("xshare", c)]
        assert row["throughput_delta"]["median"] == pytest.approx(statistics.median(deltas))
        assert row["throughput_delta"]["low"] == pytest.approx(min(deltas))
        assert row["throughput_delta"]["pairs"] == 2
        assert rows[("base", c)]["output_throughput"] == pytest.approx(
            statistics.median([tput[("base", 1, c)], tput[("base", 2, c)]])
        )
        assert row["accept_length"] == STANDIN_PRUNED_ACCEPT_LENGTH
        assert ("noproof", c) not in rows and ("crash", c) not in rows
    acc = {r["arm"]: r for r in summary["accuracy"]}
    drop = 100 * (expected_gsm8k_accuracy(QUESTIONS, 4) - expected_gsm8k_accuracy(QUESTIONS, 5))
    assert acc["xshare"]["delta_points"]["median"] == pytest.approx(drop)
    assert acc["base"]["accuracy"] == pytest.approx(expected_gsm8k_accuracy(QUESTIONS, 5))
    markdown = (out / "summary.md").read_text()
    median = 100 * rows[("xshare", 4)]["throughput_delta"]["median"]
    assert re.search(r"\| 4 \| xshare \| [0-9.]+ \| " + re.escape(f"{median:+.1f}% ["), markdown)
    assert f"| xshare | {expected_gsm8k_accuracy(QUESTIONS, 4):.3f} | {drop:+.1f} " in markdown


def test_plots_written(ab_run):
    for name in ("throughput_mt-bench.png", "pareto_mt-bench.png"):
        data = (ab_run["out"] / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_report_rebuilds_the_same_summary(ab_run, capsys):
    out = ab_run["out"]
    before = (out / "summary.md").read_text()
    (out / "summary.md").unlink()
    assert main(["--report", str(out)]) == 0
    assert (out / "summary.md").read_text() == before
    assert "## Serving: mt-bench" in capsys.readouterr().out


def test_url_mode_uses_servers_it_did_not_start(tmp_path):
    """Two stand-ins started by the test; the candidate proves itself through its log file."""
    servers = []
    try:
        ports = {}
        for name, flags in (("baseline", []), ("xshare", ["--moe-pruner", "xshare"])):
            port = launch_port()
            log = tmp_path / f"{name}.log"
            server = LaunchedServer(
                [*STANDIN.split(), "--model-path", TINY, "--port", str(port), "--enable-metrics", *flags], log
            )
            server.start()
            servers.append(server)
            ports[name] = port
        for server, port in zip(servers, ports.values(), strict=True):
            assert wait_healthy(f"http://127.0.0.1:{port}", 30, alive=server.exit_reason, poll_s=POLL_S) is None
        out = tmp_path / "out"
        code = main(
            [
                "--model-path",
                TINY,
                "--candidate",
                "xshare",
                "--output-dir",
                str(out),
                "--no-accuracy",
                "--dataset",
                "random-ids",
                "--random-input-len",
                "16",
                "--random-output-len",
                "8",
                "--num-prompts",
                "4",
                "--concurrency",
                "2",
                "--repeats",
                "1",
                "--url",
                f"baseline=http://127.0.0.1:{ports['baseline']}",
                "--url",
                f"xshare=http://127.0.0.1:{ports['xshare']}",
                "--server-log",
                f"xshare={tmp_path / 'xshare.log'}",
            ]
        )
        assert code == 0
        rows = read_runs(out)
        assert not [r for r in rows if r["record"] == "session" and r["status"] == "stopped"]
        assert all(s.exit_reason() is None for s in servers)  # still running: the tool did not stop them
        confirmed = {r["arm"]: r.get("plugin_confirmed") for r in rows if r.get("status") == "started"}
        assert confirmed == {"baseline": "unconfirmed", "xshare": "log"}  # no --server-log for the baseline
        ok = {r["arm"]: r for r in rows if r["record"] == "serving" and r["status"] == "ok"}
        assert ok["xshare"]["server_argv"] is None and ok["xshare"]["url"].endswith(str(ports["xshare"]))
        assert ok["xshare"]["pruner_metrics"]["activated_experts"] == pytest.approx(11.5)
    finally:
        for server in servers:
            server.stop(5)


def test_launch_failure_and_health_timeout_are_reported(tmp_path):
    server = LaunchedServer(
        [*STANDIN.split(), "--model-path", TINY, "--port", "1", "--standin-fail", "exit"], tmp_path / "a.log"
    )
    server.start()
    reason = wait_healthy("http://127.0.0.1:1", 30, alive=server.exit_reason, poll_s=0.2)
    assert reason == f"the server exited with code {STANDIN_EXIT_CODE}"
    port = launch_port()
    server = LaunchedServer(
        [*STANDIN.split(), "--model-path", TINY, "--port", str(port), "--standin-fail", "no-health"], tmp_path / "b.log"
    )
    server.start()
    try:
        reason = wait_healthy(f"http://127.0.0.1:{port}", 2, alive=server.exit_reason, poll_s=0.2)
        assert reason == f"no healthy answer from http://127.0.0.1:{port}/health_generate within 2 s"
    finally:
        assert server.stop(5) == "stopped by SIGTERM"
    assert server.process.returncode in (0, -signal.SIGTERM)


def test_launch_port_is_outside_the_ports_others_are_handed(tmp_path):
    """A launched server binds its port seconds after it is picked: the port must come from below the
    kernel's ephemeral range (``bind(0)`` and outgoing connections take theirs from there) and from
    outside the range SGLang draws the server's own ``nccl_port`` from.  Then a socket bound to the
    picked port is never refused."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    low, high = LAUNCH_PORT_RANGE
    assert high < 22000 and high < ephemeral_low
    ports = [launch_port() for _ in range(50)]
    assert all(low <= port <= high for port in ports), ports
    assert len(set(ports)) > 1  # drawn, not one fixed port that two servers would share
    with socket.create_server(("0.0.0.0", ports[0])):
        pass
