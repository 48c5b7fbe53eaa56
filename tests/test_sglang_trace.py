"""Trace recording from the server (``--moe-pruner-trace-dir``): flags, sampling, what is written,
and the replay tool reading it back.  SGLang's own ``select_experts`` runs on CPU under the hooks."""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace

import pytest
import torch

from tests.test_sglang_context import NUM_EXPERTS, _init, _model, _runner, _topk_config, plugin_env  # noqa: F401
from xshare_sglang import PrunerConfig, select_experts_mask
from xshare_sglang.replay import BatchShape, build_batches, load_trace, replay_table, token_table
from xshare_sglang.replay.trace import TraceMeta
from xshare_sglang.sglang_plugin import trace_recorder
from xshare_sglang.sglang_plugin.flags import add_flags, settings_from_args
from xshare_sglang.sglang_plugin.settings import ENV_VAR, PluginSettings
from xshare_sglang.sglang_plugin.trace_recorder import TraceRecorder

pytestmark = pytest.mark.sglang


def _settings(argv):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return settings_from_args(parser.parse_args(argv), None)


def test_trace_flags() -> None:
    settings = _settings(["--moe-pruner-trace-dir", "/tmp/x", "--moe-pruner-trace-every", "4"])
    assert (settings.trace_dir, settings.trace_every, settings.trace_max_mb) == ("/tmp/x", 4, 512)
    assert settings.active and not settings.enabled  # recording alone, no pruning
    assert PluginSettings.from_dict(settings.to_dict()) == settings
    with pytest.raises(ValueError, match=r"^--moe-pruner-trace-every: .*without trace_dir"):
        _settings(["--moe-pruner-trace-every", "4"])
    parser = argparse.ArgumentParser()
    add_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-pruner-trace-max-mb", "0"])
    assert _settings([]) is None


def _forward(runner, configs, mode, request_ids, logits_per_layer, spec_info=None):
    from sglang.srt.layers.moe import topk
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from xshare_sglang.sglang_plugin.hooks import model_runner_forward_raw

    outputs = []

    def original(self, forward_batch, *args, **kwargs):
        for config, logits in zip(configs, logits_per_layer, strict=True):
            hidden = torch.zeros(logits.shape[0], 4)
            outputs.append(topk.select_experts(hidden_states=hidden, router_logits=logits.clone(), topk_config=config))

    batch = SimpleNamespace(forward_mode=ForwardMode[mode], spec_info=spec_info, req_pool_indices=request_ids)
    model_runner_forward_raw.hook(original, runner, batch)
    return outputs


@pytest.mark.parametrize("policy", [{"policy": "none"}, {"policy": "moe-spec", "max_experts": 2}])
def test_server_records_unpruned_logits_of_sampled_forwards(plugin_env, monkeypatch, tmp_path, policy) -> None:  # noqa: F811
    """One decode forward in 2 is recorded, with every layer's logits as SGLang computed them
    (before the mask, in their own dtype), the keep mask the pruner applied (none when it did not
    prune), the request of each row, and verify rows repeated D times."""
    monkeypatch.setenv(ENV_VAR, json.dumps({**policy, "trace_dir": str(tmp_path), "trace_every": 2}))
    # the whole recording in the one file flush() writes: on a loaded machine (CI's two workers) two
    # forwards here were once more than the writer's idle flush apart, and it wrote a file between them
    monkeypatch.setattr(trace_recorder, "IDLE_FLUSH_S", 600.0)
    configs = [_topk_config(), _topk_config()]
    runner = _runner(_model(*configs))
    runtime = _init(runner)
    assert runtime is not None and runtime.recorder is not None
    gen = torch.Generator().manual_seed(0)
    sent = []
    for _ in range(4):
        logits = [torch.randn(3, NUM_EXPERTS, generator=gen) for _ in configs]
        outputs = _forward(runner, configs, "DECODE", torch.tensor([5, 9, 2]), logits)
        sent.append(logits)
        if policy["policy"] == "moe-spec":
            assert all(len(set(o.topk_ids[o.topk_ids >= 0].tolist())) <= 2 for o in outputs)  # pruned meanwhile
    verify_logits = [torch.randn(4, NUM_EXPERTS, generator=gen) for _ in configs]
    _forward(runner, configs, "TARGET_VERIFY", torch.tensor([7, 1]), verify_logits, SimpleNamespace(draft_token_num=2))
    _forward(runner, configs, "EXTEND", torch.tensor([3]), [torch.randn(6, NUM_EXPERTS) for _ in configs])
    runtime.recorder.flush()
    (path,) = runtime.recorder.files
    trace = load_trace(path)
    assert trace.meta.num_layers == 2 and trace.meta.num_experts == NUM_EXPERTS and trace.meta.top_k == 4
    assert [(c.step, c.layer, c.phase) for c in trace.calls] == [
        (0, 0, "decode"),
        (0, 1, "decode"),
        (2, 0, "decode"),
        (2, 1, "decode"),
        (4, 0, "verify"),
        (4, 1, "verify"),
    ]
    for call, expected in zip(trace.calls[:4], [*sent[0], *sent[2]], strict=True):
        assert call.logits.dtype == torch.float32
        assert torch.equal(call.logits, expected)
        assert call.request_ids.tolist() == [5, 9, 2]
        if policy["policy"] == "none":
            assert call.keep is None
        else:
            cfg = PrunerConfig(**policy)
            assert torch.equal(call.keep, select_experts_mask(expected, cfg, top_k=4)) and int(call.keep.sum()) == 2
    assert trace.calls[4].request_ids.tolist() == [7, 7, 1, 1]
    assert torch.equal(trace.calls[5].logits, verify_logits[1])
    # the replay tool reads the recording
    table = token_table(trace, "decode")
    assert table.num_tokens == 6 and [len(s) for s in table.sequences()["default"]] == [2, 2, 2]
    (row,) = replay_table(
        table,
        build_batches(table.sequences(), BatchShape(3, 1), "single"),
        [PrunerConfig()],
        scenario="single",
        shape=BatchShape(3, 1),
    )
    assert row.layer_calls == 4 and row.activated == row.baseline_activated
    # and so does the command line, from the folder
    from xshare_sglang.cli import main

    out = tmp_path / "rows.json"
    assert (
        main(
            [
                "replay",
                "--trace",
                str(tmp_path),
                "--shapes",
                "3x1",
                "--sweep",
                "oea",
                "--values",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert [(r["policy"], r["layer_calls"]) for r in rows] == [("none", 4), ("oea", 4)]


def test_recorder_stops_at_the_size_limit(tmp_path) -> None:
    meta = TraceMeta("m", 1, 8, 2, (0,))
    recorder = TraceRecorder(tmp_path, meta, every=1, max_bytes=1)
    try:
        for _ in range(3):
            recorder.start_forward("decode", torch.tensor([0, 1]), 1)
            recorder.record(0, torch.randn(2, 8))
            recorder.finish_forward()
            recorder.flush()
        assert len(recorder.files) == 1 and recorder.stopped
        recorder.start_forward("decode", torch.tensor([0, 1]), 1)
        assert recorder.current is None
        # rows that do not match the request count (e.g. padded by DP attention) are dropped
        other = TraceRecorder(tmp_path / "b", meta, every=1, max_bytes=2**20)
        other.start_forward("decode", torch.tensor([0, 1]), 1)
        other.record(0, torch.randn(4, 8))
        other.finish_forward()
        other.flush()
        assert other.files == [] and other.dropped == 1
        other.close()
    finally:
        recorder.close()
