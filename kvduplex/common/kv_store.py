"""The Mooncake store's parts outside the engine: whether its client imports here, and the
command lines of its two server processes (a master; a storage node that holds the
memory), for `kvduplex up --kv-store` and the docs.

A store is one ``mooncake_master`` (object metadata, and with
``--enable_http_metadata_server`` the transfer engine's metadata too) and one or more
``mooncake_client`` storage nodes, each mounting ``--global_segment_size`` of its memory
into the store. Instances (`kvduplex.engine.kv_tier_store`) mount nothing: they put and
get blocks over TCP, and the bytes live on the storage nodes, so a block outlives the
instance that demoted it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

INSTALL_HINT = (
    "pip install 'kvduplex[store]' (the package mooncake-transfer-engine-non-cuda) and the "
    "system library libibverbs1 (apt-get install libibverbs1)"
)


def mooncake_import_problem() -> str | None:
    """Why Mooncake's store client cannot be imported here (what to install), or None."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return f"the Mooncake store client does not import ({exc}): {INSTALL_HINT}"
    return None


def mooncake_binary(name: str) -> Path:
    """The path of one of the Mooncake package's programs (``mooncake_master``,
    ``mooncake_client``), found without importing the package. FileNotFoundError saying
    what to install if it is absent."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} is not installed: {INSTALL_HINT}")


def master_command(host: str, rpc_port: int, metadata_port: int, metrics_port: int) -> list[str]:
    """A Mooncake master on `host`: RPC on `rpc_port`, its own HTTP metadata server on
    `metadata_port`, health and metrics (``GET /health``, ``/get_all_segments``) on
    `metrics_port`."""
    return [
        str(mooncake_binary("mooncake_master")),
        f"--rpc_address={host}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={metadata_port}",
        f"--metrics_host={host}",
        f"--metrics_port={metrics_port}",
    ]


def storage_node_command(
    master: str, metadata_url: str, host: str, port: int, http_port: int, gib: float
) -> list[str]:
    """A Mooncake storage node on `host` that mounts `gib` GiB of its memory into the store
    of the master at `master` (HOST:PORT), over TCP; health on `http_port`."""
    return [
        str(mooncake_binary("mooncake_client")),
        f"--master_server_address={master}",
        f"--metadata_server={metadata_url}",
        f"--host={host}",
        f"--port={port}",
        f"--global_segment_size={int(gib * 2**30)}",
        "--protocol=tcp",
        "--enable_http_server=true",
        f"--http_port={http_port}",
    ]


__all__ = [
    "INSTALL_HINT",
    "master_command",
    "mooncake_binary",
    "mooncake_import_problem",
    "storage_node_command",
]
