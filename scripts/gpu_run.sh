#!/usr/bin/env bash
# samplec on MLX's CUDA backend, on a GPU machine without a network: the checks and benchmarks of
# docs/performance.md's GPU section in one go.
#
# Here (with a network), once: the wheels for the GPU machine's Python (3.12 below), MLX's CUDA backend as an
# xz'd tar (its wheel is ~90 MB; split it where a transfer limit needs that, and cat the parts back in WHEELS):
#   scripts/gpu_run.sh --fetch WHEELS [PYVER]
# There, from the repository root (pytest, hypothesis, torch, transformers, numpy, networkx, typer, flatbuffers and
# the CUDA 13 libraries as pip packages -- nvidia-cublas, nvidia-cuda-nvrtc, ... -- already installed, as on a CUDA
# image); it exits non-zero when a step failed or ran out of time:
#   scripts/gpu_run.sh WHEELS OUT
# Order matters: MLX compiles each fused kernel with NVRTC the first time a process meets it (seconds per program
# with a cold cache), so the small checks run first and warm the cache for the benchmarks. Each step has its own
# time limit and writes its log to OUT, so a slow step costs only itself.
set -u -o pipefail
if [ "${1:-}" = "--fetch" ]; then
    W=$2; PY=${3:-3.12}; V=0.32.4
    mkdir -p "$W" && T=$(mktemp -d)
    pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_35_x86_64 -d "$W" "mlx==$V" "lark==1.2.2" "mlx-lm==0.32.2" || exit 1
    pip download -q --no-deps --only-binary=:all: --platform manylinux_2_35_x86_64 -d "$T" "mlx-cuda-13==$V" || exit 1
    (cd "$T" && unzip -q mlx_cuda_13-*.whl -x '*.dist-info/*' && rm mlx_cuda_13-*.whl &&
        tar cf - . | xz -9 -T0 > "$W/mlx-cuda-13.tar.xz") || exit 1
    rm -rf "$T"
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
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$W"/*.whl || exit 3
    xz -dc -T0 "$W/mlx-cuda-13.tar.xz" | tar xf - -C "$SITE" || exit 4
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
# QUICK=1 (a short lease): the chain kernel's tests, the chains, the peers on the chains the kernel runs, token only
# (CHAINS=a,b,...: bench_real's chains), then where whole calls go (bench_gpu --calls, and ncu's per-kernel times)
if [ "${QUICK:-0}" = 1 ]; then
    timeout ${T_TEST:-100} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "chain or kth" \
        > "$OUT/test_gpu.log" 2>&1 || failed=1
    grep -E "passed|failed|Error|assert" "$OUT/test_gpu.log" | tail -12
    timeout ${T_BENCH:-60} python3 benchmarks/bench_gpu.py --chains-only --json "$OUT/bench_gpu.json" \
        > "$OUT/bench_gpu.log" 2>&1 || failed=1
    cat "$OUT/bench_gpu.log"
    timeout ${T_REAL:-150} python3 benchmarks/bench_real.py --quick --lean --trace --budget 0.25 --torch-device cuda \
        --chains "${CHAINS:-mlx_lm,hf,vllm,server,openai}" --out "$OUT/bench_real_cuda" > "$OUT/bench_real_cuda.log" 2>&1 \
        || failed=1
    tail -30 "$OUT/bench_real_cuda.log"
    timeout ${T_CALLS:-60} python3 benchmarks/bench_gpu.py --calls > "$OUT/calls.log" 2>&1 || failed=1
    grep -v warning "$OUT/calls.log" | grep -E "^ +B =|ms\)"
    # each GPU kernel's own time in one B = 1 call of HF's chain (Nsight Compute, where the image has it)
    if command -v ncu > /dev/null; then
        timeout ${T_NCU:-60} ncu --print-summary per-kernel --metrics gpu__time_duration.sum -c 120 \
            python3 benchmarks/bench_gpu.py --calls --only hf > "$OUT/ncu_hf.log" 2>&1 || failed=1
        grep -E "^  [a-zA-Z_]|gpu__time_duration" "$OUT/ncu_hf.log" | cut -c1-120
    fi
    exit $failed
fi
# the chain kernel's tests first (one kernel: one NVRTC compile), the benchmarks, then the other GPU tests (the
# examples' programs: the dense definitions' kernels are the slow compiles)
timeout ${T_TEST:-150} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "chain or kth" \
    > "$OUT/test_gpu.log" 2>&1 || failed=1
grep -E "passed|failed|Error|assert" "$OUT/test_gpu.log" | tail -12
timeout ${T_BENCH:-120} python3 benchmarks/bench_gpu.py --json "$OUT/bench_gpu.json" > "$OUT/bench_gpu.log" 2>&1 \
    || failed=1
cat "$OUT/bench_gpu.log"
timeout ${T_REAL:-170} python3 benchmarks/bench_real.py --quick --trace --budget 0.25 --torch-device cuda --check-device cpu \
    --out "$OUT/bench_real_cuda" > "$OUT/bench_real_cuda.log" 2>&1 || failed=1
tail -40 "$OUT/bench_real_cuda.log"
timeout ${T_TEST2:-60} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "not chain and not kth" \
    > "$OUT/test_gpu2.log" 2>&1 || failed=1
grep -E "passed|failed|Error|assert" "$OUT/test_gpu2.log" | tail -12
exit $failed
