"""Rendezvous (highest-random-weight) hashing of a session over instances.

Design note. Every router replica must send a named session's turns to the same
prefill and decode instance without sharing memory, so that its history (and the
answer decode returned to prefill) is where the next turn looks, whichever replica
the turn lands on and across a router's restart. Each (session, instance) pair gets
a score from a fixed hash; the session goes to the instance with the highest score::

    score(s, i) = blake2b(s ␀ url(i)) as a 64-bit integer
    rank(s)     = instances by score, highest first (ties: by URL)

Every replica that knows the same instances computes the same rank. When an
instance leaves, only the sessions that ranked it first move (each to its second),
and when one joins it takes only the sessions that rank it first (about 1/n).

An instance is named by its URL, not its KV engine id: the URL is what every
replica is given (by ``--prefill``/``--decode``, or by the same DNS answer) before
any probe, and it outlives a restart of the router. The engine id is only learnt
from a probe, at different times on different replicas, and changes at each restart
of the instance, which would move the sessions of the instances that did not restart.
The hash is blake2b, not Python's `hash`, which is salted per process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def score(session_id: str, url: str) -> int:
    """The weight of instance `url` for `session_id`: the same in every process."""
    key = session_id.encode("utf-8", "surrogatepass") + b"\0" + url.encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def rank(session_id: str, items: Iterable[T], url_of: Callable[[T], str]) -> list[T]:
    """`items` by their weight for `session_id`, highest first (equal weights by URL)."""
    return sorted(items, key=lambda item: (-score(session_id, url_of(item)), url_of(item)))
