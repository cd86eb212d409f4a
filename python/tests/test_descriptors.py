"""Descriptor helpers (get_xfer_descs / get_reg_descs / get_remote_descs) and dlist classes."""

from __future__ import annotations

import pickle
import time

import numpy as np
import pytest

MEM_KEYS = {
    "DRAM": "DRAM_SEG",
    "VRAM": "VRAM_SEG",
    "FILE": "FILE_SEG",
    "BLOCK": "BLK_SEG",
    "OBJ": "OBJ_SEG",
    "cpu": "DRAM_SEG",
    "cuda": "VRAM_SEG",
}


@pytest.fixture(scope="module")
def agent(api):
    import conftest

    return api.nixl_agent(conftest.unique_name("desc"))


def items(dl):
    return [dl[i] for i in range(dl.descCount())]


# --------------------------------------------------------------------------- get_xfer_descs


def test_xfer_descs_from_tuples(agent, bind):
    dl = agent.get_xfer_descs([(1, 2, 0), (3, 4, 5)], "DRAM")
    assert isinstance(dl, bind.nixlXferDList)
    assert dl.descCount() == 2
    assert items(dl) == [(1, 2, 0), (3, 4, 5)]
    assert dl.getType() == bind.DRAM_SEG


@pytest.mark.parametrize("key", sorted(MEM_KEYS))
def test_mem_type_keys(agent, bind, key):
    assert agent.get_xfer_descs([(1, 2, 0)], key).getType() == getattr(bind, MEM_KEYS[key])
    assert agent.get_reg_descs([(1, 2, 0, "")], key).getType() == getattr(bind, MEM_KEYS[key])
    assert agent.nixl_mems[key] == getattr(bind, MEM_KEYS[key])


def test_nixl_mems_and_ops_tables(agent, bind):
    assert set(agent.nixl_mems) == set(MEM_KEYS)
    assert agent.nixl_ops == {"WRITE": bind.NIXL_WRITE, "READ": bind.NIXL_READ}


@pytest.mark.parametrize("bad", ["V-RAM", "dram", "GPU"])
def test_bad_mem_type_raises_keyerror(agent, bad):
    with pytest.raises(KeyError):
        agent.get_xfer_descs([(1, 2, 0)], bad)
    with pytest.raises(KeyError):
        agent.get_xfer_descs(np.array([[1, 2, 0]], dtype=np.uint64), bad)
    with pytest.raises(KeyError):
        agent.get_reg_descs([(1, 2, 0, "")], bad)
    with pytest.raises(KeyError):
        agent.get_remote_descs([(1, 2, 0, "x")], bad)


def test_xfer_descs_bad_inputs_return_none(agent, bind):
    assert agent.get_xfer_descs([(1, 2, 0)]) is None  # no mem type
    assert agent.get_xfer_descs([(1, 2, 0, "")], "DRAM") is None  # 4-tuples
    assert agent.get_xfer_descs(bind.nixlRegDList(bind.DRAM_SEG), "DRAM") is None
    assert agent.get_xfer_descs(np.array([[1, 2, 0]], dtype=np.uint64)) is None  # no mem type
    assert agent.get_xfer_descs(np.array([[1, 2, 0, 0]], dtype=np.uint64), "DRAM") is None
    assert agent.get_xfer_descs(np.array([1, 2, 0], dtype=np.uint64), "DRAM") is None
    assert agent.get_xfer_descs([[1, 2, 0]], "DRAM") is None  # lists are not tuples
    assert agent.get_xfer_descs("abc", "DRAM") is None


def test_xfer_descs_empty_list_raises_indexerror(agent):
    with pytest.raises(IndexError):
        agent.get_xfer_descs([], "DRAM")
    with pytest.raises(IndexError):
        agent.get_reg_descs([], "DRAM")


def test_xfer_descs_passthrough(agent, bind):
    dl = bind.nixlXferDList(bind.VRAM_SEG, [(1, 2, 3)])
    assert agent.get_xfer_descs(dl) is dl
    assert agent.get_xfer_descs(dl, "DRAM") is dl


