"""`python -m strata_tui ...`: the same as the strata-tui script."""

import sys

from strata_tui.cli import main

if __name__ == "__main__":  # imported by a walk of the package, it must not start the app
    sys.exit(main())
