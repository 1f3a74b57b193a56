"""The .nsys-rep path with the real committed report and the real nsys 2024.2.3: export into a
content-hash cache, nothing written beside the input, progress from nsys's own percentage,
and one-line errors when nsys is absent or the report is corrupt."""
from __future__ import annotations

import hashlib
import os
import shutil
import stat

import pytest
from click.testing import CliRunner

import profclass
from profclass import inputs
from profclass.cli import main
from profclass.errors import ProfileError

from conftest import profile_path

REPORT = profile_path("tiny_host_1gpu")


def _listing(folder):
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir())


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def read_only_copy(tmp_path):
    """The report alone in a folder with no write bits (root ignores them, so the test also
    compares the folder's listing before and after)."""
    folder = tmp_path / "in"
    folder.mkdir()
    rep = folder / "job.nsys-rep"
    shutil.copyfile(REPORT, rep)
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    yield rep
    folder.chmod(stat.S_IRWXU)


def test_export_lands_in_the_hash_cache_and_nothing_beside_the_input(nsys, read_only_copy, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PROFCLASS_CACHE", str(cache))
    monkeypatch.setenv("NSYS", nsys)
    before, digest = _listing(read_only_copy.parent), _sha(read_only_copy)
    seen = []
    d = profclass.diagnose(str(read_only_copy), progress=lambda msg, fraction=None: seen.append((msg, fraction)))
    assert d.verdict["wall"] == "host"
    assert d.walls["host"]["share"] > 0.8
    assert _listing(read_only_copy.parent) == before and _sha(read_only_copy) == digest
    # the export is named by the content hash, and no partial file is left
    assert [p.name for p in cache.iterdir()] == [digest[:24] + ".sqlite"]
    # nsys's own percentage drove the bar: it rises to 100%
    export = [f for m, f in seen if m.startswith("exporting") and f is not None]
    assert export[0] == 0.0 and export[-1] == 1.0 and export == sorted(export) and len(export) > 10
    assert any(m.startswith("loading") for m, _ in seen) and any(m.startswith("analysing") for m, _ in seen)


def test_the_cached_export_is_reused_without_nsys(nsys, read_only_copy, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("PROFCLASS_CACHE", str(cache))
    monkeypatch.setenv("NSYS", nsys)
    first = profclass.diagnose(str(read_only_copy))
    exported = next(cache.iterdir())
    mtime = exported.stat().st_mtime_ns
    # a renamed copy elsewhere, and nsys gone: same content, same cached export
    other = tmp_path / "renamed.nsys-rep"
    shutil.copyfile(read_only_copy, other)
    monkeypatch.setenv("NSYS", str(tmp_path / "no-nsys-here"))
    again = profclass.diagnose(str(other))
    assert again.to_dict()["walls"] == first.to_dict()["walls"]
    assert exported.stat().st_mtime_ns == mtime and len(list(cache.iterdir())) == 1


def test_unwritable_cache_falls_back_to_a_scratch_dir(nsys, read_only_copy, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("PROFCLASS_CACHE", str(blocker / "cache"))  # cannot be created
    monkeypatch.setenv("NSYS", nsys)
    before = _listing(read_only_copy.parent)
    d = profclass.diagnose(str(read_only_copy))
    assert d.verdict["wall"] == "host"
    assert _listing(read_only_copy.parent) == before
    assert blocker.read_text() == "not a directory"


def test_absent_nsys_is_one_clear_line(read_only_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("PROFCLASS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("NSYS", raising=False)
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    monkeypatch.setenv("PATH", str(empty_bin))
    monkeypatch.setattr(inputs, "DEFAULT_NSYS", str(tmp_path / "opt" / "nsys"))
    result = CliRunner().invoke(main, ["diagnose", str(read_only_copy)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"profclass: error: {read_only_copy}: ")
    assert "nsys was not found" in lines[0] and "$NSYS" in lines[0] and "nsys export --type sqlite" in lines[0]


def test_nsys_named_by_env_must_exist(read_only_copy, tmp_path, monkeypatch):
    monkeypatch.setenv("PROFCLASS_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("NSYS", str(tmp_path / "missing-nsys"))
    with pytest.raises(ProfileError, match=r"\$NSYS \(.*missing-nsys\) is not an executable"):
        profclass.diagnose(str(read_only_copy))


def test_corrupt_report_reports_nsys_own_error(nsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PROFCLASS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("NSYS", nsys)
    bad = tmp_path / "truncated.nsys-rep"
    bad.write_bytes(REPORT.read_bytes()[:4096])
    result = CliRunner().invoke(main, ["diagnose", str(bad)])
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and line.startswith(f"profclass: error: {bad}: nsys export failed: ")
    assert "%" not in line  # nsys's progress redraws are not the message
    assert not [p for p in (tmp_path / "cache").iterdir()]  # no partial export left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "truncated.nsys-rep"]


def test_nsys_percentage_parser_reads_nsys_redraws():
    redraw = b"\rProcessing 19845 events: [==9%                      ]\rProcessing 19845 events: [=====16%    ]"
    assert [int(x) for x in inputs.NSYS_PERCENT.findall(redraw)] == [9, 16]
    assert os.path.basename(inputs.DEFAULT_NSYS) == "nsys"
