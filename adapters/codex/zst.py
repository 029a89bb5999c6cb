"""Codex's compressed rollouts (`rollout-*.jsonl.zst`, 0.146+), decompressed as a stream.

Such a file is the agent's to write (SPEC §11), so it may be a decompression bomb: what it
gives is read 64 KiB at a time and stops at the plain rollout's cap (`ROLLOUT_FILE_LIMIT`
bytes decompressed), and the decoder's window is capped, so neither its output nor its
memory grows with what the frame header asks for. A stream the decoder refuses raises
`Undecodable`; a cut last frame gives what it holds, as a torn plain rollout does.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Iterator
from typing import Any

import zstandard

from trialledger.adapters.sandbox.agentfiles import ROLLOUT_FILE_LIMIT, UnsafeAgentFile

CHUNK = 65536
# zstd's own default ceiling (128 MiB), stated so the decoder's memory is bounded here and
# not by whichever version is installed; Codex's level never asks for more than 8 MiB.
MAX_WINDOW = 1 << 27


class Undecodable(UnsafeAgentFile):
    """A compressed rollout the decoder refused (its path and the decoder's reason)."""


class _Chunks(io.RawIOBase):
    """An iterator of byte chunks as the readable stream the decoder takes."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        super().__init__()
        self._chunks, self._rest = iter(chunks), b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not self._rest:
            self._rest = next(self._chunks, b"")
        view = memoryview(buffer).cast("B")
        size = min(len(view), len(self._rest))
        view[:size] = self._rest[:size]
        self._rest = self._rest[size:]
        return size


def decompressed(chunks: Iterable[bytes], path: str, *, limit: int = ROLLOUT_FILE_LIMIT
                 ) -> Iterator[bytes]:
    """The decompressed bytes of a zstd stream (every frame), at most `CHUNK` at a time;
    `UnsafeAgentFile` past `limit` bytes, `Undecodable` when the decoder refuses it."""
    decoder = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
    reader = decoder.stream_reader(io.BufferedReader(_Chunks(chunks), CHUNK),
                                   read_size=CHUNK, read_across_frames=True)
    total = 0
    while True:
        try:
            piece = reader.read(CHUNK)
        except zstandard.ZstdError as error:
            raise Undecodable(path, f"not a zstd stream that can be decoded ({error})") from None
        if not piece:
            return
        total += len(piece)
        if total > limit:
            raise UnsafeAgentFile(path, f"decompresses to over the {limit}-byte cap")
        yield piece
