"""Writers fail closed on a tensor table change: a version whose table differs from its
parent's (a tensor added, removed, renamed, reshaped or retyped) is refused with UsageError
before anything is written, unless the caller passes allow_layout_change=True (LogWriter) or
--allow-layout-change (dcr append). The sharded writer's check is in tests/test_sharded.py."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

from dcr_log import DeltaLog, LogWriter, UsageError
from dcr_log.checkpoint import save_safetensors
from dcr_log.state import LAYOUT_CHANGES_SHOWN, TensorBits, layout_changes
from dcr_log.write.layout import check_layout_change
from helpers import assert_one_line, assert_same_bits, change_words, copy_state, make_state, run_cli

SPEC = {
    "a.weight": ("BF16", (8, 6)),
    "b.weight": ("F32", (5,)),
    "c.bias": ("F16", (3, 2)),
    "step": ("I64", ()),
}


def listing(root: Path) -> dict[str, str]:
    """Every file under a log directory and the SHA-256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _base(seed: int = 3) -> dict[str, TensorBits]:
    return make_state(np.random.default_rng(seed), SPEC)


def _changed(state: dict[str, TensorBits], case: str) -> dict[str, TensorBits]:
    """``state`` with a few words changed and one table change of kind ``case``."""
    rng = np.random.default_rng(11)
    s = copy_state(state)
    s["a.weight"] = change_words(rng, s["a.weight"], 0.1)
    if case == "added":
        s["d.new"] = make_state(rng, {"x": ("BF16", (4, 4))})["x"]
    elif case == "removed":
        del s["c.bias"]
    elif case == "renamed":
        s["c.bias_renamed"] = s.pop("c.bias")
    elif case == "reshaped":
        b = s["c.bias"]
        s["c.bias"] = TensorBits(b.dtype, (2, 3), b.words.copy())
    elif case == "retyped":
        b = s["b.weight"]
        s["b.weight"] = TensorBits("I32", b.shape, b.words.copy())
    else:
        raise ValueError(case)
    return s


CASES = {
    "added": "added 'd.new' (BF16 [4, 4])",
    "removed": "removed 'c.bias'",
    "renamed": "removed 'c.bias'",
    "reshaped": "reshaped 'c.bias' [3, 2] -> [2, 3]",
    "retyped": "retyped 'b.weight' F32 -> I32",
}


@pytest.mark.parametrize("case", list(CASES))
def test_log_writer_refuses_a_table_change_and_writes_nothing(tmp_path, case):
    path = tmp_path / "log"
    s0 = _base()
    writer = LogWriter.create(path, s0, cache_dir=False)
    s1 = copy_state(s0)
    s1["a.weight"] = change_words(np.random.default_rng(5), s0["a.weight"], 0.2)
    writer.append(s1)  # the same table: no flag needed
    before = listing(path)
    bad = _changed(s1, case)
    with pytest.raises(UsageError) as info:
        writer.append(bad)
    message = str(info.value)
    assert message.startswith("version 2 would change the tensor table: "), message
    assert CASES[case] in message, message
    if case == "renamed":
        assert "added 'c.bias_renamed' (F16 [3, 2])" in message, message
    assert "allow_layout_change=True" in message and "--allow-layout-change" in message, message
    assert "\n" not in message
    assert listing(path) == before, "the refused append wrote to the store"
    assert writer.version == 1
    # The writer is still usable, and the flag lets the change through.
    commit = writer.append(bad, allow_layout_change=True)
    assert commit.version == 2
    assert {t.name: (t.dtype, t.shape) for t in commit.tensors} == {n: (b.dtype, b.shape) for n, b in bad.items()}
    log = DeltaLog.open(path)
    assert_same_bits(log.materialize(2), bad)
    log.verify(deep=True)


