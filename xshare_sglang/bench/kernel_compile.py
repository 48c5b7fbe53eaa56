"""Compile the fused selection kernels for a GPU on a machine without one, exactly as a launch would.

The launch wrapper plans a ``prune_route`` call on CPU tensors
(:func:`~xshare_sglang.kernels.launch.planned_launches`), building every argument as it does on a GPU;
each planned launch is then compiled for
the target (sm_90 by default) with Triton's own argument specialization (the binder a real launch
runs: alignment and value-1 specialization of the arguments).  The result is what the GPU would run:
its PTX, and its SASS through the ``cuobjdump`` Triton ships.

Used by ``scripts/kernel_sass.py`` (per-policy SASS counts, the proxy for serial work) and by
``tests/test_kernels_ptx.py`` (what the PTX must and must not contain).  Needs ``TRITON_INTERPRET``
unset when the kernel module is imported (the jit functions must be real ``JITFunction`` objects).
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass

PTX_OPS = (
    "div.full.f32",
    "div.approx.f32",
    "div.approx.ftz.f32",
    "div.rn.f32",
    "griddepcontrol.wait",
    "griddepcontrol.launch_dependents",
    "ld.global",
    "atom.global.gpu.relaxed.add.u64",
    "atom.global.gpu.acq_rel",
)
GLOBAL_MEMORY_OPS = ("ld.global", "st.global", "atom.global", "red.global")


def capture_launches(call, cfg, **prune_route_kwargs) -> dict[str, tuple]:
    """The launches one :func:`~xshare_sglang.kernels.prune_route` call makes, without launching:
    ``{kernel name: (grid, args, kwargs)}`` (:func:`~xshare_sglang.kernels.launch.planned_launches`).
    ``call`` holds CPU tensors."""
    from ..kernels.launch import planned_launches

    launches = planned_launches(call, cfg, **prune_route_kwargs)
    return {launch.kernel: (launch.grid, launch.args, launch.kwargs) for launch in launches}


def compile_launch(name: str, args: tuple, kwargs: dict, capability: int = 90):
    """Compile one recorded launch of ``name`` for ``sm_<capability>``; returns Triton's compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = getattr(importlib.import_module("xshare_sglang.kernels.launch").kernel_module(), name)
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def ptx_counts(compiled) -> dict[str, int]:
    """How often each operation of :data:`PTX_OPS` (divisions, grid dependency control, global loads,
    relaxed int64 atomic adds, acquire-release atomics: tickets) occurs in the
    kernel's PTX, and ``global_before_wait``: the global memory operations written before its first
    ``griddepcontrol.wait`` (all of them when it has none)."""
    ptx = compiled.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    head = ptx if wait < 0 else ptx[:wait]
    counts = {op: ptx.count(op) for op in PTX_OPS}
    counts["global_before_wait"] = sum(head.count(op) for op in GLOBAL_MEMORY_OPS)
    return counts


@dataclass(frozen=True)
class SassStats:
    """Static counts over one kernel's SASS (every instruction once, loops not unrolled)."""

    instructions: int
    shuffles: int  # SHFL: the steps of cross-lane reductions
    barriers: int  # BAR: block-wide synchronisations
    atomics: int  # ATOM / RED to global memory
    calls: int  # CALL: subroutines (int64 division, correctly rounded division, ...)
    backward_branches: int  # branches to an earlier instruction: loops
    global_loads: int
    local_memory: int  # STL / LDL: registers spilled to local memory and read back
    registers: int


_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_REGISTERS = re.compile(r"REG:(\d+)")


def _cuobjdump(cubin: bytes, *flags: str) -> str:
    import os
    import subprocess
    import tempfile

    from triton import knobs

    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        return subprocess.check_output(
            [knobs.nvidia.cuobjdump.path, *flags, path], text=True, stderr=subprocess.DEVNULL
        )


@dataclass(frozen=True)
class LoopBody:
    """Static counts over one loop: the instructions of every basic block on a path from the loop's
    header to its backward branch (its natural loop), inner loops included (what one trip of the loop
    issues, each inner loop counted once)."""

    instructions: int
    barriers: int
    shuffles: int
    global_loads: int

    def __str__(self) -> str:
        return f"{self.instructions}/{self.barriers}/{self.shuffles}/{self.global_loads}"


def _branch_target(opcode: str, operands: str) -> int | None:
    """The address a ``BRA`` jumps to, or None for any other instruction."""
    if opcode.split(".")[0] != "BRA":
        return None
    target = re.search(r"0x([0-9a-f]+)", operands)
    return None if target is None else int(target.group(1), 16)


