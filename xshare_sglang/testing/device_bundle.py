"""What the lent GPU machine needs besides this checkout to start SGLang 0.5.23's launcher.

The device image has torch 2.11, Triton 3.6 and the distributions of ``device_packages.txt``, but no
SGLang and no network; a device call carries at most 64 MiB of working tree.  The bundle built here
(by ``scripts/device_bundle.py``, into the git-ignored ``.device_bundle/``) holds:

* ``sglang.tar.xz``: every ``.py`` file of the installed SGLang 0.5.23 package, plus the tuned fused-MoE
  configs of :data:`MOE_CONFIGS` (the JSON files SGLang reads for the served expert shape);
* ``sgl_kernel_scalar_type.py``: the pure-Python ``scalar_type.py`` of the real ``sgl_kernel`` wheel
  (the CUDA stand-in loads it; SGLang's quantization code inspects those objects at import time);
* ``wheels/``: the wheels of :data:`BUNDLE_WHEELS`, the distributions the server path imports and the
  image lacks, at the versions installed here (the versions SGLang 0.5.23 resolves to), for CPython
  3.12 on x86-64 Linux.

Modules the path imports but never uses are stood in for instead
(``cuda_standin/_module_standins.py``), and ``sgl_kernel`` by the CUDA stand-in.

:func:`filtered_site` builds a folder holding only the allowed distributions of this environment, so
that a test can import the launcher's modules as the device would find them.

This checkout (:data:`REPO`) and the CUDA stand-in's folder (:func:`cuda_standin_path`) are named here
too; :mod:`.gpu_server` imports them from this module, never the other way round.
"""

from __future__ import annotations

import importlib.metadata as md
import logging
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

#: This checkout (the folder above the ``xshare_sglang`` package).
REPO = Path(__file__).resolve().parents[2]

#: The bundle folder, relative to the repository root (git-ignored).
BUNDLE_DIR = ".device_bundle"
SGLANG_ARCHIVE = "sglang.tar.xz"
SCALAR_TYPE_FILE = "sgl_kernel_scalar_type.py"
WHEEL_DIR = "wheels"

#: The most a device call carries (working tree plus carried paths), in bytes.
CARRY_LIMIT = 64 * 1024 * 1024

#: Distributions the launcher's modules import that the device image lacks, each with the import that
#: needs it (found with ``tests/test_device_bundle.py``'s filtered import; SGLang 0.5.23 paths).
BUNDLE_WHEELS: dict[str, str] = {
    "fastapi": "srt/entrypoints/http_server.py",
    "starlette": "fastapi",
    "opentelemetry-api": "fastapi/telemetry/_api.py",
    "pydantic": "srt/entrypoints/openai/protocol.py, fastapi",
    "pydantic-core": "pydantic",
    "annotated-types": "pydantic",
    "typing-inspection": "pydantic",
    "uvicorn": "srt/entrypoints/http_server.py",
    "orjson": "srt/entrypoints/http_server.py",
    "pyzmq": "srt/managers/* (inter-process queues)",
    "setproctitle": "srt/utils/common.py",
    "msgspec": "srt/managers/io_struct.py",
    "partial-json-parser": "srt/function_call/*",
    "pybase64": "srt/utils/common.py",
    "python-multipart": "fastapi forms (http_server.py)",
    "dill": "srt/configs/deepseek_ocr.py:42 (serialises a logit processor at import)",
    "compressed-tensors": "srt/layers/quantization/compressed_tensors/compressed_tensors.py:21",
    "loguru": "compressed_tensors/logger.py",
    "openai": "srt/entrypoints/openai/protocol.py:41 (pydantic field types)",
    "jiter": "openai",
    "distro": "openai",
    "sniffio": "openai",
    "jsonschema": "srt/entrypoints/openai/serving_chat.py:48",
    "jsonschema-specifications": "jsonschema",
    "referencing": "jsonschema",
    "rpds-py": "referencing",
}

#: The launcher's modules: what ``python -m sglang.launch_server`` imports to serve a bf16 Qwen3-MoE
#: with the triton attention and MoE backends, and the plugin.
LAUNCHER_MODULES: tuple[str, ...] = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.qwen3_moe",
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe",
    "sglang.srt.model_loader.loader",
    "xshare_sglang.sglang_plugin",
)

