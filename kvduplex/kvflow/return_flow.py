"""The duplex return's facade: its decode half and its prefill half side by side.

What the routes call; they only parse bodies::

    router ──► D  POST /v1/... kv_transfer_params {session_id, return_to}
                  ─► ReturnDecodeSide.prepare(request, target)   (before the engine has it)
    D: the turn finishes; at the next step, after its answer went out:
       ReturnOfferer ── KVOffer{session, keys, token ids} ──────────────► P
                                  ReturnAcceptor: keys checked, the blocks it lacks
                                  allocated (or KVDecline)
       D ◄── KVRegister{dst blocks} ─────────────────────────────────────
       one WRITE of every layer ─────────────────────────────────────────► P's blocks
       KVDone ───────────────────────────────────────────────────────────► P: into its
                                                                   prefix cache
    GET D /internal/kv/return/stats, /records ─► ReturnDecodeSide.stats(), .records()
    GET P /internal/kv/return/stats ─► ReturnPrefillSide.stats()

The machinery is `returns.ReturnOfferer` (decode: offer, WRITE through the
`KVSender`, end) and `returns.ReturnAcceptor` (prefill: accept or decline,
allocate, insert on landing, through the `KVReceiver`); both live on the
engine thread, driven by the request's finish and the flow inbox, so nothing
here waits for them: the decode half only names where a request's turn goes
before the request reaches the engine, and both halves read their counters.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from dataclasses import replace

from kvduplex.common.config import ReturnMode
from kvduplex.engine.request import Request
from kvduplex.kvflow.return_pull import RetainSpec
from kvduplex.kvflow.return_pull import TurnRetainer
from kvduplex.kvflow.returns import ReturnAcceptor
from kvduplex.kvflow.returns import ReturnOfferer
from kvduplex.kvflow.returns import ReturnSpec
from kvduplex.kvflow.returns import ReturnStats
from kvduplex.transport.protocol import PeerHandle

logger = logging.getLogger(__name__)

GetPeer = Callable[[str, str | None], PeerHandle]
"""``get_peer(url, engine_id)``: the peer at ``url``, connecting on first use (blocking);
raises when it cannot be reached or serves another model."""


@dataclass(frozen=True)
class ReturnTarget:
    """Where a decode request's finished turn goes, as the router named it."""

    session_id: str
    mode: ReturnMode
    """PUSH: offered to ``url`` (the duplex return); PULL: kept held for the next turn's
    READ (`return_pull`, the comparison); NONE: kept nowhere."""
    url: str | None = None
    """PUSH: the prefill instance that receives the turn's blocks."""
    engine_id: str | None = None
    """``url``'s KV engine id, if the caller knows it (a connection to another engine there
    is replaced; None: the address is asked, at most every ``--peer-recheck-s``)."""
    from_block: int | None = None
    """First block to offer (None: the first that is not wholly prompt)."""
    max_tokens: int | None = None
    """The offer covers at most this many of the turn's tokens, in whole blocks (None: every
    full block decode computed)."""


class ReturnDecodeSide:
    """Decode's half: a session turn's request carries where its turn goes; once it
    finished and its answer went out, `ReturnOfferer` offers prefill the blocks it lacks,
    WRITEs those prefill registered, and ends (its references dropped)."""

    def __init__(self, offerer: ReturnOfferer, retainer: TurnRetainer, get_peer: GetPeer) -> None:
        """``get_peer``: see `GetPeer` (called off the event loop)."""
        self.offerer = offerer
        self.retainer = retainer
        self.get_peer = get_peer

    async def prepare(self, request: Request, target: ReturnTarget) -> bool:
        """Before ``request`` reaches the engine: have its finished turn returned as
        ``target`` says. Whether it will be (False: no mode, no ``url``, or no connection
        to it, logged; the next turn recomputes what it would have hit).

        Connects to ``target.url`` (a handshake, in a worker thread), then sets the
        request's ``connector_meta`` (`ReturnSpec`, or `RetainSpec` for PULL) and
        ``hold_blocks_on_finish``: its blocks outlive its finish until the offer (or
        the retainer) takes them.
        """
        if target.mode is ReturnMode.PULL:
            request.connector_meta = RetainSpec(target.session_id)
            request.hold_blocks_on_finish = True
            return True
        if target.mode is not ReturnMode.PUSH or target.url is None:
            return False
        try:
            peer = await asyncio.to_thread(self.get_peer, target.url, target.engine_id)
        except Exception as exc:  # no return this turn: the next one recomputes
            logger.warning(
                "session %s: no connection to %s (%s)", target.session_id, target.url, exc
            )
            return False
        request.connector_meta = ReturnSpec(
            target.session_id, peer, target.from_block, target.max_tokens
        )
        request.hold_blocks_on_finish = True
        return True

    def stats(self) -> ReturnStats:
        """The returns offered since start, by outcome; blocks and bytes sent (any thread:
        a copy, which the engine thread's counting does not change)."""
        return replace(self.offerer.stats)

    def num_retained(self) -> int:
        """Turns held for the next turn's READ (``--return-mode pull``; any thread)."""
        return self.retainer.num_retained()

    def records(self) -> dict[str, dict[str, int | str]]:
        """The recent returns by request id: blocks offered and sent, bytes, outcome (any
        thread: a snapshot)."""
        return self.offerer.records()


class ReturnPrefillSide:
    """Prefill's half: `ReturnAcceptor` answers each offer on the engine thread (keys
    checked against the tokens, the leading blocks its cache holds skipped, the rest
    allocated, or declined with a reason), and inserts the blocks into the prefix cache
    once decode's KVDone says they landed whole."""

    def __init__(self, acceptor: ReturnAcceptor) -> None:
        self.acceptor = acceptor

    def stats(self) -> ReturnStats:
        """Offers accepted and refused, blocks inserted (any thread: a copy, which the
        engine thread's counting does not change)."""
        return replace(self.acceptor.stats)


__all__ = ["GetPeer", "ReturnDecodeSide", "ReturnPrefillSide", "ReturnTarget"]
