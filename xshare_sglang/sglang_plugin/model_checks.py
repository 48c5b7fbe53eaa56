"""Checks of the loaded target model that concern what it answers, not the pruner.

SGLang 0.5.23's model classes differ in whether they honour ``tie_word_embeddings``: ``Qwen2`` and
``Qwen3`` tie ``lm_head`` to the input embeddings, ``Qwen3MoeForCausalLM`` never does.  A checkpoint
that asks for tying and therefore stores no ``lm_head.weight`` is then served with a head that was
never loaded, and every answer is garbage, pruned or not.  The plugin cannot repair the model class,
but it can say so at start-up instead of letting the operator blame the pruner.
"""

from __future__ import annotations

import torch


def _tie_requested(hf_config) -> bool:
    text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
    return bool(getattr(text_config, "tie_word_embeddings", False) or getattr(hf_config, "tie_word_embeddings", False))


def untied_lm_head_problem(model: torch.nn.Module, hf_config) -> str | None:
    """A warning when the checkpoint asks for tied embeddings but the model's ``lm_head`` is a separate
    tensor holding other values; None when tying is not asked for, is honoured, or cannot be checked.

    Parameters
    ----------
    model : torch.nn.Module
        The loaded model (``lm_head`` and ``get_input_embeddings()``/``model.embed_tokens`` looked up).
    hf_config : transformers.PretrainedConfig
    """
    if not _tie_requested(hf_config):
        return None
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None) if inner is not None else None
    head_weight, embed_weight = getattr(head, "weight", None), getattr(embed, "weight", None)
    if not isinstance(head_weight, torch.Tensor) or not isinstance(embed_weight, torch.Tensor):
        return None
    if head_weight is embed_weight or head_weight.data_ptr() == embed_weight.data_ptr():
        return None
    if head_weight.shape == embed_weight.shape and torch.equal(head_weight, embed_weight):
        return None  # the checkpoint stores lm_head.weight equal to the embeddings
    return (
        f"the checkpoint asks for tied embeddings (tie_word_embeddings=true) but SGLang's "
        f"{type(model).__name__} keeps a separate lm_head that differs from the input embeddings: unless "
        "the checkpoint stores lm_head.weight, this server predicts with an unloaded head and its answers "
        "are meaningless, pruned or not. Store lm_head.weight in the checkpoint (a copy of the embeddings) "
        "and set tie_word_embeddings to false."
    )
