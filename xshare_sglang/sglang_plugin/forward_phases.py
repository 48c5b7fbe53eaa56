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


def decode_graphs_on(server_args) -> bool:
    """Whether decode (and verify) forwards may replay from CUDA graphs (then they run no Python hook)."""
    if getattr(server_args, "disable_cuda_graph", False) or getattr(server_args, "device", "cuda") == "cpu":
        return False
    return getattr(server_args, "cuda_graph_backend_decode", None) != "disabled"


def speculative(server_args) -> bool:
    """Whether the server decodes speculatively (its target model then verifies, and never decodes)."""
    return getattr(server_args, "speculative_algorithm", None) not in (None, "", "NONE")
