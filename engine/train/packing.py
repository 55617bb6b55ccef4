"""Turn documents into one token stream and cut it into training batches and evaluation windows.

Every document is followed by the end-of-text id, so the model learns where a file ends and a window that
crosses a boundary sees the separator it will see at inference.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch
from tokenizers import Tokenizer

# Encoding a few thousand files at a time keeps the tokenizer's per-token bookkeeping from growing with the corpus.
_ENCODE_CHUNK_FILES = 2048
EncodeBatch = Callable[[list[str]], list[list[int]]]


def pack_documents(texts: Sequence[str], encode_batch: EncodeBatch, eot_id: int) -> np.ndarray:
    """All documents' token ids, each followed by `eot_id`, as one uint16 array."""
    if not 0 <= eot_id < 65536:
        raise ValueError(f"eot_id={eot_id}: token ids are packed as uint16")
    parts: list[np.ndarray] = []
    eot = np.array([eot_id], dtype=np.uint16)
    for start in range(0, len(texts), _ENCODE_CHUNK_FILES):
        for ids in encode_batch(list(texts[start : start + _ENCODE_CHUNK_FILES])):
            parts.append(np.asarray(ids, dtype=np.uint16))
            parts.append(eot)
    if not parts:
        return np.zeros(0, dtype=np.uint16)
    return np.concatenate(parts)


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer_json: str) -> None:
    global _worker_tokenizer
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode_chunk(args: tuple[list[str], int]) -> np.ndarray:
    texts, eot_id = args
    assert _worker_tokenizer is not None
    return pack_documents(texts, lambda batch: [e.ids for e in _worker_tokenizer.encode_batch(batch)], eot_id)


def pack_documents_parallel(texts: Sequence[str], tokenizer: Tokenizer, eot_id: int, workers: int | None = None) -> np.ndarray:
    """`pack_documents` over worker processes: the same array, in the same order.

    The tokenizer's own thread pool scales poorly on hundreds of MB (far below one core per thread); processes
    each holding a copy of the tokenizer scale with the cores a GPU machine has.
    """
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(texts) < 2 * _ENCODE_CHUNK_FILES:
        return pack_documents(texts, lambda batch: [e.ids for e in tokenizer.encode_batch(batch)], eot_id)
    step = max(64, len(texts) // (workers * 8))
    chunks = [(list(texts[i : i + step]), eot_id) for i in range(0, len(texts), step)]
    # fork keeps start-up cheap; the workers never touch torch, only the tokenizer rebuilt from JSON
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(tokenizer.to_str(),)) as pool:
        parts = list(pool.map(_encode_chunk, chunks))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def window_tokens(seq_tokens: int) -> int:
    """Tokens one training or evaluation row needs: `seq_tokens` inputs plus two more targets (t+1 and MTP's t+2)."""
    return seq_tokens + 2


def eval_windows(stream: np.ndarray, seq_tokens: int, max_windows: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping rows of `seq_tokens + 2` ids ([N, seq_tokens + 2] long); a ragged tail is dropped."""
    width = window_tokens(seq_tokens)
    count = len(stream) // width
    if max_windows is not None:
        count = min(count, max_windows)
    if count == 0:
        raise ValueError(f"a stream of {len(stream)} tokens holds no window of {width} tokens")
    rows = stream[: count * width].astype(np.int64).reshape(count, width)
    return torch.from_numpy(rows)


class BatchSampler:
    """Random windows from a token stream, drawn from a seeded generator so a run can be repeated exactly."""

    def __init__(self, stream: np.ndarray, seq_tokens: int, batch_seqs: int, seed: int, device: torch.device) -> None:
        width = window_tokens(seq_tokens)
        if len(stream) <= width:
            raise ValueError(f"training stream has {len(stream)} tokens; one window needs more than {width}")
        self.width = width
        self.batch_seqs = batch_seqs
        self.device = device
        # int32 on the device: the gather below runs there, and uint16 has no index support in torch
        self.stream = torch.from_numpy(stream.astype(np.int32)).to(device)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self._offsets = torch.arange(width, device=device)

    @property
    def num_tokens(self) -> int:
        return int(self.stream.numel())

    def next_batch(self) -> torch.Tensor:
        """[batch_seqs, seq_tokens + 2] long ids."""
        starts = torch.randint(0, self.num_tokens - self.width, (self.batch_seqs, 1), generator=self.generator)
        index = starts.to(self.device) + self._offsets
        return self.stream[index].long()
