"""Keep-all is the unpruned model: a live pruned server whose masks hold every expert the tokens pick
answers with the same tokens and the same logprobs, bit for bit, as an unpruned server.

``--moe-pruner xshare --moe-pruner-k0 4 --moe-pruner-budget 0`` on the tiny model (top-4) keeps, per
layer call, the union of every token's own four experts and prunes the rest.  SGLang's CPU engine
routes with its torch-native top-k; the plugin hands each token whose experts are all kept that very
routing (``PrunerRuntime.route``), so nothing downstream can tell the two servers apart: not in
float32, not in bfloat16 (where tied logits are common), neither one request at a time (two
prompts of each domain) nor with all twenty held-out prompts batched together.  The unpruned servers
are the ones other live modules share (``live_servers``).
"""

from __future__ import annotations

import re

import pytest

from tests.live_server import LiveServer, unpruned_args
from xshare_sglang.tiny.tiny_demo import heldout_texts
from xshare_sglang.tiny.tiny_model import tiny_model_dir

pytestmark = pytest.mark.live_server

NEW_TOKENS = 16
PROMPT_TOKENS = 24
NUM_PROMPTS = 20
#: Prompts also sent one at a time: the first six, two of each domain (the prompts alternate
#: domains).  The single requests, not the batch, were most of this test's running time in CI.
ALONE = 6
KEEP_ALL = ["--moe-pruner", "xshare", "--moe-pruner-k0", "4", "--moe-pruner-budget", "0"]
KEPT = re.compile(r"activated experts ([0-9.]+), kept ([0-9.]+)")


def _prompts(tokenizer) -> list[list[int]]:
    """Twenty held-out openings, code, math and prose in turn, 24 tokens each."""
    texts = {domain: heldout_texts(tiny_model_dir(), domain) for domain in ("code", "math", "prose")}
    chosen = [texts[domain][i] for i in range(7) for domain in texts][:NUM_PROMPTS]
    return [tokenizer(text)["input_ids"][:PROMPT_TOKENS] for text in chosen]


def _answers(server: LiveServer, prompts) -> tuple[list, list]:
    """A server's answers to the first ``ALONE`` prompts one at a time, then to all of them in one batch."""
    alone = [server.greedy_logprobs(prompt, NEW_TOKENS)[0] for prompt in prompts[:ALONE]]
    return alone, server.greedy_logprobs(prompts, NEW_TOKENS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_keep_all_server_answers_as_the_unpruned_one(dtype, reference, live_servers, tmp_path) -> None:
    # the servers run as `make serve-cpu` does, without the TRITON_INTERPRET=1 conftest sets: the
    # selection then runs the torch reference (tests/test_sglang_routing.py covers the kernels' path)
    _, tokenizer = reference
    prompts = _prompts(tokenizer)
    assert len(prompts) == NUM_PROMPTS and all(len(p) == PROMPT_TOKENS for p in prompts)
    plain = _answers(live_servers.server(unpruned_args(dtype), interpreter=False), prompts)
    flags = ["--dtype", dtype, *KEEP_ALL, "--moe-pruner-log-interval", "1"]
    server = LiveServer(flags, tmp_path / "keep_all.log", interpreter=False).start()
    try:
        pruned = _answers(server, prompts)
        log = server.log()
    finally:
        server.stop()

    assert "policy=xshare" in log, "the pruned server never proved the plugin active"
    kept = [float(m.group(2)) for m in KEPT.finditer(log)]
    assert kept and min(kept) < 32, "keep-all never pruned an expert: the test would prove nothing"
    assert "selection failed" not in log and re.search(r"selection fallbacks [1-9]", log) is None
    # keep-all is batch-invariant as the unpruned server is: the same tokens alone and batched
    assert [a[0] for a in pruned[0]] == [b[0] for b in pruned[1][:ALONE]]
    assert len(plain[0]) == ALONE and len(plain[1]) == NUM_PROMPTS
    for arm in (0, 1):  # one at a time, then batched
        for i, (want, got) in enumerate(zip(plain[arm], pruned[arm], strict=True)):
            assert got[0] == want[0], f"prompt {i}: tokens differ ({'batched' if arm else 'alone'})"
            assert got[1] == want[1], f"prompt {i}: logprobs differ ({'batched' if arm else 'alone'})"
