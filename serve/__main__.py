"""`python -m serve MODEL [flags]` (the same flags as `workbench serve`)."""

from serve.server_cli import main

raise SystemExit(main())
