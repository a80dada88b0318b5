"""The ``ulp-rans`` encoding (spec/FORMAT.md section 11) in plain Python, written from the
spec's text alone: a second implementation that the C coder (dcr_log/_rans.c) is checked
against byte for byte (tests/test_ulp_rans.py) and that tools/make_vectors.py encodes the
vectors with. Slow (one Python step per bit and symbol); for tests and vectors only.

    encode(positions, base, new, width) -> payload
    decode(payload, n, k, width) -> (positions, distances)   # raises SpecError
"""

from __future__ import annotations

SCALE_BITS = 12
SCALE = 1 << SCALE_BITS
L = 1 << 16
NBINS = 252
LANES = 2
STREAMS = 2 * LANES


class SpecError(ValueError):
    """The payload breaks a rule of the spec (a reader's integrity error)."""


# -- values ---------------------------------------------------------------------------------


def key(x: int, bits: int) -> int:
    top = 1 << (bits - 1)
    return x ^ ((1 << bits) - 1) if x & top else x ^ top


def unkey(y: int, bits: int) -> int:
    top = 1 << (bits - 1)
    return y ^ top if y & top else y ^ ((1 << bits) - 1)


def distance(b: int, t: int, bits: int) -> int:
    """(key(t) - key(b)) mod 2^W as a W-bit two's-complement integer."""
    d = (key(t, bits) - key(b, bits)) % (1 << bits)
    return d - (1 << bits) if d >> (bits - 1) else d


def zigzag(d: int) -> int:
    return 2 * d if d >= 0 else -2 * d - 1


def unzigzag(z: int) -> int:
    return z // 2 if z % 2 == 0 else -(z + 1) // 2


def to_bin(v: int) -> tuple[int, int, int]:
    """(bin, number of extra bits, extra bits) of a value 0 <= v < 2^64."""
    v = int(v)
    if v < 4:
        return v, 0, 0
    e = v.bit_length() - 1 - 2
    return 4 + 4 * e + (v >> e) - 4, e, v & ((1 << e) - 1)


def from_bin(b: int, extra: int) -> int:
    if b < 4:
        return b
    e = (b - 4) // 4
    return ((4 + (b - 4) % 4) << e) + extra


def extra_count(b: int) -> int:
    return 0 if b < 4 else (b - 4) // 4


# -- tables ---------------------------------------------------------------------------------


