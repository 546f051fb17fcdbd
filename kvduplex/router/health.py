"""The router's health prober: GET /ready on every instance, every few seconds.

The router's app starts `run_prober` in its lifespan and cancels it at
shutdown. Each round probes every prefill and decode instance at once, each
probe bounded by ``--health-timeout-s``, and tells the policy how each ended
(`BackendPool.note_probe`): a 200 makes an instance healthy again (unless a
call could not reach it after the probe began); anything else (refused, a timeout, a
non-200, an answer that is not HTTP, any error the probe raises) counts as a
failure, logged with the instance, and ``--health-failures`` of them in a row make
it unhealthy, which abandons the calls in flight to it (`calls.py`). A call whose
connection failed has its instance probed at once, outside the rounds
(`BackendPool.probe_soon`): that probe counts as any other, and an instance is
probed by one probe at a time (a round skips one being probed). An instance
that answers 503 ``{"status": "draining"}`` (it got SIGTERM, `kvduplex.common.drain`)
gets no new work at once, but its calls in flight go on (``mark_failed(...,
is_down=False)``); it is back in rotation when a probe finds it ready again. An
instance without /ready (404: an older build) is probed at /health instead. A 200
also tells the instance's ``max_model_len``, which the router checks requests
against before it dispatches them; its model fingerprint's digest, by which the
policy pairs only P and D that serve the same model (`pairing`); and its KV engine
id, which the router names to its peers in each request (``decode_engine_id`` to P,
``engine_id`` and ``return_engine_id`` to D): a peer already connected to that
engine uses the connection as it is, one connected to another (the instance
restarted) handshakes afresh, and neither asks the address first. Rounds start every
``--health-interval-s``, the first at once; a round that fails unexpectedly is
logged and the next one runs at its time (the prober ends only when cancelled).

With a cluster secret, a probe first has the instance prove it
(`admission.Admission.try_admit`) when it has no proof yet (an instance given by
URL starts without one, and gets no work before it), when it was presumed down
(its proof is dropped: whoever answers at its address now may be another
process), or when its proof is old; one that does not prove it fails the probe.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

from kvduplex.router.admission import Admission
from kvduplex.router.backends import Backend
from kvduplex.router.backends import BackendPool
from kvduplex.router.client import CallError
from kvduplex.router.client import InstanceClient
from kvduplex.router.client import WholeAnswer
from kvduplex.router.policy import RoutingPolicy

logger = logging.getLogger(__name__)


async def probe(
    client: InstanceClient,
    policy: RoutingPolicy,
    pool: BackendPool,
    b: Backend,
    timeout_s: float,
    admission: Admission | None = None,
    role: str = "",
) -> None:
    """Probe `b` (a `role` instance) once, after its proof when `admission` asks for one
    (module docstring), and note the result in `pool`; logs a change of health. Nothing
    if a probe of `b` is in flight already (its result is noted as it ends)."""
    if b.is_probing:
        return
    b.is_probing = True
    started_at = policy.clock()
    was_healthy, is_unexpected = b.is_healthy, False
    try:
        if admission is not None and admission.is_active:
            await _prove(admission, b, role)
        resp = await client.get(b.url + "/ready", timeout_s)
        if resp.status_code == 404:
            resp = await client.get(b.url + "/health", timeout_s)
        is_ok, why = resp.status_code == 200, f"HTTP {resp.status_code}"
        if is_ok:
            note_health(b, resp, policy.clock())
        elif is_draining(resp):
            _note_draining(pool, b, policy.clock())
            return
    except NotProven as exc:
        is_ok, why = False, str(exc)
    except Exception as exc:  # any failure, not only the transport's, is a failed probe
        is_ok, why = False, repr(exc)
        is_unexpected = not isinstance(exc, CallError)
    finally:
        b.is_probing = False
    pool.note_probe(b, is_ok, started_at, policy.clock())
    if not is_ok and b.is_healthy:
        logger.log(
            logging.WARNING if is_unexpected else logging.INFO,
            "instance %s: /health %s (%d of %d failures in a row)",
            b.url, why, b.num_failed_probes, pool.health_failures, exc_info=is_unexpected,
        )  # fmt: skip
    if b.is_healthy != was_healthy:
        if b.is_healthy:
            logger.warning("instance %s is healthy again", b.url)
        else:
            logger.warning("instance %s is unhealthy: /health %s", b.url, why)


class NotProven(Exception):
    """The instance did not prove the cluster secret (yet): the probe fails."""


async def _prove(admission: Admission, b: Backend, role: str) -> None:
    """Have `b` prove the cluster secret if a proof is due (again, after it was down);
    raises `NotProven` if it does not."""
    if b.is_down:
        admission.distrust(b.url)
    unproven = await admission.try_admit(b.url, role)
    if unproven is not None:
        raise NotProven(unproven)


def is_draining(resp: WholeAnswer) -> bool:
    """Whether a probe's answer says the instance drains (503 ``status: draining``)."""
    if resp.status_code != 503:
        return False
    try:
        body = resp.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("status") == "draining"


