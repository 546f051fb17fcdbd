"""KV transfer between instances: the `Transport` interface, its NIXL and in-process
implementations, the handshake, typed control messages and metrics.

This package's ``__all__`` is the public surface; the submodules do not restate it.

Import `kvduplex.transport.nixl` only where NIXL is installed.
"""

from __future__ import annotations

from kvduplex.transport.base import Transport
from kvduplex.transport.messages import (
    ControlMessage,
    HandshakeInfo,
    MessageCodec,
)
from kvduplex.transport.protocol import (
    ALL_KINDS,
    FailureKind,
    IncompatibleLayoutError,
    Notification,
    PeerHandle,
    PeerUnavailableError,
    Region,
    TransferError,
    TransferFailed,
    TransferHandle,
    TransferOp,
    TransferState,
)
from kvduplex.transport.regions import block_region_indices, region_indices

__all__ = [
    "ALL_KINDS",
    "ControlMessage",
    "FailureKind",
    "HandshakeInfo",
    "IncompatibleLayoutError",
    "MessageCodec",
    "Notification",
    "PeerHandle",
    "PeerUnavailableError",
    "Region",
    "TransferError",
    "TransferFailed",
    "TransferHandle",
    "TransferOp",
    "TransferState",
    "Transport",
    "block_region_indices",
    "region_indices",
]
