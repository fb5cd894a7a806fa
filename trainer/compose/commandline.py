"""The command line of ``train`` as Hydra reads it: every job prepared before any runs, and a single job run in
Hydra's run directory the way ``@hydra.main`` runs one.

:func:`prepare_jobs` expands the overrides into jobs (a multirun sweep is one job per combination) and
prepares each (:func:`trainer.compose.prepare.prepare`; the prepared runs are returned, for the jobs of a
multirun, which Hydra's sweeper runs, to find theirs) and writes nothing: ``train`` claims the run directory the
command line names only once every job was prepared. :func:`hydra_run` is where the writing starts: it runs a
single job from its one composition (``hydra.core.utils.run_job``: Hydra makes the run directory, writes
``.hydra/`` and ``train.log``).

A run directory named on the command line with an interpolation (``hydra.run.dir='${oc.env:PWD}'``,
``outputs/${now:%H-%M-%S}``) is resolved once, here (:func:`resolve_run_dir`), and the override replaced by the
literal it resolved to, on the command line Hydra then reads and in the composition :func:`hydra_run` runs: the
directory ``train`` claims is the one Hydra writes.
"""

from __future__ import annotations

import pickle
import re
import sys
from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from trainer.compose.compose import describe_error, expand_sweep, session, uses_glob
from trainer.compose.prepare import LauncherCheck, PreparedRun, prepare
from trainer.compose.schema import as_dict
from trainer.errors import PLACE_ERRNOS, UserError, os_error_line
from trainer.redact import redact_argv, redact_error, redact_value

# A single plain run: its composition with the ``hydra`` node, Hydra's config loader (None when every composition
# came from the cache) and the prepared run.
Single = tuple[DictConfig, Any, PreparedRun]


def prepare_jobs(
    argv: list[str], check_launcher: LauncherCheck
) -> tuple[Single | None, tuple[str, str] | None, list[str], dict[tuple[str, ...], PreparedRun]]:
    """Prepare every job of a command line before any runs.

    Returns (``single``, ``named``, ``argv``, ``jobs``): ``single`` is (the composition with its ``hydra`` node, Hydra's
    config loader or None when every composition came from the cache, the prepared run) of a single plain run,
    which :func:`hydra_run` then runs, or None when Hydra's own entry point is to run the command line (a
    multirun, also one chosen by ``hydra.mode=MULTIRUN``; ``--cfg``, ``--help``, ...); ``named`` is
    (``hydra.run.dir``, or ``hydra.sweep.dir`` for a multirun, and its value as Hydra will use it: interpolations
    resolved, :func:`resolve_run_dir`) when the command line names the run directory, else None; ``argv`` is the
    command line to hand to Hydra: ``argv`` itself, or a copy whose run-directory override is that literal value
    (the composition in ``single`` has it too); ``jobs``: every job's prepared run by its task overrides
    (:attr:`~trainer.compose.prepare.PreparedRun.overrides`), in the order of the command line (empty when Hydra's
    entry point is to run a ``--cfg``, ``--help``, ... command line).

    ``check_launcher``: the launcher's own checks, which :func:`~trainer.compose.prepare.prepare` runs on each job.

    Raises :class:`UserError` (one line) on a bad override, composition or check, and on a run directory whose
    value cannot be resolved (naming the field).
    """
    from hydra._internal.utils import get_args_parser

    prepared_jobs: dict[tuple[str, ...], PreparedRun] = {}
    args = get_args_parser().parse_args(argv)
    if args.help or args.hydra_help or args.info or args.shell_completion or args.cfg:
        return None, None, list(argv), prepared_jobs
    sweeper = [o for o in args.overrides if _override_key(o).startswith("hydra.sweeper.params")]
    if sweeper:
        raise UserError(
            f"{redact_argv(sweeper)[0]}: sweeper parameters are not read by train; write the sweep on "
            "the command line (-m layout=a,b)"
        )
    modes = [o.partition("=")[2] for o in args.overrides if o.lstrip("+").startswith("hydra.mode=")]
    multirun = bool(args.multirun or (modes and modes[-1] == "MULTIRUN"))
    if uses_glob(args.overrides):  # glob(tp*) lists the layout group's options: Hydra's config loader does
        with session() as lister:
            lister._initialise()
            jobs = expand_sweep(args.overrides, lister.config_loader)
    else:
        jobs = expand_sweep(args.overrides)
    if len(jobs) > 1 and not multirun:
        raise UserError(f"{' '.join(redact_argv(args.overrides))}: a sweep needs multirun (-m, or hydra.mode=MULTIRUN)")
    plain = not args.multirun and not (
        args.config_path or args.config_name or args.config_dir or args.experimental_rerun or modes
    )
    field = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [o for o in args.overrides if _override_key(o) == field]
    single: Single | None = None
    named: tuple[str, str] | None = None
    argv = list(argv)
    with session() as composer:
        for job in jobs:
            try:
                # a single run is composed as @hydra.main composes it (hydra.mode=RUN among Hydra's overrides)
                full = composer.compose([*job, "hydra.mode=RUN"], hydra_node=True) if plain else None
                prepared = prepare(job, composer, full, check_launcher=check_launcher)
                prepared_jobs[prepared.overrides] = prepared
            except UserError as err:
                message = f"{' '.join(redact_argv(job)) or '(defaults)'}: {err}" if len(jobs) > 1 else str(err)
                raise UserError(redact_error(message, [*args.overrides, *job])) from None
            single = (full, composer.config_loader, prepared) if full is not None else None
        if given:
            if any(_is_sweep(o) for o in given):
                raise UserError(
                    f"{redact_argv(given)[-1]}: a sweep over {field} (one run directory per command line: name one)"
                )
            # the directory as Hydra will use it: from the composition of the (first) job with the hydra node
            composed = (
                single[0]
                if single is not None
                else composer.compose([*jobs[0], f"hydra.mode={'MULTIRUN' if multirun else 'RUN'}"], hydra_node=True)
            )
            raw, literal = resolve_run_dir(composed, field, given[-1])
            if raw != literal:  # an interpolation: Hydra gets the literal, resolved once
                argv = literal_override(argv, given, field, literal)
                if single is not None:
                    literal_composition(single[0], field, literal)
            named = (field, literal)
    return single, named, argv, prepared_jobs


