"""What the fused kernels compile to on Hopper, checked without a GPU: Triton compiles them for sm_90
here with the arguments the wrapper passes (``tests/compile_sm90.py``).

Every division in the kernels must be correctly rounded (``div.rn.f32``), as the torch reference's
are: a plain ``/`` compiles to ``div.full.f32``, an approximate division, which put the retained-mass
metric one fixed-point unit off the reference on an H200.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.fused_selection
@pytest.mark.parametrize("router", ["softmax", "grouped"])
@pytest.mark.parametrize(("num_tokens", "kernels"), [(7, {"select_kernel"}), (64, {"select_kernel", "route_kernel"})])
def test_every_division_is_correctly_rounded(num_tokens, kernels, router) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    case = f"{num_tokens},128,xshare,{router}"
    result = subprocess.run(
        [sys.executable, "-m", "tests.compile_sm90", case],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    counts = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(counts) == kernels
    for name, ops in counts.items():
        approximate = {op: n for op, n in ops.items() if op != "div.rn.f32" and n}
        assert not approximate, f"{name} ({case}) divides approximately: {approximate}"
        assert ops["div.rn.f32"] > 0, f"{name} ({case}): no division found, the check saw nothing"
