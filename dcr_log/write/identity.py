"""Creating a log's identity (dcr.json) at the coordinator: a new log, or the completion of an
incomplete one (dcr.json and no version: an interrupted creation, FORMAT.md section 12)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime

from dcr_log.errors import UsageError
from dcr_log.format import IDENTITY_KEY, LogIdentity
from dcr_log.format.keys import VERSIONS_PREFIX, parse_version_key
from dcr_log.format.limits import MAX_IDENTITY_BYTES
from dcr_log.store import AlreadyExists, Store
from dcr_log.write.files import Files, resolve_files
from dcr_log.write.outcomes import CreateOutcome, describe


def utc_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def create_identity(store: Store, features: tuple[str, ...],
                    files: Files | None) -> tuple[CreateOutcome, Mapping[str, bytes] | None]:
    """Rank 0: write a new dcr.json (or finish an incomplete log of the same features); the
    outcome for every rank, and version 0's files read and checked before the log exists."""
    identity = LogIdentity(log_id=uuid.uuid4().hex, created_at=utc_now(), features=features)
    resolved = None
    try:
        if files is not None:
            resolved = {e.name: data for e, data in resolve_files(files)}
        store.put_new(IDENTITY_KEY, identity.to_bytes())
        return CreateOutcome(identity=identity.to_bytes()), resolved
    except AlreadyExists:
        return _incomplete(store, features), resolved
    except UsageError as exc:
        return CreateOutcome(failure="usage", error=str(exc)), resolved
    except Exception as exc:
        return CreateOutcome(failure="failed", error=f"cannot create {store.url}: {describe(exc)}"), resolved


def _incomplete(store: Store, features: tuple[str, ...]) -> CreateOutcome:
    """The outcome of creating a log where a dcr.json exists: an incomplete log (dcr.json and
    no version: an interrupted creation, FORMAT.md section 12) of the same features is finished
    under its identity; anything else is a conflict."""
    try:
        existing = LogIdentity.from_bytes(bytes(store.get(IDENTITY_KEY, max_size=MAX_IDENTITY_BYTES)))
        versions = [o.key for o in store.list(VERSIONS_PREFIX) if parse_version_key(o.key) is not None]
    except Exception as exc:
        return CreateOutcome(failure="conflict", error=f"{store.url} already holds a log ({describe(exc)})")
    if versions:
        return CreateOutcome(failure="conflict", error=f"{store.url} already holds a log")
    if existing.features != tuple(features):
        return CreateOutcome(failure="conflict",
                             error=f"{store.url} holds an incomplete log (an interrupted creation) with features "
                                   f"{list(existing.features)}, not {list(features)}: create it with the same "
                                   "options to finish it")
    return CreateOutcome(identity=existing.to_bytes(), resumed=True)


def default_writer_id() -> str:
    """``<host>-<pid>``: which process wrote a version (commit records' ``writer_id``)."""
    import re
    import socket

    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"
