"""`python -m serve MODEL [flags]` (the same flags as `workbench serve`)."""

from serve.http.cli import main

raise SystemExit(main())
