"""AROUND ``sglang.srt.speculative.eagle_worker_common.build_eagle_verify_input`` (checked:
eagle_worker_common.py:377, called eagerly after the draft graph at eagle_worker_v2.py:717; 0.5.23).

Why: this is where the D - 1 draft nodes SGLang chose become the verify tree.  ECHO chooses them
instead (depth for confident requests, width at the truncation depth for the others, within a batch
budget), and nodes that fill a request's remaining slots must be cut so they are never accepted.
How: with the candidates the ``organize_draft_results`` hook stashed, compute the confidence and,
with a calibration, ECHO's slots; pass them to SGLang's function in place of its own; then cut the
links to slots outside the allocation in the returned ``retrieve_next_token`` /
``retrieve_next_sibling`` (in place: acceptance and the pruner's verify votes read those tensors).
The plan rides on the verify input for the ``eagle_sample`` hook.  On any failure SGLang's own
slots are used (a failed cut leaves a consistent, uncut tree).
Remove when: SGLang grows a per-request draft-budget policy hook.
"""

from __future__ import annotations

from ..echo_runtime import get_echo_runtime

TARGET = "sglang.srt.speculative.eagle_worker_common.build_eagle_verify_input"
KIND = "around"
PLAN_ATTRIBUTE = "_xshare_echo_plan"


def hook(original, batch, draft_input, parent_list, top_scores_index, draft_tokens, *args, **kwargs):
    runtime = get_echo_runtime()
    plan = None
    if runtime is not None and not batch.forward_mode.is_idle() and kwargs.get("topk", 1) > 1:
        try:
            plan = runtime.plan(
                batch.seq_lens.shape[0],
                num_steps=kwargs["num_steps"],
                topk=kwargs["topk"],
                num_draft_tokens=kwargs["num_draft_tokens"],
                top_scores_index=top_scores_index,
            )
        except Exception as exc:
            runtime.record_fault("ECHO scheduling", exc)
            plan = None
    if plan is not None and plan.top_scores_index is not None:
        top_scores_index = plan.top_scores_index.to(top_scores_index.dtype)
        draft_tokens = plan.draft_tokens.to(draft_tokens.dtype)
    verify_input = original(batch, draft_input, parent_list, top_scores_index, draft_tokens, *args, **kwargs)
    if plan is None:
        return verify_input
    if plan.kept is not None:
        try:
            runtime.cut(verify_input, plan)
        except Exception as exc:
            runtime.record_fault("cutting the verify tree", exc)
    setattr(verify_input, PLAN_ATTRIBUTE, plan)
    return verify_input
