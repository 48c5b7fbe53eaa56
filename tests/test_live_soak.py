"""A bounded soak of one real ``sglang.launch_server`` with the plugin (CPU engine, shipped tiny MoE).

One server with the pruner settings of ``make serve-cpu`` and ``--enable-metrics`` takes 30 s of
mixed traffic from a thread pool: ``/generate`` and ``/v1/completions`` with prompts of mixed lengths
(the held-out texts of the tiny model, cut), greedy and sampled, ``n`` of 2 and 3, log-probabilities,
stop strings, streams read to the end, streams the client closes after a few chunks, and requests
SGLang itself validates and answers with 400.  Two requests are never sent, because they take down
SGLang 0.5.23 with or without the plugin (docs/cpu-server.md): an empty ``text`` on ``/generate`` and
``input_ids`` outside the vocabulary.

At the end the server must be alive and answer, no selection may have fallen back, the plugin's
counters must agree with SGLang's own (every decode forward SGLang ran was a pruned forward of the
plugin; every layer's pruned calls equal the forwards of the reports so far), the aborts and the
400s must be the ones sent, and the log written during the soak must hold no traceback and none of
the plugin's fault lines.  The figures are recorded as test properties (``record_property``) and
printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from tests.live_server import SERVE_CPU_FLAGS, SERVE_CPU_LOG_INTERVAL, LiveServer
from xshare_sglang.tiny.tiny_demo import heldout_texts
from xshare_sglang.tiny.tiny_model import tiny_model_dir

pytestmark = pytest.mark.soak

LOG_INTERVAL = SERVE_CPU_LOG_INTERVAL
#: ``make serve-cpu``'s pruner flags; a KV pool large enough that no request is ever retracted
#: (a retracted request's tokens after its second prefill are not decode tokens).
FLAGS = [*SERVE_CPU_FLAGS, "--max-total-tokens", "16384"]
CONCURRENCY = 12
TRAFFIC_S = 30.0  # no request starts after this: every kind is sent many times over (the figures say how often)
REQUEST_TIMEOUT_S = 90.0
SEED = 34
#: share of each kind in the plan
MIX = {
    "generate": 5,
    "completion": 2,
    "n": 3,
    "logprob": 3,
    "stop": 3,
    "stream": 2,
    "stream_abort": 3,
    "bad": 3,
}
PROMPT_CHARS = (6, 24, 80, 200, 400, 700)
STOPS = (["\n\n"], ["the", "of"], [")"], ["\n", ":"], ["Answer"])
#: bodies SGLang 0.5.23 validates and refuses with 400 (checked on this server; ``n`` 0 and
#: ``logprobs`` -1 are not refused and are left out).  They are sent sampled: a greedy request
#: (temperature 0) has its ``top_k`` set to 1 before validation, so ``top_k`` 0 would pass.
BAD_GENERATE = (
    {"max_new_tokens": -1},
    {"temperature": -1.0},
    {"top_p": 0.0},
    {"top_p": 1.5},
    {"top_k": 0},
    {"min_p": 1.5},
    {"repetition_penalty": 3.0},
    {"frequency_penalty": 3.0},
    {"presence_penalty": -3.0},
    {"min_new_tokens": 10, "max_new_tokens": 5},
)
BAD_COMPLETION = ({"max_tokens": -1}, {"temperature": -1.0}, {"top_p": 1.5})
#: the plugin's fault wording (``PrunerRuntime.record_fault``, the trace recorder, the metrics
#: reporter's unpruned-layer warning)
PLUGIN_FAULTS = ("selection failed in", "routing left unpruned", "trace recording stopped", "ran no pruned call")


@dataclass
class Outcome:
    """What one request of the plan came to."""

    kind: str
    status: str  # answered, aborted, rejected, skipped, error
    detail: str = ""
    tokens: list[int] = field(default_factory=list)  # completion tokens of each answered sequence


class Plan:
    """The soak's requests, drawn from a fixed seed."""

    def __init__(self, seed: int = SEED) -> None:
        self.rng = random.Random(seed)
        self.texts = [t for d in ("code", "math", "prose") for t in heldout_texts(tiny_model_dir(), d)]

    def prompt(self) -> str:
        text = self.rng.choice(self.texts)
        return text[: self.rng.choice(PROMPT_CHARS)]

    def jobs(self, count: int) -> list[tuple[str, dict]]:
        """``count`` requests: one of each kind first, in a shuffled order (so a slow machine that
        gets through few requests in the minute still sends every kind), then the weighted mix."""
        first = list(MIX)
        self.rng.shuffle(first)
        kinds = [kind for kind, weight in MIX.items() for _ in range(weight)]
        drawn = first[:count] + [self.rng.choice(kinds) for _ in range(count - len(first))]
        return [(kind, self.body(kind)) for kind in drawn]

    def body(self, kind: str) -> dict:
        rng = self.rng
        new_tokens = rng.randint(4, 40)
        sampling = {"max_new_tokens": new_tokens, "temperature": rng.choice([0.0, 0.7]), "ignore_eos": True}
        if kind == "generate":
            return {"text": self.prompt(), "sampling_params": {**sampling, "ignore_eos": rng.random() < 0.5}}
        if kind == "completion":
            return {"model": "default", "prompt": self.prompt(), "max_tokens": new_tokens, "ignore_eos": True}
        if kind == "n":
            n = rng.choice([2, 3])
            if rng.random() < 0.5:
                return {"text": self.prompt(), "sampling_params": {**sampling, "temperature": 0.8, "n": n}}
            return {"model": "default", "prompt": self.prompt(), "max_tokens": new_tokens, "n": n, "temperature": 0.8}
        if kind == "logprob":
            return {
                "text": self.prompt(),
                "sampling_params": sampling,
                "return_logprob": True,
                "top_logprobs_num": rng.choice([0, 3]),
                "logprob_start_len": rng.choice([-1, 0]),
            }
        if kind == "stop":
            stop = rng.choice(STOPS)
            return {"text": self.prompt(), "sampling_params": {**sampling, "ignore_eos": False, "stop": stop}}
        if kind == "stream":
            return {"text": self.prompt(), "stream": True, "sampling_params": sampling}
        if kind == "stream_abort":
            long = {**sampling, "max_new_tokens": 256, "temperature": 0.0}
            return {"text": self.prompt(), "stream": True, "sampling_params": long}
        if kind == "bad":
            if rng.random() < 0.7:
                bad = {**sampling, "temperature": 0.7, **rng.choice(BAD_GENERATE)}
                return {"text": self.prompt(), "sampling_params": bad}
            bad = {"temperature": 0.7, **rng.choice(BAD_COMPLETION)}
            return {"model": "default", "prompt": self.prompt(), "max_tokens": new_tokens, **bad}
        raise ValueError(kind)


