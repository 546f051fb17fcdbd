"""Which instances serve the same model, as the router sees it from their probes.

Each instance's ``/health`` shows its model fingerprint (`kvduplex.common.fingerprint`);
the prober keeps its digest (`Backend.fingerprint`). The policy pairs a prefill and a
decode instance only when their digests are equal (`policy.pairs_with`): KV computed by
one is correct on the other only then, and their KV handshake refuses any other pair
anyway, at the cost of a failed prefill call per request. A decode instance that no
healthy prefill instance pairs with gets requests only while no decode instance pairs
with a healthy prefill instance, and serves them alone (it computes each prompt
itself); this module says which instances are unpaired, for the router's ``/health``
(`fingerprint_summary`) and its metrics (`unpaired`).
"""

from __future__ import annotations

from typing import Any

from kvduplex.router.backends import Backend
from kvduplex.router.backends import BackendPool
from kvduplex.router.policy import RoutingPolicy

ROLES = ("prefill", "decode")


def _pools(policy: RoutingPolicy) -> dict[str, tuple[BackendPool, BackendPool]]:
    """Each role's pool and the pool of the role it pairs with."""
    return {"prefill": (policy.prefill, policy.decode), "decode": (policy.decode, policy.prefill)}


def unpaired(policy: RoutingPolicy, role: str) -> list[Backend]:
    """The healthy instances of `role` that no healthy instance of the other role pairs
    with, while the other role has healthy instances (a cluster without prefill
    instances leaves no decode instance unpaired: decode-alone is its design there)."""
    own, other = _pools(policy)[role]
    if not other.healthy():
        return []
    return [b for b in own.healthy() if not other.healthy([b])]


def fingerprint_summary(policy: RoutingPolicy) -> dict[str, Any]:
    """The router's ``/health`` view of pairing: ``groups``, the instances by fingerprint
    digest (``{digest, prefill: [url], decode: [url]}``, largest first); ``unknown``,
    instances whose fingerprint no probe has shown yet (they pair with any); ``unpaired``,
    healthy instances that no healthy instance of the other role pairs with."""
    groups: dict[str, dict[str, list[str]]] = {}
    unknown: list[dict[str, str]] = []
    for role in ROLES:
        for b in _pools(policy)[role][0].backends:
            if b.fingerprint is None:
                unknown.append({"url": b.url, "role": role})
            else:
                group = groups.setdefault(b.fingerprint, {"prefill": [], "decode": []})
                group[role].append(b.url)
    ordered = sorted(groups.items(), key=lambda kv: (-sum(map(len, kv[1].values())), kv[0]))
    return {
        "groups": [{"digest": digest, **members} for digest, members in ordered],
        "unknown": unknown,
        "unpaired": [
            {"url": b.url, "role": role} for role in ROLES for b in unpaired(policy, role)
        ],
    }


__all__ = ["ROLES", "fingerprint_summary", "unpaired"]
