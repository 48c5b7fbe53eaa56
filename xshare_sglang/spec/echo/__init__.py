"""ECHO: elastic speculative budget with sparse confidence gating (ECHO paper, §3 and Alg. 1).

* :mod:`.candidates` - SGLang's draft candidates, path scores and layer confidence ``c[i, d]``;
* :mod:`.schedule` - the batch scheduler: one verification budget, gates at calibrated depths,
  depth for confident requests first, width at the truncation depth with what is left;
* :mod:`.select` - the scheduler's grants as draft nodes, the fixed-D verify slots and the cut of
  nodes outside the allocation;
* :mod:`.calibrate` - per-depth AUC, Youden thresholds and sweet-spot depths from logged
  confidences and accepted lengths;
* :mod:`.utility` - the batch objective and the marginal-utility exchange (ECHO Theorem 2).
"""

from .calibrate import EchoCalibration, EchoLogRecord, calibrate, read_echo_log
from .candidates import DraftCandidates, candidate_depths, layer_confidence
from .schedule import EchoAllocation, echo_schedule
from .select import allocate_nodes, cut_tree, static_slots, verify_slots
from .utility import batch_objective, greedy_allocation, improving_exchange, marginal_gain

__all__ = [
    "DraftCandidates",
    "EchoAllocation",
    "EchoCalibration",
    "EchoLogRecord",
    "allocate_nodes",
    "batch_objective",
    "calibrate",
    "candidate_depths",
    "cut_tree",
    "echo_schedule",
    "greedy_allocation",
    "improving_exchange",
    "layer_confidence",
    "marginal_gain",
    "read_echo_log",
    "static_slots",
    "verify_slots",
]