def send(url: str, kind: str, body: dict, deadline: float) -> Outcome:
    """Send one request of the plan and check its answer; never raises."""
    if time.monotonic() > deadline:
        return Outcome(kind, "skipped")
    try:
        if kind == "stream_abort":
            return _stream(url, kind, body, abort_after=3)
        if kind == "stream":
            return _stream(url, kind, body)
        endpoint = "/v1/completions" if "prompt" in body else "/generate"
        response = requests.post(url + endpoint, json=body, timeout=REQUEST_TIMEOUT_S)
        if kind == "bad":
            if response.status_code == 400:
                return Outcome(kind, "rejected")
            detail = f"expected 400, got {response.status_code} for {_settings(body)}: {response.text[:200]}"
            return Outcome(kind, "error", detail)
        if response.status_code != 200:
            return Outcome(kind, "error", f"{response.status_code} for {_settings(body)}: {response.text[:300]}")
        answer = response.json()
        if endpoint == "/v1/completions":
            return _check_completion(kind, body, answer)
        return _check_generate(kind, body, answer)
    except Exception as exc:  # reported as an error outcome, asserted on at the end
        return Outcome(kind, "error", f"{type(exc).__name__} for {_settings(body)}: {exc}")


def _settings(body: dict) -> dict:
    """A request body without its prompt, for error messages."""
    return {key: value for key, value in body.items() if key not in ("text", "prompt")}


def _check_generate(kind: str, body: dict, answer) -> Outcome:
    sampling = body["sampling_params"]
    answers = answer if isinstance(answer, list) else [answer]
    if len(answers) != sampling.get("n", 1):
        return Outcome(kind, "error", f"{len(answers)} answers for n={sampling.get('n', 1)}")
    tokens = []
    for one in answers:
        meta = one["meta_info"]
        count = meta["completion_tokens"]
        if not 1 <= count <= sampling["max_new_tokens"]:
            return Outcome(kind, "error", f"{count} tokens for max_new_tokens={sampling['max_new_tokens']}")
        if sampling.get("ignore_eos") and "stop" not in sampling and count != sampling["max_new_tokens"]:
            return Outcome(
                kind, "error", f"{count} tokens, ignore_eos with max_new_tokens={sampling['max_new_tokens']}"
            )
        if body.get("return_logprob") and len(meta["output_token_logprobs"]) != count:
            return Outcome(kind, "error", f"{len(meta['output_token_logprobs'])} logprobs for {count} tokens")
        if "stop" in sampling:
            # a stop string, or the end-of-sequence token (``matched`` is then its id)
            reason = meta["finish_reason"]
            matched = reason.get("matched")
            if reason["type"] not in ("stop", "length") or (
                reason["type"] == "stop" and not (matched in sampling["stop"] or isinstance(matched, int))
            ):
                return Outcome(kind, "error", f"finish_reason {reason} for stop {sampling['stop']}")
        tokens.append(count)
    return Outcome(kind, "answered", tokens=tokens)


