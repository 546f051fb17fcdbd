"""KV transfer between instances: the `Transport` interface, its NIXL and in-process
implementations, the handshake, typed control messages and metrics.

This package's ``__all__`` is the public surface; the submodules do not restate it.
Its names are imported on first use (the submodules need torch), so that a torch-free
process (the router) can import a submodule such as `kvduplex.common.trust` alone.

Import `kvduplex.transport.nixl` only where NIXL is installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING
from typing import Any

if TYPE_CHECKING:
    from kvduplex.transport.base import Transport
    from kvduplex.transport.messages import ControlMessage
    from kvduplex.transport.messages import HandshakeInfo
    from kvduplex.transport.messages import MessageCodec
    from kvduplex.transport.protocol import ALL_KINDS
    from kvduplex.transport.protocol import FailureKind
    from kvduplex.transport.protocol import IncompatibleLayoutError
    from kvduplex.transport.protocol import IncompatibleModelError
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

_MODULE_OF = {
    "Transport": "kvduplex.transport.base",
    "ControlMessage": "kvduplex.transport.messages",
    "HandshakeInfo": "kvduplex.transport.messages",
    "MessageCodec": "kvduplex.transport.messages",
    "ALL_KINDS": "kvduplex.transport.protocol",
    "FailureKind": "kvduplex.transport.protocol",
    "IncompatibleLayoutError": "kvduplex.transport.protocol",
    "IncompatibleModelError": "kvduplex.transport.protocol",
    "Notification": "kvduplex.transport.protocol",
    "PeerHandle": "kvduplex.transport.protocol",
    "PeerUnavailableError": "kvduplex.transport.protocol",
    "Region": "kvduplex.transport.protocol",
    "TransferError": "kvduplex.transport.protocol",
    "TransferFailed": "kvduplex.transport.protocol",
    "TransferHandle": "kvduplex.transport.protocol",
    "TransferOp": "kvduplex.transport.protocol",
    "TransferState": "kvduplex.transport.protocol",
    "block_region_indices": "kvduplex.transport.regions",
    "region_indices": "kvduplex.transport.regions",
}
"""Where each public name is defined."""


def __getattr__(name: str) -> Any:
    """A public name, from its submodule (imported now if it was not yet)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "ALL_KINDS",
    "ControlMessage",
    "FailureKind",
    "HandshakeInfo",
    "IncompatibleLayoutError",
    "IncompatibleModelError",
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
