"""Put a copy of ``triton_kernels`` that imports under the GPU machine's Triton 3.6 into ``.sgl/site``.

``gpu_check.sh``'s ``kernel_routing`` stage times GPT-OSS's default routing, which is
``triton_kernels``' top-k; the GPU machine has no SGLang, so the package travels in ``.sgl/site``
(see docs/benchmarks.md, "How to run on a lent GPU").  The copy SGLang 0.5.23 installs targets a newer
Triton: its ``target_info.py`` imports ``is_hip_gfx1250`` from ``triton.language.target_info``, which
Triton 3.6 does not define, and nothing else stops it (checked here: with Triton 3.6 and this one
change, ``triton_kernels.topk`` imports, runs under the interpreter, and its four kernels compile for
sm_90).  This script copies the installed package without ``__pycache__`` and defines that one
predicate in the copy (false: it asks whether the target is an AMD gfx1250, and the GPU machine is
an NVIDIA one).  Nothing of it enters the repository: ``.sgl/`` is ignored.

Usage, from the repository root, after ``make .venv/.installed``::

    .venv/bin/python scripts/carry_triton_kernels.py
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

IMPORT_LINE = "    is_hip_gfx1250,\n"
DEFINITION = (
    "\n\n@triton.constexpr_function\n"
    "def is_hip_gfx1250():  # carried to Triton 3.6, which lacks it: never an AMD gfx1250 there\n"
    "    return False\n\n"
)


def carry(source: Path, destination: Path) -> Path:
    """Copy the package ``source`` to ``destination``/triton_kernels with the Triton 3.6 change made.

    Raises
    ------
    SystemExit
        When ``source`` is not the package this script knows how to change.
    """
    target_info = source / "target_info.py"
    text = target_info.read_text(encoding="utf-8") if target_info.is_file() else ""
    if text.count(IMPORT_LINE) != 1:
        raise SystemExit(f"{target_info}: no single import of is_hip_gfx1250 to replace; copy it by hand")
    copy = destination / "triton_kernels"
    if copy.exists():
        shutil.rmtree(copy)
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    head, tail = text.split(IMPORT_LINE)
    closing = tail.index(")\n") + 2  # the end of the import statement
    (copy / "target_info.py").write_text(head + tail[:closing] + DEFINITION + tail[closing:], encoding="utf-8")
    return copy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--destination", type=Path, default=Path(".sgl/site"), help="default: .sgl/site")
    args = parser.parse_args(argv)
    import triton_kernels  # the copy SGLang installed

    copy = carry(Path(triton_kernels.__file__).parent, args.destination)
    size = sum(path.stat().st_size for path in copy.rglob("*") if path.is_file())
    print(f"{copy}: {size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
