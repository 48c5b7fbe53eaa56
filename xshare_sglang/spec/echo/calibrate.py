"""Offline calibration of ECHO's gates from logged draft confidences and acceptances.

Input: an *ECHO log*, JSON lines, one per sampled verify step (written by the server with
``--xshare-echo-log-dir`` and by ``xshare-sglang spec-eval``)::

    {"num_steps": S, "topk": K, "num_draft_tokens": D,
     "confidence": [[c_1, ..., c_S], ...],   # one row per request: c[i, d] (candidates.layer_confidence)
     "accepted": [L, ...]}                   # draft tokens accepted per request, the bonus token excluded

For every depth d, a request's sample is *positive* when its accepted length reached d (L >= d) and
*negative* otherwise; the AUC of ``c[:, d]`` between the two groups (Mann-Whitney U over n_pos x
n_neg, ties counting one half) says how well the confidence at d predicts that depth d survives
verification.  The gate threshold is the one that maximises Youden's J = TPR - FPR for "pass when
c > threshold" (ties go to the lowest threshold: the gate that truncates least).

Which depths are gated (ECHO's sweet spots): the root's children (depth 1) and the deepest drafted
depth whenever their AUC beats chance, and every other depth whose AUC reaches ``auc_threshold``;
a depth with fewer than ``min_samples`` positives or negatives is never gated.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

FORMAT = "xshare-echo-calibration"
VERSION = 1
DEFAULT_AUC_THRESHOLD = 0.75
DEFAULT_MIN_SAMPLES = 20


@dataclass(frozen=True)
class EchoLogRecord:
    """One logged verify step."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    confidence: list[list[float]]
    accepted: list[int]

    def __post_init__(self) -> None:
        if len(self.confidence) != len(self.accepted):
            raise ValueError(f"{len(self.confidence)} confidence rows for {len(self.accepted)} accepted lengths")
        for row in self.confidence:
            if len(row) != self.num_steps:
                raise ValueError(f"a confidence row has {len(row)} depths, expected num_steps={self.num_steps}")
        for length in self.accepted:
            if not 0 <= length <= self.num_steps:
                raise ValueError(f"accepted length {length} outside [0, num_steps={self.num_steps}]")

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


