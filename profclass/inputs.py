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
import threading
from dataclasses import dataclass

from .errors import ProfileError

SQLITE_MAGIC = b"SQLite format 3\x00"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
XZ_MAGIC = b"\xfd7zXZ\x00"
PROFILE_SUFFIXES = (".sqlite", ".sqlite.zst", ".sqlite.xz", ".nsys-rep", ".db")
RANK_IN_NAME = re.compile(r"(?:^|[^a-z])rank[_-]?(\d+)", re.I)
EXPORT_TIMEOUT_S = 3600
DEFAULT_NSYS = "/opt/nsys/usr/lib/nsight-systems/bin/nsys"  # where get-nsys.sh installs it


@dataclass
class InputFile:
    given: str  # what the user named (for messages)
    sqlite: str | None  # a readable SQLite export (None: not resolved yet, see ``listed``)
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
                raise ProfileError(p, "directory holds no profiles (*.sqlite, *.sqlite.zst, *.sqlite.xz, *.nsys-rep)")
            files.extend(found)
        else:
            files.append(p)
    return files


def nsys_binary() -> str | None:
    env = os.environ.get("NSYS")
    if env:  # named explicitly: that one or none (never a different nsys behind the user's back)
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    found = shutil.which("nsys")
    if found:
        return found
    return DEFAULT_NSYS if os.path.isfile(DEFAULT_NSYS) and os.access(DEFAULT_NSYS, os.X_OK) else None


def cache_dir() -> str | None:
    """Where .nsys-rep exports are kept: $PROFCLASS_CACHE, else ~/.cache/profclass (XDG).
    None when it cannot be created or written (the export then goes to a scratch dir)."""
    base = os.environ.get("PROFCLASS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "profclass")
    try:
        os.makedirs(base, exist_ok=True)
    except OSError:
        return None
    return base if os.access(base, os.W_OK | os.X_OK) else None


def _hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:24]


NSYS_PERCENT = re.compile(rb"\[[= ]*(\d{1,3})%[= ]*\]")
NSYS_HELP = ("install NVIDIA Nsight Systems (the CUDA toolkit ships it; or run shared/nsys/get-nsys.sh "
             "from the profclass repository) and put nsys on PATH or set $NSYS to it, or pass a SQLite "
             "export made where nsys is with 'nsys export --type sqlite REPORT.nsys-rep'")