def _is_sweep(override: str) -> bool:
    """Whether Hydra reads ``override`` as a sweep (``a,b``, ``range(...)``, ``choice(...)``, ``glob(...)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override).is_sweep_override()  # it parsed once already


def _override_key(override: str) -> str:
    """The key an override sets (``+hydra.run.dir=x`` -> ``hydra.run.dir``; spaces around ``=`` dropped)."""
    return override.partition("=")[0].strip().lstrip("+~").strip()


def resolve_run_dir(composed: DictConfig, field: str, override: str) -> tuple[str, str]:
    """The value of ``field`` (``hydra.run.dir`` or ``hydra.sweep.dir``) in ``composed`` (a composition with its
    ``hydra`` node) as typed and as Hydra will use it: every interpolation resolved once, with Hydra's resolvers
    (``now``, ``hydra:``, with :class:`~hydra.core.hydra_config.HydraConfig` set to a copy of the composition for
    the time it takes; ``oc.env``, ...). ``override`` (the override that set it) names it in errors. Nothing is
    changed: ``composed`` and Hydra's global state are left as they were.

    Raises :class:`UserError` (one line naming ``field``) when the value cannot be resolved, resolves to null or
    to a value that holds an interpolation again.
    """
    from hydra.core.hydra_config import HydraConfig

    shown = redact_argv([override])[0]
    parent_key, _, leaf = field.rpartition(".")
    raw = as_dict(OmegaConf.select(composed, parent_key), resolve=False).get(leaf)
    if raw is None:
        raise UserError(f"{shown}: {field} is null (a run needs its own directory)")
    if not isinstance(raw, str) or "${" not in raw:
        return str(raw), str(raw)
    probe = pickle.loads(pickle.dumps(composed, protocol=pickle.HIGHEST_PROTOCOL))  # HydraConfig makes it read-only
    instance = HydraConfig.instance()
    before = instance.cfg
    try:
        instance.set_config(probe)
        value = OmegaConf.select(probe, field, throw_on_resolution_failure=True)
    except (OmegaConfBaseException, ValueError, KeyError, TypeError) as ex:
        raise UserError(
            f"{shown}: {field} cannot be resolved ({redact_error(describe_error(ex), [override])})"
        ) from None
    finally:
        instance.cfg = before
    if value is None:
        raise UserError(f"{shown}: {field} resolves to null (a run needs its own directory)")
    value = str(value)
    if "${" in value:
        raise UserError(f"{shown}: {field} resolves to {redact_value(value)!r}, which holds an interpolation again")
    return raw, value


def quote_override_value(value: str) -> str:
    """``value`` as a single-quoted value of Hydra's override grammar: quotes and the backslashes before them (or
    before the closing quote) escaped, so that the override parses back to ``value`` exactly."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    trailing = len(body) - len(body.rstrip("\\"))
    return "'" + body + "\\" * trailing + "'"


