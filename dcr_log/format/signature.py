"""Detached signatures of commit records (spec/FORMAT.md, section 21). Pure: bytes in, bytes out.

A signature object ``signatures/<version>/<key id>-<commit sha256>.sig`` is a sealed JSON object
holding an ed25519 signature over ``signature_message``: a domain tag, the log id, the version
and the SHA-256 of the commit record's bytes, which covers every byte of the version (the
record lists every segment's SHA-256). The crypto itself is in dcr_log.signing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dcr_log.errors import IntegrityError
from dcr_log.format.canonical import seal, unseal

SIGNATURES_PREFIX = "signatures/"
ALGORITHM = "ed25519"
DOMAIN = b"dcr-log/1 signed commit record\x00"
MAX_SIGNATURE_BYTES = 4096
MAX_SIGNATURES = 64  # signature objects a reader looks at per version

_KEY = re.compile(r"signatures/(0|[1-9][0-9]{0,19})/([0-9a-f]{16})-([0-9a-f]{64})\.sig")
_HEX16 = re.compile(r"[0-9a-f]{16}")
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX128 = re.compile(r"[0-9a-f]{128}")


def signature_message(log_id: str, version: int, commit_sha256: str) -> bytes:
    """What is signed: DOMAIN, the log id, NUL, the version in decimal, NUL, the 32 bytes of
    the commit record's SHA-256."""
    return DOMAIN + log_id.encode("ascii") + b"\x00" + str(version).encode("ascii") + b"\x00" \
        + bytes.fromhex(commit_sha256)


def signature_prefix(version: int) -> str:
    return f"{SIGNATURES_PREFIX}{version}/"


def signature_key(version: int, key_id: str, commit_sha256: str) -> str:
    return f"{signature_prefix(version)}{key_id}-{commit_sha256}.sig"


def parse_signature_key(key: str) -> tuple[int, str, str] | None:
    """(version, key id, commit sha256) of a signature object's key, or None."""
    m = _KEY.fullmatch(key)
    return (int(m.group(1)), m.group(2), m.group(3)) if m else None


@dataclass(frozen=True)
class SignatureRecord:
    log_id: str
    version: int
    key_id: str
    commit_sha256: str
    signature: bytes  # 64 bytes

    @property
    def key(self) -> str:
        return signature_key(self.version, self.key_id, self.commit_sha256)

    def message(self) -> bytes:
        return signature_message(self.log_id, self.version, self.commit_sha256)

    def to_bytes(self) -> bytes:
        return seal({
            "algorithm": ALGORITHM,
            "log_id": self.log_id,
            "version": self.version,
            "key_id": self.key_id,
            "commit_sha256": self.commit_sha256,
            "signature": self.signature.hex(),
        })

    @staticmethod
    def from_bytes(data: bytes, key: str) -> SignatureRecord:
        what = f"signature {key}"
        if len(data) > MAX_SIGNATURE_BYTES:
            raise IntegrityError(f"{what}: more than {MAX_SIGNATURE_BYTES} bytes (limit exceeded)")
        obj = unseal(data, what)
        if not isinstance(obj, dict) or set(obj) != {"algorithm", "log_id", "version", "key_id",
                                                      "commit_sha256", "signature"}:
            raise IntegrityError(f"{what}: unexpected members")
        ok = (obj["algorithm"] == ALGORITHM and isinstance(obj["log_id"], str) and _HEX32.fullmatch(obj["log_id"])
              and type(obj["version"]) is int and obj["version"] >= 0
              and isinstance(obj["key_id"], str) and _HEX16.fullmatch(obj["key_id"])
              and isinstance(obj["commit_sha256"], str) and _HEX64.fullmatch(obj["commit_sha256"])
              and isinstance(obj["signature"], str) and _HEX128.fullmatch(obj["signature"]))
        if not ok:
            raise IntegrityError(f"{what}: bad member")
        rec = SignatureRecord(obj["log_id"], obj["version"], obj["key_id"], obj["commit_sha256"],
                              bytes.fromhex(obj["signature"]))
        if rec.key != key:
            raise IntegrityError(f"{what}: {_mismatch(rec, parse_signature_key(key))}")
        return rec


def _mismatch(rec: SignatureRecord, named: tuple[int, str, str] | None) -> str:
    """What a signature object's contents say that its key does not: the likely mistake (a
    file copied from another version, or re-signed records renamed) in words."""
    if named is None:
        return f"its key is not a signature key; its contents are for {rec.key}"
    version, key_id, commit = named
    said = []
    if rec.version != version:
        said.append(f"it was made for version {rec.version}, not {version} (copied from another version?)")
    elif rec.commit_sha256 != commit:
        said.append(f"it signs commit record {rec.commit_sha256[:16]}..., not {commit[:16]}... "
                    "(a version rewritten since it was signed, or copied from another log?)")
    if rec.key_id != key_id:
        said.append(f"it is by key {rec.key_id}, while its name says {key_id}")
    return "; ".join(said)
