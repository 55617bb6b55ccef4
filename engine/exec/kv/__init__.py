"""The KV cache and its memory: slot KV (dense or paged blocks, host spill), the prefix-cache tier and its
share of the pool, and the VRAM books. Below the runner; imports no other part of exec but its base floor."""
