"""A STAND-IN for an SGLang server, for tests only.  This is NOT SGLang and runs no model.

It is a small stdlib HTTP server that answers the few endpoints SGLang's own clients use, so that
``python -m sglang.benchmark.serving --backend sglang`` and ``python -m sglang.test.few_shot_gsm8k``
run against it unchanged, and the A/B orchestrator (``xshare_sglang/serving/ab_*.py``) can launch it
in tests in place of ``python -m sglang.launch_server``::

    python tests/standin_server.py --model-path PATH --port N [--host 127.0.0.1] [any SGLang flags]

Unknown flags (``--tp 1``, ``--mem-fraction-static 0.8``, ...) are accepted and ignored.  Interpreted:

* ``--model-path`` (alias ``--model``), ``--tokenizer-path``, ``--served-model-name``, ``--host``,
  ``--port`` (0 picks a free port, printed on the ``Uvicorn running on`` line).
* ``--moe-pruner POLICY``, ``--moe-pruner-config JSON|FILE`` (JSON text, or a .json/.yaml file), any
  other ``--moe-pruner-*`` flag, and the ``XSHARE_MOE_PRUNER_CONFIG`` variable, merged as the plugin
  does (variable, then config, then flags).  The stand-in is *pruned* when some policy other than
  ``none`` results.  A pruned stand-in prints the plugin's proof-of-life line once::

      [... TP0] moe-pruner active: policy=P config=policy=P ... layers=4 hooks=[ModelRunner.__init__, ...]

* ``--speculative-algorithm A`` (anything but ``NONE``): ``/server_info`` reports
  ``internal_states[0].avg_spec_accept_length`` = :data:`STANDIN_ACCEPT_LENGTH`, or
  :data:`STANDIN_PRUNED_ACCEPT_LENGTH` when pruned (``--standin-accept-length`` /
  ``--standin-pruned-accept-length`` change them); each finished request's ``meta_info`` carries
  ``spec_verify_ct`` = max(1, round(completion_tokens / L)) and ``spec_accept_length`` =
  completion_tokens / spec_verify_ct.  Speculation does not change the stand-in's speed.
* ``--enable-metrics``: serves ``/metrics`` (404 without it, as in SGLang).  A pruned stand-in adds,
  once it has generated at least one token, the plugin's gauges ``moe_pruner:activated_experts``,
  ``moe_pruner:kept_experts`` and ``moe_pruner:retained_score_mass`` (labels ``layer``, ``tp_rank``)
  with the fixed per-layer values :data:`STANDIN_ACTIVATED_EXPERTS`, :data:`STANDIN_KEPT_EXPERTS`,
  :data:`STANDIN_RETAINED_SCORE_MASS`.

Stand-in knobs (``--standin-*``):

* ``--standin-itl-ms F`` (2.0): per-token delay of the unpruned stand-in; the delay of each token is
  ``itl_ms * (1 + active_requests / knee)``, divided by ``--standin-speedup`` (1.25) when pruned;
  ``--standin-knee`` (16).  See :func:`token_delay_s`.
* ``--standin-gsm8k PATH`` (the shipped ``gsm8k_test.jsonl``), ``--standin-wrong-every K`` (0 =
  never), ``--standin-pruned-wrong-every K2`` (when pruned; defaults to K): a prompt whose last
  ``Question: ...`` is a question of that file is answered with a short worked answer ending in
  ``#### N``, N the reference number, or N + 1 when the question's index in the file is divisible by
  K (K > 0).  An unknown question gets an answer without a number.  See :func:`answers_wrongly`.
* ``--standin-fail {none,exit,no-health,crash-during-bench}``: ``exit`` exits with code 3
  (:data:`STANDIN_EXIT_CODE`) after its first log lines, before listening; ``no-health`` serves but
  ``/health``, ``/health_generate`` and ``/ready`` answer 503 forever; ``crash-during-bench`` exits
  with code :data:`STANDIN_CRASH_EXIT_CODE` (``os._exit``) right after finishing its
  ``--standin-crash-after`` th (5) ``/generate`` request.
* ``--standin-no-proof``: a plugin that did not load: no proof-of-life line, and the server behaves
  unpruned (speed, answers, accept length, no ``moe_pruner:*`` gauges) whatever the pruner flags say.
* ``--standin-startup-s F`` (0): wait this long before listening (a slow start).

Importable for tests: the ``STANDIN_*`` constants, :func:`token_delay_s`, :func:`answers_wrongly`,
:func:`expected_gsm8k_accuracy` (the accuracy the GSM8K client will print).

Generation: every stand-in token is one whitespace-led word.  A prompt without ``Question:`` gets
:data:`STANDIN_TOKEN` (one token of the shipped tiny model's tokenizer, so SGLang's benchmark client
counts the same number of tokens by re-tokenizing) until ``max_new_tokens``; a GSM8K prompt gets its
answer, then ``\\n\\nQuestion:`` (which SGLang's GSM8K client's stop strings cut), then EOS, after
which ``ignore_eos`` requests go on with :data:`STANDIN_TOKEN` up to ``max_new_tokens``.  Stop strings
are cut from the text (finish reason ``{"type": "stop", "matched": STOP}``), ``max_new_tokens`` gives
``{"type": "length", "length": N}``.  Streams (``"stream": true``) send one SSE event per token with
the cumulative text and ``meta_info.completion_tokens``, then ``data: [DONE]``, over an HTTP/1.0
connection that closes at the end.

Endpoints: ``/health``, ``/health_generate``, ``/ready``; ``/model_info``, ``/get_model_info``;
``/server_info``, ``/get_server_info``; ``/flush_cache`` (GET, POST); ``/generate`` (POST, PUT;
``text`` or ``input_ids``; a list of texts without streaming is a batch); ``/metrics``;
``/v1/models``, ``/v1/models/NAME``.  Anything else answers 404.  SIGTERM and SIGINT print a
shutdown line and exit 0 at once.

What SGLang 0.5.23's clients call (paths in the ``sglang`` package):

* ``benchmark/serving.py``: ``GET /v1/models`` until 200 (readiness, l. 158, 2112); ``GET /model_info``
  only without ``--tokenizer`` (l. 2176); ``POST /generate`` with ``text`` (or ``input_ids`` with
  ``--tokenize-prompt``), ``sampling_params`` {temperature, max_new_tokens, ignore_eos: true},
  ``stream: true`` (l. 692-813): per SSE event it keeps the cumulative ``text`` and
  ``meta_info.completion_tokens`` (the output token count), ``meta_info.prompt_tokens`` and
  ``meta_info.spec_accept_length``; the warm-up is the same request; ``POST /flush_cache`` only with
  ``--flush-cache`` or ``SGLANG_IS_IN_CI`` (l. 1519); then ``GET /server_info`` twice (l. 1643: the
  ``accept_length`` of the result is ``internal_states[0].avg_spec_accept_length``; l. 1847: the whole
  answer goes into the JSONL row as ``server_info``).  It re-tokenizes the text only for
  ``total_output_tokens_retokenized`` (l. 1164).
* ``test/few_shot_gsm8k.py`` through ``lang/backend/runtime_endpoint.py``: ``GET /get_model_info``
  (``model_path``); one ``POST /generate`` with ``max_new_tokens: 0`` (prefix caching of the shared
  few-shot prefix, ``lang/interpreter.py`` l. 106, 247); then per question a non-streaming
  ``POST /generate`` with ``text`` and ``sampling_params`` {max_new_tokens, stop: ["Question",
  "Assistant:", "<|separator|>"], temperature: 0, ...}, reading ``text`` (last number = the answer)
  and ``meta_info.completion_tokens``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

# ---------------------------------------------------------------------------------------- constants
#: Per-layer values of the pruned stand-in's ``moe_pruner:*`` gauges (layers 0..3).
STANDIN_ACTIVATED_EXPERTS = (10.0, 11.0, 12.0, 13.0)
STANDIN_KEPT_EXPERTS = (12.0, 13.0, 14.0, 15.0)
STANDIN_RETAINED_SCORE_MASS = (0.96, 0.95, 0.94, 0.93)
#: MoE layers the stand-in reports (proof line ``layers=``, gauge series).
STANDIN_LAYERS = len(STANDIN_ACTIVATED_EXPERTS)
#: ``avg_spec_accept_length`` with ``--speculative-algorithm``: unpruned, pruned.
STANDIN_ACCEPT_LENGTH = 3.0
STANDIN_PRUNED_ACCEPT_LENGTH = 2.75
#: Defaults of the speed knobs.
STANDIN_ITL_MS = 2.0
STANDIN_KNEE = 16.0
STANDIN_SPEEDUP = 1.25
#: The filler token (a single token of the shipped tiny model's tokenizer).
STANDIN_TOKEN = " the"
#: Exit codes of ``--standin-fail exit`` and ``--standin-fail crash-during-bench``.
STANDIN_EXIT_CODE = 3
STANDIN_CRASH_EXIT_CODE = 1
#: SGLang's ready line and the plugin's proof-of-life prefix.
READY_LINE = "The server is fired up and ready to roll!"
PROOF_PREFIX = "moe-pruner active: policy="
#: The plugin's routing hooks as its proof line names them.
PROOF_HOOKS = (
    "ModelRunner.__init__",
    "ModelRunner._forward_raw",
    "DecodeCudaGraphRunner.load_batch",
    "topk.select_experts",
    "expert_location_dispatch.transform_select_experts_inputs",
    "topk._post_process_topk_ids",
)
PRUNER_ENV_VAR = "XSHARE_MOE_PRUNER_CONFIG"
FAIL_MODES = ("none", "exit", "no-health", "crash-during-bench")
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_REPO = Path(__file__).resolve().parent.parent
_GSM8K_RELATIVE = Path("data") / "eval_sets" / "gsm8k_test.jsonl"


# ------------------------------------------------------------------------------------ pure helpers
def token_delay_s(itl_ms: float, active_requests: int, knee: float, speedup: float, pruned: bool) -> float:
    """Seconds one token takes: ``itl_ms * (1 + active / knee)``, divided by ``speedup`` when pruned."""
    delay = itl_ms / 1000.0 * (1.0 + active_requests / knee)
    return delay / speedup if pruned else delay


def answers_wrongly(index: int, wrong_every: int) -> bool:
    """Whether the stand-in answers GSM8K question ``index`` (0-based line of the file) wrongly."""
    return wrong_every > 0 and index % wrong_every == 0


def expected_gsm8k_accuracy(num_questions: int, wrong_every: int) -> float:
    """The accuracy SGLang's few-shot GSM8K client reports for the first ``num_questions`` questions."""
    wrong = sum(answers_wrongly(i, wrong_every) for i in range(num_questions))
    return (num_questions - wrong) / num_questions


