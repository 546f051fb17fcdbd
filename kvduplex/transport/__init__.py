"""KV transfer between instances: the `Transport` interface, its NIXL and in-process
implementations, the handshake, typed control messages and metrics.

This package's ``__all__`` is the public surface; the submodules do not restate it.

Import `kvduplex.transport.nixl` only where NIXL is installed.
"""

from __future__ import annotations

from kvduplex.transport.base import Transport
from kvduplex.transport.messages import ControlMessage
from kvduplex.transport.messages import HandshakeInfo
from kvduplex.transport.messages import MessageCodec
from kvduplex.transport.protocol import ALL_KINDS
from kvduplex.transport.protocol import FailureKind
from kvduplex.transport.protocol import IncompatibleLayoutError
from kvduplex.transport.protocol import Notification
from kvduplex.transport.protocol import PeerHandle
from kvduplex.transport.protocol import PeerUnavailableError
from kvduplex.transport.protocol import Region
from kvduplex.transport.protocol import TransferError
from kvduplex.transport.protocol import TransferFailed
from kvduplex.transport.protocol import TransferHandle
from kvduplex.transport.protocol import TransferOp
from kvduplex.transport.protocol import TransferState
from kvduplex.transport.regions import block_region_indices
from kvduplex.transport.regions import region_indices

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
