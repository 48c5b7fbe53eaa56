"""What the fused kernels compile to on Hopper, checked without a GPU: Triton compiles them for sm_90
here, with the arguments the wrapper passes and Triton's own argument specialization
(``tests/compile_sm90.py``).

* The retained-mass metric divides with a correctly rounded division (``div.rn.f32``), as the torch
  reference does: a plain ``/`` compiles to ``div.full.f32``, an approximate division, which put the
  metric one fixed-point unit off the reference on an H200.  (The routing weights keep the plain
  ``/``: they are compared within a tolerance, and a correctly rounded division there cost 2.3 us
  per call at T=1 on an H200.)
* The per-call metrics are added with relaxed atomics, never loaded back; above one tile the routing
  kernel counts the activated experts without a ticket.
* Every family of kernel configurations compiles (policies, one launch and two, top-k 1 to 16, the
  four routers, dropped slots filled or not, metrics on or off).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xshare_sglang.config import POLICIES as CONFIG_POLICIES

ROOT = Path(__file__).resolve().parents[1]
# coverage above one tile: top-k scores add pair sums with atomics; dense scores ("probs") keep
# per-expert row lists, also filled with atomics
POLICIES = [*CONFIG_POLICIES, "moe-spec-coverage", "moe-spec-coverage-probs"]


def _case(tokens, policy="xshare", router="softmax", top_k=8, fill=False, metrics=True, **extra) -> dict:
    case = dict(tokens=tokens, experts=128, policy=policy, router=router, top_k=top_k, fill=fill, metrics=metrics)
    return {**case, **extra}


RETAINED_MASS_CASES = [_case(64), _case(7), _case(7, metrics=False), _case(64, "oea")]
METRICS_POLICIES = ("none", "xshare", "moe-spec")
METRICS_CASES = [_case(7, policy, metrics=metrics) for policy in METRICS_POLICIES for metrics in (True, False)]
TICKET_CASES = [_case(64, policy, metrics=metrics) for policy in ("none", "xshare") for metrics in (True, False)]
_routers = itertools.cycle(["softmax", "sigmoid", "grouped", "biased"])
FAMILY_CASES = [
    _case(tokens, policy, next(_routers), top_k, fill, metrics=top_k != 2)
    for policy in POLICIES
    for tokens, (top_k, fill) in itertools.product((7, 64), ((1, True), (2, False), (8, True), (16, False)))
]
UNEVEN_CASES = [
    _case(tokens, policy, router, 8, fill, experts=experts)
    for (tokens, policy, router, experts, fill) in [
        (1, "none", "biased", 160, False),
        (64, "none", "biased", 160, True),
        (7, "xshare", "grouped", 160, False),
        (1, "oea", "biased", 384, True),
        (64, "lynx", "biased", 384, False),
        (64, "moe-spec", "grouped", 512, False),
        (7, "none", "sigmoid", 512, False),
    ]
]
PDL_CASES = [
    _case(64, pdl=True),
    _case(64, "lynx", pdl=True),
    _case(7, pdl=True),
    _case(64),
    _case(7, "lynx"),
    _case(64, "moe-spec-coverage", pdl=True),
]
ALL_CASES = [*RETAINED_MASS_CASES, *METRICS_CASES, *TICKET_CASES, *FAMILY_CASES, *UNEVEN_CASES, *PDL_CASES]


def _key(case: dict) -> str:
    return json.dumps(case, sort_keys=True)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    """Every case of this module compiled for sm_90 in one process (``tests/compile_sm90.py``, without
    ``TRITON_INTERPRET``), each distinct case once: ``{_key(case): {kernel: {ptx op: count}}}`` or
    ``{"error": message}`` for a case that does not compile."""
    cases = list({_key(case): case for case in ALL_CASES}.values())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    result = subprocess.run(
        [sys.executable, "-m", "tests.compile_sm90", json.dumps(cases)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    return {_key(case): out for case, out in zip(cases, results, strict=True)}


def _compile(compiled: dict[str, dict], cases: list[dict]) -> list[dict]:
    return [compiled[_key(case)] for case in cases]


@pytest.mark.fused_selection
def test_retained_mass_divides_correctly_rounded(compiled) -> None:
    multi, single, single_plain, oea = _compile(compiled, RETAINED_MASS_CASES)
    # two launches: the selection kernel's only division is the metric's
    assert set(multi) == {"select_kernel", "route_kernel"}
    ops = multi["select_kernel"]
    assert ops["div.full.f32"] == ops["div.approx.f32"] == ops["div.approx.ftz.f32"] == 0, ops
    assert ops["div.rn.f32"] >= 1, ops
    # oea's retained mass is divided by the routing kernel (route_mass): correctly rounded, beside the
    # routing weights' plain divisions, which stay as in xshare's routing kernel
    routing, plain_routing = oea["route_kernel"], multi["route_kernel"]
    assert routing["div.rn.f32"] > plain_routing["div.rn.f32"], (routing, plain_routing)
    for op in ("div.full.f32", "div.approx.f32", "div.approx.ftz.f32"):
        assert routing[op] == plain_routing[op], (op, routing, plain_routing)
    # one launch: turning the metrics on adds correctly rounded divisions and no approximate one
    with_metrics, without = single["select_kernel"], single_plain["select_kernel"]
    assert with_metrics["div.rn.f32"] > without["div.rn.f32"], (with_metrics, without)
    for op in ("div.full.f32", "div.approx.f32", "div.approx.ftz.f32"):
        assert with_metrics[op] == without[op], (op, with_metrics, without)


@pytest.mark.fused_selection
def test_metrics_are_added_without_reading_them_back(compiled) -> None:
    """A one-launch call adds its four metrics with relaxed int64 atomics whose result is unused (a
    reduction the GPU queues without waiting) and loads no more than the same call without metrics.
    A load-add-store per metric waited a memory round trip each and held back the routing's loads."""
    results = _compile(compiled, METRICS_CASES)
    for policy, with_metrics, without in zip(METRICS_POLICIES, results[::2], results[1::2], strict=True):
        assert set(with_metrics) == {"select_kernel"}, policy
        got, plain = with_metrics["select_kernel"], without["select_kernel"]
        assert got["ld.global"] == plain["ld.global"], (policy, got, plain)
        added = got["atom.global.gpu.relaxed.add.u64"] - plain["atom.global.gpu.relaxed.add.u64"]
        assert added == 4, (policy, got, plain)


