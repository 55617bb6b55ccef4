"""The held-out sample shipped beside the model, and how it turns into evaluation windows.

The sample is whole held-out files joined by the end-of-text marker. Training script and CPU test both
turn it into windows with `sample_windows`, through the tokenizer the loader gives, so the figures the card
records are the figures the test measures.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from engine.train.packing import eval_windows, pack_documents
from engine.train.tokenizer_train import EOT_TOKEN

SAMPLE_FILE = "heldout_sample.txt"
SAMPLE_SEQ_TOKENS = 512
# Small files give the sample many different packages' styles within its byte budget.
_SAMPLE_MAX_FILE_BYTES = 12 * 1024


def choose_sample(texts: Sequence[str], max_bytes: int) -> list[str]:
    """Held-out files, in the order given, small enough and free of the marker, until `max_bytes` is reached."""
    chosen: list[str] = []
    used_bytes = 0
    for text in texts:
        size = len(text.encode("utf-8"))
        if size > _SAMPLE_MAX_FILE_BYTES or EOT_TOKEN in text:
            continue
        if used_bytes + size + len(EOT_TOKEN) > max_bytes:
            break
        chosen.append(text)
        used_bytes += size + len(EOT_TOKEN)
    return chosen


def sample_text(documents: Sequence[str]) -> str:
    """The file's content: each document followed by the end-of-text marker."""
    return "".join(doc + EOT_TOKEN for doc in documents)


def sample_documents(text: str) -> list[str]:
    """Split the sample file back into its documents."""
    parts = text.split(EOT_TOKEN)
    if parts and parts[-1] == "":
        parts.pop()
    if not parts:
        raise ValueError(f"{SAMPLE_FILE}: no documents (expected files separated by {EOT_TOKEN})")
    return parts


def sample_windows(
    text: str, encode: Callable[[str], list[int]], eot_id: int, seq_tokens: int = SAMPLE_SEQ_TOKENS
) -> torch.Tensor:
    """[N, seq_tokens + 2] evaluation windows of the sample, encoded one document at a time with `encode`."""
    documents = sample_documents(text)
    stream = pack_documents(documents, lambda batch: [encode(doc) for doc in batch], eot_id)
    return eval_windows(stream, seq_tokens)
