"""``trainer recipe RUN_DIR [--reference RUN_DIR]``: a run as a recipe YAML, validated against the schema.

The recipe has the seed's form (``schema_version: 1``; model, gpu, author, status, stack, workload,
layout, result, correctness, env, patches, run), documented field by field in
``schema/recipe.schema.yaml`` (JSON Schema written as YAML). Where each block comes from:

* ``gpu``, ``workload``, ``layout``, ``env``: the run's resolved ``config.yaml``;
* ``stack``: the run record's observed versions and image digest where present (``record.json`` keys
  ``observed``/``observed_versions`` and ``image_digest``/``image.digest``), else the config's pins
  (said so in ``stack.source``), with the sha256 of the lockfiles from the record;
* ``result``: :mod:`trainer.report.report` (rounded as the seed rounds: 2 decimals, MFU 4);
* ``correctness``: the numerics comparison of the two configs and :func:`trainer.report.convergence.check`
  against ``--reference`` (without one: ``not-checked``, status ``measured``);
* ``run``: the run directory's ``command.sh`` (the exact launch).

``trainer recipe --validate FILE ...`` validates existing recipe YAMLs. Exit codes: 0 written (or valid),
1 invalid recipe (``--validate``), 2 refused input.
"""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from trainer import REPO_ROOT
from trainer.compose import checks, numerics
from trainer.compose.render import render
from trainer.errors import UserError
from trainer.inputs import read_text, read_yaml, reading
from trainer.publish import atomic_write
from trainer.record.rundir import COMMAND, METRICS
from trainer.report.convergence import check, load_thresholds
from trainer.report.report import build_summary
from trainer.report.run import Run, load_run

if TYPE_CHECKING:
    from trainer.report.convergence import Verdict

SCHEMA_PATH = REPO_ROOT / "schema" / "recipe.schema.yaml"


def load_schema(path: Path = SCHEMA_PATH) -> dict[str, Any]:
    """The recipe JSON Schema (a dict) from its YAML file, itself checked against the 2020-12 meta-schema."""
    import jsonschema

    schema = yaml.safe_load(path.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


def _plain(obj: Any) -> Any:
    """YAML dates and timestamps as ISO strings (JSON Schema has no date type)."""
    if isinstance(obj, (dt.date, dt.datetime)):
        return obj.isoformat()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_plain(v) for v in obj]
    return obj


def validation_errors(recipe: Any, schema: dict[str, Any] | None = None) -> list[str]:
    """Every schema violation of a recipe, one line each (``field.path: message``); empty when valid."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema or load_schema())
    errors = sorted(validator.iter_errors(_plain(recipe)), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors]


def validate_recipe(recipe: Any, name: str = "recipe") -> None:
    """Raise :class:`UserError` naming the first invalid field of ``recipe`` (and how many more there are)."""
    errors = validation_errors(recipe)
    if errors:
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise UserError(f"{name}: {errors[0]}{more} (schema/recipe.schema.yaml)")


# ---------------------------------------------------------------------------------------------- blocks


def stack_block(run: Run) -> dict[str, Any]:
    """The ``stack:`` block: observed versions and image digest from the record, else the config's pins."""
    record: Mapping[str, Any] = run.record or {}
    observed = record.get("observed") or record.get("observed_versions") or {}
    cluster = run.train_config.cluster
    pins = run.train_config.stack
    image = record.get("image")
    if not isinstance(image, dict):
        image = {}
    digest = record.get("image_digest") or image.get("digest")

    def pick(*names: str, default: str = "") -> str:
        for n in names:
            if isinstance(observed, dict) and observed.get(n):
                return str(observed[n])
        return default

    source = (
        "observed inside the run's environment (record.json)"
        if observed
        else "pinned versions of the run's config (conf/stack, lockfiles/stack.json); not observed by the run"
    )
    block = {
        "framework": pick("miles", "framework", default=f"miles commit {pins.miles_commit[:8]}"),
        "megatron_lm": pick(
            "megatron_lm",
            "megatron-lm",
            default=f"Megatron-LM commit {pins.megatron_lm_commit[:8]} (megatron-core {pins.megatron_core})",
        ),
        "transformer_engine": pick("transformer_engine", "transformer-engine", default=pins.transformer_engine),
        "pytorch": pick("torch", "pytorch", default=pins.torch),
        "cuda": pick("cuda", default=pins.cuda),
        "nccl": pick("nccl", default=pins.nccl),
        "deepep": pick("deepep", "deep_ep", default=pins.deepep),
        "python": pick("python", default=pins.python),
        "network": f"{cluster.gpus_per_node} GPUs per node, {cluster.interconnect or 'unknown'}",
        "image_digest": digest if isinstance(digest, str) else None,
        "lock_sha256": record.get("locks") or {},
        "source": source,
    }
    return block