#: SGLang's benchmark client (``python -m sglang.bench_serving --dataset-name random-ids``), run on
#: the device against the server.
CLIENT_MODULES: tuple[str, ...] = ("sglang.bench_serving",)

#: Tuned fused-MoE configs carried: Qwen3-30B-A3B's experts (E=128, N=768 at TP 1) on H100 and H200.
MOE_CONFIGS: tuple[str, ...] = (
    "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3.json",
    "E=128,N=768,device_name=NVIDIA_H100_80GB_HBM3_down.json",
    "E=128,N=768,device_name=NVIDIA_H200.json",
)


def cuda_standin_path() -> Path:
    """The folder to put first on ``PYTHONPATH``: the CUDA ``sgl_kernel`` stand-in, its ``sitecustomize``
    and the empty module stand-ins."""
    return Path(__file__).resolve().parent / "cuda_standin"


def normalize(name: str) -> str:
    """A distribution name as the package index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages() -> set[str]:
    """The normalized distribution names of the device image (``device_packages.txt``)."""
    text = (Path(__file__).resolve().parent / "device_packages.txt").read_text()
    return {normalize(line) for line in text.splitlines() if line.strip() and not line.startswith("#")}


def sglang_dir() -> Path:
    """The installed ``sglang`` package folder (found without importing it)."""
    return Path(md.distribution("sglang").locate_file("sglang"))


def sglang_files(root: Path | None = None) -> list[Path]:
    """The files of the SGLang archive, relative to the folder above ``sglang/``: every ``.py`` file,
    and the tuned MoE configs of :data:`MOE_CONFIGS` wherever SGLang keeps them."""
    root = root or sglang_dir()
    base = root.parent
    files = sorted(p.relative_to(base) for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    wanted = set(MOE_CONFIGS)
    files += sorted(p.relative_to(base) for p in root.rglob("*.json") if p.name in wanted)
    return files


def found_moe_configs(files: Iterable[Path]) -> set[str]:
    """Which of :data:`MOE_CONFIGS` are among ``files``."""
    return {p.name for p in files} & set(MOE_CONFIGS)


def write_sglang_archive(dest: Path, root: Path | None = None) -> Path:
    """Write ``dest`` (xz tar) with :func:`sglang_files`; extract it anywhere and put that folder on
    ``sys.path``."""
    root = root or sglang_dir()
    with tarfile.open(dest, "w:xz", preset=9) as tar:
        for rel in sglang_files(root):
            tar.add(root.parent / rel, arcname=str(rel), recursive=False)
    return dest


def scalar_type_source() -> Path:
    """The real ``sgl_kernel`` wheel's ``scalar_type.py`` in this environment."""
    return Path(md.distribution("sglang-kernel").locate_file("sgl_kernel/scalar_type.py"))


def download_wheels(dest: Path, names: Iterable[str], python: str = sys.executable) -> list[Path]:
    """Download the wheels of ``names`` (at their installed versions) for CPython 3.12 on x86-64 Linux.

    Raises
    ------
    subprocess.CalledProcessError
        When pip cannot fetch one.
    """
    dest.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={md.version(name)}" for name in names]
    platforms = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)]
    command = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12"]
    command += ["--implementation", "cp", "-d", str(dest)]
    for platform in [*platforms, "manylinux2014_x86_64", "manylinux1_x86_64"]:
        command += ["--platform", platform]
    subprocess.run([*command, *pins], check=True, stdout=subprocess.DEVNULL)
    return sorted(dest.glob("*.whl"))


def tree_size(path: Path) -> int:
    """Bytes of the regular files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def checkout_size(repo: Path) -> int:
    """Bytes a device call sends of this checkout: tracked and untracked-but-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    total = 0
    for rel in filter(None, listed):
        path = repo / os.fsdecode(rel)
        if path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def _top_levels(dist: md.Distribution) -> set[str]:
    """First path components of a distribution's files (its modules and its metadata folder)."""
    tops = set()
    for f in dist.files or ():
        first = f.parts[0]
        if first not in ("..", "") and not first.endswith((".pth", ".data")) and first != "bin":
            tops.add(first)
    return tops