def normalize(counts: dict[int, int], total: int) -> dict[int, int]:
    """The reference writer's frequencies (informative in the spec): each count scaled to
    4096 and rounded half up, at least 1; a shortfall goes to the most frequent symbol (the
    lowest of those tied), an excess is taken from the largest frequencies above 1, one
    symbol at a time (the lowest of those tied), each keeping at least 1."""
    freq = {s: max(1, (c * SCALE + total // 2) // total) for s, c in counts.items()}
    largest = min(counts, key=lambda s: (-counts[s], s))
    excess = sum(freq.values()) - SCALE
    if excess < 0:
        freq[largest] -= excess
    while excess > 0:
        top = min((s for s in freq if freq[s] > 1), key=lambda s: (-freq[s], s))
        take = min(excess, freq[top] - 1)
        freq[top] -= take
        excess -= take
    return freq


def table_bytes(freq: dict[int, int]) -> bytes:
    bitmap = bytearray(32)
    for s in freq:
        bitmap[s // 8] |= 1 << (s % 8)
    return bytes(bitmap) + b"".join(freq[s].to_bytes(2, "little") for s in sorted(freq))


def read_table(data: bytes, at: int, what: str) -> tuple[dict[int, int], int]:
    if at + 32 > len(data):
        raise SpecError(f"the {what} table runs past the payload")
    symbols = [s for s in range(256) if data[at + s // 8] >> (s % 8) & 1]
    at += 32
    if any(s >= NBINS for s in symbols):
        raise SpecError(f"the {what} table lists a symbol above 251")
    if at + 2 * len(symbols) > len(data):
        raise SpecError(f"the {what} table runs past the payload")
    freq = {}
    for s in symbols:
        freq[s] = int.from_bytes(data[at:at + 2], "little")
        at += 2
    if any(f == 0 for f in freq.values()) or sum(freq.values()) != SCALE:
        raise SpecError(f"the {what} table's frequencies are not all >= 1 summing to 4096")
    return freq, at


# -- rANS -----------------------------------------------------------------------------------


def rans_encode(symbols: list[int], freq: dict[int, int]) -> bytes:
    """One stream: the symbols coded backwards from the state 2^16; the state, then the words."""
    cum, c = {}, 0
    for s in sorted(freq):
        cum[s], c = c, c + freq[s]
    x, words = L, []
    for s in reversed(symbols):
        f = freq[s]
        if x >= f << 20:  # ((2^16 >> 12) << 16) * f
            words.append(x & 0xFFFF)
            x >>= 16
        x = (x // f) * SCALE + x % f + cum[s]
    return x.to_bytes(4, "little") + b"".join(w.to_bytes(2, "little") for w in reversed(words))


class RansStream:
    """One stream being decoded (FORMAT.md: state, then 16-bit words)."""

    def __init__(self, data: bytes, freq: dict[int, int]):
        if len(data) < 4 or len(data) % 2:
            raise SpecError("a rANS stream is shorter than its state or of odd length")
        self.x = int.from_bytes(data[:4], "little")
        if self.x < L:
            raise SpecError("a rANS stream's initial state is below 2^16")
        self.words = [int.from_bytes(data[i:i + 2], "little") for i in range(4, len(data), 2)]
        self.read = 0
        self.cum, c = {}, 0
        for s in sorted(freq):
            self.cum[s], c = c, c + freq[s]
        self.freq = freq

    def next(self) -> int:
        slot = self.x % SCALE
        s = next(s for s in self.freq if self.cum[s] <= slot < self.cum[s] + self.freq[s])
        self.x = self.freq[s] * (self.x // SCALE) + slot - self.cum[s]
        if self.x < L:
            if self.read == len(self.words):
                raise SpecError("a rANS stream ran out of words")
            self.x = self.x * (1 << 16) + self.words[self.read]
            self.read += 1
        return s

    def finish(self) -> None:
        if self.x != L or self.read != len(self.words):
            raise SpecError("a rANS stream does not end at the state 2^16 with every word read")


# -- the payload ----------------------------------------------------------------------------


def encode(positions, base, new, width: int) -> bytes:
    """positions: strictly increasing ints >= 0; base, new: the W-bit words there (ints)."""
    bits = 8 * width
    gaps, prev = [], -1
    for p in positions:
        gaps.append(p - prev - 1)
        prev = p
    us = [zigzag(distance(b, t, bits)) - 1 for b, t in zip(base, new)]
    k = len(gaps)
    gbins = [to_bin(g) for g in gaps]
    dbins = [to_bin(u) for u in us]
    stream = []  # the extra bits, one int per bit, in stream order
    for (_, ge, gx), (_, de, dx) in zip(gbins, dbins):
        stream += [gx >> j & 1 for j in range(ge)] + [dx >> j & 1 for j in range(de)]
    bit_bytes = bytearray((len(stream) + 7) // 8)
    for j, bit in enumerate(stream):
        bit_bytes[j // 8] |= bit << (j % 8)
    tables = []
    for bins in (gbins, dbins):
        counts: dict[int, int] = {}
        for b, _, _ in bins:
            counts[b] = counts.get(b, 0) + 1
        tables.append(normalize(counts, k))
    streams = []
    for lane in range(LANES):
        streams.append(rans_encode([gbins[i][0] for i in range(lane, k, LANES)], tables[0]))
        streams.append(rans_encode([dbins[i][0] for i in range(lane, k, LANES)], tables[1]))
    return (len(bit_bytes).to_bytes(8, "little") + bytes(bit_bytes) + table_bytes(tables[0])
            + table_bytes(tables[1]) + b"".join(len(s).to_bytes(4, "little") for s in streams[:-1])
            + b"".join(streams))


def decode(payload: bytes, n: int, k: int, width: int) -> tuple[list[int], list[int]]:
    """The positions and the distances (as W-bit two's-complement words) of a payload."""
    data = bytes(payload)
    if k < 1:
        raise SpecError("a record needs at least one change")
    if len(data) < 8:
        raise SpecError("the payload ends before the bit stream's length")
    blen = int.from_bytes(data[:8], "little")
    if blen > len(data) - 8:
        raise SpecError("the bit stream runs past the payload")
    bit_bytes = data[8:8 + blen]
    at = 8 + blen
    gtable, at = read_table(data, at, "gap")
    dtable, at = read_table(data, at, "distance")
    if at + 4 * (STREAMS - 1) > len(data):
        raise SpecError("the stream lengths run past the payload")
    lengths = [int.from_bytes(data[at + 4 * j:at + 4 * j + 4], "little") for j in range(STREAMS - 1)]
    at += 4 * (STREAMS - 1)
    lengths.append(len(data) - at - sum(lengths))
    if lengths[-1] < 0:
        raise SpecError("the streams run past the payload")
    streams = []
    for j, length in enumerate(lengths):
        streams.append(RansStream(data[at:at + length], gtable if j % 2 == 0 else dtable))
        at += length
    bits_read = 0

    def take(count: int) -> int:
        nonlocal bits_read
        v = 0
        for j in range(count):
            if bits_read >= 8 * blen:
                raise SpecError("the bit stream ends early")
            v |= (bit_bytes[bits_read // 8] >> (bits_read % 8) & 1) << j
            bits_read += 1
        return v

    positions, distances, prev = [], [], -1
    for i in range(k):
        lane = i % LANES
        gb = streams[2 * lane].next()
        db = streams[2 * lane + 1].next()
        gap = from_bin(gb, take(extra_count(gb)))
        u = from_bin(db, take(extra_count(db)))
        if gap >= n or prev + 1 + gap >= n:
            raise SpecError("a gap or position lies beyond the box")
        prev += 1 + gap
        positions.append(prev)
        if u > (1 << (8 * width)) - 2:
            raise SpecError("a distance does not fit the word")
        distances.append(unzigzag(u + 1) % (1 << (8 * width)))
    for s in streams:
        s.finish()
    if (bits_read + 7) // 8 != blen or (bits_read % 8 and bit_bytes[-1] >> (bits_read % 8)):
        raise SpecError("the bit stream is not exactly the extra bits, zero-padded")
    return positions, distances
