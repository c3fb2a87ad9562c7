"""Fuzz target ``fuzz_spool``: the producer's on-disk spool (CRC-framed records, ``streams/producer.py``).

Inputs are mutations of a real spool file: bit flips, cuts, inserted bytes, frame lengths claiming up to 4 GiB,
and frames whose CRC is right but whose payload is not a record. Property: the intact records before the first
damaged frame are read back unchanged, and nothing else: the damaged tail ends the iteration (it was never
acknowledged), a CRC-valid frame that is not a record is :class:`SpoolError`, and reading never allocates more
than the file holds.
"""

from __future__ import annotations

import struct
import uuid
import zlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from streams.producer import SPOOL_MAGIC, SpoolError, _scan_spool, read_spool
from tests import fuzzing

pytestmark = pytest.mark.fuzz

RECORDS = [(f"ep-{i}".encode() if i % 3 else None, bytes([i]) * (5 + 7 * i),
            [("trajpipe-schema", b"step"), ("trajpipe-schema-version", b"2")]) for i in range(6)]


def _frame(payload: bytes, *, length: int | None = None, crc: int | None = None) -> bytes:
    return struct.pack(">II", len(payload) if length is None else length,
                       zlib.crc32(payload) if crc is None else crc) + payload


FRAMES = [_frame(msgspec.msgpack.encode(r)) for r in RECORDS]
SPOOL = SPOOL_MAGIC + b"".join(FRAMES)
#: Byte offset where frame i starts.
STARTS = [len(SPOOL_MAGIC) + sum(map(len, FRAMES[:i])) for i in range(len(FRAMES) + 1)]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("spool-fuzz")


@given(data=st.data())
def test_a_damaged_spool_gives_back_its_intact_records_and_never_trusts_a_length(data, scratch):
    fuzzing.tried("fuzz_spool")
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "length", "crc_valid_garbage"]))
    buf = bytearray(SPOOL)
    if kind == "flip":
        pos = data.draw(st.integers(0, len(buf) * 8 - 1))
        buf[pos // 8] ^= 1 << (pos % 8)
        first_bad = next(i for i in range(len(FRAMES) + 1) if i == len(FRAMES) or STARTS[i + 1] * 8 > pos)
    elif kind == "truncate":
        cut = data.draw(st.integers(0, len(buf) - 1))
        del buf[cut:]
        first_bad = next(i for i in range(len(FRAMES) + 1) if i == len(FRAMES) or STARTS[i + 1] > cut)
    elif kind == "insert":
        i = data.draw(st.integers(0, len(FRAMES)))
        buf[STARTS[i]:STARTS[i]] = data.draw(st.binary(min_size=1, max_size=12))
        first_bad = i
    elif kind == "length":  # a frame header claiming more than the file holds, up to 4 GiB
        i = data.draw(st.integers(0, len(FRAMES) - 1))
        claimed = data.draw(st.sampled_from([0xFFFFFFFF, 0x80000000, 1 << 30, len(SPOOL)]))
        buf[STARTS[i]:STARTS[i] + 4] = struct.pack(">I", claimed)
        first_bad = i
    else:  # the CRC matches, the payload is not a (key, value, headers) record
        i = data.draw(st.integers(0, len(FRAMES)))
        payload = data.draw(st.one_of(st.binary(max_size=20), st.builds(msgspec.msgpack.encode, st.one_of(
            st.integers(-(2**63), 2**63 - 1), st.text(max_size=5), st.lists(st.integers(0, 9), max_size=4),
            st.tuples(st.binary(max_size=3), st.integers(0, 9), st.lists(st.integers(0, 9), max_size=2))))))
        buf[STARTS[i]:STARTS[i]] = _frame(payload)
        first_bad = i
    magic_damaged = kind == "flip" and pos < len(SPOOL_MAGIC) * 8
    path = scratch / f"{uuid.uuid4().hex}.spool"
    path.write_bytes(bytes(buf))
    got, error = [], None
    with fuzzing.python_memory_bound(4 * len(SPOOL) + (1 << 20)):  # never the 4 GiB a length claims
        try:
            for record in read_spool(path):
                got.append(record)
        except SpoolError as err:
            error = err
        try:
            count = _scan_spool(path)[0]
        except SpoolError:
            count = None
    path.unlink()
    if magic_damaged:  # not a spool file at all: said so, nothing read
        assert got == [] and error is not None and count is None
    elif kind == "crc_valid_garbage":  # the records before it, then a typed error naming the file
        assert got == RECORDS[:first_bad] and error is not None and str(path) in str(error)
    else:  # the intact records before the damage, unchanged; the damaged tail ends the iteration
        assert got == RECORDS[:first_bad] and error is None and count == first_bad
