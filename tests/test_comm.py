"""Multi-rank analysis on a built 3-rank job: collective matching, wait vs transfer,
stragglers, clock alignment of one-report-per-rank captures.

Every step (20 ms, NVTX "iteration i") on rank r:  compute [t, t + c_r), then an
all-to-all from t + c_r until t + 12 ms (it finishes 2 ms after the last rank arrives at
t + 10 ms), then compute [t + 12, t + 18), then 2 ms idle. The hot rank has c = 10 ms, the
others 4 ms, so each of them waits 6 ms per step and transfers 2 ms.

Hand-worked expectations (5 NVTX iterations; the last has no next start, so the window
holds the 4 whole start-to-start steps, 4 * 20 = 80 ms, 20 ms per step):
  hot rank:    compute 16 ms/step, exposed comm 2, idle 2
  other ranks: compute 10 ms/step, exposed comm 8 (6 waiting + 2 transfer), idle 2
  blame: every instance the hot rank arrives 6 ms after the median arrival -> 6 ms/step
  job walls with the waiting moved to the straggler's wall (compute): compute 16, comm 2,
  host 2 ms per step on every rank.
"""
import pytest

import profclass
from profclass.fixes import predict_by_id
from nsys_builder import NsysExportBuilder

MS = 1_000_000
T0 = 50_000_000_000
STEP, STEPS = 20, 5
A2A_SHORT = "ncclDevKernel_SendRecv"
A2A = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


