"""Pure-torch reference of every selection policy: the normative semantics, in code.

The specification in code: the kernels must produce the same masks bit for bit, the CPU path uses it
directly, and the GPU path falls back to it where the kernels do not apply.
"""

from .api import POLICY_FUNCTIONS, select, select_experts_mask
from .call import RouterSpec, RoutingCall
from .oracle import OracleRanking, oracle_ranking
from .routing import route_within
from .scores import SCORE_ONE, SCORINGS, sanitize_logits, token_scores

__all__ = [
    "POLICY_FUNCTIONS",
    "SCORE_ONE",
    "SCORINGS",
    "OracleRanking",
    "RouterSpec",
    "RoutingCall",
    "oracle_ranking",
    "route_within",
    "sanitize_logits",
    "select",
    "select_experts_mask",
    "token_scores",
]
