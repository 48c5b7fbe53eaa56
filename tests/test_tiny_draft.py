"""The shipped draft model for speculative decoding of the tiny MoE: it is small, shares the target's
tokenizer byte for byte, its card states its training log's numbers, and on held-out text its greedy
next token agrees with the target's about as often as the log says (and far more often than a
constant guess)."""

from __future__ import annotations

import json

import pytest
import torch

from xshare_sglang.tiny.tiny_model import load_tiny_model, tiny_model_dir

TARGET = tiny_model_dir()
DRAFT = TARGET.parent / "tiny_draft"
DOMAINS = ("code", "math", "prose")
SEQ_LEN = 128  # the windows of the log's evaluation
WINDOWS = 4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the target's eager expert loop is many small ops: threads only contend
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def log() -> dict:
    return json.loads((DRAFT / "training_log.json").read_text())


def test_checkpoint_is_shipped_small_and_documented(log) -> None:
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "MODEL_CARD.md",
        "training_log.json",
    ):
        assert (DRAFT / name).is_file(), name
    total = sum(path.stat().st_size for path in DRAFT.iterdir())
    assert total <= 5 * 2**20
    config = json.loads((DRAFT / "config.json").read_text())
    target = json.loads((TARGET / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["vocab_size"] == target["vocab_size"] == 4096
    assert config["eos_token_id"] == target["eos_token_id"]
    assert config["num_hidden_layers"] < target["num_hidden_layers"]
    assert config["hidden_size"] == target["hidden_size"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (DRAFT / name).read_bytes() == (TARGET / name).read_bytes(), name
    assert set(log["final"]) >= set(DOMAINS)


def test_card_states_the_logged_numbers(log) -> None:
    card = (DRAFT / "MODEL_CARD.md").read_text()
    for d in DOMAINS:
        f = log["final"][d]
        row = (
            f"| {d} | {f['draft_loss']:.3f} | {f['target_loss']:.3f} | {f['agreement']:.3f} | "
            f"{f['target_prob_of_draft_top1']:.3f} | {f['sampling_acceptance']:.3f} | {f['kl']:.3f} | "
            f"{f['positions']:,} |"
        )
        assert row in card, row
    assert f"{log['steps']} steps" in card and f"seed {log['seed']}" in card
    assert f"{log['parameters'] / 1e6:.2f} M-parameter" in card


def _heldout_windows(tokenizer, domain: str) -> torch.Tensor:
    """The first windows of the held-out stream, as the training script cuts them."""
    eos = tokenizer.token_to_id("<|endoftext|>")
    docs = [json.loads(line)["text"] for line in (TARGET / f"heldout_{domain}.jsonl").read_text().splitlines()]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(docs[:40]):
        ids += [*encoding.ids, eos]
        if len(ids) > WINDOWS * SEQ_LEN:
            break
    stream = torch.tensor(ids[: WINDOWS * SEQ_LEN + 1])
    return torch.stack([stream[i * SEQ_LEN : (i + 1) * SEQ_LEN + 1] for i in range(WINDOWS)])


def test_draft_agrees_with_the_target_on_heldout_text(log) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    target, _ = load_tiny_model()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT, dtype=torch.float32).eval()
    assert type(draft).__name__ == "Qwen3ForCausalLM"
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters()) / 4
    tokenizer = Tokenizer.from_file(str(DRAFT / "tokenizer.json"))
    for d in DOMAINS:
        inputs = _heldout_windows(tokenizer, d)[:, :-1]
        with torch.no_grad():
            t_top1 = target(input_ids=inputs).logits.argmax(-1).reshape(-1)
            d_top1 = draft(input_ids=inputs).logits.argmax(-1).reshape(-1)
        agreement = float((t_top1 == d_top1).float().mean())
        constant = float((t_top1 == t_top1.mode().values).float().mean())  # best single-token guess
        assert agreement >= 0.5 * log["final"][d]["agreement"], (d, agreement, log["final"][d]["agreement"])
        assert agreement >= constant + 0.1, (d, agreement, constant)
