"""What an A/B serving comparison runs: the arms and the settings of the whole run, validated up front.

An *arm* is one server configuration.  The baseline arm runs with the pruner off; every candidate arm
names a pruner configuration (the JSON that ``--moe-pruner-config`` takes, i.e. the fields of
:class:`~xshare_sglang.sglang_plugin.settings.PluginSettings`).  Arms are read from a YAML or JSON file::

    model_path: Qwen/Qwen3-30B-A3B             # optional; --model-path wins
    server_args: --tp 1 --moe-runner-backend triton
    arms:
      - name: baseline                         # no "pruner": the pruner is off
      - name: xshare-b8
        pruner: {policy: xshare, k0: 1, budget: 8}
      - name: moe-spec
        pruner: {policy: moe-spec, max_experts: 48}
        server_args: --cuda-graph-max-bs-decode 64   # extra flags for this arm only

or given on the command line (``--candidate xshare``, ``--candidate '{"policy": "lynx", ...}'``).  A
pruner configuration is validated here, so a typo fails before any server starts, and pruner flags
inside ``server_args`` are refused: the orchestrator must know each arm's policy to check the server's
proof-of-life line.
"""

from __future__ import annotations

import json
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..datasets import DATASETS

BASELINE_NAME = "baseline"
# Flags the plugin owns; an arm states them under "pruner" instead.
PRUNER_FLAG_PREFIXES = ("--moe-pruner", "--xshare-echo")
# Flags the orchestrator sets itself on every launched server.
MANAGED_FLAGS = ("--model-path", "--model", "--host", "--port")


class AbConfigError(ValueError):
    """An invalid A/B setting; the message starts with the flag or file key to blame."""


