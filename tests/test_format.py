"""The on-store format on bytes: sealed JSON, commit records, log identity, keys, segments."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dcr_log.coords import Box
from dcr_log.errors import IntegrityError, UsageError
from dcr_log.format import (
    SEGMENT_SCHEMA,
    CommitRecord,
    CommitStats,
    LogIdentity,
    Record,
    SegmentRef,
    encode_segment,
    iter_segment,
    parse_version_key,
    segment_key,
    version_key,
)
from dcr_log.format import segment as segment_module
from dcr_log.format.canonical import canonical_bytes, seal, unseal
from dcr_log.format.keys import check_segment_key, check_writer_id
from dcr_log.format.tensors import TensorInfo, state_digest

LOG_ID = "0123456789abcdef0123456789abcdef"
OTHER_LOG_ID = "fedcba9876543210fedcba9876543210"


def _commit(version: int = 3, **changes) -> CommitRecord:
    tensors = (
        TensorInfo("z.bias", "BF16", (7,), 0x0123456789ABCDEF),
        TensorInfo("A", "F8_E4M3", (), 1),
        TensorInfo("é名", "I64", (0, 3), 0xFFFFFFFFFFFFFFFF),
        TensorInfo("layers.0.w", "F32", (2, 3), 0),
    )
    record = CommitRecord(
        log_id=LOG_ID,
        version=version,
        parent=None if version == 0 else version - 1,
        parent_state_digest=None if version == 0 else 0xAB,
        state_digest=state_digest(tensors),
        segments=(
            SegmentRef(segment_key(version, "w-1", "a" * 32), 1234, "0" * 64, 5),
            SegmentRef(segment_key(version, "w-2", "b" * 32), 1, "f" * 64, 0),
        ),
        tensors=tensors,
        stats=CommitStats(changed_elements=11, total_elements=14, records=5),
        created_at="2025-01-02T03:04:05.000006Z",
        writer_id="w-1",
    )
    return dataclasses.replace(record, **changes)


def _resealed(data: bytes, edit) -> bytes:
    """Parse sealed bytes, let ``edit`` change the object, seal it again (a valid checksum)."""
    obj = json.loads(data)
    del obj["checksum"]
    edit(obj)
    return seal(obj)


# -- canonical sealed JSON --------------------------------------------------------------------

def test_seal_is_canonical_and_checked():
    data = seal({"b": 1, "a": "é", "c": [1, None]})
    assert data.startswith(b'{"a":"\\u00e9","b":1,"c":[1,null],"checksum":"')
    assert data.isascii() and b" " not in data
    assert unseal(data, "x") == {"a": "é", "b": 1, "c": [1, None]}
    assert seal(unseal(data, "x")) == data


@pytest.mark.parametrize("data", [
    b"", b"{}", b"[]", b"null", b'{"checksum":"00"}', b"\xff\xfe{}",
    b'{"a":1, "checksum":"x"}',
])
def test_unseal_rejects(data):
    with pytest.raises(IntegrityError):
        unseal(data, "x")


def test_unseal_rejects_non_canonical_spelling_of_a_valid_object():
    good = seal({"a": 1, "b": "x"})
    for variant in (good.replace(b'"a":1', b'"a": 1'), good + b"\n", good.replace(b'"b":"x"', b'"b":"\\u0078"')):
        assert json.loads(variant) == json.loads(good)
        with pytest.raises(IntegrityError, match="canonical"):
            unseal(variant, "x")


# -- commit records ---------------------------------------------------------------------------

@pytest.mark.parametrize("version", [0, 1, 3, 10**12])
def test_commit_record_roundtrip(version):
    record = _commit(version)
    data = record.to_bytes()
    back = CommitRecord.from_bytes(data, expect_version=version)
    # The tensor table comes back sorted by UTF-8 name; everything else as written.
    assert [t.name for t in back.tensors] == sorted((t.name for t in record.tensors), key=str.encode)
    assert back.tensor_map() == record.tensor_map()
    assert dataclasses.replace(back, tensors=record.tensors) == record
    assert back.to_bytes() == data
    assert back.delta_bytes == 1235


def test_commit_record_exact_member_names():
    obj = json.loads(_commit(3).to_bytes())
    assert sorted(obj) == sorted([
        "checksum", "created_at", "features", "format_version", "log_id", "parent",
        "parent_state_digest", "segments", "state_digest", "stats", "tensors", "version", "writer_id",
    ])
    assert obj["tensors"][0] == {"digest": "0000000000000001", "dtype": "F8_E4M3", "name": "A", "shape": []}
    assert obj["parent"] == 2 and obj["parent_state_digest"] == "00000000000000ab"


@pytest.mark.parametrize("version", [0, 3])
def test_every_single_byte_flip_of_a_commit_record_is_rejected(version):
    data = _commit(version).to_bytes()
    for i in range(len(data)):
        for bit in (0x01, 0x20, 0x80):
            flipped = bytearray(data)
            flipped[i] ^= bit
            with pytest.raises(IntegrityError):
                CommitRecord.from_bytes(bytes(flipped), expect_version=version)


def test_every_truncation_of_a_commit_record_is_rejected():
    data = _commit(3).to_bytes()
    for cut in range(len(data)):
        with pytest.raises(IntegrityError):
            CommitRecord.from_bytes(data[:cut], expect_version=3)


def test_every_single_byte_flip_of_the_identity_is_rejected():
    data = LogIdentity(log_id=LOG_ID, created_at="2025-01-01T00:00:00Z").to_bytes()
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x04
        with pytest.raises(IntegrityError):
            LogIdentity.from_bytes(bytes(flipped))


def test_identity_roundtrip_and_checks():
    ident = LogIdentity(log_id=LOG_ID, created_at="2025-01-01T00:00:00Z")
    data = ident.to_bytes()
    assert LogIdentity.from_bytes(data) == ident
    for edit in (
        lambda o: o.update(format_version=2),
        lambda o: o.update(features=["deletion-vectors"]),
        lambda o: o.update(features="x"),
        lambda o: o.update(log_id="not-a-uuid"),
        lambda o: o.update(log_id=LOG_ID + "\n"),
        lambda o: o.update(extra=1),
        lambda o: o.pop("created_at"),
    ):
        with pytest.raises(IntegrityError):
            LogIdentity.from_bytes(_resealed(data, edit))


def test_commit_record_of_another_version_rejected():
    data = _commit(3).to_bytes()
    CommitRecord.from_bytes(data, expect_version=3)
    for other in (2, 4, 0):
        with pytest.raises(IntegrityError):
            CommitRecord.from_bytes(data, expect_version=other)


@pytest.mark.parametrize("parent", [1, 3, 4, -1])
def test_parent_must_be_previous_version(parent):
    data = _commit(3, parent=parent).to_bytes()
    with pytest.raises(IntegrityError, match="parent"):
        CommitRecord.from_bytes(data, expect_version=3)


def test_version_zero_has_no_parent():
    with pytest.raises(UsageError):
        _commit(0, parent=0, parent_state_digest=1).to_bytes()
    with pytest.raises(UsageError):
        _commit(1, parent=None, parent_state_digest=None).to_bytes()
    data = _commit(0).to_bytes()
    for edit in (lambda o: o.update(parent=0), lambda o: o.update(parent_state_digest="00000000000000ab")):
        with pytest.raises(IntegrityError):
            CommitRecord.from_bytes(_resealed(data, edit), expect_version=0)


def _swap_first_tensors(obj):
    obj["tensors"][0], obj["tensors"][1] = obj["tensors"][1], obj["tensors"][0]


def _duplicate_first_tensor(obj):
    obj["tensors"].insert(1, dict(obj["tensors"][0]))


INVALID_COMMIT_EDITS = {
    "tensors unsorted": _swap_first_tensors,
    "tensor duplicated": _duplicate_first_tensor,
    "unknown dtype": lambda o: o["tensors"][0].update(dtype="F4"),
    "negative dimension": lambda o: o["tensors"][0].update(shape=[-1]),
    "float dimension": lambda o: o["tensors"][0].update(shape=[1.5]),
    "bool dimension": lambda o: o["tensors"][0].update(shape=[True]),
    "empty name": lambda o: o["tensors"][0].update(name=""),
    "NUL in name": lambda o: o["tensors"][0].update(name="a\x00b"),
    "short digest": lambda o: o["tensors"][0].update(digest="123"),
    "digest with newline": lambda o: o["tensors"][0].update(digest="0000000000000001\n"),
    "extra tensor member": lambda o: o["tensors"][0].update(extra=1),
    "upper-case digest": lambda o: o.update(state_digest="ABCDEF0123456789"),
    "parent digest missing": lambda o: o.update(parent_state_digest=None),
    "negative version": lambda o: o.update(version=-3),
    "string version": lambda o: o.update(version="3"),
    "format version 2": lambda o: o.update(format_version=2),
    "unknown feature": lambda o: o.update(features=["v2-checkpoints"]),
    "bad log id": lambda o: o.update(log_id="zz"),
    "log id with newline": lambda o: o.update(log_id=LOG_ID + "\n"),
    "created_at not a string": lambda o: o.update(created_at=5),
    "segments not a list": lambda o: o.update(segments={}),
    "segment duplicated": lambda o: o["segments"].append(dict(o["segments"][0])),
    "segment of another version": lambda o: o["segments"][0].update(key="segments/2/w-1-x.arrow"),
    "segment in a subfolder": lambda o: o["segments"][0].update(key="segments/3/sub/w-1-x.arrow"),
    "segment not .arrow": lambda o: o["segments"][0].update(key="segments/3/w-1-x.parquet"),
    "upper-case sha256": lambda o: o["segments"][0].update(sha256="F" * 64),
    "negative size": lambda o: o["segments"][0].update(size=-1),
    "segment records missing": lambda o: o["segments"][0].pop("records"),
    "stats records null": lambda o: o["stats"].update(records=None),
    "stats not an object": lambda o: o.update(stats=[]),
    "writer_id missing": lambda o: o.pop("writer_id"),
}


@pytest.mark.parametrize("edit", list(INVALID_COMMIT_EDITS.values()), ids=list(INVALID_COMMIT_EDITS))
def test_invalid_sealed_commit_records_rejected(edit):
    data = _resealed(_commit(3).to_bytes(), lambda o: None)
    CommitRecord.from_bytes(data, expect_version=3)  # the unedited record is accepted
    with pytest.raises(IntegrityError):
        CommitRecord.from_bytes(_resealed(data, edit), expect_version=3)


def _reshaped(shape: list) -> Callable[[dict], None]:
    """An edit giving the first tensor row ``shape``, the stats' total kept in step with it."""
    def edit(obj: dict) -> None:
        old = math.prod(obj["tensors"][0]["shape"])
        obj["tensors"][0]["shape"] = shape
        if isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            obj["stats"]["total_elements"] += math.prod(shape) - old
    return edit


