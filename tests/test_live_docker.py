"""The serving image built on a local CPU base and served from, by ``scripts/docker_smoke.sh``.

Runs the whole script when a Docker daemon answers ``docker info`` and is skipped otherwise; CI starts
no daemon, so CI skips it (docs/docker.md says why, and how long a run takes).  It lives in a
``test_live_*`` module because it starts two CPU servers (in containers): under ``make test`` it runs
in the CPU-server worker, never beside another server.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "docker_smoke.sh"
#: The script's own bound is its steps' timeouts; this only stops a hung run.
SMOKE_TIMEOUT_S = 3600


def docker_reachable() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.docker
@pytest.mark.skipif(not docker_reachable(), reason="no Docker daemon answers `docker info`")
def test_image_builds_and_serves(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(SCRIPT), "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=SMOKE_TIMEOUT_S,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "passed"
    assert [step["step"] for step in summary["steps"]][-9:] == [
        "build the project's Dockerfile on it",
        "read the CPU server arguments from the image",
        "start a pruned and an unpruned server",
        "bad --moe-pruner-* value in a second container",
        "wait for both servers",
        "proof-of-life line, completion, /metrics counters",
        "the servers' network: loopback only",
        "xshare-ab-compare from the image",
        "remove what the run made",
    ]
    for needle in (
        "check: proof-of-life line: moe-pruner active: policy=xshare",
        "check: completion: 8 tokens",
        "check: /metrics counters: moe_pruner:layer_calls_total=",
        "check: bad flag refused: exit 2, one line:",
        "check: the servers' network namespace has only the loopback interface",
        "check: A/B from the image:",
        "removed container",
    ):
        assert needle in output, needle
    assert "PASSED in" in output
