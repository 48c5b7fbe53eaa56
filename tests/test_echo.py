"""ECHO: the scheduler (Alg. 1) by hand and against a loop reading of it, candidates and confidence
from SGLang's own draft functions, node allocation, verify slots, tree cutting, calibration with known
answers, and the marginal-utility exchange (Theorem 2)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from xshare_sglang.spec import acceptable_nodes
from xshare_sglang.spec.echo import (
    DraftCandidates,
    EchoCalibration,
    EchoLogRecord,
    allocate_nodes,
    batch_objective,
    calibrate,
    candidate_depths,
    cut_tree,
    echo_schedule,
    greedy_allocation,
    improving_exchange,
    layer_confidence,
    marginal_gain,
    read_echo_log,
    static_slots,
    verify_slots,
)
from xshare_sglang.spec.echo.calibrate import depth_auc, youden_threshold

# ------------------------------------------------------------------------------------ scheduler


def _schedule(conf, gates, k_max, **kwargs):
    num_depths = len(conf[0])
    gated = torch.tensor([d + 1 in gates for d in range(num_depths)])
    thresholds = torch.tensor([gates.get(d + 1, 0.0) for d in range(num_depths)])
    return echo_schedule(torch.tensor(conf), gated, thresholds, k_max, **kwargs)


def test_low_load_truncates_and_widens_at_the_failing_depth() -> None:
    # one request, gate at depth 2 fails: depth 1 gets the default width, depth 2 the max width
    alloc = _schedule([[0.9, 0.3, 0.2, 0.1]], {2: 0.5}, 7, default_width=1, max_width=4, per_request_cap=7)
    assert alloc.widths.tolist() == [[1, 4, 0, 0]]
    assert alloc.truncated.tolist() == [True] and alloc.truncation_depth.tolist() == [2]
    assert alloc.depth_reached.tolist() == [2]


def test_low_load_confident_request_goes_deep_and_leaves_budget() -> None:
    alloc = _schedule([[0.9, 0.8, 0.7, 0.6]], {1: 0.5, 4: 0.5}, 7, default_width=1, max_width=4)
    assert alloc.widths.tolist() == [[1, 1, 1, 1]]
    assert alloc.truncated.tolist() == [False]


def test_high_load_moves_budget_to_confident_requests() -> None:
    conf = [[0.9, 0.5, 0.4, 0.3], [0.2, 0.1, 0.1, 0.1], [0.8, 0.6, 0.5, 0.4]]
    alloc = _schedule(conf, {1: 0.5}, 6, default_width=1, max_width=2)
    # request 1 fails its root gate; the other two take depths 1-3 and exhaust the budget
    assert alloc.widths.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 0]]
    assert alloc.truncation_depth.tolist() == [0, 1, 0]
    # with more budget: depth 4 for both, then what is left widens request 1 at depth 1
    alloc = _schedule(conf, {1: 0.5}, 10, default_width=1, max_width=2)
    assert alloc.widths.tolist() == [[1, 1, 1, 1], [2, 0, 0, 0], [1, 1, 1, 1]]
    # a widening request takes only what is left
    alloc = _schedule(conf, {1: 0.5}, 9, default_width=1, max_width=2)
    assert alloc.widths.tolist() == [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]


def test_budget_runs_out_mid_depth_in_index_order() -> None:
    conf = [[0.9] * 3] * 3
    alloc = _schedule(conf, {}, 5, default_width=2, max_width=2)
    # depth 1: 2 + 2 + 1 (the last request gets what is left), then nothing
    assert alloc.widths.tolist() == [[2, 0, 0], [2, 0, 0], [1, 0, 0]]


def test_per_request_cap_and_padding() -> None:
    conf = [[0.9, 0.9, 0.9]] * 4
    alloc = _schedule(conf, {}, 100, default_width=2, max_width=2, per_request_cap=3, num_valid_requests=2)
    assert alloc.widths.tolist() == [[2, 1, 0], [2, 1, 0], [0, 0, 0], [0, 0, 0]]
    alloc = _schedule(conf, {}, 100, per_request_cap=3, num_valid_requests=torch.tensor(3))
    assert alloc.nodes_per_request.tolist() == [3, 3, 3, 0]


def test_schedule_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="one per depth"):
        echo_schedule(torch.zeros(2, 3), torch.zeros(2, dtype=torch.bool), torch.zeros(3), 4)
    with pytest.raises(ValueError, match="default_width"):
        _schedule([[0.5]], {}, 1, default_width=0)


def _loop_schedule(conf, gates, k_max, default_width, max_width, cap, valid, num_depths):
    """ECHO Alg. 1 read literally, one request at a time."""
    num_requests = len(conf)
    widths = [[0] * num_depths for _ in conf]
    used = [0] * num_requests
    budget = k_max
    active = [i for i in range(valid) if cap > 0]
    truncated = {}
    for d in range(1, num_depths + 1):
        if budget <= 0 or not active:
            break
        still = []
        for i in active:
            if d in gates and not conf[i][d - 1] > gates[d]:
                truncated[i] = d
                continue
            ask = min(default_width, cap - used[i])
            grant = min(ask, max(budget, 0))
            widths[i][d - 1] += grant
            used[i] += grant
            budget -= grant
            if grant == ask and used[i] < cap:
                still.append(i)
        active = still
    for i in sorted(truncated):
        ask = min(max_width, cap - used[i])
        grant = min(ask, max(budget, 0))
        widths[i][truncated[i] - 1] += grant
        used[i] += grant
        budget -= grant
    return widths


@given(
    seed=st.integers(0, 10_000),
    num_requests=st.integers(0, 9),
    num_depths=st.integers(1, 6),
    k_max=st.integers(0, 40),
    default_width=st.integers(1, 3),
    max_width=st.integers(1, 5),
    cap=st.integers(0, 12),
)
def test_schedule_matches_a_literal_reading_of_alg1(
    seed, num_requests, num_depths, k_max, default_width, max_width, cap
) -> None:
    rng = random.Random(seed)
    conf = [[round(rng.random(), 1) for _ in range(num_depths)] for _ in range(num_requests)]
    gates = {d: round(rng.random(), 1) for d in range(1, num_depths + 1) if rng.random() < 0.5}
    valid = rng.randint(0, num_requests)
    expected = _loop_schedule(conf, gates, k_max, default_width, max_width, cap, valid, num_depths)
    conf_t = torch.zeros(0, num_depths) if num_requests == 0 else torch.tensor(conf)
    gated = torch.tensor([d + 1 in gates for d in range(num_depths)])
    thresholds = torch.tensor([gates.get(d + 1, 0.0) for d in range(num_depths)])
    alloc = echo_schedule(
        conf_t,
        gated,
        thresholds,
        k_max,
        default_width=default_width,
        max_width=max_width,
        per_request_cap=cap,
        num_valid_requests=valid,
    )
    assert alloc.widths.tolist() == expected
    assert int(alloc.widths.sum()) <= k_max
    assert all(n <= cap for n in alloc.nodes_per_request.tolist())
    assert int(alloc.widths[valid:].sum()) == 0


# ---------------------------------------------------------------- candidates from SGLang's drafter


def _sglang_draft(batch: int, topk: int, num_steps: int):
    pytest.importorskip("sglang")
    from tests.sglang_helpers import sglang_draft

    return sglang_draft(batch, topk, num_steps)


@pytest.mark.sglang
@pytest.mark.parametrize(("batch", "topk", "num_steps", "draft_tokens"), [(3, 4, 5, 8), (2, 2, 3, 6), (1, 3, 1, 3)])
def test_candidates_match_sglang_organize_draft_results(batch, topk, num_steps, draft_tokens) -> None:
    eagle_utils = pytest.importorskip("sglang.srt.speculative.eagle_utils")
    score_list, token_list, parents_list = _sglang_draft(batch, topk, num_steps)
    cands = DraftCandidates.from_sglang(score_list, token_list, parents_list)
    assert cands.num_candidates == topk + (num_steps - 1) * topk * topk
    depths = cands.depths()
    parents = cands.parents
    # every parent is shallower by one and scores at least as high as its child
    has_parent = parents >= 0
    assert torch.equal(has_parent, depths.expand_as(parents) > 1)
    parent_depth = depths[parents.clamp(min=0)]
    assert torch.equal(parent_depth[has_parent], (depths.expand_as(parents) - 1)[has_parent])
    parent_score = cands.scores.gather(1, parents.clamp(min=0))
    assert bool((parent_score[has_parent] >= cands.scores[has_parent]).all())
    # SGLang's own choice of verify nodes and tokens
    _, top_index, tokens = eagle_utils.organize_draft_results(score_list, token_list, parents_list, draft_tokens)
    ours = static_slots(cands, draft_tokens)
    assert torch.equal(ours, top_index)
    assert torch.equal(cands.tokens.gather(1, ours), tokens)
    # layer confidence: the best path probability per depth
    conf = layer_confidence(cands)
    for d in range(1, num_steps + 1):
        expected = cands.scores[:, depths == d].amax(dim=1)
        assert torch.equal(conf[:, d - 1], expected)
    assert bool((conf[:, 1:] <= conf[:, :-1]).all())  # a deeper best path is never more likely


def test_candidate_depths_and_shape_errors() -> None:
    assert candidate_depths(3, 2).tolist() == [1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
    with pytest.raises(ValueError, match=r"must all be \[R, 10\]"):
        DraftCandidates(torch.zeros(1, 9), torch.zeros(1, 9), torch.zeros(1, 9), 3, 2)


def _toy_candidates() -> DraftCandidates:
    # K = 2, S = 3: depth 1 = {0, 1}; depth 2 = {2..5} (children of 0: 2, 3; of 1: 4, 5);
    # beam at depth 2 = {2, 4}; depth 3 = {6..9} (children of 2: 6, 7; of 4: 8, 9)
    scores = torch.tensor([[0.6, 0.4, 0.30, 0.20, 0.39, 0.01, 0.15, 0.10, 0.35, 0.02]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]])
    tokens = torch.arange(10)[None] + 100
    return DraftCandidates(scores, tokens, parents, num_steps=3, topk=2)


def test_allocate_nodes_by_hand() -> None:
    cands = _toy_candidates()
    # a chain of width 1: best child of the root (0), its best child (2), its best child (6)
    chain = allocate_nodes(cands, torch.tensor([[1, 1, 1]]))
    assert chain.nonzero()[:, 1].tolist() == [0, 2, 6]
    # width 2 at depth 1, then the best 2 among children of {0, 1}: 4 (0.39) and 2 (0.30)
    wide = allocate_nodes(cands, torch.tensor([[2, 2, 1]]))
    assert wide.nonzero()[:, 1].tolist() == [0, 1, 2, 4, 8]
    # more than the tree offers at a depth: served with what there is
    assert allocate_nodes(cands, torch.tensor([[5, 0, 0]])).nonzero()[:, 1].tolist() == [0, 1]
    # nothing at depth 1 means nothing below
    assert not allocate_nodes(cands, torch.tensor([[0, 3, 3]])).any()


def test_verify_slots_fill_with_cut_nodes_by_hand() -> None:
    cands = _toy_candidates()
    allocated = allocate_nodes(cands, torch.tensor([[1, 1, 1]]))  # {0, 2, 6}
    index, kept = verify_slots(cands, allocated, num_draft_tokens=6)
    # 5 slots: the chain, then the best others by path probability: 1 (0.4), 4 (0.39)
    assert index.tolist() == [[0, 1, 2, 4, 6]]
    assert kept.tolist() == [[True, True, False, True, False, True]]
    assert static_slots(cands, 6).tolist() == [[0, 1, 2, 4, 8]]


@given(seed=st.integers(0, 10_000), width_cap=st.integers(0, 3))
def test_allocation_and_slots_are_trees(seed, width_cap) -> None:
    gen = torch.Generator().manual_seed(seed)
    topk, num_steps, draft_tokens, batch = 3, 4, 9, 3
    n = topk + (num_steps - 1) * topk * topk
    # random drafter in SGLang's numbering: beams = best K of each depth
    scores = torch.zeros(batch, n)
    parents = torch.full((batch, n), -1, dtype=torch.int64)
    first = torch.rand(batch, topk, generator=gen).sort(dim=1, descending=True).values
    scores[:, :topk] = first
    beam_idx = torch.arange(topk).expand(batch, topk)
    for step in range(1, num_steps):
        start = topk + (step - 1) * topk * topk
        beam_scores = scores.gather(1, beam_idx)
        child = beam_scores[:, :, None] * torch.rand(batch, topk, topk, generator=gen)
        scores[:, start : start + topk * topk] = child.flatten(1)
        parents[:, start : start + topk * topk] = beam_idx.repeat_interleave(topk, dim=1)
        beam_idx = child.flatten(1).topk(topk, dim=1).indices + start
    cands = DraftCandidates(scores, torch.zeros_like(parents), parents, num_steps, topk)
    widths = torch.randint(0, width_cap + 1, (batch, num_steps), generator=gen)
    widths = torch.where(widths.cumsum(1) <= draft_tokens - 1, widths, 0)
    allocated = allocate_nodes(cands, widths)
    depths = cands.depths()
    for r in range(batch):
        chosen = set(allocated[r].nonzero().flatten().tolist())
        for c in chosen:  # closed under parents, never above the grant
            assert parents[r, c] < 0 or int(parents[r, c]) in chosen
        for d in range(1, num_steps + 1):
            assert sum(1 for c in chosen if depths[c] == d) <= int(widths[r, d - 1])
    index, kept = verify_slots(cands, allocated, draft_tokens)
    for r in range(batch):
        slots = index[r].tolist()
        assert slots == sorted(set(slots)) and len(slots) == draft_tokens - 1
        assert set(allocated[r].nonzero().flatten().tolist()) <= set(slots)
        for c in slots:
            assert parents[r, c] < 0 or int(parents[r, c]) in slots
        assert kept[r, 1:].tolist() == [bool(allocated[r, c]) for c in slots]


# ---------------------------------------------------------------------------------- tree cutting


def _links(parent_of: list[int]) -> tuple[list[int], list[int]]:
    """First-child / next-sibling links of a tree given each node's parent (node 0 = root)."""
    width = len(parent_of)
    next_token, next_sibling = [-1] * width, [-1] * width
    for node in range(width - 1, 0, -1):  # prepend: siblings end up in increasing order
        parent = parent_of[node]
        if parent is None:  # not in the tree
            continue
        next_sibling[node] = next_token[parent]
        next_token[parent] = node
    return next_token, next_sibling


