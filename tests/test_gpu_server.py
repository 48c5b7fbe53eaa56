"""``python -m xshare_sglang.testing.gpu_server``: the config it writes, the bundle it unpacks, the command
and environment it hands to SGLang.  Everything short of starting SGLang on a GPU."""

from __future__ import annotations

import importlib.metadata as md
import io
import json
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

from xshare_sglang.testing import gpu_server as gs
from xshare_sglang.testing.device_bundle import SCALAR_TYPE_FILE, SGLANG_ARCHIVE, WHEEL_DIR


def test_config_has_qwen3_30b_a3b_shapes_as_transformers_reads_them(tmp_path):
    from transformers import AutoConfig

    model = gs.write_model_dir(tmp_path / "m", layers=3)
    config = AutoConfig.from_pretrained(model)
    assert config.model_type == "qwen3_moe"
    assert (config.hidden_size, config.moe_intermediate_size, config.intermediate_size) == (2048, 768, 6144)
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    assert (experts, config.num_experts_per_tok, config.num_hidden_layers) == (128, 8, 3)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (32, 4, 128)
    assert config.norm_topk_prob and config.decoder_sparse_step == 1 and not config.mlp_only_layers
    assert not config.tie_word_embeddings
    assert (model / "tokenizer.json").is_file()
    assert json.loads((model / "config.json").read_text())["vocab_size"] == 4096
    with pytest.raises(ValueError):
        gs.qwen3_30b_a3b_config(0)


def test_sglang_builds_the_model_config(tmp_path):
    """SGLang's own ModelConfig accepts the written folder (architecture, MoE sizes, dtype)."""
    from sglang.srt.configs.model_config import ModelConfig

    model = gs.write_model_dir(tmp_path / "m", layers=2)
    config = ModelConfig(str(model), dtype="bfloat16")
    assert config.hf_config.architectures == ["Qwen3MoeForCausalLM"]
    assert config.num_hidden_layers == 2 and config.hidden_size == 2048


def test_split_args_takes_only_its_own_options(tmp_path):
    options, rest = gs.split_args(
        [
            "--port",
            "30001",
            f"--gpu-server-bundle={tmp_path}",
            "--gpu-server-layers",
            "6",
            "--gpu-server-dry-run",
            "--moe-pruner",
            "xshare",
        ]
    )
    assert options == {"bundle": tmp_path, "layers": 6, "dry_run": True}
    assert rest == ["--port", "30001", "--moe-pruner", "xshare"]
    assert gs.split_args([])[0] == {"bundle": gs.REPO / ".device_bundle", "layers": 4, "dry_run": False}


