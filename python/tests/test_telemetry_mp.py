"""NIXL_TELEMETRY_EXPORTER=prometheus_mp, run the same way against gixl and NIXL 1.5.1: two processes
sharing NIXL_TELEMETRY_MULTIPROC_DIR are served behind one endpoint, each agent as its own series with
the same labels (hostname, agent_name, pid, agent_instance, local_rank) and values; without the directory,
agent creation fails."""

from __future__ import annotations

import re
import socket
import time
import urllib.request

import pytest

from peer_client import PeerError

SAMPLE = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str, metric: str) -> list[tuple[dict, float]]:
    out = []
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(1) == metric:
            out.append((dict(LABEL.findall(m.group(2))), float(m.group(3))))
    return out


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def _env(tmp_path, port):
    d = tmp_path / "mp"
    d.mkdir(mode=0o700, exist_ok=True)
    return {
        "NIXL_TELEMETRY_ENABLE": "y",
        "NIXL_TELEMETRY_EXPORTER": "prometheus_mp",
        "NIXL_TELEMETRY_MULTIPROC_DIR": str(d),
        "NIXL_TELEMETRY_PROMETHEUS_PORT": str(port),
        "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y",
    }


@pytest.mark.two_process
def test_prometheus_mp_serves_two_processes_behind_one_endpoint(peers, tmp_path):
    port = free_port()
    env = _env(tmp_path, port)
    ranks = [peers(f"rank{i}", env={**env, "LOCAL_RANK": str(i)}) for i in range(2)]
    infos = [p.init(name=f"mp-py-{i}", size=4096 * (i + 1), telemetry=True) for i, p in enumerate(ranks)]
    want = {
        (socket.gethostname(), f"mp-py-{i}", str(info["pid"]), "0", str(i)): 4096.0 * (i + 1)
        for i, info in enumerate(infos)
    }
    got, text = {}, ""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            text = scrape(port)
        except OSError:
            time.sleep(0.1)
            continue
        got = {
            (lb.get("hostname"), lb.get("agent_name"), lb.get("pid"), lb.get("agent_instance"), lb.get("local_rank")): v
            for lb, v in samples(text, "agent_memory_registered_total")
        }
        # NIXL exports its events every 100 ms or so: wait for the values, not just the series.
        if got == want:
            break
        time.sleep(0.1)
    assert got == want, text
    keys = {frozenset(lb) for lb, _ in samples(text, "agent_tx_bytes_total")}
    assert keys == {frozenset({"hostname", "agent_name", "pid", "agent_instance", "local_rank"})}, text
    assert "# TYPE agent_xfer_time_us histogram" in text


@pytest.mark.two_process
def test_prometheus_mp_needs_its_directory(peers, tmp_path):
    env = _env(tmp_path, free_port())
    del env["NIXL_TELEMETRY_MULTIPROC_DIR"]
    p = peers("nodir", env=env)
    with pytest.raises(PeerError):
        p.init(name="mp-py-nodir", telemetry=True)
