"""Test configuration: markers, automatic skips, hypothesis profiles.

Markers (declared in pyproject.toml):
  gpu     needs a CUDA device; skipped without one (never in CI).
  sglang  needs ``import sglang`` to work; skipped where SGLang is not installed.
  slow    long-running; skipped unless ``--run-slow`` is given.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

#: ``--time-report PATH``: where the run's time went (tests/time_report.py); pytester for its test.
pytest_plugins = ["tests.time_report", "pytester"]

# Without a GPU the Triton kernels run in Triton's interpreter.  It is chosen when a kernel module is
# imported, so it is set here, before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

settings.register_profile(
    "default",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# CI draws the same examples on every run, so a red build is reproducible from its log.
settings.register_profile("ci", parent=settings.get_profile("default"), derandomize=True, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


#: Markers of the tests that start a real CPU server, and the modules they must live in.  Under ``make
#: test`` (pytest-xdist) every test of those modules runs in one worker, one server at a time: an idle
#: SGLang scheduler on CPU keeps a core busy, and two servers on a 2-core machine would slow each other
#: and everything else.  (xdist's own ``--dist loadgroup`` cannot group them: under pytest 9 the group
#: it appends to a test's id is lost, so the scheduler below groups by module instead.)
CPU_SERVER_MARKERS = ("live_server", "soak", "multi_rank", "adaptive_spec")
CPU_SERVER_MODULE_PREFIX = "test_live_"
CPU_SERVER_SCOPE = "cpu-server"

# Each xdist worker gets its share of the cores for torch's own threads, so two workers on a 2-core
# machine do not run four busy threads; so do the processes its tests start (CPU servers, command
# lines), through OMP_NUM_THREADS: two threads of one process on two cores wait on each other
# whenever another process takes a core (the demo took 2.6 times as long, docs/offline.md).
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Every test of a ``test_live_*`` module in one work unit, every other test in a unit of its own.

    The largest unit is handed out first (xdist's default ordering), so the CPU servers start at once
    and the other workers share the rest.
    """
    from xdist.scheduler import LoadScopeScheduling

    class CpuServerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return CPU_SERVER_SCOPE if module.startswith(CPU_SERVER_MODULE_PREFIX) else nodeid

    return CpuServerScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        marker = next((m for m in CPU_SERVER_MARKERS if m in item.keywords), None)
        if marker is not None and not item.path.name.startswith(CPU_SERVER_MODULE_PREFIX):
            raise pytest.UsageError(
                f"{item.nodeid} is marked {marker} (it starts a CPU server): move it to a "
                f"tests/{CPU_SERVER_MODULE_PREFIX}*.py module, whose tests run one server at a time"
            )
    reasons = {}
    if not torch.cuda.is_available():
        reasons["gpu"] = "needs a CUDA device (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("sglang") is None:
        reasons["sglang"] = "needs SGLang installed (pip install sglang==0.5.23)"
    if not config.getoption("--run-slow"):
        reasons["slow"] = "slow test; pass --run-slow to run it"
    for item in items:
        for marker, reason in reasons.items():
            if marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def live_servers(tmp_path_factory):
    """The CPU servers the ``test_live_*`` modules share (:class:`tests.live_server.LiveServerPool`)."""
    from tests.live_server import LiveServerPool

    pool = LiveServerPool(tmp_path_factory.mktemp("shared-servers"))
    yield pool
    pool.close()


# The live-server modules' reference: Hugging Face's Qwen3-MoE running the shipped tiny model, and
# the prompts they send (modules with fixtures of these names of their own keep them).
@pytest.fixture(scope="module")
def reference():
    """The tiny model in transformers (float32) and its tokenizer."""
    from xshare_sglang.tiny.tiny_model import load_tiny_model

    return load_tiny_model()


@pytest.fixture(scope="module")
def prompts(reference) -> list[list[int]]:
    """Three held-out openings (code, math, prose) as token ids, 24 tokens each."""
    from xshare_sglang.tiny.tiny_demo import heldout_texts
    from xshare_sglang.tiny.tiny_model import tiny_model_dir

    _, tokenizer = reference
    texts = [heldout_texts(tiny_model_dir(), domain)[0] for domain in ("code", "math", "prose")]
    return [tokenizer(text)["input_ids"][:24] for text in texts]
