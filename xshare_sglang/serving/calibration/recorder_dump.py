"""SGLang expert-distribution recorder dumps -> per-layer expert counts -> the static-ranking file.

SGLang's recorder (``sglang/srt/eplb/expert_distribution.py``, 0.5.23) writes its dump with
``torch.save`` into ``SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR`` (default ``/tmp``); this module finds
such dumps in a folder, reads and validates them, sums their logical expert counts
(:func:`read_dump`), and writes the JSON file that ``--moe-pruner moe-spec --moe-pruner-ranking static
--moe-pruner-static-ranking-path`` reads (:func:`write_static_ranking`, checked with
:func:`xshare_sglang.calibration_file.load_static_ranking` before it replaces the target).  Driving a server's
recorder is :mod:`xshare_sglang.serving.calibration.recorder_client`'s job.

Dump layouts
------------
* ``stat`` / ``stat_approx``: one file ``expert_distribution_recorder_{time.time()}.pt`` from rank 0
  (expert_distribution.py:982-1006) holding ``{"rank", "logical_count", "average_utilization_rate_over_window"}``;
  ``logical_count`` is ``int32 [passes, num_layers, num_logical_experts]``: one slice per recorded forward
  pass, already mapped from physical to logical experts and summed over ranks.  The buffer is circular
  with ``--expert-distribution-recorder-buffer-size`` slices (default 1000): start the server with
  ``--expert-distribution-recorder-buffer-size -1`` to keep every pass of the workload.
* ``per_pass`` / ``per_token``: one file ``expert_distribution_recorder_{time.time()}_{rank}.pt`` per rank
  (expert_distribution.py:938-947) holding ``{"records": [...], "last_physical_to_logical_map"}``; each
  record's ``global_physical_count`` is ``[num_layers, num_physical_experts]``.  Physical experts
  (EPLB replicas included) are folded onto logical experts with ``last_physical_to_logical_map``, as
  SGLang's own EPLB simulator reader does.

Rows are indexed by model layer id (SGLang sizes them with the model's ``num_hidden_layers``), so the
rows of dense layers are present and zero.  Counts summed over ranks scale with the number of ranks
that see the same tokens (plain TP); the ranking is unaffected.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...calibration_file import STATIC_RANKING_FORMAT, STATIC_RANKING_VERSION, StaticRanking, load_static_ranking
from ...files import load_tensors
from .routing_stats import RoutingStats

logger = logging.getLogger(__name__)

# expert_distribution_recorder_{time.time()}.pt (stat) or ..._{time.time()}_{rank}.pt (per_pass, per_token)
_DUMP_NAME = re.compile(r"^expert_distribution_recorder_(\d+(?:\.\d+)?)(?:_(\d+))?\.pt$")
# Per-rank files of one dump are written within moments of each other.
_SAME_DUMP_S = 60.0
# Experts per layer whose share of the selections :meth:`ExpertCounts.top_share` reports by default.
TOP_SHARE = 8


class CalibrationError(Exception):
    """Calibration cannot go on; the message says what is wrong and what to do."""


# ------------------------------------------------------------------------------------ dump files


@dataclass(frozen=True)
class DumpFile:
    """One recorder dump file in a folder.

    Attributes
    ----------
    path : Path
    time : float
        The ``time.time()`` the server put in the file name.
    rank : int or None
        The rank of a ``per_pass`` / ``per_token`` file; None for a ``stat`` file.
    """

    path: Path
    time: float
    rank: int | None


def list_dumps(folder: str | os.PathLike[str]) -> list[DumpFile]:
    """Every recorder dump file (``expert_distribution_recorder_*.pt``) in ``folder``, oldest first."""
    found = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    for path in entries:
        match = _DUMP_NAME.match(path.name)
        if match and path.is_file():
            rank = int(match.group(2)) if match.group(2) is not None else None
            found.append(DumpFile(path=path, time=float(match.group(1)), rank=rank))
    return sorted(found, key=lambda d: (d.time, d.path.name))


def newest_dump(dumps: Iterable[DumpFile]) -> list[DumpFile]:
    """The files of the newest dump: one ``stat`` file, or the newest file of each rank of a per-rank dump.

    Returns
    -------
    list of DumpFile
        Empty when ``dumps`` is.
    """
    dumps = sorted(dumps, key=lambda d: (d.time, d.path.name))
    if not dumps:
        return []
    newest = dumps[-1]
    if newest.rank is None:
        return [newest]
    by_rank: dict[int, DumpFile] = {}
    for dump in dumps:
        if dump.rank is not None and newest.time - dump.time <= _SAME_DUMP_S:
            by_rank[dump.rank] = dump
    return [by_rank[rank] for rank in sorted(by_rank)]


def dump_paths(path: str | os.PathLike[str]) -> list[Path]:
    """A dump file, or the files of the newest dump in a folder.

    Raises
    ------
    CalibrationError
        No such file, or a folder without recorder dumps.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        chosen = newest_dump(list_dumps(p))
        if not chosen:
            raise CalibrationError(
                f"--from-dump {p}: the folder holds no expert_distribution_recorder_*.pt file of SGLang's recorder"
            )
        return [d.path for d in chosen]
    raise CalibrationError(f"--from-dump {p}: no such file or folder")


