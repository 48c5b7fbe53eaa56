"""Start SGLang's own server on a lent GPU machine without SGLang installed: a test utility.

Usage (on the device, with ``.device_bundle`` carried; see ``scripts/device_bundle.py``)::

    python -m xshare_sglang.testing.gpu_server [gpu-server options] [any sglang.launch_server argument ...]
    python -m xshare_sglang.testing.gpu_server --moe-pruner xshare --moe-pruner-k0 2 --moe-pruner-budget 12

Before becoming ``python -m sglang.launch_server ARGS...`` (``os.execve``: same pid, same exit codes),
it:

* unpacks the bundle once into ``<bundle>/site``: SGLang's ``.py`` files and tuned MoE configs, and
  the carried wheels (plain extraction: they are pure Python or binary modules without install hooks);
* writes a ``xshare_sglang`` distribution record there when the package is not installed, so that
  SGLang loads the plugin through its ``sglang.srt.plugins`` entry point;
* writes :func:`qwen3_30b_a3b_config`, Qwen3-30B-A3B's shapes with few layers, and the shipped tiny
  model's tokenizer, into ``<bundle>/models/<name>`` and serves it with ``--load-format dummy``
  (random weights: no checkpoint travels);
* adds :data:`GPU_DEFAULTS` where the command line does not give them;
* puts the CUDA ``sgl_kernel`` stand-in, the unpacked site and this checkout first on ``PYTHONPATH``
  and sets ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1`` (the stand-in is no installed distribution).

Options of its own (removed before SGLang sees the command line):

``--gpu-server-bundle PATH``  the bundle folder (default: ``.device_bundle`` of this checkout)
``--gpu-server-layers N``     decoder layers of the served config (default 4)
``--gpu-server-dry-run``      set everything up, print the command and the ``PYTHONPATH``, do not start

Not for production: the weights are random, and SGLang's CUDA kernels are replaced by torch ops.
"""

from __future__ import annotations

import json
import logging
import lzma
import os
import shutil
import sys
import tarfile
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from .device_bundle import BUNDLE_DIR, REPO, SCALAR_TYPE_FILE, SGLANG_ARCHIVE, WHEEL_DIR, cuda_standin_path

logger = logging.getLogger(__name__)

#: Flags added unless the command line gives them (flag, its values).
GPU_DEFAULTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("--load-format", ("dummy",)),
    ("--dtype", ("bfloat16",)),
    ("--attention-backend", ("triton",)),
    ("--sampling-backend", ("pytorch",)),
    ("--moe-runner-backend", ("triton",)),
    ("--grammar-backend", ("none",)),
    ("--cuda-graph-max-bs", ("64",)),
    ("--mem-fraction-static", ("0.8",)),
)

MODEL_FLAGS = ("--model-path", "--model")
DEFAULT_LAYERS = 4
#: Marker written once the site folder is complete (its text: the archive's size and mtime).
UNPACKED_MARKER = ".unpacked"


def qwen3_30b_a3b_config(layers: int = DEFAULT_LAYERS, vocab_size: int = 4096) -> dict:
    """A Hugging Face ``config.json`` with Qwen3-30B-A3B's attention and expert shapes.

    Parameters
    ----------
    layers : int
        Decoder layers (the real model has 48; a few keep start-up and CUDA-graph capture short).
    vocab_size : int
        Embedding rows: the shipped tiny tokenizer's 4096 by default, so that every sampled id decodes
        (the vocabulary size does not change the MoE layers).

    Returns
    -------
    dict
        hidden 2048, 32 query and 4 KV heads of 128, dense intermediate 6144, 128 experts of
        intermediate 768, top-8 with renormalised weights, every layer MoE, bf16.
    """
    if layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_local_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": None,
        "eos_token_id": 0,
        "pad_token_id": None,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "initializer_range": 0.02,
        "use_cache": True,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
    }


def write_model_dir(dest: Path, layers: int = DEFAULT_LAYERS) -> Path:
    """Write :func:`qwen3_30b_a3b_config` and the tiny model's tokenizer files into ``dest``."""
    from ..tiny.tiny_model import tiny_model_dir

    dest.mkdir(parents=True, exist_ok=True)
    tiny = Path(tiny_model_dir())
    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    (dest / "config.json").write_text(json.dumps(qwen3_30b_a3b_config(layers, vocab), indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tiny / name).is_file():
            shutil.copyfile(tiny / name, dest / name)
    return dest


def _plugin_dist_info(site: Path) -> None:
    """A minimal ``xshare_sglang`` distribution record declaring the plugin's entry point."""
    info = site / "xshare_sglang-0.1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: xshare-sglang\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nxshare_sglang = xshare_sglang.sglang_plugin:register\n"
    )
    (info / "top_level.txt").write_text("xshare_sglang\n")


