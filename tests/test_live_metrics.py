"""The plugin's Prometheus series on a real ``sglang.launch_server`` (CPU engine, shipped tiny MoE).

SGLang serves ``/metrics`` from its HTTP process and collects the scheduler's series through
prometheus_client's multiprocess files; the plugin creates its families in the scheduler when the
target model is loaded.  A healthy server that has served nothing must already list every series of
``xshare_sglang.sglang_plugin.metrics.METRICS`` (each MoE layer, the TP rank) at 0, so that zero
fallbacks reads as 0 and not as a plugin that is not loaded; after traffic the forward counters
count and the fallbacks stay 0.  This server samples its metrics (``--moe-pruner-metrics-every 2``): the
layer calls of one pruned forward in two add theirs (the soak test checks every forward's).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.live_server import SERVE_CPU_FLAGS, SERVE_CPU_LOG_INTERVAL, LiveServer
from xshare_sglang.sglang_plugin.metrics import GUARD_METRICS, METRICS
from xshare_sglang.tiny.tiny_demo import heldout_texts
from xshare_sglang.tiny.tiny_model import tiny_model_dir

pytestmark = pytest.mark.live_server

LOG_INTERVAL = SERVE_CPU_LOG_INTERVAL
#: One pruned forward in this many adds its layer calls' metrics.
METRICS_EVERY = 2
#: The pruner flags of ``make serve-cpu``, the metrics sampled.
FLAGS = [*SERVE_CPU_FLAGS, "--moe-pruner-metrics-every", str(METRICS_EVERY)]
#: The tiny model's MoE layers (every one of its 4 layers is sparse).
LAYERS = ["0", "1", "2", "3"]
NEW_TOKENS = 16


def expected_labels(per_layer: bool) -> list[tuple]:
    if per_layer:
        return sorted((("layer", layer), ("tp_rank", "0")) for layer in LAYERS)
    return [(("tp_rank", "0"),)]


@pytest.fixture(scope="module")
def metrics_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server-metrics") / "server.log"
    server = LiveServer(FLAGS, log).start()
    yield server
    server.stop()


def test_every_series_from_start_up_then_counting(metrics_server) -> None:
    """Healthy and idle (only the start-up health probe, a prefill, has run): every series of
    ``METRICS`` is listed with its labels and value 0, the guard's are absent (guard off).  After
    concurrent requests: pruned forwards cover each request's decode steps, every layer's pruned
    calls are the sampled forwards of the reports so far (the first of every two), the gauges are set
    and no selection fell back."""
    server = metrics_server
    assert server.policies() == ["xshare"]
    idle = server.metrics()
    for spec in METRICS:
        series = idle.get(spec.series)
        assert series is not None, f"{spec.series} is not on /metrics at start-up"
        assert sorted(series) == expected_labels(spec.per_layer), spec.series
        assert set(series.values()) == {0.0}, f"{spec.series}: {series}"
    assert not [spec.series for spec in GUARD_METRICS if spec.series in idle]

    texts = [text[:80] for domain in ("code", "math", "prose") for text in heldout_texts(tiny_model_dir(), domain)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda text: server.generate(text, NEW_TOKENS), texts[:6]))
    assert all(answer["meta_info"]["completion_tokens"] == NEW_TOKENS for answer in answers)

    served = server.metrics()
    rank = (("tp_rank", "0"),)
    forwards = served["moe_pruner:pruned_forwards_total"][rank]
    # the first token of a request comes from its prefill (not pruned), the others from decode steps
    assert NEW_TOKENS - 1 <= forwards <= len(answers) * (NEW_TOKENS - 1)
    assert served["moe_pruner:selection_fallbacks_total"] == {rank: 0.0}
    reported = LOG_INTERVAL * math.floor(forwards / LOG_INTERVAL)
    assert reported > 0
    calls = served["moe_pruner:layer_calls_total"]
    sampled = -(-reported // METRICS_EVERY)  # forwards 0, 2, 4, ... of the reported ones
    assert calls == {labels: float(sampled) for labels in expected_labels(True)}
    assert all(value > 0 for value in served["moe_pruner:kept_experts"].values())
    assert all(value > 0 for value in served["moe_pruner:activated_experts"].values())
    assert server.alive()
