"""`python -m tensorbus` runs the tensorbus command."""

from .cli import main

raise SystemExit(main())
