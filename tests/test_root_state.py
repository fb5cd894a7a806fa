"""The root modules keep no run's state between calls, and an error no reader caught is a bug, said as one.

Promises: two ``train`` command lines in one process see neither each other's options nor each other's log, run
directory or redactor (:class:`trainer.train.Invocation`, :func:`trainer.runlog.session`,
:func:`trainer.redact.guarding`); an unexpected exception is one redacted line ``... internal error: ...`` and exit
70 (``TRAINER_DEBUG=1``: the traceback too), never exit 2 as if the input were bad; a file the user named that is
missing or unreadable is one line (:func:`trainer.inputs.reading`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from pathlib import Path

import pytest

import helpers
from trainer import cli, redact, runlog, train
from trainer.errors import EX_SOFTWARE, UserError, internal_error_line
from trainer.inputs import read_text, reading
from trainer.publish import atomic_write
from trainer.redact import Redactor, guarding, redacted_streams, redactor_for

SECRET = "hfRootState8c1f"  # an HF_TOKEN value: never printed, never written
TAIL = "(a bug: please report it; TRAINER_DEBUG=1 shows the traceback)"


def train_in_process(monkeypatch, capsys, cwd: Path, *args: str) -> tuple[object, str, str]:
    """``train ARGS`` in this process (``main()``, as ``bin/train``): its exit code (None: it returned), stdout,
    stderr."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["train", *args])
    code: object = None
    try:
        train.main()
    except SystemExit as ending:
        code = ending.code
    out = capsys.readouterr()
    return code, out.out, out.err


def left_over() -> dict[str, object]:
    """What the root modules hold between command lines: all of it must be empty."""
    return {
        "guarded": dict(redact._GUARDED),
        "held": list(runlog._HELD),
        "redactor": list(runlog._REDACTOR),
        "trainer handlers": [h for h in logging.getLogger("trainer").handlers if isinstance(h, logging.Handler)],
        "trainer propagates": logging.getLogger("trainer").propagate,
    }


EMPTY = {"guarded": {}, "held": [], "redactor": [], "trainer handlers": [], "trainer propagates": True}


def test_train_keeps_no_run_state_in_module_globals():
    """Promise: what a command line chose is passed as values (RunOptions, Invocation), not module globals."""
    for name in ("SIGNER", "RUN_DIR_MODE", "COMMAND_LINE", "STREAMS", "ERRORS", "REPORTED"):
        assert not hasattr(train, name), name
    options = train.RunOptions()
    assert (options.mode, options.signer, options.command_line) == ("new", None, ())
    with pytest.raises(AttributeError):
        options.mode = "overwrite"
    one, two = train.Invocation.of([f"+env.HF_TOKEN={SECRET}"]), train.Invocation.of([])
    assert one.error_line(f"x {SECRET} y") == "train: error: x <redacted> y"
    assert two.error_line(f"x {SECRET} y") == f"train: error: x {SECRET} y"  # the other run's secret: not known
    one.reported.add("a line")
    assert two.reported == set() and two.jobs == {}