# ---------------------------------------------------------------------------------- dump reading


@dataclass(frozen=True)
class ExpertCounts:
    """Per-layer expert selection counts read from one or more recorder dumps.

    Attributes
    ----------
    counts : torch.Tensor
        int64 ``[num_layers, num_logical_experts]``, indexed by model layer id.
    forward_passes : int
        Recorded forward passes that selected at least one expert (``stat``: non-zero buffer slices;
        ``per_pass``/``per_token``: records, summed over ranks).
    files : tuple of Path
    kinds : tuple of str
        ``"stat"`` or ``"per_pass"`` per file (``per_token`` files have the ``per_pass`` layout),
        or ``"trace"``.
    stats : RoutingStats or None
        Co-activation counts and budget curves, when the source kept each pass's top-k ids
        (``per_token`` dumps, traces).
    """

    counts: torch.Tensor
    forward_passes: int
    files: tuple[Path, ...]
    kinds: tuple[str, ...]
    stats: RoutingStats | None = None

    @property
    def num_layers(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    @property
    def selections(self) -> int:
        """Expert selections counted, over all layers."""
        return int(self.counts.sum())

    def counted_layers(self) -> list[int]:
        """Layer ids with at least one selection (the MoE layers the workload reached)."""
        return [layer for layer in range(self.num_layers) if int(self.counts[layer].sum()) > 0]

    def top_share(self, k: int = TOP_SHARE) -> dict[int, float]:
        """Per counted layer, the share of its selections that went to its ``k`` most-picked experts."""
        k = min(k, self.num_experts)
        out = {}
        for layer in self.counted_layers():
            row = self.counts[layer].double()
            out[layer] = float(row.topk(k).values.sum() / row.sum())
        return out


def _bad_dump(path: Path, why: str) -> CalibrationError:
    return CalibrationError(f"{path} is not an expert-distribution dump of SGLang's recorder: {why}")


def _count_tensor(path: Path, name: str, value: Any, dims: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise _bad_dump(path, f"{name} is {type(value).__name__}, not a tensor")
    if value.dim() not in dims:
        raise _bad_dump(path, f"{name} has shape {list(value.shape)}; expected {' or '.join(map(str, dims))} dims")
    if value.is_floating_point():
        if not bool(torch.isfinite(value).all()) or not bool((value == value.round()).all()):
            raise _bad_dump(path, f"{name} holds values that are not whole numbers")
    elif value.dtype == torch.bool or value.is_complex():
        raise _bad_dump(path, f"{name} has dtype {value.dtype}; expected integer counts")
    value = value.to(torch.int64)
    if value.numel() and int(value.min()) < 0:
        raise _bad_dump(path, f"{name} holds negative counts")
    return value


def _read_stat(path: Path, data: dict) -> tuple[torch.Tensor, int]:
    count = _count_tensor(path, '"logical_count"', data["logical_count"], (2, 3))
    if count.dim() == 2:
        count = count.unsqueeze(0)
    passes = int((count.flatten(1).sum(1) > 0).sum()) if count.numel() else 0
    return count.sum(0), passes


def _add_token_picks(path: Path, stats: RoutingStats, index: int, record: dict, mapping: torch.Tensor) -> None:
    """Add one ``per_token`` record's top-k ids (physical, ``[layers, T, k]``) to ``stats``, one group."""
    ids = record["topk_ids_of_layer"]
    if (
        not isinstance(ids, torch.Tensor)
        or ids.dim() != 3
        or ids.is_floating_point()
        or ids.shape[0] != mapping.shape[0]
    ):
        raise _bad_dump(path, f'record {index} "topk_ids_of_layer" must be an integer [num_layers, T, k] tensor')
    ids = ids.to(torch.int64).cpu()
    valid = (ids >= 0) & (ids < mapping.shape[1])
    for layer in range(ids.shape[0]):
        logical = torch.where(valid[layer], mapping[layer][ids[layer].clamp(0, mapping.shape[1] - 1)], -1)
        if bool(valid[layer].any()):
            stats.add(layer, logical)


def _read_per_pass(path: Path, data: dict) -> tuple[torch.Tensor, int, RoutingStats | None]:
    mapping = data.get("last_physical_to_logical_map")
    if not isinstance(mapping, torch.Tensor) or mapping.dim() != 2 or mapping.is_floating_point():
        raise _bad_dump(path, '"last_physical_to_logical_map" must be an integer [num_layers, num_physical] tensor')
    mapping = mapping.to(torch.int64).cpu()
    if mapping.numel() == 0 or int(mapping.min()) < 0:
        raise _bad_dump(path, '"last_physical_to_logical_map" is empty or holds negative expert ids')
    records = data["records"]
    if not isinstance(records, list):
        raise _bad_dump(path, f'"records" is {type(records).__name__}, not a list')
    physical = torch.zeros(mapping.shape, dtype=torch.int64)
    passes = 0
    stats = None
    for i, record in enumerate(records):
        if not isinstance(record, dict) or "global_physical_count" not in record:
            raise _bad_dump(path, f'record {i} has no "global_physical_count"')
        count = _count_tensor(path, f'record {i} "global_physical_count"', record["global_physical_count"], (2,))
        if tuple(count.shape) != tuple(mapping.shape):
            raise _bad_dump(
                path,
                f'record {i} "global_physical_count" has shape {list(count.shape)}, '
                f"the physical-to-logical map {list(mapping.shape)}",
            )
        physical += count.cpu()
        passes += int(count.sum() > 0)
        if "topk_ids_of_layer" in record:
            if stats is None:
                stats = RoutingStats.empty(mapping.shape[0], int(mapping.max()) + 1)
            _add_token_picks(path, stats, i, record, mapping)
    # Fold replicas onto their logical expert: every logical expert has at least one physical slot.
    logical = torch.zeros((mapping.shape[0], int(mapping.max()) + 1), dtype=torch.int64)
    logical.scatter_add_(1, mapping, physical)
    return logical, passes, stats


def read_dump(paths: Sequence[str | os.PathLike[str]]) -> ExpertCounts:
    """Read recorder dump files and sum their logical expert counts.

    Parameters
    ----------
    paths : sequence of path
        Files written by SGLang's ``dump_record`` (``stat``, ``stat_approx``, ``per_pass`` or
        ``per_token`` mode).  Several files are summed: the per-rank files of one ``per_pass`` dump, or
        dumps of several runs of the same model.

    Returns
    -------
    ExpertCounts

    Raises
    ------
    CalibrationError
        A file that cannot be read, does not hold a recorder dump, or disagrees with the others in shape.
    """
    if not paths:
        raise CalibrationError("no dump file to read")
    total: torch.Tensor | None = None
    passes = 0
    stats: RoutingStats | None = None
    stats_files = 0
    kinds = []
    files = tuple(Path(p) for p in paths)
    for path in files:
        data = load_tensors(path, "an SGLang expert-distribution recorder dump")  # InputFileError: exit 2
        if not isinstance(data, dict):
            raise _bad_dump(path, f"it holds a {type(data).__name__}, not a dict")
        if "logical_count" in data:
            counts, n = _read_stat(path, data)
            kinds.append("stat")
        elif "records" in data:
            counts, n, file_stats = _read_per_pass(path, data)
            kinds.append("per_pass")
            if file_stats is not None:
                stats_files += 1
                if stats is None:
                    stats = file_stats
                elif file_stats.coactivation.shape == stats.coactivation.shape:
                    stats.merge(file_stats)
        else:
            raise _bad_dump(
                path,
                f'it has keys {sorted(map(str, data))}; a stat dump has "logical_count", '
                'a per_pass/per_token dump "records" and "last_physical_to_logical_map"',
            )
        if total is not None and total.shape != counts.shape:
            raise CalibrationError(
                f"{path} counts {counts.shape[0]} layers x {counts.shape[1]} experts, but {files[0]} "
                f"counts {total.shape[0]} x {total.shape[1]}: dumps of different models cannot be summed"
            )
        total = counts if total is None else total + counts
        passes += n
    assert total is not None
    if total.numel() == 0:
        raise _bad_dump(files[0], "its counts are empty (no layers or no experts)")
    if stats is not None and stats_files != len(files):
        logger.warning(
            "only %d of %d dump files hold per-token top-k ids (per_token mode): no co-activation counts or budget "
            "curves are written",
            stats_files,
            len(files),
        )
        stats = None
    return ExpertCounts(counts=total, forward_passes=passes, files=files, kinds=tuple(kinds), stats=stats)


# ------------------------------------------------------------------------------- ranking file


def ranking_document(counts: ExpertCounts, model: str | None = None) -> dict[str, Any]:
    """The calibration file's JSON object for ``counts`` (see
    :func:`xshare_sglang.calibration_file.load_static_ranking`)."""
    doc: dict[str, Any] = {
        "format": STATIC_RANKING_FORMAT,
        "version": STATIC_RANKING_VERSION,
        "num_layers": counts.num_layers,
        "num_experts": counts.num_experts,
        "counts": counts.counts.tolist(),
    }
    if counts.stats is not None:
        doc["coactivation"] = counts.stats.coactivation.round().long().tolist()
        doc["budget_curves"] = [[round(v, 6) for v in row] for row in counts.stats.budget_curves().tolist()]
    if model:
        doc["model"] = model
    return doc


def write_static_ranking(counts: ExpertCounts, path: str | os.PathLike[str], model: str | None = None) -> StaticRanking:
    """Write the static-ranking file and return it as :func:`load_static_ranking` reads it back.

    The file is written next to ``path`` under a temporary name, loaded with ``load_static_ranking``
    and only then moved to ``path``, so ``path`` never holds a file the pruner would refuse.

    Raises
    ------
    CalibrationError
        The counts are all zero (nothing was recorded), or the written file does not load.
    """
    if counts.selections == 0:
        raise CalibrationError(
            f"the dump ({', '.join(map(str, counts.files))}) counted no expert selection: no traffic reached the "
            "server while it recorded, or every pick was pruned (calibrate with --moe-pruner none)"
        )
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(ranking_document(counts, model)) + "\n", encoding="utf-8")
        try:
            load_static_ranking(tmp)
        except ValueError as exc:
            raise CalibrationError(f"the written ranking does not load: {exc}") from None
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return load_static_ranking(out)