def workload_block(run: Run) -> dict[str, Any]:
    """The ``workload:`` block from the run's config: row length (tokens), rows, global batch (rows), precision
    and the dataset with its build (tokenizer, loss mask, hashes, parquet size in bytes).
    """
    d = run.train_config.data
    optim = run.train_config.optim
    b = d.build
    return {
        "row_tokens": d.seq_length,
        "rows": "SFT conversations" if optim.loss_type == "sft_loss" else optim.loss_type,
        "global_batch": optim.global_batch_size,
        "precision": "bf16" if optim.bf16 else "fp32",
        "dataset": {
            "name": d.dataset_name,
            "source": d.source,
            "revision": d.revision,
            "license": d.license,
            "rows_sha256": d.rows_sha256,
            "build": {
                "name": b.name,
                "tokenizer": f"{b.tokenizer} (revision {b.tokenizer_revision}; "
                f"tokenizer.json sha256 {b.tokenizer_sha256})",
                "loss_mask": b.loss_mask,
                "rows": b.rows,
                "row_tokens": b.row_tokens,
                "padding_tokens": b.padding_tokens,
                "seed": b.seed,
                "packing": b.packing,
                "supervised_token_ratio": b.supervised_token_ratio,
                "parquet_sha256": b.parquet_sha256,
                "parquet_bytes": b.parquet_bytes,
                "builder": b.builder,
            },
        },
    }


def layout_block(run: Run) -> dict[str, Any]:
    """The ``layout:`` block: TP/PP/VPP/CP/EP/ETP/DP sizes, layer split, recompute, dispatcher, offload and a
    one-line summary. DP and the per-stage layer split come from :func:`trainer.compose.checks.check`, which raises
    :class:`~trainer.errors.CheckError` for a layout that does not fit the model or cluster.
    """
    lay = run.train_config.layout
    par = checks.check(run.train_config)
    split = "/".join(map(str, par.stage_layers))
    parts = [f"TP {par.tensor_model_parallel_size}"]
    if par.pipeline_model_parallel_size > 1:
        pins = []
        if lay.decoder_first_pipeline_num_layers is not None:
            pins.append(f"first stage {lay.decoder_first_pipeline_num_layers} layers")
        if lay.decoder_last_pipeline_num_layers is not None:
            pins.append(f"last {lay.decoder_last_pipeline_num_layers}")
        parts.append(f"PP {par.pipeline_model_parallel_size} ({', '.join(pins) + ': ' if pins else ''}{split})")
    else:
        parts.append("PP 1")
    parts += [
        f"CP {par.context_parallel_size}",
        f"EP {par.expert_model_parallel_size}",
        f"ETP {par.expert_tensor_parallel_size}",
        f"DP {par.data_parallel_size}",
    ]
    if lay.sequence_parallel:
        parts.append("sequence parallel")
    rows = "one" if lay.micro_batch_size == 1 else str(lay.micro_batch_size)
    details = [
        f"{rows} {run.train_config.data.seq_length:,}-token row{'s' if lay.micro_batch_size > 1 else ''} "
        "per microbatch "
        f"({lay.qkv_format}, micro-batch size {lay.micro_batch_size})"
    ]
    if lay.recompute_granularity:
        details.append(
            f"{lay.recompute_granularity} recompute ({lay.recompute_method}, {lay.recompute_num_layers} layer"
            f"{'s' if (lay.recompute_num_layers or 1) > 1 else ''})"
        )
    else:
        details.append("no recompute")
    if lay.use_distributed_optimizer:
        details.append("distributed optimizer")
    details.append(f"{lay.moe_token_dispatcher_type} dispatcher")
    details.append(f"offload {lay.offload}" if lay.offload else "no offload")
    return {
        "label": lay.label,
        "summary": ", ".join(parts) + "; " + "; ".join(details),
        "highlights": None,
        "tp": par.tensor_model_parallel_size,
        "pp": par.pipeline_model_parallel_size,
        "vpp": lay.num_virtual_stages_per_pipeline_rank or 1,
        "cp": par.context_parallel_size,
        "ep": par.expert_model_parallel_size,
        "etp": par.expert_tensor_parallel_size,
        "dp": par.data_parallel_size,
        "sequence_parallel": lay.sequence_parallel,
        "layer_split": {"first": lay.decoder_first_pipeline_num_layers, "last": lay.decoder_last_pipeline_num_layers},
        "max_tokens_per_gpu": lay.max_tokens_per_gpu,
        "rows_per_microbatch": lay.micro_batch_size,
        "recompute": (
            {
                "granularity": lay.recompute_granularity,
                "method": lay.recompute_method,
                "num_layers": lay.recompute_num_layers,
            }
            if lay.recompute_granularity
            else None
        ),
        "offload": lay.offload,
        "dispatcher": lay.moe_token_dispatcher_type,
    }


