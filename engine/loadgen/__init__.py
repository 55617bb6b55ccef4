"""The torch-free HTTP load generator: the load client and named scenarios (used by strata-tui and bench)."""
