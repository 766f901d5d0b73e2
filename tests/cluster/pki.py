"""Throwaway certificates and keys for one test cluster, made with the openssl CLI.

One CA signs the API server's serving certificate and every client certificate; Kubernetes takes
a client's user name from the certificate's CN and its groups from O. The service-account key pair
signs and verifies ServiceAccount tokens (the TokenRequest API). EC P-256 keys: generating them
takes milliseconds, RSA would dominate a warm start. Certificates live two days: a cluster lives
for one test session.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.binaries import MissingBinariesError

VALID_DAYS = 2

_OPENSSL_CONFIG = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca_ext]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[server_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = {sans}
[client_ext]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = clientAuth
"""

# Names the API server answers to: loopback for us, the in-cluster names for pods' clients.
SERVING_SANS = (
    "IP:127.0.0.1",
    "DNS:localhost",
    "DNS:kubernetes",
    "DNS:kubernetes.default",
    "DNS:kubernetes.default.svc",
    "DNS:kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True, slots=True)
class CertPair:
    cert: Path
    key: Path


@dataclass(frozen=True, slots=True)
class ClientSubject:
    """A client identity as Kubernetes reads it: user = CN, groups = O."""

    user: str
    groups: tuple[str, ...] = ()

    def openssl_subject(self) -> str:
        return "".join(f"/O={g}" for g in self.groups) + f"/CN={self.user}"


@dataclass(frozen=True, slots=True)
class Pki:
    ca: CertPair
    serving: CertPair
    sa_private_key: Path
    sa_public_key: Path
    clients: dict[str, CertPair]


def _openssl(*args: str) -> None:
    try:
        result = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise MissingBinariesError(
            "the openssl CLI is missing; tests/cluster/build.sh installs it"
            " (apt-get install openssl)"
        ) from exc
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {result.stderr.strip()}")


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-out", str(path))
    path.chmod(0o600)


def _issue(
    config: Path, ca: CertPair | None, pair: CertPair, subject: str, extensions: str
) -> None:
    """A certificate for pair.key; self-signed when ca is None."""
    _new_key(pair.key)
    args = ["req", "-x509", "-new", "-config", str(config), "-key", str(pair.key)]
    args += ["-subj", subject, "-days", str(VALID_DAYS), "-extensions", extensions]
    if ca is not None:
        args += ["-CA", str(ca.cert), "-CAkey", str(ca.key)]
    _openssl(*args, "-out", str(pair.cert))


def make_pki(directory: Path, clients: dict[str, ClientSubject]) -> Pki:
    """Create the CA, the serving certificate, one client certificate per entry, the SA keys."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "openssl.cnf"
    config.write_text(_OPENSSL_CONFIG.format(sans=",".join(SERVING_SANS)))
    ca = CertPair(directory / "ca.crt", directory / "ca.key")
    _issue(config, None, ca, "/CN=kvfleet-test-ca", "ca_ext")
    serving = CertPair(directory / "apiserver.crt", directory / "apiserver.key")
    _issue(config, ca, serving, "/CN=kube-apiserver", "server_ext")
    issued: dict[str, CertPair] = {}
    for name, subject in clients.items():
        pair = CertPair(directory / f"{name}.crt", directory / f"{name}.key")
        _issue(config, ca, pair, subject.openssl_subject(), "client_ext")
        issued[name] = pair
    sa_private = directory / "sa.key"
    sa_public = directory / "sa.pub"
    _new_key(sa_private)
    _openssl("pkey", "-in", str(sa_private), "-pubout", "-out", str(sa_public))
    return Pki(ca, serving, sa_private, sa_public, issued)
