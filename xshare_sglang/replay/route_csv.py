"""Reader for the ``route_trace v1`` CSV format of the public top-k routing traces we ship.

One file holds one sequence: for every generation step and MoE layer, the token's top-k experts and
their renormalized router weights.  See ``xshare_sglang/data/route_traces/README.md``.
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from ..files import InputFileError, existing_file

PHASES = {"prefill": 0, "decode": 1}
BUNDLED_TRACES = {"gptoss": "gptoss.route.csv", "gemma": "gemma.route.csv"}


@dataclass(frozen=True)
class RouteTrace:
    """The top-k routing of one sequence, one phase.

    Attributes
    ----------
    name : str
    model : str
        Model file named in the trace header.
    num_layers, num_experts, top_k : int
    expert_bytes : tuple of int
        Bytes of one expert's weights, per layer, as the header states.
    ids : Tensor, shape [N, L, top_k], int64
        Expert of each slot; ``-1`` where a layer was not recorded for a step.
    weights : Tensor, shape [N, L, top_k], float32
        Router weight of each slot (renormalized over the token's top-k).
    """

    name: str
    model: str
    num_layers: int
    num_experts: int
    top_k: int
    expert_bytes: tuple[int, ...]
    ids: torch.Tensor
    weights: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    def logits(self, layer: int) -> torch.Tensor:
        """Router logits that reproduce the trace at one layer, shape [N, E], float32.

        A listed expert gets ``log(weight)``; softmax over the listed experts then gives back the
        recorded weights, and differences between listed logits equal the true logit differences.
        Unlisted experts get ``-inf`` (not scored).
        """
        out = torch.full((self.num_tokens, self.num_experts), float("-inf"))
        ids = self.ids[:, layer]
        listed = ids >= 0
        rows = torch.arange(self.num_tokens)[:, None].expand_as(ids)
        out[rows[listed], ids[listed]] = torch.log(self.weights[:, layer][listed])
        return out


def _header_fields(line: str) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", line))


def load_route_csv(path: str | Path, *, phase: str = "decode", name: str | None = None) -> RouteTrace:
    """Read one ``route_trace v1`` file.

    Parameters
    ----------
    path : str or Path
    phase : {"decode", "prefill"}
        Which steps to keep.
    name : str, optional
        Label for reports (default: the file name without ``.route.csv``).

    Raises
    ------
    ValueError
        If the file is not a ``route_trace v1`` file or is inconsistent.
    """
    if phase not in PHASES:
        raise ValueError(f"phase={phase!r} is invalid: choose one of {', '.join(PHASES)}")
    path = existing_file(path, "a route_trace v1 CSV file")
    header: dict[str, str] = {}
    expert_bytes: dict[int, int] = {}
    data_lines: list[tuple[int, str]] = []
    try:
        with path.open(newline="") as handle:
            first = handle.readline()
            if not first.startswith("# route_trace v1"):
                raise InputFileError(f"{path}: not a route_trace v1 file (first line {first.strip()[:80]!r})")
            for number, line in enumerate(handle, start=2):
                if line.startswith("#"):
                    fields = _header_fields(line)
                    if "layer" in fields and "expert_bytes" in fields:
                        expert_bytes[int(fields["layer"])] = int(fields["expert_bytes"])
                    else:
                        header.update(fields)
                elif line.strip():
                    data_lines.append((number, line))
    except UnicodeDecodeError:
        raise InputFileError(f"{path}: not a route_trace v1 file (not text)") from None
    except ValueError as exc:
        if isinstance(exc, InputFileError):
            raise
        raise InputFileError(f"{path}: malformed route_trace header line ({exc})") from None
    try:
        num_layers = int(header["n_layer"])
        num_experts = int(header["n_expert"])
        top_k = int(header["n_expert_used"])
    except KeyError as exc:
        raise InputFileError(f"{path}: the route_trace header lacks {exc.args[0]}") from None
    except ValueError as exc:
        raise InputFileError(f"{path}: malformed route_trace header ({exc})") from None

    wanted = PHASES[phase]
    slots: dict[int, dict[tuple[int, int], tuple[int, float]]] = {}
    columns = None
    for number, line in data_lines:
        values = next(csv.reader([line]))
        if columns is None:
            columns = values
            missing = {"phase", "step", "layer", "slot", "expert", "weight"} - set(columns)
            if missing:
                raise InputFileError(f"{path}: the column line lacks {', '.join(sorted(missing))}")
            continue
        if len(values) != len(columns):
            raise InputFileError(
                f"{path}: line {number} has {len(values)} of {len(columns)} columns (the file is cut short or "
                f"malformed): {line.strip()[:80]!r}"
            )
        row = dict(zip(columns, values, strict=True))
        try:
            if int(row["phase"]) != wanted:
                continue
            step, layer, slot = int(row["step"]), int(row["layer"]), int(row["slot"])
            expert, weight = int(row["expert"]), float(row["weight"])
        except ValueError:
            raise InputFileError(
                f"{path}: line {number} holds a value that is not a number: {line.strip()[:80]!r}"
            ) from None
        if not (0 <= layer < num_layers and 0 <= slot < top_k and 0 <= expert < num_experts):
            raise InputFileError(f"{path}: line {number} is out of range: {line.strip()[:80]!r}")
        if not math.isfinite(weight) or weight <= 0:
            raise InputFileError(f"{path}: line {number} has a weight that is not positive: {line.strip()[:80]!r}")
        slots.setdefault(step, {})[(layer, slot)] = (expert, weight)
    if not slots:
        raise InputFileError(f"{path}: no {phase} rows")
    steps = sorted(slots)
    ids = torch.full((len(steps), num_layers, top_k), -1, dtype=torch.int64)
    weights = torch.zeros((len(steps), num_layers, top_k), dtype=torch.float32)
    for i, step in enumerate(steps):
        for (layer, slot), (expert, weight) in slots[step].items():
            ids[i, layer, slot] = expert
            weights[i, layer, slot] = weight
    return RouteTrace(
        name=name or path.name.removesuffix(".route.csv"),
        model=Path(header.get("model", "unknown")).name,
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
        expert_bytes=tuple(expert_bytes.get(layer, 0) for layer in range(num_layers)),
        ids=ids,
        weights=weights,
    )


def bundled_trace_path(name: str) -> Path:
    """Path of a trace shipped in the package: ``"gptoss"`` or ``"gemma"``."""
    if name not in BUNDLED_TRACES:
        raise ValueError(f"unknown bundled trace {name!r}: choose one of {', '.join(BUNDLED_TRACES)}")
    root = resources.files("xshare_sglang") / "data" / "route_traces" / BUNDLED_TRACES[name]
    return Path(str(root))
