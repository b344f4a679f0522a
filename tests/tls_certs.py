"""Certificates made at test time with `openssl`: a CA, a server and a client certificate it signed, and a rogue
client certificate it did not sign. EC keys: quick to make, and as strict as RSA for what the tests check.
"""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

OPENSSL_TIMEOUT_SECONDS = 30.0
EC_KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    rogue_cert: str  # self-signed: not signed by `ca`
    rogue_key: str

    def client_context(self, with_cert: bool = False, rogue: bool = False) -> ssl.SSLContext:
        """A client context that trusts the test CA, presenting the client (or rogue) certificate if asked."""
        context = ssl.create_default_context(cafile=self.ca)
        if rogue:
            context.load_cert_chain(self.rogue_cert, self.rogue_key)
        elif with_cert:
            context.load_cert_chain(self.client_cert, self.client_key)
        return context

    def server_args(self, tls_port: int, require_client_cert: bool = False) -> list[str]:
        args = ["--tls-port", str(tls_port), "--tls-cert", self.server_cert, "--tls-key", self.server_key]
        return args + (["--tls-ca", self.ca] if require_client_cert else [])


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=OPENSSL_TIMEOUT_SECONDS)


def signed(name: str, subject: str, extensions: str, cwd: Path) -> None:
    """`{name}.pem` and `{name}.key`, signed by the CA in `cwd`."""
    (cwd / f"{name}.ext").write_text(extensions)
    openssl("req", *EC_KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=cwd)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=cwd)


def make_certs(directory: Path) -> Certs:
    openssl("req", "-x509", *EC_KEY, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=mqks test CA",
            cwd=directory)
    common = "basicConstraints=CA:FALSE\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    signed("server", "/CN=localhost", common + "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
           "extendedKeyUsage=serverAuth,clientAuth\n", directory)  # a cluster node is both ends of its links
    signed("client", "/CN=mqks test client", common + "extendedKeyUsage=clientAuth\n", directory)
    openssl("req", "-x509", *EC_KEY, "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2", "-subj",
            "/CN=rogue client", cwd=directory)
    d = str(directory)
    return Certs(ca=f"{d}/ca.pem", server_cert=f"{d}/server.pem", server_key=f"{d}/server.key",
                 client_cert=f"{d}/client.pem", client_key=f"{d}/client.key", rogue_cert=f"{d}/rogue.pem",
                 rogue_key=f"{d}/rogue.key")
