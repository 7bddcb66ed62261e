#!/usr/bin/env bash
# The CUDA backend's checks on a machine with an NVIDIA GPU, in one command:
#   1. every operation against the scalar reference backend;
#   2. the tiny fixtures against transformers, Q8_0/Q4_K weights against the CPU backend, the
#      engine invariants (batched, chunked, cached prefix) within rounding, CUDA graph replays
#      equal to eager steps bit for bit;
#   3. random bf16 models of Qwen2.5-0.5B's and Llama-3.2-1B's shapes against transformers'
#      f32 run of the same weights (made here by make_models.py: torch + transformers needed);
#   4. with --bench, decode (eager and graphs) and prefill speed of a Llama-3.1-8B-shaped model
#      (cuda_bench), and `kiln serve --device cuda` at concurrency 64, with graphs and with
#      --enforce-eager, against transformers' generate.
#
# Usage: scripts/gpu/check.sh [--bench] [--bin DIR]
#   --bin DIR  take prebuilt binaries gpu_ops, gpu_models, cuda_bench, kiln from DIR (built where
#              cargo is: `scripts/gpu/build.sh DIR`); otherwise they are built here.
# Environment: KILN_GPU_WORK (default /tmp/kiln-gpu) for the generated models; HBM_GBPS and
# PEAK_TFLOPS for the bench's limits (default: H100 SXM, 3350 and 989).
set -uo pipefail
cd "$(dirname "$0")/../.."
bench=0 bin=""
while [ $# -gt 0 ]; do
    case "$1" in
        --bench) bench=1 ;;
        --bin) bin="$2"; shift ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
work="${KILN_GPU_WORK:-/tmp/kiln-gpu}"
mkdir -p "$work"

# cuBLAS and NVRTC: the toolkit's lib64 or NVIDIA's Python wheels, whichever is there.
for lib in libcublas.so.13 libnvrtc.so.13 libcublas.so.12 libnvrtc.so.12; do
    dir=$(find /usr/local/cuda*/lib64 /usr/local/cuda*/targets/*/lib /usr/lib/x86_64-linux-gnu \
        $(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null) \
        -name "$lib" -print -quit 2>/dev/null | xargs -r dirname)
    [ -n "$dir" ] && export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# The bench's limits by datasheet (dense bf16 is the same on both): H200 4.8 TB/s, H100 SXM 3.35.
case "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null)" in
    *H200*) : "${HBM_GBPS:=4800}" ;;
esac

if [ -z "$bin" ]; then
    bin="$work/bin"
    scripts/gpu/build.sh "$bin" || exit 1
fi
export KILN_FIXTURES="$PWD/tests/fixtures/models" KILN_CUDA_CACHE="$work/ptx"
status=0
step() {
    local name="$1"; shift
    echo "=== $name"
    local t0=$SECONDS
    if "$@"; then echo "=== $name: ok ($((SECONDS - t0)) s)"; else echo "=== $name: FAILED ($((SECONDS - t0)) s)"; status=1; fi
}
step "operations" "$bin/gpu_ops" --ignored --nocapture --test-threads=1
args=()
[ "$bench" = 1 ] && args=(--bench)
step "make bf16 models and yardsticks (transformers)" \
    python3 scripts/gpu/make_models.py "$work/models" "${args[@]}"
KILN_GPU_MODELS="$work/models" step "models vs transformers, invariants" \
    "$bin/gpu_models" --ignored --nocapture --test-threads=1
if [ "$bench" = 1 ]; then
    step "forward speed, llama3.1-8b shape" "$bin/cuda_bench" "$work/models/llama3.1-8b" \
        "${HBM_GBPS:-3350}" "${PEAK_TFLOPS:-989}"
    step "kiln serve at concurrency 64 vs transformers, llama3.1-8b shape" \
        scripts/gpu/serve_bench.sh "$bin/kiln" "$work/models/llama3.1-8b"
fi
exit $status
