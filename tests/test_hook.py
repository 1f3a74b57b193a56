"""The post-job hook end to end: a script "trains", then calls profclass on a real fixture, the
way a training launcher would (Python API and CLI); reports land beside the profile (or in
--out), one line goes to the log, and the exit code is 0 unless a failure was asked for."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import profile_path

from profclass.hook import _targets, report_stem

TRAIN = textwrap.dedent('''
    """A tiny "training job": SGD on a linear model, one log line per step, then the hook."""
    import json
    import sys

    import numpy as np

    rng = np.random.default_rng(0)
    X = rng.normal(size=(256, 8))
    y = X @ rng.normal(size=8)
    w = np.zeros(8)
    for step in range(20):
        w -= 0.1 * X.T @ (X @ w - y) / len(y)
        print(f"step {step} loss {np.mean((X @ w - y) ** 2):.6f}", flush=True)

    if len(sys.argv) > 1:  # the post-job hook, through the Python API
        import profclass
        res = profclass.run_hook(**json.loads(sys.argv[1]))
        for m in res.messages:
            print(m, file=sys.stderr)
        print(res.summary)
        sys.exit(res.exit_code)
''')


def profclass_cmd() -> str:
    script = Path(sys.executable).parent / "profclass"
    return str(script) if script.exists() else f'{sys.executable} -c "from profclass.cli import main; main()"'


@pytest.fixture
def job(tmp_path):
    """A job directory holding the training script."""
    (tmp_path / "train.py").write_text(TRAIN)
    return tmp_path


def copy_profile(name: str, dest: Path) -> Path:
    src = profile_path(name)
    out = dest / src.name
    if src.is_dir():
        shutil.copytree(src, out)
    else:
        shutil.copy(src, out)
    return out


def run_api(job: Path, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(job / "train.py"), json.dumps(kwargs)], cwd=job,
                          capture_output=True, text=True, timeout=300)


def check_training_ran(stdout: str) -> list[str]:
    lines = stdout.strip().splitlines()
    losses = [float(x.split()[-1]) for x in lines if x.startswith("step ")]
    assert len(losses) == 20 and losses[-1] < 0.1 * losses[0]
    return lines


def test_api_hook_writes_reports_beside_the_profile(job):
    prof = copy_profile("host_1gpu", job)
    p = run_api(job, profiles=str(prof))
    assert p.returncode == 0, p.stderr
    lines = check_training_ran(p.stdout)
    summary = lines[-1]
    assert summary.startswith("profclass: host wall") and "step " in summary
    js, md = job / "host_1gpu.profclass.json", job / "host_1gpu.profclass.md"
    assert summary.endswith(f"report {js}")
    doc = json.loads(js.read_text())
    assert doc["exit_code"] == 0 and doc["diff"] is None
    assert doc["diagnosis"]["verdict"]["wall"] == "host"
    assert doc["diagnosis"]["kernels"]
    assert doc["summary"] in summary
    assert md.read_text().startswith("## profclass: **host** wall")
    assert prof.stat().st_size == profile_path("host_1gpu").stat().st_size  # input untouched


def test_api_hook_fail_on_exits_3(job):
    prof = copy_profile("host_1gpu", job)
    p = run_api(job, profiles=[str(prof)], fail_on=["memory", "host"], out=str(job / "reports"))
    assert p.returncode == 3, p.stderr
    summary = check_training_ran(p.stdout)[-1]
    assert "FAIL: host wall" in summary
    assert json.loads((job / "reports" / "host_1gpu.profclass.json").read_text())["exit_code"] == 3
    assert not (job / "host_1gpu.profclass.json").exists()  # --out given: nothing beside the profile


def test_api_hook_regression_against_baseline_exits_4(job):
    prof = copy_profile("compute_4gpu_syncs", job)
    p = run_api(job, profiles=str(prof), baseline=str(profile_path("compute_4gpu")), fail_above=5)
    assert p.returncode == 4, p.stderr
    summary = check_training_ran(p.stdout)[-1]
    assert "vs baseline: regression" in summary and "host +" in summary and "FAIL: slower by more than 5%" in summary
    doc = json.loads((job / "compute_4gpu_syncs.profclass.json").read_text())
    assert doc["exit_code"] == 4
    assert doc["diff"]["regression"] and doc["diff"]["significant"]
    assert doc["diff"]["verdict"]["wall"] == "host"
    md = (job / "compute_4gpu_syncs.profclass.md").read_text()
    assert "## profclass diff: **Regression**" in md
    # the same regression under a looser threshold, and the stored record as the next baseline
    p = run_api(job, profiles=str(prof), baseline=str(profile_path("compute_4gpu")), fail_above=20,
                out=str(job / "loose"))
    assert p.returncode == 0, p.stderr
    p = run_api(job, profiles=str(prof), baseline=str(job / "compute_4gpu_syncs.profclass.json"), fail_above=1,
                out=str(job / "self"))
    assert p.returncode == 0, p.stderr
    assert "vs baseline: no significant change" in p.stdout.strip().splitlines()[-1]


def test_cli_hook_after_training_in_a_launcher_script(job):
    """The documented shell pattern: train, then `profclass hook` on the job's rank files."""
    ranks = copy_profile("imbalance_4gpu_perrank", job)
    launcher = job / "launch.sh"
    launcher.write_text(textwrap.dedent(f'''\
        set -u
        {sys.executable} train.py
        status=$?
        {profclass_cmd()} hook {ranks} --fail-above 50 --baseline {profile_path("imbalance_4gpu")}
        hook_status=$?
        echo "hook exit $hook_status"
        exit $status
        '''))
    p = subprocess.run(["bash", str(launcher)], cwd=job, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = check_training_ran(p.stdout)
    assert lines[-1] == "hook exit 0"
    summary = lines[-2]
    assert summary.startswith("profclass: ") and "vs baseline: no significant change" in summary
    # a directory of rank files: the reports are named after it and written beside it
    doc = json.loads((job / "imbalance_4gpu_perrank.profclass.json").read_text())
    assert len(doc["diagnosis"]["devices"]) == 4
    assert (job / "imbalance_4gpu_perrank.profclass.md").exists()
    assert sorted(os.listdir(ranks)) == sorted(os.listdir(profile_path("imbalance_4gpu_perrank")))


def test_cli_hook_never_fails_the_job_on_bad_input(job):
    missing = job / "crashed-before-writing.nsys-rep"
    cmd = profclass_cmd()
    p = subprocess.run(f"{cmd} hook {missing}", shell=True, cwd=job, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0
    assert p.stderr.strip() == f"profclass: error: {missing}: no such file or directory"
    assert p.stdout == "" and "Traceback" not in p.stderr
    p = subprocess.run(f"{cmd} hook {missing} --strict", shell=True, cwd=job, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2
    assert list(job.iterdir()) == [job / "train.py"]


def test_unwritable_directory_falls_back_to_cwd(tmp_path, monkeypatch):
    """/proc is unwritable even for root: the reports go to the current directory, with a note."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc")
    monkeypatch.chdir(tmp_path)
    js, md, notes = _targets(["/proc/self/run.sqlite"], None)
    assert js == str(tmp_path / "run.profclass.json") and md == str(tmp_path / "run.profclass.md")
    assert notes == [f"profclass: note: /proc/self is not writable; writing the reports to {tmp_path}"]
    js, _, notes = _targets(["/proc/self/run.sqlite"], str(tmp_path / "out"))
    assert js == str(tmp_path / "out" / "run.profclass.json") and not notes


def test_report_stem():
    assert report_stem(["/a/b/run.nsys-rep"]) == ("/a/b", "run")
    assert report_stem(["/a/b/run.sqlite.zst"]) == ("/a/b", "run")
    assert report_stem(["/a/b/job_rank0.sqlite", "/a/b/job_rank1.sqlite"]) == ("/a/b", "job")
    assert report_stem(["/a/b/rank0.sqlite", "/a/b/rank1.sqlite"]) == ("/a/b", "profile")


def test_hook_diff_decided_on_both_runs_logs(job):
    """Drop-and-pad against its dropless baseline: the captured windows (two iterations a side)
    cannot call the 22% change; with the job's log (--train-log) and the baseline's
    (--baseline-log), call IA's untraced reruns, the hook's diff calls it an improvement, as the
    other replicate's runs have it (docs/diff.md)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    import gain_pairs
    logs = {}
    for side, name in (("base", "ia_ia_moe1_learned_u1.log"), ("job", "ia_ia_moe1_capacity_u1.log")):
        logs[side] = job / name
        logs[side].write_text(gain_pairs.timer_text(f"fixtures/timers/s49/{name}"))
    prof = copy_profile("mcore_moe1_padded", job)
    base = str(profile_path("mcore_moe1_dropless"))
    p = run_api(job, profiles=str(prof), baseline=base, train_log=str(logs["job"]), baseline_log=str(logs["base"]))
    assert p.returncode == 0, p.stderr
    assert "vs baseline: improvement" in p.stdout and "by the runs' timers" in p.stdout
    doc = json.loads((job / "mcore_moe1_padded.profclass.json").read_text())
    assert doc["diff"]["step"]["timer"]["test"]["significant"] and doc["diff"]["step"]["test"]["significant"] is False
    # an unreadable baseline log: the diff goes on with the windows, and says so
    p = run_api(job, profiles=str(prof), baseline=base, train_log=str(logs["job"]), baseline_log=str(job / "none.log"),
                out=str(job / "nolog"))
    assert p.returncode == 0 and "decided on the captured windows" in p.stderr
    assert "vs baseline: no significant change" in p.stdout
    # the CLI refuses a baseline log with nothing to compare it with
    cli = subprocess.run(f"{profclass_cmd()} hook {prof} --baseline {base} --baseline-log {logs['base']}",
                         shell=True, capture_output=True, text=True, timeout=300)
    assert cli.returncode == 2 and "--baseline-log" in cli.stderr
