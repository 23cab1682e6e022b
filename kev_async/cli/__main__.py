"""`python -m kev_async.cli ...` runs the `kev` command."""

from kev_async.cli import main

raise SystemExit(main())
