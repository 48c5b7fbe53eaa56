"""AFTER ``sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.load_batch``
(checked: decode_cuda_graph_runner.py:1521; sets ``raw_num_token`` at :1695, 0.5.23).

Why: a replayed decode/verify graph was captured for a padded batch size; the real-token count
changes every step and only the host knows it.  Padding rows must not vote and must route to -1.
How: after SGLang loaded the batch into its static buffers, write ``raw_num_token`` into the
plugin's device buffer that the captured selection reads, and for verify graphs that weigh votes the
draft nodes the root can still reach (device-side fills and copies on the current stream, no host
sync).  Only for the target model's runner.
Remove when: SGLang refills ``num_token_non_padded`` on every replay, not only with DP/EP padding.
"""

from __future__ import annotations

from ..runtime import get_runtime
from ..verify_scope import refill_graph_inputs

TARGET = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.load_batch"
KIND = "after"


def hook(result, self, *args, **kwargs):
    runtime = get_runtime()
    if runtime is not None and runtime.runner is self.model_runner:
        forward_batch = args[0] if args else kwargs.get("forward_batch")
        refill_graph_inputs(runtime, self, forward_batch)
    return None
