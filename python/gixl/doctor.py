"""``gixl doctor``: which routes work on this host and to a given peer, which one gixl picks and why.

The human report opens with a summary, the answer to "why is my transfer slow, why is it not using my NIC":
the route each kind of peer gets (same process, same host, other host, VRAM) and each device (RDMA ports,
TCP, GPU, io_uring) with whether gixl uses it and why; the details follow.

``python -m gixl doctor [--json] [--peer-md FILE | --peer NAME@HOST:PORT]``

* ``--peer-md FILE``: a peer's metadata (``nixl_agent.get_agent_metadata()`` written to a file);
* ``--peer NAME@HOST:PORT``: fetch it from the peer's metadata listener (``enable_listen_thread``).

With a peer, a throw-away agent loads it, reports the route it gets (in-process, cma, tcp,
tcp-after-cma-denied) and why, and times a READ from the peer's first registered region.
The C function ``gixl_doctor`` returns the same JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Optional

__all__ = ["doctor", "main", "render"]


def doctor(peer_md: Optional[bytes] = None, peer: Optional[str] = None) -> dict:
    """The report as a dict (see ``python -m gixl doctor --json``)."""
    from . import _gixl  # type: ignore[attr-defined]

    if peer is not None:
        name, _, hostport = peer.rpartition("@")
        host, _, port = hostport.rpartition(":")
        if not name or not host or not port.isdigit():
            raise ValueError(f"--peer wants NAME@HOST:PORT, got {peer!r}")
        r = json.loads(_gixl._doctor(peer_name=name, peer_ip=host, peer_port=int(port)))
    else:
        r = json.loads(_gixl._doctor(peer_md=peer_md))
    r["python"] = _python()
    return r


def _python() -> dict:
    """Who answers ``import nixl`` here, and NVIDIA's NIXL distributions installed beside gixl."""
    try:
        from nixl._nvidia import beside

        return beside()
    except Exception as e:  # NVIDIA's nixl answers (GIXL_NIXL=off), or none does
        return {"error": f"{type(e).__name__}: {e}"}


def _yes(ok: Any) -> str:
    return "yes" if ok else "NO"


def _summary(r: dict) -> list:
    """The first lines: the route each kind of peer gets and each device, used or not, with why."""
    s = r.get("summary") or {"routes": [], "devices": []}
    rows = [(x["peer"], x["route"], x["why"]) for x in s["routes"]]
    rows += [(d["device"], "used" if d["used"] else "NOT used", d["why"]) for d in s["devices"]]
    p = r.get("peer")
    if p is not None:
        if not p.get("ok"):
            rows.append(("this peer", "FAILED", f"at {p.get('stage', '?')}: {p.get('error', '')}"))
        else:
            pr = p["read_probe"]
            speed = f"READ {pr['gb_per_s']:.2f} GB/s" if "gb_per_s" in pr else f"READ probe: {pr.get('error') or pr.get('skipped')}"
            rows.append((f"peer {p['name']}", p["route"], f"{p['why']}; {speed}"))
    w1 = max((len(a) for a, _, _ in rows), default=0)
    w2 = max((len(b) for _, b, _ in rows), default=0)
    out = ["gixl doctor: the route to each kind of peer and each device, used or not, and why (details below)"]
    out += [f"  {a:<{w1}}  {b:<{w2}}  {c}" for a, b, c in rows]
    return out


