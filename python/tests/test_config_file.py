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
    drop = lambda k: k.startswith(("NIXL_TELEMETRY_", "NIXL_ETCD_", "NIXL_TCPSTORE_")) or k in (  # noqa: E731
        "NIXL_CONFIG_FILE",
        "NIXL_LOG_LEVEL",
        "NIXL_UCX_SGL_ENABLE",
    )
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


# --------------------------------------------------------------------------- further checks NIXL 1.5.1 makes
# Each case below was run against NIXL 1.5.1 in a fresh process. NIXL parses integers with std::from_chars:
# no sign, no surrounding spaces, hex (0x/0X) for unsigned options; yes/no words are matched exactly (no trim).

ON = {"NIXL_TELEMETRY_ENABLE": "y"}
PROM = {
    **ON,
    "NIXL_TELEMETRY_EXPORTER": "prometheus",
    "NIXL_TELEMETRY_PROMETHEUS_PORT": "0",
    "NIXL_TELEMETRY_PROMETHEUS_LOCAL": "y",
}


def _mp(tmp_path) -> dict:
    return {**PROM, "NIXL_TELEMETRY_EXPORTER": "prometheus_mp", "NIXL_TELEMETRY_MULTIPROC_DIR": str(tmp_path / "mp")}


def _file_sink(tmp_path) -> dict:
    return {**ON, "NIXL_TELEMETRY_DIR": str(tmp_path / "tele")}


@pytest.mark.parametrize(
    "env, cfg",
    [
        ({"NIXL_TELEMETRY_BUFFER_SIZE": "3"}, None),
        ({"NIXL_TELEMETRY_BUFFER_SIZE": "100"}, None),
        ({"NIXL_TELEMETRY_BUFFER_SIZE": "4097"}, None),
        ({}, TELE.replace("= 64", "= 100")),
    ],
    ids=["3", "100", "4097", "file-100"],
)
def test_a_telemetry_buffer_size_that_is_not_a_power_of_two_fails_agent_creation(tmp_path, env, cfg):
    # NIXL's file ring: "Telemetry buffer size must be a power of 2" -> "Failed to create telemetry exporter: BUFFER".
    if cfg is None:
        env = {**_file_sink(tmp_path), **env}
    outcome, _ = _run(tmp_path, cfg, env)
    assert outcome.startswith("raised"), outcome


@pytest.mark.parametrize(
    "sink, size",
    [
        ("nop", "0"),
        ("nop", "-1"),
        ("nop", "abc"),
        ("nop", ""),
        ("prometheus", "0"),
        ("prometheus", "abc"),
        ("nop-file", "0"),
        ("nop-file", "-1"),
        ("prometheus-file", "0"),
    ],
)
def test_a_bad_telemetry_buffer_size_fails_agent_creation_with_any_exporter(tmp_path, sink, size):
    # NIXL reads NIXL_TELEMETRY_BUFFER_SIZE whenever telemetry is on, whatever the exporter.
    if sink.endswith("-file"):
        cfg = "NIXL_TELEMETRY_ENABLE = true\n" + f"NIXL_TELEMETRY_BUFFER_SIZE = {size}\n"
        env = {k: v for k, v in PROM.items() if k != "NIXL_TELEMETRY_ENABLE"} if sink.startswith("prometheus") else {}
        outcome, _ = _run(tmp_path, cfg, env)
    else:
        env = {**(PROM if sink == "prometheus" else ON), "NIXL_TELEMETRY_BUFFER_SIZE": size}
        outcome, _ = _run(tmp_path, None, env)
    assert outcome.startswith("raised"), outcome


@pytest.mark.parametrize("size", [" 64", "64 ", "+64"], ids=["leading-space", "trailing-space", "plus-sign"])
def test_a_telemetry_buffer_size_with_spaces_or_a_sign_fails_agent_creation(tmp_path, size):
    outcome, made = _run(tmp_path, None, {**_file_sink(tmp_path), "NIXL_TELEMETRY_BUFFER_SIZE": size})
    assert outcome.startswith("raised") and not made, outcome


