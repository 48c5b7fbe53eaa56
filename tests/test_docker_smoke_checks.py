"""``scripts/docker/smoke_checks.py``, the checks of ``scripts/docker_smoke.sh``, on made-up inputs.

A check that could not fail would pass every Docker run; these catch it without Docker.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

spec = importlib.util.spec_from_file_location("smoke_checks", ROOT / "scripts" / "docker" / "smoke_checks.py")
smoke_checks = importlib.util.module_from_spec(spec)
sys.modules["smoke_checks"] = smoke_checks
spec.loader.exec_module(smoke_checks)
CheckFailed = smoke_checks.CheckFailed


def test_metric_sums_add_every_series_of_a_family() -> None:
    page = "\n".join(
        [
            "# HELP moe_pruner:layer_calls_total Layer calls.",
            "# TYPE moe_pruner:layer_calls_total counter",
            'moe_pruner:layer_calls_total{layer="0",tp_rank="0"} 3.0',
            'moe_pruner:layer_calls_total{layer="1",tp_rank="0"} 4.0',
            "moe_pruner:pruned_forwards_total 2",
            'moe_pruner:layer_calls_created{layer="0"} 1.7e9',
        ]
    )
    assert smoke_checks.metric_sums(page, smoke_checks.COUNTERS) == {
        "moe_pruner:layer_calls_total": 7.0,
        "moe_pruner:pruned_forwards_total": 2.0,
    }
    assert smoke_checks.metric_sums("sglang:num_requests_total 5", smoke_checks.COUNTERS) == {}


def test_proof_line_names_the_policy() -> None:
    log = "[2026-12-02] INFO x\n[2026-12-02 TP0] moe-pruner active: policy=xshare config={} layers=2 rank=tp0/1 hooks=[a]\n"
    assert smoke_checks.proof_line(log, "xshare").endswith("hooks=[a]")
    with pytest.raises(CheckFailed, match="names policy 'xshare'"):
        smoke_checks.proof_line(log, "moe-spec")
    with pytest.raises(CheckFailed, match="did not load"):
        smoke_checks.proof_line("[INFO] server started\n", "xshare")


@pytest.mark.parametrize(
    ("code", "stderr", "verdict"),
    [
        (2, "warning: x\nsglang serve: error: argument --moe-pruner-k0: -1 is not allowed\n", None),
        (1, "sglang serve: error: argument --moe-pruner-k0: bad\n", "exit code 1"),
        (2, "error: one\nsglang serve: error: argument --moe-pruner-k0: two\n", "one error line"),
        (2, "sglang serve: error: argument --moe-pruner-k0: bad\nafter\n", "one error line"),
        (2, "Traceback (most recent call last):\nsglang serve: error: --moe-pruner-k0\n", "traceback"),
        (2, "usage: sglang serve\nsglang serve: error: --moe-pruner-k0\n", "traceback or the usage"),
        (2, "sglang serve: error: argument --port: bad\n", "does not name --moe-pruner-k0"),
    ],
)
def test_refusal_is_exit_2_in_one_line_naming_the_flag(code: int, stderr: str, verdict: str | None) -> None:
    if verdict is None:
        assert smoke_checks.refusal(code, stderr, "--moe-pruner-k0").endswith("-1 is not allowed")
    else:
        with pytest.raises(CheckFailed, match=verdict):
            smoke_checks.refusal(code, stderr, "--moe-pruner-k0")


TCP_TABLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:7530 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0 100 0 0 10 0
   1: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 2 1 0 100 0 0 10 0
   2: 0100007F:7530 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 100 0 0 10 0
"""
TCP6_TABLE = """  sl  local_address                         remote_address                        st ...
   0: 00000000000000000000000000000000:6582 00000000000000000000000000000000:0000 0A 0 0 0 0 0 0 0 4
   1: 00000000000000000000000001000000:7531 00000000000000000000000000000000:0000 0A 0 0 0 0 0 0 0 5
"""
DEV_LO = """Inter-|   Receive                                                |  Transmit
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrs compressed
    lo:    1234      10    0    0    0     0          0         0     1234      10    0    0    0     0       0          0
"""


def test_listening_sockets_decode_the_kernel_tables() -> None:
    assert smoke_checks.listening_sockets(TCP_TABLE, socket.AF_INET) == [("127.0.0.1", 30000), ("0.0.0.0", 8080)]
    assert smoke_checks.listening_sockets(TCP6_TABLE, socket.AF_INET6) == [("::", 25986), ("::1", 30001)]


def test_listening_sockets_match_this_process_own_socket() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        table = Path("/proc/net/tcp").read_text()
        assert ("127.0.0.1", server.getsockname()[1]) in smoke_checks.listening_sockets(table, socket.AF_INET)


def _proc_net(folder: Path, dev: str) -> Path:
    folder.mkdir()
    (folder / "dev").write_text(dev)
    (folder / "tcp").write_text(TCP_TABLE)
    (folder / "tcp6").write_text(TCP6_TABLE)
    return folder