def _note_draining(pool: BackendPool, b: Backend, now: float) -> None:
    """No new work for `b`; its calls in flight go on (they finish as it drains)."""
    if b.is_healthy:
        logger.warning("instance %s is draining: no new work for it", b.url)
    pool.mark_failed(b, now, is_down=False)
    b.num_failed_probes = 0


def note_health(b: Backend, resp: WholeAnswer, now: float | None = None) -> None:
    """Keep what a good probe's body says: ``max_model_len``, ``engine_id``, ``block_size``,
    its model fingerprint's digest, and its pool's clock if read at router clock time
    `now`."""
    try:
        body = resp.json()
        if now is not None:
            b.kv_clock.read(body, now)
        length, engine_id = body.get("max_model_len"), body.get("engine_id")
        block_size = body.get("block_size")
        if isinstance(block_size, int) and block_size > 0:
            b.block_size = block_size
        _note_fingerprint(b, body.get("fingerprint"))
    except (ValueError, AttributeError):
        return
    if isinstance(length, int) and length > 0:
        b.max_model_len = length
    if isinstance(engine_id, str) and engine_id != b.engine_id:
        if b.engine_id is not None:
            logger.warning("instance %s has a new KV engine id (restarted): %s", b.url, engine_id)
        b.engine_id = engine_id


def _note_fingerprint(b: Backend, shown: object) -> None:
    """Keep the digest of the fingerprint a probe showed (``fingerprint.digest``); one that
    shows none leaves it unknown. A change is logged: the instance now pairs with others."""
    digest = shown.get("digest") if isinstance(shown, dict) else None
    if not isinstance(digest, str) or not digest:
        digest = None
    if digest != b.fingerprint:
        if b.fingerprint is not None:
            logger.warning(
                "instance %s serves another model now (fingerprint %s, was %s)",
                b.url, (digest or "none")[:16], b.fingerprint[:16],
            )  # fmt: skip
        b.fingerprint = digest


async def probe_all(
    client: InstanceClient,
    policy: RoutingPolicy,
    timeout_s: float,
    admission: Admission | None = None,
) -> None:
    """One round: every instance of both roles at once, those that left DNS with calls
    still in flight included (`BackendPool.to_probe`). A probe that raises (a watcher
    that broke its contract) is logged with its instance; the others end as they would."""
    pools = ((policy.prefill, "prefill"), (policy.decode, "decode"))
    probed = [(pool, role, b) for pool, role in pools for b in pool.to_probe()]
    results = await asyncio.gather(
        *(probe(client, policy, pool, b, timeout_s, admission, role) for pool, role, b in probed),
        return_exceptions=True,
    )
    for (_, _, b), result in zip(probed, results, strict=True):
        if isinstance(result, Exception):
            logger.error("instance %s: its probe failed", b.url, exc_info=result)


async def run_prober(
    client: InstanceClient,
    policy: RoutingPolicy,
    interval_s: float,
    timeout_s: float,
    on_round: Callable[[], None] | None = None,
    admission: Admission | None = None,
) -> None:
    """Probe rounds every `interval_s` (the first at once) until cancelled; `on_round`
    is called after each; `admission`: the proofs of the cluster secret (module
    docstring). A round that fails unexpectedly is logged (without its `on_round`), and
    the next one runs at its time: the prober ends only when cancelled. Meanwhile an
    instance a call to failed is probed at once (`BackendPool.probe_soon`)."""
    loop = asyncio.get_running_loop()
    soon: dict[int, asyncio.Task[None]] = {}
    """The probes made outside the rounds, by backend (`id`): one at a time each."""

    def probe_soon(pool: BackendPool, role: str, b: Backend) -> None:
        key = id(b)
        if not b.is_probing and key not in soon:
            task = loop.create_task(
                _probe_logged(client, policy, pool, b, timeout_s, admission, role)
            )
            soon[key] = task
            task.add_done_callback(lambda _: soon.pop(key, None))

    pools = ((policy.prefill, "prefill"), (policy.decode, "decode"))
    before = [pool.probe_soon for pool, _ in pools]
    for pool, role in pools:
        pool.probe_soon = functools.partial(probe_soon, pool, role)
    try:
        while True:
            started = loop.time()
            try:
                await probe_all(client, policy, timeout_s, admission)
                if on_round is not None:
                    on_round()
            except Exception:
                logger.exception("health probe round failed; the next one runs as planned")
            await asyncio.sleep(max(0.0, interval_s - (loop.time() - started)))
    finally:
        for (pool, _), probe_soon_before in zip(pools, before, strict=True):
            pool.probe_soon = probe_soon_before
        for task in list(soon.values()):
            task.cancel()


async def _probe_logged(
    client: InstanceClient, policy: RoutingPolicy, pool: BackendPool, b: Backend,
    timeout_s: float, admission: Admission | None, role: str,
) -> None:  # fmt: skip
    """`probe`, outside a round: one that raises (a watcher that broke its contract) is
    logged with its instance."""
    try:
        await probe(client, policy, pool, b, timeout_s, admission, role)
    except Exception:
        logger.exception("instance %s: its probe failed", b.url)
