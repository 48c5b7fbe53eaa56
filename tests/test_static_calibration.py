"""``xshare-sglang calibrate`` (``xshare_sglang/serving/calibration/``: ``static_calibration.py``, ``server_checks.py``, ``recorder_client.py``, ``workload.py`` and ``recorder_dump.py``).

The dumps are written by SGLang's own expert-distribution recorder (``_ExpertDistributionRecorderReal``
with its ``stat`` / ``per_pass`` / ``per_token`` gatherers and accumulators, and ``_dump_to_file``), run
on CPU under a published ``ServerArgs`` for the shipped tiny Qwen3-MoE, with an
``ExpertLocationMetadata`` built by ``init_by_mapping`` from SGLang's ``ModelConfig`` of that model (its
``Qwen3MoeForCausalLM`` gives 4 layers x 32 logical experts) and a placement with two redundant
physical experts.  One thing is stood in: ``expert_distribution.get_device``, which the layer gatherer
calls to place its count buffer.  ``sglang.srt.utils.get_device()`` raises "No accelerator (CUDA, XPU,
HPU, NPU, MUSA, MPS) or platform plugin is available" on a machine without an accelerator unless
SGLang's CPU engine was selected for the whole process before its platform was first resolved
(``SGLANG_USE_CPU_ENGINE=1``; utils/common.py:1071-1126, platforms/__init__.py); the stand-in answers
``"cpu"``, as SGLang's CPU platform does (platforms/cpu.py:47).

``stat`` mode all-reduces its counts (expert_distribution.py:995), so a one-rank gloo process group is
set up for it.  The ``--url`` flow runs against a stand-in HTTP server (stdlib ``http.server``) that
answers SGLang's ``/server_info``, ``/model_info`` and the three recorder endpoints by calling the real
recorder, which writes its dump into the dump folder as a server would.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xshare_sglang.calibration_file import load_static_ranking
from xshare_sglang.cli import main
from xshare_sglang.config import PrunerConfig
from xshare_sglang.serving.ab.ab_server import launch_port
from xshare_sglang.serving.calibration import recorder_dump as rd
from xshare_sglang.serving.calibration import server_checks
from xshare_sglang.serving.calibration import static_calibration as sc
from xshare_sglang.serving.calibration import workload as wl
from xshare_sglang.serving.datasets import custom_conversations

# The shipped tiny Qwen3-MoE (4 layers, 32 experts, top-4); SGLang's Qwen3MoeForCausalLM sizes the
# recorder from its config.
TINY_MOE = Path(__file__).resolve().parents[1] / "xshare_sglang" / "data" / "tiny_moe"
NUM_LAYERS, NUM_LOGICAL, TOP_K, REDUNDANT = 4, 32, 4, 2


def _placement(layer: int) -> list[int]:
    """Physical slot -> logical expert of one layer: a shuffled placement plus replicas of two experts
    (``--ep-num-redundant-experts 2``), different in every layer, as EPLB would leave it."""
    order = torch.randperm(NUM_LOGICAL, generator=torch.Generator().manual_seed(100 + layer)).tolist()
    return order + order[:REDUNDANT]


PHYSICAL_TO_LOGICAL = [_placement(layer) for layer in range(NUM_LAYERS)]
NUM_PHYSICAL = NUM_LOGICAL + REDUNDANT
MOE_LAYERS = (1, 2, 3)  # layer 0 never reaches the recorder, as a dense layer would not


# ------------------------------------------------------------------------------ traffic and counts


def make_traffic(seed: int, passes: int = 5) -> list[dict[int, torch.Tensor]]:
    """Forward passes of top-k physical ids per MoE layer: distinct ids per token from -1 (a pruned
    pick) to the last physical replica; every pass has the same token count in each layer."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(passes):
        tokens = int(torch.randint(1, 7, (1,), generator=gen))
        out.append(
            {
                layer: torch.stack([torch.randperm(NUM_PHYSICAL + 1, generator=gen)[:TOP_K] - 1 for _ in range(tokens)])
                for layer in MOE_LAYERS
            }
        )
    return out