def measured_date(run: Run) -> str:
    """YYYY-MM-DD of the run: the record's finish (or creation) time, else metrics.jsonl's modification date."""
    record: Mapping[str, Any] = run.record or {}
    times = record.get("times")
    for holder in (record, times if isinstance(times, dict) else {}):
        for key in ("finished_utc", "ended_utc", "created_utc"):
            value = holder.get(key)
            if isinstance(value, str) and len(value) >= 10:
                return value[:10]
    path = run.path / METRICS if run.path.is_dir() else run.path
    return dt.datetime.fromtimestamp(path.stat().st_mtime, dt.UTC).date().isoformat()


def result_block(run: Run, summary: dict[str, Any]) -> dict[str, Any]:
    """The ``result:`` block from a :func:`trainer.report.report.build_summary` ``summary``, rounded as the seed rounds
    (2 decimals; MFU 4, model TFLOP/s per GPU 1): tokens/s per GPU, USD per 1M tokens, step-time CV (%), MFU,
    peak FLOP/s, window (steps) and its tokens, GPU-hours, and the measured date (:func:`measured_date`).
    """
    cost = summary["usd_per_million_tokens"]
    return {
        "tokens_per_s_per_gpu": round(summary["tokens_per_s_per_gpu"], 2),
        "usd_per_million_tokens": None if cost is None else round(cost, 2),
        "step_time_cv_percent": round(summary["step_time_cv_percent"], 2),
        "mfu": None if summary["mfu"] is None else round(summary["mfu"], 4),
        "mfu_note": None if summary["mfu"] is not None else "no GPU in the run (CPU processes): no peak to divide by",
        "model_tflops_per_gpu": None
        if summary["model_tflops_per_gpu"] is None
        else round(summary["model_tflops_per_gpu"], 1),
        "active_params": {
            "count": summary["active_params"]["count"],
            "source": summary["active_params"]["source"],
            "revision": None,
        },
        "peak_flops": summary["peak_flops"]["value"],
        "measured": measured_date(run),
        "steps_per_run": summary["steps"],
        "window": summary["window"],
        "window_tokens": int(summary["window_tokens"]),
        "runs": 1,
        "profiler": False,
        "gpu_hours": round(summary["gpu_hours"], 2),
        "gpu_hours_note": summary["gpu_hours_note"],
    }


