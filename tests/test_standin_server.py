"""The SGLang stand-in (``tests/standin_server.py``, a test double, not SGLang): SGLang's real benchmark
and few-shot GSM8K clients run against it unchanged, and its failure modes, proof line, metrics and
shutdown behave as documented.  Each stand-in is a subprocess listening on a port of its own choosing
(``--port 0``), read back from its ``Uvicorn running on`` line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.standin_server import (
    PROOF_HOOKS,
    PROOF_PREFIX,
    PRUNER_ENV_VAR,
    READY_LINE,
    STANDIN_ACCEPT_LENGTH,
    STANDIN_ACTIVATED_EXPERTS,
    STANDIN_CRASH_EXIT_CODE,
    STANDIN_EXIT_CODE,
    STANDIN_KEPT_EXPERTS,
    STANDIN_LAYERS,
    STANDIN_PRUNED_ACCEPT_LENGTH,
    STANDIN_RETAINED_SCORE_MASS,
    STANDIN_TOKEN,
    answers_wrongly,
    build_parser,
    expected_gsm8k_accuracy,
    pruner_policies,
    resolve_pruner,
    token_delay_s,
)

ROOT = Path(__file__).resolve().parent.parent
STANDIN = ROOT / "tests" / "standin_server.py"
TINY = ROOT / "xshare_sglang" / "data" / "tiny_moe"
GSM8K = ROOT / "xshare_sglang" / "data" / "eval_sets" / "gsm8k_test.jsonl"
PRUNER_JSON = '{"policy":"xshare","budget":8}'
_LISTENING = re.compile(r"Uvicorn running on http://[^:]+:(\d+)")
_PROOF = re.compile(re.escape(PROOF_PREFIX) + r"(\S+)")


class Standin:
    """One stand-in subprocess with its log in a file."""

    def __init__(self, log_dir: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        environ = {k: v for k, v in os.environ.items() if k != PRUNER_ENV_VAR}
        environ.update(env or {})
        self.log_path = log_dir / f"standin-{time.monotonic_ns()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop())
        argv = [sys.executable, str(STANDIN), "--model-path", str(TINY), "--host", "127.0.0.1", "--port", "0", *flags]
        self.proc = subprocess.Popen(
            argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=environ, cwd=ROOT
        )
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def wait_ready(self, timeout: float = 20.0) -> Standin:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()
            found = _LISTENING.search(text)
            if found and READY_LINE in text:
                self.port = int(found.group(1))
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"stand-in exited with {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise AssertionError(f"stand-in not ready within {timeout} s:\n{self.log()}")

    def wait_exit(self, timeout: float = 10.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._log.close()


def http(method: str, url: str, body: object | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def generate(server: Standin, body: dict) -> object:
    status, raw = http("POST", server.url + "/generate", body)
    assert status == 200, raw
    return json.loads(raw)


def gsm8k_prompt(index: int, shots: int = 2) -> str:
    """The prompt SGLang's few-shot GSM8K client sends for question ``index``."""
    lines = [json.loads(line) for line in GSM8K.read_text(encoding="utf-8").splitlines()[: max(index, shots) + 1]]
    examples = "".join(f"Question: {lines[i]['question']}\nAnswer: {lines[i]['answer']}\n\n" for i in range(shots))
    return examples + f"Question: {lines[index]['question']}\nAnswer:"


def reference(index: int) -> int:
    line = GSM8K.read_text(encoding="utf-8").splitlines()[index]
    return int(json.loads(line)["answer"].rsplit("####", 1)[-1].strip().replace(",", ""))