@pytest.mark.parametrize("dtype", [np.uint64, np.int64])
def test_xfer_descs_from_nx3_array(agent, dtype):
    arr = np.array([[10, 20, 0], [30, 40, 1], [50, 60, 2]], dtype=dtype)
    dl = agent.get_xfer_descs(arr, "DRAM")
    assert items(dl) == [(10, 20, 0), (30, 40, 1), (50, 60, 2)]
    assert dl == agent.get_xfer_descs([(10, 20, 0), (30, 40, 1), (50, 60, 2)], "DRAM")


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.float64])
def test_xfer_descs_wrong_dtype_raises_valueerror(agent, dtype):
    with pytest.raises(ValueError):
        agent.get_xfer_descs(np.array([[1, 2, 0]], dtype=dtype), "DRAM")
    with pytest.raises(ValueError):
        agent.get_reg_descs(np.array([[1, 2, 0]], dtype=dtype), "DRAM")


@pytest.mark.gixl_only
def test_xfer_descs_noncontiguous_array_accepted(agent):
    base = np.array([[1, 2, 0, 9], [3, 4, 0, 9]], dtype=np.uint64)
    dl = agent.get_xfer_descs(base[:, :3], "DRAM")
    assert items(dl) == [(1, 2, 0), (3, 4, 0)]


def test_large_nx3_array_is_fast(agent):
    n = 200_000
    arr = np.empty((n, 3), dtype=np.uint64)
    arr[:, 0] = np.arange(n, dtype=np.uint64) * 4096 + 0x10000
    arr[:, 1] = 4096
    arr[:, 2] = 0
    t0 = time.perf_counter()
    dl = agent.get_xfer_descs(arr, "DRAM")
    assert time.perf_counter() - t0 < 2.0
    assert dl.descCount() == n
    assert dl[n - 1] == (int(arr[n - 1, 0]), 4096, 0)


# --------------------------------------------------------------------------- get_reg_descs


def test_reg_descs_from_tuples_meta_is_bytes(agent, bind):
    dl = agent.get_reg_descs([(1, 2, 0, "ab"), (3, 4, 0, b"c\x00d")], "DRAM")
    assert isinstance(dl, bind.nixlRegDList)
    assert items(dl) == [(1, 2, 0, b"ab"), (3, 4, 0, b"c\x00d")]


def test_reg_descs_from_array_has_empty_meta(agent):
    dl = agent.get_reg_descs(np.array([[1, 2, 0], [5, 6, 7]], dtype=np.uint64), "DRAM")
    assert items(dl) == [(1, 2, 0, b""), (5, 6, 7, b"")]


def test_reg_descs_bad_inputs_return_none(agent, bind):
    assert agent.get_reg_descs([(1, 2, 0, "")]) is None
    assert agent.get_reg_descs([(1, 2, 0)], "DRAM") is None
    assert agent.get_reg_descs(bind.nixlXferDList(bind.DRAM_SEG), "DRAM") is None
    assert agent.get_reg_descs(np.array([[1, 2, 0, 0]], dtype=np.uint64), "DRAM") is None


def test_reg_descs_passthrough(agent, bind):
    dl = bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 0, "m")])
    assert agent.get_reg_descs(dl) is dl


# --------------------------------------------------------------------------- get_remote_descs


def test_remote_descs(agent, bind):
    dl = agent.get_remote_descs([(1, 2, 0, "peer"), (3, 4, 0, b"other")], "DRAM")
    assert isinstance(dl, bind.nixlRemoteDList)
    assert dl.descCount() == 2
    assert dl[0] == (1, 2, 0, "peer")
    assert dl[1] == (3, 4, 0, "other")
    assert agent.get_remote_descs(dl) is dl


def test_remote_descs_bad_inputs(agent):
    assert agent.get_remote_descs([(1, 2, 0)], "DRAM") is None
    assert agent.get_remote_descs([(1, 2, 0, "peer")]) is None
    assert agent.get_remote_descs(np.array([[1, 2, 0]], dtype=np.uint64), "DRAM") is None
    with pytest.raises(IndexError):
        agent.get_remote_descs([], "DRAM")


# --------------------------------------------------------------------------- torch-like tensors