def expected_counts(*traffics: list[dict[int, torch.Tensor]]) -> list[list[int]]:
    """Logical counts by hand: each non-negative physical id counts once for its logical expert."""
    counts = [[0] * NUM_LOGICAL for _ in range(NUM_LAYERS)]
    for traffic in traffics:
        for step in traffic:
            for layer, ids in step.items():
                for physical in ids.flatten().tolist():
                    if physical >= 0:
                        counts[layer][PHYSICAL_TO_LOGICAL[layer][physical]] += 1
    return counts


def non_negative_picks(*traffics) -> tuple[int, int]:
    picks = [ids.flatten() for traffic in traffics for step in traffic for ids in step.values()]
    flat = torch.cat(picks)
    return int((flat >= 0).sum()), int(flat.numel())


# ------------------------------------------------------------------------ SGLang's recorder on CPU

_CONTEXTS: dict[str, object] = {}


class SGLangRecorder:
    """One of SGLang's recorders, fed like the model runner and ``select_experts`` feed it."""

    def __init__(self, recorder, mode: str) -> None:
        self.recorder, self.mode, self._pass_id = recorder, mode, 0

    def serve(self, traffic: list[dict[int, torch.Tensor]]) -> None:
        """Forward passes as ``ModelRunner.forward`` (``with_forward_pass``) and each MoE layer's
        ``select_experts`` (``with_current_layer`` + ``on_select_experts``) run them."""
        for step in traffic:
            tokens = next(iter(step.values())).shape[0]
            batch = SimpleNamespace(  # what the per_token gatherer reads from a ForwardBatch
                input_ids=torch.arange(tokens),
                positions=torch.arange(tokens),
                extend_seq_lens_cpu=[tokens],
                forward_mode=SimpleNamespace(value=2),
            )
            with self.recorder.with_forward_pass(self._pass_id, batch):
                for layer, ids in step.items():
                    with self.recorder.with_current_layer(layer):
                        self.recorder.on_select_experts(topk_ids=ids.to(torch.int32))
            self._pass_id += 1


@pytest.fixture
def sglang_recorders(monkeypatch, tmp_path) -> Iterator:
    """Factory of SGLang recorders (mode, rank) under a published config; dumps go to ``tmp_path/dumps``."""
    import torch.distributed as dist
    from sglang.srt import runtime_context
    from sglang.srt.eplb import expert_distribution, expert_location
    from sglang.srt.server_args import ServerArgs

    dump_dir = tmp_path / "dumps"
    monkeypatch.setenv(sc.RECORDER_DIR_ENV, str(dump_dir))
    monkeypatch.setattr(expert_distribution, "get_device", lambda device_id=None: "cpu")  # stand-in, see above
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)

    def context(mode: str):
        if mode not in _CONTEXTS:
            args = ServerArgs(
                model_path=str(TINY_MOE),
                device="cpu",
                expert_distribution_recorder_mode=mode,
                expert_distribution_recorder_buffer_size=-1,
                ep_num_redundant_experts=REDUNDANT,
                chunked_prefill_size=64,
            )
            _CONTEXTS[mode] = runtime_context.create_context(args, role="test")
        return _CONTEXTS[mode]

    active = []

    def make(mode: str, rank: int = 0) -> SGLangRecorder:
        ctx = context(mode)
        cm = runtime_context.use_context(ctx)
        cm.__enter__()
        active.append(cm)
        metadata = expert_location.ExpertLocationMetadata.init_by_mapping(
            runtime_context.process_model_config(), physical_to_logical_map=PHYSICAL_TO_LOGICAL, moe_ep_rank=rank
        )
        assert (metadata.num_physical_experts, metadata.num_logical_experts) == (NUM_PHYSICAL, NUM_LOGICAL)
        recorder = expert_distribution.ExpertDistributionRecorder.init_new(metadata, rank=rank)
        assert type(recorder).__name__ == "_ExpertDistributionRecorderReal"
        return SGLangRecorder(recorder, mode)

    make.dump_dir = dump_dir
    try:
        yield make
    finally:
        for cm in reversed(active):
            cm.__exit__(None, None, None)
        if own_group:
            dist.destroy_process_group()