@pytest.mark.fused_selection
def test_routing_counts_activated_experts_without_a_ticket(compiled) -> None:
    """Above one tile the routing kernel counts the activated experts with one relaxed atomic add per
    expert (visits and marks in one word) and no acquire-release ticket; it loads nothing more than
    without metrics."""
    results = _compile(compiled, TICKET_CASES)
    for with_metrics, without in zip(results[::2], results[1::2], strict=True):
        got, plain = with_metrics["route_kernel"], without["route_kernel"]
        assert got["atom.global.gpu.acq_rel"] == plain["atom.global.gpu.acq_rel"] == 0, (got, plain)
        assert got["ld.global"] == plain["ld.global"], (got, plain)
        # the visit of each expert, the activated count, and (policy none) the three call metrics
        assert got["atom.global.gpu.relaxed.add.u64"] > plain["atom.global.gpu.relaxed.add.u64"], (got, plain)


@pytest.mark.fused_selection
def test_every_configuration_family_compiles_for_sm90(compiled) -> None:
    cases = FAMILY_CASES
    results = _compile(compiled, cases)
    failed = [(case, result["error"]) for case, result in zip(cases, results, strict=True) if "error" in result]
    assert not failed, f"{len(failed)} of {len(cases)} configurations do not compile: {failed[:5]}"


@pytest.mark.fused_selection
def test_uneven_groups_and_wide_rows_compile_for_sm90(compiled) -> None:
    """Expert groups that do not split a power-of-two E (ranked one group at a time) and rows wider
    than one warp (E > 256), with and without a bias, in one program and in the routing kernel: the
    family above is all E=128."""
    cases = UNEVEN_CASES
    results = _compile(compiled, cases)
    failed = [(case, result["error"]) for case, result in zip(cases, results, strict=True) if "error" in result]
    assert not failed, failed


