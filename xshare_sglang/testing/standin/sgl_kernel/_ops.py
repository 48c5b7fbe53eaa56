"""Torch implementations of the ``sgl_kernel`` CPU ops the stand-in provides, and the error of the rest."""

from __future__ import annotations

from collections.abc import Callable

import torch


def unavailable(name: str) -> Callable[..., None]:
    """An op that SGLang imports but the stand-in does not implement: calling it raises."""

    def op(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available on CPU: xshare_sglang.testing's sgl_kernel stand-in "
            "does not implement it (the feature that calls it cannot run in a CPU test server)"
        )

    op.__name__ = op.__qualname__ = name
    return op


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write newly allocated KV-cache slots into each request's row of the request-to-token table.

    Parameters
    ----------
    req_pool_indices : Tensor [B], integer
        Row of ``req_to_token`` owned by each request.
    req_to_token : Tensor [R, pool_len], integer
        Modified in place: ``req_to_token[req_pool_indices[b], start_offset[b]:end_offset[b]]``
        receives request b's slice of ``out_cache_loc``.
    start_offset, end_offset : Tensor [B], integer
        Positions of the new tokens of each request.
    out_cache_loc : Tensor [sum(end - start)], integer
        The new slots, request after request.
    pool_len : int
        Row length of ``req_to_token`` (checked against the table).
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len={pool_len} but req_to_token has rows of {req_to_token.shape[1]}")
    lengths = (end_offset - start_offset).long()
    if bool((lengths < 0).any()):
        raise ValueError("end_offset is before start_offset for some request")
    sources = torch.cumsum(lengths, 0) - lengths
    for row, start, length, source in zip(
        req_pool_indices.tolist(), start_offset.tolist(), lengths.tolist(), sources.tolist(), strict=True
    ):
        req_to_token[row, start : start + length] = out_cache_loc[source : source + length].to(req_to_token.dtype)
