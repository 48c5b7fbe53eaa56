#!/usr/bin/env bash
# Build the project's serving image on a machine with no GPU and serve from it, as docs/docker.md says.
#
#   sudo bash scripts/docker_smoke.sh [--keep-images] [--log-dir DIR] [--min-free-gb GB]
#
#   --keep-images     keep the images this run built (a later run reuses the local base)
#   --log-dir DIR     write smoke.log, summary.json and every other log to DIR (made if missing)
#                     instead of /tmp/xshare-docker-smoke-<UTC time>-<pid>
#   --min-free-gb GB  the free space to require on the filesystem of Docker's data folder before
#                     anything is installed or built, in place of the script's own figure (25 GB,
#                     or 3 GB when a base kept by --keep-images will be reused); 0 skips the check
#   Environment: DEBIAN_MIRROR (debootstrap's mirror), HEALTH_TIMEOUT_S (seconds each server has to
#   answer /health, 900).
#
# The official base (lmsysorg/sglang:v0.5.23-cu130) is replaced by a local one: a Debian bookworm root
# (debootstrap --variant=minbase, docker import) with a system Python 3 and SGLang 0.5.23 from PyPI,
# plus, in that base only, the CPU stand-in for sgl_kernel (scripts/docker/cpu-base.Dockerfile).  On it
# the project's Dockerfile is built unchanged but for --build-arg BASE_IMAGE, so its build-time checks
# run for real.  Then, with the image:
#   1. a CPU server on the shipped tiny model with --moe-pruner xshare: its proof-of-life line, a
#      completion, and the plugin's counters on /metrics;
#   2. a second container with a bad --moe-pruner-k0: exit code 2 and one error line;
#   3. an unpruned server beside the pruned one, and xshare-ab-compare run from the image
#      (--entrypoint) against both;
#   4. the servers' network namespace has only a loopback interface, and they listen on 127.0.0.1.
# No bridge and no published port: the builds use the host's network (pip reaches PyPI), the servers a
# namespace of their own with loopback only (see start_servers).  Containers and the images this run
# built are removed at the end, also on failure (--keep-images keeps the images; a later run reuses
# the base).
# When no Docker daemon answers, one is started (installing Debian's docker.io and debootstrap where
# missing; this needs root) and stopped at the end; a running daemon is used and left running.  The
# Debian packages it installs stay installed (docs/docker.md says how to remove them).
# The checks are scripts/docker/smoke_checks.py; the run's record is DIR/summary.json.
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CHECKS=(python3 "$ROOT/scripts/docker/smoke_checks.py")
DEBIAN_SUITE=bookworm
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-900}
PRUNER_FLAGS=(--moe-pruner xshare --moe-pruner-k0 1 --moe-pruner-budget 4 --moe-pruner-log-interval 1)
BAD_FLAG=--moe-pruner-k0
BAD_VALUE=-1

# The free space (10^9 bytes) a run needs where Docker keeps its data (docs/docker.md, "Disk"): the
# base's own layers (10.8 GB) are there twice while the classic builder commits its pip layer (the
# build container's layer and the image layer made from it), beside the Debian image (0.2 GB), with
# room to spare; reusing a kept base, only the project's layers (0.16 GB) and the containers'.
BUILD_ALL_GB=25
REUSE_BASE_GB=3

KEEP_IMAGES=0
LOG_DIR=""
MIN_FREE_GB=""
while [ $# -gt 0 ]; do
    case "$1" in
        --keep-images) KEEP_IMAGES=1 ;;
        --log-dir) LOG_DIR=${2:?--log-dir needs a folder}; shift ;;
        --log-dir=*) LOG_DIR=${1#--log-dir=} ;;
        --min-free-gb) MIN_FREE_GB=${2:?--min-free-gb needs a number of GB}; shift ;;
        --min-free-gb=*) MIN_FREE_GB=${1#--min-free-gb=} ;;
        -h | --help) sed -n '2,/^set -Eeuo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "docker_smoke.sh: unknown argument $1 (allowed: --keep-images, --log-dir DIR, --min-free-gb GB)" >&2; exit 2 ;;
    esac
    shift