def assert_ranking(path: Path, counts: list[list[int]], model: str | None) -> None:
    """The file loads, holds exactly ``counts``, and the moe-spec static pruner config accepts it."""
    ranking = load_static_ranking(path)
    assert [list(map(int, row)) for row in ranking.counts] == counts
    assert all(float(v).is_integer() for row in ranking.counts for v in row)
    assert ranking.model == model
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["version"], doc["num_layers"], doc["num_experts"]) == (
        "xshare-sglang.static-ranking",
        1,
        NUM_LAYERS,
        NUM_LOGICAL,
    )
    cfg = PrunerConfig(policy="moe-spec", max_experts=4, ranking="static", static_ranking_path=str(path))
    cfg.validate_for_model(top_k=TOP_K, num_experts=NUM_LOGICAL, num_layers=NUM_LAYERS)
    assert cfg.static_ranking.counts == ranking.counts


# ------------------------------------------------------------------- (1) dumps of SGLang's recorder


@pytest.mark.sglang
@pytest.mark.parametrize("mode", ["stat", "per_pass", "per_token"])
def test_dump_of_sglangs_recorder_converts_exactly(sglang_recorders, tmp_path, mode) -> None:
    rec = sglang_recorders(mode)
    during = make_traffic(2)
    # Passes outside recording are not fed: a non-recording recorder asks torch.cuda whether a graph is
    # being captured, which fails on a CUDA build of torch without a driver.
    rec.recorder.start_record()
    rec.serve(during)
    rec.recorder.stop_record()
    rec.recorder.dump_record()

    paths = rd.dump_paths(sglang_recorders.dump_dir)
    assert len(paths) == 1
    counts = rd.read_dump(paths)
    want = expected_counts(during)
    assert counts.counts.tolist() == want
    assert counts.counts[0].sum() == 0  # the dense layer's row is present and zero
    kept, fed = non_negative_picks(during)
    assert counts.selections == kept < fed  # -1 picks were fed and not counted
    assert counts.forward_passes == len(during)
    assert counts.kinds == ("stat" if mode == "stat" else "per_pass",)

    out = tmp_path / "ranking.json"
    assert main(["calibrate", "--from-dump", str(sglang_recorders.dump_dir), "-o", str(out), "--model", "m"]) == 0
    assert_ranking(out, want, "m")


@pytest.mark.sglang
def test_per_rank_dump_files_are_summed(sglang_recorders, tmp_path) -> None:
    """per_pass writes one file per rank; a folder's newest dump is every rank's newest file."""
    old = sglang_recorders("per_pass", rank=0)
    old.recorder.start_record()
    old.serve(make_traffic(9))
    old.recorder.dump_record()  # an older dump of rank 0, superseded below
    ranks = [sglang_recorders("per_pass", rank=r) for r in (0, 1)]
    traffic = [make_traffic(10 + r) for r in (0, 1)]
    for rec, t in zip(ranks, traffic, strict=True):
        rec.recorder.start_record()
        rec.serve(t)
        rec.recorder.dump_record()
    chosen = rd.newest_dump(rd.list_dumps(sglang_recorders.dump_dir))
    assert [d.rank for d in chosen] == [0, 1]
    assert len(rd.list_dumps(sglang_recorders.dump_dir)) == 3
    out = tmp_path / "ranking.json"
    assert main(["calibrate", "--from-dump", str(sglang_recorders.dump_dir), "-o", str(out)]) == 0
    assert_ranking(out, expected_counts(*traffic), None)


# --------------------------------------------------------------- (2) the --url flow, stand-in server


