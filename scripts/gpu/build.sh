#!/usr/bin/env bash
# Builds the GPU check binaries (gpu_ops, gpu_models, cuda_bench, kiln) into DIR, stripped, for
# scripts/gpu/check.sh --bin DIR on a GPU machine without cargo.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:?usage: scripts/gpu/build.sh DIR}"
mkdir -p "$out"
cargo build --release -p kiln-cuda --example cuda_bench
cargo build --release -p kiln --features cuda
cp target/release/examples/cuda_bench target/release/kiln "$out/"
for t in gpu_ops gpu_models; do
    exe=$(cargo test -p kiln-cuda --test "$t" --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("executable") and m.get("target", {}).get("name") == sys.argv[1]:
        print(m["executable"])' "$t")
    cp "$exe" "$out/$t"
done
strip "$out"/* 2>/dev/null || true
ls -la "$out"
