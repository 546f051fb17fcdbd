"""Serialised access to one NIXL agent (UCX backend, no NIXL progress thread).

NIXL without its progress thread and with the default sync mode runs the UCX
worker in serialised mode: calls from several threads are fine as long as they
never overlap. `NixlAgent` guarantees that with one lock around every call, and
gives the rest of the transport a small typed surface instead of NIXL's
string states.

UCX memory hooks. With UCX's mmap hooks on (its default), every small
notification an agent sends may keep about 330 bytes of the sender's memory
for good (UCX 1.23 as NIXL's wheel bundles it; docs/reliability.md): an
instance that sends one or more per request grows without bound under load. `_import_nixl` therefore sets ``UCX_MEM_MMAP_HOOK_MODE=none`` unless the
environment names a mode; UCX reads it when its libraries load, so only before
NIXL is first imported. The pool is registered once and stays mapped until it
is deregistered, so nothing of ours needs UCX to see memory being unmapped.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)


UCX_HOOK_MODE_VAR = "UCX_MEM_MMAP_HOOK_MODE"
_NIXL_MODULES = ("nixl_cu12", "nixl._api")


def _import_nixl() -> Any:
    """The NIXL Python API module: the nixl-cu12 wheel's, else a source build's.

    Sets ``UCX_MEM_MMAP_HOOK_MODE=none`` first unless the environment names a mode
    (see the module docstring); warns if NIXL was imported before without it."""
    if UCX_HOOK_MODE_VAR not in os.environ:
        if any(sys.modules.get(m) is not None for m in _NIXL_MODULES):
            logger.warning(
                "NIXL was imported before kvduplex could set %s=none: each notification "
                "sent keeps some memory; set it in the environment of the process",
                UCX_HOOK_MODE_VAR,
            )
        os.environ[UCX_HOOK_MODE_VAR] = "none"
    try:
        return importlib.import_module("nixl_cu12")
    except ImportError:
        return importlib.import_module("nixl._api")


def nixl_available() -> bool:
    """Whether the NIXL Python package (nixl_cu12 or nixl) can be imported."""
    try:
        _import_nixl()
    except ImportError:
        return False
    return True


def region_descs(
    base: int, num_regions: int, region_bytes: int, device_id: int
) -> npt.NDArray[np.uint64]:
    """(addr, len, dev) rows of ``num_regions`` consecutive regions from ``base``."""
    descs = np.empty((num_regions, 3), dtype=np.uint64)
    descs[:, 0] = base + np.arange(num_regions, dtype=np.uint64) * np.uint64(region_bytes)
    descs[:, 1] = region_bytes
    descs[:, 2] = device_id
    return descs


class NixlAgent:
    """One NIXL agent; every method takes the agent lock.

    States returned by `post` and `check` are NIXL's: "DONE", "PROC" or "ERR".
    Methods raise what NIXL raises unless their name starts with ``try_``.
    """

    def __init__(self, name: str, backend_params: dict[str, str] | None = None) -> None:
        nixl = _import_nixl()
        self.name = name
        self._lock = threading.Lock()
        config = nixl.nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=[]
        )
        self._agent = nixl.nixl_agent(name, config)
        self._agent.create_backend("UCX", dict(backend_params or {}))
        self._reg: Any = None

    def register(self, base: int, num_bytes: int, mem_type: str, device_id: int) -> None:
        """Register one memory region (the whole pool)."""
        with self._lock:
            self._reg = self._agent.register_memory([(base, num_bytes, device_id, "")], mem_type)

    def metadata(self) -> bytes:
        with self._lock:
            md: bytes = self._agent.get_agent_metadata()
        return md

    def prep_dlist(self, agent_name: str, descs: npt.NDArray[np.uint64], mem_type: str) -> Any:
        """Prepare a descriptor list of ``agent_name``'s memory ("NIXL_INIT_AGENT": ours)."""
        with self._lock:
            return self._agent.prep_xfer_dlist(agent_name, descs, mem_type)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else str(name)

    def try_remove_peer(self, agent_name: str, dlist: Any) -> bool:
        """Release the peer's descriptors and remove its agent; False if NIXL refused
        either (the endpoint may still be up: transfers to it may still land)."""
        with self._lock:
            released = self._try(dlist.release, f"release descriptors of {agent_name}")
            removed = self._try(
                lambda: self._agent.remove_remote_agent(agent_name), f"remove {agent_name}"
            )
        return released and removed

    def post(
        self,
        op: str,
        local_dlist: Any,
        local: npt.NDArray[np.int32],
        remote_dlist: Any,
        remote: npt.NDArray[np.int32],
        notif: bytes,
        before: tuple[str, bytes] | None = None,
    ) -> tuple[Any, str]:
        """Create and post a transfer; returns (xfer handle, state).

        ``before`` is an (agent name, message) notification sent first, in the
        same critical section. On "ERR" the handle is already released.
        """
        with self._lock:
            if before is not None:
                self._try(lambda: self._agent.send_notif(*before), None)
            xfer = self._agent.make_prepped_xfer(
                op, local_dlist, local, remote_dlist, remote, notif_msg=notif
            )
            try:
                status: str = self._agent.transfer(xfer)
            except Exception:
                self._try(xfer.release, "release of an unposted transfer")
                raise
            if status == "ERR":
                self._try(xfer.release, "release of a refused transfer")
        return xfer, status

    def check(self, xfer: Any) -> str:
        with self._lock:
            status: str = self._agent.check_xfer_state(xfer)
        return status

    def try_release(self, xfer: Any, what: str | None) -> bool:
        """Release (cancelling if still active); False if NIXL refused."""
        with self._lock:
            return self._try(xfer.release, what)

    def send_notif(self, agent_name: str, msg: bytes) -> None:
        with self._lock:
            self._agent.send_notif(agent_name, msg)

    def try_send_notif(self, agent_name: str, msg: bytes) -> bool:
        with self._lock:
            return self._try(lambda: self._agent.send_notif(agent_name, msg), None)

    def new_notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call, by sender agent name."""
        with self._lock:
            new: dict[str, list[bytes]] = self._agent.get_new_notifs()
        return new

    def try_close(self, local_dlist: Any) -> None:
        """Release the local descriptors and the registration."""
        with self._lock:
            self._try(local_dlist.release, "release local descriptors")
            if self._reg is not None:
                self._try(lambda: self._agent.deregister_memory(self._reg), "deregister pool")
                self._reg = None

    @staticmethod
    def _try(fn: Any, what: str | None) -> bool:
        try:
            fn()
        except Exception as exc:
            if what is not None:
                logger.warning("%s failed: %s", what, exc)
            return False
        return True


__all__ = ["NixlAgent", "nixl_available", "region_descs"]