def test_namespace_needs_loopback_only_and_the_servers_listening(tmp_path: Path, capsys) -> None:
    lo_only = _proc_net(tmp_path / "lo", DEV_LO)
    assert len(smoke_checks.namespace([30000, 30001], lo_only)) == 4
    said = capsys.readouterr().out
    assert "127.0.0.1:30000, 127.0.0.1:30001" in said and "(lo only): 0.0.0.0:8080, :::25986" in said
    with pytest.raises(CheckFailed, match=r"nothing listens on 127\.0\.0\.1:8080"):
        smoke_checks.namespace([8080], lo_only)  # on every address, not on loopback only
    eth = _proc_net(tmp_path / "eth", DEV_LO + DEV_LO.splitlines()[2].replace("lo:", "eth0:") + "\n")
    with pytest.raises(CheckFailed, match=r"interfaces \['lo', 'eth0'\], expected only lo"):
        smoke_checks.namespace([30000], eth)


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = smoke_checks.free_ports(3)
    assert len(set(ports)) == 3
    assert all(smoke_checks.PORT_RANGE[0] <= port <= smoke_checks.PORT_RANGE[1] for port in ports)


def _write_runs(folder: Path, rows: list[dict]) -> None:
    folder.mkdir()
    (folder / "runs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "summary.md").write_text("# A/B\n")


def test_ab_results_needs_both_arms_served_and_the_candidate_confirmed(tmp_path: Path) -> None:
    started = [
        {"record": "session", "arm": "baseline", "status": "started", "plugin_confirmed": "unconfirmed"},
        {"record": "session", "arm": "xshare", "status": "started", "plugin_confirmed": "log"},
    ]
    served = [{"record": "serving", "arm": arm, "status": "ok"} for arm in ("baseline", "xshare")]
    _write_runs(tmp_path / "good", started + served)
    assert smoke_checks.ab_results(tmp_path / "good", "baseline", "xshare")["confirmed"]["xshare"] == "log"
    _write_runs(tmp_path / "one-arm", started + served[:1])
    with pytest.raises(CheckFailed, match="serving runs ok for \\['baseline'\\]"):
        smoke_checks.ab_results(tmp_path / "one-arm", "baseline", "xshare")
    unconfirmed = [dict(started[0]), dict(started[1], plugin_confirmed="unconfirmed")]
    _write_runs(tmp_path / "unconfirmed", unconfirmed + served)
    with pytest.raises(CheckFailed, match="not confirmed from its log"):
        smoke_checks.ab_results(tmp_path / "unconfirmed", "baseline", "xshare")


def _usage(free_bytes: int):
    """A stand-in for :func:`shutil.disk_usage` that also records the folder it was asked about."""
    asked: list[Path] = []

    def usage(path: Path):
        asked.append(Path(path))
        return shutil.disk_usage("/")._replace(free=free_bytes)

    return usage, asked


def test_free_disk_measures_the_nearest_existing_folder(tmp_path: Path, capsys) -> None:
    usage, asked = _usage(46_300_000_000)
    assert smoke_checks.free_disk(tmp_path / "lib" / "docker", 25, usage) == pytest.approx(46.3)
    assert asked == [tmp_path]  # Docker's folder does not exist yet: its parent's filesystem
    said = capsys.readouterr().out
    assert said.startswith("check: 46.3 GB free on the filesystem of") and said.rstrip().endswith("needs 25 GB")
    assert f"(not there yet: measured at {tmp_path})" in said
    smoke_checks.free_disk(tmp_path, 25, usage)
    assert asked[-1] == tmp_path and "not there yet" not in capsys.readouterr().out


def test_free_disk_fails_in_one_line_naming_free_needed_and_the_override(tmp_path: Path, capsys) -> None:
    usage, _ = _usage(12_040_000_000)
    with pytest.raises(CheckFailed) as failure:
        smoke_checks.free_disk(tmp_path, 25, usage)
    message = str(failure.value)
    assert "\n" not in message
    assert message.startswith(f"12.0 GB free on the filesystem of {tmp_path}, the run needs 25 GB")
    assert "--min-free-gb GB" in message and "0 skips this check" in message
    # 0 asks for nothing: the free space is still said
    assert smoke_checks.free_disk(tmp_path, 0, usage) == pytest.approx(12.04)
    said = capsys.readouterr().out
    assert said.startswith("check: 12.0 GB free") and "not checked" in said


def test_disk_command_exits_1_with_one_line(tmp_path: Path, capsys) -> None:
    assert smoke_checks.main(["disk", str(tmp_path / "docker"), "0"]) == 0
    assert capsys.readouterr().out.count("\n") == 1
    assert smoke_checks.main(["disk", str(tmp_path), "1e12"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("check FAILED (disk): ") and "the run needs 1e+12 GB" in captured.err
