"""``python -m gradprobe`` is the ``gradprobe`` command."""

from .cli import main

raise SystemExit(main())
