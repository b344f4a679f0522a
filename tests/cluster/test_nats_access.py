"""NATS as operators run it (issue 42): a real nats-server with TLS from a CA this test makes with openssl, clients it
verifies (mutual TLS), and users with a password or an nkey. mqksd and `mqks cluster` reach it with --log-ca,
--log-cert/--log-key, --log-nkey and MQKS_NATS_USER/PASSWORD; a wrong password says what NATS said, a certificate
problem says which, and no secret of the test reaches any log line, error or page."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import MQKS, free_port, unique
from tls_certs import Certs, make_certs
from waiting import wait_for

pytestmark = pytest.mark.timeout(180)

pytest.importorskip("nats", reason="the cluster extra (pip install -e '.[cluster]') is not installed")
nkeys = pytest.importorskip("nkeys", reason="the cluster extra's nkeys (pip install -e '.[cluster]')")

PASSWORD = "nats-pass-0123456789"


def listening(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def secured_nats(tmp_path_factory) -> tuple[int, Certs, str, Path]:
    """One nats-server: TLS with the test CA, client certificates verified, a password user and an nkey user.
    (port, certificates, the nkey user's seed file, the directory)"""
    from mqks.client.nats_local import nats_server_binary

    directory = tmp_path_factory.mktemp("secured-nats")
    (directory / "certs").mkdir()
    certs = make_certs(directory / "certs")
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    seed_file = directory / "user.nk"
    seed_file.write_bytes(seed + b"\n")
    public = nkeys.from_seed(seed).public_key.decode()
    port = free_port()
    config = directory / "nats.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\njetstream {{ store_dir: {str(directory / 'store')!r} }}\n"
        f"tls {{ cert_file: {certs.server_cert!r}, key_file: {certs.server_key!r}, ca_file: {certs.ca!r}, "
        "verify: true }\n"
        f"authorization {{ users: [ {{user: mqks, password: {PASSWORD!r}}}, {{nkey: {public!r}}} ] }}\n")
    with open(directory / "nats.log", "wb") as log:
        nats = subprocess.Popen([nats_server_binary(), "-c", str(config)], stdout=log, stderr=log)
    try:
        wait_for(lambda: listening(port), "the secured NATS server to listen")
        yield port, certs, str(seed_file), directory
    finally:
        nats.kill()
        nats.wait()


def tls_args(certs: Certs) -> list[str]:
    return ["--log-ca", certs.ca, "--log-cert", certs.client_cert, "--log-key", certs.client_key]


def mqksd(port: int, *args: str, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "mqks.server", "--port", str(port), "--log-replicas", "1",
                                 *args], stdout=out, stderr=out, env={**os.environ, **env})


def test_a_broker_logs_to_tls_nats_with_a_user_from_the_environment_and_never_shows_the_password(
        secured_nats, make_broker):
    nats_port, certs, _, _ = secured_nats
    server = make_broker("--log", f"tls://127.0.0.1:{nats_port}", "--log-stream", unique("s").replace("-", "_"),
                         "--log-replicas", "1", *tls_args(certs),
                         env={"MQKS_NATS_USER": "mqks", "MQKS_NATS_PASSWORD": PASSWORD})
    wire = server.wire()
    wire.send(b"c consume --confirm q e", b"m publish --confirm e kept")
    wire.expect(b"c ok ")
    assert {wire.recv_line(), wire.recv_line()} == {b"m ok ", b"c ok m event=e kept"}
    assert PASSWORD not in server.log()


def test_an_nkey_seed_file_proves_the_broker(secured_nats, make_broker):
    nats_port, certs, seed_file, _ = secured_nats
    server = make_broker("--log", f"tls://127.0.0.1:{nats_port}", "--log-stream", unique("s").replace("-", "_"),
                         "--log-replicas", "1", *tls_args(certs), "--log-nkey", seed_file)
    wire = server.wire()
    wire.send(b"m publish --confirm e stored")
    wire.expect(b"m ok ")
    seed = Path(seed_file).read_text().strip()
    assert seed not in server.log()


def run_refused(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "mqks.server", "--port", str(free_port()), "--log-replicas", "1",
                           *args], capture_output=True, text=True, timeout=90, env={**os.environ, **(env or {})})
    assert done.returncode != 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


def test_each_wrong_setting_is_one_line_that_says_what_is_wrong(secured_nats, tmp_path):
    nats_port, certs, _, _ = secured_nats
    url = f"tls://127.0.0.1:{nats_port}"
    wrong = run_refused("--log", url, *tls_args(certs), env={"MQKS_NATS_USER": "mqks",
                                                             "MQKS_NATS_PASSWORD": "wrong-" + PASSWORD})
    assert "Authorization Violation" in wrong and PASSWORD not in wrong, wrong
    # the server's certificate is signed by a CA this broker was not given: the system's CAs do not know it
    unknown_ca = run_refused("--log", url, "--log-cert", certs.client_cert, "--log-key", certs.client_key,
                             env={"MQKS_NATS_USER": "mqks", "MQKS_NATS_PASSWORD": PASSWORD})
    assert "certificate verify failed" in unknown_ca, unknown_ca
    # the server verifies clients: without a certificate the handshake is refused
    no_cert = run_refused("--log", url, "--log-ca", certs.ca, env={"MQKS_NATS_USER": "mqks",
                                                                   "MQKS_NATS_PASSWORD": PASSWORD})
    assert "cannot reach NATS at tls://127.0.0.1" in no_cert, no_cert
    missing = run_refused("--log", url, "--log-ca", str(tmp_path / "no-such-ca.pem"))
    assert "--log-ca" in missing and "no-such-ca.pem" in missing and "cannot read it" in missing, missing
    half = run_refused("--log", url, "--log-cert", certs.client_cert)
    assert "--log-cert and --log-key go together" in half, half


def test_a_cluster_node_and_mqks_cluster_status_use_the_same_settings(secured_nats, tmp_path):
    nats_port, certs, seed_file, _ = secured_nats
    name = unique("c").replace("-", "_")
    url = f"tls://127.0.0.1:{nats_port}"
    log_path = tmp_path / "node.log"
    env = {"MQKS_NATS_USER": "mqks", "MQKS_NATS_PASSWORD": PASSWORD}
    node = mqksd(free_port(), "--cluster", name, "--node", "a", "--groups", "2", "--log", url, *tls_args(certs),
                 env=env, log_path=log_path)
    try:
        def owned() -> list[dict] | None:
            done = subprocess.run([str(MQKS), "cluster", "status", "--json", "--cluster", name, "--log", url,
                                   *tls_args(certs), "--log-nkey", seed_file], capture_output=True, text=True,
                                  timeout=60)
            rows = json.loads(done.stdout) if done.returncode == 0 else []
            return rows if len(rows) == 2 and all(row["owner"] == "a" for row in rows) else None

        wait_for(owned, "both groups owned by node a, as mqks cluster status reads them over TLS", 90, interval=1.0)
        assert node.poll() is None, log_path.read_text()
        refused = subprocess.run([str(MQKS), "cluster", "status", "--cluster", name, "--log", url, "--log-ca",
                                  certs.ca], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and "mqks cluster status" in refused.stderr
    finally:
        node.terminate()
        node.wait(30)
    assert PASSWORD not in log_path.read_text()
