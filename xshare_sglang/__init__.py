"""xshare-sglang: batch-shared expert selection for MoE decoding in SGLang.

Public API (stable: tests and tools outside the package call it)::

    from xshare_sglang import PrunerConfig, select_experts_mask, route_within

Importing this package imports torch but neither sglang nor triton; the SGLang plugin and the
Triton kernels load only when SGLang calls the plugin or a caller asks for the kernels.
"""

from .config import POLICIES, PrunerConfig
from .policies import oracle_ranking, route_within, select_experts_mask

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "PrunerConfig",
    "__version__",
    "oracle_ranking",
    "route_within",
    "select_experts_mask",
]
