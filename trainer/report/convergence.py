"""The convergence check: does a candidate run's LM loss follow its reference's, step by step?

Megatron-Bridge's ``validate_convergence`` (``scripts/performance/utils/evaluate.py``), with the
thresholds its CI pipeline passes (``trainer/report/thresholds/megatron-bridge-pipeline.yaml``), on per-step LM
loss of a reference (golden) run g and a candidate run c (shared docs METRICS.md):

1. drop the first ``int(n x skip_first_percent_loss)`` aligned points;
2. Pearson correlation of the two series >= ``correlation_threshold``;
3. pointwise: |c - g| / |g| against a tolerance picked by g (``high_loss_tolerance`` if g >
   ``high_loss_above``, ``medium_loss_tolerance`` if g > ``medium_loss_above``, else
   ``low_loss_tolerance``); fails if failures / n > ``max_outlier_ratio``;
4. final loss: |c_last - g_last| / g_last <= ``final_loss_tolerance``;
5. outliers: residuals r = c - g; |r - mean(r)| > ``outlier_threshold`` x std(r) (population std, as
   numpy's default); fails if outliers / n > ``max_outlier_ratio``;

plus what that implementation lacks (it turns a missing step into NaN, and every comparison with NaN is
false, so a run with half its steps missing passes): here the two runs are aligned by step number, never
by position, and

6. every step of either run must be present in the other (``aligned``);
7. every loss must be finite (``finite_loss``; a step whose log line had no loss, a NaN or skipped
   Megatron iteration, has a NaN loss and fails here, named with its skipped/nan iteration counts);
8. every grad norm must be finite where logged (``finite_grad_norm``; the pipeline fails such runs too).

The run passes when every check passes. Checks 2-5 run on the steps present and finite in both, so their
values stay informative when 6-8 fail.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NotRequired, TypedDict, TypeGuard

import numpy as np
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.compose.numerics import VerdictRecord
from trainer.errors import UserError
from trainer.report.metrics import Step

CONF_DIR = Path(__file__).parent / "thresholds"  # the checker's own data, not a group of a run's composition
DEFAULT_THRESHOLDS = "megatron-bridge-pipeline"
MAX_POINTS = 20_000  # per-step points in a result; longer runs keep only failed or unmatched steps (points_omitted)


@dataclass
class Thresholds:
    """Thresholds of the check; defaults are Megatron-Bridge's CI pipeline values (fractions, not percent)."""

    name: str = DEFAULT_THRESHOLDS
    skip_first_percent_loss: float = 0.2  # fraction of aligned points dropped from the start (function default 0.0)
    correlation_threshold: float = 0.95  # minimum Pearson correlation
    high_loss_above: float = 2.0  # golden loss above this uses high_loss_tolerance
    high_loss_tolerance: float = 0.10
    medium_loss_above: float = 0.5  # golden loss above this (and not high) uses medium_loss_tolerance
    medium_loss_tolerance: float = 0.05
    low_loss_tolerance: float = 0.02
    max_outlier_ratio: float = 0.1  # max fraction of pointwise failures, and of 3-sigma outliers
    final_loss_tolerance: float = 0.05  # max relative difference of the last loss (function default 0.03)
    outlier_threshold: float = 3.0  # sigmas
    require_finite_grad_norm: bool = True

    def tolerance(self, golden: float) -> float:
        """The pointwise tolerance for a golden (reference) loss value."""
        if golden > self.high_loss_above:
            return self.high_loss_tolerance
        if golden > self.medium_loss_above:
            return self.medium_loss_tolerance
        return self.low_loss_tolerance


def load_thresholds(name_or_path: str = DEFAULT_THRESHOLDS, overrides: Sequence[str] = ()) -> Thresholds:
    """Thresholds from ``trainer/report/thresholds/NAME.yaml`` (or a YAML file path) with ``key=value`` overrides.

    Unknown keys and wrong types are refused (:class:`UserError`, one line naming the key).
    """
    path = Path(name_or_path)
    if not path.suffix:
        path = CONF_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        options = ", ".join(sorted(p.stem for p in CONF_DIR.glob("*.yaml")))
        raise UserError(f"--thresholds {name_or_path}: no such file or option (options: {options})")
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected KEY=VALUE (e.g. final_loss_tolerance=0.03)")
    try:
        base = OmegaConf.structured(Thresholds)
        merged = OmegaConf.merge(base, OmegaConf.load(path), OmegaConf.from_dotlist(list(overrides)))
        thresholds = OmegaConf.to_object(merged)
    except OmegaConfBaseException as ex:
        key = getattr(ex, "full_key", None)
        msg = (getattr(ex, "msg", None) or str(ex)).splitlines()[0]
        raise UserError(f"thresholds {path.name}: {msg}" + (f" (key: {key})" if key else "")) from None
    assert isinstance(thresholds, Thresholds)
    for f in dataclasses.fields(Thresholds):
        value = getattr(thresholds, f.name)
        if f.type in ("float", float) and (not math.isfinite(value) or value < 0):
            raise UserError(f"thresholds: {f.name} is {value}, expected a finite number >= 0")
    if thresholds.skip_first_percent_loss >= 1:
        raise UserError(f"thresholds: skip_first_percent_loss is {thresholds.skip_first_percent_loss}, expected < 1")
    return thresholds