@pytest.mark.parametrize("argv", [["--gpu-server-layers", "x"], ["--gpu-server-layers", "0"], ["--gpu-server-bundle"]])
def test_split_args_refuses_bad_values(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gs.split_args(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("gpu_server: error: --gpu-server-")


def test_defaults_are_added_only_where_missing(tmp_path):
    command = gs.gpu_server_command(["--attention-backend=fa3", "--moe-pruner", "xshare"], tmp_path, python="py")
    assert command[:5] == ["py", "-m", "sglang.launch_server", "--attention-backend=fa3", "--moe-pruner"]
    assert sum(a.startswith("--attention-backend") for a in command) == 1
    assert command[command.index("--model-path") + 1] == str(tmp_path)
    for flag, values in gs.GPU_DEFAULTS:
        if flag != "--attention-backend":
            at = command.index(flag)
            assert command[at + 1 : at + 1 + len(values)] == list(values)
    kept = gs.gpu_server_command(["--model-path", "/m"], None, python="py")
    assert kept.count("--model-path") == 1


def test_environment_order(tmp_path):
    env = gs.gpu_server_env(
        tmp_path, tmp_path / "site", {"PYTHONPATH": os.pathsep.join(["/a", str(gs.REPO)]), "K": "v"}
    )
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(gs.cuda_standin_path()),
        str(tmp_path / "site"),
        str(gs.REPO),
        "/a",
    ]
    assert env["XSHARE_SGL_KERNEL_SCALAR_TYPE"] == str(tmp_path / SCALAR_TYPE_FILE) and env["K"] == "v"
    assert env["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] == "1"
    assert (gs.cuda_standin_path() / "sgl_kernel" / "__init__.py").is_file()
    assert (gs.cuda_standin_path() / "sitecustomize.py").is_file()


def _fake_bundle(root):
    root.mkdir()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        data = b"VERSION = 'fake'\n"
        info = tarfile.TarInfo("sglang/__init__.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    (root / SGLANG_ARCHIVE).write_bytes(buffer.getvalue())
    (root / WHEEL_DIR).mkdir()
    with zipfile.ZipFile(root / WHEEL_DIR / "fakepkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fakepkg/__init__.py", "A = 1\n")
        zf.writestr("fakepkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakepkg\nVersion: 1.0\n")
    return root


def test_prepare_site_unpacks_once_and_declares_the_plugin(tmp_path, monkeypatch):
    bundle = _fake_bundle(tmp_path / "b")
    monkeypatch.setattr(gs, "_plugin_installed", lambda: False)
    site = gs.prepare_site(bundle)
    assert (site / "sglang" / "__init__.py").read_text() == "VERSION = 'fake'\n"
    assert (site / "fakepkg" / "__init__.py").is_file()
    points = md.entry_points(group="sglang.srt.plugins")  # this venv's own, for the expected value
    dist = md.PathDistribution(site / "xshare_sglang-0.1.0.dist-info")
    (plugin,) = [p for p in dist.entry_points if p.group == "sglang.srt.plugins"]
    assert plugin.value == "xshare_sglang.sglang_plugin:register"
    assert any(p.value == plugin.value for p in points)
    # a second call keeps the unpacked folder; a changed archive unpacks again
    (site / "sglang" / "extra.py").write_text("")
    assert gs.prepare_site(bundle) == site and (site / "sglang" / "extra.py").exists()
    (bundle / SGLANG_ARCHIVE).write_bytes((bundle / SGLANG_ARCHIVE).read_bytes())
    os.utime(bundle / SGLANG_ARCHIVE, ns=(1, 1))
    gs.prepare_site(bundle)
    assert not (site / "sglang" / "extra.py").exists()
    with pytest.raises(FileNotFoundError, match=r"device_bundle\.py"):
        gs.prepare_site(tmp_path / "none")


def test_dry_run_from_the_command_line(tmp_path):
    bundle = _fake_bundle(tmp_path / "b")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "xshare_sglang.testing.gpu_server",
            f"--gpu-server-bundle={bundle}",
            "--gpu-server-dry-run",
            "--gpu-server-layers",
            "2",
            "--moe-pruner",
            "xshare",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=gs.REPO,
    )
    assert done.returncode == 0, done.stderr
    command, path = done.stdout.splitlines()
    assert " -m sglang.launch_server --moe-pruner xshare --model-path " in command
    assert "--load-format dummy" in command and "--moe-runner-backend triton" in command
    assert path.startswith("PYTHONPATH=" + str(gs.cuda_standin_path()))
    assert (
        json.loads((bundle / "models" / "qwen3-30b-a3b-shape-L2" / "config.json").read_text())["num_hidden_layers"] == 2
    )
    missing = subprocess.run(
        [sys.executable, "-m", "xshare_sglang.testing.gpu_server", f"--gpu-server-bundle={tmp_path / 'none'}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=gs.REPO,
    )
    assert missing.returncode == 2 and "device_bundle.py" in missing.stderr


def test_serve_check_arms_parse_and_table(tmp_path) -> None:
    """scripts/gpu_serve_check.py: every arm's flags are valid pruner settings (the unpruned arm asks for
    none), and the results table puts each pruned arm's throughput against the unpruned one."""
    import importlib.util
    from pathlib import Path

    from xshare_sglang.sglang_plugin.flags import typed_settings_of_command

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_serve_check.py"
    spec = importlib.util.spec_from_file_location("gpu_serve_check", script)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    assert typed_settings_of_command(" ".join(check.ARMS["unpruned"])) is None
    policies = {name: typed_settings_of_command(" ".join(flags)).build() for name, flags in check.ARMS.items() if flags}
    assert policies["xshare"].pruner.policy == "xshare" and policies["xshare"].pruner.budget == 12
    assert policies["moe-spec+guard"].pruner.max_experts == 32 and policies["moe-spec+guard"].guard == "auto"
    results = [
        {"arm": "unpruned", "runs": [{"concurrency": 16, "output_throughput": 1000.0, "mean_itl_ms": 9.0}]},
        {"arm": "xshare", "runs": [{"concurrency": 16, "output_throughput": 1250.0, "mean_itl_ms": 7.0}]},
        {"arm": "moe-spec+guard", "error": "the server exited with code 1", "runs": []},
    ]
    text = check.table(results)
    assert "| xshare | 16 | 1250.0 | 7.0 | None | 1.25x |" in text
    assert "| moe-spec+guard | - | the server exited with code 1 |" in text
