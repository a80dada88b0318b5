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

from ..errors import IntegrityError


def canonical_bytes(obj: dict) -> bytes:
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


def unseal(data: bytes, what: str) -> dict:
    data = bytes(data)
    obj = parse_json(data, what)
    if not isinstance(obj, dict) or "checksum" not in obj:
        raise IntegrityError(f"{what}: not a sealed JSON object")
    try:
        canonical = canonical_bytes(obj)
    except (RecursionError, ValueError):
        raise IntegrityError(f"{what}: bytes are not in canonical form") from None
    if canonical != data:
        raise IntegrityError(f"{what}: bytes are not in canonical form")
    body = {k: v for k, v in obj.items() if k != "checksum"}
    if not isinstance(obj["checksum"], str) or hashlib.sha256(canonical_bytes(body)).hexdigest() != obj["checksum"]:
        raise IntegrityError(f"{what}: checksum mismatch")
    return body
