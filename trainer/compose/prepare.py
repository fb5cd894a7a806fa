"""A run prepared once: composed, checked, rendered and planned, before anything is written.

:func:`prepare` is the whole of the compose -> check phase of ``train``: it composes the job with Hydra's
Compose API and, in the same initialisation, the reference layout's composition (for the numerics verdict),
validates the composition against the schema, runs the pre-launch checks, the stack pins and the launcher's
own checks, renders the miles launch once and builds the plan. The result, a frozen :class:`PreparedRun`, is
what every launcher receives: none composes or renders again.

Where a config field meets the launch: a field of :mod:`trainer.compose.schema` reaches the miles argv through one row
of :mod:`trainer.compose.render`'s tables (flag, key, kind), and the same rows give megatron-core its arguments for
``launcher=local-megatron`` (:func:`trainer.launch.megatron_args.megatron_argv`: the rows its ``MEGATRON_WHEN``
conditions keep, then its ``MEGATRON_ARGS`` rows) and the numerics verdict its classes
(:mod:`trainer.compose.numerics`). A new field is added in ``schema.py``, its ``conf/`` default, and one row of
``render.py``.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from trainer import REPO_ROOT, runlog
from trainer.compose import checks, schema
from trainer.compose.compose import Composer, choices_of, job_config, session, validate
from trainer.compose.frozen import freeze
from trainer.compose.numerics import NumericsVerdict, compare
from trainer.compose.plan import Plan, build_plan
from trainer.compose.render import Launch, render
from trainer.compose.schema import TrainConfig
from trainer.compose.stackpins import verify_stack
from trainer.errors import UserError
from trainer.lock.imagelock import stale_requirements_lock
from trainer.publish import canonical_json
from trainer.redact import Redactor, redact_argv

# The launcher's own checks of a job (:func:`trainer.launch.check`): raise :class:`~trainer.errors.CheckError`.
LauncherCheck = Callable[[TrainConfig, checks.Parallelism], None]


@dataclass(frozen=True)
class PreparedRun:
    """One job of a command line, composed once and checked once; read-only all the way down, each fact held once.

    ``overrides``: the job's overrides as Hydra records them (``hydra.overrides.task``: those of ``hydra.*`` left
    out); ``composition``: the composition (read-only DictConfig, interpolations unresolved, no ``hydra`` node),
    the one source of the two views :attr:`cfg` (a read-only copy of it) and :attr:`config` (the typed
    :class:`~trainer.compose.schema.TrainConfig` made from it, frozen); ``par``: its
    :class:`~trainer.compose.checks.Parallelism`; ``choices``: the option chosen per config group
    (``{"layout": "tp2pp4ep8", ...}``, Hydra's own groups left out); ``launch``: the rendered miles launch (argv +
    env); ``numerics``: the verdict against ``launcher.reference_layout`` (``{"reference_layout", "equivalent",
    "differences", ...}``); ``plan``: the JSON-ready plan (:func:`trainer.compose.plan.build_plan`). Every list and
    dict in it is read-only (:mod:`trainer.compose.frozen`): an assignment raises ``FrozenInstanceError``
    (a field, a field of the typed config), ``ReadonlyConfigError`` (a node of :attr:`cfg`) or ``TypeError`` (an
    item of a list or dict).
    """

    overrides: tuple[str, ...]
    composition: DictConfig = field(repr=False)
    par: checks.Parallelism
    choices: Mapping[str, str | None]
    launch: Launch
    numerics: NumericsVerdict
    plan: Plan

    @property
    def cfg(self) -> DictConfig:
        """The composition, a read-only copy (interpolations unresolved, no ``hydra`` node): a change made to it
        with ``read_write`` stays in the copy."""
        return pickle.loads(pickle.dumps(self.composition, protocol=pickle.HIGHEST_PROTOCOL))

    @functools.cached_property
    def config(self) -> TrainConfig:
        """The composition as the typed :class:`~trainer.compose.schema.TrainConfig`, frozen (made once, on the
        first read: interpolations resolved then)."""
        return freeze(schema.to_object(self.composition))

    @property
    def launcher(self) -> str:
        """``launcher.name`` (``plan``, ``local-cpu``, ``slurm``, ...)."""
        return self.config.launcher.name

    def record_fields(self) -> dict[str, Any]:
        """What every ``record.json`` of this run says about its composition: ``kind`` (``plan`` or ``run``), the
        launcher, the overrides (secrets redacted), the chosen options, the resolved stack pins, the launcher
        lock's path and ``composition_sha256``: the sha256 of the canonical JSON
        (:func:`trainer.publish.canonical_json`) of the resolved composition
        (``OmegaConf.to_container(cfg, resolve=True)``), its secrets redacted as ``config.yaml`` has them (the
        values of the overrides' and the environment block's secret-named keys, URL credentials: a hash of known
        text and a short secret would give the secret away), so that a run of another composition is known
        (``--resume``, :func:`trainer.record.rundir.claim_run_dir`). Nothing time-varying is in the composition
        (Hydra's node, with its run directory and ``now``, is not part of it), so the same command line gives
        the same hash; a field the user sets from ``${now:...}`` or ``${oc.env:...}`` makes it follow that value.
        Raises what resolving the composition raises (it was resolved once already, by :func:`prepare`)."""
        import hashlib

        resolved = schema.as_dict(self.composition)
        secrets = Redactor().learn_overrides(list(self.overrides)).learn_env(resolved.get("env") or {}).freeze()
        text = secrets.scrub(canonical_json(resolved).decode())
        return dict(
            kind="plan" if self.launcher == "plan" else "run",
            launcher=self.launcher,
            overrides=redact_argv(list(self.overrides)),
            choices=self.choices,
            stack=resolved["stack"],
            lock={"path": "lockfiles/launcher.lock"},
            composition_sha256=hashlib.sha256(text.encode()).hexdigest(),
        )


FROZEN = "TRAINER_FROZEN"  # =1 (``train --frozen``): use lockfiles/launcher.lock even when launcher.in changed


def check_launcher_lock(root: Path = REPO_ROOT) -> None:
    """Refuse (:class:`UserError`, one line with the command that re-resolves it) a ``lockfiles/launcher.lock``
    whose requirements (``launcher.in``) changed since it was resolved
    (:func:`trainer.lock.imagelock.stale_requirements_lock`), unless ``$TRAINER_FROZEN`` is ``1``."""
    if os.environ.get(FROZEN) == "1":
        return
    stale = stale_requirements_lock(root / "lockfiles" / "launcher.lock", "launcher.in")
    if stale:
        raise UserError(stale.replace("pass --frozen", "pass --frozen to train"))


def reference_overrides(overrides: Sequence[str], reference_layout: str) -> list[str]:
    """The overrides of the reference composition: the job's, less those that choose or change the layout or the
    cluster, plus ``layout=REFERENCE``."""
    kept = [o for o in overrides if not o.lstrip("+~").startswith(("layout=", "layout.", "cluster="))]
    return kept + [f"layout={reference_layout}"]


def prepare(
    overrides: Sequence[str] = (),
    composer: Composer | None = None,
    composed: DictConfig | None = None,
    *,
    check_launcher: LauncherCheck,
) -> PreparedRun:
    """Compose (unless ``composed``, the composition of ``overrides`` with its ``hydra`` node, is given),
    validate, check, render and plan one job; the reference layout is composed in the same Hydra session
    (``composer``, or a session of its own). ``check_launcher`` is the launcher's own pre-launch check
    (:func:`trainer.launch.check`; the launchers import this phase, so the caller hands their check in), run
    after the schema, layout, stack-pin and launcher-lock checks.

    Raises :class:`~trainer.errors.UserError` (one line) on a bad override, composition or check; nothing is
    written.
    """
    if composer is None:
        with session() as own:
            return prepare(overrides, own, composed, check_launcher=check_launcher)

    full = composed if composed is not None else composer.compose(overrides, hydra_node=True)
    task = tuple(full.hydra.overrides.task)  # Hydra's split: the overrides of the job, not those of hydra.*
    cfg = job_config(full)
    typed = freeze(validate(cfg))  # read-only for the checks and the plan too: what they see, the run gets
    par = checks.check(typed)
    verify_stack(typed.stack)
    check_launcher_lock()
    check_launcher(typed, par)
    runlog.log.info(
        "checked %s: schema, layout (world %d), stack pins against %s, launcher %s",
        " ".join(task) or "(defaults)",
        par.world_size,
        typed.stack.lockfile,
        typed.launcher.name,
    )
    reference_layout = typed.launcher.reference_layout
    reference = composer.compose(reference_overrides(task, reference_layout))
    numerics: NumericsVerdict = {"reference_layout": reference_layout, **compare(cfg, reference).as_dict()}
    runlog.log.info("numerics against layout %s: %s", reference_layout, numerics.get("verdict"))
    OmegaConf.set_readonly(cfg, True)
    return PreparedRun(
        overrides=task,
        composition=cfg,
        par=freeze(par),
        choices=freeze(choices_of(full)),
        launch=freeze(render(cfg)),
        numerics=freeze(numerics),
        plan=freeze(build_plan(typed, par, numerics)),
    )