def add_rank(b, *, pid, device, compute_ms, clock=0, end_jitter=(0,) * STEPS, extra_leading=False):
    """One rank's steps; ``clock`` is what this report's clock reads minus true time."""
    b.add_gpu(device)
    for i in range(STEPS):
        t = T0 + i * STEP * MS + clock
        b.add_nvtx(f"iteration {i}", t - MS, t + (STEP - 1) * MS, pid=pid)
        c = compute_ms[i] if isinstance(compute_ms, tuple) else compute_ms  # per step, or one for all
        b.add_kernel(t, t + c * MS, "sm90_xmma_gemm_bf16", device=device, pid=pid,
                     launch=(t - MS // 2, t - MS // 2 + 5_000))
        b.add_kernel(t + c * MS, t + 12 * MS + end_jitter[i], A2A_SHORT, demangled=A2A,
                     device=device, pid=pid, stream=20, launch=(t - 4 * MS // 10, t - 4 * MS // 10 + 5_000))
        b.add_kernel(t + 12 * MS, t + 18 * MS, "vectorized_elementwise_kernel", device=device, pid=pid,
                     launch=(t - 3 * MS // 10, t - 3 * MS // 10 + 5_000))
    if extra_leading:  # the capture caught one collective of the step before the first
        t = T0 - 15 * MS + clock
        b.add_kernel(t, t + 2 * MS, A2A_SHORT, demangled=A2A, device=device, pid=pid, stream=20,
                     launch=(t - MS // 2, t - MS // 2 + 5_000))


def one_report(path, computes=(10, 4, 4), extra_leading_rank=None, command=None):
    b = NsysExportBuilder(path)
    for r, c in enumerate(computes):
        add_rank(b, pid=201 + r, device=r, compute_ms=c, extra_leading=(r == extra_leading_rank))
    if command:
        b.add_meta_command(command)
    b.write()
    return path


def check_imbalanced_job(d, hot_rank, exact=True):
    approx = (lambda x: x) if exact else (lambda x: pytest.approx(x, abs=0.01))
    assert d.window["source"] == "nvtx"
    assert d.window["iterations"] == STEPS - 1
    (row,) = d.collectives
    assert row["collective"] == "all_to_all" and row["group"] == "EP"
    assert row["instances"] == STEPS - 1
    # per step, mean over the 3 ranks: transfer 2 ms each; waiting (0 + 6 + 6) / 3 = 4 ms
    assert row["transfer_ms_per_step"] == approx(2.0)
    assert row["wait_ms_per_step"] == approx(4.0)
    assert row["exposed_wait_ms_per_step"] == approx(4.0)
    assert row["overlapped_ms_per_step"] == approx(0.0)
    (s,) = d.stragglers
    assert s["rank"] == hot_rank
    assert s["reason"] == "imbalance"
    assert s["cost_ms_per_step"] == approx(6.0)
    assert s["others_wait_ms_per_step"] == approx(6.0)
    assert s["blame_share"] == 1.0
    assert d.verdict["wall"] == "compute" and d.verdict["rule"] == "straggler"
    # the runner-up is the next score (communication and host hold 10% each: the thresholds decide)
    sc = d.verdict["scores"]
    assert d.verdict["runner_up"] == max((w for w in sc if w != "compute"), key=sc.get)
    assert d.verdict["straggler_blame_share"] == 1.0  # the one straggler causes all the waiting
    assert d.walls["compute"]["share"] == approx(round(16 / 20, 4))
    assert d.walls["communication"]["share"] == approx(round(2 / 20, 4))
    assert d.walls["host"]["share"] == approx(round(2 / 20, 4))
    by_rank = {dv["rank"]: dv for dv in d.devices}
    for r, dv in by_rank.items():
        assert dv["iterations"] == STEPS - 1
        assert dv["step_ms"] == 20.0
        waited = 0 if r == hot_rank else 6 * (STEPS - 1) * MS
        assert dv["comm"]["wait_ns"] == waited
        assert dv["comm"]["exposed_wait_ns"] == waited
        if exact:
            assert dv["comm"]["transfer_ns"] == 2 * (STEPS - 1) * MS
    assert by_rank[hot_rank]["walls"]["compute"]["ms_per_step"] == 16.0
    assert all(dv["walls"]["compute"]["ms_per_step"] == 10.0 for r, dv in by_rank.items() if r != hot_rank)


def test_one_report_several_processes(tmp_path):
    d = profclass.diagnose(str(one_report(tmp_path / "job.sqlite")))
    check_imbalanced_job(d, hot_rank=0)
    assert d.clock == {}  # one report, one clock


def test_matching_survives_an_extra_leading_collective(tmp_path):
    # rank 1 holds one more all-to-all (before the first iteration): instances are matched
    # by end time, not by position, so nothing changes
    d = profclass.diagnose(str(one_report(tmp_path / "job.sqlite", extra_leading_rank=1)))
    check_imbalanced_job(d, hot_rank=0)


def test_moving_imbalance_is_priced_from_the_work_spread_between_syncs(tmp_path):
    """Four ranks; a different one holds 10 ms of work each step (the others 4): no straggler,
    but at each all-to-all all wait for that step's busiest rank. Between consecutive
    all-to-alls (end of one to start of the next) a rank computes 6 + c ms: 16 on the busiest,
    10 on the others, so the spread over the mean is 16 - 11.5 = 4.5 ms a segment; 3 segments
    lie whole inside the 4-step window: 13.5 / 4 = 3.375 ms per step."""
    rotating = [tuple(10 if i % 4 == r else 4 for i in range(STEPS)) for r in range(4)]
    # the launch line names EP 4: the profile shows a MoE job (routing advice needs one)
    moe = ["python", "train.py", "--expert-model-parallel-size", "4"]
    d = profclass.diagnose(str(one_report(tmp_path / "job.sqlite", computes=rotating, command=moe)))
    assert d.stragglers == []
    assert d.numbers["ep_work_imbalance_ms"] == pytest.approx(3.375)
    # the share model prices the spread (the export has no backward or optimizer kernels, so its
    # scope is "other" and routing advice is not offered on it: the corpus's EP captures are)
    share = predict_by_id("ep_balance_routing", d.numbers, d.window["step_ms"]["mean"])
    assert share["expected_gain_ms"] == pytest.approx(3.375, abs=0.01)
    assert share["gain_low_ms"] == pytest.approx(3.375 / 2, abs=0.01)
    evidence = {e["metric"]: e["value"] for e in d.evidence}
    assert evidence["EP work imbalance"] == pytest.approx(3.375)
    # the same work on every rank: no spread, and the fix is not offered
    even = profclass.diagnose(str(one_report(tmp_path / "even.sqlite", computes=(7, 7, 7), command=moe)))
    assert even.numbers["ep_work_imbalance_ms"] == 0.0
    assert "ep_balance_routing" not in [f["id"] for f in even.fixes]


def test_balanced_job_has_no_straggler_and_no_waiting(tmp_path):
    d = profclass.diagnose(str(one_report(tmp_path / "job.sqlite", computes=(7, 7, 7))))
    assert d.stragglers == []
    (row,) = d.collectives
    assert row["wait_ms_per_step"] == 0.0
    assert row["transfer_ms_per_step"] == 5.0  # [t + 7, t + 12)
    assert row["exposed_transfer_ms_per_step"] == 5.0


# one report per rank: file name order, RANK, session start and clock error all differ.
# (file, RANK, session start offset, clock error not explained by the session start,
#  jitter of this rank's collective end times)
PER_RANK = [
    ("a.sqlite", 2, 0, 0, (0,) * STEPS),
    ("b.sqlite", 0, 3_000_000_000, 7 * MS, (0, 1_000, -1_000, 2_000, 0)),
    ("c.sqlite", 1, -1_500_000_000, -4 * MS, (0,) * STEPS),
]
SESSION_START = 1_795_659_794_000_000_000


def per_rank_job(directory):
    directory.mkdir()
    for name, rank, offset, error, jitter in PER_RANK:
        b = NsysExportBuilder(directory / name, session_start_ns=SESSION_START + offset)
        b.add_meta_command(["python3", "moe_train.py"], env={"RANK": str(rank), "WORLD_SIZE": "3"})
        # a report's clock reads true time minus its session start offset, plus its error
        add_rank(b, pid=300 + rank, device=0, compute_ms=10 if rank == 0 else 4, clock=error - offset,
                 end_jitter=jitter)
        b.write()
    return directory


def test_one_report_per_rank_clock_alignment(tmp_path):
    d = profclass.diagnose(str(per_rank_job(tmp_path / "job")))
    assert sorted(dv["rank"] for dv in d.devices) == [0, 1, 2]
    assert {dv["file"].rsplit("/", 1)[-1]: dv["rank"] for dv in d.devices} == {"a.sqlite": 2, "b.sqlite": 0,
                                                                               "c.sqlite": 1}
    # after the session-start shift, the collective end times align b and c to a; the
    # residual is the median deviation of b's jittered ends (0, 1, 1, 2, 0 us) and 0 for c
    assert d.clock == {"aligned_sources": 2, "residual_skew_ns": {1: 1_000, 2: 0}}
    check_imbalanced_job(d, hot_rank=0, exact=False)


def test_per_rank_without_session_start_still_aligns_on_collectives(tmp_path):
    directory = tmp_path / "job"
    directory.mkdir()
    for name, rank, offset, error, _ in PER_RANK:
        b = NsysExportBuilder(directory / name, drop_tables=["TARGET_INFO_SESSION_START_TIME"])
        b.add_meta_command(["python3", "moe_train.py"], env={"RANK": str(rank)})
        add_rank(b, pid=300 + rank, device=0, compute_ms=10 if rank == 0 else 4, clock=error - offset)
        b.write()
    d = profclass.diagnose(str(directory))
    assert d.clock == {"aligned_sources": 2, "residual_skew_ns": {1: 0, 2: 0}}
    check_imbalanced_job(d, hot_rank=0)


def test_lone_waits_take_the_low_end_of_each_size_class_as_transfer():
    """A lone rank of a 2-rank group: in each (stream, name, grid, block) class the 1/4
    quantile of the kernel times is the transfer and the rest of each kernel is waiting;
    a class of other messages (another channel count) keeps its own transfer."""
    import numpy as np
    import pandas as pd

    from profclass.analyzers.matching import _lone_waits
    small = [100, 100, 100, 100, 500, 900, 1300, 1700]  # 1/4 quantile: 100
    big = [10_000, 10_000, 10_000, 10_000]  # one size, never waited: all transfer
    d = small + big
    sub = pd.DataFrame({"start": np.zeros(len(d), np.int64), "end": np.array(d, np.int64),
                        "stream": 7, "name": "ncclDevKernel_SendRecv",
                        "grid": [4] * len(small) + [32] * len(big), "block": 640})
    wait = _lone_waits(sub, 2)
    assert wait.tolist() == [0, 0, 0, 0, 400, 800, 1200, 1600, 0, 0, 0, 0]