def _plugin_installed() -> bool:
    import importlib.metadata as md

    try:
        md.distribution("xshare-sglang")
    except md.PackageNotFoundError:
        return False
    return True


def prepare_site(bundle: Path) -> Path:
    """Unpack ``bundle`` into ``bundle/site`` (once per archive) and return that folder.

    Raises
    ------
    FileNotFoundError
        When the bundle has no SGLang archive (build it with ``scripts/device_bundle.py``).
    """
    archive = bundle / SGLANG_ARCHIVE
    if not archive.is_file():
        raise FileNotFoundError(f"{archive} not found: run scripts/device_bundle.py and carry {BUNDLE_DIR}")
    site = bundle / "site"
    stamp = f"{archive.stat().st_size} {archive.stat().st_mtime_ns}"
    marker = site / UNPACKED_MARKER
    if marker.is_file() and marker.read_text() == stamp:
        return site
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    with lzma.open(archive) as xz, tarfile.open(fileobj=xz, mode="r:") as tar:
        tar.extractall(site, filter="data")
    for wheel in sorted((bundle / WHEEL_DIR).glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    if not _plugin_installed():
        _plugin_dist_info(site)
    marker.write_text(stamp)
    logger.info("unpacked %s into %s", bundle, site)
    return site


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def split_args(argv: Sequence[str]) -> tuple[dict, list[str]]:
    """Separate the ``--gpu-server-*`` options from SGLang's arguments.

    Returns
    -------
    tuple of (dict, list of str)
        ``{"bundle": Path, "layers": int, "dry_run": bool}`` and the rest of ``argv``, in order.

    Raises
    ------
    SystemExit
        Code 2, with one line on stderr, for a missing or bad value.
    """
    options = {"bundle": REPO / BUNDLE_DIR, "layers": DEFAULT_LAYERS, "dry_run": False}
    rest: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in ("--gpu-server-bundle", "--gpu-server-layers"):
            if not eq:
                if i + 1 >= len(args):
                    _fail(f"{name} needs a value")
                value = args[i + 1]
                i += 1
            if name == "--gpu-server-bundle":
                options["bundle"] = Path(value)
            else:
                try:
                    options["layers"] = int(value)
                except ValueError:
                    _fail(f"{name}: not an integer: {value!r}")
                if options["layers"] < 1:
                    _fail(f"{name} must be >= 1")
        elif arg == "--gpu-server-dry-run":
            options["dry_run"] = True
        else:
            rest.append(arg)
        i += 1
    return options, rest


def _fail(message: str) -> None:
    sys.stderr.write(f"gpu_server: error: {message}\n")
    raise SystemExit(2)


def gpu_server_command(argv: Sequence[str], model_dir: Path | None, python: str | None = None) -> list[str]:
    """SGLang's launcher with ``argv``, ``--model-path model_dir`` unless one is given, then the
    defaults of :data:`GPU_DEFAULTS` the user did not give."""
    command = [python or sys.executable, "-m", "sglang.launch_server", *argv]
    if model_dir is not None and not any(_given(argv, flag) for flag in MODEL_FLAGS):
        command += ["--model-path", str(model_dir)]
    for flag, values in GPU_DEFAULTS:
        if not _given(argv, flag):
            command += [flag, *values]
    return command


def gpu_server_env(bundle: Path, site: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` with the stand-in, the unpacked site and this checkout first on ``PYTHONPATH``, the
    real ``scalar_type.py`` named for the stand-in, and SGLang's ``sglang-kernel`` version check off."""
    env = dict(os.environ if environ is None else environ)
    first = [str(cuda_standin_path()), str(site), str(REPO)]
    rest = [part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part and part not in first]
    env["PYTHONPATH"] = os.pathsep.join([*first, *rest])
    env["XSHARE_SGL_KERNEL_SCALAR_TYPE"] = str(bundle / SCALAR_TYPE_FILE)
    # On CUDA the engine asserts sglang-kernel >= 0.4.9 is installed (srt/entrypoints/engine.py:1962);
    # the stand-in is no installed distribution.
    env["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] = "1"
    return env


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="gpu_server: %(message)s")
    options, rest = split_args(sys.argv[1:] if argv is None else argv)
    bundle = options["bundle"].resolve()
    try:
        site = prepare_site(bundle)
    except FileNotFoundError as err:
        _fail(str(err))
    model_dir = None
    if not any(_given(rest, flag) for flag in MODEL_FLAGS):
        model_dir = write_model_dir(bundle / "models" / f"qwen3-30b-a3b-shape-L{options['layers']}", options["layers"])
    command = gpu_server_command(rest, model_dir)
    env = gpu_server_env(bundle, site)
    if options["dry_run"]:
        sys.stdout.write(" ".join(command) + "\n" + "PYTHONPATH=" + env["PYTHONPATH"] + "\n")
        return
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
