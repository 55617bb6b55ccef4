"""Installs a test's graph-capture faults in an engine process it starts (tests/fault_injection.py's
`engine_process_env` puts this folder on PYTHONPATH and the plan in STRATA_FAULT_INJECT). Python imports
sitecustomize at start-up, before the engine: the engine itself never reads the variable."""

import os
import sys
from pathlib import Path

if os.environ.get("STRATA_FAULT_INJECT", "").strip():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: `tests` is importable
    from tests.fault_injection import FaultPlan

    FaultPlan.from_env(os.environ).install()