def correctness_block(run: Run, reference: Run | None, convergence: Verdict | None) -> dict[str, Any]:
    """The ``correctness:`` block. Without ``reference`` or ``convergence``: ``not-checked``. Else ``pass`` only
    when the convergence check passed and the configs are not numerics-different
    (:func:`trainer.compose.numerics.compare`; ``configuration`` is ``not-checked`` when the reference has no
    config), with the check's figures rounded.
    """
    if reference is None or convergence is None:
        return {
            "result": "not-checked",
            "summary": "no reference run given",
            "reference": "",
            "configuration": "not-checked",
            "component_tests": [],
            "convergence": None,
            "rules": "trainer recipe --reference RUN_DIR runs the convergence check",
        }
    verdict = numerics.compare(run.composition, reference.cfg) if reference.cfg is not None else None
    differing = ", ".join(f"{d.flag} {d.reference} -> {d.candidate}" for d in verdict.differences) if verdict else ""
    m = convergence["metrics"]
    configuration = "not-checked" if verdict is None else ("pass" if verdict.equivalent else "fail")
    passed = convergence["passed"] and configuration != "fail"
    th = convergence["thresholds"]
    return {
        "result": "pass" if passed else "fail",
        "summary": "passed"
        if passed
        else "failed: "
        + ", ".join(convergence["failed_checks"] + (["configuration"] if configuration == "fail" else [])),
        "reference": f"{reference.label} ({reference.path.name})"
        + (f"; differing arguments: {differing}" if differing else ""),
        "configuration": configuration,
        "component_tests": [],
        "convergence": {
            "steps": m["steps"],
            "result": convergence["result"],
            "correlation": None if m["correlation"] != m["correlation"] else round(m["correlation"], 5),
            "final_loss_difference": None
            if m["final_loss_difference"] != m["final_loss_difference"]
            else round(m["final_loss_difference"], 4),
            "pointwise_failures": m["pointwise_failures"],
            "note": f"candidate arm: {run.path.name}; reference arm: {reference.path.name}",
        },
        "rules": f"argument classes of trainer/compose/numerics.py; {m['steps']}-step check by Megatron-Bridge "
        f"validate_convergence with its {th['name']} thresholds (trainer/report/convergence.py: steps aligned by "
        "number, missing steps and NaN/Inf fail)",
    }


def build_recipe(
    run: Run,
    summary: dict[str, Any],
    reference: Run | None = None,
    convergence: Verdict | None = None,
    author: str = "unknown",
    author_url: str | None = None,
) -> dict[str, Any]:
    """The recipe of a run as plain data in the seed's key order (validate with :func:`validate_recipe`)."""
    cfg = run.train_config
    correctness = correctness_block(run, reference, convergence)
    status = {"pass": "verified", "fail": "failed"}.get(correctness["result"], "measured")
    if run.cpu_only and status == "verified":
        status = "measured"  # a CPU smoke run checks the bundle, not the recipe's GPU result
    command = run.path / COMMAND
    if command.is_file():
        script = read_text(command, "command.sh")  # 64 MiB at most, a FIFO refused
    else:
        script = render(run.composition).shell_script()
    return {
        "schema_version": 1,
        "model": cfg.model.display_name,
        "gpu": {
            # a run whose processes saw no GPU (the probe) says so rather than the cluster's GPU type
            "type": cfg.cluster.gpu_type if not run.cpu_only else "none (CPU processes)",
            "memory_gb": cfg.cluster.gpu_memory_gb,
            "count": cfg.cluster.nodes * cfg.cluster.gpus_per_node,
            "per_node": cfg.cluster.gpus_per_node,
            "instance": cfg.cluster.instance,
        },
        "author": {"name": author, "url": author_url},
        "status": status,
        "stack": stack_block(run),
        "workload": workload_block(run),
        "layout": layout_block(run),
        "result": result_block(run, summary),
        "correctness": correctness,
        "env": {k: str(v) for k, v in cfg.env.items()},
        "patches": [],
        "run": script,
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> Any:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)
# a choice field of the config (trainer.compose.schema: a StrEnum) is written as its value, as the str it is
_Dumper.add_multi_representer(enum.Enum, lambda dumper, value: _str(dumper, str(value.value)))


