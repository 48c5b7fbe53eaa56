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
