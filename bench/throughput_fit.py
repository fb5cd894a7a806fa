"""Fit the compute times of DeepSeek-V4-Flash's layers from the H200 stage-slice runs (conf/throughput/).

Input: run directories of ``experiment=dsv4-flash-slice-h200`` with 2 to 5 layers and 4 or 8 microbatches, as
bench/h200_report.py keeps them (``config.yaml``, ``metrics.jsonl``, ``plan.json``). Model of one step, in seconds:

    T = m x (B + n4 x t4 + n128 x t128) + o x P / 1e9

m microbatches, n4 and n128 the layers of compress ratio 4 and 128 beyond the first two (ratio 0 in every slice),
B the per-microbatch time of the two ratio-0 layers plus embedding, output layer and cross entropy, o the
optimizer step per 1e9 parameters on the GPU (P, plan.json). Least squares over the mean step time of each run
(steps 3 on: step 1 compiles tilelang kernels, step 2 allocates Adam's state). B is then split into the head and
two ratio-0 layers in proportion to their model FLOPs (trainer.report.metrics.model_flops_per_token: the head's
logits 3 x forward, a layer 4 x forward under full recompute) - an assumption, stated in the output.

Usage: python bench/throughput_fit.py RUN_DIR... [--json]
Prints the ``conf/throughput`` fields as YAML (or JSON), and the fit's residual per run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer.compose import schema  # noqa: E402
from trainer.report.metrics import model_flops_per_token  # noqa: E402

FIRST_STEP = 3  # steps before it: tilelang compiles (step 1), Adam's state is allocated (end of step 1)
# the model fields that make a layer's time (conf/throughput ``shapes``: trainer/compose/predict.py refuses a model
# that differs in any); the runs must agree on each
SHAPES = (
    "ffn_hidden_size num_attention_heads vocab_size multi_latent_attention q_lora_rank kv_lora_rank qk_head_dim "
    "qk_pos_emb_head_dim v_head_dim moe_ffn_hidden_size moe_router_topk moe_shared_expert_intermediate_size "
    "experimental_attention_variant dsv4_hc_mult dsv4_o_groups dsv4_o_lora_rank dsv4_window_size "
    "dsa_indexer_n_heads dsa_indexer_head_dim dsa_indexer_topk"
).split()


def load(run: Path) -> tuple[schema.TrainConfig, float, int]:
    """The run's typed config, its mean step time (seconds, steps >= FIRST_STEP) and parameters on its GPU."""
    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(schema.TrainConfig), OmegaConf.load(run / "config.yaml"))
    )
    assert isinstance(cfg, schema.TrainConfig)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [r["step_time_s"] for r in rows if r["step"] >= FIRST_STEP]
    if len(times) < 3:
        raise SystemExit(f"{run}/metrics.jsonl: fewer than 3 steps from step {FIRST_STEP}")
    params = json.loads((run / "plan.json").read_text())["memory"]["per_stage"][0]["params_per_gpu"]
    return cfg, statistics.mean(times), int(params)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows, targets, names, cfgs = [], [], [], []
    for run in args.runs:
        cfg, mean_s, params = load(run)
        ratios = list(cfg.model.dsv4_compress_ratios)[: cfg.model.num_layers]
        if ratios[:2] != [0, 0] or any(r not in (4, 128) for r in ratios[2:]):
            raise SystemExit(f"{run}: compress ratios {ratios}: expected 0, 0 then 4 or 128")
        m = cfg.optim.global_batch_size // cfg.layout.micro_batch_size
        rows.append([m, m * ratios[2:].count(4), m * ratios[2:].count(128), params / 1e9])
        targets.append(mean_s)
        names.append(run.name)
        cfgs.append(cfg)
    a, t = np.array(rows, dtype=float), np.array(targets)
    if np.linalg.matrix_rank(a) < 4:
        raise SystemExit("the runs do not determine the 4 unknowns: give 2 to 5 layers and two microbatch counts")
    (base, t4, t128, opt), *_ = np.linalg.lstsq(a, t, rcond=None)
    two = next(c for c in cfgs if c.model.num_layers == 2) if any(c.model.num_layers == 2 for c in cfgs) else None
    if two is None:
        raise SystemExit("a 2-layer run is needed to split B by FLOPs")
    flops = model_flops_per_token(two.model, two.data.seq_length)
    head_share = 3 * flops.logits / (3 * flops.logits + 4 * (flops.matmul + flops.attention))
    head, t0 = base * head_share, base * (1 - head_share) / 2
    ref = cfgs[0]
    shapes = {f: getattr(ref.model, f) for f in SHAPES}
    for cfg, name in zip(cfgs, names, strict=True):
        differ = [f for f in SHAPES if getattr(cfg.model, f) != shapes[f]]
        if differ:
            field_name = differ[0]
            raise SystemExit(
                f"{name}: model.{field_name} {getattr(cfg.model, field_name)}, the first run's {shapes[field_name]}"
            )
    out = {
        "layer_s": {"0": round(float(t0), 4), "4": round(float(t4), 4), "128": round(float(t128), 4)},
        "head_s": round(float(head), 4),
        "optimizer_s_per_gparam": round(float(opt), 4),
        "hidden_size": ref.model.hidden_size,
        "seq_length": ref.data.seq_length,
        "micro_batch_size": ref.layout.micro_batch_size,
        "experts": ref.model.num_experts,
        "shapes": shapes,
        "fit": {
            "base_s": round(float(base), 4),
            "head_share_of_base": round(head_share, 4),
            "runs": {
                n: {"measured_s": round(float(y), 4), "fit_s": round(float(f), 4)}
                for n, y, f in zip(names, t, a @ [base, t4, t128, opt], strict=True)
            },
        },
    }
    print(json.dumps(out, indent=1) if args.json else OmegaConf.to_yaml(OmegaConf.create(out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
