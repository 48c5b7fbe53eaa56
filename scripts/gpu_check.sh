#!/usr/bin/env bash
# Every GPU check of the project in one command, for one call of the lent GPU machine (at most 9 minutes).
#
#   scripts/gpu_check.sh --sha "$(git rev-parse --short HEAD)"      # on the GPU machine, repository root
#
# Stages, each with its own time box, in this order:
#   1. tests      the gpu-marked tests (kernels in CUDA graphs, the torch reference without host syncs,
#                 ECHO) and the kernel tests that run natively on a GPU (tickets, devices, streams)
#   2. selection  scripts/bench_selection.py: selection cost per policy, T and router
#   2b. pdl       scripts/bench_selection.py --pdl on a subset: the same calls launched as programmatic
#                 dependents, timed and checked bit for bit in CUDA graphs, and timed behind the former
#                 counter reset launch (its table goes to gpu_check.log)
#   2c. mass      scripts/bench_selection.py --select-mass at T=32 and 512 on the three routers: the
#                 retained-mass metric of oea, static moe-spec and LYNX summed by the selection (every
#                 row's scores, E aggregates), the other side of the A/B whose first side (the routing
#                 kernel's sums) the selection stage times (its table goes to gpu_check.log)
#   2d. gate      scripts/bench_selection.py --metrics-gate closed at T=1, 8, 32 and 512 on the three
#                 routers: the calls of a forward that --moe-pruner-metrics-every does not sample (the
#                 row passed with a device gate of 0), against the selection stage's calls, which add
#                 their metrics on every call (its table goes to gpu_check.log)
#   3. moe_layer  scripts/bench_moe_layer.py: the MoE layer, baseline vs pruned
#   4. kernel_routing  GPT-OSS's default routing (triton_kernels, carried in .sgl/site) pruned through
#                 the router logits: tests/test_kernel_routing_gpu.py, then scripts/bench_kernel_routing.py
#                 (its table goes to gpu_check.log); skipped when triton_kernels does not import
#   5. guard      scripts/bench_moe_layer.py --guard-repeats: the start-up guard's decisions
# A stage that runs over its box is stopped; the benchmarks also stop starting new cases a little before
# (--max-minutes), so a cut stage still leaves the cases it finished.  Results are copied to the output
# folder after every stage, so whatever ran comes back.
#
# Output folder: $OUT (the device tool's), else ./gpu-check-out.  At most 8 files (the device tool
# returns no more): gpu_check.log (every stage's output), gpu_tests.xml (JUnit), selection.md,
# selection.csv, moe_layer.md, moe_layer.csv, guard_table.md, guard_table.json.
#
# Options: --sha SHA (recorded in every table; the device gets no .git), --only STAGE[,STAGE] (a
# subset, e.g. --only tests), --budget SECONDS (total, default 520; the stage boxes scale with it),
# --boxes STAGE=PERCENT[,...] (a stage's share of the budget instead of its default, e.g.
# --boxes selection=45,moe_layer=25 when --only leaves out the guard, whose box is the rest),
# --workers N (pytest-xdist processes for the tests stage, default 14 of the 16 cores, 0 for one process; the stage
# is mostly Triton compiles, which then run side by side; used where pytest-xdist imports).
# SGLang's fused-MoE kernel file is read from .sgl/ when present (see docs/benchmarks.md); without it
# the benchmarks time torch._grouped_mm and say so.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1

sha=unknown
only=tests,selection,pdl,mass,gate,moe_layer,kernel_routing,guard
budget=520
boxes=
workers=14
while [ $# -gt 0 ]; do
    case "$1" in
        --sha) sha=$2; shift 2 ;;
        --only) only=$2; shift 2 ;;
        --budget) budget=$2; shift 2 ;;
        --boxes) boxes=$2; shift 2 ;;
        --workers) workers=$2; shift 2 ;;
        -h|--help) sed -n '2,40p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (allowed: --sha SHA, --only STAGES, --budget SECONDS, --boxes STAGE=PERCENT,..., --workers N)" >&2; exit 2 ;;
    esac
