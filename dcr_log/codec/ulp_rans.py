"""``ulp-rans`` (feature ``rans-encoding``, ``xor`` records only): the ``ulp`` encoding's
gaps and signed distances, each split into a bin (252 symbols: small values exactly, larger
ones by their top three bits) and the bits below it; the bins coded by static rANS with
a frequency table per record, the bits below stored as they are (spec/FORMAT.md section 11).

Why not pcodec, which the ``ulp`` encoding uses: pcodec searches its bins per file. On bf16
Adam steps at 1, 3 and 10% changed (``tools/bench_codec.py --levels 8``, one thread) fixed
bins and a static coder take 9.94, 8.45 and 6.90 bits per change against pcodec's 10.02,
8.52 and 6.96, and encode 248-266 M changes/s against pcodec's 59-67, decoding about as fast
(247-253 against 240-290): the fixed bins fit the gaps' geometric and the distances' peaked
distributions as closely as pcodec's searched ones. The coder is the C module
``dcr_log._rans``; there is no numpy form of it (rANS is a chain per stream), and
tools/rans_spec.py is its plain-Python twin, written from the spec.

Params: none (``{}``).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dcr_log.codec.attempt import Attempt, Candidate
from dcr_log.codec.base import ChangeSet, Encoding, check_params, delta_positions
from dcr_log.codec.raw import payload_size
from dcr_log.codec.ulp import from_key, steer
from dcr_log.errors import IntegrityError
from dcr_log.format.commit import RANS_ENCODING

_coder = None


def _rans():
    # Imported on first use: `import dcr_log` stays light.
    global _coder
    if _coder is None:
        from dcr_log import _rans as module

        _coder = module
    return _coder


# A stream's length is a 32-bit field (FORMAT.md section 11): records of more changes than
# this could need longer streams, and take another encoding.
MAX_CHANGES = (1 << 31) - (1 << 16)

# The fewest bytes a payload can take (FORMAT.md section 11): B, two frequency tables of at
# least one symbol (32 + 2 bytes each), three stream lengths and four streams of at least an
# initial state each. A record whose candidates so far (raw's, tried first) are already this
# small (a norm's few changes) is not encoded at all: it could not win.
MIN_PAYLOAD = 8 + 2 * (32 + 2) + 3 * 4 + 4 * 4

# What dcr_log._rans.decode's error codes mean.
_DECODE_ERRORS = {
    1: "the bit stream's length runs past the payload",
    2: "the gap table is not valid",
    3: "the distance table is not valid",
    4: "the rANS streams' lengths or initial states are not valid",
    5: "a gap or position lies beyond the box",
    6: "a distance does not fit the word",
    7: "a rANS stream does not end in its final state with every word read",
    8: "the bit stream is not exactly as long as the extra bits, zero-padded",
}


class UlpRansEncoding(Encoding):
    name = "ulp-rans"
    kinds = ("xor",)
    feature = RANS_ENCODING

    @classmethod
    def try_encode(cls, attempt: Attempt) -> Candidate | None:
        """Not above ``policy.sparse_max_rate`` (nor past MAX_CHANGES). Like ``ulp``, once
        tried it steers the rest (dcr_log.codec.ulp.steer)."""
        policy = attempt.policy
        if attempt.rate > policy.sparse_max_rate or attempt.changes.k > MAX_CHANGES:
            return None
        if (attempt.size_to_beat is not None and attempt.size_to_beat <= MIN_PAYLOAD
                and MIN_PAYLOAD > policy.ulp_sparse_ratio * payload_size(attempt.kind, attempt.changes.k,
                                                                         attempt.word_size)):
            # Its payload would lose (a candidate wins only when smaller), and would steer the
            # rest only as this does: MIN_PAYLOAD is above that share of raw's, so it would not
            # have ruled sparse out.
            attempt.whole_box_min_rate = max(attempt.whole_box_min_rate, policy.ulp_dense_min_rate)
            return None
        params, payload = cls().encode(attempt.kind, attempt.changes, base=attempt.base_values,
                                       new=attempt.new_values, buffer=attempt.buffer)
        steer(attempt, len(payload))
        return Candidate.encoded(cls.name, params, payload)

    def encode(self, kind: str, changes: ChangeSet, base: np.ndarray | None = None,
               new: np.ndarray | None = None, buffer: Callable[[str, np.dtype, int], np.ndarray] | None = None
               ) -> tuple[dict, bytes]:
        """``base`` and ``new``: the words at the changed positions (the writer has them);
        without them ``changes`` must be relative (its values the distances). ``buffer``
        (tag, dtype, n) gives reusable scratch arrays."""
        self.check_kind(kind)
        positions = np.ascontiguousarray(delta_positions(changes), dtype=np.int64)
        k = positions.size
        if k == 0:
            raise ValueError("ulp-rans: a record needs at least one change")
        if base is None or new is None:
            if not changes.relative:
                raise ValueError("ulp-rans: encode needs the base and new words, or distances")
            # Words whose keys are 0 and the distances: key(new) - key(base) is the distance.
            word = np.dtype(f"<u{changes.values.dtype.itemsize}")
            base = from_key(np.zeros(k, dtype=word))
            new = from_key(np.ascontiguousarray(changes.values).view(word))
        w = base.dtype.itemsize
        word = np.dtype(f"<u{w}")
        coder = _rans()
        get = buffer or (lambda tag, dtype, n: np.empty(n, dtype=dtype))
        out = get("rans_out", np.dtype(np.uint8), coder.bound(k))
        scratch = get("rans_scratch", np.dtype(np.uint8), coder.scratch(k))
        size = coder.encode(positions, np.ascontiguousarray(base).view(word), np.ascontiguousarray(new).view(word),
                            w, out, scratch)
        return {}, out[:size].tobytes()

    def decode(self, kind, params, payload, n, k, word) -> ChangeSet:
        """Positions and distances (``relative``): the xor words follow from the base words."""
        return self.decode_at(kind, params, payload, n, k, word, 0)

    def decode_at(self, kind, params, payload, n, k, word, origin: int) -> ChangeSet:
        """``decode``, the C decoder adding ``origin`` to each block of positions it writes."""
        self.check_kind(kind)
        check_params(self.name, params, {})
        if k == 0:
            raise IntegrityError("ulp-rans: a record needs at least one change")
        word = np.dtype(f"<u{word.itemsize}")
        positions = np.empty(k, dtype=np.int64)
        distances = np.empty(k, dtype=word)
        code = _rans().decode(payload, n, k, word.itemsize, positions, distances, origin=origin)
        if code:
            raise IntegrityError(f"ulp-rans: {_DECODE_ERRORS.get(code, f'error {code}')}")
        return ChangeSet(n, positions, distances, relative=True, origin=origin)
