"""The guard's server-side TLS: a context that follows renewed certificate files.

:class:`ReloadingTLS` builds the server-side :class:`ssl.SSLContext` and swaps
in a fresh one when the certificate or key files change (cert-manager and the
kubelet replace Secret volumes by renaming a ``..data`` symlink), without a
restart and without touching connections already established. guard.serving.server
builds one before gunicorn forks; ``/readyz`` reports :meth:`ReloadingTLS.check`.

The files themselves come from ``ghost-guard certs`` (:mod:`guard.tools.certs`,
which the running guard never imports) or from any CA.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import ssl
import threading
import time

from cryptography import x509

__all__ = ["TLS12_CIPHERS", "TLS_VERSIONS", "ReloadingTLS", "TLSError"]

log = logging.getLogger("guard.tls")

#: The TLS 1.2 suites the guard serves: ECDHE key exchange with an AEAD cipher, nothing else
#: (no RSA key exchange, no CBC, no SHA-1/SHA-2 MAC suites).
TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL"
TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}


class TLSError(Exception):
    """Unusable TLS files or settings; the message is one line for the operator."""


def _stamp(paths: tuple[str, ...]) -> tuple[object, ...]:
    """What changes when a file is rewritten or a ``..data`` symlink swapped: os.stat follows links."""
    out: list[tuple[object, ...]] = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError as e:
            out.append(("missing", e.errno))
        else:
            out.append((st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class ReloadingTLS:
    """A server-side TLS context that follows renewed certificate files.

    ``context()`` returns an :class:`ssl.SSLContext` (TLS 1.2 or ``min_version``, on 1.2 only
    ECDHE with AES-GCM or ChaCha20-Poly1305; with
    ``client_ca``, a client certificate signed by that CA is required). Its
    ``sni_callback`` runs during every handshake (with or without SNI) and, at
    most every ``check_interval`` seconds, compares the files' (device, inode,
    mtime, size) with those last loaded. On a change it builds a fresh context
    and moves the handshaking connection onto it; later ``context()`` calls
    return the fresh one. Established connections keep the context they
    started with. If the new files don't load (a half-written pair, a key that
    doesn't match the certificate) the old context keeps serving, the failure is
    logged, and loading is retried when the files change again.

    The constructor loads the files once and raises :class:`TLSError` if they
    are unusable: a server must not start without a certificate.
    """

    def __init__(self, cert_file: str | os.PathLike, key_file: str | os.PathLike, client_ca: str | os.PathLike | None = None,
                 *, check_interval: float = 1.0, failure_grace: float = 30.0, min_version: str = "1.2") -> None:
        if min_version not in TLS_VERSIONS:
            raise TLSError(f"TLS minimum version must be one of {', '.join(TLS_VERSIONS)}, got {min_version!r}")
        self.min_version = TLS_VERSIONS[min_version]
        self.cert_file = os.fspath(cert_file)
        self.key_file = os.fspath(key_file)
        self.client_ca = os.fspath(client_ca) if client_ca is not None else None
        self.check_interval = check_interval
        self.failure_grace = failure_grace
        self._paths = (self.cert_file, self.key_file) + ((self.client_ca,) if self.client_ca else ())
        self._lock = threading.Lock()
        self._stamp = _stamp(self._paths)
        try:
            self._ctx, self._not_after = self._build()
        except (OSError, ssl.SSLError, ValueError) as e:
            raise TLSError(f"cannot load TLS files {', '.join(self._paths)}: {e}") from e
        self._attempted = self._stamp
        self._failure: str | None = None
        self._failing_since: float | None = None
        self._next_check = time.monotonic() + check_interval
        #: How many times a new context was loaded after the first one.
        self.reloads = 0

    def _build(self) -> tuple[ssl.SSLContext, dt.datetime]:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = self.min_version
        # TLS 1.2: forward secrecy and AEAD only (TLS 1.3's suites are all AEAD with ephemeral keys).
        ctx.set_ciphers(TLS12_CIPHERS)
        ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_NO_RENEGOTIATION | ssl.OP_CIPHER_SERVER_PREFERENCE
        ctx.load_cert_chain(self.cert_file, self.key_file)  # also checks the key matches the certificate
        if self.client_ca:
            ctx.load_verify_locations(cafile=self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        else:
            ctx.verify_mode = ssl.CERT_NONE
        ctx.sni_callback = self._on_handshake
        with open(self.cert_file, "rb") as f:
            not_after = x509.load_pem_x509_certificate(f.read()).not_valid_after_utc
        return ctx, not_after

    def context(self) -> ssl.SSLContext:
        """The current context (gunicorn calls its ``ssl_context`` hook for every connection)."""
        self._maybe_reload()
        return self._ctx

    def _on_handshake(self, sslobj: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext) -> None:
        self._maybe_reload()
        current = self._ctx
        if ctx is not current:
            sslobj.context = current  # SSL_set_SSL_CTX: this handshake uses the new certificate
        return None

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now < self._next_check:
            return
        if not self._lock.acquire(blocking=False):
            return  # another handshake is checking; serve the current context meanwhile
        try:
            self._next_check = now + self.check_interval
            for _ in range(3):
                stamp = _stamp(self._paths)
                if stamp == self._stamp or stamp == self._attempted:
                    return
                self._attempted = stamp
                try:
                    ctx, not_after = self._build()
                except (OSError, ssl.SSLError, ValueError) as e:
                    error: Exception | None = e
                else:
                    error = None
                # The files stood still while they were read: this context is what the stamp says.
                # A stamp taken mid-swap (one path stat'ed before a ``..data`` swap, the others
                # after) would otherwise load the new pair now and again at the next check.
                if _stamp(self._paths) == stamp:
                    break
            if error is not None:
                self._failure = f"cannot load renewed TLS files ({error}); still serving the certificate loaded before"
                if self._failing_since is None:
                    self._failing_since = now
                log.warning("tls reload failed, keeping the previous certificate: %s", error)
                return
            self._ctx, self._not_after, self._stamp = ctx, not_after, stamp
            self._failure, self._failing_since = None, None
            self.reloads += 1
            log.info("tls reloaded %s (valid until %s)", self.cert_file, f"{not_after:%Y-%m-%d %H:%M}Z")
        finally:
            self._lock.release()

    def check(self) -> str | None:
        """``None`` when serving is healthy, else a one-line reason (for ``/readyz``).

        Unhealthy: the certificate being served has expired, or the files on
        disk have failed to load for longer than ``failure_grace`` seconds (a
        renewal mid-write resolves within moments; a broken Secret does not).
        """
        self._maybe_reload()
        if dt.datetime.now(dt.timezone.utc) >= self._not_after:
            return f"serving certificate {self.cert_file} expired at {self._not_after:%Y-%m-%d %H:%M}Z"
        since = self._failing_since
        if self._failure and since is not None and time.monotonic() - since >= self.failure_grace:
            return self._failure
        return None
