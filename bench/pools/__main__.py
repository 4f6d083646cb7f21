"""`python -m bench.pools` (see bench/pools/__init__.py)."""

import sys

from bench.pools.cli import main

sys.exit(main())
