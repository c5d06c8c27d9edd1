#!/usr/bin/env bash
# The device checks of the compile targets on a lent CUDA machine (no network there), after the wheels have travelled:
#   .gpuA/part.aa  (a first call copies it to /tmp/gpuparts: a call carries at most 64 MiB)
#   .gpuB/part.ab, mlx, lark and mlx-lm wheels for Python 3.12 (scripts/gpu_run.sh --fetch, then split -b 48m)
# It installs MLX's CUDA backend with scripts/gpu_run.sh (INSTALL_ONLY=1), then runs tests/test_gpu.py, the targets'
# benchmark (launches, host queue time and call time of the cuda and portable targets; the portable target against
# mlx-lm's sampler) and the chain kernel's benchmarks, each step in its own time limit, logs in OUT.
set -u -o pipefail
OUT=${1:?usage: scripts/gpu_targets.sh OUT}
W=/tmp/gpuwheels
mkdir -p "$W" "$OUT"
cat /tmp/gpuparts/part.aa .gpuB/part.ab > "$W/mlx-cuda-13.tar.xz" || exit 2
cp .gpuB/*.whl "$W/"
INSTALL_ONLY=1 bash scripts/gpu_run.sh "$W" "$OUT" || exit 3
export PYTHONPATH=${SITE:-/tmp/samplec-gpu-site}:$PWD PYTHONUNBUFFERED=1
failed=0
timeout ${T_TEST:-170} python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > "$OUT/test_gpu.log" 2>&1 || failed=1
grep -E "passed|failed|Error|assert" "$OUT/test_gpu.log" | tail -15
timeout ${T_TARGETS:-170} python3 benchmarks/bench_targets.py --quick --targets cuda,portable \
    --examples "${EXAMPLES:-hf_generate,hf_greedy,llama,mlx_lm,vllm,llama_cpp_default}" --out "$OUT/bench_targets_cuda" \
    > "$OUT/bench_targets.log" 2>&1 || failed=1
cat "$OUT/bench_targets.log"
timeout ${T_BENCH:-100} python3 benchmarks/bench_gpu.py --calls > "$OUT/calls.log" 2>&1 || failed=1
grep -v warning "$OUT/calls.log" | tail -30
exit $failed
