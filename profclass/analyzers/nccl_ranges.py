"""NCCL's own NVTX ranges (its NVTX domain, traced with ``-t nvtx``): the size of torch's
all-to-all communicator, where the traffic alone cannot tell EP (``layout_infer``)."""
from __future__ import annotations

import numpy as np

# NCCL's own NVTX ranges (its NVTX domain), read for torch's all-to-all (nccl_alltoall_peers)
NCCL_NVTX = ("ncclGroupStart", "ncclGroupEnd", "ncclSend", "ncclRecv", "ncclCommCount")


def nccl_alltoall_peers(nvtx) -> int | None:
    """The communicator size of torch's all-to-all on this process, from NCCL's NVTX ranges.

    torch (``all2all_single_equal_split`` / ``_unequal_split``) asks ``ncclCommCount`` for the
    communicator's size, then in one ``ncclGroupStart``..``ncclGroupEnd`` sends to and receives
    from every member (itself included; a member with nothing to exchange may be skipped). So a
    group opened right after ``ncclCommCount`` with as many ``ncclSend`` as ``ncclRecv`` ranges
    holds at most one per member; the most over the capture is the group size (EP for the MoE
    dispatcher's all-to-all). Pipeline p2p groups (one send) and gather/scatter (sends and
    receives unequal) do not count. None without NCCL's ranges or such a group of 2 or more."""
    if nvtx is None or nvtx.empty or "text" not in nvtx:
        return None
    n = nvtx.loc[nvtx["text"].isin(NCCL_NVTX), ["tid", "start", "text"]].sort_values(["tid", "start"], kind="stable")
    if n.empty:
        return None
    text, tid = n["text"].astype("category").array, n["tid"].to_numpy()  # (codes: no copy of each text)
    delta = (text == "ncclGroupStart").astype(np.int64) - (text == "ncclGroupEnd")
    new_tid = np.r_[True, tid[1:] != tid[:-1]]
    # depth after each event, per thread (the cumulative sum restarted at each thread's first)
    total = np.cumsum(delta)
    first = np.maximum.accumulate(np.where(new_tid, np.arange(len(text)), 0))
    depth = total - (total - delta)[first]
    opens = (text == "ncclGroupStart") & (depth == 1)
    after_count = opens & ~new_tid & np.r_[False, text[:-1] == "ncclCommCount"]
    group = np.cumsum(opens)
    inside = depth > 0
    sends = np.bincount(group[inside & (text == "ncclSend")], minlength=group[-1] + 1)
    recvs = np.bincount(group[inside & (text == "ncclRecv")], minlength=group[-1] + 1)
    ok = group[after_count]
    ok = ok[(sends[ok] == recvs[ok]) & (sends[ok] >= 2)]
    return int(sends[ok].max()) if ok.size else None
