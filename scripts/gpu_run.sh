#!/usr/bin/env bash
# samplec on MLX's CUDA backend, on a GPU machine without a network: all of tests/test_gpu.py and the benchmarks of
# docs/performance.md's GPU section (issue 33's figures, the compile targets' figures) in one go, from pre-fetched
# wheels alone.
#
# Here (with a network), once: the wheels for the GPU machine's Python (3.12 below) and MLX's CUDA backend as an
# xz'd tar, pruned to the GPU's architecture so that everything fits one 64 MiB transfer (~21 MB in all for sm_90:
# scripts/prune_fatbin.py zeroes the other architectures' code in libmlx.so in place -- the file's layout unchanged --
# and its symbol table, which nothing loads):
#   scripts/gpu_run.sh --fetch WHEELS [PYVER] [SM]       # SM: 90 (H100, H200) by default
# There, from the repository root (pytest, hypothesis, torch, transformers, numpy, networkx, typer, flatbuffers and
# the CUDA 13 libraries as pip packages -- nvidia-cublas, nvidia-cuda-nvrtc, ... -- already installed, as on a CUDA
# image; nothing is fetched); it exits non-zero when a step failed or ran out of time:
#   scripts/gpu_run.sh WHEELS OUT            # at most ~12 minutes on an H100, the install included
#   QUICK=1 scripts/gpu_run.sh WHEELS OUT    # at most ~8.5 (within a lease's 10-minute call): the chat family
#                                            # alone, no one-block comparison
# (WHEELS travels with the working tree: a folder .git/info/exclude ignores, named in the device run's carry.)
# Order matters: MLX compiles each fused kernel with NVRTC the first time a process meets it (seconds per program
# with a cold cache), so the small checks run first and warm the cache for the benchmarks. Each step has its own
# time limit and writes its log to OUT, so a slow step costs only itself.
set -u -o pipefail
if [ "${1:-}" = "--fetch" ]; then
    W=$2; PY=${3:-3.12}; SM=${4:-90}; V=0.32.4
    mkdir -p "$W" && T=$(mktemp -d)
    pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_35_x86_64 -d "$W" "mlx==$V" "lark==1.2.2" "mlx-lm==0.32.2" || exit 1
    pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 -d "$T" "mlx-cuda-13==$V" || exit 1
    (cd "$T" && unzip -q mlx_cuda_13-*.whl -x '*.dist-info/*' && rm mlx_cuda_13-*.whl) || exit 1
    python3 "$(dirname "$0")/prune_fatbin.py" "$T/mlx/lib/libmlx.so" --keep-sm "$SM" || exit 1
    (cd "$T" && tar cf - . | xz -9 -T0 > "$W/mlx-cuda-13.tar.xz") || exit 1
    rm -rf "$T" "$W"/mlx_cpu-*.whl
    ls -la "$W"
    exit 0
fi
W=${1:?usage: scripts/gpu_run.sh WHEELS OUT | --fetch WHEELS [PYVER]}
OUT=${2:?usage: scripts/gpu_run.sh WHEELS OUT}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=${SITE:-/tmp/samplec-gpu-site}
if [ ! -e "$SITE/mlx/lib/libmlx.so" ]; then
    mkdir -p "$SITE"
    # (mlx, lark and mlx-lm; an mlx_cpu wheel fetched beside them is not for this machine)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        $(ls "$W"/*.whl | grep -v mlx_cpu) || exit 3
    xz -dc -T0 "$W/mlx-cuda-13.tar.xz" | tar xf - -C "$SITE" || { rm -rf "$SITE/mlx/lib"; exit 4; }
    # libmlx.so finds the CUDA libraries at $ORIGIN/../../nvidia: point that at the installed nvidia packages
    NV=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])') || {
        echo "no nvidia packages (CUDA libraries) found"; rm -rf "$SITE/mlx/lib"; exit 6; }
    ln -sfn "$NV" "$SITE/nvidia"
fi
export PYTHONPATH=$SITE:$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import mlx.core as mx; print('MLX', mx.__version__, mx.default_device(), 'cuda', mx.cuda.is_available())" \
    || exit 5