def loop_bodies(sass: str) -> list[LoopBody]:
    """Every loop of a kernel's SASS text (``cuobjdump -sass``), in the order of their backward branches.

    A loop is the natural loop of a backward branch (a ``BRA`` to an earlier address; ptxas's closing
    branch to itself is none):
    its header (the target's block) and every block that reaches the branch's block without passing
    through the header, on the control-flow graph of the listing.  Not the address range from target
    to branch: ptxas places blocks out of line (a loop's latch after the kernel's ``EXIT``, say), and
    the range then takes in code no trip runs.
    """
    listing = [
        (int(m.group(1), 16), m.group(2) is not None, m.group(3), m.group(4))
        for m in _INSTRUCTION.finditer(sass)
        if not m.group(3).startswith("NOP")
    ]
    if not listing:
        return []

    def block_index(address: int) -> int:
        # a branch target is an instruction address; NOPs were left out, so take the next one kept
        return next(i for i, (at, *_) in enumerate(listing) if at >= address)

    leaders = {0}
    for i, (_, _, opcode, operands) in enumerate(listing):
        target = _branch_target(opcode, operands)
        if target is not None:
            leaders.add(block_index(target))
        if target is not None or opcode.split(".")[0] in ("EXIT", "RET"):
            leaders.add(i + 1)
    starts = sorted(leader for leader in leaders if leader < len(listing))
    blocks = [range(a, b) for a, b in zip(starts, [*starts[1:], len(listing)], strict=True)]
    block_at = {start: number for number, start in enumerate(starts)}
    predecessors: list[set[int]] = [set() for _ in blocks]
    back_edges = []
    for number, block in enumerate(blocks):
        _, predicated, opcode, operands = listing[block[-1]]
        base = opcode.split(".")[0]
        target = _branch_target(opcode, operands)
        # a branch with a predicate (on the instruction or as an operand) may fall through
        conditional = predicated or (target is not None and re.match(r"\s*!?U?P\w+\s*,", operands) is not None)
        if target is not None:
            header = block_at[block_index(target)]
            predecessors[header].add(number)
            if listing[block[-1]][0] > target:
                back_edges.append((number, header))
        falls_through = (target is None and base not in ("EXIT", "RET")) or conditional
        if base in ("EXIT", "RET") and predicated:
            falls_through = True
        if falls_through and number + 1 < len(blocks):
            predecessors[number + 1].add(number)
    bodies = []
    for latch, header in back_edges:
        members = {header, latch}
        stack = [latch] if latch != header else []
        while stack:
            for before in predecessors[stack.pop()]:
                if before not in members:
                    members.add(before)
                    stack.append(before)
        body = [listing[i][2].split(".")[0] for number in sorted(members) for i in blocks[number]]
        bodies.append(
            LoopBody(
                instructions=len(body),
                barriers=body.count("BAR"),
                shuffles=body.count("SHFL"),
                global_loads=sum(op in ("LDG", "LD") for op in body),
            )
        )
    return bodies


def kernel_sass(compiled) -> str:
    """The SASS text of a compiled kernel."""
    return _cuobjdump(compiled.asm["cubin"], "-sass")


def sass_stats(compiled) -> SassStats:
    """Count the SASS of a compiled kernel (disassembled with the ``cuobjdump`` Triton ships)."""
    cubin = compiled.asm["cubin"]
    sass = _cuobjdump(cubin, "-sass")
    counts = dict(
        instructions=0, shuffles=0, barriers=0, atomics=0, calls=0, backward_branches=0, global_loads=0, local_memory=0
    )
    for match in _INSTRUCTION.finditer(sass):
        address, opcode, operands = int(match.group(1), 16), match.group(3), match.group(4)
        base = opcode.split(".")[0]
        if base == "NOP":
            continue
        counts["instructions"] += 1
        counts["shuffles"] += base == "SHFL"
        counts["barriers"] += base == "BAR"
        counts["atomics"] += base in ("ATOM", "ATOMG", "RED", "REDG")
        counts["calls"] += base == "CALL"
        counts["global_loads"] += base in ("LDG", "LD")
        counts["local_memory"] += base in ("STL", "LDL")
        if base == "BRA":
            target = re.search(r"0x([0-9a-f]+)", operands)
            if target is not None and int(target.group(1), 16) < address:
                counts["backward_branches"] += 1
    registers = _REGISTERS.search(_cuobjdump(cubin, "-res-usage"))
    return SassStats(**counts, registers=int(registers.group(1)) if registers else 0)
