"""`get_xfer_telemetry().descCount` per call path, as NIXL 1.5.1 reports it (vLLM feeds it to its
`nixl_num_descriptors` metric).

NIXL merges contiguous descriptors in `make_prepped_xfer` (4 adjacent prepped blocks -> 1) unless
`skip_desc_merge` is set, but not in `initialize_xfer` (`createXferReq`: 4 adjacent descriptors -> 4). gixl
may merge internally on both paths; what it reports must match.
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import addr, make_pair, wait_done

BLOCK = 512


def _descs(buf, idx):
    return [(addr(buf, i * BLOCK), BLOCK, 0) for i in idx]


def _count(p, h):
    assert p.A.transfer(h) in ("DONE", "PROC")
    assert wait_done(p.A, h) == "DONE"
    return p.A.get_xfer_telemetry(h).descCount


def _data_moved(p, local_idx, remote_idx):
    for li, ri in zip(local_idx, remote_idx):
        assert np.array_equal(p.dst[ri * BLOCK:(ri + 1) * BLOCK], p.src[li * BLOCK:(li + 1) * BLOCK])


# (local indices, remote indices, merged pieces)
CASES = {
    "adjacent4": ([0, 1, 2, 3], [4, 5, 6, 7], 1),
    "mixed": ([0, 1, 2, 5, 6, 9], [0, 1, 2, 5, 6, 9], 3),
    "remote_reversed": ([0, 1, 2, 3], [3, 2, 1, 0], 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_initialize_xfer_counts_descriptors_unmerged(make_agent, case):
    li, ri, _ = CASES[case]
    p = make_pair(make_agent, size=16 * BLOCK, capture_telemetry=True)
    a = p.A
    h = a.initialize_xfer("WRITE", a.get_xfer_descs(_descs(p.src, li), "DRAM"),
                          a.get_xfer_descs(_descs(p.dst, ri), "DRAM"), p.remote)
    assert _count(p, h) == len(li)
    _data_moved(p, li, ri)


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [None, np.int32, np.int64])
def test_make_prepped_xfer_counts_merged_pieces(make_agent, case, skip, dtype):
    li, ri, merged = CASES[case]
    p = make_pair(make_agent, size=16 * BLOCK, capture_telemetry=True)
    a = p.A
    lp = a.prep_xfer_dlist("", _descs(p.src, range(16)), "DRAM")
    rp = a.prep_xfer_dlist(p.remote, _descs(p.dst, range(16)), "DRAM")
    conv = (lambda x: x) if dtype is None else (lambda x: np.asarray(x, dtype=dtype))
    h = a.make_prepped_xfer("WRITE", lp, conv(li), rp, conv(ri), skip_desc_merge=skip)
    assert _count(p, h) == (len(li) if skip else merged)
    _data_moved(p, li, ri)
