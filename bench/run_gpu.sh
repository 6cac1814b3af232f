#!/usr/bin/env bash
# The GPU benchmark suite (B1-B4, see docs/performance.md) on this node's GPUs: results in OUT_DIR/results.json,
# one log per GPU lane beside it. Needs the trainer image's packages (torch, transformers, trl, peft, datasets,
# liger-kernel; bitsandbytes for the QLoRA case). Extra arguments go to bench/gpu_suite.py, e.g.
#   bash bench/run_gpu.sh /tmp/bench --cases b1_padded,b1_packed --budget-s 600
set -euo pipefail
out_dir=${1:-bench-results}
shift || true
cd "$(dirname "$0")/.."
python3 bench/gpu_suite.py suite --out "$out_dir" "$@"
