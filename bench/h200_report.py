"""Summarise the run directories of bench/h200_bench.sh (runs.tgz unpacked): per run its status (the error line
of a failed one), and for a complete one the speed (``trainer report``), ``trainer verify`` against the stack
lock, the plan's memory estimate next to the measured peak, and which implementation, attention backend and
cuDNN libraries ran; the bare Megatron-LM baseline (``bare-mla.jsonl``) over the same step window; ``trainer
converge`` of the dsv4-tiny pair (2 vs 4 microbatches) and of the changed learning rate, where those ran.

Usage: python bench/h200_report.py RUNS_DIR OUT_DIR
Writes OUT_DIR/<run>/{summary,verify,probe,megatron,record}.json + metrics.jsonl (the record cut to status,
reason, sources, data manifest hash; no paths of the machine that ran it) and prints Markdown for
bench/RESULTS.md.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from megatron_h200_report import (  # type: ignore[import-not-found]  # a script beside it in bench/, not on mypy's path
    ROOT,
    trainer,
)  # the `trainer ... --json` runner (same folder)


def error_line(run: Path) -> str:
    """The last ``...Error: ...`` line of rank 0's log (where a failed run stopped), shortened."""
    log = run / "logs" / "rank-0.log"
    lines = (
        [
            line
            for line in log.read_text(errors="replace").splitlines()
            if line.startswith("[rank0]:") and re.search(r"\w+Error: ", line)
        ]
        if log.is_file()
        else []
    )
    return re.sub(r"^\[rank0\]:\s*", "", lines[-1])[:300] if lines else "no error line in the log"


def window_rate(rows: list, first: int, last: int) -> float:
    win = [r for r in rows if first <= r["step"] <= last]
    return sum(r["tokens"] for r in win) / sum(r["step_time_s"] for r in win)


def main() -> int:
    if len(sys.argv) != 3 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2
    runs, out = Path(sys.argv[1]), Path(sys.argv[2])
    table, failed, rates = [], [], {}
    for run in sorted(p for p in runs.iterdir() if (p / "record.json").is_file()):
        record = json.loads((run / "record.json").read_text())
        dest = out / run.name
        dest.mkdir(parents=True, exist_ok=True)
        kept = {k: record.get(k) for k in ("status", "reason", "sources", "megatron")}
        kept["reason"] = kept["reason"] and kept["reason"].split(" (/")[0]
        kept["data_manifest_rows_sha256"] = ((record.get("data") or {}).get("manifest") or {}).get("rows_sha256")
        if record["status"] != "complete":
            kept["error"] = error_line(run)
            failed.append(f"| {run.name} | {record['status']} | `{kept['error']}` |")
            (dest / "record.json").write_text(json.dumps(kept, indent=2, sort_keys=True) + "\n")
            continue
        _, summary = trainer("report", str(run), "--no-cost", "--json")
        ver_rc, ver = trainer("verify", str(run), "--lock", str(ROOT / "lockfiles" / "stack.json"), "--json")
        ver["lock"] = "lockfiles/stack.json"
        plan = json.loads((run / "plan.json").read_text())
        chosen = json.loads((run / "megatron.json").read_text())
        probe = record["probe"]["ranks"][0]
        for name, data in (
            ("summary.json", summary),
            ("verify.json", ver),
            ("probe.json", probe),
            ("megatron.json", chosen),
            ("record.json", kept),
        ):
            (dest / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        shutil.copyfile(run / "metrics.jsonl", dest / "metrics.jsonl")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        peak = max(r["max_memory_bytes"] for r in rows) / 1e9
        rates[run.name] = (summary["window"], summary["tokens_per_s_per_gpu"])
        ok = [r["component"] for r in ver["rows"] if r["verdict"] == "ok"]
        bad = [f"{r['component']} {r['verdict']}" for r in ver["rows"] if r["verdict"] in ("drift", "absent")]
        cudnn = sorted({re.sub(r".*/", "", p) for p in chosen.get("cudnn_loaded", []) if "libcudnn.so" in p})
        table.append(
            f"| {run.name} | {plan['model']} | {chosen['transformer_impl']} / {chosen['attention_backend']} | "
            f"{summary['tokens_per_s_per_gpu']:,.0f} | {summary['model_tflops_per_gpu']:.1f} | {summary['mfu']:.4f} | "
            f"{summary['step_time_cv_percent']:.1f}% | {rows[0]['lm_loss']:.3f} -> {rows[-1]['lm_loss']:.3f} | "
            f"{peak:.1f} | {plan['memory']['max_gb']:.1f} ({plan['memory']['max_gb'] / peak:.2f}) | "
            f"{', '.join(cudnn)} | ok: {len(ok)}; {', '.join(bad) or 'none drifted'} |"
        )
    print(
        "| run | model | impl / attention | tokens/s/GPU | model TFLOP/s/GPU | MFU | step-time CV | "
        "loss first -> last | peak GB | plan GB (ratio) | libcudnn.so loaded | verify (stack.json) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))
    bare = runs / "bare-mla.jsonl"
    if bare.is_file() and "proxy-te-mla" in rates:
        (first, last), worker = rates["proxy-te-mla"]
        rows = [json.loads(line) for line in bare.read_text().splitlines()]
        base = window_rate(rows, first, last)
        shutil.copyfile(bare, out / "bare-mla.jsonl")
        print(
            f"\nbare Megatron-LM script, same model (proxy-te-mla's argv), steps {first}..{last}: "
            f"{base:,.0f} tokens/s; "
            f"the bundle's worker {worker:,.0f} = {worker / base:.3f} of it"
        )
    # convergence on the V4 code: numerics-equivalent layouts must pass, a changed learning rate must fail.
    # (2 vs 4 microbatches of 4 / 2 rows stop in TileKernels 1.0.0's backward with more than one row per
    # microbatch, so on one GPU the pair is the distributed optimizer on and off, one row per microbatch.)
    pairs = (("tiny-mb2", "tiny-mb4"), ("tiny-mb4-lr", "tiny-mb4"), ("tiny-nodistopt", "tiny"), ("tiny-lr", "tiny"))
    for candidate, reference in pairs:
        if all(
            (runs / r / "metrics.jsonl").is_file() and (runs / r / "metrics.jsonl").stat().st_size
            for r in (candidate, reference)
        ):
            rc, conv = trainer("converge", str(runs / candidate), str(runs / reference), "--json")
            conv["candidate"], conv["reference"] = candidate, reference
            (out / f"converge-{candidate}-vs-{reference}.json").write_text(
                json.dumps(conv, indent=2, sort_keys=True) + "\n"
            )
            checks = ", ".join(
                f"{c['name']} {c['value']:.4g}" for c in conv["checks"] if isinstance(c.get("value"), float)
            )
            print(f"\ntrainer converge {candidate} against {reference}: {'pass' if rc == 0 else 'FAIL'} ({checks})")
    if failed:
        print("\n| run | status | where it stopped (rank 0) |\n|---|---|---|")
        print("\n".join(failed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