# Faults of one tensor row, each with the words its error names: the parse checks a good row
# in one pass and names the fault only when that fails.
TENSOR_ROW_FAULTS = {
    "member missing": (lambda o: o["tensors"][0].pop("digest"), "members"),
    "extra member": (lambda o: o["tensors"][0].update(extra=1), "members"),
    "not an object": (lambda o: o["tensors"].__setitem__(0, list(o["tensors"][0].items())), "expected an object"),
    "name not a string": (lambda o: o["tensors"][0].update(name=5), "bad tensor name"),
    "dtype not a string": (lambda o: o["tensors"][0].update(dtype=["BF16"]), "unknown dtype"),
    "shape not a list": (_reshaped("4"), "shape must be a list"),
    "negative dimension": (_reshaped([-1]), "dimension must be an integer"),
    "bool dimension": (_reshaped([True]), "dimension must be an integer"),
    "dimension of 2^64": (_reshaped([1 << 64]), "dimension must be an integer"),
    "dimension above the limit": (_reshaped([(1 << 48) + 1]), "a dimension above"),
    "rank above the limit": (_reshaped([1] * 33), "rank 33 above"),
    "more than 256 TiB": (_reshaped([1 << 47, 4]), "of 562949953421312 bytes"),
    "digest not a string": (lambda o: o["tensors"][0].update(digest=5), "bad digest"),
    "total elements off by one": (lambda o: o["stats"].update(total_elements=o["stats"]["total_elements"] + 1),
                                  "total_elements"),
}