def literal_override(words: list[str], given: list[str], field: str, literal: str) -> list[str]:
    """A copy of ``words`` (a command line) whose overrides ``given`` (those that set ``field``) set it to
    ``literal`` instead, each with its own ``+``/``++`` prefix (:func:`quote_override_value`). Raises
    :class:`UserError` when Hydra would not read the override back as ``literal`` (a value the override grammar
    cannot carry)."""
    return [_literal(word, field, literal) if word in given else word for word in words]


def _literal(override: str, field: str, literal: str) -> str:
    """``override`` (one that sets ``field``) setting it to ``literal``, checked by Hydra's parser."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    prefix = override[: len(override) - len(override.lstrip("+"))]
    new = f"{prefix}{field}={quote_override_value(literal)}"
    try:
        parsed = OverridesParser.create().parse_override(new)
        same = not parsed.is_sweep_override() and parsed.value() == literal
    except HydraException:
        same = False
    if not same:
        raise UserError(
            f"{field}: resolves to {redact_value(literal)!r}, which a Hydra override cannot carry; "
            "name the directory without an interpolation"
        )
    return new


def literal_composition(composed: DictConfig, field: str, literal: str) -> None:
    """Set ``field`` of ``composed`` (a composition with its ``hydra`` node) to ``literal``, and in Hydra's record
    of the overrides (``hydra.overrides.hydra``, which ``.hydra/hydra.yaml`` keeps; Hydra stores them escaped)
    replace each that sets ``field`` by the literal override (:func:`literal_override`)."""
    with read_write(composed.hydra), open_dict(composed.hydra):
        OmegaConf.update(composed, field, literal, merge=False)
        typed = as_dict(composed.hydra.overrides, resolve=False).get("hydra") or []
        composed.hydra.overrides.hydra = [
            _literal(word, field, literal) if _override_key(word) == field else word for word in typed
        ]


def hydra_run(
    composed: DictConfig,
    config_loader: Any,
    prepared: PreparedRun,
    task: Callable[[PreparedRun, str], None],
    unfinished: Callable[[PreparedRun, str], None] | None = None,
) -> None:
    """Run the single job ``prepared`` from its composition ``composed`` (with the ``hydra`` node) the way
    ``@hydra.main`` runs a job: Hydra makes the run directory and writes ``.hydra/`` and ``train.log``
    (``hydra.core.utils.run_job``), then ``task(prepared, run_dir)`` runs in it. An ``OSError`` of the place
    (:data:`trainer.errors.PLACE_ERRNOS`: a full disk, a quota, a read-only mount, a name too long), Hydra's own
    writes of ``.hydra/`` included, is one line naming the file (``train: error: DIR/config.yaml: no space left on
    device``) and exit 2; when that happened before ``task`` began (in Hydra's writes),
    ``unfinished(prepared, run_dir)`` is called first (``train`` scrubs what Hydra wrote of the overrides). Any
    other unexpected error is reported as ``@hydra.main`` reports it
    (``HYDRA_FULL_ERROR=1``: all of it)."""
    from hydra._internal.callbacks import Callbacks
    from hydra._internal.utils import run_and_report
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode

    started = []  # the task began: an error naming no file is then not one of Hydra's writes of .hydra/

    def job(_cfg: DictConfig) -> None:
        started.append(True)
        task(prepared, HydraConfig.get().runtime.output_dir)

    def run() -> None:  # what Hydra.run does with a composition
        composed.hydra.mode = RunMode.RUN
        configure_log(composed.hydra.hydra_logging, composed.hydra.verbose)
        callbacks = Callbacks(composed)
        callbacks.on_run_start(config=composed, config_name="train")
        try:
            ret = run_job(
                hydra_context=HydraContext(config_loader=config_loader, callbacks=callbacks),
                task_function=job,
                config=composed,
                job_dir_key="hydra.run.dir",
                job_subdir_key=None,
                configure_logging=True,
            )
            callbacks.on_run_end(config=composed, config_name="train", job_return=ret)
            failed = getattr(ret, "_return_value", None)  # what the job raised, read without Hydra's extra line
            if isinstance(failed, OSError) and failed.errno in PLACE_ERRNOS:
                raise failed
            _ = ret.return_value  # raises what the job raised
        except OSError as err:
            if err.errno not in PLACE_ERRNOS:
                raise
            # Hydra's own writes (.hydra/*.yaml) name no file: the folder they go to is named instead
            where = "" if started else f"{composed.hydra.run.dir}/.hydra"
            if not started and unfinished is not None:
                unfinished(prepared, str(composed.hydra.run.dir))
            print(f"train: error: {os_error_line(err, where)}", file=sys.stderr)
            sys.exit(2)

    run_and_report(run)
