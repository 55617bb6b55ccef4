"""strata-engine: a bundled PyTorch inference engine.

This package root stays import-light on purpose: the TUI imports `engine.telemetry`, `engine.switches`
and `engine.config`, and must never pull torch in by doing so. Import heavy modules where they are used.
"""

__version__ = "0.1.0"