def default_gsm8k_path() -> Path:
    """The shipped GSM8K test split: from this checkout, else from the installed package (not imported)."""
    local = _REPO / "xshare_sglang" / _GSM8K_RELATIVE
    if local.is_file():
        return local
    spec = importlib.util.find_spec("xshare_sglang")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / _GSM8K_RELATIVE
        if candidate.is_file():
            return candidate
    return local


def load_gsm8k(path: Path) -> dict[str, tuple[int, str]]:
    """question text (stripped) -> (line index, reference number as written after ``####``, no commas)."""
    table: dict[str, tuple[int, str]] = {}
    with open(path, encoding="utf-8") as handle:
        for index, line in enumerate(handle):
            if not line.strip():
                continue
            row = json.loads(line)
            number = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
            table.setdefault(row["question"].strip(), (index, number))
    return table


def last_question(prompt: str) -> str | None:
    """The text of the last ``Question: ...`` of a few-shot GSM8K prompt (None if there is none)."""
    at = prompt.rfind("Question:")
    if at < 0:
        return None
    text = prompt[at + len("Question:") :]
    cut = text.rfind("\nAnswer:")
    if cut >= 0:
        text = text[:cut]
    return text.strip()


def gsm8k_answer(number: str, wrong: bool) -> str:
    """The stand-in's worked answer, ending in ``#### N`` (N + 1 when ``wrong``)."""
    if wrong:
        try:
            number = str(int(number) + 1)
        except ValueError:
            number = number + "1"
    return f" Working through the quantities step by step gives the total.\n#### {number}"


