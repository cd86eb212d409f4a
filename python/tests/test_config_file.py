"""NIXL's config file (NIXL_CONFIG_FILE, else $HOME/.nixl.cfg, else /etc/nixl.cfg), run the same way
against gixl and NIXL 1.5.1: options come from the file when the environment lacks them, the environment
wins, TOML types are strict, and a file that is named but missing or does not parse fails agent creation.
Each case runs in a fresh process (the file is read once per process)."""

from __future__ import annotations

import pytest

from helpers import run_impl_child

CODE = """
import numpy as np
api = M.api
try:
    a = api.nixl_agent("cfgtest", api.nixl_agent_config())
    b = np.zeros(4096, dtype=np.uint8)
    a.register_memory([(b.ctypes.data, 4096, 0, "")], "DRAM")
    print("created")
except Exception as e:
    print("raised", type(e).__name__, str(e).replace(chr(10), " ")[:300])
"""


def _run(tmp_path, cfg: str | None, env: dict | None = None, named: bool = True) -> tuple[str, bool]:
    """Create an agent (and register 4 KiB) in a child with this config file; (outcome, telemetry file made)."""
    tele = tmp_path / "tele"
    tele.mkdir(exist_ok=True)
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    env = {"HOME": str(home), **(env or {})}
    if cfg is not None:
        path = tmp_path / "nixl.cfg" if named else home / ".nixl.cfg"
        path.write_text(cfg.replace("@TELE@", str(tele)))
        if named:
            env.setdefault("NIXL_CONFIG_FILE", str(path))
    drop = lambda k: k.startswith("NIXL_TELEMETRY_") or k in ("NIXL_CONFIG_FILE", "NIXL_LOG_LEVEL", "NIXL_ETCD_ENDPOINTS")  # noqa: E731
    return run_impl_child(CODE, env, drop), (tele / "cfgtest").exists()


TELE = 'NIXL_TELEMETRY_ENABLE = true\nNIXL_TELEMETRY_DIR = "@TELE@"\nNIXL_TELEMETRY_BUFFER_SIZE = 64\n'


def test_options_come_from_the_named_file(tmp_path):
    assert _run(tmp_path, TELE) == ("created", True)


def test_home_file_when_none_is_named(tmp_path):
    assert _run(tmp_path, TELE, named=False) == ("created", True)


def test_the_environment_wins(tmp_path):
    assert _run(tmp_path, TELE, {"NIXL_TELEMETRY_ENABLE": "n"}) == ("created", False)


def test_an_invalid_environment_value_is_not_replaced_by_the_file(tmp_path):
    outcome, made = _run(tmp_path, TELE, {"NIXL_TELEMETRY_ENABLE": "maybe"})
    assert outcome.startswith("raised") and not made, outcome


@pytest.mark.parametrize(
    "cfg",
    [
        'NIXL_TELEMETRY_ENABLE = "yes"\n',  # a string where a boolean is expected
        'NIXL_TELEMETRY_ENABLE = 1\n',  # an integer where a boolean is expected
        'NIXL_TELEMETRY_ENABLE = true\nNIXL_TELEMETRY_DIR = "@TELE@"\nNIXL_TELEMETRY_BUFFER_SIZE = "64"\n',
        "NIXL_TELEMETRY_ENABLE = tru e\n",  # not TOML
    ],
    ids=["string-for-boolean", "integer-for-boolean", "string-for-integer", "not-toml"],
)
def test_a_bad_file_fails_agent_creation(tmp_path, cfg):
    outcome, made = _run(tmp_path, cfg)
    assert outcome.startswith("raised") and not made, outcome


def test_a_named_file_that_does_not_exist_fails_agent_creation(tmp_path):
    outcome, _ = _run(tmp_path, None, {"NIXL_CONFIG_FILE": str(tmp_path / "missing.cfg")})
    assert outcome.startswith("raised"), outcome


def test_only_top_level_keys_are_options(tmp_path):
    assert _run(tmp_path, "[telemetry]\n" + TELE) == ("created", False)


@pytest.mark.parametrize("port", ["70000", "-1", "abc"])
def test_a_prometheus_port_out_of_range_fails_agent_creation(tmp_path, port):
    env = {"NIXL_TELEMETRY_ENABLE": "y", "NIXL_TELEMETRY_EXPORTER": "prometheus", "NIXL_TELEMETRY_PROMETHEUS_PORT": port}
    outcome, _ = _run(tmp_path, None, env)
    assert outcome.startswith("raised"), outcome


def test_a_telemetry_buffer_of_zero_events_fails_agent_creation(tmp_path):
    outcome, made = _run(tmp_path, TELE.replace("= 64", "= 0"))
    assert outcome.startswith("raised") and not made, outcome
