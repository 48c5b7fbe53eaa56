"""AROUND ``sglang.srt.speculative.eagle_utils.organize_draft_results`` (checked: eagle_utils.py:100,
called at eagle_worker_v2.py:919 through the name ``eagle_worker_v2`` imported, which HookRegistry's
propagation rebinds; 0.5.23).

Why: ECHO needs every draft candidate (path probability, token, parent), and this is the last place
that sees them all: SGLang keeps only its global top-(D - 1) afterwards.
How: run SGLang's function unchanged, then copy the candidates into buffers owned by the ECHO
runtime.  The function runs inside the draft CUDA graph, so the hook does tensor ``copy_`` only and
the copy replays with the graph.  Not reached by topk = 1 chains (refused at start-up).
Remove when: SGLang exposes the draft candidates to a tree-selection policy of its own.
"""

from __future__ import annotations

from ..echo_runtime import get_echo_runtime

TARGET = "sglang.srt.speculative.eagle_utils.organize_draft_results"
KIND = "around"


def hook(original, score_list, token_list, parents_list, *args, **kwargs):
    result = original(score_list, token_list, parents_list, *args, **kwargs)
    runtime = get_echo_runtime()
    if runtime is not None:
        runtime.stash(score_list, token_list, parents_list)
    return result