done
if [ -n "$MIN_FREE_GB" ] && ! [[ $MIN_FREE_GB =~ ^[0-9]+([.][0-9]+)?$ ]]; then
    echo "docker_smoke.sh: --min-free-gb needs a number of GB (0 skips the disk check), not '$MIN_FREE_GB'" >&2
    exit 2
fi

# One run at a time on a machine: runs share the daemon, the Debian image and a kept base.
exec 9> "${TMPDIR:-/tmp}/xshare-docker-smoke.lock"
flock -n 9 || { echo "docker_smoke.sh: another run holds ${TMPDIR:-/tmp}/xshare-docker-smoke.lock; wait for it" >&2; exit 1; }

# The local base's tag names its content, so a kept base is reused only when nothing in it changed.
base_tag() {
    local digest
    digest=$(cd "$ROOT" && find scripts/docker/cpu-base.Dockerfile xshare_sglang/testing/post_import.py \
        xshare_sglang/testing/sgl_kernel_standin.py xshare_sglang/testing/standin -type f ! -path '*__pycache__*' \
        | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)
    echo "xshare-smoke/cpu-base:$digest"
}

# Free disk, before anything is installed, made or built: where the running daemon keeps its data, or
# /var/lib/docker, where the daemon this run starts keeps it.  A failure is one line and leaves nothing.
DOCKER_ROOT=$(docker info -f '{{.DockerRootDir}}' 2> /dev/null) || DOCKER_ROOT=""
NEED_GB=$BUILD_ALL_GB
if [ -n "$DOCKER_ROOT" ] && docker image inspect "$(base_tag)" > /dev/null 2>&1; then NEED_GB=$REUSE_BASE_GB; fi
DISK_CHECK=$("${CHECKS[@]}" disk "${DOCKER_ROOT:-/var/lib/docker}" "${MIN_FREE_GB:-$NEED_GB}") || exit 1

RUN_ID=$(date -u +%Y%m%dT%H%M%SZ)-$$
LOG_DIR=${LOG_DIR:-/tmp/xshare-docker-smoke-$RUN_ID}
mkdir -p "$LOG_DIR"
LOG_DIR=$(cd "$LOG_DIR" && pwd)
exec > >(tee -a "$LOG_DIR/smoke.log") 2>&1
WORK=$(mktemp -d /tmp/xshare-docker-smoke-work.XXXXXX)
NET=xshare-smoke-$RUN_ID-net
PRUNED=xshare-smoke-$RUN_ID-pruned
UNPRUNED=xshare-smoke-$RUN_ID-unpruned
IMAGE=xshare-smoke/xshare-sglang:$RUN_ID
DEBIAN_IMAGE=xshare-smoke/debian:$DEBIAN_SUITE
STARTED_DOCKERD=""
BUILT_IMAGES=()
STEPS=()
BASE_REUSED=0
RUN_START=$SECONDS

log() { printf '[docker-smoke %s] %s\n' "$(date -u +%H:%M:%S)" "$*"; }
die() { log "FAILED: $*" >&2; exit 1; }

# step NAME COMMAND...: run one step, log how long it took, record it for summary.json.
step() {
    local name=$1 start=$SECONDS
    shift
    log "step: $name"
    "$@"
    STEPS+=("$name	$((SECONDS - start))")
    log "done: $name ($((SECONDS - start)) s)"
}

# Build output goes to a log file; on failure its end is shown.
logged() {
    local file=$1
    shift
    if ! "$@" > "$LOG_DIR/$file" 2>&1; then
        tail -n 40 "$LOG_DIR/$file" >&2
        die "$* (full log: $LOG_DIR/$file)"
    fi
}

