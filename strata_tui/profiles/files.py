"""The file operations under the profile store, safe for what a profiles directory can really hold.

- Reading opens without blocking and reads only a regular file of at most MAX_PROFILE_BYTES: a FIFO named
  `x.toml` would block open() and read() forever, and a huge file would take the parser minutes.
- Writing goes through a temp file, fsync and os.replace beside the file a symlink points to (the link stays
  a link), and the new file keeps the old one's mode (and owner where allowed): a profile a person made 0644
  or 0640 stays so. A new profile is 0600 (it may hold an API key).
- `locked` is an advisory lock (fcntl on `.<name>.lock` beside the profile, there only while a save runs), so
  two app instances saving one profile take turns at read-modify-write and neither overwrites the other's save.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # not on Windows: saves there are serialized within one process only
    fcntl = None  # type: ignore[assignment]

# A hand-written profile is a few KiB; 64 KiB is far above any real one and parses in milliseconds.
MAX_PROFILE_BYTES = 64 * 1024
TEMP_SUFFIX = ".tmp"
LOCK_SUFFIX = ".lock"


class UnreadableProfile(Exception):
    """The file cannot be read as a profile (not a regular file, too large, an OS error): `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def read_profile_text(path: Path, limit_bytes: int = MAX_PROFILE_BYTES) -> str:
    """The text of a regular file of at most `limit_bytes`; raises FileNotFoundError or UnreadableProfile."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UnreadableProfile(f"cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableProfile(f"not a regular file ({_kind(info.st_mode)}): nothing was read")
        if info.st_size > limit_bytes:
            raise UnreadableProfile(f"too large to be a profile ({info.st_size:,} bytes; the limit is "
                                    f"{limit_bytes:,}): not read")
        data = b""
        while len(data) <= limit_bytes:  # a file that grows while we read is cut off here, not followed
            chunk = os.read(fd, limit_bytes + 1 - len(data))
            if not chunk:
                break
            data += chunk
        if len(data) > limit_bytes:
            raise UnreadableProfile(f"too large to be a profile (over {limit_bytes:,} bytes): not read")
    except OSError as exc:
        raise UnreadableProfile(f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnreadableProfile(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def is_regular_file(path: Path) -> bool:
    """A regular file (through symlinks), found without opening it."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a plain file"


def lock_path(path: Path) -> Path:
    return path.with_name(f".{path.stem}{LOCK_SUFFIX}")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold the advisory lock of the profile at `path` (blocking until the other holder is done)."""
    if fcntl is None:
        yield
        return
    lock = lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # The holder before us unlinked the lock file when it was done: a lock on that old file excludes
            # nobody who opens the name now, so take the lock again on the current one.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock))
            except FileNotFoundError:
                same = False
            if same:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        # Unlinked while still held (so no file is left behind, and a waiter on it sees it gone and retries),
        # then closing releases the lock.
        lock.unlink(missing_ok=True)
        os.close(fd)


def write_atomic(path: Path, text: str, exclusive: bool = False) -> None:
    """Write through a temp file beside the real file, fsync, then os.replace (or, `exclusive`, os.link,
    which fails with FileExistsError when the name is taken: an atomic create of a complete file).

    A symlink is written through (its target is replaced; the link stays); the new file keeps the old one's
    permission bits and, where the process may set them, its owner and group."""
    path = Path(path)
    real = path if exclusive else Path(os.path.realpath(path))
    real.parent.mkdir(parents=True, exist_ok=True)
    try:
        old = None if exclusive else os.stat(real)
    except FileNotFoundError:
        old = None
    fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=TEMP_SUFFIX, dir=real.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(text.encode("utf-8"))
            handle.flush()
            if old is not None:
                os.fchmod(handle.fileno(), stat.S_IMODE(old.st_mode))
                with contextlib.suppress(OSError):
                    os.fchown(handle.fileno(), old.st_uid, old.st_gid)
            os.fsync(handle.fileno())
        if exclusive:
            os.link(tmp, real)
        else:
            os.replace(tmp, real)
    finally:
        Path(tmp).unlink(missing_ok=True)
    fsync_dir(real.parent)


def fsync_dir(folder: Path) -> None:
    """Make the rename itself durable where the platform allows opening a directory."""
    try:
        dir_fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dir_fd)
    except OSError:
        pass
    finally:
        os.close(dir_fd)