def dump_recipe(recipe: dict[str, Any], name: str) -> str:
    """The recipe as YAML text with the seed's header comment (key order kept, the launch as a literal block)."""
    body = yaml.dump(recipe, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=110)
    return f"# {name}\n# A recipe; the fields are documented in schema/recipe.schema.yaml.\n{body}"


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``trainer recipe`` (write a recipe from RUN_DIR, or ``--validate`` files)."""
    p = argparse.ArgumentParser(
        prog="trainer recipe",
        description="Write a run as a recipe YAML (the seed's format, schema/recipe.schema.yaml): "
        "result from the run's metrics, stack from its record, correctness from the convergence check against "
        "--reference. Or validate recipe YAMLs with --validate.",
    )
    p.add_argument("run_dir", nargs="?", type=Path, help="the run directory (config.yaml, record.json, metrics.jsonl)")
    p.add_argument("--reference", type=Path, metavar="RUN_DIR", help="reference run for the correctness block")
    p.add_argument("-o", "--output", type=Path, help="recipe file to write (default RUN_DIR/recipe.yaml)")
    p.add_argument("--author", default="unknown", help="author.name")
    p.add_argument("--author-url", help="author.url")
    p.add_argument("--window", metavar="FIRST:LAST", help="measured steps, inclusive (default 5:LAST-1)")
    p.add_argument(
        "--usd-per-node-hour", type=float, metavar="DOLLARS", help="price of one node (default: the config's)"
    )
    p.add_argument("--no-cost", action="store_true", help="usd_per_million_tokens: null (cluster without a price)")
    p.add_argument(
        "--thresholds", default="megatron-bridge-pipeline", metavar="NAME|FILE", help="convergence thresholds"
    )
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one convergence threshold")
    p.add_argument("--validate", nargs="+", type=Path, metavar="FILE", help="validate recipe YAML files and exit")
    p.add_argument("--json", action="store_true", help="print the recipe (or the validation result) as JSON")
    return p


def _validate_files(files: list[Path], as_json: bool) -> int:
    schema = load_schema()
    report = {}
    for path in files:
        with reading(path, unreadable=f"{path}: not readable"):
            data = read_yaml(path, "recipe file")
        report[str(path)] = validation_errors(data, schema)
    if as_json:
        print(json.dumps({"valid": not any(report.values()), "errors": report}, indent=2))
    else:
        for name, errors in report.items():
            print(f"{name}: " + ("valid" if not errors else f"{len(errors)} error(s)"))
            for e in errors:
                print(f"  {e}")
    return 1 if any(report.values()) else 0


def main(argv: list[str]) -> int:
    """Entry point of ``trainer recipe``."""
    args = parser().parse_args(argv)
    if args.validate:
        return _validate_files(args.validate, args.json)
    if args.run_dir is None:
        raise UserError("expected RUN_DIR (or --validate FILE ...)")
    run = load_run(args.run_dir, need_config=True)
    summary = build_summary(run, args.window, args.usd_per_node_hour, cost=not args.no_cost)
    reference = convergence = None
    if args.reference:
        thresholds = load_thresholds(args.thresholds, args.set)
        reference = load_run(args.reference, need_config=True)
        convergence = check(run.steps, reference.steps, thresholds)
    recipe = build_recipe(run, summary, reference, convergence, args.author, args.author_url)
    out = args.output or run.path / "recipe.yaml"
    validate_recipe(recipe, str(out))
    text = dump_recipe(recipe, out.name)
    atomic_write(out, text.encode())
    if args.json:
        print(json.dumps(recipe, indent=2))
    else:
        print(
            f"{out}: {recipe['status']} · {recipe['result']['tokens_per_s_per_gpu']} tokens/s/GPU · MFU "
            f"{recipe['result']['mfu']} · correctness {recipe['correctness']['result']}"
        )
    return 0
