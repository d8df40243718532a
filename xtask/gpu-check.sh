#!/usr/bin/env bash
# The one-call GPU check: runs on a machine with an NVIDIA GPU from the folder
# `cargo xtask gpu-check --prepare` made (target/gpu-check: this script, bin.tar.gz with the
# stripped binaries, gpt_step.py). No cargo there. Usage:
#
#   bash target/gpu-check/gpu-check.sh OUT_DIR
#
# Writes OUT_DIR/summary.md (one line per check, its verdict and figures) and OUT_DIR/log.txt
# (everything the checks printed), in under 8 minutes (a deadline; a check that would pass
# it is cut short or skipped, and says so): the environment (driver, NCCL,
# NVRTC, cuBLAS found), the CUDA op tests, the NCCL tests, the cuda training tests (every
# strategy against the CPU for a few steps), GPT-2 124M bf16 tokens/s and MFU with the
# PyTorch eager + SDPA step beside it when torch is there, compute-sanitizer memcheck and
# racecheck on the op tests when it is there. Each check has its own time limit; one that
# fails or runs out is reported and the next one runs.
#
# GPU_CHECK_LIBS: more library folders to search first (the emulated GPU's, to try this
# script without a GPU). GPU_CHECK_TRAIN: cuda_train's model arguments (GPT-2 124M when unset).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-$here/out}"
mkdir -p "$out"
summary="$out/summary.md"
log="$out/log.txt"
: >"$log"
work="$(mktemp -d)"
started=$(date +%s)
deadline=$((started + 470))
failures=0

say() { echo "$*" | tee -a "$summary"; }
# check NAME SECONDS COMMAND...: runs COMMAND with its output in the log and in
# $work/NAME.txt; its status (124: out of time) in $status, its seconds in $took.
check() {
    local name="$1" limit="$2" t0
    shift 2
    t0=$(date +%s)
    local left=$((deadline - t0 - 5))
    [ "$limit" -gt "$left" ] && limit=$left
    : >"$work/$name.txt"
    if [ "$limit" -le 0 ]; then
        status=125 took=0
        echo "=== $name: skipped, the deadline has passed" >>"$log"
        return
    fi
    echo "=== $name (at most $limit s): $*" >>"$log"
    timeout --kill-after=5 "$limit" "$@" >"$work/$name.txt" 2>&1
    status=$?
    took=$(($(date +%s) - t0))
    cat "$work/$name.txt" >>"$log"
    echo "=== $name: exit $status after ${took} s" >>"$log"
    [ "$status" -ne 0 ] && failures=$((failures + 1))
}
verdict() { # ok, FAILED, OUT OF TIME or SKIPPED, from $status
    case "$status" in
        0) echo "ok" ;;
        124 | 137) echo "OUT OF TIME" ;;
        125) echo "SKIPPED (no time left)" ;;
        *) echo "FAILED (exit $status)" ;;
    esac
}
# The "test result" line of a Rust test binary's output, shortened.
tests_line() { grep -h "^test result" "$work/$1.txt" | tail -1 | sed 's/; finished in/ in/'; }

: >"$summary"
say "# distlab GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
say ""
tar -xzf "$here/bin.tar.gz" -C "$work" || { say "cannot unpack bin.tar.gz"; exit 1; }
bin="$work/bin"
say "built from: $(cat "$bin/COMMIT" 2>/dev/null || echo unknown)"

# --- the environment ---------------------------------------------------------------------
libs="${GPU_CHECK_LIBS:-}"
# NVIDIA's Python wheels (NCCL ships there only as libnccl.so.2), then the toolkit's own.
if command -v python3 >/dev/null; then
    wheels=$(python3 - <<'EOF' 2>/dev/null
import glob, os, site
dirs = site.getsitepackages() + [site.getusersitepackages()]
found = sorted({os.path.dirname(p) for d in dirs for p in glob.glob(os.path.join(d, "nvidia", "*", "lib", "lib*.so*"))})
print(":".join(found))
EOF
)
    libs="$libs:$wheels"
fi
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && libs="$libs:$d"; done
[ -n "${LD_LIBRARY_PATH:-}" ] && libs="$libs:$LD_LIBRARY_PATH"
libs=$(echo "$libs" | tr -s ':' | sed 's/^://; s/:$//') # (an empty entry would mean ".")
export LD_LIBRARY_PATH="$libs"
export DISTLAB_BIN_DIR="$bin"
say ""
say "## Environment"
if command -v nvidia-smi >/dev/null; then
    say "- GPU: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -1)"
else
    say "- GPU: no nvidia-smi here"