def read_echo_log(paths: str | Path | Iterable[str | Path]) -> list[EchoLogRecord]:
    """Records from ECHO log files (``*.jsonl``; a folder reads every ``*.jsonl`` inside, sorted)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for path in map(Path, paths):
        if path.is_dir():
            files.extend(sorted(path.glob("*.jsonl")))
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"ECHO log {path}: no such file or folder")
    if not files:
        raise ValueError(f"ECHO log {', '.join(map(str, paths))}: no *.jsonl files")
    records = []
    for file in files:
        with open(file) as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    records.append(EchoLogRecord(**json.loads(line)))
                except (TypeError, ValueError) as exc:
                    raise ValueError(f"{file}:{number}: not an ECHO log record ({exc})") from None
    if not records:
        raise ValueError(f"ECHO log {', '.join(map(str, files))}: no records")
    shapes = {(r.num_steps, r.topk, r.num_draft_tokens) for r in records}
    if len(shapes) != 1:
        raise ValueError(f"ECHO log mixes draft shapes (num_steps, topk, draft tokens): {sorted(shapes)}")
    return records


def depth_auc(confidence: Sequence[float], positive: Sequence[bool]) -> float:
    """P(c of a positive > c of a negative) + half the ties; NaN when a class is empty."""
    conf = np.asarray(confidence, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    if pos.all() or not pos.any():
        return math.nan
    from scipy.stats import mannwhitneyu  # imported here: only offline calibration needs scipy

    return float(mannwhitneyu(conf[pos], conf[~pos]).statistic / (pos.sum() * (~pos).sum()))


def youden_threshold(confidence: Sequence[float], positive: Sequence[bool]) -> tuple[float, float, float, float]:
    """The gate ``c > threshold`` that maximises TPR - FPR.

    Returns
    -------
    (threshold, J, TPR, FPR); threshold is one of the observed values (the lowest among equal J), or
    -inf when no gate beats passing everyone.
    """
    conf = np.asarray(confidence, dtype=np.float64)
    pos = np.asarray(positive, dtype=bool)
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return -math.inf, 0.0, 1.0, 1.0
    values = np.unique(conf)  # ascending
    # samples strictly above each candidate threshold
    tpr = np.array([(conf[pos] > v).sum() for v in values]) / n_pos
    fpr = np.array([(conf[~pos] > v).sum() for v in values]) / n_neg
    j = tpr - fpr
    best = int(np.argmax(j))  # first maximum = lowest threshold
    if j[best] <= 0.0:
        return -math.inf, 0.0, 1.0, 1.0
    return float(values[best]), float(j[best]), float(tpr[best]), float(fpr[best])


@dataclass(frozen=True)
class DepthReport:
    depth: int
    samples: int
    positives: int
    auc: float
    threshold: float
    youden_j: float
    tpr: float
    fpr: float
    gated: bool


@dataclass(frozen=True)
class EchoCalibration:
    """ECHO's gates: which depths are checked and their thresholds.

    Attributes
    ----------
    num_steps, topk, num_draft_tokens : int
        The draft shape the log came from; the server refuses a calibration of another depth.
    gates : dict[int, float]
        Gated depth (1-based) -> threshold.
    depths : list[DepthReport]
        Every depth's numbers (for the report).
    """

    num_steps: int
    topk: int
    num_draft_tokens: int
    gates: dict[int, float]
    auc_threshold: float = DEFAULT_AUC_THRESHOLD
    records: int = 0
    depths: list[DepthReport] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps={self.num_steps} must be >= 1")
        for depth, threshold in self.gates.items():
            if not 1 <= depth <= self.num_steps:
                raise ValueError(f"gate at depth {depth} outside 1..num_steps={self.num_steps}")
            if not isinstance(threshold, (int, float)) or math.isnan(threshold):
                raise ValueError(f"gate at depth {depth}: threshold {threshold!r} is not a number")

    def gate_tensors(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gated [S] bool, thresholds [S] float32)`` for :func:`~.schedule.echo_schedule`."""
        gated = torch.zeros(self.num_steps, dtype=torch.bool)
        thresholds = torch.zeros(self.num_steps, dtype=torch.float32)
        for depth, threshold in self.gates.items():
            gated[depth - 1] = True
            thresholds[depth - 1] = threshold
        return gated.to(device), thresholds.to(device)

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "num_steps": self.num_steps,
            "topk": self.topk,
            "num_draft_tokens": self.num_draft_tokens,
            "auc_threshold": self.auc_threshold,
            "records": self.records,
            "gates": [{"depth": d, "threshold": t} for d, t in sorted(self.gates.items())],
            "depths": [
                {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in asdict(r).items()}
                for r in self.depths
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> EchoCalibration:
        """Read and validate a calibration file written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"ECHO calibration {path}: not a readable JSON file ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"ECHO calibration {path}: not an {FORMAT} file (run `xshare-sglang echo-calibrate`)")
        if data.get("version") != VERSION:
            raise ValueError(f"ECHO calibration {path}: version {data.get('version')!r}, this build reads {VERSION}")
        try:
            gates = {int(g["depth"]): float(g["threshold"]) for g in data["gates"]}
            return cls(
                num_steps=int(data["num_steps"]),
                topk=int(data["topk"]),
                num_draft_tokens=int(data["num_draft_tokens"]),
                gates=gates,
                auc_threshold=float(data.get("auc_threshold", DEFAULT_AUC_THRESHOLD)),
                records=int(data.get("records", 0)),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"ECHO calibration {path}: missing or malformed field ({exc})") from None
        except ValueError as exc:
            raise ValueError(f"ECHO calibration {path}: {exc}") from None


def calibrate(
    records: Sequence[EchoLogRecord],
    *,
    auc_threshold: float = DEFAULT_AUC_THRESHOLD,
    min_samples: int = DEFAULT_MIN_SAMPLES,
) -> EchoCalibration:
    """Per-depth AUC, Youden thresholds and the gated depths of an ECHO log (see the module doc)."""
    if not 0.5 <= auc_threshold <= 1.0:
        raise ValueError(f"auc_threshold={auc_threshold} must lie in [0.5, 1]")
    if min_samples < 1:
        raise ValueError(f"min_samples={min_samples} must be >= 1")
    if not records:
        raise ValueError("no ECHO log records to calibrate from")
    first = records[0]
    conf = np.array([row for r in records for row in r.confidence], dtype=np.float64).reshape(-1, first.num_steps)
    accepted = np.array([length for r in records for length in r.accepted], dtype=np.int64)
    reports, gates = [], {}
    for depth in range(1, first.num_steps + 1):
        positive = accepted >= depth
        auc = depth_auc(conf[:, depth - 1], positive)
        threshold, j, tpr, fpr = youden_threshold(conf[:, depth - 1], positive)
        enough = min(int(positive.sum()), int((~positive).sum())) >= min_samples
        anchor = depth in (1, first.num_steps)
        gated = bool(
            enough
            and math.isfinite(threshold)
            and not math.isnan(auc)
            and (auc >= auc_threshold or (anchor and auc > 0.5))
        )
        if gated:
            gates[depth] = threshold
        reports.append(DepthReport(depth, len(accepted), int(positive.sum()), auc, threshold, j, tpr, fpr, gated))
    return EchoCalibration(
        num_steps=first.num_steps,
        topk=first.topk,
        num_draft_tokens=first.num_draft_tokens,
        gates=gates,
        auc_threshold=auc_threshold,
        records=len(records),
        depths=reports,
    )
