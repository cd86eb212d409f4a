"""A real S3 server for the OBJ backend's tests and benchmark: Garage, single node, on loopback.

``scripts/setup.sh`` builds Garage 2.5.0 once per machine into ``~/.cache/gixl/garage-2.5.0-lmdb`` (or
``$GIXL_GARAGE``). ``Garage.start(dir)`` runs ``garage server --single-node --default-bucket`` on free
loopback ports with a fresh key and bucket; ``stop()``/``kill()`` end it. Nothing here reaches beyond
127.0.0.1, and ``no_discovery()`` is the environment every S3 client in the tests runs with: explicit
credentials only, no instance-metadata or credential-file lookup.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

REGION = "garage"


def garage_exe() -> str | None:
    """The Garage binary, or None when this machine has none."""
    for cand in (
        os.environ.get("GIXL_GARAGE"),
        str(Path.home() / ".cache/gixl/garage-2.5.0-lmdb/bin/garage"),
        shutil.which("garage"),
    ):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_discovery(env: dict | None = None) -> dict:
    """An environment in which no AWS client looks for credentials or regions anywhere but its arguments."""
    env = dict(os.environ if env is None else env)
    for k in list(env):
        if k.startswith("AWS_"):
            del env[k]
    env.update(
        AWS_EC2_METADATA_DISABLED="true",
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    )
    return env


def isolate_this_process() -> None:
    """Apply ``no_discovery`` to this process (NIXL's AWS SDK reads the environment at backend creation)."""
    clean = no_discovery()
    for k in list(os.environ):
        if k not in clean:
            del os.environ[k]
    os.environ.update(clean)


class Garage:
    def __init__(self, exe: str, root: Path):
        self.exe, self.root = exe, root
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.access_key = "GK" + secrets.token_hex(12)
        self.secret_key = secrets.token_hex(32)
        self.bucket = "gixl-test"
        self.proc: subprocess.Popen | None = None

    @classmethod
    def start(cls, root: Path, exe: str | None = None) -> "Garage":
        exe = exe or garage_exe()
        if exe is None:
            raise FileNotFoundError("garage is not installed (scripts/setup.sh builds it)")
        g = cls(exe, Path(root))
        g._launch()
        return g

    def _launch(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "garage.toml"
        conf.write_text(
            f'metadata_dir = "{self.root}/meta"\n'
            f'data_dir = "{self.root}/data"\n'
            'db_engine = "lmdb"\n'
            "replication_factor = 1\n"
            f'rpc_bind_addr = "127.0.0.1:{free_port()}"\n'
            f'rpc_secret = "{secrets.token_hex(32)}"\n'
            "[s3_api]\n"
            f's3_region = "{REGION}"\n'
            f'api_bind_addr = "127.0.0.1:{self.port}"\n'
            'root_domain = ".s3.localhost"\n'
        )
        env = no_discovery()
        env.update(
            GARAGE_DEFAULT_ACCESS_KEY=self.access_key,
            GARAGE_DEFAULT_SECRET_KEY=self.secret_key,
            GARAGE_DEFAULT_BUCKET=self.bucket,
            RUST_LOG="warn",
        )
        log = open(self.root / "garage.log", "ab")
        self.proc = subprocess.Popen(
            [self.exe, "-c", str(conf), "server", "--single-node", "--default-bucket"],
            stdout=log, stderr=log, env=env, start_new_session=True)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"garage exited with {self.proc.returncode}: {self.log_tail()}")
            if self._bucket_ready():
                return
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"garage did not come up in 30 s: {self.log_tail()}")
            time.sleep(0.05)

    def _bucket_ready(self) -> bool:
        try:
            c = self.client()
            c.head_bucket(Bucket=self.bucket)
            return True
        except Exception:
            return False

    def log_tail(self) -> str:
        try:
            return (self.root / "garage.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def params(self, **over) -> dict:
        """The OBJ backend parameters for this server (strings, as NIXL takes them)."""
        p = {
            "access_key": self.access_key,
            "secret_key": self.secret_key,
            "bucket": self.bucket,
            "endpoint_override": self.endpoint,
            "scheme": "http",
            "region": REGION,
        }
        p.update({k: str(v) for k, v in over.items()})
        return {k: v for k, v in p.items() if v != "None"}

    def client(self):
        """An independent S3 client (boto3), for checking what is on the server."""
        import boto3
        from botocore.config import Config

        os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=REGION,
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1},
                          connect_timeout=2, read_timeout=10),
        )

    def stop_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def restart(self) -> None:
        """Start again on the same port and data (after ``kill``)."""
        self.kill()
        self._launch()


def make_ca_and_cert(root: Path, tag: str = "ca") -> tuple[Path, Path, Path]:
    """A throw-away CA (``openssl``) and a server certificate it signed for localhost and 127.0.0.1:
    (CA certificate, server certificate, server key), PEM files under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    ca_key, ca_crt = root / f"{tag}.key", root / f"{tag}.crt"
    key, csr, crt, ext = root / f"{tag}-srv.key", root / f"{tag}-srv.csr", root / f"{tag}-srv.crt", root / f"{tag}.ext"

    def ossl(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca_crt),
         "-days", "2", "-subj", f"/CN=gixl test {tag}")
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    ossl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key), "-CAcreateserial",
         "-out", str(crt), "-days", "2", "-extfile", str(ext))
    return ca_crt, crt, key


class TlsProxy:
    """HTTPS in front of a plain-HTTP server: terminates TLS on a loopback port and forwards the bytes."""

    def __init__(self, cert: Path, key: Path, upstream_port: int):
        import ssl
        import threading

        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(cert), str(key))
        self.upstream = upstream_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        import threading

        while not self.closed:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c):
        import threading

        try:
            t = self.ctx.wrap_socket(c, server_side=True)
        except OSError:
            c.close()
            return
        u = socket.create_connection(("127.0.0.1", self.upstream))

        def pump(src, dst):
            try:
                while True:
                    b = src.recv(1 << 16)
                    if not b:
                        break
                    dst.sendall(b)
            except OSError:
                pass
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pump, args=(u, t), daemon=True).start()
        pump(t, u)

    def close(self):
        self.closed = True
        self.sock.close()
