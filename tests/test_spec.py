"""Speculative verify building blocks: row grouping, draft depths, acceptable nodes, vote weights, and
what weighted votes do to the selection (hand-worked)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from tests import brute_force
from xshare_sglang import PrunerConfig, select_experts_mask
from xshare_sglang.policies.rewrite import rewrite_routing
from xshare_sglang.spec import VerifyLayout, acceptable_nodes, draft_depths, vote_weights


@pytest.mark.parametrize(
    ("bs", "d", "real_bs", "request_ids", "node_ids", "num_real"),
    [
        (1, 1, 1, [0], [0], 1),
        (2, 4, 1, [0, 0, 0, 0, 1, 1, 1, 1], [0, 1, 2, 3, 0, 1, 2, 3], 4),
        (4, 2, 3, [0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 0, 1, 0, 1, 0, 1], 6),
        (3, 3, 0, [0, 0, 0, 1, 1, 1, 2, 2, 2], [0, 1, 2, 0, 1, 2, 0, 1, 2], 0),
        (5, 1, 5, [0, 1, 2, 3, 4], [0, 0, 0, 0, 0], 5),
    ],
)
def test_verify_layout_by_hand(bs, d, real_bs, request_ids, node_ids, num_real) -> None:
    layout = VerifyLayout(bs, d)
    assert layout.num_tokens == bs * d
    assert layout.request_ids().tolist() == request_ids
    assert layout.node_ids().tolist() == node_ids
    assert layout.num_real_tokens(real_bs) == num_real
    assert VerifyLayout.of_rows(bs * d, d) == layout


def test_verify_layout_rejects_what_does_not_split() -> None:
    with pytest.raises(ValueError, match="do not split"):
        VerifyLayout.of_rows(10, 4)
    with pytest.raises(ValueError, match="do not fit"):
        VerifyLayout(2, 4).num_real_tokens(3)
    with pytest.raises(ValueError, match="tokens per request >= 1"):
        VerifyLayout(2, 0)


def test_draft_depths_by_hand() -> None:
    # SGLang's example (eagle_utils): depths [0, 1, 1, 2] after a prompt of 7 give positions [7, 8, 8, 9];
    # a chain of 4 after 20 tokens; a padded request (positions 0) reads as depth 0.
    positions = torch.tensor([7, 8, 8, 9, 20, 21, 22, 23, 0, 0, 0, 0])
    assert draft_depths(positions, 4).tolist() == [0, 1, 1, 2, 0, 1, 2, 3, 0, 0, 0, 0]
    assert draft_depths(torch.tensor([5, 9, 2]), 1).tolist() == [0, 0, 0]
    with pytest.raises(ValueError):
        draft_depths(torch.arange(6), 4)


def _random_tree(rng: random.Random, width: int) -> tuple[list[int], list[int], list[list[int]]]:
    """First-child / next-sibling links of a random tree of ``width`` nodes, with some links cut."""
    children: list[list[int]] = [[] for _ in range(width)]
    for node in range(1, width):
        children[rng.randrange(node)].append(node)
    next_token, next_sibling = [-1] * width, [-1] * width
    for parent, kids in enumerate(children):
        if kids:
            next_token[parent] = kids[0]
        for a, b in itertools.pairwise(kids):
            next_sibling[a] = b
    for _ in range(rng.randint(0, 2)):  # ECHO-style cuts: unlink a subtree
        links = rng.choice([next_token, next_sibling])
        links[rng.randrange(width)] = -1
    return next_token, next_sibling, children


def _reachable(next_token: list[int], next_sibling: list[int]) -> list[bool]:
    """Depth-first walk from the root along the links, as tree verification does."""
    seen = [False] * len(next_token)
    stack = [0]
    while stack:
        node = stack.pop()
        if node < 0 or seen[node]:
            continue
        seen[node] = True
        stack += [next_token[node], next_sibling[node]]
    return seen


@pytest.mark.parametrize("width", [1, 2, 3, 4, 7, 8, 16, 33, 64])
def test_acceptable_nodes_matches_a_walk(width) -> None:
    rng = random.Random(width)
    trees = [_random_tree(rng, width) for _ in range(25)]
    next_token = torch.tensor([t[0] for t in trees])
    next_sibling = torch.tensor([t[1] for t in trees])
    got = acceptable_nodes(next_token, next_sibling)
    want = [_reachable(t[0], t[1]) for t in trees]
    assert got.tolist() == want
    assert got[:, 0].all()
    if width >= 4:
        assert not got.all()  # some cut really removed nodes


def test_acceptable_nodes_of_an_eagle_tree_by_hand() -> None:
    # root 0 -> children 1, 2; 1 -> child 3; in the second request node 2 was cut (1 has no sibling)
    next_token = torch.tensor([[1, 3, -1, -1], [1, 3, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1], [-1, -1, -1, -1]])
    assert acceptable_nodes(next_token, next_sibling).tolist() == [[True] * 4, [True, True, False, True]]


def test_vote_weights_by_hand() -> None:
    depths = torch.tensor([0, 1, 2, 3, 0, 1])
    assert vote_weights(depths, 0.5).tolist() == [1.0, 0.5, 0.25, 0.125, 1.0, 0.5]
    acceptable = torch.tensor([True, True, False, True, True, False])
    assert vote_weights(depths, 0.5, acceptable).tolist() == [1.0, 0.5, 0.0, 0.125, 1.0, 0.0]
    assert vote_weights(depths, None, acceptable).tolist() == [1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    assert vote_weights(depths, 1.0).tolist() == [1.0] * 6
    deep = vote_weights(torch.tensor([63]), 0.01)
    assert 0.0 < float(deep) < 1e-37  # underflow must not turn a voter into a non-voter
    with pytest.raises(ValueError, match="depth_decay"):
        vote_weights(depths, 1.5)


# Two requests of D = 2, E = 4, top-2 softmax.  Request 0: the root favours expert 0, its child expert 1;
# request 1: the root favours expert 2, its child strongly expert 3.
LOGITS = torch.tensor(
    [
        [4.0, 3.0, 0.0, 0.0],
        [0.0, 4.0, 0.0, 3.0],
        [0.0, 0.0, 4.0, 2.0],
        [0.0, 0.0, 1.0, 6.0],
    ]
)


def test_depth_decay_changes_the_batch_pick_exactly() -> None:
    """xshare k0=0 budget=1 with topk scores: unweighted, expert 3 has the largest aggregate (it is in
    three tokens' top-2); with the children weighted 1/8, the roots decide and expert 2 wins."""
    cfg = PrunerConfig(policy="xshare", k0=0, budget=1)
    weights = torch.tensor([1.0, 0.125, 1.0, 0.125])
    plain = select_experts_mask(LOGITS, cfg, top_k=2)
    weighted = select_experts_mask(LOGITS, cfg, top_k=2, token_weights=weights)
    scores = torch.zeros(4, 4, dtype=torch.float64)  # each row's top-2, renormalized
    for row, (first, second) in enumerate([(0, 1), (1, 3), (2, 3), (3, 2)]):
        pair = torch.softmax(LOGITS[row, [first, second]].double(), dim=0)
        scores[row, first], scores[row, second] = pair
    assert int(scores.sum(dim=0).argmax()) == 3 and plain.tolist() == [False, False, False, True]
    assert int((scores * weights.double()[:, None]).sum(dim=0).argmax()) == 2
    assert weighted.tolist() == [False, False, True, False]


def test_nodes_that_cannot_be_accepted_do_not_vote() -> None:
    """Weight 0 removes a row from the vote entirely (warm-up included) without shrinking the batch
    size n; the rewrite routes it nowhere."""
    cfg = PrunerConfig(policy="xshare-spec", k0=1, request_budget=0, budget=0)
    weights = torch.tensor([1.0, 1.0, 1.0, 0.0])
    keep = select_experts_mask(LOGITS, cfg, top_k=2, tokens_per_request=2, token_weights=weights)
    assert keep.tolist() == [True, True, True, False]  # expert 3 was only row 3's top-1
    assert keep.tolist() == brute_force.select(LOGITS, cfg, top_k=2, tokens_per_request=2, token_weights=[1, 1, 1, 0])
    # min_tokens counts real rows, voting or not: 4 rows reach min_tokens=4, so the call is pruned
    ranged = PrunerConfig(policy="oea", k0=1, min_tokens=4)
    assert not select_experts_mask(LOGITS, ranged, top_k=2, token_weights=weights).all()
    ids = torch.tensor([[0, 1], [1, 3], [2, 3], [3, 2]], dtype=torch.int32)
    topk_weights = torch.full((4, 2), 0.5)
    rewrite_routing(ids, topk_weights, keep, token_weights=weights)
    assert ids.tolist() == [[0, 1], [1, -1], [2, -1], [-1, -1]]
    assert topk_weights[3].tolist() == [0.0, 0.0]


def test_moe_spec_request_scope_by_hand() -> None:
    """One budget per request's tree: B = 1 keeps each request's own favourite; the batch budget
    keeps only the single best expert overall."""
    request = PrunerConfig(policy="moe-spec", max_experts=1, scope="request")
    batch = PrunerConfig(policy="moe-spec", max_experts=1)
    probs = torch.softmax(LOGITS.double(), dim=1)
    favourites = {int((probs[0] + probs[1]).argmax()), int((probs[2] + probs[3]).argmax())}
    got = select_experts_mask(LOGITS, request, top_k=2, tokens_per_request=2)
    assert set(torch.nonzero(got).flatten().tolist()) == favourites == {1, 3}
    assert select_experts_mask(LOGITS, batch, top_k=2, tokens_per_request=2).sum() == 1
    # a request whose every node is cut has no budget of its own
    cut = select_experts_mask(
        LOGITS, request, top_k=2, tokens_per_request=2, token_weights=torch.tensor([1, 1, 0, 0.0])
    )
    assert torch.nonzero(cut).flatten().tolist() == [1]


@pytest.mark.parametrize(
    ("kwargs", "field", "hint"),
    [
        ({"policy": "moe-spec", "max_experts": 4, "scope": "tree"}, "scope", "batch, request"),
        ({"policy": "xshare", "depth_decay": 0.0}, "depth_decay", "(0, 1]"),
        ({"policy": "xshare", "depth_decay": 1.5}, "depth_decay", "(0, 1]"),
        ({"policy": "lynx", "depth_decay": 0.5}, "depth_decay", "lynx"),
    ],
)
def test_verify_fields_are_validated(kwargs, field, hint) -> None:
    with pytest.raises(ValueError, match=rf"PrunerConfig\.{field}=") as info:
        PrunerConfig(**kwargs)
    assert hint in str(info.value)


def test_token_weights_are_checked() -> None:
    cfg = PrunerConfig(policy="xshare")
    with pytest.raises(ValueError, match=r"token_weights must be a tensor of shape \(4,\)"):
        select_experts_mask(LOGITS, cfg, top_k=2, token_weights=torch.ones(3))
    with pytest.raises(ValueError, match="floating point"):
        select_experts_mask(LOGITS, cfg, top_k=2, token_weights=torch.ones(4, dtype=torch.int64))