def split_tokens(text: str) -> list[str]:
    """The stand-in's tokens: whitespace-led words."""
    return re.findall(r"\s*\S+", text)


def load_pruner_config(text: str) -> dict[str, Any]:
    """A ``--moe-pruner-config`` value: JSON text, or a JSON/YAML file."""
    stripped = text.strip()
    if stripped.startswith("{"):
        data = json.loads(stripped)
    else:
        path = Path(stripped)
        raw = path.read_text(encoding="utf-8")
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(raw)
        else:
            data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return data


def _coerce(value: str | bool) -> Any:
    if isinstance(value, bool):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def resolve_pruner(args: argparse.Namespace, extra: list[str], environ: dict[str, str]) -> dict[str, Any]:
    """The pruner configuration: ``XSHARE_MOE_PRUNER_CONFIG``, then ``--moe-pruner-config``, then flags."""
    config: dict[str, Any] = {}
    if environ.get(PRUNER_ENV_VAR):
        config.update(load_pruner_config(environ[PRUNER_ENV_VAR]))
    if args.moe_pruner_config:
        config.update(load_pruner_config(args.moe_pruner_config))
    if args.moe_pruner is not None:
        config["policy"] = args.moe_pruner
    i = 0
    while i < len(extra):
        token = extra[i]
        i += 1
        if not token.startswith("--moe-pruner-"):
            continue
        name, eq, value = token[len("--moe-pruner-") :].partition("=")
        if not eq:
            if i < len(extra) and not extra[i].startswith("--"):
                value, i = extra[i], i + 1
            else:
                value = True  # a switch
        config[name.replace("-", "_")] = _coerce(value)
    return config