def test_tensor_to_descs(agent, bind, fake_torch):
    arr = np.zeros(256, dtype=np.float32)
    t = fake_torch.Tensor(arr)
    dl = agent.get_xfer_descs(t)
    assert dl.getType() == bind.DRAM_SEG
    assert items(dl) == [(arr.ctypes.data, 1024, 0)]
    rl = agent.get_reg_descs(t)
    assert items(rl) == [(arr.ctypes.data, 1024, 0, b"")]
    gpu = fake_torch.Tensor(arr, device=1)
    assert agent.get_xfer_descs(gpu).getType() == bind.VRAM_SEG
    assert agent.get_xfer_descs(gpu)[0] == (arr.ctypes.data, 1024, 1)


def test_tensor_list_to_descs(agent, bind, fake_torch):
    arrs = [np.zeros(16, dtype=np.int64), np.zeros(8, dtype=np.uint8)]
    ts = [fake_torch.Tensor(a) for a in arrs]
    dl = agent.get_xfer_descs(ts)
    assert items(dl) == [(arrs[0].ctypes.data, 128, 0), (arrs[1].ctypes.data, 8, 0)]
    assert items(agent.get_reg_descs(ts)) == [(arrs[0].ctypes.data, 128, 0, b""), (arrs[1].ctypes.data, 8, 0, b"")]


def test_tensor_bad_inputs(agent, fake_torch):
    arr = np.zeros(16, dtype=np.uint8)
    assert agent.get_xfer_descs(fake_torch.Tensor(arr, contiguous=False)) is None
    assert agent.get_reg_descs(fake_torch.Tensor(arr, contiguous=False)) is None
    mixed = [fake_torch.Tensor(arr), fake_torch.Tensor(arr, device=0)]
    assert agent.get_xfer_descs(mixed) is None
    assert agent.get_xfer_descs([fake_torch.Tensor(arr), fake_torch.Tensor(arr, contiguous=False)]) is None


# --------------------------------------------------------------------------- dlist classes


def test_xfer_dlist_methods(bind):
    dl = bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3), (4, 5, 6)])
    assert dl.getType() == bind.DRAM_SEG
    assert dl.descCount() == 2 and not dl.isEmpty()
    assert dl[0] == (1, 2, 3) and dl[1] == (4, 5, 6)
    assert dl.index((4, 5, 6)) == 1
    with pytest.raises(bind.nixlNotFoundError):
        dl.index((7, 7, 7))
    dl.addDesc((7, 8, 9))
    dl.append((10, 11, 12))
    assert items(dl) == [(1, 2, 3), (4, 5, 6), (7, 8, 9), (10, 11, 12)]
    dl[1] = (9, 9, 9)
    assert dl[1] == (9, 9, 9)
    dl.remDesc(0)
    assert items(dl) == [(9, 9, 9), (7, 8, 9), (10, 11, 12)]
    with pytest.raises(IndexError):
        dl.remDesc(3)
    with pytest.raises(IndexError):
        dl.remDesc(-1)
    dl.clear()
    assert dl.isEmpty() and dl.descCount() == 0


def test_xfer_dlist_constructors(bind):
    assert bind.nixlXferDList(bind.DRAM_SEG).descCount() == 0
    assert bind.nixlXferDList(bind.DRAM_SEG).isEmpty()
    assert bind.nixlXferDList(bind.VRAM_SEG, 3).descCount() == 3
    assert bind.nixlXferDList(type=bind.FILE_SEG, init_size=2).getType() == bind.FILE_SEG
    arr = np.array([[1, 2, 3]], dtype=np.uint64)
    assert bind.nixlXferDList(bind.DRAM_SEG, arr)[0] == (1, 2, 3)
    with pytest.raises(ValueError):
        bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3, "")])
    with pytest.raises(ValueError):
        bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3), (1, 2)])
    with pytest.raises(ValueError):
        bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 3)])


