"""Canonical JSON with an embedded sha256 checksum, used for every JSON object in a log.

Canonical form: keys sorted, no whitespace, ASCII only (non-ASCII as \\uXXXX escapes),
integers and strings only (no floats). ``checksum`` is ``sha256`` of the canonical form of
the object without its ``checksum`` member. A reader accepts bytes only when they equal the
canonical form of what they parse to and the checksum matches, so any flipped or missing
byte is detected.
"""

from __future__ import annotations

import hashlib
import json

from dcr_log.errors import IntegrityError


def canonical_bytes(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def seal(obj: dict) -> bytes:
    body = {k: v for k, v in obj.items() if k != "checksum"}
    return canonical_bytes({**body, "checksum": hashlib.sha256(canonical_bytes(body)).hexdigest()})


def parse_json(data: bytes | str, what: str):
    """json.loads with every failure an IntegrityError: invalid text, and nesting too deep
    for the parser (RecursionError), which no value of this format needs."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{what}: not valid JSON ({_first_line(exc)})") from None
    except RecursionError:
        raise IntegrityError(f"{what}: JSON nested too deeply") from None


def _first_line(exc: Exception) -> str:
    return str(exc).split("\n", 1)[0][:200]


def unseal(data, what: str) -> dict:
    """Parse and check sealed bytes (section 3). The caller bounds their size first
    (limits.py): parsing takes up to ~28 times the text. The body's checksum is computed over
    the bytes themselves, without the checksum member, not over a second serialization."""
    data = data if isinstance(data, bytes) else bytes(data)
    obj = parse_json(data, what)
    if not isinstance(obj, dict) or "checksum" not in obj:
        raise IntegrityError(f"{what}: not a sealed JSON object")
    try:
        canonical = canonical_bytes(obj)
    except (RecursionError, ValueError):
        raise IntegrityError(f"{what}: bytes are not in canonical form") from None
    same = canonical == data
    del canonical
    if not same:
        raise IntegrityError(f"{what}: bytes are not in canonical form")
    checksum = obj.pop("checksum")
    if not isinstance(checksum, str) or _body_sha256(data, obj, checksum) != checksum:
        raise IntegrityError(f"{what}: checksum mismatch")
    return obj


def _body_sha256(data: bytes, body: dict, checksum: str) -> str:
    """SHA-256 of the canonical form of ``body``, given ``data``, the canonical form of
    ``body`` plus the member ``checksum``: ``data`` without that member's bytes (members are
    sorted, so it follows the canonical form of the members sorting before it)."""
    member = b'"checksum":' + canonical_bytes(checksum)
    before = {k: v for k, v in body.items() if k < "checksum"}
    # Where the member starts, and its separator: the "," after it when it comes first,
    # the "," before it otherwise.
    if before:
        start = len(canonical_bytes(before)) - 1
        member = b"," + member
        end = start + len(member)
    else:
        start = 1
        end = start + len(member)
        if data[end:end + 1] == b",":
            end += 1
    view = memoryview(data)
    if view[start:start + len(member)] != member:  # cannot happen for canonical bytes
        raise IntegrityError("sealed JSON: checksum member not where its order puts it")
    sha = hashlib.sha256(view[:start])
    sha.update(view[end:])
    return sha.hexdigest()
