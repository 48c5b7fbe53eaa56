"""Packaging promises: a light import, the public API, the shipped data."""

from __future__ import annotations

import subprocess
import sys

import xshare_sglang


def test_import_loads_neither_sglang_nor_triton() -> None:
    code = (
        "import sys, xshare_sglang, xshare_sglang.policies, xshare_sglang.replay, xshare_sglang.kernels, "
        "xshare_sglang.spec, xshare_sglang.cli, xshare_sglang.sglang_plugin, xshare_sglang.sglang_plugin.hooks\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'triton')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_api() -> None:
    assert {"PrunerConfig", "select_experts_mask", "route_within", "oracle_ranking"} <= set(xshare_sglang.__all__)


def test_shipped_traces_and_licence() -> None:
    from importlib import resources

    folder = resources.files("xshare_sglang") / "data" / "route_traces"
    names = {entry.name for entry in folder.iterdir()}
    assert {"gptoss.route.csv", "gemma.route.csv", "LICENSE.Apache-2.0", "SOURCE_COMMIT", "README.md"} <= names
    assert "Apache License" in (folder / "LICENSE.Apache-2.0").read_text()


def test_tiny_model_data_and_licences() -> None:
    from importlib import resources

    folder = resources.files("xshare_sglang") / "data" / "tiny_moe"
    names = {entry.name for entry in folder.iterdir()}
    assert {"LICENSE.gsm8k.MIT", "LICENSE.human-eval.MIT", "LICENSE.Python-PSF", "MODEL_CARD.md"} <= names
    assert "PYTHON SOFTWARE FOUNDATION LICENSE" in (folder / "LICENSE.Python-PSF").read_text()
    assert "MIT License" in (folder / "LICENSE.gsm8k.MIT").read_text()


def test_readme_documents_every_flag() -> None:
    from pathlib import Path

    from xshare_sglang.sglang_plugin.flags import (
        CONFIG_FLAG,
        ECHO_FLAGS,
        FIELD_FLAGS,
        FLAG_PREFIX,
        LOG_INTERVAL_FLAG,
        TRACE_FLAGS,
        VERIFY_FLAG,
    )

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    flags = [FLAG_PREFIX, CONFIG_FLAG, LOG_INTERVAL_FLAG, VERIFY_FLAG, *TRACE_FLAGS.values(), *ECHO_FLAGS.values()]
    for flag in [*flags, *(spec.flag for spec in FIELD_FLAGS)]:
        assert f"`{flag} " in readme or f"`{flag}`" in readme or f"{flag} " in readme, flag