def _walk(next_token, next_sibling, tokens, target):
    """Greedy tree acceptance: follow the child holding the target's token at each node."""
    path, node = [], 0
    while True:
        child = next_token[node]
        while child != -1 and tokens[child] != target[node]:
            child = next_sibling[child]
        if child == -1:
            return path
        path.append(child)
        node = child


@given(seed=st.integers(0, 10_000), width=st.integers(1, 12))
def test_cut_tree_keeps_exactly_the_kept_nodes(seed, width) -> None:
    rng = random.Random(seed)
    parent_of = [-1] + [rng.randrange(0, node) for node in range(1, width)]
    kept = [True] + [False] * (width - 1)
    for node in range(1, width):
        kept[node] = kept[parent_of[node]] and rng.random() < 0.7
    next_token, next_sibling = _links(parent_of)
    new_token, new_sibling = cut_tree(torch.tensor([next_token]), torch.tensor([next_sibling]), torch.tensor([kept]))
    assert acceptable_nodes(new_token, new_sibling)[0].tolist() == kept
    # the cut tree is the kept subtree with its sibling order
    expected = _links([p if kept[n] else None for n, p in enumerate(parent_of)])
    masked = [[v if kept[n] else -1 for n, v in enumerate(links)] for links in expected]
    assert new_token[0].tolist() == masked[0] and new_sibling[0].tolist() == masked[1]
    # every accepted path of the cut tree is accepted in the original one too
    tokens = rng.sample(range(100), width)  # siblings of a draft tree hold distinct tokens
    for _ in range(5):
        target = [rng.choice(tokens) for _ in range(width)]
        cut_path = _walk(new_token[0].tolist(), new_sibling[0].tolist(), tokens, target)
        assert all(kept[n] for n in cut_path)
        full_path = _walk(next_token, next_sibling, tokens, target)
        first_cut = next((i for i, n in enumerate(full_path) if not kept[n]), len(full_path))
        assert cut_path == full_path[:first_cut]