def _run_export(nsys: str, path: str, tmp: str, message: str, progress):
    """Run ``nsys export`` into ``tmp``; returns (exit code, last output, last percentage
    shown, whether it was killed for taking longer than EXPORT_TIMEOUT_S)."""
    tail = b""
    try:
        proc = subprocess.Popen([nsys, "export", "--type", "sqlite", "--force-overwrite", "true",
                                 "--output", tmp, path], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError as exc:
        raise ProfileError(path, f"cannot run nsys export ({exc.strerror})") from None
    # nsys redraws "Processing N events: [==42%   ]" with carriage returns, written in
    # pieces (a redraw can span reads): follow it on the text read so far
    timed_out = threading.Event()
    timer = threading.Timer(EXPORT_TIMEOUT_S, lambda: (timed_out.set(), proc.kill()))
    timer.start()
    shown = 0
    try:
        while chunk := proc.stdout.read1(4096):
            tail = (tail + chunk)[-4096:]
            pct = NSYS_PERCENT.findall(tail[-(len(chunk) + 128):])
            if progress and pct and int(pct[-1]) > shown:
                shown = min(int(pct[-1]), 100)
                progress(message, shown / 100)
        rc = proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
    return rc, tail, shown, timed_out


def export_nsys_rep(path: str, progress=None, scratch: str | None = None) -> str:
    """``nsys export --type sqlite`` into the cache, named by the report's content hash (so a
    renamed or moved report is not exported twice); reused while the report is unchanged.

    Nothing is written next to the report. When the cache cannot be written the export goes
    to ``scratch`` (a temporary dir the caller removes). ``progress(message, fraction)``
    follows nsys's own percentage.
    """
    try:
        key = _hash(path)
    except OSError as exc:
        raise ProfileError(path, f"cannot read ({exc.strerror})") from None
    base = cache_dir() or scratch
    if base is None:
        raise ProfileError(path, "no writable cache for the nsys export: set $PROFCLASS_CACHE to a writable directory")
    out = os.path.join(base, f"{key}.sqlite")
    if os.path.exists(out):  # exported before: nsys is not needed again
        return out
    nsys = nsys_binary()
    if nsys is None:
        where = f"$NSYS ({os.environ['NSYS']}) is not an executable" if os.environ.get("NSYS") else "nsys was not found"
        raise ProfileError(path, f"is an .nsys-rep report and {where}: " + NSYS_HELP)
    tmp = out + f".part{os.getpid()}"
    message = f"exporting {os.path.basename(path)} with nsys"
    if progress:
        progress(message, 0.0)
    rc, tail, shown, timed_out = _run_export(nsys, path, tmp, message, progress)
    if rc != 0 or not os.path.exists(tmp):
        with contextlib.suppress(OSError):
            os.remove(tmp)
        lines = [ln.strip() for ln in re.split(rb"[\r\n]+", tail) if ln.strip() and not NSYS_PERCENT.search(ln)]
        last = lines[-1].decode(errors="replace") if lines else f"exit status {rc}"
        if timed_out.is_set():
            last = f"no result after {EXPORT_TIMEOUT_S} s"
        raise ProfileError(path, f"nsys export failed: {last}")
    os.replace(tmp, out)
    if progress and shown < 100:
        progress(message, 1.0)
    return out


def _scratch_name(path: str, tmpdir: str) -> str:
    """A decompressed copy's path in ``tmpdir``: unique, the compression suffix dropped."""
    stem = re.sub(r"\.(zst|xz)$", "", os.path.basename(path))
    return os.path.join(tmpdir, f"{len(os.listdir(tmpdir))}-{stem}")


def _decompress_xz(path: str, tmpdir: str) -> str:
    """An .xz (lzma, Python's standard library) copy decompressed: xz keeps SQLite exports about
    a quarter smaller than zstd -19, which is how the larger fixtures are stored."""
    import lzma
    out = _scratch_name(path, tmpdir)
    try:
        with lzma.open(path, "rb") as fin, open(out, "wb") as fout:
            for chunk in iter(lambda: fin.read(1 << 20), b""):
                fout.write(chunk)
    except EOFError:
        raise ProfileError(path, "corrupt xz file (truncated: the compressed stream ends early)") from None
    except lzma.LZMAError as exc:
        raise ProfileError(path, f"corrupt xz file ({exc})") from None
    return out


def _decompress(path: str, tmpdir: str) -> str:
    import zstandard
    out = _scratch_name(path, tmpdir)
    try:
        with open(path, "rb") as fin, open(out, "wb") as fout:
            dctx = zstandard.ZstdDecompressor()
            dobj, complete = dctx.decompressobj(), True
            for chunk in iter(lambda: fin.read(1 << 20), b""):
                while chunk:  # one frame after another (pzstd and `cat a.zst b.zst` write several)
                    fout.write(dobj.decompress(chunk))
                    complete = dobj.eof  # a cut frame decompresses silently into a partial file
                    chunk = dobj.unused_data if complete else b""
                    if complete:
                        dobj = dctx.decompressobj()
    except zstandard.ZstdError as exc:
        raise ProfileError(path, f"corrupt zstd file ({exc})") from None
    if not complete:
        raise ProfileError(path, "corrupt zstd file (truncated: the compressed frame ends early)")
    return out


def _head(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(16)
    except OSError as exc:
        raise ProfileError(path, f"cannot read ({exc.strerror})") from None


def _check_sqlite_head(path: str, head: bytes) -> None:
    if len(head) == 0:
        raise ProfileError(path, "empty file")
    if head != SQLITE_MAGIC:
        raise ProfileError(path, "not an SQLite file (expected an nsys SQLite export, .sqlite.zst, .sqlite.xz or .nsys-rep)")


def check(paths: list[str]) -> None:
    """The checks ``resolve`` makes before any decompressing or exporting (missing, unreadable,
    empty, not SQLite): the command line runs them before it imports the pipeline, so bad
    input is refused in the interpreter's start-up time, not after a second of imports."""
    for f in _expand(list(paths)):
        head = _head(f)
        if not (head.startswith((ZSTD_MAGIC, XZ_MAGIC)) or f.endswith(".nsys-rep")):
            _check_sqlite_head(f, head)


@contextlib.contextmanager
def resolve(paths: list[str], progress=None):
    """Yield InputFiles for ``paths``; temporary decompressed copies vanish on exit.
    ``progress(message, fraction)`` follows .nsys-rep exports."""
    files = _expand(list(paths))
    with tempfile.TemporaryDirectory(prefix="profclass-") as tmpdir:
        out = []
        for f in files:
            head = _head(f)
            if head.startswith(ZSTD_MAGIC) or head.startswith(XZ_MAGIC):
                sqlite = (_decompress if head.startswith(ZSTD_MAGIC) else _decompress_xz)(f, tmpdir)
                with open(sqlite, "rb") as fh:
                    head = fh.read(16)
            elif f.endswith(".nsys-rep"):
                sqlite = export_nsys_rep(f, progress=progress, scratch=tmpdir)
                head = SQLITE_MAGIC
            else:
                sqlite = f
            _check_sqlite_head(f, head)
            out.append(InputFile(given=f, sqlite=sqlite, rank_hint=rank_from_name(f)))
        yield out


def listed(paths: list[str]) -> list[InputFile]:
    """``paths`` as ``resolve`` would list them, checked (``check``) but not decompressed or
    exported: ``sqlite`` is the file itself for a plain SQLite export and None for the others,
    which whoever reads them resolves (``ranks.summarise_file``: a worker, per file)."""
    files = _expand(list(paths))
    check(files)
    return [InputFile(given=f, sqlite=None if f.endswith(".nsys-rep") or _head(f).startswith((ZSTD_MAGIC, XZ_MAGIC))
                      else f, rank_hint=rank_from_name(f)) for f in files]
