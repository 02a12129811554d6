"""Test certificates made with ``openssl``: a CA and a serving certificate for 127.0.0.1
signed by it, for the operator's HTTPS intake and webhook, the agent's CA handling and the
end-to-end demo. ECDSA P-256 keys by default, as the chart generates them
(``templates/tls.yaml``) and has cert-manager issue them: an RSA-2048 key cost 0.26 s of
CPU to make (a test makes two), ECDSA 6 ms, and each handshake costs the server less."""

from __future__ import annotations

import subprocess
from pathlib import Path

__all__ = ["ca_and_certificate", "issue", "make_ca", "new_key"]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def new_key(algorithm: str) -> list[str]:
    """``openssl req``'s arguments for a new key: ``"ec"``, ECDSA P-256; ``"rsa"``,
    RSA-2048."""
    if algorithm == "rsa":
        return ["-newkey", "rsa:2048"]
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]


def make_ca(directory: Path, name: str = "ca", algorithm: str = "ec") -> tuple[Path, Path]:
    """A self-signed CA in ``directory`` with an ECDSA P-256 (or ``algorithm="rsa"``:
    RSA-2048) key: (key, certificate)."""
    key, cert = directory / f"{name}.key", directory / f"{name}.crt"
    _openssl(
        "req", "-x509", *new_key(algorithm), "-nodes", "-days", "2",
        "-subj", f"/CN=hyperpod-sdc-test-{name}", "-keyout", str(key), "-out", str(cert),
    )  # fmt: skip
    return key, cert


def issue(
    directory: Path, ca: tuple[Path, Path], name: str = "tls", algorithm: str = "ec"
) -> tuple[Path, Path]:
    """A serving certificate for 127.0.0.1 signed by ``ca`` (its key, certificate), with
    an ECDSA P-256 or (``algorithm="rsa"``) an RSA-2048 key: (key, certificate)."""
    key, csr, cert = directory / f"{name}.key", directory / f"{name}.csr", directory / f"{name}.crt"
    ext = directory / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _openssl(
        "req", *new_key(algorithm), "-nodes", "-subj", "/CN=127.0.0.1",
        "-keyout", str(key), "-out", str(csr),
    )  # fmt: skip
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca[1]), "-CAkey", str(ca[0]),
        "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert),
    )  # fmt: skip
    return key, cert


def ca_and_certificate(directory: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA named ``name`` and a certificate for 127.0.0.1 it signed: (CA certificate,
    certificate, key)."""
    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory, f"{name}-ca")
    key, cert = issue(directory, ca, name)
    return ca[1], cert, key
