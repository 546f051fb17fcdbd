"""Control messages of the KV flows, carried in NIXL notifications.

One sender and one receiver serve every flow, whichever instance plays which
part (push: prefill sends, decode receives; return: decode sends, prefill
receives)::

    receiver ── KVRegister{dst blocks} ──► sender        (push: D→P; return: P→D)
             ◄── KVRegistered ──────────          (re-sent every third of the wait until then)
             ◄── KVFailed ──────────────          (refused: nothing was or will be written)
    receiver ── KVWaiting ──────────────► sender         (not registered yet, still coming)
    sender ──── WRITE ... ─────────────► receiver's blocks
    sender ──── KVAlive ───────────────► receiver ── KVAliveAck ──► sender
    sender ──── KVDone / KVFailed ─────► receiver
    receiver ── KVCancel ──────────────► sender          (stopped waiting)
    sender ──── KVOffer{keys, tokens} ─► receiver        (return only: what could be sent)

Every registration names the token ids it is for (`ids_digest`): the sender refuses
one whose ids are not those of the KV it holds or computes, so that KV never lands
under another prompt's prefix-cache keys when two prompts have the same length.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from kvduplex.common.sampling import TokenLogprobs
from kvduplex.transport.messages import ControlMessage

IDS_DIGEST_BYTES = 16


def ids_digest(ids: Sequence[int]) -> bytes:
    """A digest of token ids, equal on every instance for equal ids: blake2b (16 bytes)
    over the ids as little-endian int32 (one pass over one buffer, in C). The prefix
    cache's block keys would not do: they cover only full blocks, and a prompt rarely
    ends on a block boundary."""
    buf = array("i", ids)
    if sys.byteorder == "big":
        buf.byteswap()
    return hashlib.blake2b(buf.tobytes(), digest_size=IDS_DIGEST_BYTES).digest()


class KVRegister(ControlMessage, tag="kv_register", frozen=True):
    """The receiver's destination blocks for blocks ``first_block ..`` of transfer ``xid``."""

    block_ids: list[int]
    first_block: int
    """Blocks before this one the receiver already has (its prefix cache)."""
    num_tokens: int
    """Tokens the transfer covers, as the receiver counts them (a check)."""
    wait_s: float
    """The receiver's wait: how long it waits without hearing from the sender (each
    `KVAlive` restarts it)."""
    time_left_s: float
    """What was left of the receiver's current wait when it sent this (``wait_s`` the
    first time, less when re-sent). A duration, never a clock: the sender counts it
    from when it received the registration, on its own clock, and writes nothing after."""
    ids_digest: bytes
    """`ids_digest` of the token ids the transfer covers, as the receiver has them (push:
    its prompt; return: the offer's tokens): the sender refuses a registration whose
    ids are not its own."""


class KVRegistered(ControlMessage, tag="kv_registered", frozen=True):
    """The sender holds the registration of ``xid``: the receiver stops re-sending it.

    Sent for every copy the sender receives (a duplicate is answered again)."""


class KVWaiting(ControlMessage, tag="kv_waiting", frozen=True):
    """The receiver will register ``xid`` but cannot yet (queued): keep the job."""


class KVAlive(ControlMessage, tag="kv_alive", frozen=True):
    """The sender still holds transfer ``xid`` and its engine runs: restart the wait."""

    sent_at: float = 0.0
    """The sender's `time.monotonic()` when it sent this (echoed by `KVAliveAck`)."""


class KVAliveAck(ControlMessage, tag="kv_alive_ack", frozen=True):
    """The receiver restarted its wait for ``xid`` on the `KVAlive` sent at ``sent_at``."""

    sent_at: float


class KVCancel(ControlMessage, tag="kv_cancel", frozen=True):
    """The receiver stopped waiting for ``xid``; the sender stops and confirms with KVFailed."""

    reason: str = ""


class KVDone(ControlMessage, tag="kv_done", frozen=True):
    """The sender finished writing the KV of transfer ``xid``."""

    num_tokens: int = 0
    """Tokens whose KV the transfer carried."""
    first_token: int | None = None
    """First sampled token, when the sender is a prefill instance."""
    num_cached_tokens: int = 0
    """Prompt tokens the sender served from its prefix cache (it computed the rest)."""
    first_token_logprobs: TokenLogprobs | None = None
    """The first token's logprobs, when the request asked for them: the receiver never
    sees the logits they come from."""


class KVFailed(ControlMessage, tag="kv_failed", frozen=True):
    """The sender gave up on transfer ``xid``; the receiver should fall back. Nothing
    of the transfer can land any more."""

    reason: str = ""
    first_token: int | None = None
    """A push's first token, if the prefill sampled it (the client may have it): the
    receiver's own prefill continues from it."""


class KVOffer(ControlMessage, tag="kv_offer", frozen=True):
    """Return: full blocks the sender holds, for the receiver's prefix cache.

    Block ``i`` of the offer holds ``token_ids[i*block_size : (i+1)*block_size]``;
    its prefix-cache key is ``keys[i]``, chained from ``parent_key`` (None: the
    offer starts at the sequence's first block). The receiver recomputes the keys
    from the tokens and declines an offer whose keys do not match.
    """

    session_id: str
    keys: list[bytes]
    token_ids: list[int]
    parent_key: bytes | None = None


class KVDecline(ControlMessage, tag="kv_decline", frozen=True):
    """Return: the receiver takes nothing of offer ``xid`` (it has it all, or no room)."""

    reason: str = ""
    num_held: int = 0
    """Offered blocks the receiver already had."""


__all__ = [
    "IDS_DIGEST_BYTES",
    "KVAlive",
    "KVAliveAck",
    "KVCancel",
    "KVDecline",
    "KVDone",
    "KVFailed",
    "KVOffer",
    "KVRegister",
    "KVRegistered",
    "KVWaiting",
    "ids_digest",
]
