"""In-process transfers: two agents and loopback, prepared and non-prepared."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import addr, collect_notifs, make_pair, pattern, wait_done

BLK = 1024
N = 8


@pytest.fixture
def pair(make_agent):
    return make_pair(make_agent, size=N * BLK)


def strided(buf, blk=BLK, n=N, offset=0, stride=None):
    return np.array([[addr(buf, offset), blk, 0, stride or blk, n]], dtype=np.uint64)


# --------------------------------------------------------------------------- initialize_xfer


def test_write_with_notification(pair):
    a, b = pair.A, pair.B
    l = a.get_xfer_descs([(addr(pair.src), 2048, 0), (addr(pair.src, 4096), 1024, 0)], "DRAM")
    r = a.get_xfer_descs([(addr(pair.dst, 1024), 2048, 0), (addr(pair.dst, 6144), 1024, 0)], "DRAM")
    h = a.initialize_xfer("WRITE", l, r, pair.remote, b"n\x00tification")
    assert h
    assert a.transfer(h) in ("DONE", "PROC")
    assert wait_done(a, h) == "DONE"
    assert a.check_xfer_state(h) == "DONE"  # stays DONE
    assert (pair.dst[1024:3072] == pair.src[:2048]).all()
    assert (pair.dst[6144:7168] == pair.src[4096:5120]).all()
    assert not pair.dst[:1024].any() and not pair.dst[3072:6144].any()
    notifs = collect_notifs(b, 1)
    assert notifs == {a.name: [b"n\x00tification"]}
    assert isinstance(next(iter(notifs)), str)
    a.release_xfer_handle(h)


def test_read_keyword_arguments(pair):
    a, b = pair.A, pair.B
    remote_src = pattern(N * BLK, 11)
    pair.dst[:] = remote_src  # B's buffer is what A reads
    local = np.zeros(N * BLK, dtype=np.uint8)
    a.register_memory([(addr(local), local.nbytes, 0, "")], "DRAM")
    h = a.initialize_xfer(
        operation="READ",
        local_descs=a.get_xfer_descs([(addr(local), 4096, 0)], "DRAM"),
        remote_descs=a.get_xfer_descs([(addr(pair.dst), 4096, 0)], "DRAM"),
        remote_agent=pair.remote,
        notif_msg=b"read-done",
    )
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert (local[:4096] == remote_src[:4096]).all()
    assert collect_notifs(b, 1) == {a.name: [b"read-done"]}


def test_transfer_without_notification(pair):
    a = pair.A
    h = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([(addr(pair.src), 512, 0)], "DRAM"),
        a.get_xfer_descs([(addr(pair.dst), 512, 0)], "DRAM"),
        pair.B.name,
    )
    assert a.transfer(h) in ("DONE", "PROC")
    assert wait_done(a, h) == "DONE"
    assert (pair.dst[:512] == pair.src[:512]).all()
    # Positive signal instead of a sleep: a second transfer on the same path carries a marker; once the
    # marker has arrived, a notification from the first one would have arrived before it.
    m = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([(addr(pair.src), 512, 0)], "DRAM"),
        a.get_xfer_descs([(addr(pair.dst), 512, 0)], "DRAM"),
        pair.B.name,
        b"marker",
    )
    a.transfer(m)
    assert wait_done(a, m) == "DONE"
    assert collect_notifs(pair.B, 1) == {a.name: [b"marker"]}


def test_str_notification_arrives_as_bytes(pair):
    a = pair.A
    h = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([(addr(pair.src), 64, 0)], "DRAM"),
        a.get_xfer_descs([(addr(pair.dst), 64, 0)], "DRAM"),
        pair.remote,
        "text-notif",
    )
    a.transfer(h)
    wait_done(a, h)
    assert collect_notifs(pair.B, 1) == {a.name: [b"text-notif"]}


def test_initialize_xfer_errors(pair, bind):
    a = pair.A
    l1 = a.get_xfer_descs([(addr(pair.src), 10, 0)], "DRAM")
    with pytest.raises(bind.nixlInvalidParamError):
        a.initialize_xfer("READ", l1, a.get_xfer_descs([(addr(pair.dst), 11, 0)], "DRAM"), pair.remote)
    with pytest.raises(bind.nixlInvalidParamError):
        a.initialize_xfer("READ", l1, a.get_xfer_descs([(addr(pair.dst), 10, 0)] * 2, "DRAM"), pair.remote)
    with pytest.raises(bind.nixlNotFoundError):
        a.initialize_xfer("READ", l1, a.get_xfer_descs([(addr(pair.dst), 10, 0)], "DRAM"), "nobody")
    with pytest.raises(bind.nixlNotFoundError):  # beyond the remote registration
        a.initialize_xfer("READ", l1, a.get_xfer_descs([(addr(pair.dst, N * BLK), 10, 0)], "DRAM"), pair.remote)
    with pytest.raises(bind.nixlNotFoundError):  # wrong device id
        a.initialize_xfer("READ", l1, a.get_xfer_descs([(addr(pair.dst), 10, 1)], "DRAM"), pair.remote)
    with pytest.raises(bind.nixlNotFoundError):
        a.initialize_xfer("READ", bind.nixlXferDList(bind.DRAM_SEG), bind.nixlXferDList(bind.DRAM_SEG), pair.remote)


def test_loopback_initialize_xfer(make_agent):
    a = make_agent("loop")
    buf = pattern(4096, 5)
    a.register_memory([(addr(buf), 4096, 0, "")], "DRAM")
    expected = buf[:1024].copy()
    h = a.initialize_xfer(
        "WRITE",
        a.get_xfer_descs([(addr(buf), 1024, 0)], "DRAM"),
        a.get_xfer_descs([(addr(buf, 2048), 1024, 0)], "DRAM"),
        a.name,
        b"self",
    )
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert (buf[2048:3072] == expected).all()
    assert collect_notifs(a, 1) == {a.name: [b"self"]}


# --------------------------------------------------------------------------- prepared lists


def test_prepped_read_and_write(pair):
    a, b = pair.A, pair.B
    lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", [(addr(pair.src, i * BLK), BLK, 0) for i in range(N)], "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, [(addr(pair.dst, i * BLK), BLK, 0) for i in range(N)], "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0, 1, 2], rh, [5, 6, 7], b"w")
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert (pair.dst[5 * BLK : 8 * BLK] == pair.src[: 3 * BLK]).all()
    pair.dst[:BLK] = 42
    h2 = a.make_prepped_xfer("READ", lh, np.array([7]), rh, np.array([0]), notif_msg=b"r")
    a.transfer(h2)
    assert wait_done(a, h2) == "DONE"
    assert (pair.src[7 * BLK : 8 * BLK] == 42).all()
    assert collect_notifs(b, 2) == {a.name: [b"w", b"r"]}
    a.release_xfer_handle(h)
    a.release_xfer_handle(h2)
    a.release_dlist_handle(lh)
    a.release_dlist_handle(rh)


@pytest.mark.parametrize("local_name", ["NIXL_INIT_AGENT", "", b""])
def test_local_side_names(pair, local_name):
    a = pair.A
    lh = a.prep_xfer_dlist(local_name, [(addr(pair.src), BLK, 0)], "DRAM")
    rh = a.prep_xfer_dlist(pair.B.name.encode(), [(addr(pair.dst), BLK, 0)], "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert (pair.dst[:BLK] == pair.src[:BLK]).all()


def test_prep_accepts_dlist_and_arrays(pair, bind):
    a = pair.A
    dl = bind.nixlXferDList(bind.DRAM_SEG, [(addr(pair.src), BLK, 0)])
    lh = a.prep_xfer_dlist("", dl)
    rh = a.prep_xfer_dlist(pair.remote, np.array([[addr(pair.dst), BLK, 0]], dtype=np.int64), "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    a.transfer(h)
    assert wait_done(a, h) == "DONE"


def test_loopback_prepped(make_agent):
    a = make_agent("loop")
    buf = pattern(2 * N * BLK, 9)
    a.register_memory([(addr(buf), buf.nbytes, 0, "")], "DRAM")
    lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", strided(buf), "DRAM")
    th = a.prep_xfer_dlist(a.name, strided(buf, offset=N * BLK), "DRAM")
    expected = buf[: 2 * BLK].copy()
    h = a.make_prepped_xfer("WRITE", lh, [0, 1], th, [2, 3], notif_msg=b"loop")
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert (buf[N * BLK + 2 * BLK : N * BLK + 4 * BLK] == expected).all()
    assert collect_notifs(a, 1) == {a.name: [b"loop"]}


def test_prep_errors(pair, bind):
    a = pair.A
    with pytest.raises(bind.nixlNotFoundError):
        a.prep_xfer_dlist("nobody", [(addr(pair.dst), BLK, 0)], "DRAM")
    with pytest.raises(bind.nixlNotFoundError):  # unregistered local range
        a.prep_xfer_dlist("", [(12345, 10, 0)], "DRAM")
    with pytest.raises(bind.nixlNotFoundError):  # wrong device id
        a.prep_xfer_dlist("", [(addr(pair.src), 10, 1)], "DRAM")
    with pytest.raises(bind.nixlNotFoundError):  # beyond the remote registration
        a.prep_xfer_dlist(pair.remote, [(addr(pair.dst), N * BLK + 1, 0)], "DRAM")
    with pytest.raises(bind.nixlNotFoundError):  # no VRAM registered anywhere
        a.prep_xfer_dlist("", [(addr(pair.src), 10, 0)], "VRAM")
    with pytest.raises(IndexError):
        a.prep_xfer_dlist("", [], "DRAM")
    with pytest.raises(ValueError):
        a.prep_xfer_dlist("", np.zeros((1, 5), dtype=np.uint64))  # Nx5 needs mem_type
    with pytest.raises(KeyError):
        a.prep_xfer_dlist("", strided(pair.src), "V-RAM")


def test_make_prepped_xfer_errors(pair, bind):
    a = pair.A
    lh = a.prep_xfer_dlist("", strided(pair.src), "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, strided(pair.dst), "DRAM")
    short = a.prep_xfer_dlist(pair.remote, [(addr(pair.dst), BLK // 2, 0)], "DRAM")
    cases = [
        (lh, [0, 1], rh, [0]),  # count mismatch
        (lh, [], rh, []),  # empty
        (lh, [-1], rh, [0]),  # negative
        (lh, np.array([-1], dtype=np.int32), rh, np.array([0], dtype=np.int32)),
        (lh, [N], rh, [0]),  # out of range
        (lh, [0], rh, [N]),
        (rh, [0], lh, [0]),  # swapped sides
        (lh, [0], lh, [0]),  # both local
        (rh, [0], rh, [0]),  # both remote
        (lh, [0], short, [0]),  # length mismatch
    ]
    for local, lidx, remote, ridx in cases:
        with pytest.raises(bind.nixlInvalidParamError) as info:
            a.make_prepped_xfer("READ", local, lidx, remote, ridx)
        assert str(info.value) == "NIXL_ERR_INVALID_PARAM"
    with pytest.raises(ValueError):
        a.make_prepped_xfer("READ", lh, np.array([[0]]), rh, np.array([[0]]))


@pytest.mark.parametrize(
    "make_idx",
    [
        lambda: [1, 2],
        lambda: (1, 2),
        lambda: range(1, 3),
        lambda: np.array([1, 2], dtype=np.int32),
        lambda: np.array([1, 2], dtype=np.int64),
        lambda: np.array([1, 2], dtype=np.uint64),
        lambda: np.array([1, 2], dtype=np.uint32),
        lambda: np.arange(8)[1:5:2] - np.array([0, 1]),  # non-contiguous view [1, 2]
        lambda: [np.int64(1), np.int32(2)],
    ],
    ids=["list", "tuple", "range", "int32", "int64", "uint64", "uint32", "view", "npscalars"],
)
def test_index_types(pair, make_idx):
    a = pair.A
    lh = a.prep_xfer_dlist("", strided(pair.src), "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, strided(pair.dst), "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, make_idx(), rh, make_idx())
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert (pair.dst[BLK : 3 * BLK] == pair.src[BLK : 3 * BLK]).all()
    assert not pair.dst[:BLK].any() and not pair.dst[3 * BLK :].any()


def test_strided_index_space(make_agent):
    """Nx5 rows expand to `count` blocks each; indices address the expansion row after row."""
    a = make_agent("init")
    b = make_agent("target")
    src = pattern(64 * 1024, 1)
    dst = np.zeros(64 * 1024, dtype=np.uint8)
    a.register_memory([(addr(src), src.nbytes, 0, "")], "DRAM")
    b.register_memory([(addr(dst), dst.nbytes, 0, "")], "DRAM")
    name = a.add_remote_agent(b.get_agent_metadata())
    blk, stride = 256, 1024
    # local: row0 = 4 blocks of 256 B every 1 KiB from 0; row1 = 3 dense blocks at 32 KiB
    local_rows = np.array(
        [[addr(src), blk, 0, stride, 4], [addr(src, 32768), blk, 0, blk, 3]], dtype=np.uint64
    )
    # remote: one dense row of 7 blocks at 8 KiB
    remote_rows = np.array([[addr(dst, 8192), blk, 0, blk, 7]], dtype=np.uint64)
    lh = a.prep_xfer_dlist("NIXL_INIT_AGENT", local_rows, mem_type="DRAM")
    rh = a.prep_xfer_dlist(name, remote_rows, mem_type="DRAM")
    lidx = np.array([0, 3, 4, 6], dtype=np.int32)
    ridx = np.array([6, 0, 2, 1], dtype=np.int32)
    h = a.make_prepped_xfer("WRITE", lh, lidx, rh, ridx, notif_msg=b"strided")
    a.transfer(h)
    assert wait_done(a, h) == "DONE"

    def local_block(i):
        off = i * stride if i < 4 else 32768 + (i - 4) * blk
        return src[off : off + blk]

    for li, ri in zip(lidx, ridx):
        off = 8192 + int(ri) * blk
        assert (dst[off : off + blk] == local_block(int(li))).all(), (li, ri)
    untouched = 8192 + 3 * blk  # remote block 3 was not written
    assert not dst[untouched : untouched + blk].any()
    with pytest.raises(Exception) as info:  # 7 expanded blocks locally: index 7 is out of range
        a.make_prepped_xfer("WRITE", lh, [7], rh, [0])
    assert type(info.value).__name__ == "nixlInvalidParamError"
    assert collect_notifs(b, 1) == {a.name: [b"strided"]}


def test_strided_matches_nx3(pair):
    a = pair.A
    lh5 = a.prep_xfer_dlist("", strided(pair.src), "DRAM")
    rh3 = a.prep_xfer_dlist(
        pair.remote, np.array([[addr(pair.dst, i * BLK), BLK, 0] for i in range(N)], dtype=np.uint64), "DRAM"
    )
    h = a.make_prepped_xfer("WRITE", lh5, list(range(N)), rh3, list(range(N))[::-1])
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    for i in range(N):
        j = N - 1 - i
        assert (pair.dst[j * BLK : (j + 1) * BLK] == pair.src[i * BLK : (i + 1) * BLK]).all()


def test_strided_input_validation(pair, bind):
    a = pair.A
    base = addr(pair.src)
    with pytest.raises(ValueError):
        a.prep_xfer_dlist("", np.array([[4096, BLK, 0, BLK, 1]], dtype=np.int32), "DRAM")
    # int64 and non-contiguous arrays are accepted
    a.prep_xfer_dlist("", np.array([[base, BLK, 0, BLK, N]], dtype=np.int64), "DRAM")
    wide = np.array([[base, BLK, 0, BLK, N, 99]], dtype=np.uint64)
    a.prep_xfer_dlist("", wide[:, :5], "DRAM")
    for rows in (
        np.zeros((0, 5), dtype=np.uint64),  # no rows
        np.array([[base, BLK, 0, BLK, 0]], dtype=np.uint64),  # count 0
        np.array([[base, BLK, 0, BLK, N + 1]], dtype=np.uint64),  # past the registration
    ):
        with pytest.raises(bind.nixlNotFoundError):
            a.prep_xfer_dlist("", rows, "DRAM")


def test_prepped_sub_block_splits(pair):
    """Several local handles over the same memory with different splits (vLLM heterogeneous TP)."""
    a = pair.A
    half = BLK // 2
    l_lo = a.prep_xfer_dlist("", strided(pair.src, blk=half, stride=BLK), "DRAM")
    l_hi = a.prep_xfer_dlist("", strided(pair.src, blk=half, offset=half, stride=BLK), "DRAM")
    r = a.prep_xfer_dlist(pair.remote, strided(pair.dst, blk=half, n=2 * N, stride=half), "DRAM")
    h1 = a.make_prepped_xfer("WRITE", l_lo, [0, 1], r, [0, 2])
    h2 = a.make_prepped_xfer("WRITE", l_hi, [0, 1], r, [1, 3])
    for h in (h1, h2):
        a.transfer(h)
    for h in (h1, h2):
        assert wait_done(a, h) == "DONE"
    assert (pair.dst[: 2 * BLK] == pair.src[: 2 * BLK]).all()


# --------------------------------------------------------------------------- handle lifecycle


def test_state_of_never_posted_handle(pair, bind):
    a = pair.A
    lh = a.prep_xfer_dlist("", strided(pair.src), "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, strided(pair.dst), "DRAM")
    h = a.make_prepped_xfer("READ", lh, [0], rh, [0])
    with pytest.raises(bind.nixlNotPostedError) as info:
        a.check_xfer_state(h)
    assert str(info.value) == "NIXL_ERR_NOT_POSTED"


def test_repost_semantics(pair, bind):
    a, b = pair.A, pair.B
    lh = a.prep_xfer_dlist("", strided(pair.src), "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, strided(pair.dst), "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0], notif_msg=b"first")
    posts = 0
    saw_active = False
    for _ in range(10):
        state = a.transfer(h)
        posts += 1
        assert state in ("DONE", "PROC")
        if state == "PROC":
            try:
                a.transfer(h)
                posts += 1  # the first one had already finished
            except bind.nixlRepostActiveError as exc:
                assert str(exc) == "NIXL_ERR_REPOST_ACTIVE"
                saw_active = True
        assert wait_done(a, h) == "DONE"
        if saw_active:
            break
    # an empty notif_msg on repost re-sends the handle's last notification
    assert collect_notifs(b, posts) == {a.name: [b"first"] * posts}
    # reposting a DONE handle is allowed, and a new message replaces the old one
    a.transfer(h, b"second")
    assert wait_done(a, h) == "DONE"
    a.transfer(h)
    assert wait_done(a, h) == "DONE"
    assert collect_notifs(b, 2) == {a.name: [b"second", b"second"]}


def test_release_is_idempotent(pair):
    a = pair.A
    lh = a.prep_xfer_dlist("", strided(pair.src), "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, strided(pair.dst), "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    a.transfer(h)
    wait_done(a, h)
    a.release_xfer_handle(h)
    a.release_xfer_handle(h)
    h.release()
    assert repr(h).endswith("released=True)")
    a.release_dlist_handle(lh)
    a.release_dlist_handle(lh)
    rh.release()
    assert "released=True" in repr(rh)


def test_estimate_and_query_backend(pair):
    a = pair.A
    lh = a.prep_xfer_dlist("", strided(pair.src), "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, strided(pair.dst), "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0, 1], rh, [0, 1])
    cost = a.estimate_xfer_cost(h)
    assert isinstance(cost, tuple) and len(cost) == 3
    assert isinstance(cost[0], int) and isinstance(cost[1], int)
    assert cost[2] == "UNKNOWN"
    assert a.query_xfer_backend(h) == "UCX"
    a.transfer(h)
    wait_done(a, h)


def test_handles_are_truthy_objects(pair, api):
    a = pair.A
    lh = a.prep_xfer_dlist("", strided(pair.src), "DRAM")
    rh = a.prep_xfer_dlist(pair.remote, strided(pair.dst), "DRAM")
    h = a.make_prepped_xfer("WRITE", lh, [0], rh, [0])
    assert isinstance(lh, api.nixl_prepped_dlist_handle) and lh
    assert isinstance(h, api.nixl_xfer_handle) and h
    assert repr(h).startswith("nixl_xfer_handle(0x")
    assert isinstance(h._handle, int) and h._handle != 0


def test_desc_merging_reported_by_telemetry(make_agent):
    p = make_pair(make_agent, size=N * BLK, capture_telemetry=True)
    a = p.A
    lh = a.prep_xfer_dlist("", strided(p.src), "DRAM")
    rh = a.prep_xfer_dlist(p.remote, strided(p.dst), "DRAM")
    expect = {(False, tuple(range(N))): 1, (True, tuple(range(N))): N, (False, (0, 2, 4)): 3}
    for (skip, idx), count in expect.items():
        h = a.make_prepped_xfer("WRITE", lh, list(idx), rh, list(idx), skip_desc_merge=skip)
        a.transfer(h)
        assert wait_done(a, h) == "DONE"
        t = a.get_xfer_telemetry(h)
        assert t.descCount == count, (skip, idx)
        assert t.totalBytes == len(idx) * BLK