class Check(TypedDict):
    """One check of a verdict: its ``name`` (``aligned``, ``finite_loss``, ``finite_grad_norm``, ``points``,
    ``correlation``, ``pointwise``, ``final_loss``, ``outliers``), the ``value`` found, the ``threshold`` it is held
    to, whether it ``passed`` and a line of ``text`` saying so."""

    name: str
    value: float
    threshold: float
    passed: bool
    text: str


class Point(TypedDict):
    """One step of a verdict: the candidate's and reference's LM loss (None where the run lacks the step), the
    pointwise ``tolerance`` and ``relative_difference`` (None unless both losses are finite), whether the step
    was ``skipped`` (the first fraction) and whether it ``failed`` its tolerance."""

    step: int
    candidate: float | None
    reference: float | None
    tolerance: float | None
    relative_difference: float | None
    skipped: bool
    failed: bool


class VerdictMetrics(TypedDict):
    """A verdict's figures: steps in either run, points compared, points skipped at the start, Pearson
    correlation (NaN below 2 points), pointwise failures, final loss relative difference (NaN without points)
    and residual outliers."""

    steps: int
    points_checked: int
    skipped: int
    correlation: float
    pointwise_failures: int
    final_loss_difference: float
    outliers: int


class Verdict(TypedDict):
    """What :func:`check` returns (``convergence.json``, NaN written as "NaN"): ``passed`` and ``result``
    (``pass``/``fail``), the names of the failed checks, every :class:`Check`, the :class:`VerdictMetrics`, the
    per-step :class:`Point` list (at most :data:`MAX_POINTS`, ``points_omitted`` the rest), the thresholds and the
    method; ``trainer converge`` adds the two runs' paths (``candidate``, ``reference``) and, when both have a
    config, the ``prediction`` of their numerics (:func:`trainer.compose.numerics.compare`)."""

    passed: bool
    result: str
    failed_checks: list[str]
    checks: list[Check]
    metrics: VerdictMetrics
    points: list[Point]
    points_omitted: int
    thresholds: dict[str, Any]
    method: str
    candidate: NotRequired[str]
    reference: NotRequired[str]
    prediction: NotRequired[VerdictRecord]


def _finite(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)


def _step_name(step: int, who: str, run: dict[int, Step]) -> str:
    reason = run[step].no_loss_reason
    return f"{who} step {step}" + (f" ({reason})" if reason else "")


def _rel(ok: bool, yes: str = "<=", no: str = ">") -> str:
    return yes if ok else no


def _check(name: str, value: float, threshold: float, passed: bool, text: str) -> Check:
    return {"name": name, "value": value, "threshold": threshold, "passed": bool(passed), "text": text}


