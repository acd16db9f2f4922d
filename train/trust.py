"""Training state eyas loads only if it wrote it: a keyed digest beside every checkpoint's state.

A resume loads `state/` through accelerate and, under DeepSpeed, through DeepSpeed, which
unpickles it (`torch.load(weights_only=False)`): a crafted `state/` folder would run code with
the user's rights. So when eyas saves a checkpoint it signs everything a resume reads (every file
under `state/`, `trainer.json`, `loader_rank*.json`) with HMAC-SHA256 under a per-user key kept
outside any run directory, and writes `state.hmac` beside them:

  {"format": "eyas-checkpoint-hmac/1", "files": [{"path", "size", "hmac"}, ...], "digest": hex}

Each file's HMAC covers its relative path, its bytes and its length; `digest` is the HMAC of the
list, so no entry can be added, dropped or edited without the key. Before a resume loads anything
that is pickled, the digest is checked; a checkpoint that fails (no `state.hmac`, a changed byte,
a file added or removed, another user's key) is refused with one line naming the checkpoint, the
files that differ where that can be told, and `train.trust_checkpoint=<path>`, which accepts that
one checkpoint (the next save signs it with this user's key as usual).

The key: `$EYAS_CHECKPOINT_KEY_FILE`, else `$XDG_CONFIG_HOME/eyas/checkpoint.key` (default
`~/.config/eyas/checkpoint.key`); 32 random bytes made on first use, mode 0600. It protects
against files someone else wrote or changed, not against someone who can read the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import struct
from pathlib import Path
from typing import Any

from eyas.errors import EyasError
from eyas.io import atomic_write_json

KEY_ENV = "EYAS_CHECKPOINT_KEY_FILE"
DIGEST_FILE = "state.hmac"
FORMAT = "eyas-checkpoint-hmac/1"
KEY_BYTES = 32
STATE_DIR = "state"
TOP_LEVEL_FILES = ("trainer.json",)
LOADER_GLOB = "loader_rank*.json"
_CHUNK = 1 << 20  # files are hashed in 1 MiB reads: a multi-GB DeepSpeed state never sits in memory
_SHOWN = 3  # differing files named in a refusal


# ----------------------------------------------------------------------------- the key


def key_path() -> Path:
    """Where this user's checkpoint key lives (see the module docstring)."""
    chosen = os.environ.get(KEY_ENV)
    if chosen:
        return Path(chosen).expanduser()
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "eyas" / "checkpoint.key"


def load_key() -> bytes:
    """This user's key, made on first use (two processes making it at once end with one key)."""
    path = key_path()
    try:
        return _read_key(path)
    except FileNotFoundError:
        return _create_key(path)
    except OSError as exc:
        raise EyasError(f"cannot read the checkpoint key '{path}': {exc.strerror or exc}; fix its permissions or set "
                        f"{KEY_ENV} to a key file outside any run directory") from None


def _read_key(path: Path) -> bytes:
    key = path.read_bytes()
    if len(key) < KEY_BYTES:
        raise EyasError(f"the checkpoint key '{path}' holds {len(key)} bytes, fewer than {KEY_BYTES}; delete it to make "
                        f"a new one (checkpoints signed with the old one then need train.trust_checkpoint), or point "
                        f"{KEY_ENV} at another key file")
    return key


