"""Rows of an EAGLE target-verify batch.

SGLang lays out a verify batch of R requests with D draft tokens each request-major: request i owns
rows ``[i*D, (i+1)*D)`` and row ``i*D`` is its tree's root (the last accepted token).  Under CUDA
graphs R is the captured (padded) batch size; only the first ``R_real * D`` rows are real.  The
positions of a request's rows are ``seq_len + depth`` (``eagle_utils.build_tree_kernel_efficient``),
so a node's depth is its position minus its root's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VerifyLayout:
    """R requests x D draft tokens, request-major.

    Attributes
    ----------
    num_requests : int
        R: requests the batch (or the captured graph) has room for, padding included.
    tokens_per_request : int
        D: draft tokens per request, the root included.
    """

    num_requests: int
    tokens_per_request: int

    def __post_init__(self) -> None:
        if self.num_requests < 0 or self.tokens_per_request < 1:
            raise ValueError(
                f"verify layout {self.num_requests} x {self.tokens_per_request} is invalid: "
                "needs requests >= 0 and tokens per request >= 1"
            )

    @classmethod
    def of_rows(cls, num_tokens: int, tokens_per_request: int) -> VerifyLayout:
        """The layout of ``num_tokens`` rows of D tokens each (``num_tokens`` must be a multiple of D)."""
        if tokens_per_request < 1 or num_tokens % tokens_per_request:
            raise ValueError(
                f"{num_tokens} verify rows do not split into requests of {tokens_per_request} draft tokens"
            )
        return cls(num_tokens // tokens_per_request, tokens_per_request)

    @property
    def num_tokens(self) -> int:
        """R * D rows."""
        return self.num_requests * self.tokens_per_request

    def num_real_tokens(self, num_real_requests: int) -> int:
        """Rows that belong to the first ``num_real_requests`` requests (the rest is padding)."""
        if not 0 <= num_real_requests <= self.num_requests:
            raise ValueError(f"{num_real_requests} real requests do not fit a layout of {self.num_requests}")
        return num_real_requests * self.tokens_per_request

    def request_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Request of every row, shape [R*D], int64: ``row // D``."""
        return torch.arange(self.num_tokens, device=device) // self.tokens_per_request

    def node_ids(self, device: torch.device | str | None = None) -> torch.Tensor:
        """Index of every row inside its request's tree, shape [R*D], int64: ``row % D`` (0 = root)."""
        return torch.arange(self.num_tokens, device=device) % self.tokens_per_request


def draft_depths(positions: torch.Tensor, tokens_per_request: int) -> torch.Tensor:
    """Depth of every draft node in its request's tree: its position minus its root's.

    Parameters
    ----------
    positions : Tensor, shape [R*D], integer
        The verify batch's positions (``seq_len + depth`` per row; padding rows hold anything).
    tokens_per_request : int
        D.

    Returns
    -------
    Tensor, shape [R*D], int64, in ``[0, D-1]`` (padding rows are clamped into that range).
    """
    num_tokens = positions.shape[0]
    layout = VerifyLayout.of_rows(num_tokens, tokens_per_request)
    per_request = positions.reshape(layout.num_requests, tokens_per_request).to(torch.int64)
    depths = per_request - per_request[:, :1]
    return depths.clamp(0, tokens_per_request - 1).reshape(-1)