fi
found() { # found NAME...: the first of the names the loader finds, or "MISSING"
    for n in "$@"; do
        if command -v python3 >/dev/null; then
            python3 -c "import ctypes,sys; ctypes.CDLL(sys.argv[1])" "$n" 2>/dev/null && { echo "$n"; return; }
        else
            for d in ${LD_LIBRARY_PATH//:/ }; do [ -e "$d/$n" ] && { echo "$d/$n"; return; }; done
            ldconfig -p 2>/dev/null | grep -q " $n " && { echo "$n"; return; }
        fi
    done
    echo "MISSING"
}
say "- driver library: $(found libcuda.so libcuda.so.1)"
say "- NCCL: $(found libnccl.so libnccl.so.2)"
say "- NVRTC: $(found libnvrtc.so libnvrtc.so.13 libnvrtc.so.12)"
say "- cuBLAS: $(found libcublas.so libcublas.so.13 libcublas.so.12)"
say "- library path: $LD_LIBRARY_PATH"

# --- the tests ---------------------------------------------------------------------------
say ""
say "## Tests"
check ops 60 "$bin/engine" --include-ignored cuda_
say "- CUDA op tests against the f64 reference: $(verdict) ($took s): $(tests_line ops)"
grep -h "^test .*FAILED\|panicked" "$work/ops.txt" | head -5 | sed 's/^/  - /' | tee -a "$summary" >/dev/null
check nccl 30 "$bin/nccl" --include-ignored --nocapture
say "- NCCL communicator tests: $(verdict) ($took s): $(tests_line nccl)"
if grep -q "refused two ranks" "$work/nccl.txt"; then
    say "  - with one GPU NCCL refused the two-rank group, as it must: only the group of one ran NCCL's collectives"
fi
# Every strategy against the CPU for 8 steps, first in fp32; then bf16/fp16, the ledgers,
# elastic resume and export as time allows (a killed run's resume needs the server: left out).
fp32=every_strategy_on_cuda_follows_the_cpu_in_fp32
check training 150 "$bin/cuda" --include-ignored --exact "$fp32" --nocapture
say "- cuda training, every strategy vs the cpu backend in fp32: $(verdict) ($took s): $(tests_line training)"
grep -h "largest relative difference" "$work/training.txt" | sed 's/^/  - /' | tee -a "$summary" >/dev/null
grep -h "panicked" -A2 "$work/training.txt" | head -6 | sed 's/^/    /' | tee -a "$summary" >/dev/null
check training_rest 80 "$bin/cuda" --include-ignored --skip "$fp32" --skip a_killed_cuda_run --test-threads 2
say "- cuda training, bf16/fp16, ledgers, elastic resume, export: $(verdict) ($took s): $(tests_line training_rest)"
grep -h "^test " "$work/training_rest.txt" | grep -v "has been running" | sed 's/^/  - /' | tee -a "$summary" >/dev/null
grep -h "panicked" -A2 "$work/training_rest.txt" | head -6 | sed 's/^/    /' | tee -a "$summary" >/dev/null

# --- speed ---------------------------------------------------------------------------------
say ""
say "## GPT-2 124M, bf16, one GPU"
train_args=${GPU_CHECK_TRAIN:---layers 12 --d-model 768 --heads 12 --seq-len 1024 --vocab 50304 --micro-batch 8}
# shellcheck disable=SC2086
check cuda_train 60 "$bin/cuda_train" $train_args --precision bf16 --steps 10 --warmup 3
say "- distlab (cuda_train $train_args): $(verdict) ($took s)"
grep -h '"bench"' "$work/cuda_train.txt" | tail -1 | sed 's/^/  - /' | tee -a "$summary" >/dev/null
if python3 -c "import torch; assert torch.cuda.is_available()" 2>/dev/null; then
    # shellcheck disable=SC2086
    check torch 60 python3 "$here/gpt_step.py" --device cuda --dtype bf16 --untied --attn sdpa --steps 10 --warmup 3 \
        $(echo "$train_args" | sed 's/--micro-batch/--batch/')
    say "- PyTorch eager + SDPA, autocast bf16 (gpt_step.py): $(verdict) ($took s)"
    grep -h '"tokens_per_s"' "$work/torch.txt" | tail -1 | sed 's/^/  - /' | tee -a "$summary" >/dev/null
else
    say "- PyTorch: no torch with CUDA here, not compared"
fi

# --- sanitizers ------------------------------------------------------------------------------
say ""
say "## compute-sanitizer on the op tests (fp32)"
if command -v compute-sanitizer >/dev/null; then
    for tool in memcheck racecheck; do
        check "$tool" 50 compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin/engine" --include-ignored cuda_fp32
        say "- $tool: $(verdict) ($took s): $(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$work/$tool.txt" | tail -1)"
    done
else
    say "- no compute-sanitizer here"
fi

say ""
say "All checks: $(($(date +%s) - started)) s; $failures did not pass."
rm -rf "$work"
[ "$failures" -eq 0 ]