def _check_completion(kind: str, body: dict, answer: dict) -> Outcome:
    n = body.get("n", 1)
    if len(answer["choices"]) != n:
        return Outcome(kind, "error", f"{len(answer['choices'])} choices for n={n}")
    if body.get("ignore_eos"):
        if answer["usage"]["completion_tokens"] != n * body["max_tokens"]:
            return Outcome(kind, "error", f"usage {answer['usage']} for n={n} max_tokens={body['max_tokens']}")
        return Outcome(kind, "answered", tokens=[body["max_tokens"]] * n)
    # sampled choices may end early at the end-of-sequence token: only their sum is known
    total = answer["usage"]["completion_tokens"]
    if not n <= total <= n * body["max_tokens"]:
        return Outcome(kind, "error", f"usage {answer['usage']} for n={n} max_tokens={body['max_tokens']}")
    return Outcome(kind, "answered", tokens=[1] * n)  # at least one token each: a safe lower bound


def _stream(url: str, kind: str, body: dict, abort_after: int | None = None) -> Outcome:
    """Read a ``/generate`` stream; with ``abort_after``, close the connection after that many chunks."""
    chunks, last = 0, None
    with requests.post(url + "/generate", json=body, stream=True, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            return Outcome(kind, "error", f"{response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith(b"data: "):
                continue
            payload = line[len(b"data: ") :]
            if payload == b"[DONE]":
                break
            last = json.loads(payload)
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                if last["meta_info"]["finish_reason"] is not None:
                    return Outcome(kind, "error", "the stream finished before it was closed")
                return Outcome(kind, "aborted")  # leaving the block closes the connection
    if last is None:
        return Outcome(kind, "error", "an empty stream")
    count = last["meta_info"]["completion_tokens"]
    if count != body["sampling_params"]["max_new_tokens"]:
        return Outcome(kind, "error", f"stream ended after {count} tokens")
    return Outcome(kind, "answered", tokens=[count])


def scrape(url: str) -> dict[str, list[tuple[dict, float]]]:
    """Every sample on ``/metrics``: name -> [(labels, value)]."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(requests.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(samples: dict, name: str, **match) -> float:
    """Sum of the samples of ``name`` whose labels include ``match`` (a callable value tests the label)."""

    def fits(labels: dict) -> bool:
        return all(
            value(labels.get(key)) if callable(value) else labels.get(key) == value for key, value in match.items()
        )

    return sum(value for labels, value in samples.get(name, []) if fits(labels))


def wait_idle(url: str, timeout_s: float = 60.0) -> dict:
    """Scrape ``/metrics`` until SGLang runs and queues no request (aborts land a moment later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        busy = total(samples, "sglang:num_running_reqs") + total(samples, "sglang:num_queue_reqs")
        if busy == 0 or time.monotonic() > deadline:
            time.sleep(1.0)  # let the last result's counters land
            return scrape(url)
        time.sleep(0.5)


def tree_rss_mib(pid: int) -> dict[str, float]:
    """Resident memory of a process and all its descendants, in MiB, by process name (psutil, else
    ``/proc`` by the process group the server was started in)."""
    rss: Counter[str] = Counter()
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                rss[proc.name()] += proc.memory_info().rss / 2**20
        return {name: round(value, 1) for name, value in rss.items()}
    page_mib = os.sysconf("SC_PAGE_SIZE") / 2**20
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            head, tail = stat.read_text().rsplit(")", 1)
            if int(tail.split()[2]) == pid:  # the process group
                rss[head.split("(", 1)[1]] += int((stat.parent / "statm").read_text().split()[1]) * page_mib
    return {name: round(value, 1) for name, value in rss.items()}


def test_soak(tmp_path, record_property) -> None:
    # the server's environment is the one of `make serve-cpu`: without the TRITON_INTERPRET=1 that
    # conftest sets for the kernel tests, selection runs the torch reference on CPU instead of the
    # Triton interpreter (same masks, and about four times the traffic in the same time)
    started = time.monotonic()
    server = LiveServer(FLAGS, tmp_path / "server.log", interpreter=False).start()
    try:
        _soak(server, started, record_property)
    finally:
        server.stop()


def _soak(server: LiveServer, started: float, record_property) -> None:
    ready_s = time.monotonic() - started
    log_offset = len(server.log())
    rss_start = tree_rss_mib(server.process.process.pid)
    deadline = time.monotonic() + TRAFFIC_S
    jobs = Plan().jobs(2000)  # more than the traffic time can send: the deadline ends the traffic
    traffic_start = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outcomes = list(pool.map(lambda job: send(server.url, job[0], job[1], deadline), jobs))
    traffic_s = time.monotonic() - traffic_start
    samples = wait_idle(server.url)

    sent = Counter(o.kind for o in outcomes if o.status != "skipped")
    by_status = Counter(o.status for o in outcomes)
    errors = [f"{o.kind}: {o.detail}" for o in outcomes if o.status == "error"]
    sequences = [count for o in outcomes for count in o.tokens]
    pruned = total(samples, "moe_pruner:pruned_forwards_total")
    fallbacks = total(samples, "moe_pruner:selection_fallbacks_total")
    decode_passes = total(samples, "sglang:cuda_graph_passes_total", mode=lambda m: str(m).startswith("decode"))
    decode_tokens = total(samples, "sglang:realtime_tokens_total", mode="decode")
    layer_calls = {labels["layer"]: value for labels, value in samples.get("moe_pruner:layer_calls_total", [])}
    aborted_by_sglang = total(samples, "sglang:num_aborted_requests_total")
    refused_by_sglang = total(
        samples,
        "sglang:http_responses_total",
        status_code="400",
        endpoint=lambda e: e in ("/generate", "/v1/completions"),
    )
    figures = {
        "sent": dict(sorted(sent.items())),
        "sent_total": sum(sent.values()),
        "answered": by_status["answered"],
        "aborted": by_status["aborted"],
        "rejected_400": by_status["rejected"],
        "errors": len(errors),
        "sequences": len(sequences),
        "longest_sequence": max(sequences, default=0),
        "pruned_forwards": pruned,
        "sglang_decode_passes": decode_passes,
        "sglang_decode_tokens": decode_tokens,
        "layer_calls": layer_calls,
        "fallbacks": fallbacks,
        "server_ready_s": round(ready_s, 1),
        "traffic_s": round(traffic_s, 1),
        "rss_start_mib": round(sum(rss_start.values()), 1),
        "rss_start_by_process": rss_start,
    }

    # alive and answering
    assert server.alive(), server.log()[-3000:]
    check = server.generate("def add(a, b):", 8)
    assert check["meta_info"]["completion_tokens"] == 8
    rss_end = tree_rss_mib(server.process.process.pid)
    figures["rss_end_mib"] = round(sum(rss_end.values()), 1)
    figures["rss_end_by_process"] = rss_end
    figures["wall_s"] = round(time.monotonic() - started, 1)
    for name, value in figures.items():
        record_property(name, value)
    print("soak figures:", json.dumps(figures))

    assert not errors, errors[:10]
    assert by_status["answered"] > 0 and by_status["aborted"] > 0 and by_status["rejected"] > 0, figures
    assert set(sent) == set(MIX), f"a kind was never sent: {sent}"
    # the plugin's counters against SGLang's own
    assert fallbacks == 0, figures
    assert pruned == decode_passes, f"pruned forwards {pruned} != SGLang's decode forwards {decode_passes}"
    # a sequence of N tokens took N - 1 decode steps (its first token comes from its prefill)
    assert pruned >= max(sequences) - 1, figures
    # every decode forward produced at least one token; every answered sequence's decode steps
    # produced one each (aborted streams add theirs on top)
    assert decode_tokens >= pruned, figures
    assert decode_tokens >= sum(count - 1 for count in sequences), figures
    reported = LOG_INTERVAL * math.floor(pruned / LOG_INTERVAL)
    assert layer_calls == {layer: reported for layer in ("0", "1", "2", "3")}, figures
    assert aborted_by_sglang == by_status["aborted"], f"SGLang counted {aborted_by_sglang} aborts: {figures}"
    assert refused_by_sglang == by_status["rejected"], f"SGLang answered {refused_by_sglang} 400s: {figures}"
    # no traceback while serving (SGLang's start-up may log one for its own freeze_gc call), no plugin fault
    served_log = server.log()[log_offset:]
    assert "Traceback" not in served_log, served_log[served_log.find("Traceback") - 500 :][:4000]
    faults = [line for line in server.log().splitlines() if any(text in line for text in PLUGIN_FAULTS)]
    assert not faults, faults[:5]