def _create_key(path: Path) -> bytes:
    """Write a new key under a private name, then hard-link it into place: the link fails if another
    process got there first, and everyone reads the one key that won; a reader never sees half a key."""
    tmp = path.with_name(f".{path.name}.new.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(secrets.token_bytes(KEY_BYTES))
            out.flush()
            os.fsync(out.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another rank or job made it first: use theirs
        return _read_key(path)
    except OSError as exc:
        raise EyasError(f"cannot create the checkpoint key '{path}': {exc.strerror or exc}; set {KEY_ENV} to a "
                        "writable file outside any run directory") from None
    finally:
        tmp.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- signing


def covered_files(checkpoint: Path) -> tuple[list[str], list[str]]:
    """(regular files a resume reads, relative paths, sorted; entries that are not regular files or folders).

    Links count as the second kind: eyas writes none, and one could point the loader anywhere.
    """
    checkpoint = Path(checkpoint)
    files: list[str] = []
    odd: list[str] = []
    tops = [checkpoint / name for name in TOP_LEVEL_FILES] + sorted(checkpoint.glob(LOADER_GLOB))
    for top in tops:
        if top.is_symlink() or (top.exists() and not top.is_file()):
            odd.append(top.name)
        elif top.is_file():
            files.append(top.name)
    state = checkpoint / STATE_DIR
    if state.is_symlink():
        odd.append(STATE_DIR)
    elif state.is_dir():
        for folder, dirs, names in os.walk(state):
            for name in dirs + names:
                entry = Path(folder) / name
                relative = entry.relative_to(checkpoint).as_posix()
                if entry.is_symlink() or not (entry.is_dir() or entry.is_file()):
                    odd.append(relative)
                elif entry.is_file():
                    files.append(relative)
    return sorted(files), sorted(odd)


def file_hmac(key: bytes, checkpoint: Path, relative: str) -> tuple[int, str]:
    """(size, HMAC-SHA256 of the relative path, the bytes and their count) of one file, streamed."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(relative.encode("utf-8") + b"\0")  # a path never holds NUL: the frame is unambiguous
    size = 0
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(checkpoint / relative, "rb") as f:
        while count := f.readinto(buffer):
            mac.update(view[:count])
            size += count
    mac.update(struct.pack(">Q", size))
    return size, mac.hexdigest()


def _listing_digest(key: bytes, entries: list[dict]) -> str:
    canonical = json.dumps({"format": FORMAT, "files": entries}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, canonical.encode("utf-8"), hashlib.sha256).hexdigest()


def sign_checkpoint(checkpoint: Path) -> Path:
    """Write `state.hmac` over everything a resume of `checkpoint` reads (after every rank wrote its files)."""
    checkpoint = Path(checkpoint)
    key = load_key()
    files, odd = covered_files(checkpoint)
    if odd:
        raise EyasError(f"cannot sign '{checkpoint}': {odd[0]} is a link or a special file, which eyas never writes")
    entries = []
    for relative in files:
        size, digest = file_hmac(key, checkpoint, relative)
        entries.append({"path": relative, "size": size, "hmac": digest})
    atomic_write_json(checkpoint / DIGEST_FILE, {"format": FORMAT, "algorithm": "HMAC-SHA256", "files": entries,
                                                 "digest": _listing_digest(key, entries)})
    return checkpoint / DIGEST_FILE


# ----------------------------------------------------------------------------- checking


def refusal(checkpoint: Path, accepted: str = "") -> str | None:
    """The one-line refusal of `checkpoint`'s state, or None when eyas signed it with this user's key
    (or `accepted`, the value of train.trust_checkpoint, names this checkpoint)."""
    checkpoint = Path(checkpoint)
    if accepted and _same_path(accepted, checkpoint):
        return None
    problem = _problem(checkpoint)
    if problem is None:
        return None
    elsewhere = f" (train.trust_checkpoint names '{accepted}', not this one)" if accepted else ""
    return (f"refusing to resume from '{checkpoint}': {problem}. A resume loads its pickled state (DeepSpeed without "
            f"restrictions), which can run code; if you trust where this checkpoint came from, accept it with "
            f"train.trust_checkpoint={checkpoint.resolve()}{elsewhere} (your key: {key_path()})")


def _same_path(accepted: str, checkpoint: Path) -> bool:
    return Path(accepted).expanduser().resolve() == checkpoint.resolve()


def _problem(checkpoint: Path) -> str | None:
    """What is wrong with the checkpoint's digest, naming files where it can; None if it is valid."""
    key = load_key()
    manifest = _read_manifest(checkpoint)
    if isinstance(manifest, str):
        return manifest
    if not hmac.compare_digest(_listing_digest(key, manifest["files"]), manifest["digest"]):
        return (f"its {DIGEST_FILE} was not made with your key (a checkpoint signed by another user or on another "
                "machine, or an edited digest file)")
    try:
        differing = _differing_files(key, checkpoint, manifest["files"])
    except OSError as exc:
        return f"cannot read '{exc.filename}': {exc.strerror or exc}"
    if not differing:
        return None
    more = f" and {len(differing) - _SHOWN} more" if len(differing) > _SHOWN else ""
    return "its files differ from what eyas signed: " + ", ".join(differing[:_SHOWN]) + more


def _read_manifest(checkpoint: Path) -> dict | str:
    """The parsed `state.hmac`, or why there is none to check."""
    path = checkpoint / DIGEST_FILE
    if not path.is_file():
        return (f"it has no {DIGEST_FILE} (a checkpoint written before eyas signed its training state, or not by "
                "eyas)")
    try:
        manifest = json.loads(path.read_bytes())
        files = manifest["files"]
        valid = (manifest.get("format") == FORMAT and isinstance(manifest["digest"], str) and isinstance(files, list)
                 and all(isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("size"), int)
                         and isinstance(e.get("hmac"), str) for e in files))
    except (ValueError, KeyError, TypeError, AttributeError, OSError):
        valid = False
    if not valid:
        return f"its {DIGEST_FILE} is not a digest file eyas wrote"
    return manifest


def _differing_files(key: bytes, checkpoint: Path, signed: list[dict]) -> list[str]:
    """Files that differ from the signed list, each with how ("changed", "added", ...), in path order.

    Names, kinds and sizes are compared first (no reading); content is hashed only where they agree.
    """
    present, odd = covered_files(checkpoint)
    expected = {e["path"]: e for e in signed}
    problems = {path: "a link or special file" for path in odd}
    problems.update({path: "removed" for path in expected if path not in present and path not in problems})
    problems.update({path: "added" for path in present if path not in expected})
    for path in present:
        entry = expected.get(path)
        if entry is None:
            continue
        if (checkpoint / path).stat().st_size != entry["size"]:
            problems[path] = "size changed"
        elif not hmac.compare_digest(file_hmac(key, checkpoint, path)[1], entry["hmac"]):
            problems[path] = "changed"
    return [f"{path} ({how})" for path, how in sorted(problems.items())]


def verify_before_load(rank_zero: Any, checkpoint: Path, accepted: str = "") -> None:
    """Refuse (EyasError on every rank) a checkpoint whose training state eyas did not sign with this user's key.

    Only the main process hashes (`rank_zero`: `eyas.train.rank_zero.RankZeroWork`, bounded by
    train.dist_timeout_s) and every rank gets its verdict: every rank hashing the same files would
    multiply the reads by the ranks per node (a multi-GB DeepSpeed state hashes at disk speed, seconds
    per GB), and the main process holds the key that signed them, also where home folders are per node.
    """

    def verdict() -> str | None:
        try:
            found = refusal(checkpoint, accepted)
        except EyasError as exc:  # a verdict like any other: every rank raises it
            return str(exc)
        if found is None and accepted and _same_path(accepted, checkpoint):
            print(f"eyas train: resuming from '{checkpoint}' without checking its digest (train.trust_checkpoint "
                  "accepts it); its next checkpoint is signed with your key", flush=True)
        return found

    found = rank_zero.run("check of the checkpoint's digest", verdict)
    if found is not None:
        raise EyasError(found)
