"""The serving KV cache: storage only. A block pool per layer, a block table per slot, bf16/int8 storage.

Layout per layer: `k[layer]`, `v[layer]` are pools `[Hkv, num_blocks, block_tokens, D]`; `block_table`
`[num_slots, blocks_per_slot]` (int32, on the device) maps each slot's logical block j (tokens
`[j * block_tokens, (j + 1) * block_tokens)`) to a physical block of the pool. Today every slot owns
`blocks_per_slot` blocks of its own (the table starts as slot s -> blocks `s * blocks_per_slot + j`); the
attention backends and the tier copies only ever go through the table, so a slot can map any block.

The slot's last blocks past `context` (the margin, from `pad_start_tokens`) are scratch: padded batch rows (a batch
padded up to its bucket, a prefill chunk padded up to its length bucket) write there, so every forward has static
shapes and no padded row ever touches a real token. Validity needs no length tensor: a query at position p sees keys 0..p of
its slot, so KV left behind by a rejected draft or an earlier request is never visible and is overwritten when
its position is reused.

`--kv int8` stores keys and values as int8 with one float32 scale per (token, head), written at quantization
time (pools of scales `[Hkv, num_blocks, block_tokens]`). `--kv bf16` stores unquantized KV in the model's
compute dtype (bf16 on GPU; fp32 when a CPU run keeps fp32 weights, so the lossless tests compare like with like).

Attention itself lives in engine.model.attention: `attend` writes the new keys and values and hands the bound
cache to a backend (the PyTorch reference, or the Triton kernels that read the pool in place: `set_path`).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from engine.exec.kv.geometry import KVGeometry
from engine.exec.kv.paging import KVPaging
from engine.exec.kv.pool_resize import resize_all
from engine.exec.cuda_streams import Streams
from engine.model.attention.backends import TorchAttention, kernel_backend
from engine.model.attention.kv_site import KVSite
from engine.model.attention.reference import flash_accepts

KV_STORAGE = ("bf16", "int8")
# Scores scratch one blocked-attention step may use (B x Hq x T x block x 4 bytes).
_BLOCK_SCORES_BYTES = 256 << 20
# Keys + values one read may copy (gathered by slot, dequantized): longer spans are read block by block.
_BLOCK_KV_BYTES = 128 << 20
_SPLIT_TOKENS = 1024  # keys per split in the split-KV decode path
_INT8_MAX = 127.0
SCRUB_CHUNK_BYTES = 16 << 20  # non_finite_blocks' mask: at most this many bytes at once


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(token, head) symmetric int8: x [..., D] -> (int8 [..., D], float32 scale [...])."""
    scale = x.abs().amax(dim=-1).float().clamp(min=1e-8) / _INT8_MAX
    q = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


