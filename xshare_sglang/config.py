"""``PrunerConfig``: the one frozen, validated description of what the pruner does.

Every entry point (the SGLang flags, the environment variable, ``Engine(...)`` users, the offline
tools) builds one of these and nothing else.  Construction validates every field and raises
:class:`~xshare_sglang.errors.ConfigError` (a ``ValueError``) naming the field, the offending value and
what is allowed, so a bad value fails at start-up and never half-way through serving.

Checks that need the model (``k0 <= top_k``; the expert and layer counts of a static ranking file)
live in :meth:`PrunerConfig.validate_for_model`, which the server calls once it knows the model; a
config remembers the model shapes it has accepted, so the offline entry points that call it on every
use pay for the checks once.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .calibration_file import StaticRanking, load_static_ranking
from .errors import ConfigError, invalid

POLICIES: tuple[str, ...] = (
    "none",
    "oea",
    "xshare",
    "xshare-threshold",
    "xshare-spec",
    "xshare-ep",
    "moe-spec",
    "lynx",
)
SCORES: tuple[str, ...] = ("topk", "probs")
COVERAGES: tuple[str, ...] = ("substitution", "truncation")
# ``coverage``: greedy on the batch's own per-token scores, each token's score of a candidate
# weighted by the share of the token's routing mass the experts already kept leave uncovered.
# ``coactivation``: greedy on router scores, each candidate discounted by its co-activation with the
# experts already kept (statistics from the calibration file).
RANKINGS: tuple[str, ...] = ("router", "static", "coverage", "coactivation")
# Rankings that read the calibration file.
FILE_RANKINGS: frozenset[str] = frozenset({"static", "coactivation"})
# How ``moe-spec``'s budget is spread over layers: ``max_experts`` in every layer, or per-layer budgets
# averaging ``max_experts``, set from the calibration file's coverage curves.
BUDGET_ALLOCATIONS: tuple[str, ...] = ("uniform", "calibrated")
# What one ``moe-spec`` budget covers in a speculative verify batch: the whole batch (one top-B), or
# each request's draft tree (a top-B per request, the union kept).
SCOPES: tuple[str, ...] = ("batch", "request")
# SGLang forward modes the pruner can act on: plain decode, EAGLE target verify, prefill/extend and
# mixed (chunked-prefill) batches.  Prefill and mixed batches are compute-bound and sensitive to
# routing changes (LYNX section 3.3), hence off by default.
PHASES: tuple[str, ...] = ("decode", "verify", "extend", "mixed")
DEFAULT_PHASES: tuple[str, ...] = ("decode", "verify")

# Score each policy aggregates when ``score`` is left unset.
DEFAULT_SCORE: dict[str, str] = {
    "none": "topk",
    "oea": "topk",
    "xshare": "topk",
    "xshare-threshold": "topk",
    "xshare-spec": "topk",
    "xshare-ep": "topk",
    "moe-spec": "probs",
    "lynx": "probs",
}
# Policies whose keep mask starts from the warm-up set W(k0).
WARMUP_POLICIES: frozenset[str] = frozenset({"oea", "xshare", "xshare-threshold", "xshare-spec", "xshare-ep"})


def _fail(name: str, value: Any, allowed: str) -> ConfigError:
    return invalid("PrunerConfig", name, value, allowed)


def _check_int(name: str, value: Any, minimum: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        allowed = f"an integer >= {minimum}" + (" or null" if optional else "")
        raise _fail(name, value, f"must be {allowed}")
    if value < minimum:
        raise _fail(name, value, f"must be >= {minimum}")


def _check_choice(name: str, value: Any, choices: Iterable[str], *, optional: bool = False) -> None:
    if value is None and optional:
        return
    choices = tuple(choices)
    if value not in choices:
        listed = ", ".join(choices) + (", or null for the policy's default" if optional else "")
        raise _fail(name, value, f"choose one of {listed}")


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, value, "must be a finite number")
    return float(value)


@dataclass(frozen=True)
class PrunerConfig:
    """What the pruner does, for one model.  Frozen and validated on construction.

    Parameters
    ----------
    policy : str
        One of :data:`POLICIES`.  ``"none"`` leaves routing untouched.
    k0 : int
        Warm-up width: every valid token's top-``k0`` experts by logit are always kept
        (``oea``, ``xshare*``).  ``0 <= k0 <= top_k``.
    budget : int
        Experts the batch-level greedy step adds beyond the warm-up (``xshare``, ``xshare-spec``).
    request_budget : int
        Experts the per-request greedy step adds beyond each request's warm-up (``xshare-spec``).
    rank_budget : int
        Per-rank budget of ``xshare-ep``: rounds continue while fewer than
        ``rank_budget * num_ranks`` experts are kept.
    max_experts : int or None
        The expert budget B of ``moe-spec`` (required there); a hard cap for every other policy.
    tau : float
        ``xshare-threshold`` keeps growing until this fraction of the batch's score mass is kept;
        ``0 < tau <= 1``.
    score : {"topk", "probs"} or None
        Per-token score that aggregates are summed from; ``None`` takes the policy's default
        (:data:`DEFAULT_SCORE`).
    coverage : {"substitution", "truncation"}
        How tokens are routed inside the kept set (:func:`xshare_sglang.route_within`).
    ranking : {"router", "static", "coverage", "coactivation"}
        How ``moe-spec`` ranks experts: by the batch's aggregate router scores; by calibration
        counts; greedily by the routing mass each expert adds to tokens the experts already kept
        leave uncovered (``coverage``); or greedily by aggregate discounted by calibration
        co-activation with the experts already kept (``coactivation``).
    static_ranking_path : str or None
        The calibration JSON file (``xshare-sglang calibrate``), required with ``ranking="static"``
        or ``"coactivation"`` and with ``budget_allocation="calibrated"``.
    alpha : float
        LYNX bin scale (bins are ``1/alpha`` wide in logit units); ``> 0``.
    beta : int
        LYNX lowest bin; everything at or below ``-beta`` shares one bin; ``>= 1``.
    phases : tuple of str
        Forward phases the server prunes, a subset of :data:`PHASES`.
    min_tokens, max_tokens : int or None
        Prune only layer calls whose count of real tokens lies in ``[min_tokens, max_tokens]``.
    scope : {"batch", "request"}
        ``moe-spec`` in a verify batch: one top-``max_experts`` for the whole batch, or one per
        request (each request's D draft tokens), keeping the union.
    depth_decay : float or None
        Speculative verify: a draft node at depth d (0 = the root) votes with weight
        ``depth_decay ** d``, so deep nodes, which are less likely to be accepted, count less;
        ``0 < depth_decay <= 1``; None (default) weighs every node equally.  Not for ``lynx``,
        whose votes are bin counts.
    budget_allocation : {"uniform", "calibrated"}
        ``moe-spec``: ``max_experts`` in every layer, or per-layer budgets that average
        ``max_experts`` and go where the calibration file's coverage curves say they cover the most
        router selections (:meth:`StaticRanking.layer_budgets`).
    """

    policy: str = "none"
    k0: int = 2
    budget: int = 12
    request_budget: int = 4
    rank_budget: int = 5
    max_experts: int | None = None
    tau: float = 0.9
    score: str | None = None
    coverage: str = "substitution"
    ranking: str = "router"
    static_ranking_path: str | None = None
    alpha: float = 2.0
    beta: int = 4
    phases: tuple[str, ...] = DEFAULT_PHASES
    min_tokens: int | None = None
    max_tokens: int | None = None
    scope: str = "batch"
    depth_decay: float | None = None
    budget_allocation: str = "uniform"
    _static_ranking: StaticRanking | None = field(default=None, init=False, repr=False, compare=False)
    # (top_k, num_experts, num_layers) shapes validate_for_model has accepted
    _accepted_models: set = field(default_factory=set, init=False, repr=False, compare=False)

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        _check_choice("policy", self.policy, POLICIES)
        for name in ("k0", "budget", "request_budget", "rank_budget"):
            _check_int(name, getattr(self, name), 0)
        _check_int("max_experts", self.max_experts, 1, optional=True)
        tau = _check_real("tau", self.tau)
        if not 0.0 < tau <= 1.0:
            raise _fail("tau", self.tau, "must lie in (0, 1]")
        _check_choice("score", self.score, SCORES, optional=True)
        _check_choice("coverage", self.coverage, COVERAGES)
        _check_choice("ranking", self.ranking, RANKINGS)
        alpha = _check_real("alpha", self.alpha)
        if alpha <= 0.0:
            raise _fail("alpha", self.alpha, "must be > 0")
        _check_int("beta", self.beta, 1)
        _check_int("min_tokens", self.min_tokens, 0, optional=True)
        _check_int("max_tokens", self.max_tokens, 1, optional=True)
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", self.min_tokens, f"must not exceed max_tokens={self.max_tokens}")
        _check_choice("scope", self.scope, SCOPES)
        _check_choice("budget_allocation", self.budget_allocation, BUDGET_ALLOCATIONS)
        if self.depth_decay is not None:
            decay = _check_real("depth_decay", self.depth_decay)
            if not 0.0 < decay <= 1.0:
                raise _fail(
                    "depth_decay", self.depth_decay, "must lie in (0, 1], or be null to weigh every node equally"
                )
            if self.policy == "lynx":
                raise _fail(
                    "depth_decay",
                    self.depth_decay,
                    "policy 'lynx' ranks experts by counts of logit bins, which cannot be weighted; "
                    "leave depth_decay unset or choose another policy",
                )
            object.__setattr__(self, "depth_decay", decay)
        if self.scope == "request" and self.ranking == "static":
            raise _fail(
                "scope",
                "request",
                "ranking='static' has one ranking for every request; scope='request' needs ranking='router'",
            )
        object.__setattr__(self, "tau", tau)
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "phases", self._normalized_phases(self.phases))

        if self.policy == "moe-spec" and self.max_experts is None:
            raise _fail(
                "max_experts",
                None,
                "policy 'moe-spec' needs max_experts, its expert budget B "
                "(MoE-Spec uses 16-64 of 128 experts for Qwen3-30B-A3B)",
            )
        if self.scope == "request" and self.ranking in ("coverage", "coactivation"):
            raise _fail(
                "scope",
                "request",
                f"ranking={self.ranking!r} ranks the whole batch; scope='request' needs ranking='router'",
            )
        reads_file = self._reads_calibration_file()
        for name, value, used, wanted in (
            ("ranking", self.ranking, self.ranking != "router", self.ranking in FILE_RANKINGS),
            ("budget_allocation", self.budget_allocation, self.budget_allocation != "uniform", True),
        ):
            if used and self.policy != "moe-spec":
                raise _fail(name, value, f"only policy 'moe-spec' takes {name}={value!r}, not {self.policy!r}")
            if used and wanted and self.static_ranking_path is None:
                raise _fail(
                    "static_ranking_path",
                    None,
                    f"{name}={value!r} needs the calibration file `xshare-sglang calibrate` writes",
                )
        if self.static_ranking_path is not None and not reads_file:
            raise _fail(
                "static_ranking_path",
                self.static_ranking_path,
                "the calibration file is only read by policy='moe-spec' with ranking='static' or 'coactivation', "
                "or budget_allocation='calibrated'",
            )
        if self.static_ranking_path is not None:
            if not isinstance(self.static_ranking_path, (str, os.PathLike)):
                raise _fail("static_ranking_path", self.static_ranking_path, "must be a file path")
            object.__setattr__(self, "static_ranking_path", os.fspath(self.static_ranking_path))
            ranking = load_static_ranking(self.static_ranking_path)
            for name, value, table, wanted in (
                ("ranking", "coactivation", ranking.coactivation, self.ranking == "coactivation"),
                ("budget_allocation", "calibrated", ranking.budget_curves, self.budget_allocation == "calibrated"),
            ):
                if wanted and table is None:
                    raise _fail(
                        "static_ranking_path",
                        self.static_ranking_path,
                        f"{name}={value!r} needs a file with "
                        f"{'co-activation counts' if name == 'ranking' else 'budget curves'}; write one with "
                        "`xshare-sglang calibrate --from-trace` or from a per_token recorder dump",
                    )
            object.__setattr__(self, "_static_ranking", ranking)

    def _reads_calibration_file(self) -> bool:
        return self.policy == "moe-spec" and (self.ranking in FILE_RANKINGS or self.budget_allocation == "calibrated")

    @staticmethod
    def _normalized_phases(phases: Any) -> tuple[str, ...]:
        if isinstance(phases, str):
            phases = [p.strip() for p in phases.split(",") if p.strip()]
        if not isinstance(phases, (list, tuple)) or not phases:
            raise _fail("phases", phases, f"must be a non-empty list drawn from {', '.join(PHASES)}")
        for phase in phases:
            if phase not in PHASES:
                raise _fail("phases", phase, f"each phase must be one of {', '.join(PHASES)}")
        return tuple(p for p in PHASES if p in phases)

    def validate_for_model(self, *, top_k: int, num_experts: int | None = None, num_layers: int | None = None) -> None:
        """Checks that need the model's routing shape.

        Parameters
        ----------
        top_k : int
            Routed experts per token.
        num_experts : int, optional
            Routed experts per MoE layer (E).
        num_layers : int, optional
            Layers the static ranking is indexed by.

        Raises
        ------
        ConfigError
            ``k0 > top_k`` for a warm-up policy, or a static ranking whose shape does not match.
        """
        shape = (top_k, num_experts, num_layers)
        if shape in self._accepted_models:
            return
        _check_int("top_k", top_k, 1)
        if self.policy in WARMUP_POLICIES and self.k0 > top_k:
            raise _fail("k0", self.k0, f"must be <= the model's top_k={top_k}")
        ranking = self._static_ranking
        if ranking is not None:
            if num_experts is not None and ranking.num_experts != num_experts:
                raise _fail(
                    "static_ranking_path",
                    self.static_ranking_path,
                    f"the file ranks {ranking.num_experts} experts per layer, the model has {num_experts}",
                )
            if num_layers is not None and ranking.num_layers != num_layers:
                raise _fail(
                    "static_ranking_path",
                    self.static_ranking_path,
                    f"the file has {ranking.num_layers} layers, the model has {num_layers}",
                )
        self._accepted_models.add(shape)

    # ------------------------------------------------------------------ derived values
    @property
    def effective_score(self) -> str:
        """The score actually aggregated: ``score`` or the policy's default (``topk`` for ``moe-spec``
        with ``ranking="coverage"``, whose per-token coverage is of the token's own routing)."""
        if self.score is not None:
            return self.score
        if self.policy == "moe-spec" and self.ranking == "coverage":
            return "topk"
        return DEFAULT_SCORE[self.policy]

    @property
    def static_ranking(self) -> StaticRanking | None:
        """The parsed calibration file (``moe-spec`` with a ranking other than ``router``, or
        calibrated budgets)."""
        return self._static_ranking

    def layer_budget(self, layer_id: int | None) -> int:
        """``moe-spec``'s budget in one layer: ``max_experts``, or the calibrated per-layer budget.

        ``layer_id`` may be omitted only when the calibration file has a single layer.
        """
        if self.budget_allocation == "uniform" or self._static_ranking is None:
            return self.max_experts
        ranking = self._static_ranking
        layer = layer_id
        if layer is None:
            if ranking.num_layers != 1:
                raise ValueError(
                    "budget_allocation='calibrated' needs layer_id: "
                    f"the calibration file has {ranking.num_layers} layers"
                )
            layer = 0
        if not 0 <= layer < ranking.num_layers:
            raise ValueError(f"layer_id={layer} is outside the calibration file's {ranking.num_layers} layers")
        return ranking.layer_budgets(self.max_experts)[layer]

    def policy_parameters(self) -> dict[str, Any]:
        """The fields the chosen policy reads, by name (for labels and logs)."""
        used: dict[str, tuple[str, ...]] = {
            "none": (),
            "oea": ("k0",),
            "xshare": ("k0", "budget"),
            "xshare-threshold": ("k0", "tau"),
            "xshare-spec": ("k0", "request_budget", "budget"),
            "xshare-ep": ("k0", "rank_budget"),
            "moe-spec": ("max_experts", "ranking", "scope"),
            "lynx": ("alpha", "beta"),
        }
        params = {name: getattr(self, name) for name in used[self.policy]}
        if self.policy not in ("none", "moe-spec") and self.max_experts is not None:
            params["max_experts"] = self.max_experts
        if self.policy == "moe-spec" and self.budget_allocation != "uniform":
            params["budget_allocation"] = self.budget_allocation
        if self.policy != "none" and self.depth_decay is not None:
            params["depth_decay"] = self.depth_decay
        return params

    def summary(self) -> str:
        """One line naming the policy and every setting that affects it, for logs."""
        parts = [f"policy={self.policy}"]
        parts += [f"{name}={value}" for name, value in self.policy_parameters().items()]
        if self.policy != "none":
            parts.append(f"score={self.effective_score}")
            parts.append(f"coverage={self.coverage}")
            parts.append(f"phases={','.join(self.phases)}")
            if self.min_tokens is not None or self.max_tokens is not None:
                parts.append(f"tokens=[{self.min_tokens or 0},{self.max_tokens or 'inf'}]")
        return " ".join(parts)

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The public field names, in their documented order (the stable API's first)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    def check_field_names(cls, names: Iterable[str]) -> None:
        """Raise :class:`ConfigError` (blaming the first) when some of ``names`` are not fields."""
        fields = cls.field_names()
        unknown = sorted(set(names) - set(fields))
        if unknown:
            raise ConfigError(
                unknown[0],
                f"PrunerConfig has no field(s) {', '.join(map(repr, unknown))}; the fields are {', '.join(fields)}",
            )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of every public field; ``PrunerConfig.from_dict`` reads it back."""
        out = {name: getattr(self, name) for name in self.field_names()}
        out["phases"] = list(self.phases)
        return out

    def to_json(self, **kwargs: Any) -> str:
        """JSON text of :meth:`to_dict`."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PrunerConfig:
        """Build from a mapping of field names; unknown keys are an error, not ignored."""
        if not isinstance(data, Mapping):
            raise ConfigError("", f"PrunerConfig needs a JSON object / mapping, got {type(data).__name__}")
        cls.check_field_names(data)
        kwargs = dict(data)
        if isinstance(kwargs.get("phases"), list):
            kwargs["phases"] = tuple(kwargs["phases"])
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> PrunerConfig:
        """Build from JSON text holding an object of field names."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("", f"PrunerConfig JSON is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PrunerConfig:
        """Build from a JSON file."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError("", f"PrunerConfig file {os.fspath(path)!r} does not exist")
        return cls.from_json(p.read_text())

    @classmethod
    def load(cls, spec: str | os.PathLike[str] | Mapping[str, Any]) -> PrunerConfig:
        """Build from a mapping, JSON text (starts with ``{``), or the path of a JSON file."""
        if isinstance(spec, Mapping):
            return cls.from_dict(spec)
        text = os.fspath(spec)
        if text.lstrip().startswith("{"):
            return cls.from_json(text)
        return cls.from_file(text)

    def __str__(self) -> str:
        return self.to_json()
