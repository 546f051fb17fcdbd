"""The KV tier of CPU instances: one preallocated file of fixed-size slots
(`kvduplex.engine.kv_tier` has the slot format, the index and the writer thread).

Blocks are copied out of the pool into a few staging buffers on the engine thread,
then written with ``pwritev`` by the writer thread; loads read a slot with
``preadv`` (a whole slot, or one layer of its payload straight into the pool, for a
layer-wise load). The page cache does the rest: recently written slots are read from
memory, older ones from the device.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import torch

from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.engine.kv_tier import Bytes
from kvduplex.engine.kv_tier import SlotTier
from kvduplex.engine.kv_tier import settle
from kvduplex.engine.kv_tier_format import HEADER_BYTES
from kvduplex.engine.kv_tier_format import HEADER_FIELDS_BYTES

_STAGING_BUFFERS = 8
"""Blocks copied out of the pool and not yet written, at most (the engine thread waits
for the oldest write beyond this)."""


class FileTier(SlotTier):
    """Slots in one file, preallocated in `directory` and unlinked at once (it never
    outlives the process, and no two processes share one). Written with ``pwritev`` from a
    few staging buffers, read with ``preadv``; the page cache does the rest."""

    ALIGN = 4096

    def __init__(
        self, layout: KVCacheLayout, identity: bytes, num_slots: int, directory: str = ""
    ) -> None:
        super().__init__(layout, identity, num_slots)
        directory = directory or tempfile.gettempdir()
        # Open for the tier's life, closed by `close`.
        self._file = tempfile.TemporaryFile(dir=directory, prefix="kvduplex-kv-tier-")  # noqa: SIM115
        self._fd = self._file.fileno()
        size = num_slots * self.slot_bytes
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            self._file.close()
            raise OSError(
                exc.errno,
                f"cannot reserve {size / 2**30:.2f} GiB for the KV tier in {directory} "
                f"({exc.strerror}); lower kv_tier_gib or pick another kv_tier_path",
            ) from exc
        self.directory = directory
        self._buffers = [
            torch.empty(self.payload_bytes, dtype=torch.uint8) for _ in range(_STAGING_BUFFERS)
        ]
        self._buffer_writes: list[Future[None] | None] = [None] * _STAGING_BUFFERS
        self._next_buffer = 0
        self._read_buffer = torch.empty(HEADER_BYTES + self.payload_bytes, dtype=torch.uint8)

    def fileno(self) -> int:
        """The tier file's descriptor (inspection and fault tests)."""
        return self._fd

    def _staging(self, slot: int) -> torch.Tensor:
        write = self._buffer_writes[self._next_buffer]
        if write is not None:
            settle(write)
        return self._buffers[self._next_buffer]

    def _staged(self, write: Future[Any]) -> None:
        self._buffer_writes[self._next_buffer] = write
        self._next_buffer = (self._next_buffer + 1) % _STAGING_BUFFERS

    def _persist(self, slot: int, header: bytes, payload: torch.Tensor) -> None:
        offset = slot * self.slot_bytes
        padded = header.ljust(HEADER_BYTES, b"\0")
        _write_all(self._fd, [memoryview(padded), payload.numpy().data], offset)

    def _read(self, slot: int) -> tuple[bytes, torch.Tensor]:
        buffer = self._read_buffer
        num_read = os.preadv(self._fd, [buffer.numpy().data], slot * self.slot_bytes)
        header = buffer[: min(num_read, HEADER_FIELDS_BYTES)].numpy().tobytes()
        return header, buffer[HEADER_BYTES : max(num_read, HEADER_BYTES)]

    def _read_header(self, slot: int) -> bytes:
        return os.pread(self._fd, HEADER_FIELDS_BYTES, slot * self.slot_bytes)

    def _read_layer(self, slot: int, layer: int, parts: Sequence[Bytes]) -> int:
        offset = slot * self.slot_bytes + HEADER_BYTES + layer * self.layer_bytes
        return os.preadv(self._fd, [part.data for part in parts], offset)

    def _release(self) -> None:
        self._file.close()


def _write_all(fd: int, parts: list[memoryview], offset: int) -> None:
    """``pwritev`` until every byte of `parts` is written at `offset`."""
    while parts:
        num_written = os.pwritev(fd, parts, offset)
        if num_written == 0:
            raise OSError(f"the KV tier file took no bytes at offset {offset}")
        offset += num_written
        while parts and num_written >= len(parts[0]):
            num_written -= len(parts[0])
            parts = parts[1:]
        if parts and num_written:
            parts = [parts[0][num_written:], *parts[1:]]


__all__ = ["FileTier"]
