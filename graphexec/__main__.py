from graphexec.cli import main

raise SystemExit(main())
