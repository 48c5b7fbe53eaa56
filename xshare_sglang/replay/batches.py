"""Batches built from one recorded sequence: R requests x D consecutive tokens each.

The sequence is cut into R equal segments, one per request.  A batch takes D consecutive tokens from
every segment at the same offset; the offset then advances by D, so the batches of one shape do not
overlap.  Rows are request-major (request r owns rows ``[r*D, (r+1)*D)``), the layout the server's
EAGLE verify batches have and ``xshare-spec`` expects.  D = 1 is a plain decode batch of R requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BatchShape:
    """R requests x D tokens per request."""

    requests: int
    tokens_per_request: int

    @classmethod
    def parse(cls, text: str) -> BatchShape:
        """Read ``"RxD"``, e.g. ``"8x1"`` or ``"4x4"``."""
        try:
            requests, tokens = (int(part) for part in text.lower().split("x"))
        except ValueError:
            raise ValueError(f"batch shape {text!r} is invalid: write RxD, e.g. 8x1 or 4x4") from None
        if requests < 1 or tokens < 1:
            raise ValueError(f"batch shape {text!r} is invalid: R and D must be >= 1")
        return cls(requests, tokens)

    def __str__(self) -> str:
        return f"{self.requests}x{self.tokens_per_request}"


def segment_batches(num_tokens: int, shape: BatchShape) -> list[torch.Tensor]:
    """Row indices of every batch of ``shape`` that fits in a sequence of ``num_tokens``.

    Returns
    -------
    list of Tensor, each shape [R*D], int64
        Empty when a segment is shorter than D.
    """
    segment = num_tokens // shape.requests
    d = shape.tokens_per_request
    starts = torch.arange(shape.requests)[:, None] * segment + torch.arange(d)[None, :]
    return [(starts + offset).reshape(-1) for offset in range(0, segment - d + 1, d)]


SCENARIOS = ("single", "mixed")


def split_sequences(sequences: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """At least ``count`` sequences: when there are fewer, each is cut into equal consecutive pieces
    (a long single-request trace stands in for several requests)."""
    if len(sequences) >= count or not sequences:
        return list(sequences)
    pieces = -(-count // len(sequences))
    out = []
    for seq in sequences:
        length = len(seq) // pieces
        out += [seq[i * length : (i + 1) * length] for i in range(pieces)]
    return out


def _batches_of_group(group: list[torch.Tensor], d: int) -> list[torch.Tensor]:
    """Request-major batches: D consecutive tokens of every sequence at offsets 0, D, 2D, ..."""
    shortest = min(len(seq) for seq in group)
    stacked = torch.stack([seq[:shortest] for seq in group])
    return [stacked[:, offset : offset + d].reshape(-1) for offset in range(0, shortest - d + 1, d)]


def single_load_batches(by_source: dict[str, list[torch.Tensor]], shape: BatchShape) -> list[torch.Tensor]:
    """Batches whose R requests all come from one source; every source in turn.

    Parameters
    ----------
    by_source : dict of str to list of Tensor
        Token indices of each request, grouped by source (``TokenTable.sequences()``).

    Returns
    -------
    list of Tensor, each shape [R*D], int64 (request-major)
    """
    r = shape.requests
    out = []
    for sequences in by_source.values():
        pieces = split_sequences(sequences, r)
        for g in range(len(pieces) // r):
            out += _batches_of_group(pieces[g * r : (g + 1) * r], shape.tokens_per_request)
    return out


def mixed_load_batches(
    by_source: dict[str, list[torch.Tensor]], shape: BatchShape, share: float = 0.25
) -> list[torch.Tensor]:
    """Batches where ``round(share * R)`` requests (at least 1) come from one source and the rest
    from the other sources in turn, as in XShare's mixed-load experiments; every source takes the
    focus in turn.

    Raises
    ------
    ValueError
        With fewer than two sources, or ``share`` outside (0, 1).
    """
    if len(by_source) < 2:
        raise ValueError(f"mixed-load batches need two or more sources, the trace has {list(by_source) or 'none'}")
    if not 0 < share < 1:
        raise ValueError(f"mixed-load share={share} is invalid: it must be in (0, 1)")
    r = shape.requests
    focus_count = min(r - 1, max(1, round(share * r))) if r > 1 else 1
    other_count = r - focus_count
    out = []
    for focus, sequences in by_source.items():
        focus_pieces = split_sequences(sequences, focus_count)
        other_lists = [split_sequences(seqs, other_count) for name, seqs in by_source.items() if name != focus]
        others = [seq for group in zip(*other_lists, strict=False) for seq in group]  # round-robin
        groups = len(focus_pieces) // focus_count
        if other_count:
            groups = min(groups, len(others) // other_count)
        for g in range(groups):
            group = focus_pieces[g * focus_count : (g + 1) * focus_count]
            group += others[g * other_count : (g + 1) * other_count]
            out += _batches_of_group(group, shape.tokens_per_request)
    return out


def build_batches(
    by_source: dict[str, list[torch.Tensor]], shape: BatchShape, scenario: str, share: float = 0.25
) -> list[torch.Tensor]:
    """Batches of one scenario: ``single`` or ``mixed`` (D > 1 makes either a speculative batch)."""
    if scenario == "single":
        return single_load_batches(by_source, shape)
    if scenario == "mixed":
        return mixed_load_batches(by_source, shape, share)
    raise ValueError(f"scenario={scenario!r} is invalid: choose one of {', '.join(SCENARIOS)}")