def final_number(text: str) -> int | None:
    numbers = re.findall(r"\d+", text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


def pruner_samples(metrics_text: str) -> dict[str, dict[str, float]]:
    """gauge name -> {layer: value} of the ``moe_pruner:*`` series on a ``/metrics`` page."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name.startswith("moe_pruner:") and "layer" in sample.labels:
                out.setdefault(sample.name, {})[sample.labels["layer"]] = sample.value
    return out


@pytest.fixture(scope="module")
def pruned(tmp_path_factory):
    """A pruned, speculative stand-in with metrics, started with flags SGLang takes and it ignores."""
    server = Standin(
        tmp_path_factory.mktemp("pruned"),
        *("--tp", "1", "--mem-fraction-static", "0.5", "--trust-remote-code"),
        *("--moe-pruner-config", PRUNER_JSON, "--moe-pruner-log-interval", "50"),
        *("--speculative-algorithm", "EAGLE", "--enable-metrics"),
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An unpruned stand-in that answers every 5th GSM8K question wrongly (every 2nd if it were pruned)."""
    server = Standin(
        tmp_path_factory.mktemp("baseline"), "--standin-wrong-every", "5", "--standin-pruned-wrong-every", "2"
    )
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture
def standin(tmp_path):
    """Start stand-ins for one test; all are stopped at its end."""
    started: list[Standin] = []

    def start(*flags: str, env: dict[str, str] | None = None, ready: bool = True) -> Standin:
        server = Standin(tmp_path, *flags, env=env)
        started.append(server)
        return server.wait_ready() if ready else server

    yield start
    for server in started:
        server.stop()


# ------------------------------------------------------------------------------- the real clients
@pytest.mark.sglang
def test_benchmark_client_runs_unchanged(pruned, tmp_path):
    output = tmp_path / "serving.jsonl"
    argv = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        *("--backend", "sglang", "--base-url", pruned.url),
        *("--dataset-name", "random-ids", "--random-input-len", "32", "--random-output-len", "16"),
        *("--random-range-ratio", "1.0", "--num-prompts", "8", "--max-concurrency", "4"),
        *("--tokenizer", str(TINY), "--model", str(TINY), "--output-file", str(output)),
        *("--seed", "0", "--warmup-requests", "1", "--disable-tqdm"),
    ]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 1
    row = rows[0]
    assert row["completed"] == 8
    assert row["total_output_tokens"] == 8 * 16
    assert row["total_output_tokens_retokenized"] == 8 * 16  # STANDIN_TOKEN is one token of the tiny tokenizer
    assert row["total_input_tokens"] == 8 * 32
    assert row["output_throughput"] > 0
    assert row["accept_length"] == STANDIN_PRUNED_ACCEPT_LENGTH
    assert row["server_info"]["standin"] is True
    assert row["server_info"]["internal_states"][0]["avg_spec_accept_length"] == STANDIN_PRUNED_ACCEPT_LENGTH
    # the warm-up and the 8 measured requests were streamed /generate requests
    assert pruned.log().count('"POST /generate HTTP/1.1" 200') >= 9


@pytest.mark.sglang
def test_few_shot_gsm8k_client_runs_unchanged(baseline, tmp_path):
    argv = [
        sys.executable,
        "-m",
        "sglang.test.few_shot_gsm8k",
        *("--host", "127.0.0.1", "--port", str(baseline.port), "--data-path", str(GSM8K)),
        *("--num-questions", "20", "--num-shots", "2", "--parallel", "4"),
    ]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert expected_gsm8k_accuracy(20, 5) == 0.8  # questions 0, 5, 10 and 15 are answered wrongly
    assert "Accuracy: 0.800" in done.stdout
    assert "Invalid: 0.000" in done.stdout
    assert (tmp_path / "tmp_output_gsm8k.txt").is_file()


# ------------------------------------------------------------------------------ proof and metrics
def test_pruned_standin_prints_one_proof_line(pruned):
    lines = [line for line in pruned.log().splitlines() if PROOF_PREFIX in line]
    assert len(lines) == 1, lines
    assert _PROOF.findall(lines[0]) == ["xshare"]
    assert "config=policy=xshare budget=8 log_interval=50 " in lines[0]
    assert f"layers={STANDIN_LAYERS} hooks=[{', '.join(PROOF_HOOKS)}]" in lines[0]
    assert pruned.log().index(lines[0]) < pruned.log().index(READY_LINE)


