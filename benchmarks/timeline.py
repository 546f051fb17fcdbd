"""Where a relayed request's first event spent its time (`bench_router_capacity.py
--timeline`).

Each request names itself in ``user``, a field every relay passes on to D as the client
sent it. The load client notes when it sent a request and when its first event came; the
stub notes when P and D read it, when P answered and when D wrote its first event. P
learns the name as each relay tells P of the request: the push router's prefill body
carries no ``user`` but the transfer id (``xid``) that D's ``kv_transfer_params`` names
too; the reference routers send P the client's body (the floors send P a body of their
own, which names no request: they have no P stages). All times are this process's clock
(the stub and the client share it), so each stage is a difference of two readings::

    client sent ──► P read   P answered ──────────────► client's first event
               └──► D read   D wrote its first event ──► client's first event

A relay adds to "to D" what it spends before D has the request (its own server's turn,
its handler, the call), and to "D's first event to the client" what it spends after (its
client's read, the splice, its server's write); against the same stages straight to D.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from dataclasses import field
from typing import Any

STAGES = ("to_p", "p_answer_to_client", "to_d", "d_first_to_client")
"""The stages reported, each a p50 in ms over the requests that have it."""


@dataclass
class Timeline:
    """The readings of one run, by request name."""

    sent: dict[str, float] = field(default_factory=dict)
    first: dict[str, float] = field(default_factory=dict)
    p_read: dict[str, float] = field(default_factory=dict)
    p_answered: dict[str, float] = field(default_factory=dict)
    d_read: dict[str, float] = field(default_factory=dict)
    d_first: dict[str, float] = field(default_factory=dict)
    _p_by_xid: dict[str, tuple[float, float]] = field(default_factory=dict)
    _user_by_xid: dict[str, str] = field(default_factory=dict)

    def note_prefill(self, req: dict[str, Any], read_at: float, answered_at: float) -> None:
        """P read `req` at `read_at` and answered it at `answered_at`."""
        user, xid = req.get("user"), req.get("xid")
        if isinstance(user, str):
            self.p_read[user], self.p_answered[user] = read_at, answered_at
        elif isinstance(xid, str):  # the push router's prefill: named by D's request
            self._p_by_xid[xid] = (read_at, answered_at)
            self._link(xid)

    def note_decode(self, req: dict[str, Any], read_at: float, first_at: float) -> None:
        """D read `req` at `read_at` and wrote its first event at `first_at`."""
        user = req.get("user")
        if not isinstance(user, str):
            return
        self.d_read[user], self.d_first[user] = read_at, first_at
        xid = (req.get("kv_transfer_params") or {}).get("xid")
        if isinstance(xid, str):
            self._user_by_xid[xid] = user
            self._link(xid)

    def _link(self, xid: str) -> None:
        if xid in self._p_by_xid and xid in self._user_by_xid:
            user = self._user_by_xid.pop(xid)
            self.p_read[user], self.p_answered[user] = self._p_by_xid.pop(xid)

    def stages_ms(self, prefix: str) -> dict[str, float]:
        """Each stage's p50 in ms over the requests named `prefix`... (NaN: none had it)."""
        users = [u for u in self.first if u.startswith(prefix) and u in self.sent]
        pairs = {
            "to_p": (self.sent, self.p_read),
            "p_answer_to_client": (self.p_answered, self.first),
            "to_d": (self.sent, self.d_read),
            "d_first_to_client": (self.d_first, self.first),
        }
        out = {}
        for stage, (start, end) in pairs.items():
            values = [end[u] - start[u] for u in users if u in start and u in end]
            out[stage] = statistics.median(values) * 1e3 if values else float("nan")
        return out