@pytest.mark.parametrize("edit,says", list(TENSOR_ROW_FAULTS.values()), ids=list(TENSOR_ROW_FAULTS))
def test_a_faulty_tensor_row_is_refused_by_name(edit, says):
    data = _commit(3).to_bytes()
    with pytest.raises(IntegrityError, match=re.escape(says)):
        CommitRecord.from_bytes(_resealed(data, edit), expect_version=3)


def test_tensor_names_sorted_by_utf8_bytes():
    """U+FF21 sorts before U+1F600 in UTF-8 but after it in UTF-16: the format uses UTF-8."""
    tensors = (TensorInfo("\U0001F600", "U8", (1,), 1), TensorInfo("\uFF21", "U8", (1,), 2))
    record = _commit(3, tensors=tensors, state_digest=state_digest(tensors),
                     stats=CommitStats(changed_elements=2, total_elements=2, records=5))
    back = CommitRecord.from_bytes(record.to_bytes(), expect_version=3)
    assert [t.name for t in back.tensors] == ["\uFF21", "\U0001F600"]
    swapped = _resealed(record.to_bytes(), _swap_first_tensors)
    with pytest.raises(IntegrityError, match="sorted"):
        CommitRecord.from_bytes(swapped, expect_version=3)


# -- keys -------------------------------------------------------------------------------------

