"""The operator's own certificate reloaded from its files (as cert-manager renews it in
place): a handshake over memory BIOs shows which certificate the server presents."""

from __future__ import annotations

import os
import shutil
import ssl
from pathlib import Path

import pytest

from sdc_harness.tls import ca_and_certificate
from sdc_operator.trust_bundle import FileStamp, ServingCertificate


def handshake(server: ssl.SSLContext, trusted_ca: Path) -> bool:
    """Whether a client trusting only ``trusted_ca`` completes a handshake with ``server``."""
    client_context = ssl.create_default_context(cafile=str(trusted_ca))
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = client_context.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    served = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side, outgoing, incoming in ((client, c_out, s_in), (served, s_out, c_in)):
            try:
                side.do_handshake()
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLError:
                return False
            if data := outgoing.read():
                incoming.write(data)
        try:
            client.do_handshake()
            served.do_handshake()
            return True
        except ssl.SSLWantReadError:
            continue
        except ssl.SSLError:
            return False
    return False


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the certificates")
def test_a_renewed_certificate_is_served_without_a_restart(tmp_path: Path) -> None:
    first, second = ca_and_certificate(tmp_path, "first"), ca_and_certificate(tmp_path, "second")
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(first[1], live / "tls.crt")
    shutil.copy(first[2], live / "tls.key")
    serving = ServingCertificate(str(live / "tls.crt"), str(live / "tls.key"))
    assert handshake(serving.context, first[0]) and not handshake(serving.context, second[0])
    assert serving.refresh() is False  # nothing changed
    # half a rotation (new certificate, old key): kept serving the old pair, tried again
    shutil.copy(second[1], live / "tls.crt.new")
    os.replace(live / "tls.crt.new", live / "tls.crt")
    assert serving.refresh() is False and handshake(serving.context, first[0])
    shutil.copy(second[2], live / "tls.key.new")
    os.replace(live / "tls.key.new", live / "tls.key")
    assert serving.refresh() is True
    assert handshake(serving.context, second[0]) and not handshake(serving.context, first[0])


def test_file_stamps_see_a_symlink_swap(tmp_path: Path) -> None:
    for version in ("..v1", "..v2"):
        (tmp_path / version).mkdir()
        (tmp_path / version / "ca.crt").write_text("same size\n")
    (tmp_path / "..data").symlink_to("..v1")
    (tmp_path / "ca.crt").symlink_to("..data/ca.crt")
    stamp = FileStamp(str(tmp_path / "ca.crt"))
    assert stamp.changed() and not stamp.changed()
    (tmp_path / "..tmp").symlink_to("..v2")
    os.replace(tmp_path / "..tmp", tmp_path / "..data")
    assert stamp.changed()  # same size, maybe the same mtime: the inode differs
    assert not FileStamp(str(tmp_path / "missing")).changed()
