"""Typed messages of the transfer layer.

Two families:

* `HandshakeInfo` (JSON over HTTP, ``GET /internal/kv/handshake``): what a peer
  needs to reach this instance's KV pool: engine id, NIXL agent name and
  metadata, memory description and pool layout, and what the instance serves
  (its `ModelFingerprint`).
* `ControlMessage` (msgpack, carried in NIXL notifications): a tagged union of
  small control messages. Later flows (push, pull, duplex) extend it by
  subclassing `ControlMessage` with their own ``tag``; `MessageCodec` decodes
  every subclass defined at the time it is built.

Notifications are wrapped in an `Envelope` by the transport, so the receiver
always learns the transfer id, whatever the payload, and can check the
sender's engine id the envelope names against the agent that delivered it
(`NotifRefusal` says why one did not pass).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import msgspec

from kvduplex.common.fingerprint import ModelFingerprint
from kvduplex.common.kv_layout import KVCacheLayout

HANDSHAKE_VERSION = 2
"""Bumped when `HandshakeInfo` or the envelope changes incompatibly."""


class LayoutInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """`KVCacheLayout` on the wire (same field names as ``KVCacheLayout.to_dict()``)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @classmethod
    def from_layout(cls, layout: KVCacheLayout) -> LayoutInfo:
        return cls(**dataclasses.asdict(layout))

    def to_layout(self) -> KVCacheLayout:
        """The layout; raises ValueError if the fields are not a valid layout."""
        return KVCacheLayout(**msgspec.structs.asdict(self))


class HandshakeInfo(msgspec.Struct, frozen=True):
    """Everything a peer needs to connect to this instance's KV pool.

    ``agent_metadata`` is opaque transport metadata (base64 in JSON). The
    ``engine_id`` is chosen at start-up; a different id at the same address
    means the instance restarted and every connection to it must be redone.
    """

    engine_id: str
    agent_name: str
    agent_metadata: bytes
    layout: LayoutInfo
    base_address: int
    """Address of the pool's first byte in the owner's address space."""
    mem_type: str = "DRAM"
    """DRAM (host memory) or VRAM (device memory)."""
    device_id: int = 0
    """CUDA device index for VRAM, 0 for DRAM."""
    transport: str = "nixl"
    """Which transport implementation produced this (nixl, inprocess)."""
    version: int = HANDSHAKE_VERSION
    fingerprint: ModelFingerprint | None = None
    """What the instance serves; None from a transport built without a model (transfer
    tests and benchmarks), which pairs only with another such."""


def encode_handshake(info: HandshakeInfo) -> bytes:
    return msgspec.json.encode(info)


def decode_handshake(data: bytes | str) -> HandshakeInfo:
    """Decode a handshake; raises msgspec.ValidationError/DecodeError on bad input."""
    return msgspec.json.decode(data, type=HandshakeInfo)


# --------------------------------------------------------------------------
# Notifications


class EnvelopeKind(enum.IntEnum):
    """What a notification envelope carries."""

    USER = 0
    """A caller's payload (from `send_notif` or a transfer's ``notif``)."""
    XFER_BEGIN = 1
    """Internal: a large transfer to this target began; poll fast until XFER_END."""
    XFER_END = 2
    """Internal: that transfer ended (done or failed)."""


class NotifRefusal(enum.Enum):
    """Why a received notification was refused (a metrics label)."""

    FORGED_SENDER = "forged_sender"
    """Its envelope names an engine other than the connected peer whose agent delivered it."""
    UNKNOWN_AGENT = "unknown_agent"
    """Delivered by an agent this instance never connected to (through a handshake)."""


class Envelope(msgspec.Struct, array_like=True, frozen=True):
    """What travels in one NIXL notification (msgpack array)."""

    kind: EnvelopeKind
    sender: str
    """Sender's engine id, as the sender claims it (checked against the delivering agent)."""
    xid: str | None
    payload: bytes = b""
    deadline_s: float = 0.0
    """XFER_BEGIN only: the transfer's deadline, relative to its post."""


def encode_envelope(env: Envelope) -> bytes:
    return msgspec.msgpack.encode(env)


def decode_envelope(data: bytes) -> Envelope:
    """Decode an envelope; raises msgspec.DecodeError/ValidationError on bad input."""
    return msgspec.msgpack.decode(data, type=Envelope)


class ControlMessage(msgspec.Struct, tag_field="type", frozen=True):
    """Base of the small control messages exchanged in notifications.

    Subclass with ``class MyMsg(ControlMessage, tag="my_msg", frozen=True)`` to extend the
    union; every message names the transfer it belongs to.
    """

    xid: str


def _all_subclasses(cls: type[ControlMessage]) -> list[type[ControlMessage]]:
    out: list[type[ControlMessage]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


class MessageCodec:
    """Encode and decode `ControlMessage`s (msgpack, tagged by ``type``).

    ``types`` defaults to every subclass of `ControlMessage` defined when the
    codec is built, so build it after importing the flows that extend the union.
    """

    def __init__(self, types: Sequence[type[ControlMessage]] | None = None) -> None:
        chosen = list(types) if types is not None else _all_subclasses(ControlMessage)
        if not chosen:
            raise ValueError("MessageCodec needs at least one ControlMessage subclass")
        self.types: tuple[type[ControlMessage], ...] = tuple(chosen)
        union: Any = self.types[0]
        for t in self.types[1:]:
            union = union | t
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(union)

    def encode(self, msg: ControlMessage) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes) -> ControlMessage:
        """Decode; raises msgspec.DecodeError/ValidationError on malformed or unknown input."""
        msg = self._decoder.decode(data)
        assert isinstance(msg, ControlMessage)
        return msg

    def decode_many(self, items: Iterable[bytes]) -> list[ControlMessage]:
        return [self.decode(item) for item in items]


__all__ = [
    "HANDSHAKE_VERSION",
    "ControlMessage",
    "Envelope",
    "EnvelopeKind",
    "HandshakeInfo",
    "LayoutInfo",
    "MessageCodec",
    "NotifRefusal",
    "decode_envelope",
    "decode_handshake",
    "encode_envelope",
    "encode_handshake",
]