def test_version_keys():
    assert version_key(7) == "versions/00000000000000000007.json"
    assert len(version_key(0)) == len("versions/") + 20 + len(".json")
    for v in (0, 1, 99, 10**19):
        assert parse_version_key(version_key(v)) == v
    for bad in ("versions/7.json", "versions/0000000000000000007.json", "versions/00000000000000000007.json.tmp",
                "x/versions/00000000000000000007.json", "versions/00000000000000000007.json\n",
                "versions/0000000000000000000a.json", "dcr.json"):
        assert parse_version_key(bad) is None, bad


def test_segment_keys_and_writer_ids():
    key = segment_key(7, "host-12", "ab" * 16)
    assert key == f"segments/7/host-12-{'ab' * 16}.arrow"
    check_segment_key(key, 7)
    for version in (6, 70):
        with pytest.raises(IntegrityError):
            check_segment_key(key, version)
    assert check_writer_id("a.B_c-9") == "a.B_c-9"
    for bad in ("", "a/b", "a b", "x" * 65, "w\n", "é"):
        with pytest.raises(UsageError):
            check_writer_id(bad)


# -- segments ---------------------------------------------------------------------------------

def _records() -> list[Record]:
    return [
        Record("a", "xor", Box((0, 0), (2, 3)), "sparse", {"gap_bytes": 1, "level": 9}, 2, 1, 2 ** 64 - 1, b"\x01\x02"),
        Record("é名", "tensor", Box((), ()), "raw", {}, 1, 0, 7, b"\x00" * 4),
        Record("a", "overwrite", Box((2, 0), (1, 3)), "raw", {}, 0, 0, 0, b""),
        Record("big", "xor", Box((2**40, 3), (5, 1)), "dense", {"level": 3}, 5, 3, 4, bytes(range(256)) * 3),
    ]