def render(r: dict) -> str:
    """The report for people: the summary (a dozen lines), then the details."""
    v, h, routes = r["versions"], r["host"], r["routes"]
    out = _summary(r) + ["details:"]
    out += [
        f"gixl {v['gixl']} (NIXL API {v['nixl_api']}; features: {', '.join(v['features']) or 'none'})",
        f"host {h['hostname']}, kernel {h['kernel']}, pid {h['pid']}, uid {h['uid']}",
        f"  namespaces: {h['pid_ns']} {h['net_ns']}",
        "routes on this host:",
        f"  in-process  {_yes(routes['in_process']['works'])}  {routes['in_process']['why']}",
        f"  cma         {_yes(routes['cma']['works'])}  {routes['cma']['why']}",
    ]
    c = routes["cma"]["checks"]
    scope = "none (no Yama)" if c["yama_ptrace_scope"] is None else c["yama_ptrace_scope"]
    out.append(
        f"              Yama ptrace_scope {scope}, seccomp {c['seccomp_mode']}, "
        f"CAP_SYS_PTRACE {_yes(c['cap_sys_ptrace'])}, self-probe {c['self_probe']}"
    )
    out.append(f"  tcp         {_yes(routes['tcp']['works'])}  {routes['tcp']['why']}")
    rd = routes["rdma"]
    out.append(f"  rdma        {_yes(rd['works'])}  devices: {', '.join(rd['devices']) or 'none'}; {rd['why']}")
    for t in rd.get("self_tests", []):
        res = "passed" if t["passed"] else f"FAILED at {t['step']}: {t['error']}"
        out.append(f"              self-test {t['device']}: {res} ({t['ms']} ms)")
    gd = rd["gpu_direct"]
    out.append(f"              GPU memory: peer-memory module {_yes(gd['peer_memory_module'])}; {gd['how']}")
    lf = routes["libfabric"]
    found = f"{lf['library']} (libfabric {lf['version']}, API {lf['api']})" if lf["found"] else f"not found ({lf['library']})"
    out.append(f"  libfabric   {_yes(lf['works'])}  {found}; devices: {', '.join(lf['devices']) or 'none'}; {lf['why']}")
    for t in lf["self_tests"]:
        res = "passed" if t["passed"] else f"FAILED at {t['step']}: {t['error']}"
        out.append(f"              self-test {t['device']}: {res} ({t['ms']} ms)")
    cu = routes["cuda"]
    out.append(f"  cuda        {_yes(cu['works'])}  libcuda {cu['libcuda']}; {cu['why']}")
    out.append(f"transport {r['transport']}: {r['route_choice']}")
    py = r.get("python") or {}
    if "nixl_is" in py:
        nv = ", ".join(py["nvidia"]) or "none"
        ep = ", ".join(py["nixl_ep"]) or "none"
        out.append(f"python: import nixl is {py['nixl_is']}; NVIDIA's NIXL beside it: {nv}; nixl_ep: {ep}")
    elif py:
        out.append(f"python: import nixl fails or is not gixl's: {py['error']}")
    if r["agents"]:
        out.append("agents in this process:")
        for a in r["agents"]:
            out.append(f"  {a['name']} incarnation {a['incarnation']}")
            for p in a["remotes"]:
                state = "connected" if p["connected"] else "DISCONNECTED"
                out.append(f"    peer {p['name']} incarnation {p['incarnation']} route {p['route']} ({state})")
    p = r.get("peer")
    if p is not None:
        if "listener" in p:
            li = p["listener"]
            reach = "reachable" if li["reachable"] else f"NOT reachable ({li['error']})"
            out.append(f"peer listener {li['address']}: {reach} in {li['connect_ms']:.1f} ms")
        if not p.get("ok"):
            out.append(f"peer: FAILED at {p.get('stage', '?')}: {p.get('error', '')}")
        else:
            out.append(f"peer {p['name']} incarnation {p['incarnation']}")
            if p["route"] != p["route_at_load"]:
                out.append(f"  route: {p['route']} (was {p['route_at_load']} when loaded)")
            else:
                out.append(f"  route: {p['route']}")
            out.append(f"  why: {p['why']}")
            pr = p["read_probe"]
            if "gb_per_s" in pr:
                out.append(f"  READ of {pr['bytes']} bytes: best {pr['best_seconds'] * 1e3:.2f} ms, {pr['gb_per_s']:.2f} GB/s")
            else:
                out.append(f"  READ probe: {pr.get('error') or pr.get('skipped')}")
    return "\n".join(out)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gixl doctor", description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--peer-md", metavar="FILE", help="a peer's metadata, as get_agent_metadata() returns it")
    g.add_argument("--peer", metavar="NAME@HOST:PORT", help="a peer's metadata listener")
    a = ap.parse_args(argv)
    md = None
    if a.peer_md:
        with open(a.peer_md, "rb") as f:
            md = f.read()
    r = doctor(peer_md=md, peer=a.peer)
    print(json.dumps(r, indent=2) if a.json else render(r))
    p = r.get("peer")
    return 1 if p is not None and not p.get("ok") else 0


if __name__ == "__main__":
    sys.exit(main())
