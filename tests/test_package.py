"""Packaging promises: a light import, the public API, the shipped data."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import xshare_sglang
from xshare_sglang import provenance


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


def test_serving_doc_documents_every_flag() -> None:
    from pathlib import Path

    from xshare_sglang.sglang_plugin.flags import (
        CONFIG_FLAG,
        ECHO_FLAGS,
        FIELD_FLAGS,
        FLAG_PREFIX,
        GUARD_FLAGS,
        LOG_INTERVAL_FLAG,
        TRACE_FLAGS,
        VERIFY_FLAG,
    )

    root = Path(__file__).resolve().parent.parent
    readme = (root / "docs" / "serving.md").read_text()
    assert "docs/serving.md" in (root / "README.md").read_text()
    flags = [FLAG_PREFIX, CONFIG_FLAG, LOG_INTERVAL_FLAG, VERIFY_FLAG, *TRACE_FLAGS.values(), *ECHO_FLAGS.values()]
    flags += GUARD_FLAGS.values()
    for flag in [*flags, *(spec.flag for spec in FIELD_FLAGS)]:
        assert f"`{flag} " in readme or f"`{flag}`" in readme or f"{flag} " in readme, flag


def test_license_is_an_spdx_expression() -> None:
    """The current packaging form (a string, setuptools >= 77), which installs without the deprecation
    warning the old ``{text = ...}`` table gives."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert any(req.startswith("setuptools>=77") for req in project["build-system"]["requires"])


def test_registering_the_plugin_imports_no_offline_tool() -> None:
    """The plugin's import chain stays on the serving path: no scipy (ECHO's offline calibration), no
    plotting, no offline replay or A/B client, checked in a fresh interpreter without SGLang loaded
    first (SGLang itself may import some of these; this is about what the plugin adds)."""
    import subprocess
    import sys

    code = (
        "import sys, xshare_sglang.sglang_plugin.flags, xshare_sglang.sglang_plugin.settings, "
        "xshare_sglang.sglang_plugin.echo_runtime, xshare_sglang.sglang_plugin.echo_checks; "
        "print(sorted(m for m in ('scipy', 'matplotlib', 'xshare_sglang.replay', 'xshare_sglang.serving') "
        "if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_readme_is_short_and_cites_no_design_notes() -> None:
    """The README says what the project is and for whom, the two set-up commands, a launch per model
    family, what is supported, the generated results and the links, in at most 6,000 characters; the
    depth is in docs/.  No document cites design notes that are not in the tree."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    assert len(readme) <= 6000
    lines = readme.splitlines()
    setup = lines.index("## Set up")
    assert lines[setup + 2 : setup + 6] == [
        "```bash",
        "make demo   # creates .venv, installs the package, decodes with a tiny trained MoE model under every policy",
        "make test   # creates .venv, installs the package with its test tools, runs ruff and the test suite",
        "```",
    ]
    for model in ("Qwen/Qwen3-30B-A3B", "openai/gpt-oss-120b", "deepseek-ai/DeepSeek-V3", "mistralai/Mixtral"):
        assert f"--model-path {model}" in readme, model
    assert "<!-- results:readme -->" in readme
    for doc in [root / "README.md", *(root / "docs").glob("*.md")]:
        assert "DESIGN" not in doc.read_text(), doc
    for link in re.findall(r"\]\((docs/[^)#]+)\)", readme):
        assert (root / link).exists(), link


def test_the_long_docs_keep_the_current_state() -> None:
    """The three docs that grew into lab notebooks stay at most 40 KB: the current state, the commands
    that reproduce it and a decision log; their history lives in docs/history/."""
    from pathlib import Path

    docs = Path(__file__).resolve().parent.parent / "docs"
    for name in ("kernel-sass.md", "bench_selection.md", "benchmarks.md"):
        assert len((docs / name).read_bytes()) <= 40_000, name
        assert "history/" in (docs / name).read_text(), name


def test_package_commit_is_the_checkouts_head_from_any_directory(tmp_path, monkeypatch) -> None:
    """Benchmark and A/B records name the commit that produced them, wherever the tool runs from."""
    root = Path(provenance.__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("the package is not installed from a git checkout")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    monkeypatch.chdir(tmp_path)
    commit = provenance.package_commit()
    assert commit is not None and commit.removesuffix("-dirty") == head.stdout.strip()
    from xshare_sglang.bench.common import git_sha

    assert git_sha() == commit