def test_two_runs_in_one_process_keep_to_their_own(tmp_path, monkeypatch, capsys):
    """Promise: a second ``train`` in the same process (a test, a notebook) writes nothing into the first run's
    directory (its train.log is sealed with it), does not inherit its --overwrite, prints no debug lines left by
    its logging, and leaves no guard, held record, redactor or --frozen behind; the first run's secret stays
    redacted in its own files."""
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", "off")
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.delenv("TRAINER_FROZEN", raising=False)
    code, out, err = train_in_process(
        monkeypatch, capsys, tmp_path, "--overwrite", "--frozen", f"hydra.run.dir={first}", f"+env.HF_TOKEN={SECRET}"
    )
    assert code is None and err == "", err
    assert out.startswith("plan: ") and f"run dir       {first}" in out, out
    assert left_over() == EMPTY and "TRAINER_FROZEN" not in os.environ  # --frozen: for that command line only
    log_before = (first / "train.log").read_bytes()
    record = json.loads((first / "record.json").read_text())
    assert record["status"] == "planned"

    code, out, err = train_in_process(monkeypatch, capsys, tmp_path, f"hydra.run.dir={second}")
    assert code is None and err == "", err
    assert "[trainer][DEBUG]" not in out and str(first) not in out, out
    assert (first / "train.log").read_bytes() == log_before  # nothing of the second run in the first's log
    second_log = (second / "train.log").read_text()
    assert str(first) not in second_log and "HF_TOKEN" not in second_log, second_log
    assert left_over() == EMPTY

    # the first run's directory without --overwrite: refused, the mode of the earlier command line not inherited
    code, out, err = train_in_process(monkeypatch, capsys, tmp_path, f"hydra.run.dir={first}")
    assert code == 2 and err.startswith("train: error: ") and "--overwrite" in err and len(err.splitlines()) == 1
    assert (first / "train.log").read_bytes() == log_before
    assert left_over() == EMPTY
    for path in [*first.rglob("*"), *second.rglob("*")]:
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_a_refused_command_line_leaves_nothing_held(refused_train, tmp_path):
    """Promise: records held for a job's log that never opened are dropped when the command line ends."""
    result = refused_train(["layout=nope", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert result.returncode == 2 and result.stderr.startswith("train: error: "), result.stderr
    assert left_over() == EMPTY


# ------------------------------------------------------------------------------------------ internal errors


@pytest.fixture
def buggy_command(monkeypatch):
    """``trainer bug ARGS``: a subcommand whose main raises ``KeyError`` quoting the HF_TOKEN of the environment."""
    module = types.ModuleType("buggy_subcommand")

    def main(argv: list[str]) -> int:
        raise KeyError(f"row {os.environ['HF_TOKEN']} {' '.join(argv)}")

    module.main = main
    monkeypatch.setitem(sys.modules, "buggy_subcommand", module)
    monkeypatch.setitem(cli.COMMANDS, "bug", ("buggy_subcommand", "raises"))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    monkeypatch.delenv("TRAINER_DEBUG", raising=False)
    return monkeypatch


def test_an_unexpected_exception_is_an_internal_error_not_bad_input(buggy_command, capsys):
    """Promise: exit 70 and one line naming the exception, its message redacted (the environment's secret and a
    secret flag of the command line), never exit 2's "unexpected shape"."""
    code = cli.main(["bug", "--hf-token=ab12cd34"])
    err = capsys.readouterr().err
    assert code == EX_SOFTWARE == 70
    assert err == f"trainer bug: internal error: KeyError: 'row <redacted> --hf-token=<redacted>' {TAIL}\n", err


def test_trainer_debug_shows_the_traceback_redacted(buggy_command, capsys):
    buggy_command.setenv("TRAINER_DEBUG", "1")
    code = cli.main(["bug"])
    err = capsys.readouterr().err
    assert code == 70 and err.startswith("Traceback (most recent call last):\n"), err
    assert 'raise KeyError(f"row' in err and SECRET not in err
    assert err.splitlines()[-1] == f"trainer bug: internal error: KeyError: 'row <redacted> ' {TAIL}"


def test_bad_input_and_the_place_keep_their_codes(monkeypatch, capsys):
    """Promise: a UserError stays exit 2 with its line, an OSError one line exit 2, a RecursionError exit 2."""
    for raised, code, line in (
        (UserError("x.yaml: not a mapping"), 2, "trainer bug: error: x.yaml: not a mapping"),
        (
            FileNotFoundError(2, "No such file or directory", "gone.json"),
            2,
            "trainer bug: error: gone.json: no such file or directory",
        ),
        (RecursionError("deep"), 2, "trainer bug: error: input nested too deeply"),
        (AssertionError(), 70, f"trainer bug: internal error: AssertionError {TAIL}"),
    ):
        module = types.ModuleType("raising_subcommand")

        def main(argv: list[str], raised: BaseException = raised) -> int:
            raise raised

        module.main = main
        monkeypatch.setitem(sys.modules, "raising_subcommand", module)
        monkeypatch.setitem(cli.COMMANDS, "bug", ("raising_subcommand", "raises"))
        assert cli.main(["bug"]) == code
        assert capsys.readouterr().err == line + "\n"


def test_internal_error_line_is_one_line():
    err = ValueError("a\nmulti   line\tmessage " + "x" * 400)
    line = internal_error_line("train", err)
    assert "\n" not in line and line.startswith("train: internal error: ValueError: a multi line message xxx")
    assert line.endswith(f"…{' ' + TAIL}") and len(line) < 400


def test_train_says_an_internal_error_in_one_redacted_line(capsys):
    """Promise: in train, an exception that is not an exit is one line, exit 70, through the error redactor (which
    knows the short values of secret overrides)."""
    streams = Redactor().freeze()
    errors = Redactor(short=1).learn_overrides(["+env.HF_TOKEN=ab1"]).freeze()
    with pytest.raises(SystemExit) as ending:
        with redacted_streams(streams, errors=errors):
            raise AttributeError("'NoneType' object has no attribute ab1")
    assert ending.value.code == 70
    assert capsys.readouterr().err == (
        f"train: internal error: AttributeError: 'NoneType' object has no attribute <redacted> {TAIL}\n"
    )


def test_a_bug_inside_a_run_is_exit_70_not_hydras_report(tmp_path, monkeypatch, capsys):
    """Promise: an exception inside a job (here: run_one made to raise) is train's one line and exit 70, with the
    job's secret redacted, not Hydra's "Error executing job" report and exit 1."""
    monkeypatch.setenv("TRAINER_COMPOSE_CACHE", "off")
    monkeypatch.delenv("TRAINER_DEBUG", raising=False)

    def broken(invocation, prepared, run_dir):
        raise TypeError(f"bad field {SECRET}")

    monkeypatch.setattr(train, "run_one", broken)
    code, out, err = train_in_process(
        monkeypatch, capsys, tmp_path, f"hydra.run.dir={tmp_path / 'run'}", f"+env.HF_TOKEN={SECRET}"
    )
    assert code == 70 and err == f"train: internal error: TypeError: bad field <redacted> {TAIL}\n", err
    assert left_over() == EMPTY


# ------------------------------------------------------------------------------------------ the guard


def test_a_guard_lasts_as_long_as_its_block(tmp_path):
    """Promise: a run directory is guarded (its writes scrubbed) only inside :func:`guarding`, also when the block
    raises; a nested guard of the same directory gives the outer one back."""
    run = tmp_path / "run"
    outer = Redactor().learn_secret("outerSecret11").freeze()
    inner = Redactor().learn_secret("innerSecret22").freeze()
    with guarding(run, outer):
        assert redactor_for(run / "a" / "b.txt") is outer
        atomic_write(run / "a.txt", b"outerSecret11\n")
        with pytest.raises(RuntimeError), guarding(run, inner):
            assert redactor_for(run / "a.txt") is inner
            raise RuntimeError("x")
        assert redactor_for(run / "a.txt") is outer
    assert redactor_for(run / "a.txt") is None and redact._GUARDED == {}
    atomic_write(run / "b.txt", b"outerSecret11\n")  # after the run: not its redactor's any more
    assert (run / "a.txt").read_bytes() == b"<redacted>\n" and (run / "b.txt").read_bytes() == b"outerSecret11\n"


def test_the_log_session_forgets_what_it_held(tmp_path):
    """Promise: records held and never released, the redactor and the handlers added meanwhile end with the
    session."""
    root = logging.getLogger()
    before = list(root.handlers)
    with runlog.session(Redactor().learn_secret("logSecret33").freeze()):
        runlog.info("held, never released")
        handler = logging.FileHandler(tmp_path / "job.log")  # as Hydra's job logging adds train.log
        handler.addFilter(runlog.Redacting())
        root.addHandler(handler)
        runlog.release()
        logging.getLogger("trainer.test").warning("logSecret33 in a record")
    assert (tmp_path / "job.log").read_text() == "held, never released\n<redacted> in a record\n"
    assert root.handlers == before and left_over() == EMPTY
    with runlog.session(Redactor().freeze()):
        runlog.info("the second session's own")
        assert [len(h.buffer) for h in runlog._HELD] == [1]
    assert left_over() == EMPTY


# ------------------------------------------------------------------------------------------ reading


def test_reading_says_missing_and_unreadable_files_in_one_line(tmp_path):
    plain = tmp_path / "plain.txt"
    plain.write_text("x")
    with pytest.raises(UserError) as err:
        with reading(tmp_path / "gone.json"):
            read_text(tmp_path / "gone.json")
    assert str(err.value) == f"{tmp_path / 'gone.json'}: no such file"
    with pytest.raises(UserError) as err:
        with reading(tmp_path / "gone.json", missing="--key gone.json: no such file (write it with keygen)"):
            read_text(tmp_path / "gone.json")
    assert str(err.value) == "--key gone.json: no such file (write it with keygen)"
    below = plain / "child"  # a path through a file: ENOTDIR, not a missing file
    with pytest.raises(UserError) as err:
        with reading(below, unreadable=f"--key {below}: cannot read"):
            read_text(below)
    assert str(err.value) == f"--key {below}: cannot read (Not a directory)"
    with pytest.raises(NotADirectoryError):  # no words for it: the OSError goes on (the CLI's one line)
        with reading(below):
            read_text(below)


def test_reading_names_the_flag_before_a_readers_refusal(tmp_path):
    fifo = tmp_path / "key.pem"
    os.mkfifo(fifo)
    with pytest.raises(UserError) as err:
        with reading(fifo, prefix="--key "):
            read_text(fifo, "PEM public key")
    assert str(err.value) == f"--key {fifo}: a FIFO, not a regular file (a PEM public key must be one)"
    with pytest.raises(UserError) as err:
        with reading(fifo, prefix="--key "):
            raise UserError(f"--key {fifo}: said already")
    assert str(err.value) == f"--key {fifo}: said already"
    with pytest.raises(UserError) as err:
        with reading(tmp_path / "gone", prefix="tokenizer "):
            read_text(tmp_path / "gone")
    assert str(err.value) == f"tokenizer {tmp_path / 'gone'}: no such file"


def test_the_front_doors_say_a_missing_key_in_one_line(tmp_path):
    """Promise: wrappers replaced by :func:`reading` keep their words (``trainer verify --key``)."""
    run = tmp_path / "run"
    run.mkdir()
    result = helpers.run_trainer("verify", run, "--key", tmp_path / "gone.pub", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (
        f"trainer verify: error: --key {tmp_path / 'gone.pub'}: no such file "
        "(the public key is KEY.pub, written by `trainer keygen`)\n"
    )


if __name__ == "__main__":
    raise SystemExit(helpers.main(__file__))