@pytest.mark.parametrize("size", ["0x40", "0X40"])
def test_a_hexadecimal_telemetry_buffer_size_is_accepted(tmp_path, size):
    assert _run(tmp_path, None, {**_file_sink(tmp_path), "NIXL_TELEMETRY_BUFFER_SIZE": size}) == ("created", True)


@pytest.mark.parametrize(
    "env, cfg",
    [
        ({"NIXL_TELEMETRY_RUN_INTERVAL": "-1"}, None),
        ({"NIXL_TELEMETRY_RUN_INTERVAL": "abc"}, None),
        ({"NIXL_TELEMETRY_RUN_INTERVAL": ""}, None),
        ({"NIXL_TELEMETRY_RUN_INTERVAL": " 100"}, None),
        ({"NIXL_TELEMETRY_RUN_INTERVAL": "18446744073709551616"}, None),
        ({**ON, "NIXL_TELEMETRY_RUN_INTERVAL": "abc"}, None),
        ({}, TELE + 'NIXL_TELEMETRY_RUN_INTERVAL = "abc"\n'),
        ({}, TELE + "NIXL_TELEMETRY_RUN_INTERVAL = 1.5\n"),
    ],
    ids=["-1", "abc", "empty", "leading-space", "2^64", "nop-abc", "file-string", "file-float"],
)
def test_a_bad_telemetry_run_interval_fails_agent_creation(tmp_path, env, cfg):
    # NIXL_TELEMETRY_RUN_INTERVAL (milliseconds, unsigned) is read whenever telemetry is on.
    if cfg is None and "NIXL_TELEMETRY_ENABLE" not in env:
        env = {**_file_sink(tmp_path), **env}
    outcome, _ = _run(tmp_path, cfg, env)
    assert outcome.startswith("raised"), outcome


@pytest.mark.parametrize("value", [" y", "y "], ids=["leading-space", "trailing-space"])
def test_a_telemetry_enable_flag_with_spaces_fails_agent_creation(tmp_path, value):
    outcome, made = _run(tmp_path, None, {**_file_sink(tmp_path), "NIXL_TELEMETRY_ENABLE": value})
    assert outcome.startswith("raised") and not made, outcome


@pytest.mark.parametrize(
    "exporter",
    ["nop", "NOP ", " prometheus", " "],
    ids=["lowercase-nop", "NOP-trailing-space", "leading-space", "blank"],
)
def test_an_exporter_name_is_matched_exactly(tmp_path, exporter):
    outcome, _ = _run(tmp_path, None, {**PROM, "NIXL_TELEMETRY_EXPORTER": exporter})
    assert outcome.startswith("raised"), outcome


def test_the_file_exporter_can_be_named_buffer(tmp_path):
    assert _run(tmp_path, None, {**_file_sink(tmp_path), "NIXL_TELEMETRY_EXPORTER": "BUFFER"}) == ("created", True)


@pytest.mark.parametrize("port", [" 0", "0 "], ids=["leading-space", "trailing-space"])
def test_a_prometheus_port_with_spaces_fails_agent_creation(tmp_path, port):
    outcome, _ = _run(tmp_path, None, {**PROM, "NIXL_TELEMETRY_PROMETHEUS_PORT": port})
    assert outcome.startswith("raised"), outcome


def test_a_hexadecimal_prometheus_port_is_accepted(tmp_path):
    assert _run(tmp_path, None, {**PROM, "NIXL_TELEMETRY_PROMETHEUS_PORT": "0x0"}) == ("created", False)


