"""KV transfer between instances: the transport Protocol, its NIXL and in-process
implementations, the handshake, typed control messages and metrics.

Import `kvduplex.transport.nixl` only where NIXL is installed.
"""

from __future__ import annotations

from kvduplex.transport.base import block_region_indices, region_indices
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
    Transport,
)

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
