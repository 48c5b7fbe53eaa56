"""Nothing is left in the user's working directory.

SGLang's clients write files where they run: ``python -m sglang.benchmark.serving`` appends its result
to ``{backend}_{MMDD}_{prompts}_{in}_{out}.jsonl`` in its working directory unless ``--output-file``
names one, and ``python -m sglang.test.few_shot_gsm8k`` always writes ``tmp_output_gsm8k.txt`` there
(it has no flag for it).  The A/B tool therefore runs every client in its session's folder with
absolute paths in its command; these tests run it from an empty working directory, with relative
``--output-dir`` and ``--model-path``, against the test stand-in server (``tests/standin_server.py``,
not SGLang) and SGLang's real clients.  ``xshare-sglang calibrate``'s counterpart is in
``tests/test_static_calibration.py``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from xshare_sglang.serving.ab.ab_cli import main
from xshare_sglang.serving.ab.ab_report import read_runs
from xshare_sglang.serving.ab.ab_server import launch_port

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parent.parent
STANDIN = f"{sys.executable} {REPO / 'tests' / 'standin_server.py'}"
TINY = REPO / "xshare_sglang" / "data" / "tiny_moe"


def listing(folder: Path) -> list[str]:
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*"))


def test_ab_compare_leaves_the_working_directory_empty(tmp_path, monkeypatch):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (tmp_path / "model").symlink_to(TINY, target_is_directory=True)
    monkeypatch.chdir(cwd)
    code = main(
        [
            *("--model-path", "../model", "--launch-command", STANDIN, "--port", str(launch_port())),
            *("--output-dir", "../out", "--candidate", "xshare", "--repeats", "1", "--concurrency", "2"),
            *("--dataset", "mt-bench", "--output-len", "8", "--num-prompts", "4"),
            *("--gsm8k-questions", "8", "--gsm8k-shots", "2", "--gsm8k-parallel", "4"),
            *("--startup-timeout", "60", "--run-timeout", "240", "--stop-timeout", "10"),
        ]
    )
    assert listing(cwd) == [], f"left in the working directory: {listing(cwd)}"
    out = tmp_path / "out"
    failed = [r.get("error") for r in read_runs(out) if r.get("status") == "failed"]
    assert code == 0 and not failed, failed
    ok = [r for r in read_runs(out) if r["record"] in ("serving", "accuracy") and r["status"] == "ok"]
    assert sorted((r["arm"], r["record"], r["dataset"]) for r in ok) == sorted(
        (arm, record, dataset)
        for arm in ("baseline", "xshare")
        for record, dataset in (("serving", "mt-bench"), ("accuracy", "gsm8k"))
    )
    # each client's files are in its session's folder, under --output-dir
    for session in ("000-r1-baseline", "001-r1-xshare"):
        files = set(os.listdir(out / "runs" / session))
        assert {"serving-mt-bench-c2.jsonl", "tmp_output_gsm8k.txt"} <= files, files
    assert not list(tmp_path.glob("sglang_*.jsonl")) and not list(out.rglob("sglang_*.jsonl"))
