"""Where a test run's time went, printed at its end (and written as JSON with ``--time-report PATH``).

Three tables, from the reports pytest (or, under pytest-xdist, each worker) sends back:

* the slowest tests, each test's setup, call and teardown summed (a class- or module-scoped fixture,
  such as a live server, is set up in its first test and torn down in its last, so it counts there);
* the total per test module;
* per worker: tests run, seconds busy in them, and the span from its first test's start to its last
  test's end (the run's wall time is set by the longest span).

CI quotes these tables at every stop (``make test`` passes ``--time-report``), so a test or module
that grows shows up in the next report.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

#: Rows of the slowest-tests table.
SLOWEST = 25


@dataclass
class _WorkerTime:
    tests: int = 0
    busy_s: float = 0.0
    first_start: float = float("inf")
    last_stop: float = 0.0


@dataclass
class TimeReport:
    """Per test, module and worker seconds of one run, gathered from its test reports."""

    test_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    workers: dict[str, _WorkerTime] = field(default_factory=lambda: defaultdict(_WorkerTime))

    def add(self, report: pytest.TestReport) -> None:
        self.test_seconds[report.nodeid] += report.duration
        node = getattr(report, "node", None)  # pytest-xdist: the worker that ran it
        worker = self.workers[node.gateway.id if node is not None else "main"]
        worker.busy_s += report.duration
        worker.first_start = min(worker.first_start, report.start)
        worker.last_stop = max(worker.last_stop, report.stop)
        if report.when == "call" or (report.when == "setup" and report.skipped):
            worker.tests += 1

    def module_seconds(self) -> dict[str, float]:
        totals: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.test_seconds.items():
            totals[nodeid.split("::", 1)[0]] += seconds
        return dict(totals)

    def as_dict(self) -> dict:
        slowest = sorted(self.test_seconds.items(), key=lambda item: -item[1])[:SLOWEST]
        return {
            "slowest_tests": [{"test": nodeid, "seconds": round(s, 2)} for nodeid, s in slowest],
            "modules": [
                {"module": module, "seconds": round(s, 2)}
                for module, s in sorted(self.module_seconds().items(), key=lambda item: -item[1])
            ],
            "workers": [
                {
                    "worker": name,
                    "tests": w.tests,
                    "busy_seconds": round(w.busy_s, 2),
                    "span_seconds": round(max(0.0, w.last_stop - w.first_start), 2),
                }
                for name, w in sorted(self.workers.items())
            ],
        }

    def lines(self) -> list[str]:
        """The three tables as text."""
        data = self.as_dict()
        out = [f"slowest {len(data['slowest_tests'])} tests (setup + call + teardown, s):"]
        out += [f"{row['seconds']:9.1f}  {row['test']}" for row in data["slowest_tests"]]
        out += ["", "per test module (s):"]
        out += [f"{row['seconds']:9.1f}  {row['module']}" for row in data["modules"]]
        out += ["", "per worker: tests, busy s, span s (first start to last end):"]
        out += [
            f"  {row['worker']:>6}  {row['tests']:5d}  {row['busy_seconds']:9.1f}  {row['span_seconds']:9.1f}"
            for row in data["workers"]
        ]
        return out


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--time-report",
        metavar="PATH",
        help="print where the run's time went (slowest tests, per module, per worker) and write it to PATH as JSON",
    )


def pytest_configure(config: pytest.Config) -> None:
    # on the controller only: an xdist worker's reports reach the controller, which adds them up
    if config.getoption("--time-report") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Collector(Path(config.getoption("--time-report"))), "time-report")


class _Collector:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.report = TimeReport()
        self.started = time.monotonic()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.report.add(report)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        wall_s = time.monotonic() - self.started
        terminalreporter.section("where the time went")
        for line in self.report.lines():
            terminalreporter.write_line(line)
        terminalreporter.write_line(f"wall time from collection to this report: {wall_s:.1f} s")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"wall_seconds": round(wall_s, 1), **self.report.as_dict()}, indent=1) + "\n")
        terminalreporter.write_line(f"(written to {self.path})")
