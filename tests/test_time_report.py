"""The end-of-run time report (tests/time_report.py): its sums, and a real run under pytest-xdist."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from tests.time_report import TimeReport

ROOT = Path(__file__).resolve().parent.parent


def _report(nodeid: str, when: str, duration: float, start: float, worker: str | None = None, skipped: bool = False):
    node = SimpleNamespace(gateway=SimpleNamespace(id=worker)) if worker else None
    return SimpleNamespace(
        nodeid=nodeid, when=when, duration=duration, start=start, stop=start + duration, skipped=skipped, node=node
    )


def test_sums_per_test_module_and_worker() -> None:
    report = TimeReport()
    for args in [
        ("tests/test_a.py::test_server", "setup", 30.0, 100.0, "gw0"),  # a module fixture's start
        ("tests/test_a.py::test_server", "call", 2.0, 130.0, "gw0"),
        ("tests/test_a.py::test_server", "teardown", 1.0, 132.0, "gw0"),
        ("tests/test_b.py::test_x[1]", "setup", 0.1, 100.0, "gw1"),
        ("tests/test_b.py::test_x[1]", "call", 5.0, 100.1, "gw1"),
        ("tests/test_b.py::test_x[2]", "call", 7.0, 110.0, "gw1"),
        ("tests/test_b.py::test_skipped", "setup", 0.0, 117.0, "gw1", True),
    ]:
        report.add(_report(*args))
    data = report.as_dict()
    assert data["slowest_tests"][:3] == [
        {"test": "tests/test_a.py::test_server", "seconds": 33.0},
        {"test": "tests/test_b.py::test_x[2]", "seconds": 7.0},
        {"test": "tests/test_b.py::test_x[1]", "seconds": 5.1},
    ]
    assert data["modules"] == [
        {"module": "tests/test_a.py", "seconds": 33.0},
        {"module": "tests/test_b.py", "seconds": 12.1},
    ]
    assert data["workers"] == [
        {"worker": "gw0", "tests": 1, "busy_seconds": 33.0, "span_seconds": 33.0},
        {"worker": "gw1", "tests": 3, "busy_seconds": 12.1, "span_seconds": 17.0},
    ]
    text = "\n".join(report.lines())
    assert "33.0  tests/test_a.py::test_server" in text and "gw1      3" in text


def test_a_run_under_xdist_prints_and_writes_the_report(pytester, monkeypatch) -> None:
    pytester.makepyfile(
        test_slow="import time\n\ndef test_one():\n    time.sleep(0.3)\n\ndef test_two():\n    time.sleep(0.2)\n",
        test_fast="def test_fast():\n    pass\n",
    )
    out = pytester.path / "times" / "report.json"
    env_path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", env_path)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "tests.time_report", "--time-report", str(out))
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(
        ["*where the time went*", "slowest 3 tests*", "per test module*", "per worker*", "wall time*"]
    )
    data = json.loads(out.read_text())
    assert data["wall_seconds"] >= 0.25  # the two workers slept 0.3 and 0.2 s
    assert data["slowest_tests"][0]["test"] == "test_slow.py::test_one"
    assert data["slowest_tests"][0]["seconds"] >= 0.3
    assert [m["module"] for m in data["modules"]] == ["test_slow.py", "test_fast.py"]
    assert {w["worker"] for w in data["workers"]} <= {"gw0", "gw1"}
    assert sum(w["tests"] for w in data["workers"]) == 3
