"""`python -m engine.cli serve ...`: the same as the strata-engine script (strata-tui launches the engine this way)."""

import sys

from engine.cli import main

sys.exit(main())
