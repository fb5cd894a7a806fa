#!/usr/bin/env bash
# On the lent H200, after bench/h200_setup.sh install: the runs of bench/RESULTS.md's "recipe code on H200"
# section, each a `trainer.train` run directory (launcher=local-megatron: Megatron-LM 37f91617 and miles 78527b91
# from the checkouts in /tmp/src, verified by git tree hash; TE 2.17.0 and tilelang 0.1.15 from /tmp/site),
# same rows and seed, packed into $OUT/runs.tgz; analyse here with bench/h200_report.py.
# Usage there: bash bench/h200_bench.sh RUN [RUN ...]   (RUN names below; `bare-mla` is the bare Megatron script)
# BENCH_SECONDS (default 540): the runs stop by then (a run is cut to the time left, and one with under 60 s
# left is skipped), so that $OUT/runs.tgz is written inside the device call's limit.
set -uo pipefail
OUT=${OUT:-/tmp/out}
deadline=$(( $(date +%s) + ${BENCH_SECONDS:-540} ))
export PYTHONPATH="/tmp/site:$PWD" MEGATRON_LM_PATH=/tmp/src/Megatron-LM MILES_PATH=/tmp/src/miles
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# the lock's pip cuDNN first: the machine's apt cuDNN 9.14 would otherwise shadow it (bench/h200_setup.sh cudnn-dir)
cudnn=$(bash bench/h200_setup.sh cudnn-dir)
export LD_LIBRARY_PATH="$cudnn:${LD_LIBRARY_PATH:-}"
# TE 2.17.0 loads cuDNN itself, searching $CUDNN_HOME, $CUDNN_PATH, $CUDA_HOME, /usr/local/cuda before the python
# packages (transformer_engine/common/__init__.py, _load_cuda_library_from_system): on 2026-12-01, without this,
# it mapped the apt 9.14 next to torch's 9.19
export CUDNN_HOME="$(dirname "$cudnn")"
export XDG_CACHE_HOME=/tmp/cache  # JIT kernel caches (triton; tilelang keeps ~/.tilelang/cache) stay warm between runs of one machine
runs=/tmp/runs
mkdir -p "$runs"
trap 'tar -C /tmp -czf "$OUT/runs.tgz" runs' EXIT
proxy="experiment=proxy-h200 paths.prompt_data=/tmp/rows/rows-4096 launcher.steps=12"
tiny="experiment=dsv4-tiny-h200 paths.prompt_data=/tmp/rows/rows-8192"
slice="experiment=dsv4-flash-slice-h200 paths.prompt_data=/tmp/rows/rows-8192"
overrides() {
  case "$1" in
    proxy-local) echo "$proxy model=dsv4-proxy launcher.transformer_impl=local" ;;
    proxy-te) echo "$proxy model=dsv4-proxy launcher.transformer_impl=transformer_engine" ;;
    proxy-te-mla) echo "$proxy model=dsv4-proxy-mla launcher.transformer_impl=transformer_engine" ;;
    proxy-te-mla-profile) echo "$proxy model=dsv4-proxy-mla launcher.transformer_impl=transformer_engine launcher.profile_step=8" ;;
    proxy-te-mla-fused) echo "$proxy model=dsv4-proxy-mla launcher.transformer_impl=transformer_engine launcher.attention_backend=fused launcher.steps=2" ;;
    tiny) echo "$tiny" ;;
    tiny-profile) echo "$tiny launcher.profile_step=8" ;;
    # the convergence pair on one GPU (one row per microbatch: conf/experiment/dsv4-tiny-h200.yaml says why)
    tiny-nodistopt) echo "$tiny layout.use_distributed_optimizer=false" ;;
    tiny-lr) echo "$tiny optim.lr=6.0e-4 optim.min_lr=6.0e-5" ;;
    # 4 microbatches of 2 rows vs 2 of 4, no hash layer: stopped in TileKernels 1.0.0's backward on 2026-12-01;
    # the launcher now refuses them (layout.micro_batch_size > 1 with the V4 model)
    tiny-mb4) echo "$tiny layout.micro_batch_size=2 model.dsv4_n_hash_layers=0" ;;
    tiny-mb2) echo "$tiny layout.micro_batch_size=4 model.dsv4_n_hash_layers=0" ;;
    tiny-mb4-lr) echo "$tiny layout.micro_batch_size=2 model.dsv4_n_hash_layers=0 optim.lr=6.0e-4 optim.min_lr=6.0e-5" ;;
    tiny-smoke) echo "$tiny launcher.steps=3" ;;
    # the stage slice of DeepSeek-V4-Flash (conf/experiment/dsv4-flash-slice-h200.yaml): 5 layers, and 2 and 4 for
    # the memory of one layer (the difference of two peaks)
    slice) echo "$slice" ;;
    slice-2) echo "$slice model.num_layers=2 model.moe_layer_freq=[1,1] model.dsv4_compress_ratios=[0,0]" ;;
    slice-mtp) echo "$slice model.num_layers=2 model.moe_layer_freq=[1,1] model.dsv4_compress_ratios=[0,0,0] model.mtp_num_layers=1" ;;
    slice-gb8) echo "$slice optim.global_batch_size=8 optim.rollout_batch_size=8 optim.num_rollout=6" ;;
    slice-3) echo "$slice model.num_layers=3 model.moe_layer_freq=[1,1,1] model.dsv4_compress_ratios=[0,0,4]" ;;
    slice-4) echo "$slice model.num_layers=4 model.moe_layer_freq=[1,1,1,1] model.dsv4_compress_ratios=[0,0,4,128]" ;;
    proxy-te-mla-fused-mixed) echo "$proxy model=dsv4-proxy-mla launcher.transformer_impl=transformer_engine launcher.attention_backend=fused launcher.steps=2" ;;
    *) return 1 ;;
  esac
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$runs/nvidia-smi.csv"
for run in "$@"; do
  start=$(date +%s)
  case "$run" in tiny*|slice*) limit=300 ;; *) limit=200 ;; esac
  left=$(( deadline - start ))
  if [ $left -lt 60 ]; then echo "=== $run skipped: ${left} s left"; continue; fi
  [ $left -lt $limit ] && limit=$left
  echo "=== $run (limit ${limit} s)"
  if [ "$run" = proxy-te-mla-fused-mixed ]; then
    # the machine as it is: the loader's cache (apt cuDNN 9.14) ahead of the pip cuDNN 9.19
    ( export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/local/nvidia/lib
      timeout $limit python3 -m trainer.train $(overrides "$run") hydra.run.dir="$runs/$run" > "$runs/$run.out" 2>&1 )
    rc=$?
  elif [ "$run" = bare-mla ]; then
    # the same model as proxy-te-mla, by a Megatron-LM script that uses nothing of the bundle
    argv=$(python3 -c "import json; print(' '.join(json.load(open('$runs/proxy-te-mla/megatron.json'))['argv']))")
    # with the environment the worker's processes get (the recipe's env block, OMP threads). On 2026-12-01 the
    # bare script ran without it and 15% faster than the worker; which difference caused that is not established
    CUDA_DEVICE_MAX_CONNECTIONS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=4 \
    PYTHONPATH="/tmp/site:$MEGATRON_LM_PATH:$MILES_PATH" timeout $limit python3 -m torch.distributed.run --nproc-per-node 1 \
      --master-addr 127.0.0.1 --master-port 29511 bench/megatron_bare.py --rows /tmp/rows/rows-4096/rows.parquet \
      --out "$runs/bare-mla.jsonl" $argv > "$runs/bare-mla.out" 2>&1
    rc=$?
  else
    timeout $limit python3 -m trainer.train $(overrides "$run") hydra.run.dir="$runs/$run" > "$runs/$run.out" 2>&1
    rc=$?
  fi
  echo "$run rc=$rc wall=$(( $(date +%s) - start ))s"
  tail -n 3 "$runs/$run.out"
  if [ $rc -ne 0 ]; then
    grep -E "Error|File \"/tmp/src" "$runs/$run/logs/rank-0.log" 2>/dev/null | grep -v -i "warn" | tail -n 8
    grep -E "Error|error" "$runs/$run.out" | tail -n 4
  fi
done