class StandInSGLangServer:
    """Stand-in for an SGLang HTTP server: ``/server_info``, ``/model_info`` and the three recorder
    endpoints, answering as http_server.py does (200 and a line of text).  With a recorder it calls the
    real one; ``traffic_on_start`` is served right after recording starts (requests that arrive while
    it records).  Without one (``recorder_mode=None``) a start call drops the connection, as the real
    server does when its scheduler dies."""

    def __init__(self, recorder: SGLangRecorder | None, *, server_info: dict | None = None) -> None:
        self.recorder = recorder
        self.calls: list[str] = []
        self.traffic_on_start: list = []
        self.server_info = {
            "expert_distribution_recorder_mode": recorder.mode if recorder else None,
            "expert_distribution_recorder_buffer_size": -1 if recorder else None,
            "enable_eplb": False,
            "tp_size": 1,
            "launch_command": "python -m sglang.launch_server --model-path stand-in/tiny-moe",
        }
        if server_info is not None:
            self.server_info = server_info
        self.model_info = {"model_path": "stand-in/tiny-moe", "tokenizer_path": "stand-in/tokenizer"}
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: bytes, kind: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                stand_in.calls.append(self.path)
                doc = {"/server_info": stand_in.server_info, "/model_info": stand_in.model_info}.get(self.path)
                if doc is None:
                    self._answer(404, b'{"detail":"Not Found"}', "application/json")
                else:
                    self._answer(200, json.dumps(doc).encode(), "application/json")

            def do_POST(self):
                stand_in.calls.append(self.path)
                rec = stand_in.recorder
                if self.path == sc.START and rec is None:
                    self.close_connection = True  # the scheduler raised; the server goes down
                    return
                if self.path == sc.START:
                    rec.recorder.start_record()
                    rec.serve(stand_in.traffic_on_start)
                    text = "Start recording the expert distribution.\n"
                elif self.path == sc.STOP:
                    rec.recorder.stop_record()
                    text = "Stop recording the expert distribution.\n"
                elif self.path == sc.DUMP:
                    rec.recorder.dump_record()
                    text = "Dump expert distribution record.\n"
                else:
                    self._answer(404, b'{"detail":"Not Found"}', "application/json")
                    return
                self._answer(200, text.encode(), "text/plain")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)

    def __enter__(self) -> StandInSGLangServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _serving_flags() -> str:
    """The source of SGLang's benchmark client, whose parser the workload command must satisfy."""
    spec = importlib.util.find_spec("sglang.benchmark.serving")
    return Path(spec.origin).read_text()


@pytest.mark.sglang
def test_url_flow_runs_the_benchmark_client_and_reads_the_new_dump(sglang_recorders, tmp_path, monkeypatch) -> None:
    rec = sglang_recorders("stat")
    dump_dir = sglang_recorders.dump_dir
    dump_dir.mkdir(parents=True)
    # An older dump already in the folder, with a later time in its name: not created by this run.
    torch.save(
        {"rank": 0, "logical_count": torch.ones(1, NUM_LAYERS, NUM_LOGICAL, dtype=torch.int32)},
        dump_dir / "expert_distribution_recorder_9999999999.0.pt",
    )
    traffic = make_traffic(4)
    seen = {}

    def stand_in_benchmark_client(cmd, env, cwd, check):
        """Stand-in for ``python -m sglang.benchmark.serving``: checks its command line, and the
        requests it would send are served by the stand-in server while it records."""
        seen["cmd"], seen["env"], seen["cwd"] = cmd, env, cwd
        rec.serve(traffic)
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(wl.subprocess, "run", stand_in_benchmark_client)
    out = tmp_path / "ranking.json"
    with StandInSGLangServer(rec) as server:
        argv = ["calibrate", "--url", server.url + "/", "-o", str(out), "--dump-dir", str(dump_dir)]
        argv += ["--num-prompts", "5", "--max-concurrency", "4", "--output-len", "16", "--api-key", "k"]
        assert main(argv) == 0
        assert server.calls == ["/server_info", "/model_info", sc.START, sc.STOP, sc.DUMP]
    assert_ranking(out, expected_counts(traffic), "stand-in/tiny-moe")

    cmd = seen["cmd"]
    assert cmd[1:3] == ["-m", "sglang.benchmark.serving"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=True))
    assert flags == {
        "--backend": "sglang",
        "--base-url": server.url,
        "--dataset-name": "custom",
        "--dataset-path": flags["--dataset-path"],
        "--output-file": str(Path(seen["cwd"]) / "benchmark.jsonl"),
        "--num-prompts": "5",
        "--max-concurrency": "4",
        "--sharegpt-output-len": "16",
        "--model": "stand-in/tiny-moe",
        "--tokenizer": "stand-in/tokenizer",
    }
    assert seen["env"]["OPENAI_API_KEY"] == "k"
    source = _serving_flags()
    for flag in flags:
        assert f'"{flag}"' in source, f"sglang.benchmark.serving has no {flag}"
    assert '"custom"' in source
    assert Path(flags["--dataset-path"]).parent == Path(seen["cwd"])
    assert not Path(seen["cwd"]).exists()  # the client ran in a temporary folder, removed since


