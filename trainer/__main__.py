"""``python -m trainer`` is the ``trainer`` command line."""

from trainer.cli import main

raise SystemExit(main())
