"""Build the device bundle: what the lent GPU machine needs, besides this checkout, to start SGLang.

Usage::

    python scripts/device_bundle.py                 # builds .device_bundle/ (git-ignored), prints sizes
    python scripts/device_bundle.py --no-wheels     # the SGLang archive only (no network needed)

Writes ``.device_bundle/sglang.tar.xz`` (SGLang 0.5.23's ``.py`` files and the tuned MoE configs of
Qwen3-30B-A3B's expert shape), ``.device_bundle/sgl_kernel_scalar_type.py`` and
``.device_bundle/wheels/*.whl`` (see ``xshare_sglang/testing/device_bundle.py``), then prints the
bundle's size, the checkout's (what a device call sends besides carried paths) and their sum against
the 64 MiB a call carries.  Exits 1 when the sum is over the limit, saying by how much, and 2 when
``--out`` names a non-empty folder that is not a bundle (it is never removed).  Carry the
bundle with ``carry=[".device_bundle"]``; ``python -m xshare_sglang.testing.gpu_server`` unpacks it.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from xshare_sglang.testing import device_bundle as db  # noqa: E402

logger = logging.getLogger("device_bundle")


def mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / db.BUNDLE_DIR, help="bundle folder (default: %(default)s)")
    parser.add_argument("--no-wheels", action="store_true", help="skip downloading the wheels")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    out: Path = args.out
    if out.exists():
        if any(out.iterdir()) and not (out / db.SGLANG_ARCHIVE).is_file():
            logger.error("%s is not empty and holds no %s: not removing it", out, db.SGLANG_ARCHIVE)
            return 2
        shutil.rmtree(out)
    out.mkdir(parents=True)

    files = db.sglang_files()
    missing_configs = sorted(set(db.MOE_CONFIGS) - db.found_moe_configs(files))
    if missing_configs:
        logger.warning("tuned MoE configs not in this SGLang: %s", ", ".join(missing_configs))
    archive = db.write_sglang_archive(out / db.SGLANG_ARCHIVE)
    shutil.copyfile(db.scalar_type_source(), out / db.SCALAR_TYPE_FILE)
    logger.info("%s: %d files, %s", archive.name, len(files), mib(archive.stat().st_size))

    if not args.no_wheels:
        wheels = db.download_wheels(out / db.WHEEL_DIR, db.BUNDLE_WHEELS)
        for wheel in wheels:
            logger.info("  %s  %s", wheel.name, mib(wheel.stat().st_size))
        logger.info("wheels: %d, %s", len(wheels), mib(db.tree_size(out / db.WHEEL_DIR)))

    bundle = db.tree_size(out)
    checkout = db.checkout_size(REPO)
    total = bundle + checkout
    logger.info("bundle %s + checkout %s = %s (limit %s)", mib(bundle), mib(checkout), mib(total), mib(db.CARRY_LIMIT))
    if total > db.CARRY_LIMIT:
        logger.error("over the device call's limit by %s", mib(total - db.CARRY_LIMIT))
        return 1
    logger.info("fits, with %s to spare", mib(db.CARRY_LIMIT - total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
