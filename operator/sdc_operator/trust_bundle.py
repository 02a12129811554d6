"""The operator's CA where the agents need it, and its own certificate kept current.

:class:`CaPublisher` writes the CA that signed the operator's certificate into a ConfigMap
``hyperpod-sdc-ca`` (key ``ca.crt``) in every namespace where an opted-in job appears, and
rewrites those ConfigMaps when the CA file changes (cert-manager or a new Secret rotated
it); the writes are :meth:`.effects.Effects.put_configmap`'s (read first, written where
they differ). The pods mount it (:mod:`.injection`) and the agent re-reads it when it changes, so a
new namespace needs no chart value and a rotation needs no restart.

:class:`ServingCertificate` reloads the operator's own certificate and key when their files
change (the kubelet updates a mounted Secret in place): new connections get the new
certificate, open ones finish with the old.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import ssl
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .injection import CA_CONFIGMAP, CA_KEY

if TYPE_CHECKING:
    from .effects import Effects

__all__ = ["CaPublisher", "FileStamp", "ServingCertificate"]

log = logging.getLogger(__name__)
MANAGED_BY = {"app.kubernetes.io/managed-by": "hyperpod-sdc-operator"}


class FileStamp:
    """Tells whether a file changed since last asked (mtime, size, inode: a kubelet
    update swaps a symlink, which changes the inode)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[float, int, int] | None = None

    def changed(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False  # mid-swap or not yet there: keep what we have
        stamp = (st.st_mtime, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True


class CaPublisher:
    def __init__(
        self,
        effects: Effects,
        ca_file: str,
        *,
        name: str = CA_CONFIGMAP,
        recheck_seconds: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.effects = effects
        self.name = name
        self.recheck_seconds = recheck_seconds
        self.clock = clock
        self._file = FileStamp(ca_file)
        self._pem: str | None = None
        # namespace -> (sha256 of the CA written there, when it was last confirmed)
        self._published: dict[str, tuple[str, float]] = {}
        self._lock = asyncio.Lock()

    def current(self) -> str | None:
        """The CA as the file holds it now (re-read when it changed)."""
        if self._file.changed():
            try:
                with open(self._file.path, encoding="utf-8") as f:
                    pem = f.read()
            except OSError as exc:
                log.warning("cannot read the CA file %s: %s", self._file.path, exc)
                return self._pem
            if "BEGIN CERTIFICATE" not in pem:
                log.warning(
                    "the CA file %s holds no PEM certificate; keeping the last", self._file.path
                )
                return self._pem
            if self._pem is not None and pem != self._pem:
                log.info("the CA in %s changed: republishing it", self._file.path)
            self._pem = pem
        return self._pem

    def namespaces(self) -> list[str]:
        return sorted(self._published)

    async def ensure(self, namespace: str) -> bool:
        """The namespace's ConfigMap holds the current CA; true if it was written now."""
        pem = self.current()
        if pem is None:
            return False
        digest = hashlib.sha256(pem.encode()).hexdigest()
        async with self._lock:
            done = self._published.get(namespace)
            if done and done[0] == digest and self.clock() - done[1] < self.recheck_seconds:
                return False
            wrote = await self._write(namespace, pem)
            self._published[namespace] = (digest, self.clock())
            return wrote

    async def refresh(self) -> None:
        """Rewrite every published namespace whose CA is stale (rotation, or the recheck
        interval passed: someone deleted or edited a ConfigMap)."""
        for namespace in self.namespaces():
            try:
                await self.ensure(namespace)
            except Exception as exc:
                log.warning("cannot publish the CA in namespace %s: %s", namespace, exc)

    def forget(self, namespace: str) -> None:
        self._published.pop(namespace, None)

    async def _write(self, namespace: str, pem: str) -> bool:
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": self.name, "namespace": namespace, "labels": MANAGED_BY},
            "data": {CA_KEY: pem},
        }
        wrote = await self.effects.put_configmap(body)
        if wrote:
            log.info("published the CA in namespace %s (ConfigMap %s)", namespace, self.name)
        return wrote


class ServingCertificate:
    """The TLS context of the operator's server, reloaded when its files change."""

    def __init__(self, cert_file: str, key_file: str) -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._stamps = (FileStamp(cert_file), FileStamp(key_file))
        for stamp in self._stamps:
            stamp.changed()
        self.context.load_cert_chain(cert_file, key_file)  # a bad pair fails the start

    def refresh(self) -> bool:
        """Load the certificate again if a file changed; true if it was reloaded."""
        changed = [s.changed() for s in self._stamps]
        if not any(changed):
            return False
        try:
            self._load_checked()
        except (OSError, ssl.SSLError) as exc:
            # A half-written pair (certificate new, key old): the next pass tries again.
            for stamp in self._stamps:
                stamp._stamp = None
            log.warning("cannot load the serving certificate yet: %s", exc)
            return False
        return True

    def _load_checked(self) -> None:
        """Load the pair into the live context only once a scratch context accepted it: a
        failed load leaves OpenSSL's context half-changed (a certificate without its key).
        Both loads read one private copy, so the files cannot change in between."""
        with tempfile.TemporaryDirectory(prefix="hyperpod-sdc-tls-") as scratch:
            copies = []
            for source, name in ((self.cert_file, "tls.crt"), (self.key_file, "tls.key")):
                with open(source, "rb") as f:
                    data = f.read()
                path = os.path.join(scratch, name)
                with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
                    f.write(data)
                copies.append(path)
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(*copies)
            self.context.load_cert_chain(*copies)