@pytest.mark.sglang
def test_url_flow_leaves_the_working_directory_empty(sglang_recorders, tmp_path, monkeypatch) -> None:
    """SGLang's REAL benchmark client, run from an empty working directory, writes nothing there.

    Without ``--output-file`` it appends its result to ``sglang_MMDD_N_custom.jsonl`` in its working
    directory.  Its requests go to the A/B tests' stand-in (``tests/standin_server.py``, not SGLang;
    the recorder stand-in here serves no ``/generate``) while the recorder stand-in records; the
    server's model is a relative path, found from the user's working directory."""
    from xshare_sglang.serving.ab.ab_server import LaunchedServer, wait_healthy

    rec = sglang_recorders("stat")
    traffic = make_traffic(6)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (tmp_path / "model").symlink_to(TINY_MOE, target_is_directory=True)
    real_run = subprocess.run
    seen = {}

    def benchmark_client_against_the_standin(cmd, **kwargs):
        cmd = list(cmd)
        cmd[cmd.index("--base-url") + 1] = generator.url
        seen["cmd"], seen["done"] = cmd, real_run(cmd, **kwargs, capture_output=True, text=True, timeout=240)
        rec.serve(traffic)
        return seen["done"]

    port = launch_port()
    standin = Path(__file__).resolve().parent / "standin_server.py"
    server_argv = [sys.executable, str(standin), "--model-path", str(TINY_MOE), "--port", str(port)]
    generator = LaunchedServer(server_argv, tmp_path / "standin.log")
    generator.url = f"http://127.0.0.1:{port}"
    generator.start()
    try:
        assert wait_healthy(generator.url, 60, alive=generator.exit_reason, poll_s=0.2) is None
        monkeypatch.setattr(wl.subprocess, "run", benchmark_client_against_the_standin)
        monkeypatch.chdir(cwd)
        out = tmp_path / "ranking.json"
        with StandInSGLangServer(rec) as server:
            server.model_info = {"model_path": "../model", "tokenizer_path": "../model"}
            argv = ["calibrate", "--url", server.url, "-o", str(out), "--dump-dir", str(sglang_recorders.dump_dir)]
            code = main([*argv, "--num-prompts", "4", "--max-concurrency", "2", "--output-len", "8"])
    finally:
        generator.stop(10)
    left = sorted(str(path.relative_to(cwd)) for path in cwd.rglob("*"))
    assert left == [], f"left in the working directory: {left}"
    done = seen["done"]
    assert code == 0 and done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert seen["cmd"][seen["cmd"].index("--tokenizer") + 1] == str(tmp_path / "model")
    assert_ranking(out, expected_counts(traffic), "../model")


@pytest.mark.sglang
def test_url_flow_without_workload_and_per_pass_mode(sglang_recorders, tmp_path) -> None:
    rec = sglang_recorders("per_pass")
    traffic = make_traffic(5)
    out = tmp_path / "ranking.json"
    with StandInSGLangServer(rec) as server:
        server.traffic_on_start = traffic
        argv = ["calibrate", "--url", server.url, "-o", str(out), "--dump-dir", str(sglang_recorders.dump_dir)]
        assert main([*argv, "--no-workload", "--duration", "0", "--model", "override"]) == 0
    assert_ranking(out, expected_counts(traffic), "override")


@pytest.mark.sglang
def test_failed_workload_still_stops_the_recorder(sglang_recorders, tmp_path, monkeypatch) -> None:
    rec = sglang_recorders("stat")
    monkeypatch.setattr(wl.subprocess, "run", lambda cmd, **kwargs: SimpleNamespace(returncode=3))
    out = tmp_path / "ranking.json"
    with StandInSGLangServer(rec) as server:
        with pytest.raises(SystemExit) as info:
            main(["calibrate", "--url", server.url, "-o", str(out), "--dump-dir", str(tmp_path)])
        assert server.calls[-2:] == [sc.START, sc.STOP]
    assert "benchmark client exited with 3" in str(info.value.code)
    assert not rec.recorder.recording
    assert not out.exists()


