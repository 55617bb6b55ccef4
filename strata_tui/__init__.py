"""strata-tui: a Textual app that launches strata-engine from saved profiles and watches it live. No torch."""

__version__ = "0.1.0"