def test_cut_tree_by_hand_and_errors() -> None:
    # root -> 1, 2, 3; 2 -> 4.  Cut 2 (and so 4): 1's sibling becomes 3.
    next_token = torch.tensor([[1, -1, 4, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, 3, -1, -1]])
    kept = torch.tensor([[True, True, False, True, False]])
    token, sibling = cut_tree(next_token, next_sibling, kept)
    assert token.tolist() == [[1, -1, -1, -1, -1]] and sibling.tolist() == [[-1, 3, -1, -1, -1]]
    # cutting the first child moves the parent's link
    token, sibling = cut_tree(next_token, next_sibling, torch.tensor([[True, False, True, True, True]]))
    assert token.tolist() == [[2, -1, 4, -1, -1]] and sibling.tolist() == [[-1, -1, 3, -1, -1]]
    with pytest.raises(ValueError, match=r"\[R, D\]"):
        cut_tree(next_token, next_sibling, kept[:, :3])


# ----------------------------------------------------------------------------------- calibration


def test_auc_and_youden_known_answers() -> None:
    # pairs (pos, neg): (0.2, 0.2) tie = 1/2, (0.2, 0.1), (0.4, 0.2), (0.4, 0.1) = 1 each
    assert depth_auc([0.2, 0.4, 0.2, 0.1], [True, True, False, False]) == pytest.approx(3.5 / 4)
    assert depth_auc([0.9, 0.8, 0.1, 0.2], [True, True, False, False]) == 1.0
    assert depth_auc([0.1, 0.2, 0.9, 0.8], [True, True, False, False]) == 0.0
    assert math.isnan(depth_auc([0.1, 0.2], [True, True]))
    # separable: the gate sits on the highest negative
    assert youden_threshold([0.9, 0.8, 0.1, 0.3], [True, True, False, False]) == (0.3, 1.0, 1.0, 0.0)
    # positives 0.5, 0.7, 0.9; negatives 0.2, 0.6, 0.8: c > 0.2 gives TPR 1, FPR 2/3, J 1/3;
    # c > 0.6 gives TPR 2/3, FPR 1/3, J 1/3 too -> the lower threshold wins
    threshold, j, tpr, fpr = youden_threshold([0.5, 0.7, 0.9, 0.2, 0.6, 0.8], [True] * 3 + [False] * 3)
    assert (threshold, tpr, fpr) == (0.2, 1.0, pytest.approx(2 / 3)) and j == pytest.approx(1 / 3)
    # no gate beats passing everyone
    assert youden_threshold([0.1, 0.9], [True, False])[0] == -math.inf


