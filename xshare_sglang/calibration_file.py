"""The calibration file: per-layer expert counts, co-activation counts and budget curves.

``xshare-sglang calibrate`` writes it; ``moe-spec`` reads it with ``ranking="static"`` (the counts),
``ranking="coactivation"`` (the co-activation counts) and ``budget_allocation="calibrated"`` (the
budget curves).  :func:`load_static_ranking` validates a file, :class:`StaticRanking` holds it and
caches what the kernels read on each device.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, invalid

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
    coactivation : Tensor, shape [num_layers, E, E], float64, or None
        ``coactivation[l, i, j]``: tokens that picked both ``i`` and ``j`` in layer ``l`` (the diagonal
        is each expert's own count).  Read by ``ranking="coactivation"``.
    budget_curves : Tensor, shape [num_layers, E + 1], float64, or None
        ``budget_curves[l, b]``: the share of a calibration batch's expert selections that its ``b``
        most-selected experts cover, averaged over batches (0 at ``b = 0``, 1 at ``b = E``).  Read by
        ``budget_allocation="calibrated"``.
    """

    counts: tuple[tuple[float, ...], ...]
    model: str | None = None
    coactivation: Any = field(default=None, repr=False, compare=False)
    budget_curves: Any = field(default=None, repr=False, compare=False)
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

        from .devices import canonical_device

        device = canonical_device(device)
        key = ("positions", device)
        if key not in self._on_device:
            counts = torch.tensor(self.counts, dtype=torch.float64)
            order = torch.sort(counts, dim=-1, descending=True, stable=True).indices
            places = torch.empty_like(order).scatter_(-1, order, torch.arange(self.num_experts).expand_as(order))
            self._on_device[key] = places.to(dtype=torch.int32, device=device)
        return self._on_device[key][layer]

    def layer_redundancy(self, layer: int, device: Any) -> Any:
        """Fixed-point redundancy of every expert pair of one layer, int32 [E, E] on ``device``.

        ``floor(2**16 * C[i, j] / sqrt(C[i, i] * C[j, j]))`` from the co-activation counts ``C``: how
        often ``i`` and ``j`` are picked by the same token, against how often each is picked (1.0, that
        is ``2**16``, on the diagonal; 0 when either expert was never picked).  Computed once per device.
        """
        import torch

        from .devices import canonical_device

        if self.coactivation is None:
            raise ValueError("the static-ranking file has no co-activation counts")
        device = canonical_device(device)
        key = ("redundancy", device)
        if key not in self._on_device:
            pairs = self.coactivation
            own = torch.diagonal(pairs, dim1=1, dim2=2)
            scale = torch.sqrt(own[:, :, None] * own[:, None, :])
            share = torch.where(scale > 0, pairs / scale.clamp(min=1e-300), 0.0).clamp(0.0, 1.0)
            fixed = torch.floor(share * float(1 << REDUNDANCY_BITS)).to(torch.int32)
            eye = torch.eye(self.num_experts, dtype=torch.bool)
            fixed = torch.where(eye, 1 << REDUNDANCY_BITS, fixed)
            self._on_device[key] = fixed.to(device)
        return self._on_device[key][layer]

    def layer_budgets(self, mean_budget: int) -> tuple[int, ...]:
        """Per-layer budgets averaging ``mean_budget`` that cover the most calibration selections.

        Over the layers whose curve is not all zero (the MoE layers calibration reached), budgets
        ``b_l`` in ``[1, E]`` with ``sum(b_l) = n * min(mean_budget, E)`` maximize
        ``sum_l budget_curves[l, b_l]``: starting from 1 each, the next expert goes to the layer where
        it adds the most coverage (ties to the layer with fewer experts so far, then the lower layer,
        so equal curves get equal budgets).  Every other layer gets ``mean_budget``.
        Cached per ``mean_budget``.
        """
        if self.budget_curves is None:
            raise ValueError("the static-ranking file has no budget curves")
        key = ("budgets", mean_budget)
        if key not in self._on_device:
            self._on_device[key] = allocate_layer_budgets(self.budget_curves.tolist(), mean_budget)
        return self._on_device[key]


REDUNDANCY_BITS = 16


