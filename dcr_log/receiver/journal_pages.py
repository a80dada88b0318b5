"""LMDB's own pages in the journal's ``data.mdb``, checked as a plain file before LMDB maps it.

LMDB trusts its page headers, node bounds and page counts without checks, and a damaged one
makes it fail (or crash) only when it reads or writes that page; ``check_pages`` walks every
page of both trees first, so a damaged journal is refused with IntegrityError instead. (The
journal's entries are checked separately: journal_entries.)
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from dcr_log.errors import IntegrityError, os_error

DATA_NAME = "data.mdb"

# LMDB's file (lmdb.h/mdb.c, file format of 0.9): the page header is pgno (8 bytes), pad (2),
# flags (2), lower and upper (2 each; an overflow page's page count, 4, in their place); the
# meta (pages 0 and 1, after the header) magic, version, address, map size, the free and the
# main database (pad: the page size in the free one; flags, depth, branch, leaf and overflow
# page counts, entries, root), the last page and the transaction id.
_P_BRANCH, _P_LEAF, _P_OVERFLOW = 0x01, 0x02, 0x04
_F_BIGDATA = 0x01
_P_INVALID = (1 << 64) - 1
_MDB_INTEGERKEY = 0x08
_DB = struct.Struct("<IHHQQQQQ")


def check_pages(path: Path) -> set[int]:
    """LMDB's own structures in ``data.mdb``, read as a plain file before LMDB maps it: the
    meta page LMDB will use, and every page of both trees (page numbers within the file,
    page headers, node bounds, page counts). LMDB trusts these without checks, and a damaged
    one makes it fail (or crash) only when it reads or writes that page. Returns the pages in
    use (beside the meta pages); raises IntegrityError naming what is wrong."""
    try:
        fd = os.open(path / DATA_NAME, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise os_error(exc, f"cannot read the receiver journal {path}") from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return set()  # never written: LMDB initializes it at the first write
        head = os.pread(fd, 4096 + 160, 0)
        if len(head) < 160:
            raise IntegrityError("the file is shorter than a meta page")
        psize = _DB.unpack_from(head, 40)[0]
        if psize not in (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536) or size < 2 * psize:
            raise IntegrityError(f"meta page 0 gives page size {psize} for a file of {size} bytes")
        metas = []
        for n in (0, 1):
            page = os.pread(fd, 160, n * psize)
            magic, fmt = struct.unpack_from("<II", page, 16)
            if magic != 0xBEEFC0DE or fmt != 1 or struct.unpack_from("<Q", page, 0)[0] != n:
                raise IntegrityError(f"meta page {n} is not an LMDB meta page")
            metas.append(page)
        meta = metas[1] if struct.unpack_from("<Q", metas[0], 144)[0] < struct.unpack_from("<Q", metas[1], 144)[0] \
            else metas[0]
        last = struct.unpack_from("<Q", meta, 136)[0]
        if not 1 <= last or (last + 1) * psize > size:
            raise IntegrityError(f"the meta page's last page {last} lies beyond the file")
        seen: set[int] = set()

        def read_page(pgno: int, flags: int) -> bytes:
            if not 2 <= pgno <= last or pgno in seen:
                raise IntegrityError(f"page {pgno} is out of place")
            seen.add(pgno)
            page = os.pread(fd, psize, pgno * psize)
            got_no, _, got_flags, lower, upper = struct.unpack_from("<QHHHH", page, 0)
            if len(page) != psize or got_no != pgno or got_flags != flags:
                raise IntegrityError(f"page {pgno} has another header")
            if flags != _P_OVERFLOW and not (16 <= lower <= upper <= psize and lower % 2 == 0):
                raise IntegrityError(f"page {pgno} has bounds {lower}, {upper}")
            return page

        def walk(db: tuple, free: bool) -> list[bytes]:
            flags, depth, branches, leaves, overflows, entries, root = db[1:]
            if flags != (_MDB_INTEGERKEY if free else 0):
                raise IntegrityError(f"a database has flags {flags:#x}")
            counts = [0, 0, 0, 0]  # branch, leaf, overflow pages, entries
            values: list[bytes] = []

            def visit(pgno: int, level: int) -> None:
                leaf = level == 1
                page = read_page(pgno, _P_LEAF if leaf else _P_BRANCH)
                counts[1 if leaf else 0] += 1
                lower, upper = struct.unpack_from("<HH", page, 12)
                used = 0
                for i in range((lower - 16) // 2):
                    ptr = struct.unpack_from("<H", page, 16 + 2 * i)[0]
                    if ptr % 2 or not upper <= ptr <= psize - 8:
                        raise IntegrityError(f"page {pgno}: node {i} lies outside the page")
                    lo, hi, nflags, ksize = struct.unpack_from("<HHHH", page, ptr)
                    if leaf:
                        dsize = lo | hi << 16
                        if nflags not in (0, _F_BIGDATA):
                            raise IntegrityError(f"page {pgno}: node {i} has flags {nflags:#x}")
                        nsize = 8 + ksize + (8 if nflags else dsize)
                    else:
                        nsize = 8 + ksize
                    if ptr + nsize > psize:
                        raise IntegrityError(f"page {pgno}: node {i} runs past the page")
                    used += nsize + nsize % 2
                    if not leaf:
                        visit(lo | hi << 16 | nflags << 32, level - 1)
                        continue
                    counts[3] += 1
                    data = page[ptr + 8 + ksize: ptr + nsize]
                    if nflags:
                        first = struct.unpack_from("<Q", data)[0]
                        over = read_page(first, _P_OVERFLOW)
                        pages = struct.unpack_from("<I", over, 12)[0]
                        if not 1 <= pages <= last + 1 - first or pages * psize - 16 < dsize:
                            raise IntegrityError(f"overflow page {first} has {pages} pages")
                        seen.update(range(first + 1, first + pages))
                        counts[2] += pages
                        if free:
                            data = os.pread(fd, dsize, first * psize + 16)
                    if free:
                        values.append(bytes(data[:dsize]))
                if used != psize - upper:
                    raise IntegrityError(f"page {pgno}: its nodes do not fill it from {upper}")

            if root == _P_INVALID:
                if depth != 0 or entries != 0:
                    raise IntegrityError("an empty database has depth or entries")
            elif not 1 <= depth <= 32:
                raise IntegrityError(f"a database has depth {depth}")
            else:
                visit(root, depth)
            if counts != [branches, leaves, overflows, entries]:
                raise IntegrityError(f"a database's page counts {counts} differ from its meta's")
            return values

        free_db = _DB.unpack_from(meta, 40)
        main_db = _DB.unpack_from(meta, 88)
        walk(main_db, False)
        live = set(seen)
        free: set[int] = set()
        for value in walk(free_db, True):
            n = len(value) // 8 - 1
            ids = struct.unpack_from(f"<{n + 1}Q", value) if len(value) % 8 == 0 and n >= 0 else ()
            pages = ids[1:]
            if (not ids or ids[0] != n or any(a <= b for a, b in zip(pages, pages[1:]))
                    or any(not 2 <= pg <= last or pg in seen or pg in free for pg in pages)):
                raise IntegrityError("a free-page list names pages out of place")
            free.update(pages)
        # LMDB accounts for every page: the meta pages, those in use and the free ones.
        if len(seen) + len(free) + 2 != last + 1:
            raise IntegrityError(f"{len(seen)} pages in use and {len(free)} free do not make "
                                 f"the {last + 1} pages of the file")
        return live
    except OSError as exc:
        raise os_error(exc, f"cannot read the receiver journal {path}") from None
    finally:
        os.close(fd)
