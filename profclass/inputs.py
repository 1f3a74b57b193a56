"""Resolve what the user passed (files, rank files, directories, .zst, .nsys-rep) to SQLite exports.

Nothing is ever written next to the input: compressed fixtures are decompressed into a
private temporary directory that is removed afterwards, and ``.nsys-rep`` reports are
exported with ``nsys export`` into a cache keyed by the report's content hash.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from .errors import ProfileError

SQLITE_MAGIC = b"SQLite format 3\x00"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
PROFILE_SUFFIXES = (".sqlite", ".sqlite.zst", ".nsys-rep", ".db")
RANK_IN_NAME = re.compile(r"(?:^|[^a-z])rank[_-]?(\d+)", re.I)


@dataclass
class InputFile:
    given: str  # what the user named (for messages)
    sqlite: str  # a readable SQLite export
    rank_hint: int | None  # rank number from the file name, if any


def rank_from_name(path: str) -> int | None:
    m = RANK_IN_NAME.search(os.path.basename(path))
    return int(m.group(1)) if m else None


def _expand(paths: list[str]) -> list[str]:
    files: list[str] = []
    for p in paths:
        if not os.path.exists(p):
            raise ProfileError(p, "no such file or directory")
        if os.path.isdir(p):
            found = sorted(os.path.join(p, n) for n in os.listdir(p)
                           if n.endswith(PROFILE_SUFFIXES) and os.path.isfile(os.path.join(p, n)))
            # an export and its own .nsys-rep side by side: read the export only
            stems = {f[: -len(".sqlite")] for f in found if f.endswith(".sqlite")}
            found = [f for f in found if not (f.endswith(".nsys-rep") and f[: -len(".nsys-rep")] in stems)]
            if not found:
                raise ProfileError(p, "directory holds no profiles (*.sqlite, *.sqlite.zst, *.nsys-rep)")
            files.extend(found)
        else:
            files.append(p)
    return files


def nsys_binary() -> str | None:
    env = os.environ.get("NSYS")
    if env and os.path.isfile(env) and os.access(env, os.X_OK):
        return env
    found = shutil.which("nsys")
    if found:
        return found
    default = "/opt/nsys/usr/lib/nsight-systems/bin/nsys"
    return default if os.path.isfile(default) else None


def cache_dir() -> str:
    base = os.environ.get("PROFCLASS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "profclass")
    os.makedirs(base, exist_ok=True)
    return base


def _hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


def export_nsys_rep(path: str, progress=None) -> str:
    """``nsys export --type sqlite`` into the cache (reused while the report is unchanged)."""
    nsys = nsys_binary()
    if nsys is None:
        raise ProfileError(path, "is an .nsys-rep report and nsys was not found: put nsys on PATH or set "
                                 "$NSYS (e.g. install it with shared/nsys/get-nsys.sh), or pass a "
                                 "SQLite export made with 'nsys export --type sqlite'")
    out = os.path.join(cache_dir(), f"{_hash(path)}.sqlite")
    if os.path.exists(out):
        return out
    tmp = out + f".part{os.getpid()}"
    try:
        proc = subprocess.run([nsys, "export", "--type", "sqlite", "--force-overwrite", "true",
                               "--output", tmp, path], capture_output=True, text=True, timeout=3600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProfileError(path, f"nsys export failed ({exc})") from None
    if proc.returncode != 0 or not os.path.exists(tmp):
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise ProfileError(path, f"nsys export failed: {last[0]}")
    os.replace(tmp, out)
    return out


def _decompress(path: str, tmpdir: str) -> str:
    import zstandard
    out = os.path.join(tmpdir, f"{len(os.listdir(tmpdir))}-{os.path.basename(path)[:-4]}")
    try:
        with open(path, "rb") as fin, open(out, "wb") as fout:
            zstandard.ZstdDecompressor().copy_stream(fin, fout)
    except zstandard.ZstdError as exc:
        raise ProfileError(path, f"corrupt zstd file ({exc})") from None
    return out


@contextlib.contextmanager
def resolve(paths: list[str]):
    """Yield InputFiles for ``paths``; temporary decompressed copies vanish on exit."""
    files = _expand(list(paths))
    with tempfile.TemporaryDirectory(prefix="profclass-") as tmpdir:
        out = []
        for f in files:
            try:
                with open(f, "rb") as fh:
                    head = fh.read(16)
            except OSError as exc:
                raise ProfileError(f, f"cannot read ({exc.strerror})") from None
            if head.startswith(ZSTD_MAGIC):
                sqlite = _decompress(f, tmpdir)
                with open(sqlite, "rb") as fh:
                    head = fh.read(16)
            elif f.endswith(".nsys-rep"):
                sqlite = export_nsys_rep(f)
                head = SQLITE_MAGIC
            else:
                sqlite = f
            if len(head) == 0:
                raise ProfileError(f, "empty file")
            if head != SQLITE_MAGIC:
                raise ProfileError(f, "not an SQLite file (expected an nsys SQLite export, .sqlite.zst or .nsys-rep)")
            out.append(InputFile(given=f, sqlite=sqlite, rank_hint=rank_from_name(f)))
        yield out
