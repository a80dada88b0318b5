"""Segment files: Arrow IPC file format, one row per record. Pure: bytes in, bytes out."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dcr_log.coords import Box
from dcr_log.errors import IntegrityError
from dcr_log.format import limits as L
from dcr_log.format.canonical import canonical_bytes, parse_json

if TYPE_CHECKING:
    import pyarrow as pa


def load_pyarrow() -> Any:
    # pyarrow is imported when a segment is first read or written, not with the package: a
    # command that reads no segment (``dcr apply`` of an empty delta) starts without it.
    import pyarrow

    return pyarrow


def load_reader() -> None:
    """Import what reading a segment takes (pyarrow and its IPC reader; about 18 ms here,
    ``python -X importtime -c "import pyarrow.ipc"``): a receiver opened ahead of its first
    version pays for it then, not in the apply."""
    import pyarrow.ipc  # noqa: F401


@functools.cache
def segment_schema() -> pa.Schema:
    """The segment files' Arrow schema (section 8), without its metadata."""
    pa = load_pyarrow()
    return pa.schema([
        pa.field("tensor", pa.utf8(), nullable=False),
        pa.field("kind", pa.utf8(), nullable=False),
        pa.field("box_offset", pa.list_(pa.field("item", pa.uint64(), nullable=False)), nullable=False),
        pa.field("box_shape", pa.list_(pa.field("item", pa.uint64(), nullable=False)), nullable=False),
        pa.field("encoding", pa.utf8(), nullable=False),
        pa.field("params", pa.utf8(), nullable=False),
        pa.field("n_changed", pa.uint64(), nullable=False),
        pa.field("base_digest", pa.uint64(), nullable=False),
        pa.field("target_digest", pa.uint64(), nullable=False),
        pa.field("payload", pa.large_binary(), nullable=False),
    ])


def __getattr__(name: str) -> Any:
    if name == "SEGMENT_SCHEMA":  # the schema, built (and pyarrow imported) on first use
        return segment_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Records are grouped into Arrow record batches of about this many payload bytes: a reader
# holds one batch at a time, and a writer to a local directory writes each batch as soon as it
# is closed, while later records are encoded (write.uploader.SegmentUploader.feed). With 64 MiB,
# a version of 22 MiB (10% changed of 512 MiB) was one batch, written after the last record,
# and the append waited for that write (tools/bench_encode.py --mib 512 --rates 0.10 --phases
# 0.10 --repeats 6 --no-create --layout transformer --layers 24: 72.6 ms of 295).
BATCH_PAYLOAD_BYTES = 4 << 20
# A record with at least this many payload bytes gets a batch of its own, so that its payload
# goes into the file without first being joined with its neighbours' (one copy less).
OWN_BATCH_BYTES = 1 << 20

# The kinds of record (section 9): how a record's values combine with the words they replace.
KINDS = ("xor", "overwrite", "tensor")


@dataclass(frozen=True)
class Record:
    tensor: str
    kind: str
    box: Box
    encoding: str
    params: dict
    n_changed: int
    base_digest: int
    target_digest: int
    payload: bytes | memoryview
    # Called once the payload has been decoded (delta.decode_record), for a payload that lies in
    # a memory-mapped segment file: its pages may then be given back (log.SegmentFile).
    done: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise IntegrityError(f"unknown record kind {self.kind!r}")


def _meta(log_id: str, version: int) -> dict[bytes, bytes]:
    return {b"dcr.format_version": b"1", b"dcr.log_id": log_id.encode(), b"dcr.version": str(version).encode()}


def _batch(records: list[Record]) -> pa.RecordBatch:
    pa = load_pyarrow()
    return pa.record_batch([
        pa.array([r.tensor for r in records], pa.utf8()),
        pa.array([r.kind for r in records], pa.utf8()),
        pa.array([list(r.box.offset) for r in records], segment_schema().field("box_offset").type),
        pa.array([list(r.box.shape) for r in records], segment_schema().field("box_shape").type),
        pa.array([r.encoding for r in records], pa.utf8()),
        pa.array([canonical_bytes(r.params).decode() for r in records], pa.utf8()),
        pa.array([r.n_changed for r in records], pa.uint64()),
        pa.array([r.base_digest for r in records], pa.uint64()),
        pa.array([r.target_digest for r in records], pa.uint64()),
        _payload_column(records),
    ], schema=segment_schema())


