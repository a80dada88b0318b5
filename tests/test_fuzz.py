"""tools/fuzz.py: 500 damaged logs, journals and receiver directories (seed 0), every refusal a
typed error, no hang, no untyped exception, no receiver byte changed by a refused apply, no
wrong bits accepted. A failing case is reproduced with ``python tools/fuzz.py --cases 500
--seed 0 --keep DIR``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "fuzz.py"


def load_tool():
    spec = importlib.util.spec_from_file_location("dcr_fuzz", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_fuzz_500_cases():
    fuzz = load_tool()
    report = fuzz.run(cases=500, seed=0)
    assert report.bugs == []
    assert sum(report.outcomes.values()) >= 500
    # The damage reached every kind of check: refusals of several classes, and benign damage.
    assert report.outcomes["typed"] > 500 and report.outcomes["accepted"] > 50
    assert {"IntegrityError", "LineageError", "NotFoundError"} <= set(report.errors)
