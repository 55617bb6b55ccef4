"""The torch execution layer: runner, MTP drafter, sampler, KV cache, executor and graph cache, VRAM budget."""
