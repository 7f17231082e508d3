"""`python -m shardwise.cli`."""

from shardwise.cli.main import main

raise SystemExit(main())
