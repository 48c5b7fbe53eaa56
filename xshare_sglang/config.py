"""``PrunerConfig``: the one frozen, validated description of what the pruner does.

Every entry point (the SGLang flags, the environment variable, ``Engine(...)`` users, the offline
tools) builds one of these and nothing else.  Construction validates every field and raises
``ValueError`` naming the field, the offending value and what is allowed, so a bad value fails at
start-up and never half-way through serving.

Checks that need the model (``k0 <= top_k``; the expert and layer counts of a static ranking file)
live in :meth:`PrunerConfig.validate_for_model`, which the server calls once it knows the model and
:func:`xshare_sglang.select_experts_mask` calls on every use.
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
RANKINGS: tuple[str, ...] = ("router", "static")
# What one ``moe-spec`` budget covers in a speculative verify batch: the whole batch (one top-B), or
# each request's draft tree (a top-B per request, the union kept).
SCOPES: tuple[str, ...] = ("batch", "request")
# SGLang forward modes the pruner can act on: plain decode, EAGLE target verify, prefill/extend and
# mixed (chunked-prefill) batches.  Prefill and mixed batches are compute-bound and sensitive to
# routing changes (LYNX section 3.3), hence off by default.
PHASES: tuple[str, ...] = ("decode", "verify", "extend", "mixed")
DEFAULT_PHASES: tuple[str, ...] = ("decode", "verify")

# Score each policy aggregates when ``score`` is left unset (DESIGN section 4).
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

STATIC_RANKING_FORMAT = "xshare-sglang.static-ranking"
STATIC_RANKING_VERSION = 1


@dataclass(frozen=True)
class StaticRanking:
    """Per-layer expert selection counts read from a calibration file (MoE-Spec eq. 4).

    Attributes
    ----------
    counts : tuple of tuple of float
        ``counts[layer][expert]``, shape ``[num_layers][num_experts]``, non-negative.
    model : str or None
        The model the counts were collected on, if the file says.
    """

    counts: tuple[tuple[float, ...], ...]
    model: str | None = None
    _on_device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.counts)

    @property
    def num_experts(self) -> int:
        return len(self.counts[0])

    def layer_positions(self, layer: int, device: Any) -> Any:
        """Place of every expert of one layer in the ranking (count desc, index asc), int32 [E].

        Computed once per device from the counts and reused: the kernels and the reference keep
        the experts whose place is below the budget, with no float64 work per call.
        """
        import torch

        key = ("positions", str(device))
        if key not in self._on_device:
            counts = torch.tensor(self.counts, dtype=torch.float64)
            order = torch.sort(counts, dim=-1, descending=True, stable=True).indices
            places = torch.empty_like(order).scatter_(-1, order, torch.arange(self.num_experts).expand_as(order))
            self._on_device[key] = places.to(dtype=torch.int32, device=device)
        return self._on_device[key][layer]


def _fail(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"PrunerConfig.{name}={value!r} is invalid: {allowed}")


def load_static_ranking(path: str | os.PathLike[str]) -> StaticRanking:
    """Read and validate a static-ranking file.

    The file is JSON::

        {"format": "xshare-sglang.static-ranking", "version": 1,
         "num_layers": L, "num_experts": E,
         "counts": [[c_0, ..., c_{E-1}], ...],      # L rows, layer order of the model
         "model": "Qwen/Qwen3-30B-A3B"}              # optional

    Raises
    ------
    ValueError
        If the file is missing, is not JSON, or does not have the shape above.  The message names
        ``static_ranking_path`` and says what is wrong.
    """
    name = "static_ranking_path"
    p = Path(path)
    if not p.is_file():
        raise _fail(name, str(path), "no such file (expected a JSON static-ranking file)")
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(name, str(path), f"not a readable JSON file ({exc})") from None
    if not isinstance(doc, dict):
        raise _fail(name, str(path), "the file must hold a JSON object")
    if doc.get("format") != STATIC_RANKING_FORMAT or doc.get("version") != STATIC_RANKING_VERSION:
        raise _fail(
            name,
            str(path),
            f'expected "format": "{STATIC_RANKING_FORMAT}" and "version": {STATIC_RANKING_VERSION}, '
            f"got format={doc.get('format')!r} version={doc.get('version')!r}",
        )
    counts = doc.get("counts")
    if not isinstance(counts, list) or not counts:
        raise _fail(name, str(path), '"counts" must be a non-empty list of per-layer lists')
    rows: list[tuple[float, ...]] = []
    for layer, row in enumerate(counts):
        if not isinstance(row, list) or not row:
            raise _fail(name, str(path), f'"counts"[{layer}] must be a non-empty list of numbers')
        for value in row:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise _fail(
                    name,
                    str(path),
                    f'"counts"[{layer}] holds {value!r}; counts must be finite numbers >= 0',
                )
        rows.append(tuple(float(v) for v in row))
    widths = {len(r) for r in rows}
    if len(widths) != 1:
        raise _fail(name, str(path), f"every layer must list the same number of experts, got {sorted(widths)}")
    for key, actual in (("num_layers", len(rows)), ("num_experts", len(rows[0]))):
        if key in doc and doc[key] != actual:
            raise _fail(name, str(path), f'"{key}" says {doc[key]!r} but "counts" has {actual}')
    model = doc.get("model")
    return StaticRanking(counts=tuple(rows), model=model if isinstance(model, str) else None)


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
    ranking : {"router", "static"}
        ``moe-spec`` ranks experts by the batch's router scores, or by calibration counts.
    static_ranking_path : str or None
        The static-ranking JSON file, required with ``ranking="static"``.
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
    _static_ranking: StaticRanking | None = field(default=None, init=False, repr=False, compare=False)

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
        if self.ranking == "static":
            if self.policy != "moe-spec":
                raise _fail("ranking", "static", f"only policy 'moe-spec' reads a static ranking, not {self.policy!r}")
            if self.static_ranking_path is None:
                raise _fail("static_ranking_path", None, "ranking='static' needs the path of a static-ranking file")
        elif self.static_ranking_path is not None:
            raise _fail(
                "static_ranking_path",
                self.static_ranking_path,
                "a ranking file is only read with policy='moe-spec' and ranking='static'",
            )
        if self.static_ranking_path is not None:
            if not isinstance(self.static_ranking_path, (str, os.PathLike)):
                raise _fail("static_ranking_path", self.static_ranking_path, "must be a file path")
            object.__setattr__(self, "static_ranking_path", os.fspath(self.static_ranking_path))
            object.__setattr__(self, "_static_ranking", load_static_ranking(self.static_ranking_path))

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
        ValueError
            ``k0 > top_k`` for a warm-up policy, or a static ranking whose shape does not match.
        """
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

    # ------------------------------------------------------------------ derived values
    @property
    def effective_score(self) -> str:
        """The score actually aggregated: ``score`` or the policy's default."""
        return self.score if self.score is not None else DEFAULT_SCORE[self.policy]

    @property
    def static_ranking(self) -> StaticRanking | None:
        """The parsed static-ranking file (``ranking="static"`` only)."""
        return self._static_ranking

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
        """The public field names, in DESIGN section 4 order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

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
            raise ValueError(f"PrunerConfig needs a JSON object / mapping, got {type(data).__name__}")
        names = cls.field_names()
        unknown = sorted(set(data) - set(names))
        if unknown:
            raise ValueError(
                f"PrunerConfig has no field(s) {', '.join(map(repr, unknown))}; the fields are {', '.join(names)}"
            )
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
            raise ValueError(f"PrunerConfig JSON is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PrunerConfig:
        """Build from a JSON file."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"PrunerConfig file {os.fspath(path)!r} does not exist")
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
