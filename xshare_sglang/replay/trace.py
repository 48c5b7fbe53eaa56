"""The ``xshare-trace`` format (version 1): what the router saw, layer call by layer call.

A trace file is one ``torch.save`` archive holding only tensors, strings, numbers, lists and dicts,
so :func:`load_trace` reads it with ``torch.load(weights_only=True)`` (no pickled code runs)::

    {
      "format": "xshare-trace", "version": 1,
      "meta": {"model": str, "num_layers": int, "num_experts": int, "top_k": int,
               "scoring": "softmax" | "sigmoid", "renormalize": bool,
               "expert_bytes": [int] * num_layers,        # bytes of one expert's weights, per layer
               "sources": {request_id: label}},           # e.g. the domain or data set of a request
      "calls": [                                          # one entry per recorded MoE layer call
        {"step": int, "layer": int, "phase": "decode" | "verify" | "extend" | "mixed",
         "request_ids": int64 [T],                        # the request each row belongs to
         "logits": float16/bfloat16/float32 [T, E]        # router logits, or instead:
         "topk_ids": int64 [T, k], "topk_weights": float32 [T, k],    # top-k only (-1 = none)
         "keep": bool [E]},                               # optional: the keep mask a pruning server used
        ...
      ],
    }

Calls of one ``step`` are the layers of one forward; every layer of a step lists the same rows.  A
trace with top-k only cannot say how a token would route to an expert it did not pick: replay gives
such tokens ``-inf`` logits outside their top-k (so substitution acts as truncation for them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..files import InputFileError, load_tensors

TRACE_FORMAT = "xshare-trace"
TRACE_VERSION = 1
TRACE_PHASES = ("decode", "verify", "extend", "mixed")
SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class TraceMeta:
    """What a trace says about the model it was recorded from."""

    model: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: tuple[int, ...]
    scoring: str = "softmax"
    renormalize: bool = True
    sources: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"trace scoring={self.scoring!r} is invalid: choose one of {', '.join(SCORINGS)}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"trace top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if len(self.expert_bytes) != self.num_layers:
            raise ValueError(f"trace expert_bytes has {len(self.expert_bytes)} entries, expected num_layers")

    def source_of(self, request_id: int) -> str:
        return self.sources.get(int(request_id), "default")


@dataclass(frozen=True)
class LayerCall:
    """One recorded MoE layer call: T rows, with router logits or with top-k ids and weights."""

    step: int
    layer: int
    phase: str
    request_ids: torch.Tensor
    logits: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    keep: torch.Tensor | None = None  # [E] bool: the keep mask the recording server applied, if it pruned

    def __post_init__(self) -> None:
        if self.phase not in TRACE_PHASES:
            raise ValueError(f"call phase={self.phase!r} is invalid: choose one of {', '.join(TRACE_PHASES)}")
        rows = self.request_ids.shape[0]
        if (self.logits is None) == (self.topk_ids is None):
            raise ValueError("a layer call holds either logits or topk_ids + topk_weights, not both or neither")
        if self.logits is not None and (self.logits.dim() != 2 or self.logits.shape[0] != rows):
            raise ValueError(f"call logits must be [T={rows}, E], got {tuple(self.logits.shape)}")
        if self.topk_ids is not None:
            weights = self.topk_weights
            if weights is None or weights.shape != self.topk_ids.shape or self.topk_ids.shape[0] != rows:
                raise ValueError("call topk_ids and topk_weights must both be [T, k]")

    @property
    def num_rows(self) -> int:
        return self.request_ids.shape[0]

    def router_logits(self, num_experts: int) -> torch.Tensor:
        """Logits [T, E] float32; from top-k only: log(weight) on the listed experts, -inf elsewhere
        (softmax over them gives back the recorded weights)."""
        if self.logits is not None:
            return self.logits.float()
        out = torch.full((self.num_rows, num_experts), float("-inf"))
        listed = self.topk_ids >= 0
        rows = torch.arange(self.num_rows)[:, None].expand_as(self.topk_ids)
        out[rows[listed], self.topk_ids[listed]] = torch.log(self.topk_weights[listed].float())
        return out

    def natural_topk(self, meta: TraceMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """The unpruned routing: ids [T, k] int64 (-1 = none) and weights [T, k] float32."""
        if self.topk_ids is not None:
            return self.topk_ids.long(), self.topk_weights.float()
        logits = self.logits.float()
        scores = logits.softmax(dim=-1) if meta.scoring == "softmax" else logits.sigmoid()
        weights, ids = scores.topk(meta.top_k, dim=-1)
        if meta.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
        return ids, weights

    def to_dict(self) -> dict:
        out = {"step": self.step, "layer": self.layer, "phase": self.phase, "request_ids": self.request_ids}
        if self.logits is not None:
            out["logits"] = self.logits
        else:
            out["topk_ids"], out["topk_weights"] = self.topk_ids, self.topk_weights
        if self.keep is not None:
            out["keep"] = self.keep
        return out


@dataclass
class Trace:
    """A recorded trace: metadata and its layer calls in recording order."""

    meta: TraceMeta
    calls: list[LayerCall]
    name: str = "trace"

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        meta = {
            "model": self.meta.model,
            "num_layers": self.meta.num_layers,
            "num_experts": self.meta.num_experts,
            "top_k": self.meta.top_k,
            "scoring": self.meta.scoring,
            "renormalize": self.meta.renormalize,
            "expert_bytes": list(self.meta.expert_bytes),
            "sources": {int(k): v for k, v in self.meta.sources.items()},
        }
        payload = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "meta": meta,
            "calls": [c.to_dict() for c in self.calls],
        }
        torch.save(payload, path)
        return path

    def phases(self) -> list[str]:
        return sorted({c.phase for c in self.calls}, key=TRACE_PHASES.index)


def load_trace(path: str | Path, *, name: str | None = None) -> Trace:
    """Read an ``xshare-trace`` v1 file.

    Raises
    ------
    ValueError
        If the file is not an ``xshare-trace`` file, has another version, or is inconsistent.
    """
    path = Path(path)
    payload = load_tensors(path, "an xshare-trace file")
    if not isinstance(payload, dict) or payload.get("format") != TRACE_FORMAT:
        raise InputFileError(f"{path}: not an xshare-trace file (a torch.save archive without its format tag)")
    if payload.get("version") != TRACE_VERSION:
        raise ValueError(f"{path}: xshare-trace version {payload.get('version')} is not supported (this reads 1)")
    raw = payload["meta"]
    try:
        meta = TraceMeta(
            model=str(raw["model"]),
            num_layers=int(raw["num_layers"]),
            num_experts=int(raw["num_experts"]),
            top_k=int(raw["top_k"]),
            expert_bytes=tuple(int(b) for b in raw["expert_bytes"]),
            scoring=str(raw.get("scoring", "softmax")),
            renormalize=bool(raw.get("renormalize", True)),
            sources={int(k): str(v) for k, v in raw.get("sources", {}).items()},
        )
        calls = [
            LayerCall(
                step=int(c["step"]),
                layer=int(c["layer"]),
                phase=str(c["phase"]),
                request_ids=c["request_ids"].long(),
                logits=c.get("logits"),
                topk_ids=c.get("topk_ids"),
                topk_weights=c.get("topk_weights"),
                keep=c.get("keep"),
            )
            for c in payload["calls"]
        ]
    except KeyError as exc:
        raise InputFileError(f"{path}: xshare-trace without the field {exc.args[0]!r}") from None
    except (TypeError, AttributeError, ValueError) as exc:
        raise InputFileError(f"{path}: malformed xshare-trace ({exc})") from None
    for call in calls:
        if not 0 <= call.layer < meta.num_layers:
            raise ValueError(f"{path}: call of step {call.step} names layer {call.layer} of {meta.num_layers}")
        if call.logits is not None and call.logits.shape[1] != meta.num_experts:
            raise ValueError(f"{path}: call of step {call.step} has {call.logits.shape[1]} experts, not E")
    return Trace(meta, calls, name=name or path.name.split(".")[0])


def trace_from_route_csv(route) -> Trace:
    """Convert a :class:`~xshare_sglang.replay.route_csv.RouteTrace` (one request, top-k only)."""
    meta = TraceMeta(
        model=route.model,
        num_layers=route.num_layers,
        num_experts=route.num_experts,
        top_k=route.top_k,
        expert_bytes=route.expert_bytes,
        sources={0: route.name},
    )
    one = torch.zeros(1, dtype=torch.int64)
    calls = [
        LayerCall(
            step=step,
            layer=layer,
            phase="decode",
            request_ids=one,
            topk_ids=route.ids[step, layer][None].clone(),
            topk_weights=route.weights[step, layer][None].clone(),
        )
        for step in range(route.num_tokens)
        for layer in range(route.num_layers)
    ]
    return Trace(meta, calls, name=route.name)


def load_trace_dir(path: str | Path, *, name: str | None = None) -> Trace:
    """Read every ``*.pt`` file of a folder (e.g. a server's ``--moe-pruner-trace-dir``) as one trace,
    files in name order, their steps renumbered to stay distinct.

    Raises
    ------
    ValueError
        If the folder holds no trace file, or files that describe different models.
    """
    path = Path(path)
    files = sorted(path.glob("*.pt"))
    if not files:
        raise ValueError(f"{path}: no xshare-trace files (*.pt) in this folder")
    merged: Trace | None = None
    for file in files:
        part = load_trace(file)
        if merged is None:
            merged = Trace(part.meta, list(part.calls), name=name or path.name)
            continue
        if part.meta != merged.meta:
            raise ValueError(f"{file}: describes another model than {files[0].name} ({part.meta} vs {merged.meta})")
        offset = max(c.step for c in merged.calls) + 1
        merged.calls += [dataclasses.replace(c, step=c.step + offset) for c in part.calls]
    return merged