def pruner_policies(config: dict[str, Any]) -> list[str]:
    """The policies other than ``none`` in a configuration (base and per-phase), sorted."""
    found = {config.get("policy")}
    found |= {value.get("policy") for value in config.values() if isinstance(value, dict)}
    return sorted(str(p) for p in found - {None, "none"})


def pruner_summary(config: dict[str, Any]) -> str:
    """A one-line configuration in the plugin's ``summary()`` style."""
    parts = [f"policy={config.get('policy', 'none')}"]
    parts += [f"{k}={v}" for k, v in config.items() if k != "policy" and not isinstance(v, dict)]
    text = " ".join(parts)
    for phase, delta in config.items():
        if isinstance(delta, dict):
            text += f" | {phase}: " + " ".join(f"{k}={v}" for k, v in delta.items())
    return text


# ------------------------------------------------------------------------------------------ logging
_LOG_LOCK = threading.Lock()


def log(message: str, prefix: str = "") -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with _LOG_LOCK:
        sys.stdout.write(f"[{stamp}{prefix}] {message}\n")
        sys.stdout.flush()


# ------------------------------------------------------------------------------------------ options
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="standin_server.py",
        description="Test stand-in for an SGLang server (not SGLang). Unknown flags are ignored.",
        allow_abbrev=False,
    )
    parser.add_argument("--model-path", "--model", dest="model_path", required=True)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--speculative-algorithm", default=None)
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--moe-pruner", default=None)
    parser.add_argument("--moe-pruner-config", default=None)
    group = parser.add_argument_group("stand-in knobs")
    group.add_argument("--standin-itl-ms", type=float, default=STANDIN_ITL_MS)
    group.add_argument("--standin-knee", type=float, default=STANDIN_KNEE)
    group.add_argument("--standin-speedup", type=float, default=STANDIN_SPEEDUP)
    group.add_argument("--standin-gsm8k", type=Path, default=None)
    group.add_argument("--standin-wrong-every", type=int, default=0)
    group.add_argument("--standin-pruned-wrong-every", type=int, default=None)
    group.add_argument("--standin-accept-length", type=float, default=STANDIN_ACCEPT_LENGTH)
    group.add_argument("--standin-pruned-accept-length", type=float, default=STANDIN_PRUNED_ACCEPT_LENGTH)
    group.add_argument("--standin-fail", choices=FAIL_MODES, default="none")
    group.add_argument("--standin-crash-after", type=int, default=5)
    group.add_argument("--standin-no-proof", action="store_true")
    group.add_argument("--standin-startup-s", type=float, default=0.0)
    return parser