# The sizes of the images this run used, as "name<TAB>bytes" lines.
image_sizes() {
    local image
    for image in "$DEBIAN_IMAGE" "${BASE_IMAGE:-}" "$IMAGE"; do
        [ -n "$image" ] && docker image inspect "$image" > /dev/null 2>&1 \
            && printf '%s\t%s\n' "$image" "$(docker image inspect -f '{{.Size}}' "$image")"
    done
    return 0
}

write_summary() {
    local status=$1 sizes=$2
    printf '%s\n' "${STEPS[@]}" | python3 -c '
import datetime, json, os, sys
status, commit, sizes, total, driver, docker_version, started, reused, log_dir = sys.argv[1:10]
steps = [{"step": name, "seconds": int(s)} for name, s in (line.split("\t") for line in sys.stdin.read().splitlines() if line)]
record = {
    "status": status,
    "commit": commit,
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    "total_seconds": int(total),
    "steps": steps,
    "image_bytes": {name: int(size) for name, size in (line.split("\t") for line in sizes.splitlines() if line)},
    "base_reused": reused == "1",
    "docker": docker_version,
    "storage_driver": driver,
    "daemon_started_by_run": started == "1",
    "cores": os.cpu_count(),
    "logs": sorted(name for name in os.listdir(log_dir) if name != "summary.json"),
}
with open(os.path.join(log_dir, "summary.json"), "w") as out:
    json.dump(record, out, indent=1)
    out.write("\n")
' "$status" "$(git -C "$ROOT" describe --always --dirty --abbrev=7 2> /dev/null || echo unknown)" "$sizes" \
        "$((SECONDS - RUN_START))" "${DRIVER:-}" "${DOCKER_VERSION:-}" "$([ -n "$STARTED_DOCKERD" ] && echo 1 || echo 0)" \
        "$BASE_REUSED" "$LOG_DIR"
}