def _log(tmp_path, rows, accepted, num_steps=3):
    path = tmp_path / "echo.jsonl"
    with open(path, "w") as handle:
        for start in range(0, len(rows), 4):
            record = EchoLogRecord(num_steps, 4, 8, rows[start : start + 4], accepted[start : start + 4])
            handle.write(record.to_json() + "\n")
    return path


def test_calibration_picks_sweet_spots_and_thresholds(tmp_path) -> None:
    rng = random.Random(0)
    rows, accepted = [], []
    for _ in range(400):
        length = rng.randint(0, 3)
        # depth 1: separable at 0.5; depth 2: weakly informative (AUC ~0.6); depth 3: separable at 0.2
        c1 = 0.5 + rng.random() * 0.5 if length >= 1 else rng.random() * 0.5
        c2 = rng.random() * 0.5 + (0.1 if length >= 2 else 0.0)
        c3 = 0.2 + rng.random() * 0.1 if length >= 3 else rng.random() * 0.2
        rows.append([c1, c2, c3])
        accepted.append(length)
    records = read_echo_log(_log(tmp_path, rows, accepted))
    assert len(records) == 100
    calib = calibrate(records, auc_threshold=0.75, min_samples=20)
    by_depth = {r.depth: r for r in calib.depths}
    assert by_depth[1].auc == 1.0 and by_depth[3].auc == 1.0
    assert 0.55 < by_depth[2].auc < 0.75
    assert set(calib.gates) == {1, 3}
    neg1 = max(r[0] for r, a in zip(rows, accepted, strict=True) if a < 1)
    neg3 = max(r[2] for r, a in zip(rows, accepted, strict=True) if a < 3)
    assert calib.gates == {1: neg1, 3: neg3}
    # an intermediate depth needs the AUC threshold; the root and the target depth only beat chance
    assert set(calibrate(records, auc_threshold=0.55).gates) == {1, 2, 3}
    # too few samples of a class: never gated
    assert calibrate(records, min_samples=1000).gates == {}
    # round trip through the file the server reads
    calib.save(tmp_path / "calib.json")
    loaded = EchoCalibration.load(tmp_path / "calib.json")
    assert loaded.gates == calib.gates and loaded.num_steps == 3 and loaded.num_draft_tokens == 8
    gated, thresholds = loaded.gate_tensors()
    assert gated.tolist() == [True, False, True]
    assert thresholds[0] == pytest.approx(neg1) and thresholds[2] == pytest.approx(neg3)
    data = json.loads((tmp_path / "calib.json").read_text())
    assert [d["depth"] for d in data["depths"]] == [1, 2, 3]