# ------------------------------------------------------------------------------------------- server
class StandinState:
    """Everything the handlers share; counters under ``lock``."""

    def __init__(self, args: argparse.Namespace, pruner: dict[str, Any]) -> None:
        self.args = args
        self.pruner = pruner
        self.policies = pruner_policies(pruner)
        # --standin-no-proof stands for a plugin that did not load: the server then does not prune.
        self.pruned = bool(self.policies) and not args.standin_no_proof
        spec = args.speculative_algorithm
        self.speculative = bool(spec) and str(spec).upper() != "NONE"
        self.accept_length = args.standin_pruned_accept_length if self.pruned else args.standin_accept_length
        self.wrong_every = args.standin_wrong_every
        if self.pruned and args.standin_pruned_wrong_every is not None:
            self.wrong_every = args.standin_pruned_wrong_every
        self.model_path = args.model_path
        self.tokenizer_path = args.tokenizer_path or args.model_path
        self.served_model_name = args.served_model_name or args.model_path
        self.hf_config = _read_json_file(Path(self.model_path) / "config.json")
        self.eos_token_id = self.hf_config.get("eos_token_id", 0)
        if isinstance(self.eos_token_id, list):
            self.eos_token_id = self.eos_token_id[0] if self.eos_token_id else 0
        self.context_len = int(self.hf_config.get("max_position_embeddings", 4096))
        self.gsm8k_path = args.standin_gsm8k or default_gsm8k_path()
        self.gsm8k = load_gsm8k(self.gsm8k_path) if self.gsm8k_path.is_file() else {}
        self.tokenizer = _load_tokenizer(Path(self.tokenizer_path))
        self.started = time.time()
        self.lock = threading.Lock()
        self.active = 0
        self.generate_finished = 0
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.last_gen_throughput = 0.0

    # --------------------------------------------------------------- generation
    def count_prompt_tokens(self, text: str | None, input_ids: list[int] | None) -> int:
        if input_ids is not None:
            return len(input_ids)
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text or "").ids)
        return len(split_tokens(text or ""))

    def script_for(self, prompt: str | None) -> tuple[list[str], bool]:
        """The tokens the stand-in means to say, and whether EOS follows them (else filler forever)."""
        question = last_question(prompt) if prompt else None
        if question is None:
            return [], False
        found = self.gsm8k.get(question)
        if found is None:
            body = " I cannot work this one out."
        else:
            index, number = found
            body = gsm8k_answer(number, answers_wrongly(index, self.wrong_every))
        return [*split_tokens(body), "\n\nQuestion:"], True

    def steps(self, prompt: str | None, params: dict[str, Any]) -> Iterator[tuple[str, int, Any]]:
        """(visible text, completion tokens, finish reason or None) after each token; sleeps per token."""
        max_new = params.get("max_new_tokens")
        max_new = DEFAULT_MAX_NEW_TOKENS if max_new is None else int(max_new)
        ignore_eos = bool(params.get("ignore_eos", False))
        stops = params.get("stop") or []
        if isinstance(stops, str):
            stops = [stops]
        stops = [s for s in stops if s]
        script, eos_after = self.script_for(prompt)
        if max_new <= 0:
            yield "", 0, {"type": "length", "length": 0}
            return
        text, count = "", 0
        while True:
            eos = eos_after and count >= len(script) and not ignore_eos
            self._sleep_one_token()
            count += 1
            if eos:
                yield text, count, {"type": "stop", "matched": self.eos_token_id}
                return
            text += script[count - 1] if count <= len(script) else STANDIN_TOKEN
            hits = [(text.find(s), s) for s in stops if s in text]
            if hits:
                at, stop = min(hits)
                yield text[:at], count, {"type": "stop", "matched": stop}
                return
            if count >= max_new:
                yield text, count, {"type": "length", "length": max_new}
                return
            yield text, count, None

    def _sleep_one_token(self) -> None:
        a = self.args
        with self.lock:
            active = self.active
        time.sleep(token_delay_s(a.standin_itl_ms, active, a.standin_knee, a.standin_speedup, self.pruned))

    def meta_info(self, rid: str, prompt_tokens: int, count: int, finish: Any, started: float) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": prompt_tokens,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": count,
            "cached_tokens": 0,
        }
        if finish is not None:
            meta["e2e_latency"] = time.perf_counter() - started
            if self.speculative and count > 0:
                verify_ct = max(1, round(count / self.accept_length))
                meta["spec_verify_ct"] = verify_ct
                meta["spec_accept_length"] = count / verify_ct
        return meta

    def begin(self) -> None:
        with self.lock:
            self.active += 1
            self.requests_total += 1

    def end(self, prompt_tokens: int, count: int, seconds: float) -> int:
        with self.lock:
            self.active -= 1
            self.generate_finished += 1
            self.prompt_tokens_total += prompt_tokens
            self.generation_tokens_total += count
            if seconds > 0 and count > 0:
                self.last_gen_throughput = count / seconds
            return self.generate_finished

    # --------------------------------------------------------------- read-outs
    def model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.hf_config.get("model_type"),
            "architectures": self.hf_config.get("architectures"),
            "standin": True,
        }

    def server_info(self) -> dict[str, Any]:
        a = self.args
        state: dict[str, Any] = {"last_gen_throughput": self.last_gen_throughput}
        if self.speculative:
            state["avg_spec_accept_length"] = self.accept_length
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "host": a.host,
            "port": a.port,
            "speculative_algorithm": a.speculative_algorithm if self.speculative else None,
            "enable_metrics": a.enable_metrics,
            "context_length": self.context_len,
            "startup_time": self.started,
            "internal_states": [state],
            "version": _sglang_version(),
            "frontend": "python",
            "standin": True,
            "standin_pruned": self.pruned,
            "standin_policies": self.policies,
        }

    def metrics_text(self) -> str:
        labels = f'model_name="{self.served_model_name}",engine_type="unified",tp_rank="0",pp_rank="0"'
        with self.lock:
            running, prompt_total, gen_total = self.active, self.prompt_tokens_total, self.generation_tokens_total
            requests, throughput = self.generate_finished, self.last_gen_throughput
        lines = [
            "# HELP sglang:num_running_reqs The number of running requests.",
            "# TYPE sglang:num_running_reqs gauge",
            f"sglang:num_running_reqs{{{labels}}} {float(running)}",
            "# HELP sglang:gen_throughput The generation throughput (token/s).",
            "# TYPE sglang:gen_throughput gauge",
            f"sglang:gen_throughput{{{labels}}} {throughput}",
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE sglang:prompt_tokens_total counter",
            f"sglang:prompt_tokens_total{{{labels}}} {float(prompt_total)}",
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.",
            "# TYPE sglang:generation_tokens_total counter",
            f"sglang:generation_tokens_total{{{labels}}} {float(gen_total)}",
            "# HELP sglang:num_requests_total The number of processed requests.",
            "# TYPE sglang:num_requests_total counter",
            f"sglang:num_requests_total{{{labels}}} {float(requests)}",
        ]
        if self.speculative:
            lines += [
                "# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.",
                "# TYPE sglang:spec_accept_length gauge",
                f"sglang:spec_accept_length{{{labels}}} {self.accept_length}",
            ]
        if self.pruned and gen_total > 0:
            gauges = (
                (
                    "activated_experts",
                    "Mean distinct experts the routed tokens use per layer call.",
                    STANDIN_ACTIVATED_EXPERTS,
                ),
                ("kept_experts", "Mean experts in the keep mask per layer call.", STANDIN_KEPT_EXPERTS),
                (
                    "retained_score_mass",
                    "Mean share of router score held by kept experts.",
                    STANDIN_RETAINED_SCORE_MASS,
                ),
            )
            for name, help_text, values in gauges:
                lines += [f"# HELP moe_pruner:{name} {help_text}", f"# TYPE moe_pruner:{name} gauge"]
                lines += [f'moe_pruner:{name}{{layer="{i}",tp_rank="0"}} {v}' for i, v in enumerate(values)]
            lines += [
                "# HELP moe_pruner:selection_fallbacks Layer calls left unpruned because selection failed.",
                "# TYPE moe_pruner:selection_fallbacks counter",
                'moe_pruner:selection_fallbacks_total{tp_rank="0"} 0.0',
            ]
        return "\n".join(lines) + "\n"

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.served_model_name,
            "object": "model",
            "created": int(self.started),
            "owned_by": "sglang",
            "root": self.served_model_name,
            "max_model_len": self.context_len,
        }


