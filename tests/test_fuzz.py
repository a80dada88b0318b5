"""tools/fuzz.py: 500 damaged logs, journals and receiver directories (seed 0), every refusal a
typed error, no hang, no untyped exception, no receiver byte changed by a refused apply, no
wrong bits accepted. A failing case is reproduced with ``python tools/fuzz.py --cases 500
--seed 0 --keep DIR``."""

from __future__ import annotations

import importlib.util
import random
import shutil
import sys
from pathlib import Path

import pytest

from dcr_log import DeltaLog
from dcr_log.errors import IntegrityError
from dcr_log.receiver import open_directory

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


def test_the_template_holds_a_frame_of_no_content_that_damage_reaches(tmp_path):
    """The template's version 3 creates an empty tensor with a dense tensor record, whose payload
    is a zstd frame of no content (LogWriter writes none such; another writer may). The fuzz's
    payload damage reaches it; a byte after its frame, or the frame cut short, is refused by
    verify, materialize and an apply at every level, the receiver left as version 2 left it.
    (Without the frame's own walk, codec.base._check_frame_end, the trailing byte was accepted.)"""
    fuzz = load_tool()
    t = fuzz.build_template(tmp_path / "template")
    got = DeltaLog.open(t.log).materialize(3)
    assert got[fuzz.EMPTY_TENSOR].shape == (0,) and set(got) == set(t.states[3])
    for n, (name, edit) in enumerate((("trailing byte", lambda b: b + b"\0"), ("cut", lambda b: b[:-1]))):
        log = tmp_path / f"log-{n}"
        shutil.copytree(t.log, log)
        what = fuzz.damage_payload(random.Random(n), log, 3, fuzz.EMPTY_TENSOR, edit)
        assert fuzz.EMPTY_TENSOR in what, what
        dlog = DeltaLog.open(log)
        with pytest.raises(IntegrityError):
            dlog.verify(deep=True)
        with pytest.raises(IntegrityError):
            dlog.materialize(3)
        for verify in ("none", "sample", "full"):
            rx = tmp_path / f"rx-{n}-{verify}"
            shutil.copytree(t.rx, rx)
            with open_directory(dlog, rx) as receiver:  # (bound at version 1)
                receiver.apply(dlog, to=2, verify=verify)
                before = fuzz.tree(rx)
                with pytest.raises(IntegrityError):
                    receiver.apply(dlog, to=3, verify=verify)
                assert receiver.version == 2, (name, verify)
            assert fuzz.tree(rx) == before, (name, verify)
