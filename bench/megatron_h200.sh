#!/usr/bin/env bash
# Superseded by bench/h200_bench.sh (the worker now runs the Megatron-LM checkout, not the megatron-core wheel).
# Benchmark on the lent H200s (device tool, kind nvidia-h200-x2): the DeepSeek-V4 proxy with megatron-core,
# 20 steps per layout on the same rows and seed, in one call. Each layout writes a run directory (run
# directories: metrics.jsonl, record.json with the probe of every rank, logs), packed into $OUT/runs.tgz (the
# device tool returns a limited number of files); analyse them here with bench/megatron_h200_report.py.
#
# Carry: bench/.scratch/wheels (megatron-core 0.16.1, hydra-core, omegaconf, antlr4 wheels for Python 3.12) and
# bench/.scratch/rows-4096 (`trainer data example --conversations 2400 --seed 1` +
# `trainer data build --row-tokens 4096`, rows_sha256 pinned in conf/data/synthetic-4096.yaml).
# Usage there: bash bench/megatron_h200.sh [LAYOUT ...]
set -uo pipefail
OUT=${OUT:-/tmp/out}
site=/tmp/site
python3 -m pip install -q --no-index --no-deps --target "$site" bench/.scratch/wheels/*.whl
export PYTHONPATH="$site:$PWD"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
layouts=("$@")
[ ${#layouts[@]} -gt 0 ] || layouts=(gpu1-tp1pp1ep1 gpu2-tp1pp1ep1 gpu2-tp1pp2ep1 gpu2-tp1pp1ep2)
runs=$(mktemp -d)/runs
mkdir -p "$runs"
trap 'tar -C "$(dirname "$runs")" -czf "$OUT/runs.tgz" runs' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$runs/nvidia-smi.csv"
for layout in "${layouts[@]}"; do
  echo "=== $layout"
  start=$(date +%s)
  timeout 240 python3 -m trainer.train experiment=proxy-h200 layout="$layout" \
    paths.prompt_data="$PWD/bench/.scratch/rows-4096" hydra.run.dir="$runs/$layout" \
    > "$runs/$layout.out" 2>&1
  rc=$?
  echo "$layout rc=$rc wall=$(( $(date +%s) - start ))s"
  tail -n 4 "$runs/$layout.out"
  if [ $rc -ne 0 ]; then
    tail -n 30 "$runs/$layout/logs/rank-0.log" 2>/dev/null | grep -v "^\s*$" | tail -n 25
    [ "$layout" = "${layouts[0]}" ] && { echo "first layout failed: stopping"; exit 1; }
  fi
done