def test_reopened_writer_refuses_too_and_the_flag_is_per_append(tmp_path):
    """A writer opened on an existing log checks against the latest commit's table; an
    allowed change does not allow the next one."""
    path = tmp_path / "log"
    s0 = _base()
    LogWriter.create(path, s0, cache_dir=False)
    before = listing(path)
    writer = LogWriter.open(path, cache_dir=False)
    with pytest.raises(UsageError, match="removed 'c.bias'"):
        writer.append(_changed(s0, "removed"))
    assert listing(path) == before
    s1 = _changed(s0, "added")
    writer.append(s1, allow_layout_change=True)
    s2 = copy_state(s1)
    del s2["d.new"]
    with pytest.raises(UsageError, match="version 2 would change the tensor table: removed 'd.new'"):
        LogWriter.open(path, cache_dir=False).append(s2)
    assert LogWriter.open(path, cache_dir=False).append(s1).version == 2  # same table as version 1


def test_message_is_bounded():
    """Many differences: the first few named, the rest counted, one line."""
    prev = {f"t{i:03d}": ("F32", (i + 1,)) for i in range(70)}
    new = {f"u{i:03d}": ("BF16", (4, 4)) for i in range(70)}
    changes = layout_changes(new, prev)
    assert len(changes) == 140
    with pytest.raises(UsageError) as info:
        check_layout_change(5, new, prev, [False])
    message = str(info.value)
    assert message.count("'") == 2 * LAYOUT_CHANGES_SHOWN, message
    assert f"(+{140 - LAYOUT_CHANGES_SHOWN} more)" in message, message
    assert len(message) < 400 and "\n" not in message
    # Long names are cut.
    long = {"x" * 5000: ("F32", (1,))}
    assert len(layout_changes(long, {})[0]) < 120


def test_another_model_is_refused(tmp_path):
    """The measured case: a state of another model (other names, shapes, dtypes)."""
    path = tmp_path / "log"
    LogWriter.create(path, _base(), cache_dir=False)
    before = listing(path)
    other = make_state(np.random.default_rng(9), {f"model.layers.{i}.mlp.weight": ("BF16", (16, 8)) for i in range(6)})
    with pytest.raises(UsageError) as info:
        LogWriter.open(path, cache_dir=False).append(other)
    assert "(+7 more)" in str(info.value), str(info.value)  # 6 added, 4 removed: 3 named
    assert listing(path) == before


# -- dcr append -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_log(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("layout-cli")
    s0 = _base()
    save_safetensors(s0, tmp / "s0.safetensors")
    rc, _, err = run_cli("init", tmp / "log", "--from", tmp / "s0.safetensors", "--cache", "none")
    assert rc == 0, err
    return tmp, s0


@pytest.mark.parametrize("case", list(CASES))
def test_cli_append_refuses_a_table_change(tmp_path, cli_log, case):
    src, s0 = cli_log
    log = tmp_path / "log"
    shutil.copytree(src / "log", log)
    bad = _changed(s0, case)
    save_safetensors(bad, tmp_path / "bad.safetensors")
    before = listing(log)
    rc, out, err = run_cli("append", log, "--from", tmp_path / "bad.safetensors", "--cache", "none")
    assert rc == 2, (out, err)
    assert_one_line(err)
    assert "version 1 would change the tensor table" in err and CASES[case] in err, err
    assert "--allow-layout-change" in err, err
    assert listing(log) == before
    rc, out, err = run_cli("append", log, "--from", tmp_path / "bad.safetensors", "--cache", "none",
                           "--allow-layout-change")
    assert rc == 0, err
    assert out.startswith("version 1: "), out
    assert_same_bits(DeltaLog.open(log).materialize(1), bad)


def test_cli_append_from_another_model(tmp_path, cli_log):
    """`dcr append LOG --from OTHER_MODEL` exits 2, one line, the log unchanged."""
    src, _ = cli_log
    log = tmp_path / "log"
    shutil.copytree(src / "log", log)
    other = make_state(np.random.default_rng(9), {"encoder.weight": ("F32", (7, 7)), "decoder.weight": ("F16", (7,))})
    save_safetensors(other, tmp_path / "other.safetensors")
    before = listing(log)
    rc, out, err = run_cli("append", log, "--from", tmp_path / "other.safetensors", "--cache", "none")
    assert rc == 2, (out, err)
    assert_one_line(err)
    assert ("would change the tensor table: removed 'a.weight', removed 'b.weight', removed 'c.bias' "
            "(+3 more)") in err, err
    assert "changed" not in out
    assert listing(log) == before
    assert DeltaLog.open(log).versions() == [0]