def test_calibration_input_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no such file"):
        read_echo_log(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"num_steps": 2, "topk": 2, "num_draft_tokens": 4, "confidence": [[0.1]], "accepted": [0]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: .*2 depths|1 depths"):
        read_echo_log(bad)
    with pytest.raises(ValueError, match="outside"):
        EchoLogRecord(2, 2, 4, [[0.1, 0.2]], [3])
    (tmp_path / "other.json").write_text('{"format": "something"}')
    with pytest.raises(ValueError, match="echo-calibrate"):
        EchoCalibration.load(tmp_path / "other.json")
    with pytest.raises(ValueError, match=r"outside 1\.\.num_steps"):
        EchoCalibration(num_steps=2, topk=2, num_draft_tokens=4, gates={3: 0.1})
    with pytest.raises(ValueError, match="auc_threshold"):
        calibrate([EchoLogRecord(1, 2, 3, [[0.5]], [1])], auc_threshold=0.3)


# ------------------------------------------------------------------ marginal utility (Theorem 2)


def _concave_curves(rng: random.Random, count: int, length: int) -> list[list[float]]:
    curves = []
    for _ in range(count):
        gains = sorted((rng.random() for _ in range(length)), reverse=True)
        curve = [0.0]
        for gain in gains:
            curve.append(curve[-1] + gain)
        curves.append(curve)
    return curves


@given(seed=st.integers(0, 10_000))
def test_marginal_utility_exchange(seed) -> None:
    rng = random.Random(seed)
    curves = _concave_curves(rng, rng.randint(2, 4), rng.randint(2, 5))
    length = len(curves[0]) - 1
    k_max = rng.randint(1, len(curves) * length)
    allocation = [0] * len(curves)
    for _ in range(k_max):  # a random feasible split of k_max
        allocation[rng.choice([i for i, k in enumerate(allocation) if k < length])] += 1
    # Theorem 2: moving one candidate i -> j changes the objective by Δ_j(K_j + 1) - Δ_i(K_i)
    for i, j in itertools.permutations(range(len(curves)), 2):
        if allocation[i] == 0 or allocation[j] == length:
            continue
        moved = list(allocation)
        moved[i] -= 1
        moved[j] += 1
        change = batch_objective(curves, moved) - batch_objective(curves, allocation)
        predicted = marginal_gain(curves[j], allocation[j] + 1) - marginal_gain(curves[i], allocation[i])
        assert change == pytest.approx(predicted)
        assert (change > 1e-12) == (predicted > 1e-12)
    # exchanging while it helps reaches the optimum, which is what greedy marginal allocation finds
    while (pair := improving_exchange(curves, allocation)) is not None:
        before = batch_objective(curves, allocation)
        allocation[pair[0]] -= 1
        allocation[pair[1]] += 1
        assert batch_objective(curves, allocation) > before
    best = max(
        batch_objective(curves, split)
        for split in itertools.product(range(length + 1), repeat=len(curves))
        if sum(split) == k_max
    )
    assert batch_objective(curves, allocation) == pytest.approx(best)
    greedy = greedy_allocation(curves, k_max)
    assert sum(greedy) == k_max and batch_objective(curves, greedy) == pytest.approx(best)
    assert improving_exchange(curves, greedy) is None


def test_echo_calibrate_command(tmp_path, capsys) -> None:
    from xshare_sglang.cli import main

    rng = random.Random(1)
    rows, accepted = [], []
    for _ in range(200):
        length = rng.randint(0, 2)
        rows.append([0.6 + 0.4 * rng.random() if length >= 1 else 0.6 * rng.random(), rng.random(), rng.random()])
        accepted.append(length)
    log = _log(tmp_path, rows, accepted)
    out = tmp_path / "calib.json"
    assert main(["echo-calibrate", str(log), "-o", str(out), "--min-samples", "10"]) == 0
    calib = EchoCalibration.load(out)
    assert set(calib.gates) == {1}
    assert calib.gates[1] == max(r[0] for r, a in zip(rows, accepted, strict=True) if a < 1)
    text = capsys.readouterr().out
    assert "ECHO calibration: 50 verify steps" in text and "depth 1 >" in text
    with pytest.raises(SystemExit) as exc:
        main(["echo-calibrate", str(tmp_path / "nothing.jsonl")])
    assert exc.value.code == 2
