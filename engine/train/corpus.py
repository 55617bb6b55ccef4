"""Collect the Python source on this machine (stdlib + site-packages), deduplicate it and split it by file.

The split is decided by each file's content hash, not by walk order, so the same files land on the same
side on any machine and in any run.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
import site
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# Files past this size are nearly always generated tables or vendored bundles, not code a person writes.
DEFAULT_MAX_FILE_BYTES = 256 * 1024
# Minified or generated sources: long lines teach the tokenizer and the model nothing useful.
MAX_MEAN_LINE_CHARS = 120
MAX_LINE_CHARS = 1000
_SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", "node_modules"}


@dataclass(frozen=True)
class SourceFile:
    """One deduplicated source file: where it was found, its text and its content hash (hex sha256)."""

    path: str
    text: str
    sha256: str

    @property
    def num_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass
class Corpus:
    """Train and held-out files plus the counts a model card reports."""

    train: list[SourceFile] = field(default_factory=list)
    heldout: list[SourceFile] = field(default_factory=list)
    roots: list[str] = field(default_factory=list)
    files_seen: int = 0
    duplicates: int = 0
    rejected: int = 0
    capped: int = 0

    def summary(self) -> dict[str, object]:
        """Counts for logs and the model card."""
        return {
            "roots": self.roots,
            "files_seen": self.files_seen,
            "duplicates_dropped": self.duplicates,
            "rejected_not_source": self.rejected,
            "dropped_by_size_cap": self.capped,
            "train_files": len(self.train),
            "train_bytes": sum(f.num_bytes for f in self.train),
            "heldout_files": len(self.heldout),
            "heldout_bytes": sum(f.num_bytes for f in self.heldout),
        }


def default_roots() -> list[str]:
    """The running interpreter's standard library and every site-packages directory it knows."""
    paths = sysconfig.get_paths()
    candidates = [paths["stdlib"], paths["purelib"], paths["platlib"], *site.getsitepackages()]
    user_site = site.getusersitepackages()
    if isinstance(user_site, str):
        candidates.append(user_site)
    roots: list[str] = []
    for cand in candidates:
        real = os.path.realpath(cand)
        if os.path.isdir(real) and real not in roots:
            roots.append(real)
    return roots


def iter_source_paths(roots: list[str]) -> list[str]:
    """Every *.py file under the roots, real paths, sorted, each once (roots may nest)."""
    found: set[str] = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
            for name in filenames:
                if name.endswith(".py"):
                    found.add(os.path.realpath(os.path.join(dirpath, name)))
    return sorted(found)


def read_source(path: str, max_file_bytes: int) -> str | None:
    """The file's text if it looks like hand-written Python source, else None."""
    try:
        if os.path.getsize(path) > max_file_bytes:
            return None
        raw = Path(path).read_bytes()
    except OSError:
        return None
    if not raw.strip() or b"\x00" in raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    lines = text.splitlines()
    if max(len(line) for line in lines) > MAX_LINE_CHARS or len(text) / len(lines) > MAX_MEAN_LINE_CHARS:
        return None
    return text.replace("\r\n", "\n")


def _read_chunk(args: tuple[list[str], int]) -> list[tuple[str, str | None, str]]:
    paths, max_file_bytes = args
    out: list[tuple[str, str | None, str]] = []
    for path in paths:
        text = read_source(path, max_file_bytes)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest() if text is not None else ""
        out.append((path, text, digest))
    return out


def read_all(paths: list[str], max_file_bytes: int, workers: int | None = None) -> list[tuple[str, str | None, str]]:
    """(path, text or None, sha256) for each path, in order; worker processes when there are many files.

    A GPU machine's site-packages holds a GB or more of source: reading, checking and hashing it in one
    process would eat into the training budget.
    """
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(paths) < 4096:
        return _read_chunk((paths, max_file_bytes))
    step = max(256, len(paths) // (workers * 8))
    chunks = [(paths[i : i + step], max_file_bytes) for i in range(0, len(paths), step)]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return [item for part in pool.map(_read_chunk, chunks) for item in part]


def is_heldout(sha256: str, heldout_per_mille: int) -> bool:
    """Decide the side of the split from the content hash alone."""
    return int(sha256[:8], 16) % 1000 < heldout_per_mille


def collect(
    roots: list[str] | None = None,
    max_total_bytes: int = 1000 * 1024 * 1024,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    heldout_per_mille: int = 25,
) -> Corpus:
    """Walk the roots, keep unique source files, cap the total size, split train / held-out by hash.

    When the cap bites, files are kept in content-hash order, which is a fixed pseudo-random sample rather
    than whichever package happens to sort first.
    """
    if not 0 < heldout_per_mille < 1000:
        raise ValueError(f"heldout_per_mille={heldout_per_mille}: expected 1..999")
    if max_total_bytes <= 0:
        raise ValueError(f"max_total_bytes={max_total_bytes}: expected > 0")
    corpus = Corpus(roots=list(roots) if roots is not None else default_roots())
    for root in corpus.roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"corpus root {root!r} is not a directory")
    by_hash: dict[str, SourceFile] = {}
    for path, text, digest in read_all(iter_source_paths(corpus.roots), max_file_bytes):
        corpus.files_seen += 1
        if text is None:
            corpus.rejected += 1
            continue
        if digest in by_hash:
            corpus.duplicates += 1
            continue
        by_hash[digest] = SourceFile(path=path, text=text, sha256=digest)
    total_bytes = 0
    for digest in sorted(by_hash):
        source = by_hash[digest]
        if total_bytes + source.num_bytes > max_total_bytes:
            corpus.capped += 1
            continue
        total_bytes += source.num_bytes
        side = corpus.heldout if is_heldout(digest, heldout_per_mille) else corpus.train
        side.append(source)
    return corpus