def filtered_site(dest: Path, allowed: Iterable[str]) -> list[str]:
    """Fill ``dest`` with links to the files of the installed distributions named in ``allowed`` only.

    Parameters
    ----------
    dest : Path
        An empty folder; put it on ``PYTHONPATH`` of a ``python -S`` process to import as a machine
        holding only these distributions would.
    allowed : iterable of str
        Distribution names (any spelling).

    Returns
    -------
    list of str
        The allowed names that are not installed here (nothing to link for them).
    """
    wanted = {normalize(n) for n in allowed}
    seen = set()
    for dist in md.distributions():
        name = normalize(dist.metadata["Name"] or "")
        if name not in wanted or name in seen:
            continue
        seen.add(name)
        base = Path(dist.locate_file(""))
        for top in _top_levels(dist):
            link, target = dest / top, base / top
            if target.exists() and not link.exists():
                link.symlink_to(target, target_is_directory=target.is_dir())
    return sorted(wanted - seen)


#: Prepended to the import check by ``cuda_branches=True``: SGLang reads these at import time to pick
#: its CUDA branches (``sglang.srt.utils.is_cuda``, the capability checks of its kernels).
_PRETEND_H100 = """\
import torch
torch.cuda.is_available = lambda: True
torch.version.cuda = "13.0"
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda *args, **kwargs: (9, 0)
torch.cuda.get_device_name = lambda *args, **kwargs: "NVIDIA H100 80GB HBM3"
"""

_IMPORT_CHECK = """\
import importlib, sys, traceback
{pretend}
import sitecustomize  # python -S skips site; the CUDA stand-in's start-up hooks live there
for name in {modules!r}:
    try:
        importlib.import_module(name)
    except BaseException as err:
        traceback.print_exc()
        print("IMPORT FAILED", name, repr(err))
        sys.exit(1)
{then}
import sgl_kernel
print("UNAVAILABLE", " ".join(sorted(sgl_kernel.STOOD_IN_AS_UNAVAILABLE)))
print("STOOD IN", " ".join(sorted(k for k, m in sys.modules.items() if type(m).__name__ == "_StandinModule")))
print("ALL IMPORTED")
"""


def launcher_import_check(
    workdir: Path,
    allowed: Iterable[str],
    modules: Sequence[str] = LAUNCHER_MODULES,
    python: str = sys.executable,
    timeout: float = 600,
    cuda_branches: bool = False,
    then: str = "",
) -> subprocess.CompletedProcess:
    """Import ``modules`` in a ``python -S`` subprocess that sees only the standard library, the
    distributions of ``allowed`` (through :func:`filtered_site` in ``workdir``), this checkout and the
    CUDA stand-in folder first on its path.  With ``cuda_branches`` torch first pretends to see one
    H100 (``torch.cuda.is_available()`` and friends), so that SGLang's modules take their CUDA branches
    at import time as on the device; nothing is launched on a GPU by importing.  ``then`` is Python
    code run after the imports (a failure there exits 1 too).

    Returns
    -------
    subprocess.CompletedProcess
        Exit code 0 and ``ALL IMPORTED`` on stdout when every module imported; otherwise code 1 with the
        traceback and ``IMPORT FAILED <module> <error>``.  Before ``ALL IMPORTED`` two lines list the
        ``sgl_kernel`` names answered by the stand-in's raising ops (``UNAVAILABLE``) and the modules
        answered by empty stand-ins (``STOOD IN``).
    """
    site = workdir / "site"
    site.mkdir(parents=True, exist_ok=True)
    filtered_site(site, allowed)
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
    env["PYTHONPATH"] = os.pathsep.join([str(cuda_standin_path()), str(site), str(REPO)])
    env["XSHARE_SGL_KERNEL_SCALAR_TYPE"] = str(scalar_type_source())
    return subprocess.run(
        [
            python,
            "-S",
            "-c",
            _IMPORT_CHECK.format(modules=tuple(modules), pretend=_PRETEND_H100 if cuda_branches else "", then=then),
        ],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def allowed_distributions() -> set[str]:
    """What the device sees: its image's distributions, the bundle's wheels, SGLang (unpacked from the
    bundle) and this package (from the checkout)."""
    return device_packages() | {normalize(n) for n in BUNDLE_WHEELS} | {"sglang", "xshare-sglang"}
