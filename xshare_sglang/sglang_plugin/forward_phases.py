"""Which forwards a server runs: SGLang's forward modes as the pruner's phases
(forward_batch_info.py:198, 0.5.23), and whether decode forwards replay from CUDA graphs."""

from __future__ import annotations


def phase_of(forward_mode) -> str | None:
    """``decode``, ``verify``, ``extend``, ``mixed``, or None for modes the pruner never touches
    (idle, draft extend, prebuilt, dLLM)."""
    if forward_mode is None:
        return None
    name = getattr(forward_mode, "name", str(forward_mode))
    return {
        "DECODE": "decode",
        "TARGET_VERIFY": "verify",
        "EXTEND": "extend",
        "SPLIT_PREFILL": "extend",
        "MIXED": "mixed",
    }.get(name)


def pruned_phase(forward_mode, tokens_per_request: int) -> str | None:
    """The phase whose config prunes a forward: :func:`phase_of`, except that a verify forward of one
    token per request is a decode step (``--speculative-adaptive`` at 0 steps verifies each request's
    last token alone: eagle_worker_v2.py ``_build_trivial_verify_input``, 0.5.23) and is pruned as one."""
    phase = phase_of(forward_mode)
    return "decode" if phase == "verify" and tokens_per_request == 1 else phase


def decode_graphs_on(server_args) -> bool:
    """Whether decode (and verify) forwards may replay from CUDA graphs (then they run no Python hook)."""
    if getattr(server_args, "disable_cuda_graph", False) or getattr(server_args, "device", "cuda") == "cpu":
        return False
    return getattr(server_args, "cuda_graph_backend_decode", None) != "disabled"


def speculative(server_args) -> bool:
    """Whether the server decodes speculatively (its target model then verifies, and never decodes)."""
    return getattr(server_args, "speculative_algorithm", None) not in (None, "", "NONE")


def verify_widths(server_args) -> list[int]:
    """Every D (draft tokens per request) the target model of a speculative server may verify with:
    its ``--speculative-num-draft-tokens``, or under ``--speculative-adaptive`` steps + 1 of every
    candidate step count of its adaptive config (SGLang's defaults without one; 1 = 0 steps, a decode
    step).  [] for a server that does not speculate.  Reads SGLang's resolved settings (it turns
    adaptive speculation off where it cannot adapt, e.g. an EAGLE top-k above 1)."""
    if not speculative(server_args):
        return []
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    if getattr(spec, "speculative_adaptive", False):
        from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config

        return [steps + 1 for steps in resolve_candidate_steps_from_config(spec.speculative_adaptive_config)]
    return [int(spec.speculative_num_draft_tokens or 0)]
