"""``python -m cdcd`` is the same program as the ``cdcd`` console script."""

from cdcd.cli import main

raise SystemExit(main())
