"""The serving core: pure Python (no torch) request state, scheduling, prefill pacing and the prefix index."""
