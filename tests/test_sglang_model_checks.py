"""Start-up checks of the loaded model: which MoE backends get weight-0 fillers instead of -1, and the
warning for a checkpoint that asks for tied embeddings the model class does not tie."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.sglang_helpers import stand_in_experts
from xshare_sglang.sglang_plugin.model_checks import untied_lm_head_problem
from xshare_sglang.sglang_plugin.moe_backends import dropped_slots_filled

pytestmark = pytest.mark.sglang


@pytest.mark.parametrize(
    ("runner", "filled"),
    [
        ("triton", False),
        ("deep_gemm", False),
        ("flashinfer_trtllm", False),
        ("cutlass", False),
        ("aiter", True),
        ("hpc_ops", True),
        ("ascend", True),
    ],
)
def test_runner_backends_that_skip_minus_one(runner, filled) -> None:
    experts = stand_in_experts(layer_id=0, num_experts=8, runner=runner)
    experts.w13_weight = torch.empty(8, 4, 2, device="meta")  # a GPU server's weights, as far as the check goes
    fill, reason = dropped_slots_filled(experts)
    assert fill is filled
    assert runner in reason


def test_cpu_weights_always_get_fillers() -> None:
    """SGLang's CPU MoE loop indexes experts with every slot, whatever runner name the layer holds."""
    experts = stand_in_experts(layer_id=0, num_experts=8, runner="triton")
    experts.w13_weight = torch.empty(8, 4, 2)
    fill, reason = dropped_slots_filled(experts)
    assert fill and "CPU" in reason


def _model(head: torch.Tensor, embed: torch.Tensor) -> torch.nn.Module:
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens = SimpleNamespace(weight=embed)
    model.lm_head = SimpleNamespace(weight=head)
    return model


def test_untied_head_is_reported_only_when_tying_was_asked_for() -> None:
    embed = torch.randn(16, 4)
    tied_config = SimpleNamespace(tie_word_embeddings=True)
    # SGLang's Qwen3-MoE class: a separate, never-loaded head
    problem = untied_lm_head_problem(_model(torch.zeros(16, 4), embed), tied_config)
    assert problem is not None and "tie_word_embeddings" in problem and "lm_head.weight" in problem
    # the same tensor (a class that ties), or a stored copy (an untied checkpoint): fine
    assert untied_lm_head_problem(_model(embed, embed), tied_config) is None
    assert untied_lm_head_problem(_model(embed.clone(), embed), tied_config) is None
    # a checkpoint that does not ask for tying: its own head is expected
    assert untied_lm_head_problem(_model(torch.zeros(16, 4), embed), SimpleNamespace(tie_word_embeddings=False)) is None
