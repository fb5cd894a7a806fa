#!/bin/bash
# recipe-bundle: TP2 PP4 EP8 DP8 on 8 x 8 H200 (p5en-8x8), written by `train launcher=slurm`.
# Run directory (shared by every node): RUN_DIR
#SBATCH --job-name=recipe-tp2pp4ep8
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --time=04:00:00
#SBATCH --output=RUN_DIR/logs/slurm-%j.out
#SBATCH --signal=B:TERM@120
#SBATCH --no-requeue
set -uo pipefail

RUN_DIR=RUN_DIR
PY=python3
IMAGE=registry.example/recipe-bundle@sha256:abababababababababababababababababababababababababababababababab
export RECIPE_BUNDLE_IMAGE_DIGEST=sha256:abababababababababababababababababababababababababababababababab
export PYTHONPATH=/opt/recipe-bundle-launcher${PYTHONPATH:+:$PYTHONPATH}
# every step runs in the image by digest; the steps of one node share a named container
CONTAINER=(--container-image="$IMAGE" --container-name="recipe-$SLURM_JOB_ID" --container-mounts=RUN_DIR:RUN_DIR,REPO/trainer:/opt/recipe-bundle-launcher/trainer:ro)
export RAY_USAGE_STATS_ENABLED=0 RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0 PYTHONUNBUFFERED=1

# variables the recipe's env and argv refer to (paths.*): set them before sbatch
for v in HF_CKPT KERNEL_CACHE SFT_DATA TORCH_DIST; do
  [ -n "${!v+x}" ] || { echo "sbatch.sh: $v is not set: export it before sbatch (paths.* refer to it)" >&2; exit 2; }
done
# the recipe's environment (env.json; as command.sh has it: a secret from the submitter's environment)
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TILELANG_CACHE_DIR="$KERNEL_CACHE/tilelang"
export TRITON_CACHE_DIR="$KERNEL_CACHE/triton"
export TORCHINDUCTOR_CACHE_DIR="$KERNEL_CACHE/inductor"
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1

# the job (job.json; the same command as command.sh unless launcher.job names another)
ARGV=(
  python3 train.py
  --actor-num-nodes 8
  --actor-num-gpus-per-node 8
  --num-gpus-per-node 8
  --disable-bias-linear
  --num-layers 43
  --hidden-size 4096
  --ffn-hidden-size 2048
  --num-attention-heads 64
  --normalization RMSNorm
  --position-embedding-type rope
  --norm-epsilon 1e-6
  --swiglu
  --untie-embeddings-and-output-weights
  --vocab-size 129280
  --hidden-dropout 0.0
  --attention-dropout 0.0
  --multi-latent-attention
  --q-lora-rank 1024
  --kv-lora-rank 512
  --qk-head-dim 512
  --qk-pos-emb-head-dim 64
  --v-head-dim 512
  --qk-layernorm
  --rotary-scaling-factor 16
  --rotary-base 10000
  --original-max-position-embeddings 65536
  --beta-fast 32
  --beta-slow 1
  --attention-softmax-in-fp32
  --no-rope-fusion
  --num-experts 256
  --moe-layer-freq '[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]'
  --moe-ffn-hidden-size 2048
  --moe-router-topk 6
  --moe-shared-expert-intermediate-size 2048
  --moe-router-pre-softmax
  --moe-router-score-function sqrtsoftplus
  --moe-router-enable-expert-bias
  --moe-router-load-balancing-type seq_aux_loss
  --moe-token-dispatcher-type alltoall
  --moe-aux-loss-coeff 0
  --moe-grouped-gemm
  --moe-router-topk-scaling-factor 1.5
  --experimental-attention-variant dsv4
  --dsv4-hc-mult 4
  --dsv4-hc-sinkhorn-iters 20
  --dsv4-compress-ratios 0 0 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 128 4 0
  --dsv4-compress-rope-theta 160000
  --dsv4-o-groups 8
  --dsv4-o-lora-rank 1024
  --dsv4-n-hash-layers 3
  --dsv4-window-size 128
  --dsa-indexer-n-heads 64
  --dsa-indexer-head-dim 128
  --dsa-indexer-topk 512
  --spec miles_plugins.models.deepseek_v4.deepseek_v4 get_dsv4_spec
  --activation-func-clamp-value 10
  --no-bias-swiglu-fusion
  --no-activation-func-clamp-shared-expert
  --hf-checkpoint "$HF_CKPT"
  --ref-load "$TORCH_DIST"
  --model-name deepseekv4
  --qkv-format bshd
  --moe-router-freeze-gate
  --freeze-e-score-correction-bias
  --rollout-function-path pretokenized_sft_rollout.generate_rollout
  --prompt-data "$SFT_DATA"
  --input-key messages
  --metadata-key metadata
  --num-rollout 20
  --rollout-batch-size 128
  --global-batch-size 128
  --loss-type sft_loss
  --calculate-per-token-loss
  --disable-compute-advantages-and-returns
  --debug-train-only
  --tensor-model-parallel-size 2
  --sequence-parallel
  --pipeline-model-parallel-size 4
  --decoder-first-pipeline-num-layers 11
  --decoder-last-pipeline-num-layers 10
  --context-parallel-size 1
  --expert-model-parallel-size 8
  --expert-tensor-parallel-size 1
  --recompute-granularity full
  --recompute-method uniform
  --recompute-num-layers 1
  --micro-batch-size 1
  --optimizer adam
  --lr 1e-5
  --lr-decay-style cosine
  --min-lr 1e-6
  --lr-warmup-fraction 0.1
  --weight-decay 0.1
  --adam-beta1 0.9
  --adam-beta2 0.98
  --use-distributed-optimizer
  --attention-dropout 0.0
  --hidden-dropout 0.0
  --accumulate-allreduce-grads-in-fp32
  --attention-softmax-in-fp32
  --distributed-timeout-minutes 30
)

