"""The rules of a valid step (dcr_log.log.steps.StepRules) as replay applies them: a snapshot
or squash whose tensor records do not tile a tensor it creates exactly once is refused with a
typed error, even when its record counts equal its stats and every record is sound alone."""

from __future__ import annotations

import dataclasses
import hashlib
import uuid

import numpy as np
import pytest

from dcr_log import IntegrityError
from dcr_log.format import SegmentRef, encode_segment
from dcr_log.lifecycle import write_snapshot, write_squash
from dcr_log.log import DeltaLog
from dcr_log.store import Store
from dcr_log.write import LogWriter
from dcr_log.write.differ import EncodePolicy
from helpers import assert_same_bits, change_words, copy_state, make_state

# Chunks of 16 elements: "n" (8 rows of 4) is written as two tensor records of 4 rows each.
POLICY = EncodePolicy(chunk_elements=16)


def _log_with(kind: str):
    """A log of three versions ("n" new at version 1) and a snapshot of 2 or a squash 0-2, in
    both of which "n" is a created tensor."""
    rng = np.random.default_rng(11)
    store = Store.open(f"memory://steps-{uuid.uuid4().hex}")
    s0 = make_state(rng, {"w": ("F32", (6, 5))})
    s1 = copy_state(s0)
    s1["n"] = make_state(rng, {"n": ("F32", (8, 4))})["n"]
    s2 = copy_state(s1)
    s2["w"] = change_words(rng, s1["w"], 0.3)
    writer = LogWriter.create(store, s0, policy=POLICY)
    writer.append(s1, allow_layout_change=True)
    writer.append(s2)
    log = DeltaLog.open(store)
    cu = write_snapshot(log, 2, policy=POLICY) if kind == "snapshot" else write_squash(log, 0, 2, policy=POLICY)
    return store, cu, s2


def _one_tensor_record_twice(store: Store, cu) -> None:
    """Rewrite the catch-up through the library's own format functions: the second tensor
    record of "n" replaced by a copy of the first (same size, same changed count: the counts
    still equal the stats), in one re-sealed segment and manifest."""
    log = DeltaLog.open(store)
    records = list(log.records(log.catchup_step(cu)))
    mine = [i for i, rec in enumerate(records) if rec.tensor == "n"]
    assert len(mine) == 2 and all(records[i].kind == "tensor" for i in mine)
    records[mine[1]] = records[mine[0]]
    data = encode_segment(records, log.log_id, cu.version)
    for ref in cu.segments:
        store.delete(ref.key)
    key = cu.segments[0].key
    store.put_new(key, data)
    forged = dataclasses.replace(cu, segments=(SegmentRef(key, len(data), hashlib.sha256(data).hexdigest(),
                                                          len(records)),))
    assert (forged.stats.records, forged.stats.changed_elements) == (
        len(records), sum(rec.n_changed for rec in records))
    store.delete(cu.key)
    store.put_new(cu.key, forged.to_bytes())


@pytest.mark.parametrize("kind, what", [("snapshot", "snapshot 2"), ("squash", "squash 0-2")])
def test_replay_refuses_records_that_do_not_tile_a_created_tensor(kind, what):
    store, cu, s2 = _log_with(kind)
    _one_tensor_record_twice(store, cu)
    log = DeltaLog.open(store)
    step = log.catchup_step(log.catchup(cu.key)[0])  # the manifest itself is sound
    state = {} if kind == "snapshot" else log.materialize(0)
    message = rf"^{what}: the tensor records of the new tensor 'n' do not cover it exactly once$"
    with pytest.raises(IntegrityError, match=message):
        log.apply_step(state, step)
    with pytest.raises(IntegrityError, match=message):
        DeltaLog.open(store).verify(deep=True)
    # Routes leave the damaged catch-up out: the chain of versions still gives version 2.
    fresh = DeltaLog.open(store)
    assert_same_bits(fresh.materialize(2), s2)
    assert cu.key in fresh.excluded
