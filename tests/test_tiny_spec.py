"""Real tree speculative decoding with the tiny MoE (``tiny/tiny_spec.py``, ``tiny/spec_eval.py``):
greedy tree decoding reproduces the target's greedy decoding in every node-choice mode, the draft tree
is SGLang's own, the tree-masked verify forward equals one forward per path, and the activated-expert
count lets only kept rows vote."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from xshare_sglang import PrunerConfig
from xshare_sglang.cli import main
from xshare_sglang.spec.echo import EchoCalibration, layer_confidence, static_slots
from xshare_sglang.tiny.spec_eval import default_draft_dir, split_prompts
from xshare_sglang.tiny.tiny_model import load_tiny_model, tiny_model_dir
from xshare_sglang.tiny.tiny_spec import (
    SpecSettings,
    TreeNodes,
    accept,
    activated_experts,
    build_tree,
    choose_nodes,
    draft_tree,
    greedy_reference,
    last_logits,
    model_probs,
    policy_label,
    speculative_generate,
    verify_forward,
    vote_layout,
)

SETTINGS = SpecSettings(num_steps=4, topk=3, num_draft_tokens=6, new_tokens=10)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the eager expert loop is many small ops: threads only contend
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return load_tiny_model()


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    """The shipped draft, or (before it is trained) the target cut to its first layer."""
    if (default_draft_dir() / "config.json").is_file():
        return default_draft_dir()
    model = copy.deepcopy(target[0])
    model.model.layers = model.model.layers[:1]
    model.config.num_hidden_layers = 1
    path = tmp_path_factory.mktemp("draft")
    model.save_pretrained(path)
    target[1].save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def draft(draft_dir, target):
    from xshare_sglang.tiny.spec_eval import load_draft

    return load_draft(draft_dir, target[0].config.vocab_size)


@pytest.fixture(scope="module")
def prompts(target):
    texts = split_prompts(tiny_model_dir())[1][:4]
    return [target[1](t)["input_ids"] for t in texts]


@pytest.fixture(scope="module")
def reference(target, prompts):
    # each step adds at least one token to the slowest request and at most S + 1 to any
    return greedy_reference(target[0], prompts, SETTINGS.new_tokens * (SETTINGS.num_steps + 1))


def _calibration(depth1: float) -> EchoCalibration:
    return EchoCalibration(
        num_steps=SETTINGS.num_steps, topk=SETTINGS.topk, num_draft_tokens=6, gates={1: depth1, 3: 0.05}
    )


@pytest.mark.parametrize(
    ("mode", "budget"),
    [("static", 5), ("static", 2), ("echo", 5), ("echo", 2), ("echo-ragged", 3)],
)
def test_greedy_tree_decoding_reproduces_target_greedy(target, draft, prompts, reference, mode, budget) -> None:
    run = speculative_generate(
        target[0],
        model_probs(draft),
        prompts,
        SETTINGS,
        mode=mode,
        k_max=budget * len(prompts),
        calibration=_calibration(0.3),
        configs=[PrunerConfig(policy="none")],
    )
    assert min(map(len, run.outputs)) >= SETTINGS.new_tokens
    for out, ref in zip(run.outputs, reference, strict=True):
        assert len(out) <= len(ref)
        assert out == ref[: len(out)]
    assert run.steps * len(prompts) == run.request_steps
    assert run.accepted + run.request_steps == sum(map(len, run.outputs))
    if mode == "echo":
        assert run.slots == run.steps * len(prompts) * (SETTINGS.num_draft_tokens - 1)
        assert budget > 2 or run.kept_nodes < run.slots  # some slots were cut
    assert run.kept_nodes <= run.steps * budget * len(prompts)
    assert 0 < run.activated["none"] <= run.layer_calls * 32


def test_target_as_its_own_draft_accepts_whole_paths(target, prompts, reference) -> None:
    run = speculative_generate(target[0], model_probs(target[0]), prompts[:2], SETTINGS, mode="static")
    assert all(out == ref[: len(out)] for out, ref in zip(run.outputs, reference[:2], strict=True))
    assert run.mat > 2.0  # nearly every step accepts the whole best path (float noise aside)


def _sglang_draft(next_probs, contexts, num_steps, topk):
    """SGLang's own drafting loop on the same probabilities, the path of every beam row tracked
    through ``hidden_states`` (row ids)."""
    from sglang.srt.speculative import spec_utils
    from sglang.srt.utils import fast_topk

    later = getattr(spec_utils._select_top_k_tokens_later, "_torchdynamo_orig_callable", None)
    later = later or spec_utils._select_top_k_tokens_later
    topk_p, topk_index = fast_topk(next_probs([list(c) for c in contexts]), topk, dim=-1)
    input_ids, _, scores, info = spec_utils._select_top_k_tokens_first(topk_p, topk_index, None, topk)
    score_list, token_list, parents_list = [info[0]], [info[1]], [info[2]]
    paths = [[t] for t in input_ids.tolist()]  # beam row r * topk + a
    for step in range(1, num_steps):
        flat = [list(contexts[row // topk]) + paths[row] for row in range(len(paths))]
        topk_p, topk_index = fast_topk(next_probs(flat), topk, dim=-1)
        rows = torch.arange(len(paths), dtype=torch.float32)[:, None]
        input_ids, rows, scores, info = later(step, topk_p, topk_index, rows, scores, topk)
        paths = [paths[int(p)] + [t] for p, t in zip(rows.flatten().tolist(), input_ids.tolist(), strict=True)]
        score_list.append(info[0])
        token_list.append(info[1])
        parents_list.append(info[2])
    return score_list, token_list, parents_list


def _fake_probs(vocab: int):
    def next_probs(seqs):
        out = []
        for seq in seqs:
            gen = torch.Generator().manual_seed(hash(tuple(seq)) % (2**31))
            out.append(torch.softmax(3 * torch.randn(vocab, generator=gen), dim=-1))
        return torch.stack(out)

    return next_probs


@pytest.mark.sglang
@pytest.mark.parametrize(
    ("source", "num_steps", "topk", "d"), [("draft", 4, 3, 6), ("fake", 3, 4, 8), ("fake", 3, 1, 3)]
)
def test_draft_tree_is_sglangs(draft, prompts, source, num_steps, topk, d) -> None:
    from sglang.srt.speculative.eagle_utils import organize_draft_results

    next_probs = model_probs(draft) if source == "draft" else _fake_probs(64)
    contexts = prompts if source == "draft" else [[random.Random(i).randrange(64) for _ in range(5)] for i in range(3)]
    ours = draft_tree(next_probs, contexts, num_steps, topk)
    theirs = _sglang_draft(next_probs, contexts, num_steps, topk)
    for mine, other in zip((ours.score_list, ours.token_list, ours.parents_list), theirs, strict=True):
        assert len(mine) == len(other) == num_steps
        for a, b in zip(mine, other, strict=True):
            torch.testing.assert_close(a, b.to(a.dtype), rtol=0, atol=0)
    parent_list, top_scores_index, draft_tokens = organize_draft_results(*theirs, d)
    candidates = ours.candidates
    slots = static_slots(candidates, d)
    assert torch.equal(slots, top_scores_index)
    assert torch.equal(candidates.tokens.gather(1, slots), draft_tokens)
    if num_steps > 1:
        assert torch.equal(
            candidates.parents[:, topk:], parent_list[:, torch.arange(topk, candidates.num_candidates) // topk]
        )
    nodes = choose_nodes(candidates, "static", len(contexts) * (d - 1), d)
    assert torch.equal(torch.stack([n.index for n in nodes]), top_scores_index)


def test_tree_mask_forward_equals_one_forward_per_path(target, draft, prompts) -> None:
    model = target[0]
    candidates = draft_tree(model_probs(draft), prompts[:2], 3, 3).candidates
    chosen = choose_nodes(candidates, "static", 2 * 6, 7)
    trees = [build_tree(candidates, r, nodes) for r, nodes in enumerate(chosen)]
    argmax, router_rows = verify_forward(model, prompts[:2], trees)
    for r, tree in enumerate(trees):
        for j in range(len(tree.tokens)):
            path, p = [tree.tokens[j]], tree.parent[j]
            while p > 0:
                path.insert(0, tree.tokens[p - 1])
                p = tree.parent[p - 1]
            logits = last_logits(model, [list(prompts[r]) + path])
            assert int(logits.argmax()) == argmax[r][j + 1]
        assert int(last_logits(model, [prompts[r]]).argmax()) == argmax[r][0]
        assert all(layer[r].shape == (1 + len(tree.tokens), 32) for layer in router_rows)


def test_activated_experts_none_is_the_union_of_voting_rows() -> None:
    logits = torch.full((2, 3, 8), -5.0)
    tops = {(0, 0): [0, 1], (0, 1): [1, 2], (0, 2): [6, 7], (1, 0): [3, 4], (1, 1): [4, 5]}
    for (r, j), experts in tops.items():
        logits[r, j, experts] = torch.tensor([3.0, 2.0])
    rows = [logits[0], logits[1, :2]]  # request 1 is ragged: two rows
    weights = [torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0])]  # request 0's third node is cut
    flat, votes, width = vote_layout(rows, weights)
    assert width == 3 and votes.tolist() == [1, 1, 0, 1, 1, 0]
    assert activated_experts(flat, votes, PrunerConfig(policy="none"), top_k=2, tokens_per_request=3) == 6
    votes_all = votes.clone()
    votes_all[2] = 1.0
    assert activated_experts(flat, votes_all, PrunerConfig(policy="none"), top_k=2, tokens_per_request=3) == 8


@pytest.mark.parametrize(
    "cfg",
    [
        PrunerConfig(policy="none"),
        PrunerConfig(policy="xshare-spec", k0=1, request_budget=1, budget=0),
        PrunerConfig(policy="moe-spec", max_experts=8, scope="request"),
    ],
)
def test_a_cut_node_does_not_vote(cfg) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2 * 4, 32, generator=gen)
    logits[:, 31] = -10.0
    logits[5, 31] = 20.0  # request 1's node 1 alone wants expert 31
    kept = torch.ones(8)
    cut = kept.clone()
    cut[5] = 0.0
    with_vote = activated_experts(logits, kept, cfg, top_k=4, tokens_per_request=4)
    without = activated_experts(logits, cut, cfg, top_k=4, tokens_per_request=4)
    keep_ids = torch.unique(logits[cut > 0].topk(4).indices)
    assert 31 not in keep_ids.tolist()
    if cfg.policy == "none":
        assert without == keep_ids.numel()
        assert with_vote == torch.unique(logits.topk(4).indices).numel() > without
    # a cut row's logits never add an expert: only expert 31's vote changes
    logits_cut = logits.clone()
    logits_cut[5] = torch.randn(32, generator=gen)
    assert activated_experts(logits_cut, cut, cfg, top_k=4, tokens_per_request=4) == without


def test_cut_nodes_and_their_subtrees_are_never_accepted(target, draft, prompts) -> None:
    candidates = draft_tree(model_probs(draft), prompts[:1], 3, 2).candidates
    nodes = choose_nodes(candidates, "static", 5, 6)[0]
    kept = torch.ones_like(nodes.kept)
    kept[0] = False  # cut the best depth-1 node; its descendants become unreachable
    tree = build_tree(candidates, 0, TreeNodes(nodes.index, kept))
    cut_rows = {0} | {j for j, p in enumerate(tree.parent) if p == 1}
    assert all(not tree.kept[j] for j in cut_rows)
    # a target that always agrees with node 0: acceptance must still stop at the root
    argmax = [tree.tokens[0]] * (1 + len(tree.tokens))
    accepted, bonus = accept(tree, argmax)
    assert accepted == [] and bonus == tree.tokens[0]


def test_echo_nodes_respect_the_budget_and_layout(draft, prompts) -> None:
    candidates = draft_tree(model_probs(draft), prompts, 4, 3).candidates
    calibration = _calibration(float(layer_confidence(candidates)[:, 0].median()))
    fixed = choose_nodes(candidates, "echo", 10, 6, calibration=calibration)
    ragged = choose_nodes(candidates, "echo-ragged", 10, 6, calibration=calibration)
    assert all(n.index.numel() == 5 for n in fixed)
    assert sum(int(n.kept.sum()) for n in fixed) <= 10
    assert sum(n.index.numel() for n in ragged) <= 10
    assert all(bool(n.kept.all()) for n in ragged)


def test_spec_eval_cli_quick_end_to_end(tmp_path, draft_dir) -> None:
    out = tmp_path / "spec"
    code = main(
        ["spec-eval", "--quick", "--out", str(out), "--draft", str(draft_dir), "--requests", "3", "--new-tokens", "6"]
    )
    assert code == 0
    result = json.loads((out / "spec_eval.json").read_text())
    assert [r["mode"] for r in result["runs"]] == ["static", "echo", "echo-ragged"]
    assert all(r["exact"] for r in result["runs"] + result["calibration_runs"])
    assert result["runs"][0]["k_max"] == 4 * 3
    calibration = EchoCalibration.load(out / "echo_calibration.json")
    assert calibration.num_steps == 5 and calibration.num_draft_tokens == 8
    records = (out / "echo_log.jsonl").read_text().splitlines()
    assert len(records) == result["calibration_runs"][0]["steps"]
    assert len(json.loads(records[0])["confidence"]) == 3
    # acceptance under pruned verify, one row per verify policy, against the static run's trees
    pruned = result["pruned_verify"]
    assert [r["policy"].split()[0] for r in pruned] == ["xshare-spec", "xshare-spec", "moe-spec", "moe-spec", "lynx"]
    for row in pruned:
        assert row["k_max"] == 12 and row["unpruned_steps"] == result["runs"][0]["steps"]
        for key in ("accept_len", "unpruned_accept_len"):
            assert 0 <= row[key]["low"] <= row[key]["mean"] <= row[key]["high"] <= 5
        assert row["unpruned_accept_len"]["mean"] == pytest.approx(result["runs"][0]["mat"])
        assert 0 < row["experts"] <= row["unpruned_experts"] + 1e-9 or row["policy"].startswith("lynx")


def test_pruned_verify_routes_tree_rows_inside_each_requests_set(target) -> None:
    """The verify hook prunes exactly the tree rows: one expert per request (moe-spec, per request,
    budget 1), the union read by the layer call; context and padding rows keep the model's routing."""
    from xshare_sglang.tiny.tiny_model import routers
    from xshare_sglang.tiny.tiny_spec import _prune_tree_rows

    router = routers(target[0])[0]
    gen = torch.Generator().manual_seed(0)
    width, num_experts, top_k = 9, router.num_experts, router.top_k
    logits = torch.randn(2 * width, num_experts, generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(top_k, dim=-1)
    rows = [torch.arange(3, 7), torch.arange(5, 8) + width]  # request 0: 4 tree rows, request 1: 3
    cfg = PrunerConfig(policy="moe-spec", max_experts=1, scope="request")
    _, new_weights, new_ids = _prune_tree_rows(router, 0, (logits, weights, ids), rows, cfg, None, 4)
    tree = torch.cat(rows)
    others = torch.ones(2 * width, dtype=torch.bool)
    others[tree] = False
    assert torch.equal(new_ids[others], ids[others]) and torch.equal(new_weights[others], weights[others])
    # each request alone picks one expert; the layer call reads their union, and every tree row is
    # routed inside it (renormalized), so requests must have been grouped as laid out
    from xshare_sglang import select_experts_mask

    chosen = set()
    for r in rows:
        alone = select_experts_mask(logits[r], cfg, top_k=top_k, tokens_per_request=r.numel())
        assert int(alone.sum()) == 1
        chosen |= set(torch.nonzero(alone).flatten().tolist())
    used = new_ids[tree][new_ids[tree] < num_experts]
    assert set(used.unique().tolist()) == chosen and len(chosen) <= 2
    assert torch.allclose(new_weights[tree].sum(-1), torch.ones(tree.numel()))


def test_pruned_verify_changes_acceptance_not_the_unpruned_run(target, draft, prompts, reference) -> None:
    settings = SpecSettings(num_steps=4, topk=3, num_draft_tokens=6, new_tokens=8)
    common = dict(mode="static", k_max=5 * len(prompts))
    plain = speculative_generate(target[0], model_probs(draft), prompts, settings, **common)
    none = speculative_generate(
        target[0], model_probs(draft), prompts, settings, verify_cfg=PrunerConfig(policy="none"), **common
    )
    assert none.outputs == plain.outputs and none.accepted_by_request == plain.accepted_by_request
    assert sum(plain.accepted_by_request) == plain.accepted
    tight = PrunerConfig(policy="moe-spec", max_experts=1, scope="request")
    pruned = speculative_generate(
        target[0], model_probs(draft), prompts, settings, verify_cfg=tight, configs=[tight], **common
    )
    # one expert per request instead of top-4: the pruned target is another model, and a verify layer
    # call reads at most one expert per request (4 requests)
    assert pruned.outputs != plain.outputs
    assert pruned.activated[policy_label(tight)] <= 4 * pruned.layer_calls


def test_spec_settings_are_validated_once() -> None:
    from xshare_sglang.tiny.spec_eval import SpecEvalSettings

    assert SpecSettings(topk=3).max_width == 3  # None means the draft top-k
    with pytest.raises(ValueError, match=r"--draft-tokens 100 must lie in \[2, 69\]"):
        SpecSettings(num_steps=5, topk=4, num_draft_tokens=100)
    with pytest.raises(ValueError, match="--default-width 0"):
        SpecSettings(default_width=0)
    with pytest.raises(ValueError, match="--budgets"):
        SpecEvalSettings(budgets=())
    assert SpecEvalSettings.quick().spec.new_tokens == 16
