"""``python -m commgate`` is the same as the ``commgate`` command."""

from commgate.cli import main

raise SystemExit(main())
