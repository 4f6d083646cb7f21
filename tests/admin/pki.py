"""A throwaway PKI for the operator TLS tests, made at test time with the `openssl` command (no
key or certificate is committed): CAs, server certificates for 127.0.0.1 and localhost, client
certificates. EC P-256 keys, valid for a day."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(OPENSSL is None, reason="no openssl command")
SERVER_SAN = "IP:127.0.0.1,DNS:localhost"


class Pki:
    """Certificates in one directory: NAME.crt and NAME.key."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)

    def crt(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def _openssl(self, *args: str) -> None:
        assert OPENSSL is not None
        subprocess.run([OPENSSL, *args], check=True, capture_output=True, cwd=self.dir)

    def _new_key_args(self, name: str) -> list[str]:
        return [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:P-256",
            "-nodes",
            "-keyout",
            str(self.key(name)),
            "-subj",
            f"/CN={name}",
        ]

    def ca(self, name: str) -> str:
        self._openssl(
            "req",
            "-x509",
            *self._new_key_args(name),
            "-out",
            str(self.crt(name)),
            "-days",
            "1",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        )
        return name

    def leaf(self, name: str, ca: str, *, server: bool, sans: str | None = None) -> str:
        """A certificate signed by `ca` with subject CN=`name`: for a server (SAN 127.0.0.1,
        localhost, or `sans`) or a client (no SAN, or `sans`, e.g. "URI:spiffe://...,DNS:x")."""
        csr = self.dir / f"{name}.csr"
        self._openssl("req", *self._new_key_args(name), "-out", str(csr))
        extensions = self.dir / f"{name}.ext"
        lines = ["basicConstraints=CA:FALSE"]
        if server:
            lines += ["extendedKeyUsage=serverAuth", f"subjectAltName={sans or SERVER_SAN}"]
        else:
            lines += ["extendedKeyUsage=clientAuth"]
            if sans:
                lines.append(f"subjectAltName={sans}")
        extensions.write_text("\n".join(lines) + "\n")
        self._openssl(
            "x509",
            "-req",
            "-in",
            str(csr),
            "-CA",
            str(self.crt(ca)),
            "-CAkey",
            str(self.key(ca)),
            "-set_serial",
            "0x" + os.urandom(8).hex(),
            "-days",
            "1",
            "-extfile",
            str(extensions),
            "-out",
            str(self.crt(name)),
        )
        return name


def make_pki(directory: Path) -> Pki:
    """Two independent CAs, each with a server and a client certificate; `intruder` is a
    client certificate of a third CA kvgate never trusts."""
    pki = Pki(directory)
    for suffix in ("", "2"):
        pki.ca(f"ca{suffix}")
        pki.leaf(f"server{suffix}", f"ca{suffix}", server=True)
        pki.leaf(f"client{suffix}", f"ca{suffix}", server=False)
    pki.ca("other-ca")
    pki.leaf("intruder", "other-ca", server=False)
    return pki


class SecretVolume:
    """A directory laid out like a Kubernetes Secret volume: NAME -> ..data/NAME, and ..data a
    symlink to a timestamped directory that one rename swaps (what the kubelet does when
    cert-manager renews the Secret)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._version = 0

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def publish(self, files: dict[str, bytes]) -> None:
        self._version += 1
        version = self.dir / f"..v{self._version}"
        version.mkdir()
        for name, content in files.items():
            (version / name).write_bytes(content)
            link = self.dir / name
            if not link.is_symlink():
                link.symlink_to(Path("..data") / name)
        staged = self.dir / "..data_tmp"
        staged.symlink_to(version.name)
        os.replace(staged, self.dir / "..data")  # atomic
