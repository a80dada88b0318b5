"""Payload encodings. A record names its encoding and params; readers never guess. Which
encodings exist, in which order writers try them and which log feature each needs is
dcr_log.codec.registry."""

from __future__ import annotations

from dcr_log.codec.attempt import Attempt, Candidate
from dcr_log.codec.base import ChangeSet, Encoding
from dcr_log.codec.registry import (
    ENCODINGS,
    choose,
    decode_changes,
    get_encoding,
    register,
    registered,
    required_feature,
    unregister,
)
from dcr_log.format.segment import KINDS

__all__ = ["ENCODINGS", "KINDS", "Attempt", "Candidate", "ChangeSet", "Encoding", "choose", "decode_changes",
           "get_encoding", "register", "registered", "required_feature", "unregister"]
