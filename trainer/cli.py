"""``trainer``: the bundle's command line. One subcommand per phase, each in its own module.

Each module in :data:`COMMANDS` exposes ``main(argv: list[str]) -> int``; it is imported only when its
subcommand runs, so ``trainer data ...`` does not pay for ``trainer image``'s imports. A
:class:`~trainer.errors.UserError` raised by a subcommand becomes one line on stderr and its exit code; so does an
``OSError`` (``FILE: no space left on device``, ``FILE: file name too long``, exit 2:
:func:`trainer.errors.os_error_line`). Any other exception is a bug, not bad input: one line ``trainer CMD:
internal error: TYPE: MESSAGE (a bug: please report it; TRAINER_DEBUG=1 shows the traceback)``, redacted like
every line of the bundle (:mod:`trainer.redact`), and exit 70 (``EX_SOFTWARE``); ``TRAINER_DEBUG=1`` prints the
(redacted) traceback before it.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

from trainer.errors import EX_SOFTWARE, UserError, internal_error_report, os_error_line
from trainer.redact import Redactor

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "data": ("trainer.data.cli", "build, verify and generate the fixed-length SFT rows (deepseek_v4 loss mask)"),
    "verify": (
        "trainer.record.verify_cli",
        "compare what a run observed (its probe) with its lock and the recipe; --key: signatures",
    ),
    "keygen": ("trainer.record.keygen", "make an offline key pair for signing image provenance and run attestations"),
    "attest": (
        "trainer.record.attest_cli",
        "write the (signed) attestation of a run that ended outside `train`, e.g. a Slurm job",
    ),
    "train": ("trainer.train", "compose, check and plan a run (Hydra overrides follow; same as `train`)"),
    "image": ("trainer.image.cli", "build an OCI image from a lock, print its digest, diff two images"),
    "lock": ("trainer.lock.cli", "verify an image lock offline; resolve one from PyPI (network)"),
    "cache": ("trainer.image.cachecli", "the content-addressed input cache: add a file (hash-checked), locate, verify"),
    "report": ("trainer.report.report", "throughput, MFU, model TFLOP/s, cost, step-time CV and GPU-hours of a run"),
    "converge": (
        "trainer.report.convergence_cli",
        "convergence check of a candidate run against a reference (--predict: from configs)",
    ),
    "recipe": (
        "trainer.report.recipe",
        "write a run as a recipe YAML (schema/recipe.schema.yaml); --validate recipe files",
    ),
    "logs": (
        "trainer.report.logs",
        "read per-step loss and iteration time from a Megatron/miles log into metrics.jsonl",
    ),
    "status": ("trainer.record.status", "where a run stands; follows its Slurm job (--wait) and records how it ended"),
}


def usage() -> str:
    """The top-level help text: one line per subcommand of :data:`COMMANDS`, sorted by name."""
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: trainer COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in sorted(COMMANDS.items())]
    lines += ["", "`trainer COMMAND --help` describes a command."]
    return "\n".join(lines)


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM, so that ``finally`` blocks and ``except BaseException`` clean-ups run."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; return its exit code.

    Exit codes: 0 ok, 1 a command's negative answer (e.g. images differ, a check failed),
    2 bad usage or refused input (one line on stderr), 70 an internal error (a bug: one line on stderr, the
    traceback too with ``TRAINER_DEBUG=1``), 130 interrupted, 141 its output closed, 143 terminated.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"trainer: error: unknown command {name!r} (commands: {', '.join(sorted(COMMANDS))})", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])  # the command's module (COMMANDS), loaded when it runs
    if name == "train":
        sys.argv = ["train", *rest]
        module.main()
        return 0
    signal.signal(signal.SIGTERM, _terminate)  # SIGTERM unwinds like Ctrl-C: temporary files are removed
    try:
        return int(module.main(rest) or 0)
    except UserError as err:
        print(f"trainer {name}: error: {err}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say, as a tool killed by SIGPIPE
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so that the interpreter's final flush does not fail again
        return 141
    except OSError as err:  # a path the user gave that cannot be read or written, a full disk, a name too long
        print(f"trainer {name}: error: {os_error_line(err)}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"trainer {name}: terminated (temporary files removed)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print(f"trainer {name}: interrupted", file=sys.stderr)
        return 130
    except RecursionError:  # a reader missed a nesting bound: still one line
        print(f"trainer {name}: error: input nested too deeply", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - no reader turned it into a UserError: a bug, said as one (exit 70)
        print(internal_error(f"trainer {name}", err, rest), end="", file=sys.stderr)
        return EX_SOFTWARE


def internal_error(prog: str, err: BaseException, argv: list[str]) -> str:
    """The report of the unexpected exception ``err`` (:func:`trainer.errors.internal_error_report`: one line, after
    the traceback with ``TRAINER_DEBUG=1``) with the secrets of ``argv`` and of this process's environment replaced,
    as :mod:`trainer.redact` replaces them in every line (the message of an exception may quote an input)."""
    inherited = Redactor().learn_env(os.environ)  # as train's error lines: the environment's values of 4+ characters
    redactor = Redactor(short=1).learn_overrides(argv).teach(inherited).freeze()
    return redactor.scrub(internal_error_report(prog, err))


if __name__ == "__main__":
    raise SystemExit(main())