@pytest.mark.parametrize(
    "ttl, in_file",
    [
        ("-1", False),
        ("abc", False),
        ("", False),
        ("1.5", False),
        (" 30", False),
        ("18446744073709551616", False),
        ("-1", True),
    ],
    ids=["-1", "abc", "empty", "fraction", "leading-space", "2^64", "file--1"],
)
def test_a_bad_prometheus_mp_stale_ttl_fails_agent_creation(tmp_path, ttl, in_file):
    # NIXL_TELEMETRY_MP_STALE_TTL is whole seconds (unsigned); NIXL fails the prometheus_mp exporter otherwise.
    if in_file:
        outcome, _ = _run(tmp_path, f"NIXL_TELEMETRY_MP_STALE_TTL = {ttl}\n", _mp(tmp_path))
    else:
        outcome, _ = _run(tmp_path, None, {**_mp(tmp_path), "NIXL_TELEMETRY_MP_STALE_TTL": ttl})
    assert outcome.startswith("raised"), outcome


@pytest.mark.parametrize(
    "env, cfg",
    [
        ({"NIXL_ETCD_ENDPOINTS": ""}, None),
        ({"NIXL_TCPSTORE_ENDPOINT": ""}, None),
        ({}, 'NIXL_ETCD_ENDPOINTS = ""\n'),
        ({}, 'NIXL_TCPSTORE_ENDPOINT = ""\n'),
    ],
    ids=["etcd", "tcpstore", "file-etcd", "file-tcpstore"],
)
def test_an_empty_metadata_store_endpoint_fails_agent_creation(tmp_path, env, cfg):
    # "Config parameter 'NIXL_ETCD_ENDPOINTS' needs non-empty value" (likewise NIXL_TCPSTORE_ENDPOINT).
    outcome, _ = _run(tmp_path, cfg, env)
    assert outcome.startswith("raised"), outcome


@pytest.mark.parametrize(
    "env",
    [
        {"NIXL_TCPSTORE_ENDPOINT": "abc"},
        {"NIXL_TCPSTORE_ENDPOINT": " "},
        {"NIXL_TCPSTORE_ENDPOINT": "127.0.0.1:70000"},
        {"NIXL_TCPSTORE_ENDPOINT": "127.0.0.1:-1"},
        {"NIXL_TCPSTORE_ENDPOINT": "127.0.0.1:abc"},
        {"NIXL_TCPSTORE_ENDPOINT": "127.0.0.1:1", "NIXL_TCPSTORE_TIMEOUT_MS": "abc"},
        {"NIXL_TCPSTORE_ENDPOINT": "127.0.0.1:1", "NIXL_TCPSTORE_TIMEOUT_MS": ""},
        {"NIXL_TCPSTORE_ENDPOINT": "127.0.0.1:1", "NIXL_TCPSTORE_OP_TIMEOUT_MS": "abc"},
        {"NIXL_TCPSTORE_ENDPOINT": "127.0.0.1:1", "NIXL_TCPSTORE_OP_TIMEOUT_MS": ""},
    ],
    ids=["no-port", "blank", "port-70000", "port--1", "port-abc", "timeout-abc", "timeout-empty", "op-timeout-abc",
         "op-timeout-empty"],
)
def test_a_malformed_tcpstore_setting_fails_agent_creation(tmp_path, env):
    # Checked at agent creation (nothing is connected to yet): "NIXL_TCPSTORE_ENDPOINT must be host:port, got: ...",
    # "NIXL_TCPSTORE_ENDPOINT has invalid port: ...", "Invalid integer string '...'".
    outcome, _ = _run(tmp_path, None, env)
    assert outcome.startswith("raised"), outcome


@pytest.mark.parametrize("value", ["abc", "", "2"], ids=["abc", "empty", "2"])
def test_a_bad_ucx_sgl_enable_flag_fails_agent_creation(tmp_path, value):
    # NIXL's UCX backend (created by the default agent config) fails: nixlBackendError NIXL_ERR_BACKEND.
    outcome, _ = _run(tmp_path, None, {"NIXL_UCX_SGL_ENABLE": value})
    assert outcome.startswith("raised"), outcome


def test_an_empty_config_file_name_fails_agent_creation(tmp_path):
    # NIXL tries to open "" ("File could not be opened for reading"); it does not fall back to $HOME/.nixl.cfg.
    outcome, made = _run(tmp_path, TELE, {"NIXL_CONFIG_FILE": ""}, named=False)
    assert outcome.startswith("raised") and not made, outcome
