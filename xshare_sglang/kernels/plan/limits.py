"""The kernels' limits: what a call may be to run on them, and those that depend on its token count T.

A call outside the fixed limits (:data:`MAX_EXPERTS`, ...) goes to the torch reference
(:func:`xshare_sglang.kernels.launch.unsupported_reason`).  The T-dependent ones are one value,
:class:`PlanLimits`.

Every served call plans with :data:`PRODUCTION_LIMITS`.  A test may pass lower limits to
:func:`~xshare_sglang.kernels.prune_route` or :func:`~xshare_sglang.kernels.select_keep_mask`
(``limits=``): a call of a few dozen rows then takes the launches a served call takes only from about
a thousand rows (several programs of several tiles each, a partial last program, the co-activation
picks without packed keys), which Triton's interpreter runs in a fraction of the time.  The limits
change what is launched, never the answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_EXPERTS = 512
MAX_TOP_K = 16
MAX_GROUPS = 32
MAX_TOKENS_PER_REQUEST = 64
MAX_LYNX_BETA = 14
MAX_TOKENS = 1 << 22  # aggregates stay below 2**56 (E * 2**24 per token at most)
MAX_COVERAGE_TOKENS = 1024  # ranking=coverage keeps every row's scores in the workspace
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

MAX_PARTS = 128  # programs of the selection at most: one wave on an H100's or H200's 132 SMs
#: Co-activation gains (an aggregate of at most T * 2**24 times a factor of at most 2**16) fit one packed
#: key with the index, gain << 10 | (1023 - e), below the 2**62 the warp maxima take: gain < 2**52, T < 4096.
MAX_KEYED_COACT_TOKENS = 4095


@dataclass(frozen=True)
class PlanLimits:
    """The T-dependent limits of :func:`~xshare_sglang.kernels.plan.plan_call`.

    A limit may be lowered, never raised: the production values are the largest the kernels are
    exact with (the packed keys) or are tuned for (one wave of programs).

    Parameters
    ----------
    max_parts : int
        Programs of the selection at most, from 2 to :data:`MAX_PARTS` (one program holds a call of
        one tile of rows or one request only; above, the rows are split over at most this many).
    max_keyed_coact_tokens : int
        The co-activation ranking takes each pick as the maximum of one packed int64 key in calls of
        at most this many tokens (``COACT_KEYS``), from 0 to :data:`MAX_KEYED_COACT_TOKENS`; above,
        as a (gain, index) maximum.
    """

    max_parts: int = MAX_PARTS
    max_keyed_coact_tokens: int = MAX_KEYED_COACT_TOKENS

    def __post_init__(self) -> None:
        if not 2 <= self.max_parts <= MAX_PARTS:
            raise ValueError(f"max_parts={self.max_parts}: must be from 2 to {MAX_PARTS}")
        if not 0 <= self.max_keyed_coact_tokens <= MAX_KEYED_COACT_TOKENS:
            raise ValueError(
                f"max_keyed_coact_tokens={self.max_keyed_coact_tokens}: must be from 0 to {MAX_KEYED_COACT_TOKENS}"
            )


#: The limits of every served call.
PRODUCTION_LIMITS = PlanLimits()