def test_pruner_gauges_appear_after_a_request(standin):
    pytest.importorskip("prometheus_client")
    server = standin("--moe-pruner", "topk", "--enable-metrics")
    status, page = http("GET", server.url + "/metrics")
    assert status == 200
    assert pruner_samples(page.decode()) == {}
    assert "sglang:num_running_reqs" in page.decode()
    generate(server, {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    status, page = http("GET", server.url + "/metrics")
    samples = pruner_samples(page.decode())
    assert samples == {
        "moe_pruner:activated_experts": {str(i): v for i, v in enumerate(STANDIN_ACTIVATED_EXPERTS)},
        "moe_pruner:kept_experts": {str(i): v for i, v in enumerate(STANDIN_KEPT_EXPERTS)},
        "moe_pruner:retained_score_mass": {str(i): v for i, v in enumerate(STANDIN_RETAINED_SCORE_MASS)},
    }
    assert 'moe_pruner:activated_experts{layer="0",tp_rank="0"} 10.0' in page.decode()


def test_baseline_has_no_proof_no_gauges_no_accept_length(baseline, standin):
    assert PROOF_PREFIX not in baseline.log()
    assert http("GET", baseline.url + "/metrics")[0] == 404  # no --enable-metrics, as in SGLang
    info = json.loads(http("GET", baseline.url + "/server_info")[1])
    assert info["standin"] is True and info["version"]
    assert "avg_spec_accept_length" not in info["internal_states"][0]
    unpruned = standin("--enable-metrics", "--speculative-algorithm", "EAGLE", "--moe-pruner", "none")
    generate(unpruned, {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert "moe_pruner:" not in http("GET", unpruned.url + "/metrics")[1].decode()
    assert PROOF_PREFIX not in unpruned.log()
    info = json.loads(http("GET", unpruned.url + "/get_server_info")[1])
    assert info["internal_states"][0]["avg_spec_accept_length"] == STANDIN_ACCEPT_LENGTH


def test_no_proof_is_a_plugin_that_did_not_load(standin):
    server = standin("--moe-pruner", "topk", "--standin-no-proof", "--enable-metrics")
    generate(server, {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
    assert PROOF_PREFIX not in server.log()
    assert "moe_pruner:" not in http("GET", server.url + "/metrics")[1].decode()


def test_pruner_configuration_sources():
    parser = build_parser()

    def policies(argv: list[str], environ: dict[str, str] | None = None) -> list[str]:
        args, extra = parser.parse_known_args(["--model-path", "m", *argv])
        return pruner_policies(resolve_pruner(args, extra, environ or {}))

    assert policies([]) == []
    assert policies(["--moe-pruner", "none", "--tp", "2"]) == []
    assert policies(["--moe-pruner-config", PRUNER_JSON]) == ["xshare"]
    assert policies([], {PRUNER_ENV_VAR: '{"policy": "lynx"}'}) == ["lynx"]
    assert policies(["--moe-pruner", "none"], {PRUNER_ENV_VAR: '{"policy": "lynx"}'}) == []
    assert policies(["--moe-pruner-config", '{"policy": "none", "decode": {"policy": "topk"}}']) == ["topk"]
    args, extra = parser.parse_known_args(["--model", "m", "--moe-pruner", "topk", "--moe-pruner-k=3", "--x", "1"])
    assert resolve_pruner(args, extra, {}) == {"policy": "topk", "k": 3}


# --------------------------------------------------------------------------------- failure modes
def test_fail_exit_exits_with_code_3(standin):
    server = standin("--moe-pruner", "topk", "--standin-fail", "exit", ready=False)
    assert server.wait_exit() == STANDIN_EXIT_CODE == 3
    assert "stand-in launch failure" in server.log()
    assert READY_LINE not in server.log()


def test_fail_no_health_answers_503(standin):
    server = standin("--standin-fail", "no-health")
    assert http("GET", server.url + "/health")[0] == 503
    assert http("GET", server.url + "/health_generate")[0] == 503
    assert http("GET", server.url + "/v1/models")[0] == 200
    assert generate(server, {"text": "hi", "sampling_params": {"max_new_tokens": 1}})["text"] == STANDIN_TOKEN


def test_fail_crash_during_bench_exits_after_n_requests(standin):
    server = standin("--standin-fail", "crash-during-bench", "--standin-crash-after", "2")
    for _ in range(2):
        assert (
            generate(server, {"text": "hi", "sampling_params": {"max_new_tokens": 2}})["meta_info"]["completion_tokens"]
            == 2
        )
    assert server.wait_exit() == STANDIN_CRASH_EXIT_CODE
    with pytest.raises(OSError):  # URLError: connection refused
        http("POST", server.url + "/generate", {"text": "hi"}, timeout=2)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_zero_promptly(standin, signum):
    server = standin()
    started = time.monotonic()
    server.proc.send_signal(signum)
    assert server.wait_exit(timeout=5) == 0
    assert time.monotonic() - started < 3
    assert f"Received {signum.name}" in server.log()


# ---------------------------------------------------------------------------------------- endpoints
def test_info_endpoints(baseline):
    assert http("GET", baseline.url + "/health")[0] == 200
    assert http("GET", baseline.url + "/health_generate")[0] == 200
    for path in ("/get_model_info", "/model_info"):
        info = json.loads(http("GET", baseline.url + path)[1])
        assert info["model_path"] == str(TINY) and info["tokenizer_path"] == str(TINY)
        assert info["is_generation"] is True
    models = json.loads(http("GET", baseline.url + "/v1/models")[1])
    assert models["data"][0]["id"] == str(TINY)
    assert http("GET", baseline.url + "/flush_cache")[0] == 200
    assert http("POST", baseline.url + "/flush_cache?timeout=60")[0] == 200
    assert http("GET", baseline.url + "/no_such_endpoint")[0] == 404
    assert http("GET", baseline.url + "/generate")[0] == 405
    assert http("POST", baseline.url + "/generate", {"sampling_params": {}})[0] == 400


def test_generate_answers_gsm8k_questions(baseline, standin):
    stops = ["Question", "Assistant:", "<|separator|>"]
    pruned = standin("--moe-pruner", "topk", "--standin-wrong-every", "5", "--standin-pruned-wrong-every", "2")
    # baseline: wrong when index % 5 == 0; pruned: wrong when index % 2 == 0
    for index, baseline_right, pruned_right in [
        (2, True, False),
        (3, True, True),
        (5, False, True),
        (10, False, False),
    ]:
        for server, right in ((baseline, baseline_right), (pruned, pruned_right)):
            out = generate(
                server, {"text": gsm8k_prompt(index), "sampling_params": {"max_new_tokens": 512, "stop": stops}}
            )
            assert (final_number(out["text"]) == reference(index)) is right, (index, out)
            assert "Question" not in out["text"]
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": "Question"}
    assert answers_wrongly(5, 5) and not answers_wrongly(2, 5) and not answers_wrongly(0, 0)
    # max_new_tokens cuts the answer
    out = generate(baseline, {"text": gsm8k_prompt(3), "sampling_params": {"max_new_tokens": 3, "stop": stops}})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert out["meta_info"]["completion_tokens"] == 3 and len(out["text"].split()) == 3
    # without stop strings the answer runs on to EOS
    out = generate(baseline, {"text": gsm8k_prompt(3), "sampling_params": {"max_new_tokens": 512}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 0}
    assert out["text"].endswith("\n\nQuestion:") and final_number(out["text"]) == reference(3)
    # an unknown question gets no number at all
    out = generate(
        baseline, {"text": "Question: How many legs has a cat?\nAnswer:", "sampling_params": {"stop": stops}}
    )
    assert final_number(out["text"]) is None
    # a prefix-caching request (max_new_tokens 0) and a batch
    assert generate(baseline, {"text": "abc", "sampling_params": {"max_new_tokens": 0}})["text"] == ""
    outs = generate(baseline, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}})
    assert [o["text"] for o in outs] == [STANDIN_TOKEN * 2] * 2


def test_stream_is_read_by_aiohttp(pruned):
    aiohttp = pytest.importorskip("aiohttp")
    import asyncio

    async def read() -> list[bytes]:
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 7, "ignore_eos": True}, "stream": True}
        async with aiohttp.ClientSession() as session, session.post(pruned.url + "/generate", json=body) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            return [line.strip() async for line in response.content if line.strip()]

    lines = asyncio.run(read())
    assert lines[-1] == b"data: [DONE]"
    events = [json.loads(line[len(b"data: ") :]) for line in lines[:-1]]
    assert [e["meta_info"]["completion_tokens"] for e in events] == list(range(1, 8))
    assert [e["text"] for e in events] == [STANDIN_TOKEN * n for n in range(1, 8)]
    assert events[0]["meta_info"]["prompt_tokens"] == 3
    last = events[-1]["meta_info"]
    assert last["finish_reason"] == {"type": "length", "length": 7}
    assert last["spec_verify_ct"] == round(7 / STANDIN_PRUNED_ACCEPT_LENGTH)
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


# ------------------------------------------------------------------------------------ pure helpers
def test_token_delay():
    assert token_delay_s(2.0, 0, 16, 1.25, pruned=False) == pytest.approx(0.002)
    assert token_delay_s(2.0, 16, 16, 1.25, pruned=False) == pytest.approx(0.004)
    assert token_delay_s(2.0, 16, 16, 1.25, pruned=True) == pytest.approx(0.004 / 1.25)


def test_filler_is_one_token_of_the_tiny_tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_file(str(TINY / "tokenizer.json"))
    assert len(tokenizer.encode(STANDIN_TOKEN * 16, add_special_tokens=False).ids) == 16
