"""The replay section's notes in words: where the verdict's wall is not the one whose removal
gains most, and what the step without the profiler leaves out on a host-paced job."""
from __future__ import annotations


def untraced_caveat(untraced: float, measured: float) -> str:
    """What the step without the profiler leaves out on a host-paced multi-rank job (measured:
    docs/notes.md, "The profiler's cost inside a Megatron job")."""
    return (f"replay: untraced_step_ms takes only CUDA tracing's per-call cost off this host-paced step "
            f"({100 * (1 - untraced / measured):.0f}%); host-paced 4-rank Megatron jobs ran 13-37% slower traced "
            f"than untraced on one machine, most of it not per call, so the step without the profiler is "
            f"likely shorter than untraced_step_ms (give the job's own, --untraced-step-ms, to calibrate the host)")


def disagreement(verdict: str, largest: str, without: dict, measured: float) -> str:
    gain_v = measured - without.get(verdict, measured)
    gain_l = measured - without[largest]
    return (f"the verdict is the {verdict} wall (the largest share of the step), but removing the {largest} "
            f"wall shortens the replayed step most ({gain_l:.1f} vs {gain_v:.1f} ms/step): the {verdict} "
            f"time is partly hidden behind other work, so the step does not fall by its share")