def _split_args(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            return tuple(shlex.split(value))
        except ValueError as exc:
            raise AbConfigError(f"{where}: cannot split {value!r} into flags ({exc})") from None
    if isinstance(value, Sequence) and all(isinstance(item, str | int | float) for item in value):
        return tuple(str(item) for item in value)
    raise AbConfigError(f"{where}: expected a string of flags or a list of strings, got {value!r}")


def _check_server_args(args: tuple[str, ...], where: str) -> None:
    for token in args:
        name = token.split("=", 1)[0]
        if name.startswith(PRUNER_FLAG_PREFIXES):
            raise AbConfigError(
                f"{where}: {name} is a pruner flag; state the arm's pruner settings under 'pruner' "
                "(the JSON fields of --moe-pruner-config) so the run can check the server applied them"
            )
        if name in MANAGED_FLAGS:
            raise AbConfigError(f"{where}: {name} is set by the A/B tool (--model-path, --host, --port); remove it")


@dataclass(frozen=True)
class Arm:
    """One server configuration of the comparison.

    Attributes
    ----------
    name : str
        Label in results, file names and plots (letters, digits, ``-``, ``_``, ``.``).
    pruner : dict or None
        Plugin settings (``--moe-pruner-config`` JSON fields); None for the baseline (pruner off).
    server_args : tuple of str
        Extra launch flags of this arm, after the common ones.
    url : str or None
        Base URL of a server the user started (``--url`` mode); None when the tool launches it.
    server_log : str or None
        Log file of that server (``--server-log``), searched for the plugin's proof-of-life line.
    is_baseline : bool
        The arm every other one is compared with (set by :func:`order_arms`: a pruner-off arm).
    """

    name: str
    pruner: Mapping[str, Any] | None = None
    server_args: tuple[str, ...] = ()
    url: str | None = None
    server_log: str | None = None
    is_baseline: bool = False
    _policy: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise AbConfigError(f"arm name {self.name!r}: use letters, digits, '-', '_' or '.'")
        where = f"arm {self.name!r}"
        _check_server_args(self.server_args, f"{where} server_args")
        if self.pruner is not None:
            from ...sglang_plugin.settings import PluginSettings

            if not isinstance(self.pruner, Mapping):
                raise AbConfigError(f"{where} pruner: expected a mapping of --moe-pruner-config fields")
            try:
                settings = PluginSettings.from_dict(dict(self.pruner))
            except (TypeError, ValueError) as exc:
                raise AbConfigError(f"{where} pruner: {exc}") from None
            if not settings.enabled:
                raise AbConfigError(
                    f"{where} pruner: policy 'none' prunes nothing; drop 'pruner' to make this the baseline"
                )
            object.__setattr__(self, "pruner", dict(self.pruner))
            object.__setattr__(self, "_policy", settings.policy_names())
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise AbConfigError(f"{where} url {self.url!r}: expected http://HOST:PORT")
        elif self.server_log is not None:
            raise AbConfigError(f"{where}: a server log is only read for a server given by --url")

    @property
    def unpruned(self) -> bool:
        """The pruner is off in this arm's server (the baseline's, and any other arm without 'pruner')."""
        return self.pruner is None

    @property
    def expected_policy(self) -> str | None:
        """The ``policy=`` the server's ``moe-pruner active`` line must show; None for the baseline."""
        return self._policy

    def launch_flags(self) -> list[str]:
        """This arm's own launch flags: its extra flags, then its pruner configuration."""
        flags = list(self.server_args)
        if self.pruner is not None:
            flags += ["--moe-pruner-config", json.dumps(self.pruner, separators=(",", ":"))]
        return flags


def candidate_arm(spec: str) -> Arm:
    """An arm from ``--candidate``: a policy name, or a JSON object of pruner fields."""
    text = spec.strip()
    if text.startswith("{"):
        try:
            pruner = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AbConfigError(f"--candidate {spec!r}: not valid JSON ({exc})") from None
        if not isinstance(pruner, dict):
            raise AbConfigError(f"--candidate {spec!r}: expected a JSON object")
        name = pruner.pop("name", None) or _auto_name(pruner)
    else:
        pruner, name = {"policy": text}, text
    try:
        return Arm(name=str(name), pruner=pruner)
    except AbConfigError as exc:
        raise AbConfigError(f"--candidate: {exc}") from None


def _auto_name(pruner: Mapping[str, Any]) -> str:
    parts = [str(pruner.get("policy", "arm"))]
    parts += [
        f"{key.replace('_', '')}{value}"
        for key, value in pruner.items()
        if key != "policy" and isinstance(value, int | float)
    ]
    return "-".join(parts).replace(" ", "")


def read_arms_file(path: str | Path) -> dict[str, Any]:
    """Read an arms file (YAML, or JSON which YAML also reads).

    Returns
    -------
    dict
        ``{"arms": [Arm, ...], "server_args": (...), "model_path": str or None}``.
    """
    import yaml

    path = Path(path)
    if not path.is_file():
        raise AbConfigError(f"--arms {path}: no such file")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise AbConfigError(f"--arms {path}: not valid YAML/JSON ({exc})") from None
    if isinstance(doc, list):
        doc = {"arms": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("arms"), list) or not doc["arms"]:
        raise AbConfigError(f"--arms {path}: expected a mapping with a non-empty list 'arms'")
    unknown = set(doc) - {"arms", "server_args", "model_path"}
    if unknown:
        raise AbConfigError(f"--arms {path}: unknown keys {sorted(unknown)}; allowed: arms, server_args, model_path")
    arms = []
    for index, item in enumerate(doc["arms"]):
        if not isinstance(item, dict) or "name" not in item:
            raise AbConfigError(f"--arms {path}: arms[{index}] must be a mapping with a 'name'")
        extra = set(item) - {"name", "pruner", "server_args", "url"}
        if extra:
            raise AbConfigError(
                f"--arms {path}: arms[{index}] has unknown keys {sorted(extra)}; "
                "allowed: name, pruner, server_args, url"
            )
        try:
            arms.append(
                Arm(
                    name=str(item["name"]),
                    pruner=item.get("pruner"),
                    server_args=_split_args(item.get("server_args"), f"arm {item['name']!r} server_args"),
                    url=item.get("url"),
                )
            )
        except AbConfigError as exc:
            raise AbConfigError(f"--arms {path}: {exc}") from None
    common = _split_args(doc.get("server_args"), f"--arms {path}: server_args")
    _check_server_args(common, f"--arms {path}: server_args")
    model = doc.get("model_path")
    return {"arms": arms, "server_args": common, "model_path": model if isinstance(model, str) else None}


def order_arms(arms: Sequence[Arm]) -> tuple[Arm, ...]:
    """The baseline first, then the other arms in the order given; names unique.

    The baseline is the pruner-off arm named ``baseline``, else the first pruner-off arm given (a
    pruner-off arm named ``baseline`` is added when there is none).  Other pruner-off arms (e.g.
    another speculative configuration of SGLang alone) are compared with it as candidates are.
    """
    names = [arm.name for arm in arms]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise AbConfigError(f"arm names must be unique; repeated: {', '.join(duplicates)}")
    unpruned = [arm for arm in arms if arm.unpruned]
    if not any(not arm.unpruned for arm in arms):
        raise AbConfigError("no candidate arm: give --candidate POLICY or arms with a 'pruner' in --arms")
    if BASELINE_NAME in names and not next(arm for arm in arms if arm.name == BASELINE_NAME).unpruned:
        raise AbConfigError(f"the name {BASELINE_NAME!r} is reserved for the pruner-off arm")
    if not unpruned:
        unpruned = [Arm(name=BASELINE_NAME)]
    baseline = next((arm for arm in unpruned if arm.name == BASELINE_NAME), unpruned[0])
    others = [arm for arm in arms if arm is not baseline]
    return (replace(baseline, is_baseline=True), *others)


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AbConfigError(f"{name}={value!r}: must be an integer >= 1")


@dataclass(frozen=True)
class AbSettings:
    """Every setting of one A/B run.

    Attributes
    ----------
    model_path : str
        ``--model-path`` of every launched server; also the benchmark client's ``--model``.
    arms : tuple of Arm
        Baseline first, then candidates, in the order each repetition runs them.
    output_dir : Path
        Where ``runs.jsonl``, ``summary.md``, the plots, server logs and raw client outputs go.
    server_args : tuple of str
        Launch flags common to every arm.
    concurrencies : tuple of int
        ``--max-concurrency`` values of the benchmark client, one run each per dataset.
    datasets : tuple of str
        Workloads: ``random-ids``, ``mt-bench``, ``gsm8k`` (see :mod:`.datasets`).
    repeats : int
        Repetitions; arms alternate within each (A B A B ...), so drift hits every arm alike.
    num_prompts : int or None
        Prompts per benchmark run; None sends ``max(32, 8 x concurrency)``.
    random_input_len, random_output_len : int
        Lengths of the ``random-ids`` workload (every request exactly these).
    output_len : int
        Tokens generated per MT-Bench request (MT-Bench has no reference answers).
    accuracy : bool
        Run SGLang's few-shot GSM8K on the shipped test split once per arm and repetition.
    gsm8k_questions, gsm8k_shots, gsm8k_parallel, gsm8k_max_new_tokens : int
        Its size, shots, client threads and generation limit.
    tokenizer : str or None
        The client's tokenizer; None uses ``model_path``.
    host, port : str, int
        Where launched servers listen.
    launch_command : tuple of str
        How to start a server (default ``python -m sglang.launch_server``).
    enable_metrics : bool
        Launch with ``--enable-metrics`` (every arm alike) so activated experts can be read.
    startup_timeout_s, run_timeout_s, stop_timeout_s : float
        Limits for a server to become healthy, for one client run, and for a clean stop.
    seed : int
        Seed of the benchmark client's prompt sampling (the same for every arm).
    """

    model_path: str
    arms: tuple[Arm, ...]
    output_dir: Path
    server_args: tuple[str, ...] = ()
    concurrencies: tuple[int, ...] = (1, 8, 32)
    datasets: tuple[str, ...] = ("random-ids",)
    repeats: int = 2
    num_prompts: int | None = None
    random_input_len: int = 1024
    random_output_len: int = 256
    output_len: int = 256
    accuracy: bool = True
    gsm8k_questions: int = 200
    gsm8k_shots: int = 5
    gsm8k_parallel: int = 64
    gsm8k_max_new_tokens: int = 512
    tokenizer: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    launch_command: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")
    enable_metrics: bool = True
    startup_timeout_s: float = 1800.0
    run_timeout_s: float = 3600.0
    stop_timeout_s: float = 60.0
    seed: int = 1

    def __post_init__(self) -> None:
        if not self.model_path:
            raise AbConfigError("--model-path is required (or model_path in the --arms file)")
        object.__setattr__(self, "arms", order_arms(self.arms))
        object.__setattr__(self, "output_dir", Path(self.output_dir))
        _check_server_args(tuple(self.server_args), "--server-args")
        urls = [arm.url is not None for arm in self.arms]
        if any(urls) and not all(urls):
            raise AbConfigError("--url: give a URL for every arm, or none (then the tool launches the servers)")
        if not self.concurrencies:
            raise AbConfigError("--concurrency: give at least one value")
        for value in self.concurrencies:
            _positive("--concurrency", value)
        object.__setattr__(self, "concurrencies", tuple(sorted(set(self.concurrencies))))
        if not self.datasets and not self.accuracy:
            raise AbConfigError("nothing to run: give --dataset, or drop --no-accuracy")
        for name in self.datasets:
            if name not in DATASETS:
                raise AbConfigError(f"--dataset {name!r}: allowed values are {', '.join(DATASETS)}")
        object.__setattr__(self, "datasets", tuple(dict.fromkeys(self.datasets)))
        if self.num_prompts is not None:
            _positive("--num-prompts", self.num_prompts)
        for name in (
            "repeats",
            "random_input_len",
            "random_output_len",
            "gsm8k_questions",
            "gsm8k_parallel",
            "gsm8k_max_new_tokens",
        ):
            _positive("--" + name.replace("_", "-"), getattr(self, name))
        if self.output_len < 4:
            raise AbConfigError(f"--output-len={self.output_len!r}: must be >= 4 (SGLang's client refuses less)")
        if isinstance(self.gsm8k_shots, bool) or not isinstance(self.gsm8k_shots, int) or self.gsm8k_shots < 0:
            raise AbConfigError(f"--gsm8k-shots={self.gsm8k_shots!r}: must be an integer >= 0")
        if not 1 <= self.port <= 65535:
            raise AbConfigError(f"--port={self.port!r}: must be in 1..65535")
        if not self.launch_command:
            raise AbConfigError("--launch-command: must name a program")
        for name in ("startup_timeout_s", "run_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise AbConfigError(f"--{name[:-2].replace('_', '-')}: must be > 0 seconds")

    @property
    def url_mode(self) -> bool:
        """The servers are the user's (``--url``); the tool neither starts nor stops them."""
        return self.arms[0].url is not None

    @property
    def base_url(self) -> str:
        """URL of a server the tool launches."""
        return f"http://{self.host}:{self.port}"

    def prompts_for(self, concurrency: int) -> int:
        """Prompts one benchmark run sends at this concurrency."""
        return self.num_prompts if self.num_prompts is not None else max(32, 8 * concurrency)