def _read_json_file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _load_tokenizer(folder: Path):
    """The model's ``tokenizer.json`` through the ``tokenizers`` package, or None (then words count)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    except Exception:  # no tokenizers package, or a file it cannot read
        return None


def _sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return "0.5.23"


class Handler(BaseHTTPRequestHandler):
    """Routes of the stand-in.  HTTP/1.0: one request per connection, closed after the response."""

    server_version = "uvicorn-standin"
    sys_version = ""
    state: StandinState  # set on the subclass made by serve()

    # ------------------------------------------------------------------ plumbing
    def log_message(self, format: str, *args: Any) -> None:  # uvicorn-like access lines
        return

    def log_request(self, code: Any = "-", size: Any = "-") -> None:
        host, port = self.client_address[:2]
        with _LOG_LOCK:
            sys.stdout.write(f'INFO:     {host}:{port} - "{self.requestline}" {code}\n')
            sys.stdout.flush()

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data: Any) -> None:
        self._send(status, json.dumps(data).encode(), "application/json")

    def _text(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8") -> None:
        self._send(status, text.encode(), content_type)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length > 0 else b""
        return json.loads(raw) if raw.strip() else {}

    def do_GET(self) -> None:
        self._route()

    def do_POST(self) -> None:
        self._route()

    def do_PUT(self) -> None:
        self._route()

    # ------------------------------------------------------------------ routes
    def _route(self) -> None:
        state = self.state
        path = unquote(urlsplit(self.path).path).rstrip("/") or "/"
        method = self.command
        if path in ("/health", "/health_generate", "/ready"):
            if state.args.standin_fail == "no-health":
                return self._send(503, b"", "text/plain")
            return self._send(200, b"", "text/plain")
        if path in ("/model_info", "/get_model_info") and method == "GET":
            return self._json(200, state.model_info())
        if path in ("/server_info", "/get_server_info") and method == "GET":
            return self._json(200, state.server_info())
        if path == "/flush_cache" and method in ("GET", "POST"):
            return self._text(200, "Cache flushed.\nPlease check backend logs for more details.\n")
        if path == "/generate" and method in ("POST", "PUT"):
            return self._generate()
        if path == "/metrics" and method == "GET" and state.args.enable_metrics:
            return self._text(200, state.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
        if path == "/v1/models" and method == "GET":
            return self._json(200, state.models())
        if path.startswith("/v1/models/") and method == "GET":
            if path[len("/v1/models/") :] == state.served_model_name:
                return self._json(200, state.model_card())
            return self._json(404, {"detail": "model not found"})
        if path in ("/health", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/flush_cache"):
            return self._json(405, {"detail": "Method Not Allowed"})
        if path == "/generate":
            return self._json(405, {"detail": "Method Not Allowed"})
        return self._json(404, {"detail": "Not Found"})

    def _generate(self) -> None:
        try:
            body = self._body()
        except ValueError as exc:
            return self._json(400, {"error": f"invalid JSON body: {exc}"})
        if not isinstance(body, dict):
            return self._json(400, {"error": "expected a JSON object"})
        text, input_ids = body.get("text"), body.get("input_ids")
        if text is None and input_ids is None:
            return self._json(400, {"error": "Either text or input_ids should be provided."})
        stream = bool(body.get("stream", False))
        params = body.get("sampling_params") or {}
        batch = isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list))
        if batch:
            if stream:
                return self._json(400, {"error": "the stand-in streams single requests only"})
            prompts = text if text is not None else [None] * len(input_ids)
            ids = input_ids if input_ids is not None else [None] * len(text)
            plist = params if isinstance(params, list) else [params] * len(prompts)
            outs = [self._run(p, i, sp, stream=False) for p, i, sp in zip(prompts, ids, plist, strict=True)]
            if any(out is None for out in outs):
                return None
            self._json(200, outs)
            return self._maybe_crash()
        if stream:
            self._run(text, input_ids, params, stream=True)
            return self._maybe_crash()
        out = self._run(text, input_ids, params, stream=False)
        if out is not None:
            self._json(200, out)
        return self._maybe_crash()

    def _run(self, text: str | None, input_ids: list[int] | None, params: dict[str, Any], stream: bool):
        """One request; with ``stream`` it writes the SSE response itself, else returns the output dict."""
        state = self.state
        rid = uuid.uuid4().hex
        started = time.perf_counter()
        prompt_tokens = state.count_prompt_tokens(text, input_ids)
        state.begin()
        count, last = 0, None
        try:
            if stream:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
            for visible, count, finish in state.steps(text, params):
                last = {"text": visible, "meta_info": state.meta_info(rid, prompt_tokens, count, finish, started)}
                if stream:
                    self.wfile.write(b"data: " + json.dumps(last).encode() + b"\n\n")
            if stream:
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            return None
        finally:
            state.end(prompt_tokens, count, time.perf_counter() - started)
        return last

    def _maybe_crash(self) -> None:
        state = self.state
        if state.args.standin_fail != "crash-during-bench":
            return
        with state.lock:
            finished = state.generate_finished
        if finished >= state.args.standin_crash_after:
            with contextlib.suppress(OSError):
                self.wfile.flush()
            log(
                f"Scheduler hit an exception: stand-in crash (--standin-fail crash-during-bench) after "
                f"{finished} generate requests",
                prefix=" TP0",
            )
            os._exit(STANDIN_CRASH_EXIT_CODE)


class StandinHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512


def _install_signal_handlers() -> None:
    def stop(signum: int, _frame: Any) -> None:
        log(f"Received {signal.Signals(signum).name}; the stand-in server shuts down.")
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    _install_signal_handlers()
    log("SGLang stand-in (tests/standin_server.py): a test double, not SGLang; no model runs.")
    log(f"server_args=StandinArgs({', '.join(f'{k}={v!r}' for k, v in vars(args).items())}, ignored={extra!r})")
    if args.standin_fail == "exit":
        log("Scheduler hit an exception: RuntimeError: stand-in launch failure (--standin-fail exit)", prefix=" TP0")
        sys.stderr.write("RuntimeError: stand-in launch failure (--standin-fail exit)\n")
        sys.stderr.flush()
        return STANDIN_EXIT_CODE
    try:
        pruner = resolve_pruner(args, extra, dict(os.environ))
    except (OSError, ValueError) as exc:
        log(f"moe-pruner: invalid configuration, refusing to start: {exc}", prefix=" TP0")
        return 1
    state = StandinState(args, pruner)
    log(
        f"Load weight end. type={(state.hf_config.get('architectures') or ['?'])[0]} (stand-in: nothing loaded)", " TP0"
    )
    if state.pruned:
        log(
            f"{PROOF_PREFIX}{','.join(state.policies)} config={pruner_summary(pruner)} "
            f"layers={STANDIN_LAYERS} hooks=[{', '.join(PROOF_HOOKS)}]",
            prefix=" TP0",
        )
    if args.standin_startup_s > 0:
        time.sleep(args.standin_startup_s)
    handler = type("BoundHandler", (Handler,), {"state": state})
    try:
        server = StandinHTTPServer((args.host, args.port), handler)
    except OSError as exc:
        log(f"cannot listen on {args.host}:{args.port}: {exc}")
        return 1
    port = server.server_address[1]
    args.port = port
    log(f"Uvicorn running on http://{args.host}:{port} (Press CTRL+C to quit)")
    log(READY_LINE)
    server.serve_forever(poll_interval=0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
