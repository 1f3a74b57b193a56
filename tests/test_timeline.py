"""Iterations and the steady-state window on hand-built timelines (times in ns, expected
values worked out by hand from the construction)."""
import numpy as np
import pytest

from nsys_builder import NsysExportBuilder
from profclass.analyzers.iterations import detect_iterations
from profclass.load import load
from profclass.timeline import build_ops, split_gpus

MS = 1_000_000
T0 = 5_000_000_000  # timestamps on a realistic clock, far from 0


def timelines(path, regex=None):
    prof = load(str(path))
    gpus = split_gpus(prof, 0, build_ops(prof))
    for g in gpus:
        detect_iterations(g, regex)
    return gpus


def nvtx_job(tmp_path, durations_ms, busy_ms, *, last_busy_ms=None, extra=None):
    """One GPU; iteration i is an NVTX range "iteration i" whose kernels (launched 0.2 ms
    before they run) keep the GPU busy for ``busy_ms`` from the iteration's start."""
    b = NsysExportBuilder(tmp_path / "job.sqlite")
    b.add_gpu(0)
    starts = T0 + np.r_[0, np.cumsum(durations_ms)[:-1]].astype(np.int64) * MS
    for i, (s, d) in enumerate(zip(starts.tolist(), durations_ms)):
        busy = busy_ms if (last_busy_ms is None or i < len(durations_ms) - 1) else last_busy_ms
        b.add_nvtx(f"iteration {i}", s - MS // 2, s + d * MS - MS // 2)
        # two kernels per iteration: a GEMM then an elementwise kernel
        half = busy * MS // 2
        b.add_kernel(s, s + half, "sm90_xmma_gemm_bf16", launch=(s - MS // 5, s - MS // 5 + 5_000))
        b.add_kernel(s + half, s + busy * MS, "vectorized_elementwise_kernel",
                     launch=(s - MS // 10, s - MS // 10 + 5_000))
    if extra:
        extra(b, starts)
    b.write()
    return starts


def test_nvtx_iterations_drop_warmup_and_truncated_last(tmp_path):
    # iteration 0 is a slow warm-up (30 ms); 1-4 are 10 ms; 5 was cut by the end of the
    # capture: its range stays open past the last kernel, which covers only 2 ms
    starts = nvtx_job(tmp_path, [30, 10, 10, 10, 10, 10], busy_ms=8, last_busy_ms=2)
    (g,) = timelines(tmp_path / "job.sqlite")
    assert g.window_source == "nvtx"
    its = g.iterations
    assert its["start"].tolist() == starts.tolist()
    assert its["label"].tolist() == [f"iteration {i}" for i in range(6)]
    # step spans run to the next iteration's start; the last one to its own GPU end
    assert its["step_end"].tolist() == starts[1:].tolist() + [int(starts[5]) + 2 * MS]
    assert its["steady"].tolist() == [False, True, True, True, True, False]
    assert g.window == (int(starts[1]), int(starts[5]))


def test_nvtx_iteration_extent_follows_launches_not_range(tmp_path):
    # a kernel launched inside iteration 1's range runs after the range closed: it belongs
    # to iteration 1 (GPU extent from the launch, not from the range)
    def late_kernel(b, starts):
        s1 = int(starts[1])
        b.add_kernel(s1 + 9_700_000, s1 + 9_900_000, "reduce_kernel",
                     launch=(s1 + 9_000_000, s1 + 9_005_000), stream=9)

    starts = nvtx_job(tmp_path, [10, 10, 10], busy_ms=5, extra=late_kernel)
    (g,) = timelines(tmp_path / "job.sqlite")
    its = g.iterations.set_index("label")
    assert its.loc["iteration 1", "end"] == int(starts[1]) + 9_900_000
    assert its.loc["iteration 0", "end"] == int(starts[0]) + 5 * MS


def test_nested_and_non_iteration_ranges_are_ignored(tmp_path):
    # "forward"/"backward" ranges and an inner "step 3" inside "iteration 3" must not add
    # iterations; only the outermost iteration ranges count
    def noise(b, starts):
        for i, s in enumerate(starts.tolist()):
            b.add_nvtx("forward", s - 100_000, s + 2 * MS)
            b.add_nvtx("backward", s + 2 * MS, s + 6 * MS)
            b.add_nvtx(f"step {i}", s - 200_000, s + 7 * MS)

    starts = nvtx_job(tmp_path, [10, 10, 10, 10], busy_ms=8, extra=noise)
    (g,) = timelines(tmp_path / "job.sqlite")
    assert g.window_source == "nvtx"
    assert g.iterations["start"].tolist() == starts.tolist()
    assert len(g.iterations) == 4


def test_iteration_regex_override(tmp_path):
    def custom(b, starts):
        for i, s in enumerate(starts.tolist()):
            b.add_nvtx(f"my_loop_{i}", s - 300_000, s + 9 * MS)

    starts = nvtx_job(tmp_path, [10, 10, 10], busy_ms=8, extra=custom)
    (g,) = timelines(tmp_path / "job.sqlite", regex=r"^my_loop_\d+$")
    assert g.iterations["label"].tolist() == ["my_loop_0", "my_loop_1", "my_loop_2"]


def periodic_job(path, steps=6, period_ms=10, whole_last=False):
    """No NVTX. Every step runs the same kernel sequence: A, B, C once and D three times
    (1 ms apart), each 0.5 ms long, launched 0.1 ms before it runs."""
    b = NsysExportBuilder(path)
    b.add_gpu(0)
    starts = [T0 + i * period_ms * MS for i in range(steps)]
    seq = [("kernel_A", 0), ("kernel_B", 1), ("kernel_C", 2), ("kernel_D", 3), ("kernel_D", 4),
           ("kernel_D", 5)]
    for s in starts:
        for name, at in seq:
            k0 = s + at * MS
            b.add_kernel(k0, k0 + MS // 2, name, launch=(k0 - MS // 10, k0 - MS // 10 + 4_000))
    if whole_last:  # a closing kernel makes the last step a whole period long
        end = starts[-1] + period_ms * MS
        b.add_kernel(end - MS // 2, end, "kernel_E", launch=(end - MS, end - MS + 4_000))
    b.write()
    return starts


def test_periodicity_without_nvtx(tmp_path):
    starts = periodic_job(tmp_path / "p.sqlite")
    (g,) = timelines(tmp_path / "p.sqlite")
    assert g.window_source == "periodicity"
    # the last step ends 5.5 ms after its marker, not a period: it is not an iteration
    assert g.iterations["start"].tolist() == starts[:5]
    assert g.iterations["end"].tolist() == starts[1:]
    assert g.iterations["steady"].all()
    assert g.window == (starts[0], starts[5])


def test_periodicity_keeps_a_whole_last_step(tmp_path):
    starts = periodic_job(tmp_path / "p.sqlite", whole_last=True)
    (g,) = timelines(tmp_path / "p.sqlite")
    assert g.window_source == "periodicity"
    assert g.iterations["start"].tolist() == starts
    assert g.window == (starts[0], starts[-1] + 10 * MS)


def test_periodicity_ignores_a_single_irregular_name(tmp_path):
    # kernels at irregular times must not be taken for the step: without a period the
    # whole capture is the window
    b = NsysExportBuilder(tmp_path / "irr.sqlite")
    b.add_gpu(0)
    rng = np.random.default_rng(7)
    times = np.sort(rng.choice(np.arange(1000), size=40, replace=False)) * 100_000 + T0
    for i, t in enumerate(times.tolist()):
        b.add_kernel(t, t + 50_000, f"kernel_{i % 2}_{i}", launch=(t - 20_000, t - 19_000))
    b.write()
    (g,) = timelines(tmp_path / "irr.sqlite")
    assert g.window_source == "whole"
    assert g.window == (int(times[0]), int(times[-1]) + 50_000)


def test_whole_capture_when_nothing_repeats(tmp_path):
    b = NsysExportBuilder(tmp_path / "w.sqlite")
    b.add_gpu(0)
    b.add_kernel(T0, T0 + MS, "kernel_a", launch=(T0 - 10_000, T0 - 9_000))
    b.add_memcpy(T0 + 2 * MS, T0 + 3 * MS, 4096, "HtoD", launch=(T0 + MS, T0 + MS + 1_000))
    b.write()
    (g,) = timelines(tmp_path / "w.sqlite")
    assert g.window_source == "whole"
    assert len(g.iterations) == 1
    assert g.window == (T0, T0 + 3 * MS)  # copies count: the window spans every op


def test_gpus_split_by_process_and_device(tmp_path):
    # one report, three processes, one device each; a peer copy alone does not make a GPU
    b = NsysExportBuilder(tmp_path / "multi.sqlite")
    for pid, dev in ((101, 0), (102, 1), (103, 2)):
        b.add_gpu(dev)
        b.add_kernel(T0, T0 + MS, "k", device=dev, pid=pid, launch=(T0 - 5_000, T0 - 4_000))
    b.add_memcpy(T0, T0 + MS, 1 << 20, "PtoP", device=3, pid=101)
    b.write()
    gs = timelines(tmp_path / "multi.sqlite")
    assert [(g.pid, g.device) for g in gs] == [(101, 0), (102, 1), (103, 2)]
    # each GPU's runtime rows are its own process's (the launch joined by correlation id)
    assert all(len(g.runtime) == 1 and g.ops["launch_start"].tolist() == [T0 - 5_000] for g in gs)


@pytest.mark.parametrize("variant", ["no_textId", "renamed_kernel_table"])
def test_schema_variants_still_give_nvtx_iterations(tmp_path, variant):
    opts = {"no_textId": dict(drop_columns={"NVTX_EVENTS": ["textId"]}),
            "renamed_kernel_table": dict(rename_tables={"CUPTI_ACTIVITY_KIND_KERNEL":
                                                        "CUPTI_ACTIVITY_KIND_KERNEL_V2"})}[variant]
    b = NsysExportBuilder(tmp_path / "v.sqlite", **opts)
    b.add_gpu(0)
    for i in range(3):
        s = T0 + i * 10 * MS
        b.add_nvtx(f"iteration {i}", s - MS, s + 9 * MS)
        b.add_kernel(s, s + 9 * MS, "k", launch=(s - 100_000, s - 99_000))
    b.write()
    (g,) = timelines(tmp_path / "v.sqlite")
    assert g.window_source == "nvtx"
    # the last NVTX iteration has no next start, so only the two whole start-to-start steps count
    assert g.iterations["steady"].tolist() == [True, True, False]
    assert g.window == (T0, T0 + 20 * MS)
