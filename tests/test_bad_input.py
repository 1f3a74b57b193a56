"""Bad input: the CLI answers with one line naming the file and the problem, exits 2, never
prints a traceback, and leaves the input as it found it. Real fixtures wherever the case can
be made from one; built exports (the shared builder) where it cannot."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zstandard

from conftest import decompress_fixture
from nsys_builder import NsysExportBuilder

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT / "fixtures" / "profiles"
CLI = [str(Path(sys.executable).parent / "profclass")]
MS = 1_000_000
T0 = 7_000_000_000


def run(*args, env=None, cwd=None):
    e = dict(os.environ, **(env or {}))
    e.pop("PROFCLASS_DEBUG", None)
    p = subprocess.run([*CLI, "diagnose", *map(str, args)], capture_output=True, text=True, env=e,
                       cwd=cwd, timeout=120)
    return p.returncode, p.stdout, p.stderr


def assert_bad_input(args, path, problem, env=None):
    rc, out, err = run(*args, env=env)
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.endswith("\n"), err  # exactly one line
    assert err.startswith(f"profclass: error: {path}: "), err
    assert problem in err, err
    assert out == ""
    return err


def sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def host_export(tmp_path_factory) -> Path:
    """The real host_1gpu export, uncompressed (read-only, as a job's output often is)."""
    p = decompress_fixture(PROFILES / "host_1gpu.sqlite.xz", tmp_path_factory.mktemp("real") / "host_1gpu.sqlite")
    p.chmod(0o444)
    return p


def small_job(path: Path, *, kernels=True, command=("python3", "train.py", "--ep", "4"), env=None,
              session_start_ns=1_795_659_794_721_005_514, **builder_args) -> Path:
    """A built export: one GPU, five NVTX iterations of two kernels each."""
    b = NsysExportBuilder(path, session_start_ns=session_start_ns, **builder_args)
    b.add_gpu(0)
    for i in range(5):
        s = T0 + i * 10 * MS
        b.add_nvtx(f"iteration {i}", s - MS, s + 9 * MS)
        if kernels:
            b.add_kernel(s, s + 4 * MS, "sm90_xmma_gemm_bf16bf16", launch=(s - MS // 2, s - MS // 2 + 5000))
            b.add_kernel(s + 4 * MS, s + 6 * MS, "vectorized_elementwise_kernel",
                         launch=(s - MS // 4, s - MS // 4 + 5000))
    b.add_meta_command(list(command), env)
    return b.write()


# -- files that are not profiles -------------------------------------------------------------

def test_missing_file(tmp_path):
    assert_bad_input([tmp_path / "nope.sqlite"], tmp_path / "nope.sqlite", "no such file or directory")


def test_directory_without_profiles(tmp_path):
    (tmp_path / "notes.txt").write_text("no profiles here")
    assert_bad_input([tmp_path], tmp_path, "directory holds no profiles")


def test_not_sqlite(tmp_path):
    f = tmp_path / "report.sqlite"
    f.write_text("this is a log file, not an export\n")
    assert_bad_input([f], f, "not an SQLite file")


def test_empty_file(tmp_path):
    f = tmp_path / "empty.sqlite"
    f.touch()
    assert_bad_input([f], f, "empty file")


# the corpus's one zstd export (the others are xz): an older nsys release's, a real export that holds no
# kernels (tests/test_schemas.py reads it), which is all the reader's tests need
ZST = PROFILES / "schemas" / "host_1gpu_nsys2023.4.4_no_cuda_events.sqlite.zst"


def test_corrupt_zstd(tmp_path):
    f = tmp_path / "cut.sqlite.zst"
    f.write_bytes(ZST.read_bytes()[:ZST.stat().st_size // 2])
    assert_bad_input([f], f, "corrupt zstd file")


@pytest.mark.parametrize("keep", [0.05, 0.5])
def test_truncated_sqlite(tmp_path, host_export, keep):
    f = tmp_path / "truncated.sqlite"
    data = host_export.read_bytes()
    f.write_bytes(data[: int(len(data) * keep)])
    assert_bad_input([f], f, "corrupt or truncated SQLite file")


def test_corrupted_sqlite_page(tmp_path, host_export):
    # zero the page that holds the kernel table's root: the schema reads, the kernels don't
    f = tmp_path / "corrupt.sqlite"
    shutil.copyfile(host_export, f)
    con = sqlite3.connect(f"file:{host_export}?mode=ro", uri=True)
    root, = con.execute("SELECT rootpage FROM sqlite_master WHERE name='CUPTI_ACTIVITY_KIND_KERNEL'").fetchone()
    page, = con.execute("PRAGMA page_size").fetchone()
    con.close()
    data = bytearray(f.read_bytes())
    data[(root - 1) * page: root * page] = b"\xa5" * page
    f.write_bytes(bytes(data))
    assert_bad_input([f], f, "corrupt or truncated SQLite file")


def test_schema_name_not_utf8(tmp_path, host_export):
    """A flipped byte in a table's name in sqlite_master: SQLite reports the schema malformed
    quoting the damaged name, and Python's sqlite3 fails to decode that message (found by
    the fuzzer: UnicodeDecodeError escaped the loader)."""
    f = tmp_path / "flipped.sqlite"
    data = bytearray(host_export.read_bytes())
    at = data.find(b"tableENUM_OPENGL_DEBUG_SEVERITYENUM_OPENGL_DEBUG_SEVERITY")
    assert at > 0
    data[at + len("tableENUM_OPENGL_DEBUG_SEVERI")] ^= 0xFF
    f.write_bytes(bytes(data))
    assert_bad_input([f], f, "corrupt or truncated SQLite file (damaged schema: its text is not UTF-8)")


def test_sqlite_not_nsys(tmp_path):
    f = tmp_path / "app.sqlite"
    con = sqlite3.connect(f)
    con.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
    con.commit()
    con.close()
    assert_bad_input([f], f, "not an Nsight Systems export")


# -- exports without what a diagnosis needs --------------------------------------------------

def test_no_kernel_table(tmp_path):
    f = small_job(tmp_path / "cpu_only.sqlite", drop_tables=["CUPTI_ACTIVITY_KIND_KERNEL"])
    assert_bad_input([f], f, "no GPU kernels in the profile")


def test_empty_kernel_table(tmp_path):
    f = small_job(tmp_path / "no_kernels.sqlite", kernels=False)
    assert_bad_input([f], f, "no GPU kernels in the profile")


def test_shorter_than_one_iteration(tmp_path, host_export):
    """A capture cut inside one iteration (a too-short --duration): diagnosed as one window,
    and the report says so."""
    f = tmp_path / "short.sqlite"
    shutil.copyfile(host_export, f)
    f.chmod(0o644)
    con = sqlite3.connect(f)
    (s, e), = con.execute("SELECT start, end FROM NVTX_EVENTS WHERE text = 'iteration 5'").fetchall()
    # keep the first 15 kernels of iteration 5 (and what overlaps them) and nothing else
    hi, = con.execute("SELECT max(end) FROM (SELECT end FROM CUPTI_ACTIVITY_KIND_KERNEL WHERE start >= ? "
                      "ORDER BY start LIMIT 15)", (s,)).fetchone()
    for t in ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "CUPTI_ACTIVITY_KIND_MEMSET",
              "CUPTI_ACTIVITY_KIND_RUNTIME", "NVTX_EVENTS"):
        con.execute(f'DELETE FROM {t} WHERE start < ? OR coalesce("end", start) > ?', (s, hi))
    con.commit()
    con.close()
    rc, out, err = run(f, "--format", "json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["window"]["source"] == "whole"
    assert d["window"]["iterations"] == 1
    assert any("whole capture was diagnosed as one window" in m and "shorter than one iteration" in m
               for m in d["missing"])
    assert d["walls"]["host"]["ms_per_step"] > 0  # still a diagnosis, with its numbers


# -- files being written, missing tools ------------------------------------------------------

def test_locked_database(tmp_path, host_export):
    """nsys holds a write lock while it writes the export: a short wait, then a clear error,
    and the writer's transaction is untouched."""
    f = tmp_path / "being_written.sqlite"
    shutil.copyfile(host_export, f)
    f.chmod(0o644)
    writer = sqlite3.connect(f, isolation_level=None)
    writer.execute("BEGIN EXCLUSIVE")
    writer.execute("CREATE TABLE still_writing (x)")
    try:
        assert_bad_input([f], f, "database is locked (is nsys still writing it?)",
                         env={"PROFCLASS_BUSY_TIMEOUT": "0.2"})
    finally:
        writer.execute("COMMIT")
        writer.close()
    # once the writer is done, the same file diagnoses
    rc, out, err = run(f, "--format", "json")
    assert rc == 0, err


def test_lock_released_within_busy_timeout(tmp_path, host_export):
    f = tmp_path / "finishing.sqlite"
    shutil.copyfile(host_export, f)
    f.chmod(0o644)
    writer = sqlite3.connect(f, isolation_level=None, check_same_thread=False)
    writer.execute("BEGIN EXCLUSIVE")
    threading.Timer(1.0, lambda: (writer.execute("COMMIT"), writer.close())).start()
    rc, out, err = run(f, "--format", "json", env={"PROFCLASS_BUSY_TIMEOUT": "30"})
    assert rc == 0, err


def test_hot_journal(tmp_path, host_export):
    """nsys killed mid-write leaves a hot -journal; rolling it back would write: refuse."""
    d = tmp_path / "killed"
    d.mkdir()
    f = d / "run.sqlite"
    shutil.copyfile(host_export, f)
    f.chmod(0o644)
    # make a real hot journal: a process dies holding an uncommitted write transaction
    code = ("import sqlite3, os; c = sqlite3.connect(%r, isolation_level=None); "
            "c.execute('PRAGMA cache_size=1'); c.execute('BEGIN'); "
            "c.execute('DELETE FROM CUPTI_ACTIVITY_KIND_KERNEL'); os._exit(0)") % str(f)
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (d / "run.sqlite-journal").exists()
    before = (sha(f), sha(d / "run.sqlite-journal"))
    assert_bad_input([f], f, "unfinished write")
    assert (sha(f), sha(d / "run.sqlite-journal")) == before


def test_nsys_rep_without_nsys(tmp_path):
    rep = PROFILES / "tiny_host_1gpu.nsys-rep"
    assert_bad_input([rep], rep, "is an .nsys-rep report and $NSYS (/nonexistent/nsys) is not an executable",
                     env={"NSYS": "/nonexistent/nsys", "PROFCLASS_CACHE": str(tmp_path / "cache")})


def test_nsys_rep_not_found_anywhere(monkeypatch, tmp_path):
    """No $NSYS, nothing on PATH, no default install: the message says how to get one."""
    from profclass import inputs
    from profclass.errors import ProfileError
    monkeypatch.delenv("NSYS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("PROFCLASS_CACHE", str(tmp_path / "cache"))  # no earlier export to reuse
    monkeypatch.setattr(inputs.os.path, "isfile", lambda p: False)
    assert inputs.nsys_binary() is None
    with pytest.raises(ProfileError, match="nsys was not found: .*put nsys on PATH"):
        inputs.export_nsys_rep(str(PROFILES / "tiny_host_1gpu.nsys-rep"))


def test_damaged_nsys_rep(tmp_path, nsys):
    f = tmp_path / "cut.nsys-rep"
    f.write_bytes((PROFILES / "tiny_host_1gpu.nsys-rep").read_bytes()[:300_000])
    assert_bad_input([f], f, "nsys export failed: Exportation error: Section Table Reference magic number mismatch",
                     env={"PROFCLASS_CACHE": str(tmp_path / "cache"), "NSYS": nsys})
    assert not list((tmp_path / "cache").glob("*"))  # no partial export left in the cache


# -- several files ---------------------------------------------------------------------------

def test_directory_mixing_jobs(tmp_path):
    """Ranks 0-1 of the host-straggler run and ranks 2-3 of the comm run (real captures)."""
    d = tmp_path / "ranks"
    d.mkdir()
    for job, ranks in (("hoststraggler_4gpu", (0, 1)), ("comm_4gpu_nonvtx", (2, 3))):
        for r in ranks:
            shutil.copyfile(PROFILES / job / f"rank{r}.sqlite.xz", d / f"rank{r}.sqlite.xz")
    assert_bad_input([d], d, "files of different jobs: rank0.sqlite.xz ran")


def test_same_rank_twice(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    small_job(d / "run1_rank0.sqlite", env={"RANK": "0", "WORLD_SIZE": "2"})
    small_job(d / "run2_rank0.sqlite", env={"RANK": "0", "WORLD_SIZE": "2"})
    assert_bad_input([d], d, "run1_rank0.sqlite and run2_rank0.sqlite are both rank 0")


def test_captures_hours_apart(tmp_path):
    d = tmp_path / "ranks"
    d.mkdir()
    small_job(d / "rank0.sqlite", env={"RANK": "0"})
    small_job(d / "rank1.sqlite", env={"RANK": "1"}, session_start_ns=1_795_659_794_721_005_514 + 5 * 3600 * 10**9)
    assert_bad_input([d], d, "rank1.sqlite was captured 5.0 h after rank0.sqlite")


def test_different_job_ids(tmp_path):
    a, b = small_job(tmp_path / "a.sqlite", env={"SLURM_JOB_ID": "811"}), \
        small_job(tmp_path / "b.sqlite", env={"SLURM_JOB_ID": "812"})
    assert_bad_input([a, b], f"{a}, {b}", "a.sqlite has SLURM_JOB_ID=811 but b.sqlite has SLURM_JOB_ID=812")


def test_one_job_per_rank_args_differ(tmp_path):
    """--local-rank N differs between ranks of one job: still one job."""
    d = tmp_path / "ranks"
    d.mkdir()
    for r in (0, 1):
        small_job(d / f"rank{r}.sqlite", command=("python3", "train.py", f"--local-rank={r}"), env={"RANK": str(r)})
    rc, out, err = run(d, "--format", "json")
    assert rc == 0, err


# -- output ----------------------------------------------------------------------------------

def test_output_is_a_directory(tmp_path):
    f = small_job(tmp_path / "job.sqlite")
    assert_bad_input([f, "-o", tmp_path], tmp_path, "cannot write output (is a directory)")


def test_output_directory_missing(tmp_path):
    f = small_job(tmp_path / "job.sqlite")
    out = tmp_path / "no" / "such" / "report.json"
    assert_bad_input([f, "-o", out], out, "cannot write output (no such directory)")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_output_not_writable(tmp_path):
    f = small_job(tmp_path / "job.sqlite")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    assert_bad_input([f, "-o", ro / "r.json"], ro / "r.json", "cannot write output (permission denied)")


def test_output_full_device(tmp_path):
    """A write that fails at the end (a full disk): /dev/full is a real one."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    f = small_job(tmp_path / "job.sqlite")
    assert_bad_input([f, "-o", "/dev/full"], "/dev/full", "cannot write output")


# -- the last resort -------------------------------------------------------------------------

def test_unexpected_exception_is_one_line(monkeypatch):
    """Whatever escapes the core ends as one line and exit 2 (the group's last resort)."""
    import click
    from click.testing import CliRunner

    from profclass.cli import _Guarded

    @click.group(cls=_Guarded)
    def group():
        pass

    @group.command()
    def boom():
        {}["no such key"]

    monkeypatch.delenv("PROFCLASS_DEBUG", raising=False)
    r = CliRunner().invoke(group, ["boom"])
    assert r.exit_code == 2
    assert r.output == ("profclass: error: internal error (KeyError: 'no such key'); please report it "
                        "with the profile (PROFCLASS_DEBUG=1 shows the traceback)\n")


# -- nothing changed, nothing left -----------------------------------------------------------

def test_inputs_unchanged_and_no_temp_files(tmp_path):
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    inputs = [PROFILES / "comm_4gpu_nonvtx", PROFILES / "compute_1gpu.sqlite.xz"]
    files = sorted(p for i in inputs for p in ([i] if i.is_file() else i.iterdir()))
    before = {p: sha(p) for p in files}
    for i in inputs:
        rc, out, err = run(i, "--format", "json", env={"TMPDIR": str(tmpdir)})
        assert rc == 0, err
    assert {p: sha(p) for p in files} == before
    assert list(tmpdir.iterdir()) == []


def test_bad_iteration_regex(tmp_path):
    f = small_job(tmp_path / "job.sqlite")
    assert_bad_input([f, "--iteration-range", "iteration ("], "--iteration-range",
                     "not a valid regular expression (missing ), unterminated subpattern")


def test_corrupt_xz(tmp_path):
    import lzma
    payload = zstandard.ZstdDecompressor().decompressobj().decompress(ZST.read_bytes())
    f = tmp_path / "cut.sqlite.xz"
    whole = lzma.compress(payload)
    f.write_bytes(whole[:len(whole) // 2])
    assert_bad_input([f], f, "corrupt xz file")


def test_xz_reads_like_zst(tmp_path):
    """An .sqlite.zst is the same export as its .sqlite.xz: the same diagnosis."""
    import lzma

    import profclass
    src = PROFILES / "compute_1gpu_gpumetrics.sqlite.xz"
    f = tmp_path / "compute_1gpu_gpumetrics.sqlite.zst"
    f.write_bytes(zstandard.ZstdCompressor().compress(lzma.decompress(src.read_bytes())))
    a, b = (profclass.diagnose(str(p)).to_json().replace(str(p), "INPUT") for p in (src, f))
    assert a == b


def test_zst_of_several_frames_reads_whole(tmp_path):
    """The completeness check must not stop at the first frame (pzstd writes several)."""
    from profclass.inputs import _decompress
    payload = zstandard.ZstdDecompressor().decompressobj().decompress(
        ZST.read_bytes())
    z = zstandard.ZstdCompressor()
    half = len(payload) // 2
    f = tmp_path / "frames.sqlite.zst"
    f.write_bytes(z.compress(payload[:half]) + z.compress(payload[half:]))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert Path(_decompress(str(f), str(scratch))).read_bytes() == payload
