"""How an UPDATES record's buffers are stored, read from the bytes (for tests that must
see that records really are compressed, independently of the writer's setting)."""

from __future__ import annotations

import pyarrow as pa

FRAME_MAGIC = {b"\x04\x22\x4d\x18": "lz4", b"\x28\xb5\x2f\xfd": "zstd"}
"""The first bytes of an LZ4 frame and of a ZSTD frame."""


def codec_of(payload: bytes | memoryview) -> str:
    """"lz4", "zstd" or "none" for an UPDATES payload: a compressed record batch body
    starts with its first buffer's int64 uncompressed length, then that codec's frame
    (lamina.wal.record)."""
    batches = [m for m in pa.ipc.MessageReader.open_stream(pa.py_buffer(payload))
               if m.type == "record batch"]
    body = batches[0].body.to_pybytes()
    return FRAME_MAGIC.get(body[8:12], "none")