# Removes what this run made (containers; images unless --keep-images; the daemon it started), then
# writes summary.json, with the removal as its last step and the total up to the end.
cleanup() {
    local status=$? sizes="" start=$SECONDS
    trap - EXIT INT TERM
    set +e
    if docker info > /dev/null 2>&1; then
        sizes=$(image_sizes)
        for container in "$PRUNED" "$UNPRUNED" "$NET"; do
            if docker container inspect "$container" > /dev/null 2>&1; then
                [ "$container" = "$NET" ] || docker logs "$container" > "$LOG_DIR/$container.log" 2>&1
                docker rm -f "$container" > /dev/null
                log "removed container $container"
            fi
        done
        if [ "$KEEP_IMAGES" -eq 0 ] && [ ${#BUILT_IMAGES[@]} -gt 0 ]; then
            docker image rm -f "${BUILT_IMAGES[@]}" > /dev/null && log "removed images ${BUILT_IMAGES[*]}"
        fi
    fi
    if [ -n "$STARTED_DOCKERD" ]; then
        kill "$STARTED_DOCKERD" 2> /dev/null && log "stopping the Docker daemon this run started (pid $STARTED_DOCKERD)"
        for _ in $(seq 60); do kill -0 "$STARTED_DOCKERD" 2> /dev/null || break; sleep 1; done
    fi
    rm -rf "$WORK"
    STEPS+=("remove what the run made	$((SECONDS - start))")
    write_summary "$([ "$status" -eq 0 ] && echo passed || echo failed)" "$sizes"
    log "steps: $(printf '%s; ' "${STEPS[@]}" | tr '\t' ' ')"
    if [ "$status" -eq 0 ]; then
        log "PASSED in $((SECONDS - RUN_START)) s; logs and summary.json in $LOG_DIR"
    else
        log "FAILED (exit $status) after $((SECONDS - RUN_START)) s; logs in $LOG_DIR" >&2
    fi
    exit "$status"
}
trap cleanup EXIT
trap 'log "FAILED: line $LINENO: $BASH_COMMAND" >&2' ERR
trap 'exit 130' INT TERM

# ----------------------------------------------------------------------------------------- the steps
need_root() {
    [ "$(id -u)" -eq 0 ] || die "$1 needs root (run with sudo)"
}

# Each install writes its own log, apt-install-<packages>.log; the package lists are updated once a run.
APT_UPDATED=0
apt_install() {
    local packages="$*"
    local file="apt-install-${packages// /+}.log"
    need_root "installing $packages"
    if [ "$APT_UPDATED" -eq 0 ]; then
        logged apt-update.log apt-get update
        APT_UPDATED=1
    fi
    log "installing Debian packages: $packages"
    logged "$file" env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@"
    log "installed $packages (apt's output: $file); they stay installed after the run"
}

start_daemon() {
    if docker info > /dev/null 2>&1; then
        log "using the running Docker daemon"
    else
        need_root "starting a Docker daemon"
        command -v dockerd > /dev/null || apt_install docker.io
        # --bridge=none: no docker0 bridge and no NAT rules; the containers use the host's network only.
        dockerd --bridge=none --iptables=false --ip-masq=false --pidfile "$WORK/dockerd.pid" \
            > "$LOG_DIR/dockerd.log" 2>&1 9>&- &
        STARTED_DOCKERD=$!
        for _ in $(seq 60); do
            docker info > /dev/null 2>&1 && break
            kill -0 "$STARTED_DOCKERD" 2> /dev/null || { tail -n 20 "$LOG_DIR/dockerd.log" >&2; die "dockerd exited"; }
            sleep 1
        done
        docker info > /dev/null 2>&1 || die "dockerd did not answer within 60 s (log: $LOG_DIR/dockerd.log)"
        log "started dockerd (pid $STARTED_DOCKERD), stopped at the end"
    fi
    DRIVER=$(docker info -f '{{.Driver}}')
    if [ "$DRIVER" = vfs ]; then
        log "warning: storage driver vfs copies every layer in full: the images need several times their size on disk"
    fi
    DOCKER_VERSION=$(docker version -f 'client {{.Client.Version}}, daemon {{.Server.Version}}')
    log "Docker $DOCKER_VERSION, storage driver $DRIVER, $(df -h --output=avail "$(docker info -f '{{.DockerRootDir}}')" | tail -1 | tr -d ' ') free"
}

build_debian_root() {
    need_root "debootstrap"
    command -v debootstrap > /dev/null || apt_install debootstrap
    logged debootstrap.log debootstrap --variant=minbase "$DEBIAN_SUITE" "$WORK/rootfs" "$DEBIAN_MIRROR"
    tar -C "$WORK/rootfs" -c . | docker import - "$DEBIAN_IMAGE" > /dev/null
    rm -rf "$WORK/rootfs"
    BUILT_IMAGES+=("$DEBIAN_IMAGE")
    log "imported $DEBIAN_IMAGE ($(docker image ls --format '{{.Size}}' "$DEBIAN_IMAGE"))"
}

build_base() {
    local context=$WORK/base-context
    mkdir -p "$context"
    cp -r "$ROOT/xshare_sglang/testing/standin" "$context/standin"
    cp "$ROOT/xshare_sglang/testing/post_import.py" "$context/post_import.py"
    cp "$ROOT/xshare_sglang/testing/sgl_kernel_standin.py" "$context/sgl_kernel_standin.py"
    # the host's CA bundle (empty where there is none): pip in the build trusts what the host trusts
    local bundle
    bundle=$(python3 -c 'import ssl; paths = ssl.get_default_verify_paths(); print(paths.cafile or paths.openssl_cafile)')
    if [ -f "$bundle" ]; then cp "$bundle" "$context/host-ca-certificates.crt"; else : > "$context/host-ca-certificates.crt"; fi
    find "$context" -name __pycache__ -prune -exec rm -rf {} +
    logged build-base.log env DOCKER_BUILDKIT=0 docker build --network host --build-arg "DEBIAN_IMAGE=$DEBIAN_IMAGE" \
        -f "$ROOT/scripts/docker/cpu-base.Dockerfile" -t "$BASE_IMAGE" "$context"
    BUILT_IMAGES+=("$BASE_IMAGE")
    log "built $BASE_IMAGE ($(docker image ls --format '{{.Size}}' "$BASE_IMAGE")): $(docker run --rm --network none \
        --entrypoint python3 "$BASE_IMAGE" -c 'import sys, torch, sglang; print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, sglang {sglang.__version__}")')"
}

build_image() {
    # --no-cache: every build-time check runs, even where an earlier --keep-images run left the layers
    logged build-image.log env DOCKER_BUILDKIT=0 docker build --no-cache --network host \
        --build-arg "BASE_IMAGE=$BASE_IMAGE" -t "$IMAGE" "$ROOT"
    BUILT_IMAGES+=("$IMAGE")
    # the build-time checks' own output: the GPU stack the base shipped, which the install left alone
    local stack
    stack=$(grep -E '^(torch|triton|sglang)==' "$LOG_DIR/build-image.log" | sort -u) \
        || die "the build log shows no torch/triton/sglang versions (did the checks run?)"
    log "the build-time checks passed; the base's stack, unchanged by the install: ${stack//$'\n'/ }"
    log "built $IMAGE ($(docker image ls --format '{{.Size}}' "$IMAGE"))"
}

# The CPU server's arguments, from the package inside the image: the shipped tiny model and the CPU
# engine's defaults (xshare_sglang.testing.cpu_server, as `make serve-cpu` uses them).
read_server_args() {
    local printed
    printed=$(docker run --rm --network none --entrypoint python3 "$IMAGE" -c \
        'from xshare_sglang.testing.cpu_server import cpu_server_command; print("\n".join(cpu_server_command([])[3:]))') \
        || die "could not read the CPU server arguments from the image"
    mapfile -t SERVER_ARGS <<< "$printed"
    [ "${SERVER_ARGS[0]}" = --model-path ] && [ -n "${SERVER_ARGS[1]:-}" ] || die "unexpected server arguments: $printed"
    TINY_MODEL=${SERVER_ARGS[1]}
    log "server arguments: ${SERVER_ARGS[*]}"
}

# The servers share one network namespace that has only a loopback interface, held by a container
# started with --network none; the checks that talk to them run in that container.  Nothing they
# listen on can be reached from beyond the loopback address, not even the torch.distributed store that
# each SGLang scheduler binds to every address whatever --host says (with --network host it would be
# open on the host's interfaces).
in_net() { docker exec "$NET" python3 -I /checks/smoke_checks.py "$@"; }

start_servers() {
    docker run -d --name "$NET" --network none -v "$ROOT/scripts/docker:/checks:ro" --entrypoint sleep \
        "$IMAGE" infinity > /dev/null
    read -r PRUNED_PORT UNPRUNED_PORT < <(in_net free-ports 2)
    [ -n "${UNPRUNED_PORT:-}" ] || die "no free ports in the servers' network namespace"
    docker run -d --name "$PRUNED" --network "container:$NET" --shm-size 1g "$IMAGE" "${SERVER_ARGS[@]}" \
        --host 127.0.0.1 --port "$PRUNED_PORT" --enable-metrics "${PRUNER_FLAGS[@]}" > /dev/null
    docker run -d --name "$UNPRUNED" --network "container:$NET" --shm-size 1g "$IMAGE" "${SERVER_ARGS[@]}" \
        --host 127.0.0.1 --port "$UNPRUNED_PORT" --enable-metrics > /dev/null
    log "started $PRUNED on 127.0.0.1:$PRUNED_PORT (${PRUNER_FLAGS[*]}) and $UNPRUNED on 127.0.0.1:$UNPRUNED_PORT"
}

check_bad_flag() {
    local code=0
    docker run --rm --network none "$IMAGE" "${SERVER_ARGS[@]}" --moe-pruner xshare "$BAD_FLAG" "$BAD_VALUE" \
        > "$LOG_DIR/bad-flag.stdout" 2> "$LOG_DIR/bad-flag.stderr" || code=$?
    "${CHECKS[@]}" refusal -- "$code" "$LOG_DIR/bad-flag.stderr" "$BAD_FLAG"
}

wait_healthy() {
    local container=$1 port=$2 start=$SECONDS state
    until in_net health "http://127.0.0.1:$port"; do
        state=$(docker inspect -f '{{.State.Status}} (exit code {{.State.ExitCode}})' "$container")
        if [ "${state%% *}" != running ]; then
            docker logs --tail 40 "$container" >&2
            die "$container stopped before it was healthy: $state"
        fi
        [ $((SECONDS - start)) -lt "$HEALTH_TIMEOUT_S" ] || die "$container not healthy within $HEALTH_TIMEOUT_S s"
        sleep 1
    done
    echo "check: $container healthy at 127.0.0.1:$port after $((SECONDS - start)) s"
}

wait_servers() {
    wait_healthy "$PRUNED" "$PRUNED_PORT"
    wait_healthy "$UNPRUNED" "$UNPRUNED_PORT"
}

check_pruned_server() {
    docker logs "$PRUNED" > "$LOG_DIR/$PRUNED.log" 2>&1
    "${CHECKS[@]}" proof-line "$LOG_DIR/$PRUNED.log" xshare
    in_net completion "http://127.0.0.1:$PRUNED_PORT"
    in_net counters "http://127.0.0.1:$PRUNED_PORT"
    # the unpruned server answers too, and runs no pruner
    in_net completion "http://127.0.0.1:$UNPRUNED_PORT"
    if docker logs "$UNPRUNED" 2>&1 | grep -q "moe-pruner active"; then die "the unpruned server runs a pruner"; fi
}

check_network() {
    in_net namespace "$PRUNED_PORT" "$UNPRUNED_PORT"
}

run_ab_compare() {
    mkdir -p "$LOG_DIR/ab"
    docker logs "$PRUNED" > "$LOG_DIR/$PRUNED.log" 2>&1
    logged ab-compare.log docker run --rm --network "container:$NET" -v "$LOG_DIR:/smoke" \
        --entrypoint xshare-ab-compare "$IMAGE" \
        --model-path "$TINY_MODEL" --candidate '{"name": "xshare", "policy": "xshare", "k0": 1, "budget": 4}' \
        --url "baseline=http://127.0.0.1:$UNPRUNED_PORT" --url "xshare=http://127.0.0.1:$PRUNED_PORT" \
        --server-log "xshare=/smoke/$PRUNED.log" --no-accuracy --dataset random-ids --random-input-len 16 \
        --random-output-len 8 --num-prompts 4 --concurrency 2 --repeats 1 --output-dir /smoke/ab
    "${CHECKS[@]}" ab-results "$LOG_DIR/ab" baseline xshare
}

# ------------------------------------------------------------------------------------------------ run
log "xshare-sglang Docker smoke run $RUN_ID at $(git -C "$ROOT" rev-parse --short HEAD 2> /dev/null || echo '(no git)'); logs in $LOG_DIR"
echo "$DISK_CHECK"
step "start or find the Docker daemon" start_daemon
BASE_IMAGE=$(base_tag)
if docker image inspect "$BASE_IMAGE" > /dev/null 2>&1; then
    log "reusing $BASE_IMAGE, kept by an earlier --keep-images run (same Dockerfile and stand-in)"
    BASE_REUSED=1
else
    step "debootstrap and import a Debian $DEBIAN_SUITE root" build_debian_root
    step "build the local CPU base (SGLang 0.5.23 from PyPI)" build_base
fi
step "build the project's Dockerfile on it" build_image
step "read the CPU server arguments from the image" read_server_args
step "start a pruned and an unpruned server" start_servers
step "bad --moe-pruner-* value in a second container" check_bad_flag
step "wait for both servers" wait_servers
step "proof-of-life line, completion, /metrics counters" check_pruned_server
step "the servers' network: loopback only" check_network
step "xshare-ab-compare from the image" run_ab_compare