def test_mt_bench_default_output_len_and_gsm8k_reference_lengths(tmp_path, monkeypatch) -> None:
    """Without --output-len, MT-Bench (no reference answers) asks for 256 tokens and GSM8K for each
    reference answer's length (no --sharegpt-output-len); the default prompt count is the whole set."""
    commands = []
    monkeypatch.setattr(
        wl.subprocess, "run", lambda cmd, **kwargs: commands.append(cmd) or SimpleNamespace(returncode=0)
    )
    monkeypatch.setattr(sc, "benchmark_client_available", lambda: True)
    client = sc.RecorderClient("http://127.0.0.1:1")
    for dataset in ("mt-bench", "gsm8k"):
        args = SimpleNamespace(
            no_workload=False,
            dataset=dataset,
            num_prompts=None,
            output_len=None,
            max_concurrency=8,
            tokenizer=None,
            api_key=None,
        )
        sc._server_workload(args, client, {"model_path": "m"}, tmp_path)()
    mt, gsm = (dict(zip(c[3::2], c[4::2], strict=True)) for c in commands)
    assert mt["--sharegpt-output-len"] == "256"
    assert "--sharegpt-output-len" not in gsm
    assert mt["--num-prompts"] == str(len(custom_conversations("mt-bench"))) == "160"
    assert gsm["--num-prompts"] == str(len(custom_conversations("gsm8k")))
    assert mt["--tokenizer"] == "m"


# ------------------------------------------------------------------------------- (3) error cases