def test_dlist_equality(bind):
    a = bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3), (4, 5, 6)])
    b = bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3), (4, 5, 6)])
    assert a == b and not (a != b)
    assert not (a == bind.nixlXferDList(bind.VRAM_SEG, [(1, 2, 3), (4, 5, 6)]))
    assert not (a == bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3)]))
    r1 = bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 3, "x")])
    assert r1 == bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 3, "x")])
    assert not (r1 == bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 3, "y")]))


def test_reg_dlist_methods(bind):
    rl = bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 3, "meta"), (4, 5, 6, b"\x00\x01")])
    assert rl[0] == (1, 2, 3, b"meta") and rl[1] == (4, 5, 6, b"\x00\x01")
    assert rl.index((4, 5, 6, b"\x00\x01")) == 1
    assert rl.index((1, 2, 3, "other")) == 0  # index compares (addr, len, dev) only
    trimmed = rl.trim()
    assert isinstance(trimmed, bind.nixlXferDList)
    assert trimmed.getType() == bind.DRAM_SEG
    assert items(trimmed) == [(1, 2, 3), (4, 5, 6)]
    assert rl.descCount() == 2  # trim does not modify the list
    rl.addDesc((7, 8, 9, "z"))
    rl.append((10, 11, 12, b""))
    rl[0] = (0, 1, 2, "new")
    assert items(rl) == [(0, 1, 2, b"new"), (4, 5, 6, b"\x00\x01"), (7, 8, 9, b"z"), (10, 11, 12, b"")]
    rl.remDesc(1)
    assert rl.descCount() == 3
    rl.clear()
    assert rl.isEmpty()


def test_remote_dlist_methods(bind):
    rd = bind.nixlRemoteDList(bind.DRAM_SEG, [(1, 2, 3, "B")])
    assert rd.descCount() == 1 and not rd.isEmpty()
    assert rd[0] == (1, 2, 3, "B")
    rd.addDesc((4, 5, 6, "C"))
    assert rd[1] == (4, 5, 6, "C")
    rd.remDesc(0)
    assert rd[0] == (4, 5, 6, "C")
    assert bind.nixlRemoteDList(bind.VRAM_SEG, 2).descCount() == 2


def test_dlist_print_does_not_fail(bind):
    bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3)]).print()
    bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 3, "m")]).print()


@pytest.mark.parametrize("mem", ["DRAM_SEG", "VRAM_SEG", "FILE_SEG"])
def test_xfer_dlist_pickle_roundtrip(bind, agent, mem):
    dl = bind.nixlXferDList(getattr(bind, mem), [(1, 2, 3), (2**63 + 5, 4096, 7)])
    back = pickle.loads(pickle.dumps(dl))
    assert type(back) is type(dl)
    assert back == dl
    assert back.getType() == getattr(bind, mem)
    assert items(back) == items(dl)
    assert agent.deserialize_descs(agent.get_serialized_descs(dl)) == dl
    assert isinstance(dl.__getstate__(), bytes)


def test_reg_dlist_pickle_roundtrip(bind):
    rl = bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 3, b"a\x00b"), (4, 5, 6, "")])
    back = pickle.loads(pickle.dumps(rl))
    assert back == rl
    assert items(back) == [(1, 2, 3, b"a\x00b"), (4, 5, 6, b"")]
    empty = pickle.loads(pickle.dumps(bind.nixlXferDList(bind.DRAM_SEG)))
    assert empty.isEmpty()


def test_trimmed_reg_list_pickles(bind, agent):
    # Ray: get_serialized_descs(reg_descs.trim())
    rl = agent.get_reg_descs([(100, 200, 0, "x")], "DRAM")
    back = agent.deserialize_descs(agent.get_serialized_descs(rl.trim()))
    assert items(back) == [(100, 200, 0)]


@pytest.mark.gixl_native
def test_getitem_out_of_range_raises_and_iteration_works(bind):
    dl = bind.nixlXferDList(bind.DRAM_SEG, [(1, 2, 3), (4, 5, 6)])
    with pytest.raises(IndexError):
        dl[2]
    assert list(dl) == [(1, 2, 3), (4, 5, 6)]
    rl = bind.nixlRegDList(bind.DRAM_SEG, [(1, 2, 3, "")])
    with pytest.raises(IndexError):
        rl[5]
