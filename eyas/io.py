"""Crash-safe file output: every file and directory eyas writes goes through here.

Readers never see half a file: a file is written to a temporary name in the same folder,
fsynced, renamed over the old one, and the folder is fsynced so the rename survives a power
cut. A directory (a checkpoint, an export, a prepared split) is built under `<name>.partial`
and swapped into place with `publish_dir`, which on Linux exchanges the two paths in one
system call, so there is no moment at which neither the old nor the new directory exists.

Temporary names carry the writer's PID (`.<name>.tmp.<pid>`); `remove_stale_temps` deletes
those whose writer is gone, which is how a rerun cleans up after a kill -9.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from eyas.errors import EyasError

_TEMP = re.compile(r"^\..+\.tmp\.(\d+)$")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories; the rename itself still happened
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_error(path: Path, exc: OSError) -> EyasError:
    return EyasError(f"cannot write '{path}': {exc.strerror or exc}; free disk space or fix permissions "
                     "and rerun (finished files are kept)")


def temp_name(path: Path) -> Path:
    """The temporary sibling a write to `path` goes through (PID-tagged, hidden)."""
    return path.with_name(f".{path.name}.tmp.{os.getpid()}")


def atomic_write_bytes(path: Path | str, payload: bytes) -> None:
    """Write `payload` to `path` so that a reader sees the old file or the whole new one."""
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise _write_error(path, exc) from None
    _fsync_dir(path.parent)


def atomic_write_text(path: Path | str, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: Path | str, data: Any, sort_keys: bool = False) -> None:
    """JSON with a trailing newline; values json cannot encode are written as strings."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=sort_keys, default=str) + "\n")


def json_problem(exc: BaseException, where: bool = True) -> str:
    """One line for what json.loads refused: (where and) why, an int past int()'s digit limit, or nesting
    deeper than Python's stack (RecursionError)."""
    if isinstance(exc, json.JSONDecodeError):
        return f"line {exc.lineno}: {exc.msg}" if where else exc.msg
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return " ".join(str(exc).split(";")[0].split())  # "Exceeds the limit (4300 digits) for integer string conversion..."


def sha256_file(path: Path | str, chunk: int = 1 << 24) -> str:
    """The file's SHA-256, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))


def publish_dir(partial: Path, final: Path) -> Path:
    """Move a completed `partial` directory to `final`, replacing an older one.

    With an old `final` in place the two are exchanged atomically and the old one (now at
    `partial`) is deleted; a crash at any point leaves one complete directory at `final`.
    Where the kernel cannot exchange, the old one is moved aside first (a short window).
    """
    partial, final = Path(partial), Path(final)
    try:
        if final.exists():
            if not _exchange(partial, final):
                old = final.with_name(final.name + ".old")
                shutil.rmtree(old, ignore_errors=True)
                final.rename(old)
                partial.rename(final)
                partial = old
            shutil.rmtree(partial, ignore_errors=True)
        else:
            partial.rename(final)
    except OSError as exc:
        raise _write_error(final, exc) from None
    _fsync_dir(final.parent)
    return final


def fresh_partial(final: Path) -> Path:
    """An empty `<final>.partial` directory to build into (a leftover of a killed run is removed)."""
    partial = Path(final).with_name(Path(final).name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    return partial


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (one of another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(directory: Path | str) -> list[Path]:
    """Delete temporary files (`.<name>.tmp.<pid>`) under `directory` whose writer has exited."""
    directory = Path(directory)
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    for path in directory.rglob(".*.tmp.*"):
        match = _TEMP.match(path.name)
        if match and path.is_file() and not pid_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
