# xshare-sglang serving image for H200 nodes: NOT WRITTEN YET.
#
# The image (a pinned SGLang 0.5.23 CUDA base with this package installed, checked at build time for
# the plugin entry point and the --moe-pruner flag) belongs to the issue "Scripted A/B serving
# comparisons, static-ranking calibration, and the H200 Docker image".  Until then, building this
# file fails on purpose, so that nobody deploys an image that would not prune anything.
FROM busybox:1.36
RUN echo "xshare-sglang: the Docker image is not implemented yet; see README.md, section Status." >&2 && exit 1
