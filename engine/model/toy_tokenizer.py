"""A small byte-level BPE tokenizer trained on a few KB of embedded text, for random and tiny checkpoints.

Byte-level means every string round-trips (unknown characters fall back to bytes), so tests can encode any
prompt. Training is deterministic and takes well under a second; the result is cached per process.
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = """
The quick brown fox jumps over the lazy dog. A long prompt arrives while six slots are decoding, and the engine
must admit it without stopping the others. The scheduler plans chunked prefill so that no step runs longer than
its token budget. Memory is shared between weights, the key and value cache, captured graphs, the adaptive tier
and a reserve that the engine never takes. When a graph cannot be instantiated for lack of memory, the drafter
frees its own graphs, waits for the tier to give memory back, and only then turns the switch off with a warning.
Once upon a time there was a small model that wanted to predict the next token. It read the whole story and
then guessed what came after, one word at a time. Sometimes it guessed two words ahead, and a larger model
checked the guesses. When the guesses were right the story moved faster; when they were wrong nothing was lost.
Hello, world! How are you today? I am fine, thank you. What is the capital of France? The capital of France is
Paris. What is two plus two? Two plus two is four. Please write a short poem about the sea. The sea is wide and
blue, the waves come in and out, the gulls fly high above, and the sailors shout.
def main(argv):
    for line in open(argv[1]):
        print(line.strip())
    return 0
numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 256 1024 4096 65536; symbols: ( ) [ ] { } < > = + - * / % # @ & | ^ ~
The user asked the assistant a question, and the assistant answered politely and precisely. Temperature zero
means greedy decoding: always the most likely token. Top-p keeps the smallest set of tokens whose probability
adds up to p, then samples among them. A seed makes the sampling repeatable.
"""


def corpus_lines() -> list[str]:
    """The embedded training text, as lines (repeated so merges see enough pairs)."""
    return [line for line in _CORPUS.strip().splitlines() if line.strip()] * 4


@functools.lru_cache(maxsize=8)
def toy_tokenizer_json(vocab_size: int = 512) -> str:
    """The tokenizer.json text of a byte-level BPE with at most `vocab_size` ids (specials are 0, 1, 2)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    return tok.to_str()