done
if [ "$sha" = unknown ] && git rev-parse --short HEAD >/dev/null 2>&1; then
    sha=$(git rev-parse --short HEAD)
    git diff --quiet HEAD 2>/dev/null || sha="$sha-dirty"
fi

out=${OUT:-gpu-check-out}
mkdir -p "$out"
work=$(mktemp -d)
log="$out/gpu_check.log"
: >"$log"
start=$(date +%s)
export PYTHONPATH=. PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=ci
sgl_args=()
[ -d .sgl/sglang ] && sgl_args=(--sglang-root .sgl/sglang)

say() { echo "[gpu_check $(($(date +%s) - start))s] $*" | tee -a "$log"; }
wanted() { [[ ",$only," == *",$1,"* ]]; }
stages=" tests selection pdl mass gate moe_layer kernel_routing guard "
for entry in ${boxes//,/ }; do
    name=${entry%%=*} percent=${entry#*=}
    if [[ "$stages" != *" $name "* || ! "$percent" =~ ^[0-9]+$ || "$percent" -gt 100 ]]; then
        echo "gpu_check.sh: --boxes $entry: want STAGE=PERCENT with STAGE one of$stages and PERCENT 0..100" >&2
        exit 2
    fi
done
# seconds of a stage's box: its share of the budget (--boxes, else the default given), never past the
# budget's end
box() {
    local name=$1 share=$2 entry
    for entry in ${boxes//,/ }; do [ "${entry%%=*}" = "$name" ] && share=${entry#*=}; done
    local left=$((budget - ($(date +%s) - start)))
    local want=$((budget * share / 100))
    [ "$want" -gt "$left" ] && want=$left
    echo "$want"
}
# run one stage: name, seconds, command...
stage() {
    local name=$1 seconds=$2; shift 2
    if [ "$seconds" -lt 20 ]; then
        say "stage $name skipped: ${seconds}s left of the ${budget}s budget"
        return
    fi
    say "stage $name: up to ${seconds}s: $*"
    timeout -k 10 "$seconds" "$@" 2>&1 | tee -a "$log"
    local status=${PIPESTATUS[0]}
    [ "$status" -eq 124 ] && say "stage $name stopped at its ${seconds}s box"
    say "stage $name: exit $status"
}
keep() {  # copy result files into the output folder
    local file
    for file in "$@"; do [ -f "$file" ] && cp "$file" "$out/"; done
}

say "commit $sha; output $out; budget ${budget}s; stages $only"
python3 - <<'EOF' 2>&1 | tee -a "$log"
import torch, triton
print(f"device {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; torch {torch.__version__}; triton {triton.__version__}")
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$log"

if ! [[ "$workers" =~ ^[0-9]+$ ]]; then
    echo "gpu_check.sh: --workers $workers: want a number of processes (0: one)" >&2
    exit 2
fi
if wanted tests; then
    parallel=()
    if [ "$workers" -gt 0 ] && python3 -c "import xdist" >/dev/null 2>&1; then
        parallel=(-n "$workers")
    else
        say "tests run in one process (--workers $workers, or pytest-xdist does not import)"
    fi
    stage tests "$(box tests 25)" python3 -m pytest "${parallel[@]}" -v -p no:cacheprovider -rfE --junitxml="$work/gpu_tests.xml" \
        tests/test_kernels_gpu.py tests/test_gpu_reference.py tests/test_echo_gpu.py tests/test_kernel_primitives.py \
        tests/test_kernels.py -k "gpu or leave_the_counters or whichever_program or interleaved_layers or split_tile or fails_part_way or per_stream or current_device or sixteen or infinity or primitives"
    keep "$work/gpu_tests.xml"
fi
if wanted selection; then
    seconds=$(box selection 35)
    stage selection "$seconds" python3 scripts/bench_selection.py --tokens 1,8,32,64,128,256,512 \
        --max-minutes "$(python3 -c "print(max(0.2, ($seconds - 30) / 60))")" --git-sha "$sha" \
        --out-dir "$work/selection" "${sgl_args[@]}"
    keep "$work/selection/selection.md" "$work/selection/selection.csv"
fi
if wanted pdl; then
    seconds=$(box pdl 5)
    stage pdl "$seconds" python3 scripts/bench_selection.py --pdl --models qwen3-30b-a3b,deepseek-v3 \
        --tokens 1,32,512 --policies xshare,lynx,moe-spec-static \
        --max-minutes "$(python3 -c "print(max(0.2, ($seconds - 30) / 60))")" --git-sha "$sha" \
        --out-dir "$work/pdl" "${sgl_args[@]}"
    [ -f "$work/pdl/selection.md" ] && cat "$work/pdl/selection.md" >>"$log"
fi
if wanted mass; then
    # plan.ROUTING_SUMS_MASS: only above one program, where the routing kernel runs
    seconds=$(box mass 5)
    stage mass "$seconds" python3 scripts/bench_selection.py --select-mass --tokens 32,512 \
        --models qwen3-30b-a3b,gpt-oss-120b,deepseek-v3 --policies oea,moe-spec-static,lynx \
        --max-minutes "$(python3 -c "print(max(0.2, ($seconds - 30) / 60))")" --git-sha "$sha" \
        --out-dir "$work/mass" "${sgl_args[@]}"
    [ -f "$work/mass/selection.md" ] && cat "$work/mass/selection.md" >>"$log"
fi
if wanted gate; then
    # --moe-pruner-metrics-every: what a forward the server does not sample costs
    seconds=$(box gate 6)
    stage gate "$seconds" python3 scripts/bench_selection.py --metrics-gate closed --tokens 1,8,32,512 \
        --models qwen3-30b-a3b,gpt-oss-120b,deepseek-v3 --policies oea,moe-spec-static,xshare,lynx \
        --max-minutes "$(python3 -c "print(max(0.2, ($seconds - 30) / 60))")" --git-sha "$sha" \
        --out-dir "$work/gate" "${sgl_args[@]}"
    [ -f "$work/gate/selection.md" ] && cat "$work/gate/selection.md" >>"$log"
fi
if wanted moe_layer; then
    seconds=$(box moe_layer 15)
    stage moe_layer "$seconds" python3 scripts/bench_moe_layer.py --models qwen3-30b-a3b,gpt-oss-120b,deepseek-v3-ep8 \
        --tokens 8,32,128,512 --max-minutes "$(python3 -c "print(max(0.2, ($seconds - 30) / 60))")" \
        --git-sha "$sha" --out-dir "$work/moe_layer" "${sgl_args[@]}"
    keep "$work/moe_layer/moe_layer.md" "$work/moe_layer/moe_layer.csv"
fi
if wanted kernel_routing; then
    # GPT-OSS's default routing (triton_kernels, carried in .sgl/site; see docs/benchmarks.md), pruned
    # through the router logits: the gpu tests of that path (-m gpu: its CPU cases need the
    # interpreter, which this machine does not set), then its added cost per layer call
    if PYTHONPATH=.:.sgl/site python3 -c "import triton_kernels.topk" >>"$log" 2>&1; then
        seconds=$(box kernel_routing 5)
        stage kernel_routing "$seconds" env PYTHONPATH=.:.sgl/site bash -c \
            "python3 -m pytest -q -p no:cacheprovider -rfE -m gpu tests/test_kernel_routing_gpu.py \
             && python3 scripts/bench_kernel_routing.py --git-sha $sha --calls 10 --replays 20"
    else
        say "stage kernel_routing skipped: triton_kernels does not import from .sgl/site (see the line above)"
    fi
fi
if wanted guard; then
    seconds=$(box guard 100)
    stage guard "$seconds" python3 scripts/bench_moe_layer.py --models qwen3-30b-a3b,gpt-oss-20b --phases decode \
        --tokens 1,4,16,64,256 --policies xshare,moe-spec --guard-repeats 3 \
        --max-minutes "$(python3 -c "print(max(0.2, ($seconds - 30) / 60))")" --git-sha "$sha" \
        --out-dir "$work/guard" "${sgl_args[@]}"
    keep "$work/guard/guard_table.md" "$work/guard/guard_table.json"
fi
say "done in $(($(date +%s) - start))s; files: $(find "$out" -mindepth 1 -maxdepth 1 -printf '%f\n' | sort | tr '\n' ' ')"
rm -rf "$work"
