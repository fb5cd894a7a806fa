#!/usr/bin/env bash
set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
export TILELANG_CACHE_DIR="$KERNEL_CACHE/tilelang"
export TRITON_CACHE_DIR="$KERNEL_CACHE/triton"
export TORCHINDUCTOR_CACHE_DIR="$KERNEL_CACHE/inductor"
export FI_PROVIDER=efa
export FI_EFA_USE_DEVICE_RDMA=1

python3 train.py \
  --actor-num-nodes 1 \
  --actor-num-gpus-per-node 1 \
  --num-gpus-per-node 1 \
  --disable-bias-linear \
  --num-layers 2 \
  --hidden-size 64 \
  --ffn-hidden-size 128 \
  --num-attention-heads 4 \
  --normalization RMSNorm \
  --position-embedding-type rope \
  --norm-epsilon 1e-6 \
  --swiglu \
  --untie-embeddings-and-output-weights \
  --vocab-size 129280 \
  --hidden-dropout 0.0 \
  --attention-dropout 0.0 \
  --multi-latent-attention \
  --q-lora-rank 32 \
  --kv-lora-rank 16 \
  --qk-head-dim 16 \
  --qk-pos-emb-head-dim 8 \
  --v-head-dim 16 \
  --qk-layernorm \
  --rotary-scaling-factor 16 \
  --rotary-base 10000 \
  --original-max-position-embeddings 65536 \
  --beta-fast 32 \
  --beta-slow 1 \
  --attention-softmax-in-fp32 \
  --no-rope-fusion \
  --num-experts 4 \
  --moe-layer-freq '[1,1]' \
  --moe-ffn-hidden-size 32 \
  --moe-router-topk 2 \
  --moe-shared-expert-intermediate-size 32 \
  --moe-router-pre-softmax \
  --moe-router-score-function sqrtsoftplus \
  --moe-router-enable-expert-bias \
  --moe-router-load-balancing-type seq_aux_loss \
  --moe-token-dispatcher-type alltoall \
  --moe-aux-loss-coeff 0 \
  --moe-grouped-gemm \
  --moe-router-topk-scaling-factor 1.5 \
  --experimental-attention-variant dsv4 \
  --dsv4-hc-mult 2 \
  --dsv4-hc-sinkhorn-iters 20 \
  --dsv4-compress-ratios 0 4 \
  --dsv4-compress-rope-theta 160000 \
  --dsv4-o-groups 2 \
  --dsv4-o-lora-rank 16 \
  --dsv4-n-hash-layers 1 \
  --dsv4-window-size 16 \
  --dsa-indexer-n-heads 2 \
  --dsa-indexer-head-dim 8 \
  --dsa-indexer-topk 8 \
  --spec miles_plugins.models.deepseek_v4.deepseek_v4 get_dsv4_spec \
  --activation-func-clamp-value 10 \
  --no-bias-swiglu-fusion \
  --no-activation-func-clamp-shared-expert \
  --hf-checkpoint "$HF_CKPT" \
  --ref-load "$TORCH_DIST" \
  --model-name deepseekv4 \
  --qkv-format bshd \
  --moe-router-freeze-gate \
  --freeze-e-score-correction-bias \
  --rollout-function-path pretokenized_sft_rollout.generate_rollout \
  --prompt-data "$SFT_DATA" \
  --input-key messages \
  --metadata-key metadata \
  --num-rollout 20 \
  --rollout-batch-size 4 \
  --global-batch-size 4 \
  --loss-type sft_loss \
  --calculate-per-token-loss \
  --disable-compute-advantages-and-returns \
  --debug-train-only \
  --tensor-model-parallel-size 1 \
  --pipeline-model-parallel-size 1 \
  --context-parallel-size 1 \
  --expert-model-parallel-size 1 \
  --expert-tensor-parallel-size 1 \
  --recompute-granularity full \
  --recompute-method uniform \
  --recompute-num-layers 1 \
  --micro-batch-size 1 \
  --optimizer adam \
  --lr 0.003 \
  --lr-decay-style cosine \
  --min-lr 0.0003 \
  --lr-warmup-fraction 0.1 \
  --weight-decay 0.1 \
  --adam-beta1 0.9 \
  --adam-beta2 0.98 \
  --use-distributed-optimizer \
  --attention-dropout 0.0 \
  --hidden-dropout 0.0 \
  --accumulate-allreduce-grads-in-fp32 \
  --attention-softmax-in-fp32 \
  --distributed-timeout-minutes 30
