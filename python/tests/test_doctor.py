"""`python -m gixl doctor` and gixl's route log lines, on the installed gixl (a gixl addition).

The doctor is also tested across network namespaces and with cross-memory attach denied in Rust
(tests/doctor.rs); here: the command line, its JSON, a peer given by metadata file and by listener, and the
INFO line through Python's `logging` when a peer's route is chosen.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.gixl_native

PEER = r"""
import sys, numpy as np
import nixl._api as api
cfg = api.nixl_agent_config(enable_listen_thread=True, listen_port=int(sys.argv[2]))
a = api.nixl_agent("doctor-peer", cfg)
buf = np.full(1 << 20, 9, dtype=np.uint8)
a.register_memory([(buf.ctypes.data, buf.size, 0, "")], "DRAM")
open(sys.argv[1], "wb").write(a.get_agent_metadata())
print("ready", flush=True)
sys.stdin.read()
"""


def _run(args, **kw):
    # The installed package, from a neutral directory (python/gixl in the checkout has no native module).
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir(), **kw
    )


@pytest.fixture(scope="module")
def installed():
    r = _run(["-c", "import gixl._gixl"])
    if r.returncode != 0:
        pytest.skip("gixl is not installed in this interpreter (scripts/setup.sh installs it): " + r.stderr[-300:])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_doctor_json_names_every_route(installed):
    r = _run(["-m", "gixl", "doctor", "--json"])
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["versions"]["nixl_api"] == "1.5.2"
    assert set(rep["routes"]) == {"in_process", "cma", "tcp", "rdma", "libfabric", "cuda"}
    assert rep["routes"]["in_process"]["works"] is True
    assert isinstance(rep["routes"]["rdma"]["gpu_direct"]["peer_memory_module"], bool)
    assert "capi" not in rep["versions"]["features"], "the extension is built without the C ABI"
    human = _run(["-m", "gixl", "doctor"])
    assert human.returncode == 0 and "routes on this host:" in human.stdout and "cma " in human.stdout
    lf = rep["routes"]["libfabric"]
    assert lf["works"] is False and isinstance(lf["found"], bool) and "libfabric " in human.stdout


def test_doctor_lists_libfabric_devices(installed):
    """With the libfabric that scripts/setup.sh unpacks (opened by path, its folders on LD_LIBRARY_PATH in
    this process only), the report says where it was found and lists its shm and tcp devices."""
    root = os.path.expanduser("~/.cache/gixl/libfabric")
    lib = os.path.join(root, "usr/lib/x86_64-linux-gnu")
    if not os.path.exists(os.path.join(lib, "libfabric.so.1")):
        pytest.skip("no libfabric under ~/.cache/gixl/libfabric (scripts/setup.sh unpacks it)")
    env = {
        **os.environ,
        "GIXL_LIBFABRIC": os.path.join(lib, "libfabric.so.1"),
        "LD_LIBRARY_PATH": f"{lib}:{os.path.join(root, 'lib/x86_64-linux-gnu')}",
    }
    r = _run(["-m", "gixl", "doctor", "--json"], env=env)
    assert r.returncode == 0, r.stderr
    lf = json.loads(r.stdout)["routes"]["libfabric"]
    assert lf["found"] is True and lf["library"] == env["GIXL_LIBFABRIC"], lf
    assert "shm/shm" in lf["devices"] and "tcp;ofi_rxm/lo" in lf["devices"], lf


def test_doctor_opens_with_the_route_per_peer_kind_and_each_device(installed):
    """The answer to "why is my transfer slow / not using my NIC" comes first, in about a dozen lines: the
    route each kind of peer gets and each device, used or not, with why; the details after."""
    rep = json.loads(_run(["-m", "gixl", "doctor", "--json"]).stdout)
    s = rep["summary"]
    assert [x["peer"] for x in s["routes"]] == ["same process", "same host", "other host", "VRAM"], s
    assert s["routes"][0]["route"] == "in-process"
    same_host = s["routes"][1]
    assert same_host["route"] == ("cma" if rep["routes"]["cma"]["works"] else "tcp"), same_host
    devices = {d["device"]: d for d in s["devices"]}
    assert {"TCP", "GPU", "io_uring"} <= set(devices), devices
    assert any(d.startswith("RDMA") for d in devices), "each NIC port, or that there is none: " + str(devices)
    assert all(d["why"] for d in s["devices"]) and all(x["why"] for x in s["routes"])
    assert devices["GPU"]["used"] is rep["routes"]["cuda"]["works"]
    assert devices["io_uring"]["used"] is True or "thread pool" in devices["io_uring"]["why"]
    # Without a NIC on this fabric, the other host is reached over TCP and the summary says why.
    if not rep["routes"]["rdma"]["works"]:
        assert s["routes"][2]["route"] == "tcp" and rep["routes"]["rdma"]["why"] in s["routes"][2]["why"]
    lines = _run(["-m", "gixl", "doctor"]).stdout.splitlines()
    assert lines[0].startswith("gixl doctor: the route to each kind of peer"), lines[:3]
    head = lines[: lines.index("details:")]
    assert 6 <= len(head) <= 14, head
    for want in ("same process", "same host", "other host", "VRAM", "TCP", "GPU", "io_uring"):
        assert any(line.strip().startswith(want) for line in head), (want, head)
    fake = _run(["-m", "gixl", "doctor"], env={**os.environ, "GIXL_FAKE_DEVICE": "1"}).stdout.splitlines()
    gpu = next(line for line in fake if line.strip().startswith("GPU"))
    assert " used " in gpu and "fake device" in gpu, gpu


def test_doctor_says_whether_vram_works(installed):
    """The wheel has the `cuda` feature: with the fake device layer VRAM works; without a driver (or with one)
    the report says so, never that VRAM is unsupported by design."""
    fake = json.loads(_run(["-m", "gixl", "doctor", "--json"], env={**os.environ, "GIXL_FAKE_DEVICE": "1"}).stdout)
    cu = fake["routes"]["cuda"]
    assert (cu["works"], cu["layer"], cu["ipc"]) == (True, "fake", True), cu
    rep = json.loads(_run(["-m", "gixl", "doctor", "--json"]).stdout)
    assert "cuda" in rep["versions"]["features"]
    real = rep["routes"]["cuda"]
    if real["works"]:
        assert real["layer"] == "cuda" and "CUDA IPC" in real["why"], real
    else:
        assert real["layer"] == "none" and real["why"].startswith("VRAM registration fails here"), real


def test_doctor_with_a_peer_by_file_and_by_listener(installed, tmp_path):
    md = tmp_path / "peer.md"
    port = _free_port()
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(md), str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    try:
        for line in peer.stdout:  # NIXL's logger writes to stdout too
            if line.strip() == "ready":
                break
        else:
            pytest.fail("the peer did not start")
        r = _run(["-m", "gixl", "doctor", "--json", "--peer-md", str(md)])
        assert r.returncode == 0, r.stdout + r.stderr
        p = json.loads(r.stdout)["peer"]
        assert p["ok"] and p["name"] == "doctor-peer"
        assert p["route"] in ("cma", "tcp-after-cma-denied"), p
        assert p["read_probe"]["bytes"] == 1 << 20 and p["read_probe"]["gb_per_s"] > 0
        r = _run(["-m", "gixl", "doctor", "--peer", f"doctor-peer@127.0.0.1:{port}"])
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"peer listener 127.0.0.1:{port}: reachable" in r.stdout, r.stdout
        assert "peer doctor-peer incarnation" in r.stdout and "READ of 1048576 bytes" in r.stdout, r.stdout
        head = r.stdout[: r.stdout.index("details:")]
        assert "peer doctor-peer " in head and " GB/s" in head, "the peer's route and speed lead: " + r.stdout
        bad = _run(["-m", "gixl", "doctor", "--peer", f"nobody-here@127.0.0.1:{_free_port()}"])
        assert bad.returncode == 1 and "FAILED" in bad.stdout, bad.stdout + bad.stderr
    finally:
        peer.stdin.close()
        peer.wait(timeout=30)


# The start of a child program that records every record of NIXL's loggers as (logger, level, message) in `seen`.
_LOG_CAPTURE = (
    "import logging, numpy as np\n"
    "import nixl._api as api\n"
    "seen = []\n"
    "class H(logging.Handler):\n"
    "    def emit(self, rec): seen.append((rec.name, rec.levelname, rec.getMessage()))\n"
    "logging.getLogger('nixl').addHandler(H())\n"
)


def test_route_choice_is_logged_through_python_logging(installed):
    code = (
        _LOG_CAPTURE + "a, b = api.nixl_agent('log-a'), api.nixl_agent('log-b')\n"
        "x = np.zeros(4096, dtype=np.uint8)\n"
        "b.register_memory([(x.ctypes.data, 4096, 0, '')], 'DRAM')\n"
        "a.add_remote_agent(b.get_agent_metadata())\n"
        "print([s for s in seen if s[0] == 'nixl.gixl'])\n"
    )
    r = _run(["-c", code])
    assert r.returncode == 0, r.stderr
    assert "('nixl.gixl', 'INFO', \"agent 'log-a': peer 'log-b'" in r.stdout, r.stdout
    assert "route in-process" in r.stdout, r.stdout


def test_route_line_once_per_peer_incarnation(installed):
    """Ray adds the peer on every fetch and removes it after: the route is said at INFO once per incarnation
    (NIXL says nothing at all); a new incarnation under the same name is said again."""
    code = (
        _LOG_CAPTURE + "logging.getLogger('nixl').setLevel(logging.INFO)\n"
        "a = api.nixl_agent('once-a')\n"
        "x = np.zeros(4096, dtype=np.uint8)\n"
        "def peer():\n"
        "    b = api.nixl_agent('once-b')\n"
        "    b.register_memory([(x.ctypes.data, 4096, 0, '')], 'DRAM')\n"
        "    return b\n"
        "b = peer()\n"
        "for _ in range(5):\n"
        "    a.add_remote_agent(b.get_agent_metadata())\n"
        "    a.remove_remote_agent('once-b')\n"
        "del b\n"
        "b = peer()\n"
        "a.add_remote_agent(b.get_agent_metadata())\n"
        "lines = [m for _, lv, m in seen if lv in ('INFO', 'WARNING') and \"peer 'once-b'\" in m]\n"
        "print(len(lines), len({m.split('incarnation ')[1][:32] for m in lines}))\n"
    )
    r = _run(["-c", code])
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1].split() == ["2", "2"], r.stdout


def test_doctor_says_who_answers_import_nixl(installed):
    r = _run(["-W", "error", "-m", "gixl", "doctor", "--json"])
    assert r.returncode == 0, r.stderr
    py = json.loads(r.stdout)["python"]
    assert py["nixl_is"].endswith(os.path.join("gixl", "_nixl", "__init__.py")), py
    assert py["nvidia"] == [] and py["nixl_ep"] == [], py  # this interpreter has none of NVIDIA's wheels
    r = _run(["-m", "gixl", "doctor"])
    assert "python: import nixl is " in r.stdout, r.stdout
