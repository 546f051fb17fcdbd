"""What the router's routes and flows share: config, tokenizer, policy, metrics, the client
to the instances."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry

from kvduplex.common.auth import api_key_headers
from kvduplex.common.auth import resolve_api_key
from kvduplex.common.config import Environment
from kvduplex.common.drain import DrainState
from kvduplex.common.guard import load_cluster_secret
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.common.trust import secret_headers
from kvduplex.router.admission import Admission
from kvduplex.router.admission import TrustedClient
from kvduplex.router.client import InstanceClient
from kvduplex.router.config import RouterConfig
from kvduplex.router.discovery import Discovery
from kvduplex.router.discovery import Resolve
from kvduplex.router.metrics import RouterMetrics
from kvduplex.router.policy import RoutingPolicy
from kvduplex.router.wire import WirePool

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0
"""A POST's whole answer's deadline: a last resort, as a call ends sooner when its
instance is marked unhealthy (`calls.py`)."""


@dataclass
class RouterState:
    config: RouterConfig
    """The router's flags (mode, return mode, short appends, health, limits)."""
    tokenizer: Tokenizer
    """The served model's tokenizer and chat template (see `load_tokenizer`)."""
    policy: RoutingPolicy
    registry: CollectorRegistry
    metrics: RouterMetrics
    client: InstanceClient
    """To the instances (`client.InstanceClient`): the flows' calls send the cluster secret
    and the API key, with a secret only to instances that proved it (`admission`); the
    health probes (``--health-timeout-s``) send neither."""
    prompts: ThreadPoolExecutor
    """Where prompts are built (``--prompt-threads``; `routing.build_prompt`): rendering and
    tokenizing hold a thread for milliseconds (a long conversation: tens), which the
    event loop does not wait on. Shut down with the app."""
    api_key: str | None = None
    """What clients must send on /v1/* (see `kvduplex.common.auth`); None: open."""
    num_probe_rounds: int = 0
    """Health probe rounds done; the router is not ready before the first."""
    drain: DrainState = field(default_factory=DrainState)
    """The drain on SIGTERM (`kvduplex.common.drain`): requests in flight, whether it drains."""
    discovery: Discovery | None = None
    """Instances by DNS (``--prefill-dns``, ``--decode-dns``); None: URLs only."""
    admission: Admission | None = None
    """Which instances proved the cluster secret (`admission.Admission`); None: no
    checks (a state built without `create`)."""

    async def aclose(self) -> None:
        """Close the clients to the instances (their idle connections)."""
        self.client.close()
        if self.admission is not None and self.admission.client is not self.client:
            self.admission.close()

    def note_probe_round(self) -> None:
        self.num_probe_rounds += 1

    def unready_reason(self) -> str | None:
        """Why the router cannot serve now (its /ready answers 503), or None."""
        if self.drain.is_draining:
            return "draining: shutting down"
        if self.num_probe_rounds == 0:
            return "the instances have not been probed yet"
        if self.discovery is not None and self.discovery.num_rounds == 0:
            return "the instances' DNS names have not been resolved yet"
        if not self.policy.decode.healthy():
            return "no healthy decode instance"
        has_prefill = self.policy.prefill.backends or self.config.prefill_dns
        if has_prefill and not self.policy.prefill.healthy():
            return "no healthy prefill instance"
        return None

    @classmethod
    def create(
        cls,
        config: RouterConfig,
        tokenizer: Tokenizer,
        *,
        make_client: Callable[[dict[str, str]], InstanceClient] | None = None,
        clock: Callable[[], float] = time.monotonic,
        resolve: Resolve | None = None,
    ) -> RouterState:
        """`make_client` replaces the network (tests): it makes the client to the instances
        from the headers every call with credentials sends (with a cluster secret, once
        more with none: the client of the proofs, `admission`); `clock` replaces the
        policy's and the admission's clock; `resolve` DNS (tests). With a secret, the
        instances given by URL get no work before the prober has their proof."""
        policy = RoutingPolicy.from_config(config, clock)
        registry = CollectorRegistry()
        env = Environment.read()
        api_key = resolve_api_key(config.api_key, env.api_key)
        secret = load_cluster_secret(config.cluster_secret_file, env.cluster_secret)
        headers = {**secret_headers(secret), **api_key_headers(api_key)}
        if make_client is None:
            make_client = partial(
                WirePool, connect_timeout_s=CONNECT_TIMEOUT_S, read_timeout_s=READ_TIMEOUT_S
            )
        client = make_client(headers)
        metrics = RouterMetrics(registry, policy)
        admission = Admission(
            secret, client if secret is None else make_client({}), config.health_timeout_s,
            metrics.instance_refusals, clock,
        )  # fmt: skip
        if secret is not None:
            client = TrustedClient(client, admission)
            for b in (*policy.prefill.backends, *policy.decode.backends):
                b.is_healthy = False  # no work before its proof (the prober asks for it)
        prompts = ThreadPoolExecutor(config.prompt_threads, thread_name_prefix="kvduplex-prompt")
        return cls(
            config, tokenizer, policy, registry, metrics, client, prompts, api_key,
            drain=DrainState(timeout_s=config.drain_timeout_s),
            discovery=Discovery.try_from_config(
                config, policy, client, config.health_timeout_s, resolve, admission
            ),
            admission=admission,
        )  # fmt: skip


def json_body(body: dict[str, Any]) -> bytes:
    """`body` as a call's JSON (lone surrogates, valid in a request a client sent, escaped
    as `json.dumps` writes them)."""
    return json.dumps(body).encode()
