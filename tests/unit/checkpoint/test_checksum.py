"""The checksum's hashing beside the I/O gives the checksum of exactly the bytes written or read."""

import io
import os
import signal

import pytest

from lightning_zeroq.checkpoint import checksum

pytestmark = pytest.mark.skipif(checksum.xxhash is None, reason="needs xxhash")


def _reference(data: bytes) -> str:
    h = checksum.hasher("xxh3_64")
    h.update(data)
    return h.hexdigest()


def _pieces() -> list[bytes]:
    big = checksum.OVERLAP_BYTES
    return [os.urandom(n) for n in (7, big + 13, 100, 2 * big, 1, big - 1)]


def test_a_writer_hashes_small_and_large_writes_in_order():
    pieces = _pieces()
    sink = io.BytesIO()
    out = checksum.HashingWriter(sink, "xxh3_64")
    for piece in pieces:
        assert out.write(piece) == len(piece)
    whole = b"".join(pieces)
    assert sink.getvalue() == whole
    assert out.hexdigest() == _reference(whole)
    assert out.hexdigest() != _reference(whole[:-1] + bytes([whole[-1] ^ 1]))


def test_a_failed_write_still_waits_for_its_hash_and_raises():
    class Full(io.RawIOBase):
        def write(self, data):
            raise OSError(28, "No space left on device")

    out = checksum.HashingWriter(Full(), "xxh3_64")
    with pytest.raises(OSError, match="No space"):
        out.write(bytes(checksum.OVERLAP_BYTES))


@pytest.mark.parametrize("size", [0, 5, checksum.OVERLAP_BYTES + 3, 2 * checksum.READ_CHUNK + 17])
def test_a_chunked_read_hashes_what_it_read(monkeypatch, size):
    monkeypatch.setattr(checksum, "READ_CHUNK", max(checksum.OVERLAP_BYTES, 1 << 22))
    data = os.urandom(size)
    calls = []

    def read_into(at: int, view: memoryview) -> int:
        calls.append((at, len(view)))
        n = min(len(view), len(data) - at)
        view[:n] = data[at:at + n]
        return n

    buffer = memoryview(bytearray(size))
    n, got = checksum.read_hashed(read_into, buffer, "xxh3_64")
    assert n == size and bytes(buffer) == data and got == _reference(data)
    if size > checksum.READ_CHUNK:
        assert len(calls) > 1  # really in chunks


def test_a_short_read_is_hashed_as_far_as_it_went():
    data = os.urandom(checksum.OVERLAP_BYTES * 3)
    half = len(data) // 2

    def read_into(at: int, view: memoryview) -> int:
        n = max(0, min(len(view), half - at))
        view[:n] = data[at:at + n]
        return n

    n, got = checksum.read_hashed(read_into, memoryview(bytearray(len(data))), "xxh3_64")
    assert n == half and got == _reference(data[:half])


def test_a_forked_child_hashes_on_its_own_thread():
    checksum.HashingWriter(io.BytesIO(), "xxh3_64").write(bytes(checksum.OVERLAP_BYTES))  # parent's thread exists
    pid = os.fork()
    if pid == 0:  # child: the parent's checksum thread does not exist here; this must not hang
        signal.alarm(30)  # a hang ends the child with SIGALRM, and the test fails
        out = checksum.HashingWriter(io.BytesIO(), "xxh3_64")
        out.write(b"x" * checksum.OVERLAP_BYTES)
        os._exit(0 if out.hexdigest() == _reference(b"x" * checksum.OVERLAP_BYTES) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
