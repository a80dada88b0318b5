"""Signatures of commit records (spec/FORMAT.md section 21): finding a trusted key's valid
signature of a version, and writing one.

Functions take the ``DeltaLog`` they read; its ``check_signed``, ``write_signature`` and
``sign`` delegate here. The key found per (version, trust policy) is cached on the log."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from dcr_log.errors import IntegrityError, NotFoundError, UsageError
from dcr_log.format import CommitRecord
from dcr_log.format.signature import (
    MAX_SIGNATURE_BYTES,
    MAX_SIGNATURES,
    SignatureRecord,
    parse_signature_key,
    signature_prefix,
)
from dcr_log.signing import as_signing_key, as_trust
from dcr_log.store import AlreadyExists

if TYPE_CHECKING:
    from dcr_log.log.deltalog import DeltaLog


class _Skipped:
    """A signature object not fetched: an untrusted key, or one signing other bytes."""

    def __init__(self, trusted_key: bool):
        self.trusted_key = trusted_key

    def as_error(self) -> Exception:
        return IntegrityError("signs another record" if self.trusted_key else "key not trusted")


def check_signed(log: DeltaLog, version: int, trust=None) -> str:
    """The id of a trusted key with a valid signature of ``version``, else TrustError."""
    policy = as_trust(trust) if trust is not None else log.trust
    if policy is None:
        raise UsageError("no trust policy to check signatures against")
    known = log.signers.get((version, policy.fingerprint))
    if known is not None:
        return known
    sha = log.commit_sha256(version)
    found: list[tuple[str, SignatureRecord | Exception | _Skipped]] = []
    objects = [o.key for o in log.store.list(signature_prefix(version))]
    for key in sorted(objects):
        parsed = parse_signature_key(key)
        if parsed is None or parsed[0] != version:
            continue
        if parsed[1] not in policy.keys or parsed[2] != sha:
            # Not worth fetching; say why in the refusal.
            found.append((key, _Skipped(parsed[1] in policy.keys)))
            continue
        if len(found) >= MAX_SIGNATURES:
            break
        try:
            found.append((key, SignatureRecord.from_bytes(
                bytes(log.store.get(key, max_size=MAX_SIGNATURE_BYTES)), key)))
        except (IntegrityError, NotFoundError) as exc:
            found.append((key, exc))
    # Fetched ones first, then the skipped ones as the errors they stand for.
    results: list[tuple[str, SignatureRecord | Exception]] = [
        (k, r) for k, r in found if not isinstance(r, _Skipped)]
    results += [(k, r.as_error()) for k, r in found if isinstance(r, _Skipped)]
    kid = policy.check(log.log_id, version, sha, results)
    log.signers[(version, policy.fingerprint)] = kid
    return kid


def write_signature(log: DeltaLog, record: CommitRecord, key) -> SignatureRecord:
    """Sign a commit record's bytes and create the signature object (create-if-absent; a
    second signature by the same key of the same bytes is the same object)."""
    key = as_signing_key(key)
    sig = key.sign(log.log_id, record.version, hashlib.sha256(record.to_bytes()).hexdigest())
    try:
        log.store.put_new(sig.key, sig.to_bytes())
    except AlreadyExists:
        pass  # ed25519 is deterministic: the same key signed the same record before
    return sig


def sign(log: DeltaLog, version: int, key) -> SignatureRecord:
    """Sign an existing version (a new key of a rotation, or a log written unsigned)."""
    saved, log.trust = log.trust, None
    try:
        record = log.commit(version)
    finally:
        log.trust = saved
    return log.write_signature(record, key)
