"""``python -m harness`` is the same as the ``commgate`` command."""

from harness.cli import main

raise SystemExit(main())