def _exit_message(argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return str(info.value.code)


def test_server_without_recorder_is_refused_before_any_recorder_call(tmp_path) -> None:
    with StandInSGLangServer(None) as server:
        message = _exit_message(
            ["calibrate", "--url", server.url, "-o", str(tmp_path / "r.json"), "--no-workload", "--duration", "0"]
        )
        assert server.calls == ["/server_info"]  # the real server would shut down on the start call
    assert "started without an expert-distribution recorder" in message
    assert "--expert-distribution-recorder-mode stat" in message


def test_server_that_does_not_report_its_mode_and_drops_the_start_call(tmp_path) -> None:
    with StandInSGLangServer(None, server_info={}) as server:
        message = _exit_message(
            ["calibrate", "--url", server.url, "-o", str(tmp_path / "r.json"), "--no-workload", "--duration", "0"]
        )
        assert server.calls[-1] == sc.START
    assert sc.START in message
    assert "--expert-distribution-recorder-mode stat" in message


def test_eplb_server_is_refused(tmp_path) -> None:
    info = {"expert_distribution_recorder_mode": "stat", "enable_eplb": True}
    with StandInSGLangServer(None, server_info=info) as server:
        message = _exit_message(["calibrate", "--url", server.url, "--no-workload", "--duration", "0"])
        assert sc.START not in server.calls
    assert "--enable-eplb" in message


def test_unreachable_server(tmp_path) -> None:
    server = StandInSGLangServer(None)
    url = server.url
    server.httpd.server_close()  # nothing listens there now
    message = _exit_message(["calibrate", "--url", url, "--no-workload", "--duration", "0"])
    assert "cannot reach an SGLang server at --url" in message


def test_no_dump_in_dump_dir(tmp_path, monkeypatch) -> None:
    """The server answers the dump call but nothing appears in --dump-dir (the wrong folder)."""
    info = {"expert_distribution_recorder_mode": "stat", "expert_distribution_recorder_buffer_size": -1}
    recorder = SimpleNamespace(
        mode="stat",
        recorder=SimpleNamespace(start_record=lambda: None, stop_record=lambda: None, dump_record=lambda: None),
        serve=lambda traffic: None,
    )
    with StandInSGLangServer(recorder, server_info=info) as server:
        argv = ["calibrate", "--url", server.url, "--dump-dir", str(tmp_path), "--dump-timeout", "0.2"]
        message = _exit_message([*argv, "--no-workload", "--duration", "0"])
        assert server.calls[-3:] == [sc.START, sc.STOP, sc.DUMP]
    assert f"--dump-dir {tmp_path}" in message
    assert "--from-dump" in message


def test_pruner_set_by_moe_pruner_config_json_is_warned_about(caplog) -> None:
    """``--moe-pruner-config`` JSON in the launch command turns the pruner on as ``--moe-pruner`` does.

    SGLang reports ``launch_command`` as ``" ".join(argv)`` (server_args.py, watermarking/core.py), so
    the JSON text appears unquoted; its phase overrides prune even under ``--moe-pruner none``."""
    base = ["python", "-m", "sglang.launch_server", "--model-path", "m"]
    config = json.dumps({"policy": "none", "k0": 1, "budget": 8, "verify": {"policy": "xshare-spec", "budget": 4}})

    def warnings_for(*argv: str) -> list[str]:
        caplog.clear()
        info = {
            "expert_distribution_recorder_mode": "stat",
            "expert_distribution_recorder_buffer_size": -1,
            "launch_command": " ".join([*base, *argv]),
        }
        with caplog.at_level("WARNING", logger=server_checks.__name__):
            assert sc.check_server(info, "http://x:1") == "stat"
        return [r.getMessage() for r in caplog.records]

    (message,) = warnings_for("--moe-pruner-config", json.dumps({"policy": "xshare", "k0": 2}))
    assert "pruner on (--moe-pruner-config policy xshare)" in message
    assert "biases the ranking" in message
    (message,) = warnings_for("--moe-pruner=none", f"--moe-pruner-config={config}")
    assert "pruner on (--moe-pruner-config policy xshare-spec in the verify phase)" in message
    (message,) = warnings_for("--moe-pruner-config", config, "--moe-pruner", "lynx")
    assert "(--moe-pruner lynx; --moe-pruner-config policy xshare-spec in the verify phase)" in message
    assert warnings_for("--moe-pruner-config", json.dumps({"policy": "xshare"}), "--moe-pruner", "none") == []
    assert warnings_for("--moe-pruner-config", json.dumps({"policy": "none", "decode": {"k0": 1}})) == []
    assert warnings_for("--moe-pruner-config", "'" + json.dumps({"policy": "moe-spec"}) + "'")[0].startswith(
        "the server was launched with the pruner on (--moe-pruner-config policy moe-spec)"
    )
    (message,) = warnings_for("--moe-pruner-config", "/srv/pruner.json", "--moe-pruner", "none")
    assert message.startswith(
        "cannot tell whether the server runs the pruner: --moe-pruner-config: /srv/pruner.json names a file"
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--url", "http://x:1", "--dataset", "sharegpt"], "--dataset: invalid choice: 'sharegpt' (choose from"),
        (["--url", "http://x:1", "--num-prompts", "0"], "--num-prompts 0 is invalid: must be an integer >= 1"),
        (
            ["--url", "http://x:1", "--num-prompts", "161"],
            "--num-prompts 161 is invalid: --dataset mt-bench has 160 prompts",
        ),
        (["--url", "http://x:1", "--max-concurrency", "0"], "--max-concurrency 0 is invalid"),
        (["--url", "http://x:1", "--output-len", "3"], "--output-len 3 is invalid: must be an integer >= 4"),
        (["--url", "http://x:1", "--no-workload"], "--no-workload needs --duration"),
        (["--url", "http://x:1", "--no-workload", "--duration", "-1"], "--duration -1.0 is invalid"),
        (["--url", "http://x:1", "--duration", "5"], "--duration is for --no-workload"),
        (["--url", "x:1"], "--url 'x:1' is invalid"),
        (["--from-dump", "d.pt", "--num-prompts", "3"], "--num-prompts: workload flags need --url"),
        (["--url", "http://x:1", "--from-dump", "d.pt"], "not allowed with argument"),
        ([], "one of the arguments --url --from-dump --from-trace is required"),
    ],
)
def test_bad_flags_name_the_flag(argv, needle, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["calibrate", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert needle in err
    if "--dataset" in argv:
        assert "mt-bench" in err.split("choose from")[1] and "gsm8k" in err.split("choose from")[1]


def _stat(counts) -> dict:
    return {"rank": 0, "logical_count": counts, "average_utilization_rate_over_window": None}


MALFORMED = {
    "not-torch": (None, "not a torch.save archive"),
    "not-loadable": ("zip", "the archive is damaged or cut short"),
    "a-list": ([1, 2], "holds a list, not a dict"),
    "no-counts": ({"rank": 0}, 'a stat dump has "logical_count"'),
    "1-dim": (_stat(torch.ones(8, dtype=torch.int32)), "expected 2 or 3 dims"),
    "negative": (_stat(-torch.ones(1, 3, 8, dtype=torch.int32)), "negative counts"),
    "fractional": (_stat(torch.full((1, 3, 8), 0.5)), "not whole numbers"),
    "not-a-tensor": (_stat([[1, 2]]), "not a tensor"),
    "record-shape": (
        {
            "records": [{"global_physical_count": torch.ones(3, 9, dtype=torch.int32)}],
            "last_physical_to_logical_map": torch.zeros(3, 10, dtype=torch.int64),
        },
        "has shape [3, 9], the physical-to-logical map [3, 10]",
    ),
    "no-map": ({"records": []}, '"last_physical_to_logical_map" must be'),
    "all-zero": (_stat(torch.zeros(4, 3, 8, dtype=torch.int32)), "counted no expert selection"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_dumps_are_refused(name, tmp_path, capsys) -> None:
    content, needle = MALFORMED[name]
    path = tmp_path / "expert_distribution_recorder_1.0.pt"
    if content is None:
        path.write_text("not a torch file")
    elif content == "zip":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("data.txt", "a zip archive, but not one torch.save wrote")
    else:
        torch.save(content, path)
    out = tmp_path / "r.json"
    argv = ["calibrate", "--from-dump", str(path), "-o", str(out)]
    if content is None or content == "zip":  # not an archive torch can read: a bad input file, exit 2
        assert main(argv) == 2
        message = capsys.readouterr().err
    else:
        message = _exit_message(argv)
    assert needle in message
    assert not out.exists()
    assert list(tmp_path.glob(".r.json*")) == []


def test_dumps_of_different_models_are_not_summed(tmp_path) -> None:
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save(_stat(torch.ones(1, 3, 8, dtype=torch.int32)), a)
    torch.save(_stat(torch.ones(1, 4, 8, dtype=torch.int32)), b)
    message = _exit_message(["calibrate", "--from-dump", str(a), str(b), "-o", str(tmp_path / "r.json")])
    assert "cannot be summed" in message


def test_from_dump_folder_without_dumps(tmp_path) -> None:
    (tmp_path / "other.pt").write_text("")
    assert "holds no expert_distribution_recorder_*.pt" in _exit_message(["calibrate", "--from-dump", str(tmp_path)])
    assert "no such file or folder" in _exit_message(["calibrate", "--from-dump", str(tmp_path / "missing")])


def test_hand_written_stat_dump_in_sglangs_layout(tmp_path) -> None:
    """Without SGLang: a stat dump as _StatAccumulator.dump writes it (expert_distribution.py:998-1006),
    ``logical_count`` [passes, layers, experts], summed over passes; 2-dim counts are read as one pass."""
    passes = torch.tensor(
        [[[0] * 8, [1, 0, 2, 0, 0, 0, 0, 3], [0, 0, 0, 0, 5, 0, 0, 0]], [[0] * 8] * 3, [[0] * 8, [1] * 8, [0] * 8]]
    )
    torch.save(_stat(passes.to(torch.int32)), tmp_path / "expert_distribution_recorder_5.5.pt")
    torch.save(_stat(passes.sum(0)), tmp_path / "expert_distribution_recorder_2.0.pt")  # older: not picked
    counts = rd.read_dump(rd.dump_paths(tmp_path))
    assert counts.files == (tmp_path / "expert_distribution_recorder_5.5.pt",)
    assert counts.counts.tolist() == passes.sum(0).tolist()
    assert counts.forward_passes == 2
    two_dim = rd.read_dump([tmp_path / "expert_distribution_recorder_2.0.pt"])
    assert two_dim.counts.tolist() == passes.sum(0).tolist()
    assert counts.top_share(2) == {1: (4 + 3) / 14, 2: 1.0}
    assert counts.counted_layers() == [1, 2]
