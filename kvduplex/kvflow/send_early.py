"""What a sender keeps of transfer ids it has no job for (engine thread, plain data).

* Early registrations: a `KVRegister` that came before its job began (decode
  admits its request before prefill's job exists). They are kept per sender,
  so that no engine displaces another's: when the job begins, each is applied
  to it, and the job's machine takes its own receiver's and refuses the rest.
* Tombstones: xids cancelled (or whose registration was dropped) before or
  while their job waited for a registration, remembered for a while so that
  a job or a registration coming later is refused. A tombstone names who it
  binds: the engines whose cancel (or dropped registration) made it, or
  anyone when this instance cancelled on its own. A job is refused only by
  its own receiver's tombstone, a registration only by its sender's: another
  cluster member cannot cancel a transfer that is not its own::

      KVCancel("x") from E1 (no job) ──► tombstone x: {E1}
      job x to E2 begins             ──► not refused (E1 is not its receiver)
      KVRegister("x") from E1        ──► refused (E1 cancelled it)
"""

from __future__ import annotations

from dataclasses import dataclass

from kvduplex.kvflow.messages import KVRegister


@dataclass(frozen=True)
class Registration:
    """A received `KVRegister`, with who sent it and when it arrived (monotonic)."""

    msg: KVRegister
    sender: str
    received_at: float


@dataclass(frozen=True)
class _Kept:
    reg: Registration
    until: float


class EarlyRegistrations:
    """Registrations that came before their job, by xid and by sender."""

    def __init__(self) -> None:
        self._by_xid: dict[str, dict[str, _Kept]] = {}

    def keep(self, reg: Registration, until: float) -> None:
        """Keep ``reg`` until ``until``; it replaces only its own sender's earlier copy."""
        self._by_xid.setdefault(reg.msg.xid, {})[reg.sender] = _Kept(reg, until)

    def take(self, xid: str, first: str | None = None) -> list[Registration]:
        """Remove and return every registration of ``xid``, ``first``'s first."""
        kept = self._by_xid.pop(xid, {})
        return sorted((k.reg for k in kept.values()), key=lambda r: r.sender != first)

    def drop(self, xid: str, sender: str | None) -> list[Registration]:
        """Remove and return ``sender``'s registration of ``xid`` (None: everyone's)."""
        if sender is None:
            return self.take(xid)
        kept = self._by_xid.get(xid)
        if kept is None or sender not in kept:
            return []
        reg = kept.pop(sender).reg
        if not kept:
            del self._by_xid[xid]
        return [reg]

    def expire(self, now: float) -> list[Registration]:
        """Remove and return the registrations kept past their time."""
        out: list[Registration] = []
        for xid in list(self._by_xid):
            kept = self._by_xid[xid]
            for sender in [s for s, k in kept.items() if now > k.until]:
                out.append(kept.pop(sender).reg)
            if not kept:
                del self._by_xid[xid]
        return out

    def __contains__(self, xid: object) -> bool:
        return xid in self._by_xid

    def __len__(self) -> int:
        """How many registrations are kept (all xids, all senders)."""
        return sum(len(kept) for kept in self._by_xid.values())


@dataclass(frozen=True)
class _Tombstone:
    until: float
    by: frozenset[str] | None
    """The engines it binds (None: anyone)."""


class Tombstones:
    """Cancelled xids, each binding the engines that cancelled it (or anyone)."""

    def __init__(self) -> None:
        self._by_xid: dict[str, _Tombstone] = {}

    def add(self, xid: str, by: str | None, until: float) -> None:
        """Remember ``xid`` as cancelled by ``by`` (None: here, binding anyone) until
        ``until``; it adds to what an earlier cancel of ``xid`` binds."""
        old = self._by_xid.get(xid)
        binds: frozenset[str] | None = None if by is None else frozenset({by})
        if old is not None:
            until = max(until, old.until)
            binds = None if old.by is None or binds is None else old.by | binds
        self._by_xid[xid] = _Tombstone(until, binds)

    def refuses(self, xid: str, engine_id: str) -> bool:
        """Whether a job to ``engine_id``, or a registration from it, under ``xid`` is
        refused."""
        stone = self._by_xid.get(xid)
        return stone is not None and (stone.by is None or engine_id in stone.by)

    def expire(self, now: float) -> None:
        for xid in [x for x, stone in self._by_xid.items() if now > stone.until]:
            del self._by_xid[xid]

    def __contains__(self, xid: object) -> bool:
        return xid in self._by_xid

    def __len__(self) -> int:
        return len(self._by_xid)


__all__ = ["EarlyRegistrations", "Registration", "Tombstones"]