def _payload_column(records: list[Record]) -> pa.Array:
    """The payloads as one large_binary array built from its buffers: one join, where
    pa.array over a list of bytes objects is an order of magnitude slower."""
    pa = load_pyarrow()
    offsets = np.zeros(len(records) + 1, dtype=np.int64)
    np.cumsum([len(r.payload) for r in records], out=offsets[1:])
    # One record (a large payload has a batch of its own): its buffer as is, not copied.
    data = records[0].payload if len(records) == 1 else b"".join(r.payload for r in records)
    return pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(records), [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


class SegmentBuilder:
    """Accumulates records into one segment file's bytes, batch by batch.

    The file is written when it is finished, into one buffer sized from the records (an
    upper bound on the IPC framing), so the payloads are copied once: a growing output
    stream would copy them again at every doubling, onto fresh pages each time. Or, into a
    file, batch by batch as they close (``take_closed``, ``write_batches``).
    """

    def __init__(self, log_id: str, version: int):
        self._schema = segment_schema().with_metadata(_meta(log_id, version))
        self._batches: list[list[Record]] = [[]]
        self._pending_bytes = 0
        self._taken = False  # batches were handed over (take_closed): only write_batches writes
        self.records = 0
        self.payload_bytes = 0

    def add(self, record: Record) -> None:
        size = len(record.payload)
        if size >= OWN_BATCH_BYTES and self._batches[-1]:
            self._batches.append([])
            self._pending_bytes = 0
        self._batches[-1].append(record)
        self._pending_bytes += size
        self.records += 1
        self.payload_bytes += size
        if self._pending_bytes >= BATCH_PAYLOAD_BYTES or size >= OWN_BATCH_BYTES:
            self._batches.append([])
            self._pending_bytes = 0

    def _bound(self) -> int:
        """More than the file can take: payloads, names and params, plus generous framing."""
        text = sum(len(r.tensor.encode()) + len(r.kind) + len(r.encoding) + 64 + 16 * len(r.box.shape)
                   for batch in self._batches for r in batch)
        return self.payload_bytes + text + 512 * self.records + (64 << 10) * len(self._batches) + (1 << 20)

    @property
    def closed_batches(self) -> int:
        """Batches closed and not yet taken (the last one is open)."""
        return len(self._batches) - 1

    def take_closed(self, everything: bool = False) -> list[list[Record]]:
        """Hand over the batches closed so far (with ``everything``, the open one too), for
        ``write_batches``: the builder keeps only its counts. A segment taken from is written
        by ``write_batches`` alone."""
        keep = [] if everything else self._batches[-1:]
        taken = [batch for batch in self._batches[:len(self._batches) - len(keep)] if batch]
        self._batches = keep or [[]]
        if everything:
            self._pending_bytes = 0
        self._taken = self._taken or bool(taken)
        return taken

    def write_batches(self, f, batches: Iterable[list[Record]]) -> None:
        """Write the segment file to a binary file object from ``batches`` as they come (the
        builder's own, taken by ``take_closed``)."""
        pa = load_pyarrow()
        self._write(pa.PythonFile(f, mode="w"), batches)

    def _write(self, sink, batches: Iterable[list[Record]] | None = None) -> None:
        if batches is None and self._taken:
            raise ValueError("batches were taken from this segment: write them with write_batches")
        pa = load_pyarrow()
        writer = pa.ipc.new_file(sink, self._schema)
        for batch in self._batches if batches is None else batches:
            if batch:
                writer.write_batch(_batch(batch))
        writer.close()

    def write_to(self, f) -> None:
        """Write the segment file to a binary file object (no copy of it in memory)."""
        pa = load_pyarrow()
        self._write(pa.PythonFile(f, mode="w"))

    def finish(self, into: pa.Buffer | None = None) -> pa.Buffer:
        """The segment's bytes: a slice of ``into`` (a mutable buffer to reuse) when it is
        large enough, else of a new buffer."""
        pa = load_pyarrow()
        bound = self._bound()
        buf = into if into is not None and into.size >= bound else pa.allocate_buffer(bound)
        sink = pa.FixedSizeBufferWriter(buf)
        try:
            self._write(sink)
        except (pa.ArrowInvalid, OSError):  # the bound was too small after all: grow as needed
            out = pa.BufferOutputStream()
            self._write(out)
            return out.getvalue()
        return buf.slice(0, sink.tell())


def encode_segment(records: Iterable[Record], log_id: str, version: int) -> bytes:
    builder = SegmentBuilder(log_id, version)
    for r in records:
        builder.add(r)
    return builder.finish().to_pybytes()


def _parse_params(text: str) -> dict:
    # A segment repeats a few params texts ("{}" for every ulp-rans record): each is parsed
    # and checked once (parsing and the canonical check were half of a segment's parse); a
    # record gets its own copy (params are flat objects of numbers and strings).
    return dict(_checked_params(text))


@functools.lru_cache(maxsize=256)
def _checked_params(text: str) -> dict:
    L.check(len(text) <= L.MAX_PARAMS_BYTES, "record params", f"more than {L.MAX_PARAMS_BYTES} bytes")
    params = parse_json(text, "record params")
    if not isinstance(params, dict) or canonical_bytes(params).decode() != text:
        raise IntegrityError("record params are not a canonical JSON object")
    return params


def iter_segment(data, log_id: str, version: int) -> Iterator[Record]:
    """Yield the records of a segment, checking its schema and that it belongs here.

    ``data`` may be bytes or any buffer; payloads are zero-copy slices of it.
    """
    pa = load_pyarrow()
    try:
        reader = pa.ipc.open_file(pa.py_buffer(data))
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
        raise IntegrityError(f"segment of version {version}: not an Arrow IPC file ({exc})") from None
    schema = reader.schema
    if not schema.remove_metadata().equals(segment_schema()):
        raise IntegrityError(f"segment of version {version}: unexpected schema")
    meta = schema.metadata or {}
    if meta != _meta(log_id, version):
        raise IntegrityError(f"segment of version {version}: belongs to another log or version")
    for i in range(reader.num_record_batches):
        try:
            batch = reader.get_batch(i)
            batch.validate(full=True)
        except (pa.ArrowInvalid, pa.ArrowException, OSError) as exc:
            raise IntegrityError(f"segment of version {version}: corrupt batch ({exc})") from None
        cols = {name: batch.column(name) for name in segment_schema().names}
        # Every field is declared non-nullable, which Arrow neither enforces on write nor
        # checks in validate: a null would reach the records as None.
        # (The items of the box lists are checked below, on their buffers: ListArray.flatten
        # would import pyarrow.compute, about 21 ms by python -X importtime;
        # tests/test_api_habits.py.)
        for name, column in cols.items():
            if column.null_count:
                raise IntegrityError(f"segment of version {version}: a null in column {name!r}")
        # Each column converted once per batch, not one pyarrow scalar per value (eight per
        # record: most of a segment's parse before).
        values = {name: cols[name].to_pylist() for name in _SCALAR_COLUMNS}
        offsets, shapes = values["box_offset"], values["box_shape"]
        # (A batch of no rows has nothing to check; its list offsets may be an empty buffer.)
        if batch.num_rows and not _boxes_plain(cols["box_offset"], cols["box_shape"]):
            for j in range(batch.num_rows):  # the first bad row's error
                _check_box(offsets[j], shapes[j], version)
        payload = _payload_slices(cols["payload"])
        tensor, kind, encoding, params = values["tensor"], values["kind"], values["encoding"], values["params"]
        n_changed, base_digest, target_digest = values["n_changed"], values["base_digest"], values["target_digest"]
        for j in range(batch.num_rows):
            yield Record(tensor[j], kind[j], Box(tuple(offsets[j]), tuple(shapes[j])), encoding[j],
                         _parse_params(params[j]), n_changed[j], base_digest[j], target_digest[j], payload(j))


def _boxes_plain(offset_column: pa.ListArray, shape_column: pa.ListArray) -> bool:
    """Whether every row's box passes _check_box, checked on the columns' buffers at once (with
    the per-row check, and a copy of each unaligned payload, a segment of 89 records parsed in
    0.46 ms, now 0.21: tools/bench_apply.py --gib 0.5 --reps 1 --receivers numpy --verify none
    --rates 0.0001,0.01): no null item, offset and shape of the same rank, within the limits.
    False: some row may fail, checked row by row. The columns hold at least one row."""
    lengths, items = [], []
    for column in (offset_column, shape_column):
        if column.values.null_count:
            return False
        bounds = column.offsets.to_numpy()
        lengths.append(np.diff(bounds))
        items.append(column.values.to_numpy()[bounds[0]:bounds[-1]])
    if not np.array_equal(lengths[0], lengths[1]) or (lengths[0].size and lengths[0].max() > L.MAX_RANK):
        return False
    return not any(part.size and part.max() > L.MAX_DIM for part in items)


def _check_box(offset: list, shape: list, version: int) -> None:
    for name, box_list in (("box_offset", offset), ("box_shape", shape)):
        if None in box_list:
            raise IntegrityError(f"segment of version {version}: a null in column {name!r}")
    if len(offset) != len(shape):
        raise IntegrityError(f"segment of version {version}: box rank mismatch")
    if len(offset) > L.MAX_RANK or any(d > L.MAX_DIM for d in offset + shape):
        raise IntegrityError(f"segment of version {version}: box beyond the limits")


# The columns a record takes as Python values (the payload stays a view of the buffer).
_SCALAR_COLUMNS = ("tensor", "kind", "box_offset", "box_shape", "encoding", "params", "n_changed",
                   "base_digest", "target_digest")


def _payload_slices(column: pa.Array) -> Callable[[int], memoryview]:
    """Row ``j``'s payload as a view of the column's data buffer (validated): zero-copy, so a
    segment read from a memory map stays there (a scalar's ``as_buffer`` copies the bytes).
    A payload need not start on any boundary (the raw encoding, which views it as words,
    copies one that does not)."""
    _, offsets_buf, data_buf = column.buffers()
    offsets = np.frombuffer(offsets_buf, dtype=np.int64)[column.offset:column.offset + len(column) + 1].tolist()
    data = memoryview(data_buf) if data_buf is not None else memoryview(b"")

    def row(j: int) -> memoryview:
        return data[offsets[j]:offsets[j + 1]]
    return row
