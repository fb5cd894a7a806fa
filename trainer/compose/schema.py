"""Typed schema of a composed run: the structured configs behind ``conf/``.

Every group of ``conf/`` (model, layout, data, cluster, optim, throughput, stack, env, paths, launcher) is merged
into one of these dataclasses, so Hydra/OmegaConf reject unknown keys and values of the wrong type at
composition time, before any check or launch. Field names are Megatron-LM's argument names (the
``dest`` of ``megatron/training/arguments.py``: ``--disable-bias-linear`` is ``add_bias_linear: false``,
``--no-rope-fusion`` is ``apply_rope_fusion: false``) or, for miles-only flags, miles' own names, so
that ``trainer.compose.render`` maps fields to flags mechanically.

Units: sizes are counts (layers, heads, experts, tokens); memory in GB (1e9 bytes) where the name says
``_gb``; money in US dollars; times in minutes or hours where the name says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from trainer.compose.frozen import Record

# Choice fields: a closed set of values, spelled as Megatron-LM spells them (the ``choices`` of its argument, each
# member named by its value). OmegaConf 2.3 refuses ``typing.Literal`` in a structured config but types an ``Enum``
# field, so a value outside the set fails at composition (the error line: compose.describe_error); the typed
# config holds the member, a ``str`` equal to its value, rendered and written as before.


class Normalization(StrEnum):
    """Megatron ``--normalization``."""

    LayerNorm = "LayerNorm"
    RMSNorm = "RMSNorm"


class PositionEmbeddingType(StrEnum):
    """Megatron ``--position-embedding-type``."""

    learned_absolute = "learned_absolute"
    rope = "rope"
    mrope = "mrope"
    relative = "relative"
    none = "none"


class RecomputeGranularity(StrEnum):
    """Megatron ``--recompute-granularity``."""

    full = "full"
    selective = "selective"


class RecomputeMethod(StrEnum):
    """Megatron ``--recompute-method``."""

    uniform = "uniform"
    block = "block"


class MoeTokenDispatcherType(StrEnum):
    """Megatron ``--moe-token-dispatcher-type``."""

    allgather = "allgather"
    alltoall = "alltoall"
    flex = "flex"


class QkvFormat(StrEnum):
    """miles ``--qkv-format``: ``bshd`` (padded rows) or ``thd`` (packed)."""

    bshd = "bshd"
    thd = "thd"


class TransformerImpl(StrEnum):
    """``launcher.transformer_impl``: Megatron ``--transformer-impl`` (``local``, ``transformer_engine``) or
    ``auto`` (TransformerEngine when installed)."""

    auto = "auto"
    transformer_engine = "transformer_engine"
    local = "local"


class AttentionBackend(StrEnum):
    """Megatron ``--attention-backend`` (its ``AttnBackend`` enum), in the order the error line lists them."""

    unfused = "unfused"
    fused = "fused"
    flash = "flash"
    local = "local"
    auto = "auto"


@dataclass
class ModelConfig(Record):
    """Model shape and architecture flags (miles ``model_args_utils.py <model>`` plus ``--model-name``)."""

    name: str = MISSING  # config option name, e.g. deepseek-v4-flash
    display_name: str = MISSING  # the model as a recipe names it, e.g. DeepSeek-V4-Flash
    model_name: str = "deepseekv4"  # miles --model-name (selects the HF <-> Megatron converter)
    add_bias_linear: bool = True  # --disable-bias-linear sets false
    num_layers: int = MISSING  # decoder layers (the MTP layer is not counted)
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING  # dense MLP width
    num_attention_heads: int = MISSING
    normalization: Normalization = Normalization.RMSNorm
    position_embedding_type: PositionEmbeddingType = PositionEmbeddingType.rope
    norm_epsilon: float = 1e-6
    swiglu: bool = True
    untie_embeddings_and_output_weights: bool = True
    vocab_size: int = MISSING  # tokens in the tokenizer's id space
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    multi_latent_attention: bool = True
    q_lora_rank: int = MISSING
    kv_lora_rank: int = MISSING
    qk_head_dim: int = MISSING
    qk_pos_emb_head_dim: int = MISSING
    v_head_dim: int = MISSING
    qk_layernorm: bool = True
    rotary_scaling_factor: float = 16.0
    rotary_base: int = 10000
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_softmax_in_fp32: bool = True
    apply_rope_fusion: bool = False  # --no-rope-fusion sets false
    num_experts: int = MISSING  # routed experts per MoE layer
    moe_layer_freq: list[int] = MISSING  # 1 = MoE layer, 0 = dense, one entry per decoder layer
    moe_ffn_hidden_size: int = MISSING  # width of one routed expert
    moe_router_topk: int = MISSING  # routed experts per token
    moe_shared_expert_intermediate_size: int = MISSING  # width of the shared expert(s)
    moe_router_pre_softmax: bool = True
    moe_router_score_function: str = "sqrtsoftplus"
    moe_router_enable_expert_bias: bool = True
    moe_router_load_balancing_type: str = "seq_aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_grouped_gemm: bool = True
    moe_router_topk_scaling_factor: float = 1.5
    experimental_attention_variant: str = "dsv4"
    dsv4_hc_mult: int = 4  # hyper-connection streams: the residual stream is hc_mult x hidden_size wide
    dsv4_hc_sinkhorn_iters: int = 20
    dsv4_compress_ratios: list[int] = MISSING  # KV compression ratio per layer (+ the MTP layer)
    dsv4_compress_rope_theta: float = 160000.0
    dsv4_o_groups: int = 8
    dsv4_o_lora_rank: int = 1024
    dsv4_n_hash_layers: int = 3
    dsv4_window_size: int = 128  # tokens of the sliding attention window
    dsa_indexer_n_heads: int = 64
    dsa_indexer_head_dim: int = 128
    dsa_indexer_topk: int = 512  # compressed KV entries each query attends to
    spec: list[str] = field(default_factory=lambda: ["miles_plugins.models.deepseek_v4.deepseek_v4", "get_dsv4_spec"])
    activation_func_clamp_value: float = 10.0
    bias_swiglu_fusion: bool = False  # --no-bias-swiglu-fusion sets false
    activation_func_clamp_shared_expert: bool = False  # --no-activation-func-clamp-shared-expert sets false
    mtp_num_layers: int = 1  # multi-token-prediction layers (not rendered: miles reads them from the checkpoint)
    source: str = ""  # where the shapes were read


@dataclass
class LayoutConfig(Record):
    """How the model is spread over GPUs (Megatron parallelism, recompute, optimizer sharding)."""

    name: str = MISSING  # config option name, e.g. tp2pp4ep8
    label: str = MISSING  # e.g. "TP2 PP4 EP8 DP8"
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False
    pipeline_model_parallel_size: int = 1
    num_virtual_stages_per_pipeline_rank: int | None = None  # interleaved (virtual) pipeline stages per rank; null = 1
    decoder_first_pipeline_num_layers: int | None = None  # layers on the first stage; null = even split
    decoder_last_pipeline_num_layers: int | None = None  # layers on the last stage; null = even split
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1
    data_parallel_size: int | None = None  # expected DP; checked against world / (TP x PP x CP)
    micro_batch_size: int = 1  # rows per microbatch
    recompute_granularity: RecomputeGranularity | None = None  # null = no recompute
    recompute_method: RecomputeMethod | None = None  # needed with full recompute
    recompute_num_layers: int | None = None
    use_distributed_optimizer: bool = True
    moe_token_dispatcher_type: MoeTokenDispatcherType = MoeTokenDispatcherType.alltoall
    qkv_format: QkvFormat = QkvFormat.bshd  # miles --qkv-format
    max_tokens_per_gpu: int | None = None  # miles dynamic batching budget; null = off
    offload: str | None = None  # CPU offload of optimizer/activations; null = none


@dataclass
class DatasetBuild(Record):
    """How the fixed-row dataset was built (the recipe's ``workload.dataset.build``)."""

    name: str = MISSING
    tokenizer: str = MISSING  # tokenizer name and revision
    tokenizer_revision: str = MISSING
    tokenizer_sha256: str = MISSING  # sha256 of tokenizer.json
    loss_mask: str = MISSING  # named loss-mask convention, e.g. deepseek_v4
    rows: int = MISSING
    row_tokens: int = MISSING  # tokens per row
    padding_tokens: int = 0
    seed: int = 42  # permutation seed
    packing: str = ""
    supervised_token_ratio: float = MISSING
    parquet_sha256: str = MISSING
    parquet_bytes: int = MISSING
    builder: str = ""


@dataclass
class DataConfig(Record):
    """The training rows (the recipe's ``workload.dataset`` plus how miles reads them)."""

    name: str = MISSING  # config option name
    dataset_name: str = MISSING  # e.g. Tulu 3 SFT mixture
    source: str = MISSING  # e.g. allenai/tulu-3-sft-mixture
    revision: str = MISSING
    license: str = MISSING
    rows_sha256: str = MISSING
    build: DatasetBuild = field(default_factory=DatasetBuild)
    seq_length: int = MISSING  # tokens per row the model sees; must equal build.row_tokens
    input_key: str = "messages"  # miles --input-key
    metadata_key: str = "metadata"  # miles --metadata-key
    rollout_function_path: str = "pretokenized_sft_rollout.generate_rollout"  # miles --rollout-function-path
    synthetic_conversations: int | None = None  # local runs: generate this many conversations and build rows
    synthetic_seed: int = 0  # seed of the generated conversations (trainer.data.synthetic)


@dataclass
class ClusterConfig(Record):
    """Where the run goes: nodes, GPUs, price."""

    name: str = MISSING
    nodes: int = 1
    gpus_per_node: int = 1
    gpu_type: str = "H200"
    gpu_memory_gb: float = 141.0  # usable memory per GPU, GB (1e9 bytes)
    gpu_peak_bf16_flops: float = 989e12  # dense bf16 FLOP/s per GPU (H200 SXM; torchtitan's figure)
    instance: str = ""
    interconnect: str = ""
    usd_per_node_hour: float | None = None  # on-demand price of one node
    price_source: str = ""
    partition: str | None = None  # Slurm partition
    account: str | None = None  # Slurm account
    # bandwidth per GPU and direction, GB/s (1e9 bytes), for the throughput prediction (trainer/compose/predict.py);
    # null = not stated, no prediction
    nvlink_gb_s: float | None = None  # within a node
    network_gb_s: float | None = None  # between nodes (the node's NICs shared by its GPUs)


@dataclass
class ThroughputConfig(Record):
    """Measured compute times that the throughput prediction scales to a layout (``conf/throughput/``,
    trainer/compose/predict.py). Times are seconds per microbatch of ``micro_batch_size`` rows of ``seq_length``
    tokens on one GPU of ``gpu_type`` holding a whole layer's dense weights and ``experts`` routed experts that
    receive every token's top-k (the work that TP ranks of a layout share); ``name: none`` = no prediction."""

    name: str = "none"
    source: str = ""  # where and when the times were measured (run directories, machine, date)
    gpu_type: str = ""
    model: str = ""  # the model config option whose layers were timed (model.name of the runs)
    hidden_size: int = 0
    seq_length: int = 0
    micro_batch_size: int = 1
    experts: int = 0  # routed experts on the timed GPU (a layout applies where num_experts / EP is this)
    shapes: dict[str, Any] = field(default_factory=dict)  # model.<field> -> value of the timed layers (hidden
    # sizes, heads, experts' sizes and top-k, hyper-connections, vocabulary): a model that differs in any is refused
    layer_s: dict[str, float] = field(default_factory=dict)  # one decoder layer (forward, recompute, backward) by
    # its compress ratio ("0", "4", "128")
    head_s: float = 0.0  # the output layer and cross entropy (forward and backward); the MTP layer has one too
    optimizer_s_per_gparam: float = 0.0  # the optimizer step (grad norm, clip, Adam) per 1e9 parameters on the GPU
    reference_layout: str = ""  # the layout of the recipe's measured run
    reference_tokens_per_s_per_gpu: float | None = None  # the recipe's measured throughput (its card)
    validated_error: float | None = None  # (predicted - measured) / measured for reference_layout, from
    # bench/throughput_fit.py's runs; tests/test_predict.py checks it against the prediction


@dataclass
class OptimConfig(Record):
    """Optimizer, schedule, batch and loss (all numerics-affecting)."""

    optimizer: str = "adam"
    lr: float = 1e-5
    lr_decay_style: str = "cosine"
    min_lr: float = 1e-6
    lr_warmup_fraction: float = 0.1
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    global_batch_size: int = 128  # rows per optimizer step
    num_rollout: int = 20  # miles: optimizer steps of an SFT run (one rollout = one global batch)
    rollout_batch_size: int = 128  # miles: rows per rollout
    loss_type: str = "sft_loss"
    calculate_per_token_loss: bool = True
    moe_router_freeze_gate: bool = True  # miles/Megatron fork: router gate weights get no update
    freeze_e_score_correction_bias: bool = True  # expert score-correction bias gets no update
    accumulate_allreduce_grads_in_fp32: bool = True
    bf16: bool = True  # precision of the run (miles default; CPU runs compute in float32)
    clip_grad: float = 1.0  # Megatron --clip-grad (its default; the recipe keeps it)


@dataclass
class StackConfig(Record):
    """The pins of the recipe's ``stack:`` block; ``lockfile`` holds them with sources and hashes."""

    lockfile: str = MISSING  # path relative to the repository root
    miles_commit: str = MISSING
    megatron_lm_commit: str = MISSING
    megatron_core: str = MISSING
    transformer_engine: str = MISSING
    torch: str = MISSING
    cuda: str = MISSING
    nccl: str = MISSING
    deepep: str = MISSING
    aws_ofi_nccl: str = MISSING
    python: str = MISSING


@dataclass
class PathsConfig(Record):
    """Locations the launch refers to; ``$VAR`` values stay symbolic and are expanded on the cluster."""

    hf_checkpoint: str = "$HF_CKPT"  # miles --hf-checkpoint
    ref_load: str = "$TORCH_DIST"  # miles --ref-load (Megatron torch_dist checkpoint)
    prompt_data: str = "$SFT_DATA"  # miles --prompt-data (the fixed rows)
    kernel_cache: str = "$KERNEL_CACHE"  # root of the JIT kernel caches


@dataclass
class LauncherConfig(Record):
    """How the composed run is executed; ``plan`` writes the plan and launches nothing."""

    name: str = "plan"
    distributed_timeout_minutes: int = 30  # --distributed-timeout-minutes
    debug_train_only: bool = True  # miles --debug-train-only: no rollout engine, train only
    disable_compute_advantages_and_returns: bool = True  # miles: SFT has no advantages
    entrypoint: list[str] = field(default_factory=lambda: ["python3", "train.py"])  # run in the miles checkout
    reference_layout: str = "tp8pp8ep8"  # layout the numerics verdict compares against
    submit: bool = False
    seed: int = 1234  # Megatron --seed (its default): model init and data order of executed local runs
    steps: int | None = None  # optimizer steps of an executed run; null = optim.num_rollout
    save_interval: int = (
        0  # Megatron --save-interval: CPU worker checkpoints every N steps (0: none), RUN_DIR/checkpoints
    )
    # cluster launchers (slurm, ray, local-image; trainer/launch/)
    image: str | None = (
        None  # the job's image pinned by digest: NAME@sha256:<64 hex> (slurm, ray); sha256:<hex> (local-image)
    )
    image_layout: str | None = None  # local-image: OCI image layout directory holding `image`
    container: str = "pyxis"  # slurm: pyxis (srun --container-image) | none (the nodes' own environment)
    container_mounts: list[str] = field(default_factory=list)  # slurm/pyxis: SRC:DST[:ro] mounts (checkpoints, data)
    time_limit: str = "04:00:00"  # slurm --time (D-HH:MM:SS or HH:MM:SS)
    gpus_flag: str = "gpus-per-node"  # slurm: gpus-per-node (--gpus-per-node=N) | gres (--gres=gpu:N) | none
    sbatch_args: list[str] = field(default_factory=list)  # extra #SBATCH lines, e.g. [--qos=high, --exclusive]
    ray_port: int = 6379  # Ray GCS port on the head node
    dashboard_port: int = 8265  # Ray dashboard (job submission) port on the head node
    ray_start_args: list[str] = field(default_factory=list)  # slurm: extra `ray start` arguments (head and workers)
    # slurm: Ray worker nodes started together, each wave joined (alive in the head's state API) before the next
    # starts; 0 = all at once. 1 on hosts that run several nodes on few cores (the test clusters): a raylet whose
    # agents start slower than it waits for their port files (ray 2.60: about 15 s, fixed) exits
    ray_join_wave: int = 0
    head_ip: str | None = None  # slurm: address Ray binds on the head node; null = as launcher.node_address says
    # slurm: each node's Ray address: interface (the head's first `hostname -I` address; Ray's own choice on the
    # others) | hostname (`hostname -i` on every node: what its host name resolves to; the test clusters' nodes)
    node_address: str = "interface"
    address: str | None = None  # ray: job submission address of an existing cluster, http://HOST:8265
    python: str | None = None  # interpreter on the nodes; null = python3 (in an image), this Python (container none)
    # directory the job starts in on the cluster (the image's miles checkout, /root/miles, in conf/launcher/)
    workdir: str | None = None  # null = as started
    job: list[str] = field(
        default_factory=list
    )  # argv to run instead of the plan's miles launch (probe-only/smoke jobs)
    # ray, slurm: what the job trains: miles (the plan's miles launch, or launcher.job) | cpu (the tiny model's CPU
    # worker, one Ray actor per slot: trainer.launch.ray_workers; for clusters without GPUs, e.g. the test clusters)
    payload: str = "miles"
    expect_gpus: bool = True  # preflight: every node must see cluster.gpus_per_node GPUs
    node_wait_s: int = 300  # ray, slurm: seconds the job waits for cluster.nodes nodes to join (and each probe)
    wait_s: int | None = None  # ray: seconds to wait for the job; null = until it ends
    master_port: int | None = None  # torchrun port on 127.0.0.1 (local-megatron); null = a free one (launch.ports)
    # local-megatron: the Megatron-LM and miles sources (checkouts of the locked commits, verified by git tree hash)
    megatron_lm_path: str | None = None  # Megatron-LM checkout; null = $MEGATRON_LM_PATH
    miles_path: str | None = None  # miles checkout; null = $MILES_PATH
    transformer_impl: TransformerImpl = TransformerImpl.auto  # Megatron --transformer-impl (auto: TE when installed)
    attention_backend: AttentionBackend = AttentionBackend.unfused  # Megatron --attention-backend
    profile_step: int | None = None  # local-megatron: run this step under torch.profiler (top kernels table)


@dataclass
class TrainConfig(Record):
    """A whole run: one option per config group plus overrides (``conf/train.yaml``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    stack: StackConfig = field(default_factory=StackConfig)
    env: dict[str, str] = field(default_factory=dict)  # environment of every training process
    paths: PathsConfig = field(default_factory=PathsConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


def register() -> None:
    """Register :class:`TrainConfig` in Hydra's ConfigStore as ``train_schema``.

    ``conf/train.yaml`` lists ``train_schema`` first in its defaults, so every group option is merged
    into a typed node: unknown keys and values of the wrong type fail at composition.
    """
    global _REGISTERED
    if not _REGISTERED:  # storing converts the dataclass tree to a config: once per process is enough
        ConfigStore.instance().store(name="train_schema", node=TrainConfig)
        _REGISTERED = True


_REGISTERED = False


def as_dict(node: Any, resolve: bool = True) -> dict[str, Any]:
    """A mapping node of a composition (a ``DictConfig``) as plain Python data (``OmegaConf.to_container``),
    interpolations resolved unless ``resolve`` is false. Raises :class:`TypeError` when ``node`` is not a mapping
    (a list, a value, None), and what resolving raises."""
    from omegaconf import OmegaConf

    data = OmegaConf.to_container(node, resolve=resolve)
    if not isinstance(data, dict):
        raise TypeError(f"as_dict: a {type(data).__name__}, not a mapping")
    return {str(key): value for key, value in data.items()}


def to_object(cfg: Any) -> TrainConfig:
    """Turn a composed DictConfig into a :class:`TrainConfig` instance (raises OmegaConf errors on MISSING)."""
    from omegaconf import OmegaConf

    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, TrainConfig)
    return obj