[ "${INSTALL_ONLY:-0}" = 1 ] && exit 0      # (then run any step by hand: PYTHONPATH=$SITE:$PWD python3 ...)
failed=0
# Every step has its own time limit (T_* seconds) and log in OUT (seven files at most with QUICK=1: a lease brings
# back eight); the limits keep the whole run within 12 minutes on an H100 with the install (QUICK=1: 8.5). What each
# step prints is compact: pytest's summary, one line a benchmark case, the targets met and missed.
step() {        # step NAME LIMIT COMMAND...: run with a time limit, log to OUT/NAME.log, note a failure
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit} s)"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    [ $rc -ne 0 ] && { failed=1; echo "   $name: exit $rc$([ $rc -eq 124 ] && echo ' (time limit)')"; }
    echo "   ($((SECONDS - t0)) s)"
}
# 1. the device tests: the chain kernel's (one NVRTC compile, then split and one-block rows against the CPU's -O0)
# first, then in a step of their own the examples' programs on each GPU target; each test named as it starts and
# stopped after 90 s where pytest-timeout is installed, with Python's stacks (a test that does not return names
# where it waits)
Q=${QUICK:-0}
TO=$(python3 -c 'import pytest_timeout' 2> /dev/null && echo "--timeout 90")
step test_gpu ${T_TEST:-90} python3 -X faulthandler -m pytest -v -rfE -p no:cacheprovider $TO tests/test_gpu.py \
    -k "not tokens_equal_cpu"
grep -E " passed| failed|FAILED|ERROR|Timeout" "$OUT/test_gpu.log" | cut -c1-160 | tail -12
step test_gpu_examples ${T_EXAMPLES:-$([ $Q = 1 ] && echo 100 || echo 150)} python3 -X faulthandler -m pytest -v -rfE \
    -p no:cacheprovider $TO tests/test_gpu.py tests/test_gpu_targets.py -k "tokens_equal_cpu or on_the_gpu"
grep -E "PASSED|FAILED|ERROR|Timeout| passed| failed" "$OUT/test_gpu_examples.log" | cut -c1-160 | tail -12
# 2. issue 33's figures: every real chain at B = 1, 8, 64, 256, against mx.max (the floor) and the peers at B <= 8
if [ $Q = 1 ]; then
    step issue ${T_ISSUE:-90} python3 benchmarks/bench_gpu.py --issue --quick --torch-device cuda --json "$OUT/issue.json"
else
    step issue ${T_ISSUE:-170} python3 benchmarks/bench_gpu.py --issue --torch-device cuda --json "$OUT/issue.json"
fi
grep -E "^  (chat|confident)|^targets|^\[skip|Error" "$OUT/issue.log" | cut -c1-150
# 3. the host's share of a call (Program.queue alone) beside the synchronous and queued calls
step calls ${T_CALLS:-$([ $Q = 1 ] && echo 30 || echo 40)} python3 benchmarks/bench_gpu.py --calls
grep -v -i warning "$OUT/calls.log" | grep -E "^ +B =|ms\)" | cut -c1-150
# 4. each GPU kernel's own time in one B = 1 call of HF's chain (Nsight Compute, where the image has it; NCU=0 skips)
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
    step ncu_hf ${T_NCU:-45} ncu --clock-control none --print-summary per-kernel --metrics gpu__time_duration.sum \
        -c 120 python3 benchmarks/bench_gpu.py --calls --only hf
    grep -E "^  [a-zA-Z_]|gpu__time_duration" "$OUT/ncu_hf.log" | cut -c1-120 | head -30
fi
# 5. the compile targets on this GPU: launches, the host's queue time and a call's time of the cuda target (samplec's
# kernel) and the portable target (what an Apple GPU runs: MLX ops alone), the portable target against mlx-lm's sampler
step targets ${T_TARGETS:-$([ $Q = 1 ] && echo 100 || echo 150)} python3 benchmarks/bench_targets.py --quick \
    --targets cuda,portable --examples "${EXAMPLES:-hf_generate,hf_greedy,llama,mlx_lm,vllm,llama_cpp_default}"
grep -v -i warning "$OUT/targets.log" | tail -30 | cut -c1-160
# 6. some chains with one block a row (split mode off): what the split buys, in the same run
if [ $Q != 1 ]; then
    step one_block ${T_AB:-40} env SAMPLEC_GPU_SPLIT=0 python3 benchmarks/bench_gpu.py --issue --quick --batches 1,8 \
        --chains hf,mlx_lm,greedy,llama_cpp --torch-device cuda
    grep -E "^  chat" "$OUT/one_block.log" | cut -c1-150
fi
echo "== done in $SECONDS s, $([ $failed = 0 ] && echo 'every step passed' || echo 'A STEP FAILED: see its log')"
exit $failed
