"""``trainer``: the bundle's command line. One subcommand per phase, each in its own module.

Each module in :data:`COMMANDS` exposes ``main(argv: list[str]) -> int``; it is imported only when its
subcommand runs, so ``trainer data ...`` does not pay for ``trainer image``'s imports. A
:class:`~trainer.errors.UserError` raised by a subcommand becomes one line on stderr and its exit code.
"""

from __future__ import annotations

import importlib
import sys
from typing import Dict, List, Optional, Tuple

from trainer.errors import UserError

# subcommand -> (module, one-line help)
COMMANDS: Dict[str, Tuple[str, str]] = {
    "train": ("trainer.train", "compose, check and plan a run (Hydra overrides follow; same as `train`)"),
}


def usage() -> str:
    width = max(len(name) for name in COMMANDS)
    lines = ["usage: trainer COMMAND [ARGS ...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in sorted(COMMANDS.items())]
    lines += ["", "`trainer COMMAND --help` describes a command."]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Dispatch ``argv`` (default ``sys.argv[1:]``) to a subcommand; return its exit code.

    Exit codes: 0 ok, 1 a command's negative answer (e.g. images differ, a check failed),
    2 bad usage or refused input (one line on stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"trainer: error: unknown command {name!r} (commands: {', '.join(sorted(COMMANDS))})", file=sys.stderr)
        return 2
    if name == "train":
        from trainer import train

        sys.argv = ["train", *rest]
        train.main()
        return 0
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except UserError as err:
        print(f"trainer {name}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print(f"trainer {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
