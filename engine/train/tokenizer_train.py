"""Train the byte-level BPE tokenizer (HF `tokenizers`) on the training side of the corpus."""

from __future__ import annotations

from typing import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT_TOKEN = "<|endoftext|>"


def _texts_up_to(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    """Yield texts until about `max_bytes` of UTF-8 have been yielded (BPE merges settle long before that)."""
    seen_bytes = 0
    for text in texts:
        if seen_bytes >= max_bytes:
            return
        seen_bytes += len(text.encode("utf-8"))
        yield text


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192, max_bytes: int = 64 * 1024 * 1024) -> Tokenizer:
    """A byte-level BPE with `vocab_size` entries, the last-resort 256 bytes and one end-of-text token.

    Any UTF-8 string round-trips through it (bytes are the fallback), which the loader's incremental
    decoder relies on.
    """
    if vocab_size < 512 or vocab_size > 65535:
        # token ids are packed as uint16; fewer than 512 leaves almost no merges
        raise ValueError(f"vocab_size={vocab_size}: expected 512..65535")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_texts_up_to(texts, max_bytes), trainer=trainer)
    return tokenizer


def eot_id(tokenizer: Tokenizer) -> int:
    """The end-of-text token's id; it separates documents in packed training data."""
    token_id = tokenizer.token_to_id(EOT_TOKEN)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOT_TOKEN} token")
    return token_id
