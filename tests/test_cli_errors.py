"""Bad files and bad arguments on the command line: exit 2 and one line naming the file or the flag.

Each case runs ``xshare-sglang`` in a subprocess as a user would and checks the exit status, the
message, the absence of a traceback, and that torch's advice to load without ``weights_only`` (which
would run code from the file) is never passed on.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from xshare_sglang.replay.route_csv import bundled_trace_path

pytestmark = pytest.mark.cli_errors


def _run(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xshare_sglang", *argv], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def _assert_clean_error(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    assert "weights_only" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    """A folder of broken inputs: a route CSV cut mid-row, pickled code, an empty and a cut archive."""
    folder = tmp_path_factory.mktemp("bad-files")
    text = bundled_trace_path("gemma").read_text()
    cut = text[: len(text) // 2]
    cut = cut[: cut.rindex(",") + 1]  # ends inside a row
    (folder / "cut.route.csv").write_text(cut)
    torch.save({"format": "xshare-trace", "payload": Path("not/a/tensor")}, folder / "pickled.pt")
    (folder / "empty.pt").write_bytes(b"")
    torch.save({"format": "xshare-trace", "version": 1, "x": torch.zeros(1000)}, folder / "whole.pt")
    (folder / "cut.pt").write_bytes((folder / "whole.pt").read_bytes()[:2000])
    (folder / "configs.json").write_text('[{"policy": "bogus"}]')
    return folder


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["replay", "--trace", "cut.route.csv"], ["cut.route.csv", "line", "cut short"]),
        (["verify", "--trace", "cut.route.csv"], ["cut.route.csv", "line", "cut short"]),
        (["convert", "cut.route.csv", "out.pt"], ["cut.route.csv", "line", "cut short"]),
        (["convert", "missing.route.csv", "out.pt"], ["missing.route.csv", "no such file"]),
        (["replay", "--trace", "pickled.pt"], ["pickled.pt", "could run code"]),
        (["replay", "--trace", "empty.pt"], ["empty.pt", "empty"]),
        (["replay", "--trace", "cut.pt"], ["cut.pt", "cut short"]),
        (["calibrate", "--from-trace", "cut.pt"], ["cut.pt", "cut short"]),
        (["calibrate", "--from-dump", "pickled.pt"], ["pickled.pt", "could run code"]),
    ],
)
def test_bad_files_name_the_file(files, argv, needles) -> None:
    _assert_clean_error(_run(*argv, cwd=files), *needles)


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["spec-eval", "--requests", "0"], ["--requests 0", ">= 1"]),
        (["spec-eval", "--budgets", "0"], ["--budgets", "[1, 7]"]),
        (["spec-eval", "--budgets", "99"], ["--budgets", "[1, 7]"]),
        (["spec-eval", "--new-tokens", "0"], ["--new-tokens 0"]),
        (["replay", "--shapes", "1000x1"], ["--shapes 1000x1", "at most"]),
        (["replay", "--shapes", "8x0"], ["--shapes 8x0", ">= 1"]),
        (["verify", "--shapes", "300x4"], ["--shapes 300x4", "at most"]),
        (["replay", "--configs", "configs.json"], ["policy='bogus'", "choose one of"]),
        (["quality", "--study", "--configs", "configs.json"], ["--study and --configs"]),
    ],
)
def test_bad_arguments_name_the_flag_before_any_work(files, argv, needles) -> None:
    result = _run(*argv, cwd=files)
    _assert_clean_error(result, *needles)
    assert "k_max=" not in result.stdout and "configurations" not in result.stdout  # nothing was run