mkdir -p "$RUN_DIR/logs" "$RUN_DIR/probes"
NODES=($(scontrol show hostnames "$SLURM_JOB_NODELIST"))
HEAD=${NODES[0]}
NODELIST=$(IFS=,; echo "${NODES[*]}")
on_head() { srun --overlap -N1 -n1 -w "$HEAD" "${CONTAINER[@]}" "$@"; }
mark() { on_head "$PY" -m trainer.launch.jobsteps mark "$RUN_DIR" "$@"; }
RAY_PIDS=()
STAGE=start
stop_ray() {
  [ ${#RAY_PIDS[@]} -gt 0 ] || return 0
  srun --overlap --ntasks-per-node=1 "${CONTAINER[@]}" bash -c \
    'mkdir -p "$0/logs/ray/$SLURMD_NODENAME" && cp -r "$1-$SLURMD_NODENAME"/session_latest/logs/. "$0/logs/ray/$SLURMD_NODENAME/"' \
    "$RUN_DIR" "$RAY_TMP" >> "$RUN_DIR/logs/gather.log" 2>&1
  kill -TERM "${RAY_PIDS[@]}" 2>/dev/null; wait "${RAY_PIDS[@]}" 2>/dev/null; RAY_PIDS=()
  srun --overlap --ntasks-per-node=1 "${CONTAINER[@]}" bash -c 'rm -rf "$0-$SLURMD_NODENAME"' "$RAY_TMP" >> "$RUN_DIR/logs/gather.log" 2>&1
}
on_term() { stop_ray; mark failed --stage "$STAGE" --reason "Slurm job $SLURM_JOB_ID got SIGTERM during $STAGE (time limit or scancel)"; exit 143; }
trap on_term TERM
mark running --job-id "$SLURM_JOB_ID" --nodes "$NODELIST"

# 1. the version probe on every node, inside the image; then every node must agree (preflight)
STAGE=preflight
srun --overlap --ntasks-per-node=1 "${CONTAINER[@]}" "$PY" -m trainer.probe --out "$RUN_DIR/probes/{node}.json" \
  > "$RUN_DIR/logs/probe.log" 2>&1
on_head "$PY" -m trainer.launch.preflight "$RUN_DIR/probes" --nodes "$NODELIST" --expect-gpus 8 --expect-digest sha256:abababababababababababababababababababababababababababababababab \
  --out "$RUN_DIR/preflight.json" > "$RUN_DIR/logs/preflight.log" 2>&1
rc=$?
cat "$RUN_DIR/logs/preflight.log"
if [ $rc -ne 0 ]; then mark failed --stage preflight --exit-code $rc; exit 1; fi

# 2. one Ray head on the first node, a Ray worker on every other node, each Ray node named as its Slurm node
STAGE=ray
HEAD_IP=$(srun --overlap -N1 -n1 -w "$HEAD" hostname -I | awk '{print $1}')
RAY_TMP=/tmp/ray-recipe-$SLURM_JOB_ID  # each node's Ray temp dir is $RAY_TMP-NODE (nodes may share a /tmp)
export RAY_TMP
# each Ray node's agents take free ports of its node (jobsteps ray-ports), not Ray's fixed defaults
srun --overlap -N1 -n1 -w "$HEAD" "${CONTAINER[@]}" bash -c \
  'exec ray start --head --block $("$0" -m trainer.launch.jobsteps ray-ports --head) "$@"' "$PY" --node-ip-address="$HEAD_IP" \
  --node-name="$HEAD" --port=6379 --dashboard-host=127.0.0.1 --dashboard-port=8265 --num-gpus=8 --temp-dir="$RAY_TMP-$HEAD" \
  > "$RUN_DIR/logs/ray-head.log" 2>&1 &
RAY_PIDS+=($!)
# the head first: worker nodes that start before its GCS answers may time out joining it
on_head "$PY" -m trainer.launch.jobsteps wait-dashboard http://127.0.0.1:8265 --timeout 300
rc=$?
if [ $rc -ne 0 ]; then stop_ray; mark failed --stage ray --exit-code $rc --reason "Ray head did not start: $(tail -n 1 "$RUN_DIR/logs/ray-head.log")"; exit 1; fi
if [ ${#NODES[@]} -gt 1 ]; then
  # the worker nodes in waves of 0 (0: all at once), each wave alive in the head's state API before the next
  WORKERS=("${NODES[@]:1}")
  WAVE=0
  [ "$WAVE" -gt 0 ] || WAVE=${#WORKERS[@]}
  for ((i = 0; i < ${#WORKERS[@]}; i += WAVE)); do
    PART=("${WORKERS[@]:i:WAVE}")
    # -n as well as -N: the step otherwise inherits the job's task count (SLURM_NTASKS), one more than its nodes
    srun --overlap -N${#PART[@]} -n${#PART[@]} -w "$(IFS=,; echo "${PART[*]}")" "${CONTAINER[@]}" bash -c \
      'exec ray start --block --address="$1" $("$0" -m trainer.launch.jobsteps ray-ports) --node-name="$SLURMD_NODENAME" --temp-dir="$RAY_TMP-$SLURMD_NODENAME" "${@:2}"' \
      "$PY" "$HEAD_IP:6379" --num-gpus=8 >> "$RUN_DIR/logs/ray-workers.log" 2>&1 &
    RAY_PIDS+=($!)
    [ 0 -gt 0 ] || break  # all at once: the job's entry waits for them (--expect-nodes)
    on_head "$PY" -m trainer.launch.jobsteps wait-dashboard http://127.0.0.1:8265 \
      --nodes $((1 + i + ${#PART[@]})) --timeout 300
    rc=$?
    if [ $rc -ne 0 ]; then stop_ray; mark failed --stage ray --exit-code $rc --reason "Ray worker nodes ${PART[*]} did not join: $(tail -n 1 "$RUN_DIR/logs/ray-workers.log")"; exit 1; fi
  done
fi

# 3. the job, submitted to that Ray cluster (the entry waits for every node, probes them through Ray, runs ARGV)
STAGE=job
# (a fresh head answers before its job agent is up: retry while it says so, up to 60 s)
for attempt in $(seq 20); do
  on_head ray job submit --address http://127.0.0.1:8265 --submission-id "recipe-$SLURM_JOB_ID" -- \
    "$PY" -m trainer.launch.ray_entry --probe --expect-nodes 8 --probe-timeout 300 --expect-gpus 8 --expect-digest sha256:abababababababababababababababababababababababababababababababab --workdir /root/miles \
    --argv-b64 "$(printf '%s\0' "${ARGV[@]}" | base64 -w0)" > "$RUN_DIR/logs/job.log" 2>&1 &
  wait $!
  JOB_RC=$?
  grep -q "No available agent to submit job" "$RUN_DIR/logs/job.log" || break
  sleep 3
done

# 4. gather the logs, stop Ray, record the result
STAGE=gather
stop_ray
if [ $JOB_RC -eq 0 ]; then mark complete --stage job --exit-code 0; else mark failed --stage job --exit-code $JOB_RC; fi
exit $JOB_RC
