"""Speculative decoding: the layout of EAGLE verify batches and the votes of draft nodes.

* :mod:`.layout` - which rows belong to which request (``[i*D, (i+1)*D)``), how many are real, and
  each draft node's depth in its tree;
* :mod:`.tree` - which draft nodes can still be accepted (reachable from the root);
* :mod:`.votes` - the weight each node's routing vote carries (depth decay, 0 for nodes that can
  never be accepted).

Everything here is device work with static shapes, so it can be recorded into CUDA graphs.
"""

from .layout import VerifyLayout, draft_depths
from .tree import acceptable_nodes
from .votes import vote_weights

__all__ = ["VerifyLayout", "acceptable_nodes", "draft_depths", "vote_weights"]
