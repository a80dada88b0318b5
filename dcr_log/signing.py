"""ed25519 keys, signing of commit records and trust policies (spec/FORMAT.md, section 21).

A *signing key* signs commit records when a writer commits them (or later, ``dcr sign``). A
*trust policy* lists the public keys whose signatures a reader accepts; under a policy, a
version is read only when a signature object of it, by a listed key, verifies over the SHA-256
of the very commit record bytes the reader read. A log may be signed by several keys over its
life (key rotation): the policy lists every key still accepted.

Key files: the private key is PEM (PKCS#8, unencrypted, mode 0600); a public key (and a trust
file, one key per line, ``#`` comments allowed) is ``ed25519:<64 hex digits>``. A key's id is
the first 16 hex digits of the SHA-256 of its 32 public-key bytes.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dcr_log.errors import TrustError, UsageError, os_error
from dcr_log.format.signature import SignatureRecord

# cryptography is imported where a key is made, read or checked: every receiver and reader
# imports this module, and most logs are not signed.
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

_PUBLIC = re.compile(r"ed25519:([0-9a-f]{64})")


def key_id(public: bytes) -> str:
    return hashlib.sha256(public).hexdigest()[:16]


def public_text(public: bytes) -> str:
    return f"ed25519:{public.hex()}"


class SigningKey:
    """An ed25519 private key that signs commit records."""

    def __init__(self, private: Ed25519PrivateKey):
        from cryptography.hazmat.primitives import serialization

        self._private = private
        self.public = private.public_key().public_bytes(serialization.Encoding.Raw,
                                                        serialization.PublicFormat.Raw)
        self.key_id = key_id(self.public)

    @staticmethod
    def generate() -> SigningKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return SigningKey(Ed25519PrivateKey.generate())

    @staticmethod
    def from_seed(seed: bytes) -> SigningKey:
        """A key from its 32 private bytes (test vectors use fixed seeds)."""
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        return SigningKey(Ed25519PrivateKey.from_private_bytes(seed))

    @staticmethod
    def load(path: str | os.PathLike) -> SigningKey:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        try:
            data = Path(path).read_bytes()
        except FileNotFoundError:
            raise UsageError(f"no signing key at {path}") from None
        except OSError as exc:
            raise os_error(exc, f"cannot read {path}") from None
        try:
            private = serialization.load_pem_private_key(data, password=None)
        except (ValueError, TypeError):
            raise UsageError(f"{path} is not an unencrypted PEM private key") from None
        if not isinstance(private, Ed25519PrivateKey):
            raise UsageError(f"{path} is not an ed25519 key")
        return SigningKey(private)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the private key (0600, create-if-absent) and ``<path>.pub``; returns the latter."""
        from cryptography.hazmat.primitives import serialization

        path = Path(path)
        pem = self._private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())
        pub = Path(f"{path}.pub")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise UsageError(f"{path} exists; not overwriting a key") from None
        except OSError as exc:
            raise os_error(exc, f"cannot write {path}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        pub.write_text(f"{public_text(self.public)}  # key id {self.key_id}\n")
        return pub

    def sign(self, log_id: str, version: int, commit_sha256: str) -> SignatureRecord:
        rec = SignatureRecord(log_id, version, self.key_id, commit_sha256, b"\0" * 64)
        return SignatureRecord(log_id, version, self.key_id, commit_sha256,
                               self._private.sign(rec.message()))


def as_signing_key(key) -> SigningKey | None:
    if key is None or isinstance(key, SigningKey):
        return key
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if isinstance(key, Ed25519PrivateKey):
        return SigningKey(key)
    if isinstance(key, (str, os.PathLike)):
        return SigningKey.load(key)
    raise UsageError(f"cannot sign with a {type(key).__name__}")


@dataclass(frozen=True)
class TrustPolicy:
    """The public keys whose signatures are accepted, by key id."""

    keys: dict[str, Ed25519PublicKey]

    @property
    def fingerprint(self) -> tuple[str, ...]:
        """The accepted key ids: what a cached check depends on."""
        return tuple(sorted(self.keys))

    @staticmethod
    def of(publics: Iterable[bytes | str]) -> TrustPolicy:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

        keys: dict[str, Ed25519PublicKey] = {}
        for p in publics:
            if isinstance(p, SigningKey):
                p = p.public
            raw = p if isinstance(p, bytes) else parse_public(p)
            if len(raw) != 32:
                raise UsageError("an ed25519 public key has 32 bytes")
            kid = key_id(raw)
            keys[kid] = Ed25519PublicKey.from_public_bytes(raw)
        if not keys:
            raise UsageError("a trust policy needs at least one public key")
        return TrustPolicy(keys)

    @staticmethod
    def load(paths: Iterable[str | os.PathLike]) -> TrustPolicy:
        publics = []
        for path in paths:
            try:
                text = Path(path).read_text()
            except FileNotFoundError:
                raise UsageError(f"no trust file at {path}") from None
            except (OSError, UnicodeDecodeError) as exc:
                raise UsageError(f"cannot read trust file {path}: {exc}") from None
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    publics.append(parse_public(line, str(path)))
        return TrustPolicy.of(publics)

    def check(self, log_id: str, version: int, commit_sha256: str,
              signatures: list[tuple[str, SignatureRecord | Exception]]) -> str:
        """The key id of a trusted key whose signature verifies; else TrustError saying what
        was found. ``signatures``: (object key, parsed record or the error parsing it)."""
        from cryptography.exceptions import InvalidSignature

        found = []
        for obj_key, rec in signatures:
            if isinstance(rec, Exception):
                found.append(f"{obj_key.rsplit('/', 1)[-1][:16]}: {rec}")
                continue
            public = self.keys.get(rec.key_id)
            if public is None:
                found.append(f"key {rec.key_id}: not trusted")
                continue
            if (rec.log_id, rec.version, rec.commit_sha256) != (log_id, version, commit_sha256):
                found.append(f"key {rec.key_id}: signs another record")
                continue
            try:
                public.verify(rec.signature, rec.message())
            except InvalidSignature:
                found.append(f"key {rec.key_id}: signature does not verify")
                continue
            return rec.key_id
        detail = "; ".join(found) if found else "no signature"
        raise TrustError(f"version {version} has no valid signature by a trusted key ({detail})")


def parse_public(text: str, where: str = "public key") -> bytes:
    m = _PUBLIC.fullmatch(text.strip())
    if not m:
        raise UsageError(f"{where}: expected ed25519:<64 hex digits>, got {text.strip()[:80]!r}")
    return bytes.fromhex(m.group(1))


def as_trust(trust) -> TrustPolicy | None:
    if trust is None or isinstance(trust, TrustPolicy):
        return trust
    if isinstance(trust, (str, os.PathLike)):
        return TrustPolicy.load([trust])
    return TrustPolicy.of(trust)