def test_loop_bodies_count_one_trip_of_each_loop() -> None:
    """``kernel_sass.py --loops`` reads each loop off the SASS: the instructions from a backward
    branch's target to the branch, an inner loop counted once inside its outer loop, NOPs and
    forward branches left out."""
    from xshare_sglang.bench.kernel_compile import LoopBody, loop_bodies

    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0030*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0040*/                   LDG.E R5, desc[UR4][R4.64] ;
        /*0050*/              @P0  BRA 0x40 ;
        /*0060*/                   NOP ;
        /*0070*/              @!P1 BRA 0x20 ;
        /*0080*/                   BRA 0xa0 ;
        /*0090*/                   IADD3 R1, R1, 0x1, RZ ;
        /*00a0*/                   EXIT ;
    """
    assert loop_bodies(sass) == [
        LoopBody(instructions=2, barriers=0, shuffles=0, global_loads=1),
        LoopBody(instructions=5, barriers=1, shuffles=1, global_loads=1),
    ]
    assert str(loop_bodies(sass)[1]) == "5/1/1/1"
    # ptxas may place a loop's latch out of line, after the EXIT: the loop is the blocks on a path from
    # its header to the latch (0x20-0x30 and 0x70-0x80), not the address range 0x20-0x80, whose
    # 0x40-0x60 no trip runs; the closing branch to itself is no loop
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   SHFL.BFLY PT, R3, R2, 0x1, 0x1f ;
        /*0030*/              @P0  BRA 0x70 ;
        /*0040*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0050*/                   LDG.E R5, desc[UR4][R4.64] ;
        /*0060*/                   EXIT ;
        /*0070*/                   LDG.E R6, desc[UR4][R4.64] ;
        /*0080*/                   BRA 0x20 ;
        /*0090*/                   BRA 0x90 ;
    """
    assert loop_bodies(sass) == [LoopBody(instructions=4, barriers=0, shuffles=1, global_loads=1)]


@pytest.mark.fused_selection
def test_dependent_launches_wait_before_touching_memory(compiled) -> None:
    """``enable_pdl``: every kernel's first global memory access comes after its grid dependency wait;
    the selection (and LYNX's pick kernel) let the next kernel of the call launch early, the routing
    kernel (the call's last, followed by SGLang's kernels) and a one-program call do not; without
    ``enable_pdl`` no kernel holds grid dependency control."""
    multi, lynx, single, plain_multi, plain_single, pairs = _compile(compiled, PDL_CASES)
    wait, trigger = "griddepcontrol.wait", "griddepcontrol.launch_dependents"
    # no counter reset launch (each kernel's last program clears its counters); the coverage
    # ranking's pair sums are zeroed by a kernel of ours, which waits and then triggers the selection
    assert set(multi) == {"select_kernel", "route_kernel"} and set(single) == {"select_kernel"}
    assert set(lynx) == {"select_kernel", "lynx_pick_kernel", "route_kernel"}
    assert set(plain_multi) == {"select_kernel", "route_kernel"}
    assert set(pairs) == {"fill_kernel", "select_kernel", "route_kernel"}
    for name, ops in [*multi.items(), *lynx.items(), *single.items(), *pairs.items()]:
        assert ops[wait] >= 1 and ops["global_before_wait"] == 0, (name, ops)
    assert pairs["fill_kernel"][trigger] >= 1 and pairs["select_kernel"][trigger] >= 1
    assert multi["select_kernel"][trigger] >= 1 and multi["route_kernel"][trigger] == 0
    assert lynx["select_kernel"][trigger] >= 1 and lynx["lynx_pick_kernel"][trigger] >= 1
    assert lynx["route_kernel"][trigger] == 0 and single["select_kernel"][trigger] == 0
    for name, ops in [*plain_multi.items(), *plain_single.items()]:
        assert ops[wait] == ops[trigger] == 0, (name, ops)
