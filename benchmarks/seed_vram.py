"""The seed report's two views of VRAM: the engine's books (/strata/state) and NVML's (the driver's).

The books count memory torch keeps cached as free (the engine can reuse it); NVML, nvidia-smi and nvitop count it
as used. Both are recorded at ready and after each run, so a report shows whether the tier really filled the GPU.
"""

from __future__ import annotations

import httpx

from strata_tui.engine_io.gpu import NvmlSampler


# What a report keeps of the expert cache's section of /strata/state (the per-layer rows stay out).
_EXPERT_FIELDS = ("mib", "target_slots", "slots", "num_experts", "host_mib", "device", "hits", "misses",
                  "hit_rate", "evictions", "loaded_mib", "prompt_loaded_mib", "oracle_hit_rate")


async def vram_books(base_url: str) -> list[dict] | str:
    """The engine's VRAM books per device (/strata/state `vram`: total, weights, KV, graphs, tier, reserve and
    free MiB), or why they could not be read: shows the tier holding the VRAM near-full, as in the seed."""
    state = await _state(base_url)
    return state if isinstance(state, str) else state["vram"]


async def expert_books(base_url: str) -> dict | str | None:
    """The expert cache's size and hit figures (/strata/state `experts`), None for a dense model, or why they
    could not be read: with the MoE seed the cache, not the tier, is what fills the card."""
    state = await _state(base_url)
    if isinstance(state, str):
        return state
    experts = state.get("experts")
    return {k: experts.get(k) for k in _EXPERT_FIELDS} if isinstance(experts, dict) else None


def expert_text(books: dict | str | None) -> str:
    if books is None:
        return "no expert cache"
    if isinstance(books, str):
        return f"expert books unreadable ({books})"
    return (f"expert cache {books.get('mib')} MiB on {books.get('device')} ({books.get('slots')} of "
            f"{books.get('num_experts')} experts per layer, host {books.get('host_mib')} MiB), hit rate "
            f"{books.get('hit_rate')} (oracle {books.get('oracle_hit_rate')}), {books.get('evictions')} evictions, "
            f"{books.get('loaded_mib')} MiB copied in ({books.get('prompt_loaded_mib')} by prompt chunks)")


async def _state(base_url: str) -> dict | str:
    try:
        async with httpx.AsyncClient(timeout=10.0) as client:
            state = (await client.get(f"{base_url}/strata/state")).json()
        state["vram"]  # noqa: B018 - a body without the books is reported like an unreadable one
        return state
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"


def vram_text(books: list[dict] | str) -> str:
    if isinstance(books, str):
        return f"VRAM books unreadable ({books})"
    return "; ".join(f"{b.get('device')}: free {b.get('free_mib')} of {b.get('total_mib')} MiB (tier "
                     f"{b.get('tier_mib')}, KV {b.get('kv_mib')}, graphs {b.get('graphs_mib')}, reserve "
                     f"{b.get('reserve_mib')} MiB)" for b in books)


def nvml_used() -> list[dict] | str:
    """Each GPU's used/total MiB as NVML (nvidia-smi, nvitop) sees it: the driver's view, in which memory
    torch keeps cached counts as used; the engine's books count it as free (torch can reuse it)."""
    sampler = NvmlSampler()
    why = sampler.open()
    if why is not None:
        return why
    try:
        return [{"index": s.index, "used_mib": s.used_mib, "total_mib": s.total_mib} for s in sampler.sample()]
    finally:
        sampler.close()


def nvml_text(used: list[dict] | str) -> str:
    if isinstance(used, str):
        return used
    return "; ".join(f"NVML gpu{g['index']}: used {g['used_mib']:.0f} of {g['total_mib']:.0f} MiB" for g in used
                     if g["used_mib"] is not None and g["total_mib"] is not None)