def _same_records(got: list[Record], expected: list[Record]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert dataclasses.replace(g, payload=b"") == dataclasses.replace(e, payload=b"")
        assert bytes(g.payload) == bytes(e.payload)


def test_segment_roundtrip():
    records = _records()
    data = encode_segment(records, LOG_ID, 5)
    _same_records(list(iter_segment(data, LOG_ID, 5)), records)
    _same_records(list(iter_segment(memoryview(data), LOG_ID, 5)), records)
    assert list(iter_segment(encode_segment([], LOG_ID, 5), LOG_ID, 5)) == []


def test_segment_roundtrip_over_several_batches(monkeypatch):
    monkeypatch.setattr(segment_module, "BATCH_PAYLOAD_BYTES", 3)
    records = _records() * 3
    data = encode_segment(records, LOG_ID, 5)
    assert pa.ipc.open_file(pa.py_buffer(data)).num_record_batches > 3
    _same_records(list(iter_segment(data, LOG_ID, 5)), records)


def test_segment_is_an_arrow_file_with_the_documented_schema():
    data = encode_segment(_records(), LOG_ID, 5)
    reader = pa.ipc.open_file(pa.py_buffer(data))
    assert reader.schema.remove_metadata().equals(SEGMENT_SCHEMA)
    assert reader.schema.metadata == {b"dcr.format_version": b"1", b"dcr.log_id": LOG_ID.encode(),
                                      b"dcr.version": b"5"}
    table = reader.read_all()
    assert table.column("params").to_pylist()[0] == '{"gap_bytes":1,"level":9}'


@pytest.mark.parametrize("log_id,version", [(OTHER_LOG_ID, 5), (LOG_ID, 4), (LOG_ID, 6), (OTHER_LOG_ID, 4)])
def test_segment_of_another_log_or_version_rejected(log_id, version):
    data = encode_segment(_records(), LOG_ID, 5)
    with pytest.raises(IntegrityError, match="another log or version"):
        list(iter_segment(data, log_id, version))


@pytest.mark.parametrize("data", [b"", b"ARROW1", b"PAR1" * 10, json.dumps({"a": 1}).encode()])
def test_non_arrow_segment_rejected(data):
    with pytest.raises(IntegrityError):
        list(iter_segment(data, LOG_ID, 5))


def _arrow_file(batch: pa.RecordBatch, schema: pa.Schema) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _segment_columns(**override) -> dict:
    cols = {
        "tensor": ["a"], "kind": ["xor"], "box_offset": [[0]], "box_shape": [[4]], "encoding": ["raw"],
        "params": ["{}"], "n_changed": [1], "base_digest": [0], "target_digest": [0], "payload": [b"x"],
    }
    cols.update(override)
    return cols


@pytest.mark.parametrize("override,match", [
    ({"params": ['{"level": 3}']}, "canonical"),
    ({"params": ["[1]"]}, "canonical"),
    ({"params": ["{"]}, "JSON"),
    ({"kind": ["and"]}, "kind"),
    ({"box_shape": [[4, 1]]}, "rank"),
    ({"box_offset": [[0] * 33], "box_shape": [[1] * 33]}, "beyond the limits"),
    ({"box_offset": [[(1 << 48) + 1]]}, "beyond the limits"),
    ({"box_shape": [[(1 << 48) + 1]]}, "beyond the limits"),
    ({"box_offset": [[(1 << 64) - 1]]}, "beyond the limits"),
    # Nulls in fields the schema declares non-nullable (Arrow writes and validates them):
    *(({name: [None]}, f"null in column '{name}'") for name in _segment_columns()),
    ({"box_offset": [[None]]}, "null in column 'box_offset'"),
    ({"box_shape": [[None]]}, "null in column 'box_shape'"),
])
def test_segment_rows_checked(override, match):
    meta_schema = SEGMENT_SCHEMA.with_metadata(segment_module._meta(LOG_ID, 5))
    good = pa.record_batch([pa.array(v, SEGMENT_SCHEMA.field(k).type) for k, v in _segment_columns().items()],
                           schema=SEGMENT_SCHEMA)
    assert len(list(iter_segment(_arrow_file(good, meta_schema), LOG_ID, 5))) == 1
    cols = _segment_columns(**override)
    batch = pa.record_batch([pa.array(v, SEGMENT_SCHEMA.field(k).type) for k, v in cols.items()],
                            schema=SEGMENT_SCHEMA)
    with pytest.raises(IntegrityError, match=match):
        list(iter_segment(_arrow_file(batch, meta_schema), LOG_ID, 5))


_BOX_ITEMS = st.one_of(st.none(), st.sampled_from([0, 1, 7, (1 << 48) - 1, 1 << 48, (1 << 64) - 1]),
                      st.integers(0, 1 << 20))


@settings(max_examples=150, deadline=None)
@given(boxes=st.lists(st.tuples(st.lists(_BOX_ITEMS, max_size=34), st.lists(_BOX_ITEMS, max_size=34)),
                      min_size=1, max_size=6),
       offset=st.integers(0, 2))
def test_segment_boxes_checked_on_the_buffers_as_row_by_row(boxes, offset):
    """The boxes of a batch are checked on its columns' buffers at once: a segment is accepted
    exactly when every row passes the row-by-row check, and refused with the first bad row's
    error (a null item, a rank mismatch, a rank or item beyond the limits); also where the
    list arrays are slices of larger ones."""
    meta_schema = SEGMENT_SCHEMA.with_metadata(segment_module._meta(LOG_ID, 5))
    n = len(boxes)
    pad = [[0]] * offset
    cols = _segment_columns(**{name: values * n for name, values in _segment_columns().items()
                               if name not in ("box_offset", "box_shape")})
    arrays = []
    for name, values in cols.items():
        if name in ("box_offset", "box_shape"):
            rows = [list(b[0] if name == "box_offset" else b[1]) for b in boxes]
            arrays.append(pa.array(pad + rows, SEGMENT_SCHEMA.field(name).type).slice(offset))
        else:
            arrays.append(pa.array(values, SEGMENT_SCHEMA.field(name).type))
    batch = pa.record_batch(arrays, schema=SEGMENT_SCHEMA)
    expected = None
    for box_offset, box_shape in boxes:
        try:
            segment_module._check_box(box_offset, box_shape, 5)
        except IntegrityError as exc:
            expected = str(exc)
            break
    data = _arrow_file(batch, meta_schema)
    if expected is None:
        got = list(iter_segment(data, LOG_ID, 5))
        assert [(r.box.offset, r.box.shape) for r in got] == [(tuple(o), tuple(s)) for o, s in boxes]
    else:
        with pytest.raises(IntegrityError) as caught:
            list(iter_segment(data, LOG_ID, 5))
        assert str(caught.value) == expected


def test_segment_with_another_schema_rejected():
    schema = pa.schema([pa.field("tensor", pa.utf8(), nullable=False)]).with_metadata(
        segment_module._meta(LOG_ID, 5))
    data = _arrow_file(pa.record_batch([pa.array(["a"])], schema=schema), schema)
    with pytest.raises(IntegrityError, match="schema"):
        list(iter_segment(data, LOG_ID, 5))


def test_record_kind_checked():
    with pytest.raises(IntegrityError):
        Record("a", "replace", Box((0,), (1,)), "raw", {}, 1, 0, 0, b"")


def test_canonical_params_bytes():
    assert canonical_bytes({"level": 9, "gap_bytes": 1}) == b'{"gap_bytes":1,"level":9}'


def test_raw_records_at_any_offset_of_a_segment_decode_to_their_changes():
    """Payloads are views of the segment's buffer wherever they start (no copy at parse); the
    raw encoding, which views its payload as words, decodes one at an odd offset into aligned
    words all the same."""
    from dcr_log.codec import ChangeSet, decode_changes, get_encoding

    rng = np.random.default_rng(3)
    changes = []
    records = []
    for i, (k, dtype) in enumerate([(3, "<u2"), (5, "<u4"), (2, "<u8"), (7, "<u2")]):
        n = 64
        positions = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
        values = rng.integers(1, 1 << 15, k).astype(dtype)
        params, payload = get_encoding("raw").encode("xor", ChangeSet(n, positions, values))
        records.append(Record(f"t{i}", "xor", Box((0,), (n,)), "raw", params, k, 0, 0, b"\x01" * (i % 2) + payload))
        changes.append((n, positions, values))
    # An odd byte before every other payload, cut off again below: the payloads of one batch
    # then start at odd offsets of the segment.
    data = encode_segment(records, LOG_ID, 5)
    buffer = pa.py_buffer(data)
    got = list(iter_segment(buffer, LOG_ID, 5))
    starts = [pa.py_buffer(r.payload).address - buffer.address for r in got]
    assert all(0 <= s < len(data) for s in starts)  # views of the segment, not copies
    assert any(s % 8 for s in starts)
    for rec, (n, positions, values) in zip(got, changes):
        payload = rec.payload[1:] if rec.tensor in ("t1", "t3") else rec.payload
        decoded = decode_changes("xor", "raw", rec.params, payload, n, len(positions), values.dtype)
        assert np.array_equal(decoded.positions, positions)
        assert decoded.values.tobytes() == values.tobytes()
        # aligned, as the C gather and scatter take them
        assert decoded.positions.flags.aligned and decoded.values.flags.aligned


def test_zero_row_batches_are_read_past():
    """Section 8 allows batches of no rows, here with their list columns' offsets as empty
    buffers (as a writer may leave them for no rows), before and after a batch of one row."""
    meta_schema = SEGMENT_SCHEMA.with_metadata(segment_module._meta(LOG_ID, 5))
    good = pa.record_batch([pa.array(v, SEGMENT_SCHEMA.field(k).type) for k, v in _segment_columns().items()],
                           schema=SEGMENT_SCHEMA)
    empty_columns = []
    for field in SEGMENT_SCHEMA:
        if pa.types.is_list(field.type):
            empty_columns.append(pa.Array.from_buffers(field.type, 0, [None, None],
                                                       children=[pa.array([], field.type.value_type)]))
        else:
            empty_columns.append(pa.array([], field.type))
    empty = pa.record_batch(empty_columns, schema=SEGMENT_SCHEMA)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, meta_schema) as writer:
        for batch in (empty, good, empty):
            writer.write_batch(batch)
    records = list(iter_segment(sink.getvalue().to_pybytes(), LOG_ID, 5))
    assert [(r.tensor, r.box.offset, r.box.shape, bytes(r.payload)) for r in records] == [("a", (0,), (4,), b"x")]