class SlotKVCache:
    """KV for `num_slots` sequences of up to `context_tokens` each; implements the model's `kv.attend`.

    Before each forward the step function calls `bind(slots)` with a [B] long tensor naming the slot of each
    batch row, and `set_path(split, paged)` for the SPLIT_ATTN and PAGED_ATTN paths. Positions arrive with
    each `attend` call.

    With `resident_tokens` (`--kv-resident`) the pools hold each slot's resident window, one scratch block and a
    shared pool of `pool_blocks` that grows and spills (`paging`, engine.exec.kv.paging); the runner calls
    `prepare` before each forward. Without it, every slot owns its whole context (`paging` is None).
    """

    def __init__(self, geometry: KVGeometry, storage: str, compute_dtype: torch.dtype, device: torch.device | str,
                 resident_tokens: int | None = None, pool_blocks: int = 0, streams: Streams | None = None,
                 **paging: Any) -> None:
        """With `resident_tokens`, `paging` holds KVPaging's keyword arguments (what a pool growth takes memory
        from and what follows it, how far it may grow alone)."""
        if storage not in KV_STORAGE:
            raise ValueError(f"kv storage {storage!r}: expected one of {KV_STORAGE}")
        self.geometry = geometry
        self.storage = storage
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        g = geometry
        layout = None if resident_tokens is None else geometry.layout(resident_tokens)
        num_blocks = g.num_blocks if layout is None else layout.device_blocks(pool_blocks)
        shape = (g.num_kv_heads, num_blocks, g.block_tokens, g.head_dim)
        data_dtype = torch.int8 if storage == "int8" else compute_dtype
        self.k = [torch.zeros(shape, dtype=data_dtype, device=self.device) for _ in range(g.num_layers)]
        self.v = [torch.zeros(shape, dtype=data_dtype, device=self.device) for _ in range(g.num_layers)]
        if storage == "int8":
            sshape = shape[:-1]
            self.k_scale = [torch.ones(sshape, dtype=torch.float32, device=self.device) for _ in range(g.num_layers)]
            self.v_scale = [torch.ones(sshape, dtype=torch.float32, device=self.device) for _ in range(g.num_layers)]
        else:
            self.k_scale = self.v_scale = []
        self.block_table = torch.arange(g.num_blocks, dtype=torch.int32, device=self.device).view(
            g.num_slots, g.blocks_per_slot)
        self.paging: KVPaging | None = None
        # Pool blocks the prefix-cache tier holds when its blocks live in this pool (engine.exec.kv.tier_pool).
        self.tier_blocks = 0
        if layout is not None:
            self.paging = KVPaging(self, layout, pool_blocks, int(resident_tokens), streams, **paging)
            self.block_table = self.paging._table.to(self.device, copy=True)  # the device table: synced in place
        self.slots: torch.Tensor | None = None
        self.span_tokens = geometry.context_tokens
        self.causal_keys: int | None = None
        self.split_attn = False
        self.reference = TorchAttention()
        self.kernel = kernel_backend(self.device)  # None where the paged kernels cannot run
        self.paged = False
        self.paged_prefill = False
        # Tunable so tests reach the blocked and split paths at small sizes.
        self.block_scores_bytes = _BLOCK_SCORES_BYTES
        self.block_kv_bytes = _BLOCK_KV_BYTES
        self.split_tokens = _SPLIT_TOKENS
        self.fused_prefill: bool | None = None  # None: decide per device (flash on CUDA), see chunk_fusable
        self._where: tuple | None = None  # (positions, blocks, offsets) of the forward's writes
        self._fusable: dict[tuple[int, int], bool] = {}
        self.write_kernel: Any = None  # FUSED_OPS: engine.model.attention.triton_kv_write.write_kv

    def use_write_kernel(self, enabled: bool = True) -> None:
        """FUSED_OPS: write (and quantize) each step's keys and values with one Triton kernel per layer instead
        of the reference's index_put (and quantize) ops. Launches it once first: raises here, at start, what the
        kernel cannot do on this device (and then leaves the reference writer)."""
        self.write_kernel = None
        if enabled:
            from engine.model.attention.triton_kv_write import launch_once, write_kv

            scales = self.k_scale[0] if self.storage == "int8" else None
            launch_once(self.k[0], scales, self.compute_dtype, self.device)
            self.write_kernel = write_kv

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(key scales, value scales) of one layer's pool for a kernel launch: int8 KV's, or (None, None)."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.storage == "int8" else (None, None)

    # --- accounting ----------------------------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Bytes of the slots' KV: the pool less the blocks a shared prefix-cache tier holds in it (its own)."""
        tensors = self.k + self.v + list(self.k_scale) + list(self.v_scale)
        total = sum(t.numel() * t.element_size() for t in tensors)
        num_blocks = self.k[0].shape[1] if self.k else 0
        return total * (num_blocks - self.tier_blocks) // num_blocks if num_blocks else total

    @property
    def mib(self) -> float:
        return self.nbytes / (1 << 20)

    def pools(self) -> list[torch.Tensor]:
        """Every pool tensor (keys, values, int8 scales; all layers), block axis 1: what paging copies and grows."""
        return self.k + self.v + list(self.k_scale) + list(self.v_scale)

    def pool_groups(self) -> list[list[int]]:
        """Indices into pools() of each KV layer's tensors, by attend's layer index (main layers, then MTP): what
        one layer's attention reads and writes, so paging can fetch it, and attend wait for it, layer by layer."""
        n = len(self.k)
        per_layer = len(self.pools()) // n
        return [[layer + j * n for j in range(per_layer)] for layer in range(n)]

    @property
    def backend(self) -> TorchAttention:
        """The attention backend the next forward uses."""
        return self.kernel if (self.paged and self.kernel is not None) else self.reference

    # --- the model-facing seam -----------------------------------------------------------------------------

    def bind(self, slots: torch.Tensor, span_tokens: int | None = None, causal_keys: int | None = None) -> None:
        """Name each batch row's slot ([B] long tensor) and the key span (length bucket) to read.

        The span is a static int (part of the executor key); None reads every column that can be valid.
        """
        self.slots = slots
        self.span_tokens = self.geometry.context_tokens if span_tokens is None else int(span_tokens)
        self.causal_keys = causal_keys
        self._where = None
        self.reference.reset()
        if self.kernel is not None:
            self.kernel.reset()

    def bind_chunk(self, slots: torch.Tensor, span_tokens: int, start: int, chunk_bucket: int) -> None:
        """bind() for one prompt chunk padded at its end: positions [start, start + chunk_bucket).

        Lets long chunks use fused causal attention aligned to the bottom right: over keys [0, start +
        chunk_bucket), query row i sees keys <= start + i, which is exactly its causal set (the pad rows at
        the end see stale keys, and their outputs are never used). `start` is baked into the step, so the
        runner puts it in the executor key.
        """
        self.bind(slots, span_tokens)
        self.causal_keys = int(start) + int(chunk_bucket)

    def free(self) -> None:
        """Drop every K/V buffer (Engine.close); the cache cannot be used afterwards."""
        if self.paging is not None:
            self.paging.free()  # first: a fetch still in flight writes the pools
        self.k, self.v, self.k_scale, self.v_scale = [], [], [], []
        self.slots = self._where = None

    def set_path(self, split: bool, paged: bool, paged_prefill: bool = False) -> None:
        """The attention path of the forward about to run: SPLIT_ATTN (reference backend), PAGED_ATTN (the
        in-place kernels, where `kernel` exists) and PAGED_PREFILL (prompt chunks through the kernels too)."""
        self.split_attn = bool(split)
        self.paged = bool(paged)
        self.paged_prefill = bool(paged and paged_prefill)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Write k, v at `positions` of each row's slot, then attend causally. q [B,Hq,T,D] -> [B,Hq,T,D]."""
        self._wait_fetched(layer_idx)
        self._write(layer_idx, k, v, positions)
        return self.backend.attend(self, layer_idx, q, positions)

    def write_site(self, layer_idx: int, positions: torch.Tensor) -> KVSite | None:
        """FUSED_OPS: where this forward's keys and values of the layer go, for the layer's norm + RoPE kernel that
        writes them itself (then `attend_written`); None where the cache writes them (no write kernel)."""
        if self.write_kernel is None:
            return None
        self._wait_fetched(layer_idx)
        blocks, offsets = self._locate(self.slots, positions)
        return KVSite(self.k[layer_idx], self.v[layer_idx], *self.scales(layer_idx), blocks, offsets)

    def attend_written(self, layer_idx: int, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """attend() once the forward's keys and values are in the pool at `write_site`."""
        return self.backend.attend(self, layer_idx, q, positions)

    def _wait_fetched(self, layer_idx: int) -> None:
        assert self.slots is not None, "SlotKVCache.bind(slots) must precede the forward"
        if self.paging is not None:
            # Before the write, which may land in a partly filled block the copy stream is still fetching. In
            # every forward (and captured graph) of a paging engine, fetch or not; never with every slot's context reserved.
            self.paging.wait_fetched(layer_idx)

    def gather_bytes(self, q: torch.Tensor, n_keys: int) -> int:
        """Bytes of the dequantized key + value copy one read of `n_keys` keys for this batch makes."""
        return 2 * q.shape[0] * self.geometry.num_kv_heads * n_keys * self.geometry.head_dim * q.element_size()

    def chunk_fusable(self, num_heads: int, chunk_tokens: int) -> bool:
        """Whether a prompt chunk may use fused (flash) causal attention through `bind_chunk`: on CUDA when the
        flash kernel accepts the shapes and dtype (otherwise torch would materialize the whole mask, so the
        blocked path is used instead). `fused_prefill` True forces it (tests on CPU), False disables it."""
        if self.fused_prefill is not None:
            return self.fused_prefill
        if self.device.type != "cuda" or chunk_tokens <= 8:
            return False
        key = (num_heads, chunk_tokens)
        if key not in self._fusable:
            g = self.geometry
            q = torch.zeros(1, num_heads, chunk_tokens, g.head_dim, dtype=self.compute_dtype, device=self.device)
            k = torch.zeros(1, g.num_kv_heads, 1, g.head_dim, dtype=self.compute_dtype, device=self.device)
            self._fusable[key] = flash_accepts(q, k)
        return self._fusable[key]

    # --- paging (--kv-resident; no-ops when every slot owns its whole context) ---------------------------------

    def prepare(self, wants: dict[int, int]) -> None:
        """Before a forward: every block slot s addresses below wants[s] (tokens) is on the device and mapped."""
        if self.paging is not None:
            self.paging.prepare(wants)

    def join_fetches(self) -> None:
        """The current stream waits for every fetch in flight: before pools are read or written outside attend."""
        if self.paging is not None:
            self.paging.join_fetches()

    def retire_slot(self, slot: int) -> None:
        """The slot's request finished: its pool and host blocks go back at the next `reclaim_retired`."""
        if self.paging is not None:
            self.paging.retire(slot)

    def reclaim_retired(self) -> None:
        if self.paging is not None:
            self.paging.reclaim()

    def resize_pool(self, num_blocks: int, stage: bool = False, failed_move: Callable | None = None) -> None:
        """Every pool tensor to `num_blocks` blocks, its first blocks kept, one tensor at a time; new blocks finite.
        All or nothing in size (`kv_pool_resize.resize_all`), not in place: a failure part-way puts the grown tensors
        back at new addresses, and then runs `failed_move` (graphs read addresses). `stage`: `resized`'s."""
        if self.device.type == "cuda":
            # A prompt chunk in flight on another stream (engine.exec.chunk_stream) writes the old tensors: its
            # writes must land before they are copied, and nothing may still address them once they are freed.
            torch.cuda.synchronize(self.device)
        addresses = [t.data_ptr() for t in self.pools()]
        try:
            resize_all(((self.k, 0.0), (self.v, 0.0), (self.k_scale, 1.0), (self.v_scale, 1.0)), num_blocks, stage)
        except torch.OutOfMemoryError:
            if failed_move is not None and [t.data_ptr() for t in self.pools()] != addresses:
                failed_move()
            raise

    def non_finite_blocks(self) -> set[int]:
        """Physical blocks holding a NaN or inf in any layer's keys, values or scales (a pass over the pools: for
        the rare step whose logits were not finite, never per step)."""
        num_blocks = self.k[0].shape[1]
        bad = torch.zeros(num_blocks, dtype=torch.bool, device=self.device)
        for pool in (*self.k, *self.v, *self.k_scale, *self.v_scale):
            if not pool.is_floating_point():
                continue
            # a slice of blocks at a time: the check's mask is as large as what it checks, and VRAM is full by design
            step = max(1, SCRUB_CHUNK_BYTES // max(1, pool[:, :1].numel()))
            for start in range(0, num_blocks, step):
                part = pool[:, start:start + step]  # [Hkv, n, bt(, D)]
                bad[start:start + part.shape[1]] |= ~torch.isfinite(part).transpose(0, 1).flatten(1).all(dim=1)
        return set(bad.nonzero().flatten().tolist())

    def blocks_of(self, slots: Iterable[int]) -> set[int]:
        """The physical blocks the slots' table rows address."""
        rows = list(slots)
        if not rows:
            return set()
        return set(self.block_table[torch.tensor(rows, device=self.device)].flatten().tolist())

    def zero_blocks(self, blocks: Iterable[int]) -> None:
        """Zero physical blocks (scales to 1): what a fresh pool holds. Attention masks the positions past a row's
        length, but a masked NaN still poisons P.V (0 * NaN), so a block handed to another slot must be finite."""
        ids = sorted(blocks)
        if not ids:
            return
        index = torch.tensor(ids, device=self.device)
        for pools, fill in ((self.k, 0), (self.v, 0), (self.k_scale, 1.0), (self.v_scale, 1.0)):
            for pool in pools:
                pool.index_fill_(1, index, fill)

    # --- storage -------------------------------------------------------------------------------------------

    def _locate(self, slots: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical block and offset [B, T] of each (row, position): the block table's one lookup per forward."""
        if self._where is None or self._where[0] is not positions:
            bt = self.geometry.block_tokens
            blocks = self.block_table[slots.view(-1, 1), positions // bt].long()
            self._where = (positions, blocks, positions % bt)
        return self._where[1], self._where[2]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        blocks, offsets = self._locate(self.slots, positions)
        if self.write_kernel is not None:
            self.write_kernel(self.k[layer], self.v[layer], *self.scales(layer), k, v, blocks, offsets)
            return
        k_tok = k.permute(1, 0, 2, 3)  # [Hkv, B, T, D]: the advanced indices (block, offset) sit at dims 1, 2
        v_tok = v.permute(1, 0, 2, 3)
        if self.storage == "int8":
            kq, ks = quantize_int8(k_tok)
            vq, vs = quantize_int8(v_tok)
            self.k[layer][:, blocks, offsets] = kq
            self.v[layer][:, blocks, offsets] = vq
            self.k_scale[layer][:, blocks, offsets] = ks
            self.v_scale[layer][:, blocks, offsets] = vs
        else:
            self.k[layer][:, blocks, offsets] = k_tok.to(self.compute_dtype)
            self.v[layer][:, blocks, offsets] = v_tok.to(self.compute_dtype)

    def read(self, layer: int, slots: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, Hkv, end-start, D] of each row's slot, dequantized to the compute dtype: a gather
        of whole blocks through the block table (the reference backend's one copy)."""
        bt = self.geometry.block_tokens
        first, last = start // bt, -(-end // bt)
        blocks = self.block_table.index_select(0, slots)[:, first:last]  # [B, n]
        b, n = blocks.shape
        lo, hi = start - first * bt, end - first * bt

        def gather(pool: torch.Tensor) -> torch.Tensor:  # [Hkv, NB, bt, ...] -> [B, Hkv, end-start, ...]
            picked = pool.index_select(1, blocks.reshape(-1))  # [Hkv, B*n, bt, ...]
            picked = picked.view(pool.shape[0], b, n * bt, *pool.shape[3:]).transpose(0, 1)
            return picked[:, :, lo:hi]

        kk, vv = gather(self.k[layer]), gather(self.v[layer])
        if self.storage == "int8":
            ks, vs = gather(self.k_scale[layer]), gather(self.v_scale[layer])
            return dequantize_int8(kk, ks, self.compute_dtype), dequantize_int8(vv, vs, self.compute_dtype)
        return kk, vv

    # --- whole-slot copies: prefix blocks in and out of the tier -------------------------------------------

    def _slot_tokens(self, slot: int, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n, device=self.device)
        bt = self.geometry.block_tokens
        return self.block_table[slot].long()[pos // bt], pos % bt

    def read_span(self, slot: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """All layers' KV of one slot's tokens [start, end): data [layers, 2, Hkv, n, D], int8 scales or None."""
        self.prepare({slot: end})
        self.join_fetches()
        blocks, offsets = self._slot_tokens(slot, start, end - start)
        data = torch.stack([torch.stack([self.k[i][:, blocks, offsets], self.v[i][:, blocks, offsets]])
                            for i in range(self.geometry.num_layers)])
        if self.storage != "int8":
            return data, None
        scales = torch.stack([torch.stack([self.k_scale[i][:, blocks, offsets], self.v_scale[i][:, blocks, offsets]])
                              for i in range(self.geometry.num_layers)])
        return data, scales

    def write_span(self, slot: int, start: int, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        """The inverse of read_span: put a [layers, 2, Hkv, n, D] span at tokens [start, start+n) of `slot`."""
        self.prepare({slot: start + data.shape[3]})
        self.join_fetches()
        blocks, offsets = self._slot_tokens(slot, start, data.shape[3])
        for i in range(self.geometry.num_layers):
            self.k[i][:, blocks, offsets] = data[i, 0].to(self.k[i].device, non_blocking=True)
            self.v[i][:, blocks, offsets] = data[i, 1].to(self.v[i].device, non_blocking=True)
            if scales is not None:
                self.k_scale[i][:, blocks, offsets] = scales[i, 0].to(self.device, non_blocking=True)
                self.v_scale[i][:, blocks, offsets] = scales[i, 1].to(self.device, non_blocking=True)

