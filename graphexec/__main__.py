"""`python -m graphexec`: the command line (`graphexec.app.cli`)."""

from graphexec.app.cli import main

raise SystemExit(main())
