"""A loaded engine's heap and Python's cyclic collector.

A full collection walks every tracked object: with torch, Triton and a loaded engine that is a few hundred thousand
objects and over a hundred milliseconds, run on whichever thread allocates when the collector's counts say so (the
engine's step, the server's event loop). Under load a step allocates enough to trigger one every few seconds, and
the step it lands in stalls every slot (an inter-token gap far above the rest), as does an explicit collection
before a device-memory release (engine.exec.graphs.backends). The objects alive once the engine is ready live as
long as it does, so the collector has nothing to find among them: they are moved out of its reach.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now (the model, the tokenizer, the imported modules) out of the
    collector's reach; later collections walk only what was allocated since."""
    gc.collect()
    gc.freeze()


def thaw_heap() -> None:
    """Objects frozen by `freeze_startup_heap` back in the collector's reach: for a process that drops an engine and
    builds another (a benchmark's rows), whose cycles would otherwise never be freed."""
    gc.unfreeze()
