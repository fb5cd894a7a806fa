"""PNG plots of a run (matplotlib, Agg backend: no display needed).

* :func:`plot_step_times`: step time per step, the measured window shaded, its mean and CV in the title.
* :func:`plot_convergence`: LM loss per step of candidate and reference with the per-point tolerance band
  around the reference, the skipped steps greyed, failing points marked; below it the relative difference
  per step against its tolerance, so a glance says whether two runs agree.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeGuard

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from trainer.publish import atomic_write  # noqa: E402
from trainer.report.metrics import Step  # noqa: E402

if TYPE_CHECKING:
    from trainer.report.convergence import Verdict

CANDIDATE = "#1f77b4"
REFERENCE = "#ff7f0e"
FAIL = "#d62728"
PASS = "#2ca02c"


def _save(fig: Any, path: Path) -> None:
    buf = io.BytesIO()
    # a fixed "Software" key and no date keep the bytes stable across runs
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": "recipe-bundle"})
    plt.close(fig)
    atomic_write(Path(path), buf.getvalue())


def plot_step_times(
    steps: Sequence[Step], window: tuple[int, int], summary: dict[str, Any], path: Path, title: str = ""
) -> None:
    """Step time (s) per step with the window ``[first, last]`` shaded; writes a PNG to ``path``."""
    xs = [s.step for s in steps if s.step_time_s is not None]
    ys = [s.step_time_s for s in steps if s.step_time_s is not None]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.axvspan(window[0] - 0.5, window[1] + 0.5, color=PASS, alpha=0.12, label=f"window {window[0]}..{window[1]}")
    ax.plot(xs, ys, "o-", color=CANDIDATE, ms=4, lw=1.2, label="step time")
    mean = summary["step_time_mean_s"]
    ax.hlines(mean, window[0] - 0.5, window[1] + 0.5, colors=PASS, linestyles="--", label=f"window mean {mean:.3g} s")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("step time (s)")
    ax.set_ylim(bottom=0)
    head = title or "step time per step"
    ax.set_title(
        f"{head}\n{summary['tokens_per_s_per_gpu']:.2f} tokens/s/GPU · CV {summary['step_time_cv_percent']:.2f}%"
        f" (population) over steps {window[0]}..{window[1]}",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    _save(fig, path)


def plot_convergence(
    result: Verdict, path: Path, candidate_label: str = "candidate", reference_label: str = "reference"
) -> None:
    """Loss of candidate and reference per step (from a :func:`trainer.report.convergence.check` result dict).

    Top: both loss curves, the reference's tolerance band (reference x (1 ± tolerance)), skipped steps
    greyed, points outside the band marked. Bottom: relative difference |c - g| / |g| with the tolerance.
    Missing or non-finite points are marked on the x axis. Writes a PNG to ``path``.
    """
    points = result["points"]
    steps = [p["step"] for p in points]
    cand = [p["candidate"] for p in points]
    ref = [p["reference"] for p in points]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.6]})
    ok = result["passed"]
    colour = PASS if ok else FAIL
    skipped = [p["step"] for p in points if p["skipped"]]
    for ax in (top, bottom):
        if skipped:
            ax.axvspan(min(skipped) - 0.5, max(skipped) + 0.5, color="grey", alpha=0.15)
        ax.grid(alpha=0.3)

    def finite(v: float | None) -> TypeGuard[float]:
        return v is not None and math.isfinite(v)

    band = [
        (p["step"], reference, tolerance)
        for p in points
        if finite(reference := p["reference"]) and (tolerance := p["tolerance"]) is not None
    ]
    if band:
        bx = [b[0] for b in band]
        lo = [b[1] - abs(b[1]) * b[2] for b in band]
        hi = [b[1] + abs(b[1]) * b[2] for b in band]
        top.fill_between(bx, lo, hi, color=REFERENCE, alpha=0.18, step="mid", label="reference tolerance band")
    top.plot(steps, ref, "s-", color=REFERENCE, ms=3.5, lw=1.4, label=reference_label)
    top.plot(steps, cand, "o--", color=CANDIDATE, ms=3.5, lw=1.2, label=candidate_label)
    fails = [p for p in points if p["failed"]]
    if fails:
        top.plot(
            [p["step"] for p in fails],
            [p["candidate"] for p in fails],
            "x",
            color=FAIL,
            ms=9,
            mew=2,
            label=f"outside tolerance ({len(fails)})",
        )
    bad = [p["step"] for p in points if not (finite(p["candidate"]) and finite(p["reference"]))]
    if bad:
        for ax in (top, bottom):
            for b in bad:
                ax.axvline(b, color=FAIL, lw=1.5, alpha=0.6)
        top.plot([], [], color=FAIL, lw=1.5, label=f"missing / NaN / Inf ({len(bad)})")
    top.set_ylabel("LM loss")
    metrics = result["metrics"]
    corr = metrics.get("correlation")
    corr_text = f"{corr:.5f}" if corr is not None and math.isfinite(corr) else "n/a"
    top.set_title(
        f"convergence: {'PASS' if ok else 'FAIL'} · correlation {corr_text} · final-loss diff "
        f"{_fmt(metrics.get('final_loss_difference'))} · pointwise failures {metrics.get('pointwise_failures')}"
        f"/{metrics.get('points_checked')}",
        color=colour,
        fontsize=10,
    )
    top.legend(fontsize=8)
    rel = [(p["step"], p["relative_difference"], p["tolerance"]) for p in points if finite(p["relative_difference"])]
    if rel:
        bottom.plot(
            [r[0] for r in rel], [r[1] for r in rel], "o-", color=CANDIDATE, ms=3.5, lw=1.2, label="|c - g| / |g|"
        )
        bottom.step(
            [r[0] for r in rel], [r[2] for r in rel], where="mid", color=FAIL, lw=1.2, ls="--", label="tolerance"
        )
    bottom.set_ylim(bottom=0)
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_xlabel("step" + (" (grey: skipped by skip_first_percent_loss)" if skipped else ""))
    bottom.set_ylabel("relative diff")
    if rel:
        bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    _save(fig, path)


def _fmt(value: float | None) -> str:
    return f"{value:.4f}" if value is not None and math.isfinite(value) else "n/a"
