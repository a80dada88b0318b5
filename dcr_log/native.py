"""The optional C kernels, loaded in one place: ``digest`` (dcr_log/_digest.c: the sum digest's
passes) and ``changes`` (dcr_log/_changes.c: change detection, gathers and scatters, the ulp
step). Each is None when it was not built (no compiler at install time) or when
``DCR_NO_NATIVE`` is set in the environment; callers then take their numpy path, which gives
the same bits. Callers read ``native.digest`` / ``native.changes`` at call time, so a test can
switch a kernel off by setting the attribute."""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _load(name: str) -> ModuleType | None:
    if os.environ.get("DCR_NO_NATIVE"):
        return None
    try:
        return importlib.import_module(f"dcr_log.{name}")
    except ImportError:  # built without a compiler
        return None


digest = _load("_digest")
changes = _load("_changes")
