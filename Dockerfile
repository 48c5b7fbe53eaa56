# xshare-sglang serving image: SGLang 0.5.23 with the MoE expert-pruning plugin installed.
#
# Built and run on GPU hosts (H100 / H200, sm_90).  tests/test_dockerfile.py lints this file and checks
# its pins; scripts/docker_smoke.sh builds and serves it on a CPU-only machine.  See docs/docker.md.
#
# Base image.  Since SGLang 0.5.20 the official images are CUDA 13 only (v0.5.19-cu129 was the last
# CUDA 12 tag); each release is published as `v<version>` and as `v<version>-cu130`.  The explicit
# `-cu130` tag is pinned because it names the CUDA line in the tag itself and matches the PyPI wheels
# this package is tested against (torch 2.14.1+cu130, triton 3.8.0, sglang-kernel 0.4.10), whose
# kernels include sm_90, so H100 and H200 run it.  The host needs a CUDA 13 driver (>= 580).
# No digest is pinned (it could not be checked from where this file was written); to pin one, append
# `@sha256:<digest>` to the tag (tests/test_dockerfile.py accepts that form).
# BASE_IMAGE is overridden only by scripts/docker_smoke.sh, which builds this file unchanged on a local
# CPU-only stand-in for the official image (docs/docker.md).
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.23-cu130
FROM ${BASE_IMAGE}
ARG BASE_IMAGE

LABEL org.opencontainers.image.title="xshare-sglang" \
      org.opencontainers.image.description="SGLang 0.5.23 with the xshare_sglang MoE expert-pruning plugin (--moe-pruner)" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Only what building the package needs (.dockerignore keeps everything else out of the context).
COPY pyproject.toml README.md /tmp/xshare-sglang/
COPY xshare_sglang /tmp/xshare-sglang/xshare_sglang

# Install without touching the image's GPU stack:
#   1. record torch/triton/sglang before installing anything, and turn them into a pip constraints
#      file, so pip fails instead of replacing one of them;
#   2. install the package's own dependencies other than SGLang, pinned exactly as in pyproject.toml
#      (transformers==5.19.0 is SGLang's own pin; scipy and PyYAML are pinned to what SGLang's
#      unpinned requirements resolved to when the pins were set, so pip replaces a newer release that
#      the base may hold since);
#   3. install the package itself with --no-deps, so its `sglang==0.5.23` requirement never reaches pip.
# PIP_BREAK_SYSTEM_PACKAGES: the image's Python is the system one; SGLang's own Dockerfile installs
# into it the same way.
# Then check, at build time, that the image does what it is for:
#   a. the base really is SGLang 0.5.23;
#   b. SGLang sees the plugin's entry point (group sglang.srt.plugins, name xshare_sglang);
#   c. `python3 -m sglang.launch_server --help` lists --moe-pruner (the plugin hook ran);
#   d. torch, triton and sglang are the versions the base image shipped;
#   e. the package's two commands start (xshare-sglang, xshare-ab-compare).
RUN python3 -c 'from importlib.metadata import version; v = version("sglang"); assert v == "0.5.23", f"base image has sglang {v}, expected 0.5.23"' \
    && python3 -c 'from importlib.metadata import version; print("\n".join(f"{p}=={version(p)}" for p in ("torch", "triton", "sglang")))' > /tmp/gpu-stack.before \
    && cat /tmp/gpu-stack.before \
    && PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore python3 -m pip install --no-cache-dir \
        -c /tmp/gpu-stack.before \
        transformers==5.19.0 \
        matplotlib==3.11.2 \
        rich==15.0.0 \
        scipy==1.17.1 \
        pyyaml==6.0.3 \
    && PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore python3 -m pip install --no-cache-dir --no-deps /tmp/xshare-sglang \
    && rm -rf /tmp/xshare-sglang \
    && python3 -c 'from importlib.metadata import entry_points; eps = {e.name: e.value for e in entry_points(group="sglang.srt.plugins")}; assert eps.get("xshare_sglang") == "xshare_sglang.sglang_plugin:register", f"plugin entry point missing: {eps}"' \
    && python3 -m sglang.launch_server --help > /tmp/launch-server-help.txt \
    && { grep -q -e '--moe-pruner ' /tmp/launch-server-help.txt || { echo "--moe-pruner is missing from sglang.launch_server --help" >&2; exit 1; }; } \
    && python3 -c 'from importlib.metadata import version; print("\n".join(f"{p}=={version(p)}" for p in ("torch", "triton", "sglang")))' > /tmp/gpu-stack.after \
    && diff -u /tmp/gpu-stack.before /tmp/gpu-stack.after \
    && xshare-sglang --help > /dev/null \
    && xshare-ab-compare --help > /dev/null \
    && rm -f /tmp/gpu-stack.before /tmp/gpu-stack.after /tmp/launch-server-help.txt

# Runs as root, like the SGLang base image: its JIT caches (FlashInfer, Triton, DeepGEMM) and the
# conventional Hugging Face cache mount (/root/.cache/huggingface) live under /root, and a non-root
# user would need matching ownership of every mounted cache volume on each GPU host.
WORKDIR /workspace
EXPOSE 30000

# `docker run IMAGE --model-path ... --moe-pruner xshare` starts a pruned server; other tools
# (xshare-sglang, the A/B comparison) run with --entrypoint.
ENTRYPOINT ["python3", "-m", "sglang.launch_server"]
CMD ["--help"]
