# A local, CPU-only base in place of lmsysorg/sglang:v0.5.23-cu130, for scripts/docker_smoke.sh.
#
# It holds what the official image provides and the project's Dockerfile relies on: a system
# Python 3 (Debian bookworm's 3.11), SGLang 0.5.23 with its dependencies installed by pip into that
# Python, and the torch they pull in.  SGLang 0.5.23 pins torch==2.14.1; PyPI publishes that release
# for Linux x86_64 only as its CUDA build, which runs on the CPU (a CPU-only 2.14.1 wheel exists only
# on download.pytorch.org).  Only this local base adds the CPU stand-in for the CUDA-only sgl_kernel
# and switches SGLang to its CPU engine, exactly as `make serve-cpu` does outside Docker.
#
# DEBIAN_IMAGE is a Debian bookworm root made by `debootstrap --variant=minbase` and `docker import`.
ARG DEBIAN_IMAGE=xshare-smoke/debian:bookworm
FROM ${DEBIAN_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The building host's CA certificates join Debian's, so that pip reaches PyPI through any TLS proxy
# the host trusts (Debian's pip verifies against the system store).
COPY host-ca-certificates.crt /usr/local/share/ca-certificates/host-ca-certificates.crt
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-pip ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && update-ca-certificates

RUN PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore python3 -m pip install --no-cache-dir sglang==0.5.23

# The stand-in and the files it loads by path from its parent folder: the post-import hook
# (post_import.py) and what it shares with the CUDA stand-in (sgl_kernel_standin.py).
COPY standin /opt/xshare-cpu/standin
COPY post_import.py /opt/xshare-cpu/post_import.py
COPY sgl_kernel_standin.py /opt/xshare-cpu/sgl_kernel_standin.py
ENV SGLANG_USE_CPU_ENGINE=1 \
    PYTHONPATH=/opt/xshare-cpu/standin
