"""Numerics equivalence of two composed runs: which launch arguments differ, and can each change the function?

Two runs whose numerics-affecting arguments are equal compute the same function of the same data and
should pass the convergence check; differences only in layout (TP/PP/CP/EP/ETP/DP, sequence parallel,
recompute, micro-batching, dispatcher, offload, pipeline split), cluster size or kernel fusion change
speed and memory, not the function (shared docs METRICS.md, "Numerics vs performance arguments";
the recipe's correctness block classes arguments the same way). Everything else, model shapes, optimizer,
schedule, batch, loss, data, precision and the frozen-router flags, is numerics-affecting.

The comparison runs over the launch tables of :mod:`trainer.compose.render`, so every argument that reaches
miles is classed, and over the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict

from omegaconf import DictConfig

from trainer.compose.render import SECTIONS
from trainer.compose.schema import as_dict

PERFORMANCE = "performance"
NUMERICS = "numerics"

# Keys outside layout.* / cluster.* that change speed or memory only.
PERFORMANCE_KEYS = frozenset(
    {
        "model.moe_grouped_gemm",  # grouped GEMM kernel vs a loop over experts
        "model.apply_rope_fusion",  # fused RoPE kernel
        "model.bias_swiglu_fusion",  # fused bias + SwiGLU kernel
        "launcher.distributed_timeout_minutes",
    }
)
PERFORMANCE_PREFIXES = ("layout.", "cluster.", "launcher.")
# Keys that describe rather than configure (names, labels, provenance): never compared.
DESCRIPTIVE = frozenset(
    {"model.name", "model.display_name", "model.source", "layout.name", "layout.label", "data.name"}
)
# launcher.* keys that do change the function computed by an executed run.
LAUNCHER_NUMERICS = frozenset({"launcher.seed", "launcher.steps"})


def classify(key: str) -> str:
    """``performance`` or ``numerics`` for a dotted config key (see the module docstring)."""
    if key in LAUNCHER_NUMERICS:
        return NUMERICS
    if key in PERFORMANCE_KEYS or key.startswith(PERFORMANCE_PREFIXES):
        return PERFORMANCE
    return NUMERICS


# One difference as the plan and reports write it (``class``, a Python keyword, needs the functional form).
DifferenceRecord = TypedDict(
    "DifferenceRecord", {"flag": str, "key": str, "candidate": Any, "reference": Any, "class": str}
)


class VerdictRecord(TypedDict):
    """:meth:`Verdict.as_dict`: ``equivalent``, the ``verdict`` sentence and every difference."""

    equivalent: bool
    verdict: str
    differences: list[DifferenceRecord]


class NumericsVerdict(VerdictRecord):
    """The plan's ``numerics``: the verdict against ``launcher.reference_layout`` (an option of ``conf/layout``)."""

    reference_layout: str


@dataclass
class Difference:
    """One launch argument whose value differs between two compositions."""

    flag: str
    key: str
    candidate: Any
    reference: Any
    cls: str

    def as_dict(self) -> DifferenceRecord:
        """The difference as JSON-able data: ``flag``, ``key``, ``candidate``, ``reference``, ``class``."""
        return {
            "flag": self.flag,
            "key": self.key,
            "candidate": self.candidate,
            "reference": self.reference,
            "class": self.cls,
        }


@dataclass
class Verdict:
    """Result of :func:`compare`: ``equivalent`` is true when no numerics-affecting argument differs."""

    differences: list[Difference] = field(default_factory=list)

    @property
    def numerics_differences(self) -> list[Difference]:
        """The differences classed ``numerics`` (those that can change the function computed)."""
        return [d for d in self.differences if d.cls == NUMERICS]

    @property
    def equivalent(self) -> bool:
        """True when no numerics-affecting argument differs (performance differences are allowed)."""
        return not self.numerics_differences

    def as_dict(self) -> VerdictRecord:
        """The verdict as JSON-able data: ``equivalent`` (bool), ``verdict`` (one sentence naming the differing
        numerics arguments) and ``differences`` (:meth:`Difference.as_dict` each).
        """
        return {
            "equivalent": self.equivalent,
            "verdict": (
                "identical: no argument differs"
                if not self.differences
                else "numerics-equivalent: only performance arguments differ; the convergence check should pass"
                if self.equivalent
                else "numerics differ: "
                + ", ".join(d.flag for d in self.numerics_differences)
                + "; the convergence check may fail"
            ),
            "differences": [d.as_dict() for d in self.differences],
        }


def _value(data: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of the resolved container ``data`` (None where a key is absent, as
    ``OmegaConf.select`` gives it)."""
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of nested dicts; lists are leaves."""
    if not isinstance(data, dict):
        return {prefix[:-1]: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}{key}."))
    return out


def compare(candidate: DictConfig, reference: DictConfig) -> Verdict:
    """Compare two compositions argument by argument: every row of the launch tables, then every other config
    field (those no launch argument carries, named ``(key)``), then ``env``.

    Each key is compared once even where the launch restates it; names, labels and provenance are skipped.
    Returns a :class:`Verdict`.
    """
    verdict = Verdict()
    seen = set()
    data_a, data_b = as_dict(candidate), as_dict(reference)
    for _, rows in SECTIONS:
        for flag, key, _kind in rows:
            if key in seen:
                continue
            seen.add(key)
            a, b = _value(data_a, key), _value(data_b, key)
            if a != b:
                verdict.differences.append(Difference(flag, key, a, b, classify(key)))
    # Fields that reach no launch argument (e.g. optim.clip_grad, launcher.seed): compared as config keys.
    flat_a, flat_b = _flatten(data_a), _flatten(data_b)
    for key in sorted(set(flat_a) | set(flat_b)):
        if key in seen or key in DESCRIPTIVE or key.startswith(("env.", "hydra.")):
            continue
        if flat_a.get(key) != flat_b.get(key):
            verdict.differences.append(Difference(f"({key})", key, flat_a.get(key), flat_b.get(key), classify(key)))
    env_a, env_b = data_a.get("env") or {}, data_b.get("env") or {}
    for name in sorted(set(env_a) | set(env_b)):
        if env_a.get(name) != env_b.get(name):
            # Environment variables can select kernels and algorithms (NCCL, cuBLAS); count them as numerics.
            verdict.differences.append(
                Difference(f"env {name}", f"env.{name}", env_a.get(name), env_b.get(name), NUMERICS)
            )
    return verdict