def allocate_layer_budgets(curves: list[list[float]], mean_budget: int) -> tuple[int, ...]:
    """Greedy water-filling of ``n * mean_budget`` experts over the ``n`` layers with a non-zero curve
    (see :meth:`StaticRanking.layer_budgets`).  ``curves[l][b]``: coverage of ``b`` experts in layer ``l``."""
    import heapq

    num_experts = len(curves[0]) - 1
    per_layer = min(mean_budget, num_experts)
    active = [layer for layer, curve in enumerate(curves) if max(curve) > 0]
    budgets = [mean_budget] * len(curves)
    for layer in active:
        budgets[layer] = 1
    heap = [(-(curves[layer][2] - curves[layer][1]), 1, layer) for layer in active if num_experts > 1]
    heapq.heapify(heap)
    for _ in range(len(active) * (per_layer - 1)):
        _, _, layer = heapq.heappop(heap)
        budgets[layer] += 1
        b = budgets[layer]
        if b < num_experts:
            heapq.heappush(heap, (-(curves[layer][b + 1] - curves[layer][b]), b, layer))
    return tuple(budgets)


def _fail(name: str, value: Any, allowed: str) -> ConfigError:
    return invalid("PrunerConfig", name, value, allowed)


def load_static_ranking(path: str | os.PathLike[str]) -> StaticRanking:
    """Read and validate a static-ranking file.

    The file is JSON::

        {"format": "xshare-sglang.static-ranking", "version": 1,
         "num_layers": L, "num_experts": E,
         "counts": [[c_0, ..., c_{E-1}], ...],      # L rows, layer order of the model
         "model": "Qwen/Qwen3-30B-A3B"}              # optional

    A file is read once per process while it stays unchanged (same path, size and modification
    time): every config that names it (one per pruned phase, say) shares one :class:`StaticRanking`
    and the device copies it caches.

    Raises
    ------
    ConfigError
        If the file is missing, is not JSON, or does not have the shape above.  The message names
        ``static_ranking_path`` and says what is wrong.
    """
    p = Path(path)
    if not p.is_file():
        raise _fail("static_ranking_path", str(path), "no such file (expected a JSON static-ranking file)")
    stat = p.stat()
    key = (os.path.realpath(p), stat.st_size, stat.st_mtime_ns)
    if key not in _loaded:
        if len(_loaded) >= _MAX_LOADED:
            _loaded.clear()
        _loaded[key] = _read_static_ranking(p, str(path))
    return _loaded[key]


_MAX_LOADED = 8
_loaded: dict[tuple[str, int, int], StaticRanking] = {}


def _read_static_ranking(p: Path, path: str) -> StaticRanking:
    name = "static_ranking_path"
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
    num_layers, num_experts = len(rows), len(rows[0])
    coactivation = _optional_table(
        doc, "coactivation", (num_layers, num_experts, num_experts), str(path), "co-activation counts >= 0"
    )
    curves = _optional_table(
        doc, "budget_curves", (num_layers, num_experts + 1), str(path), "coverage shares in [0, 1]"
    )
    if curves is not None and bool(((curves < 0) | (curves > 1)).any()):
        raise _fail(name, str(path), '"budget_curves" must hold shares in [0, 1]')
    return StaticRanking(
        counts=tuple(rows),
        model=model if isinstance(model, str) else None,
        coactivation=coactivation,
        budget_curves=curves,
    )


def _optional_table(doc: dict, key: str, shape: tuple[int, ...], path: str, what: str) -> Any:
    """``doc[key]`` as a float64 tensor of ``shape`` with finite values >= 0, or None when absent."""
    import torch

    if key not in doc:
        return None
    dims = "[" + "][".join(str(d) for d in shape) + "]"
    try:
        table = torch.tensor(doc[key], dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        table = None
    if table is None or tuple(table.shape) != shape:
        got = "not a rectangular table of numbers" if table is None else f"shape {list(table.shape)}"
        raise _fail("static_ranking_path", path, f'"{key}" must be a {dims} table of {what}, got {got}')
    if not bool(torch.isfinite(table).all()) or bool((table < 0).any()):
        raise _fail("static_ranking_path", path, f'"{key}" must hold {what}')
    return table
