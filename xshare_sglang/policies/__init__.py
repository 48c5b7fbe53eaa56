"""Pure-torch reference of every selection policy (DESIGN section 4).

The specification in code: the kernels must produce the same masks bit for bit, the CPU path uses it
directly, and the GPU path falls back to it where the kernels do not apply.
"""

from .api import POLICY_FUNCTIONS, select_experts_mask
from .oracle import OracleRanking, oracle_ranking
from .routing import route_within
from .scores import SCORE_ONE, SCORINGS, sanitize_logits, token_scores

__all__ = [
    "POLICY_FUNCTIONS",
    "SCORE_ONE",
    "SCORINGS",
    "OracleRanking",
    "oracle_ranking",
    "route_within",
    "sanitize_logits",
    "select_experts_mask",
    "token_scores",
]