def check(candidate: Sequence[Step], reference: Sequence[Step], thresholds: Thresholds | None = None) -> Verdict:
    """Compare two runs' per-step LM loss (see the module docstring); steps aligned by step number.

    Returns a JSON-ready dict (:class:`Verdict`): ``passed``, ``checks`` (name, value, threshold, passed, text
    for each), ``metrics`` (correlation, pointwise_failures, points_checked, final_loss_difference, outliers, ...),
    ``points`` (per step: candidate, reference, tolerance, relative_difference, skipped, failed),
    ``thresholds``. Raises :class:`UserError` only when either run has no steps.
    """
    th = thresholds or Thresholds()
    if not candidate or not reference:
        raise UserError("convergence check: a run without steps")
    cand = {s.step: s for s in candidate}
    ref = {s.step: s for s in reference}
    all_steps = sorted(set(cand) | set(ref))
    only_cand = [n for n in all_steps if n not in ref]
    only_ref = [n for n in all_steps if n not in cand]
    nonfinite_loss = [
        (n, who)
        for n in all_steps
        for who, run in (("candidate", cand), ("reference", ref))
        if n in run and not _finite(run[n].lm_loss)
    ]
    nonfinite_grad = [
        (n, who)
        for n in all_steps
        for who, run in (("candidate", cand), ("reference", ref))
        if n in run and (norm := run[n].grad_norm) is not None and not math.isfinite(norm)
    ]
    usable = [n for n in all_steps if n in cand and n in ref and _finite(cand[n].lm_loss) and _finite(ref[n].lm_loss)]
    skip = max(0, int(len(usable) * th.skip_first_percent_loss))
    kept = usable[skip:]
    c = np.array([cand[n].lm_loss for n in kept], dtype=np.float64)
    g = np.array([ref[n].lm_loss for n in kept], dtype=np.float64)
    n = len(kept)

    checks: list[Check] = []
    missing = [f"step {s} only in candidate" for s in only_cand] + [f"step {s} only in reference" for s in only_ref]
    checks.append(
        _check(
            "aligned",
            len(only_cand) + len(only_ref),
            0,
            not missing,
            "every step present in both runs"
            if not missing
            else f"{len(missing)} unmatched: " + ", ".join(missing[:5]),
        )
    )
    checks.append(
        _check(
            "finite_loss",
            len(nonfinite_loss),
            0,
            not nonfinite_loss,
            "no NaN/Inf loss"
            if not nonfinite_loss
            else "NaN/Inf loss at "
            + ", ".join(_step_name(s, who, cand if who == "candidate" else ref) for s, who in nonfinite_loss[:5]),
        )
    )
    if th.require_finite_grad_norm:
        checks.append(
            _check(
                "finite_grad_norm",
                len(nonfinite_grad),
                0,
                not nonfinite_grad,
                "no NaN/Inf grad norm"
                if not nonfinite_grad
                else "NaN/Inf grad norm at " + ", ".join(f"{who} step {s}" for s, who in nonfinite_grad[:5]),
            )
        )

    if n < 2:
        checks.append(_check("points", n, 2, False, f"{n} comparable point(s) after skipping {skip}: need at least 2"))
        correlation = float("nan")
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            correlation = float(np.corrcoef(c, g)[0, 1])
        checks.append(
            _check(
                "correlation",
                correlation,
                th.correlation_threshold,
                math.isfinite(correlation) and correlation >= th.correlation_threshold,
                f"Pearson r {correlation:.5f} {_rel(correlation >= th.correlation_threshold, '>=', '<')} "
                f"{th.correlation_threshold}"
                if math.isfinite(correlation)
                else "Pearson r undefined (a constant series)",
            )
        )

    points: list[Point] = []
    omitted = 0
    failures = 0
    kept_set = set(kept)
    skipped_set = set(usable[:skip])
    for step in all_steps:
        cv = cand[step].lm_loss if step in cand else None
        gv = ref[step].lm_loss if step in ref else None
        tol = th.tolerance(gv) if _finite(gv) else None
        rel = None
        if _finite(cv) and _finite(gv):
            rel = abs(cv - gv) / abs(gv) if gv != 0 else abs(cv)
        failed = step in kept_set and rel is not None and tol is not None and rel > tol
        failures += failed
        # a long run keeps the points that explain a failure, up to MAX_POINTS: the result stays bounded
        if len(points) >= MAX_POINTS or (len(all_steps) > MAX_POINTS and not failed and rel is not None):
            omitted += 1
            continue
        points.append(
            {
                "step": step,
                "candidate": cv,
                "reference": gv,
                "tolerance": tol,
                "relative_difference": rel,
                "skipped": step in skipped_set,
                "failed": bool(failed),
            }
        )
    ratio = failures / n if n else float("nan")
    if n:
        checks.append(
            _check(
                "pointwise",
                failures,
                th.max_outlier_ratio,
                ratio <= th.max_outlier_ratio,
                f"{failures}/{n} points outside tolerance "
                f"({ratio:.1%} {_rel(ratio <= th.max_outlier_ratio)} {th.max_outlier_ratio:.0%} allowed)",
            )
        )

    final_diff = float("nan")
    outliers = 0
    if n:
        final_diff = float(abs(c[-1] - g[-1]) / g[-1]) if g[-1] != 0 else float(abs(c[-1]))
        checks.append(
            _check(
                "final_loss",
                final_diff,
                th.final_loss_tolerance,
                final_diff <= th.final_loss_tolerance,
                f"step {kept[-1]}: |{c[-1]:.6g} - {g[-1]:.6g}| / {g[-1]:.6g} = {final_diff:.4f} "
                f"{_rel(final_diff <= th.final_loss_tolerance)} {th.final_loss_tolerance}",
            )
        )
        residuals = c - g
        outliers = int(np.sum(np.abs(residuals - residuals.mean()) > th.outlier_threshold * residuals.std()))
        checks.append(
            _check(
                "outliers",
                outliers,
                th.max_outlier_ratio,
                outliers / n <= th.max_outlier_ratio,
                f"{outliers}/{n} residuals beyond {th.outlier_threshold:g} sigma "
                f"({outliers / n:.1%} {_rel(outliers / n <= th.max_outlier_ratio)} {th.max_outlier_ratio:.0%} allowed)",
            )
        )

    passed = all(ch["passed"] for ch in checks)
    return {
        "passed": passed,
        "result": "pass" if passed else "fail",
        "failed_checks": [ch["name"] for ch in checks if not ch["passed"]],
        "checks": checks,
        "metrics": {
            "steps": len(all_steps),
            "points_checked": n,
            "skipped": skip,
            "correlation": correlation,
            "pointwise_failures": failures,
            "final_loss_difference": final_diff,
            "outliers": outliers,
        },
        "points": points,
        "points_omitted": omitted,
        "thresholds": dataclasses.asdict(th),
        "method": "Megatron-Bridge validate_convergence (scripts/performance/utils/evaluate.py) with steps aligned "
        "by number; missing steps and NaN/Inf loss or grad norm fail",
    }
