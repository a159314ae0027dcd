"""`python -m ladle`: the `ladle` command."""

from ladle.cli import main

raise SystemExit(main())
