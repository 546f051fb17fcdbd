"""``kvduplex serve`` and ``kvduplex router`` in a pod beside a Kubernetes Service named
``kvduplex``: the variables its service links inject (``KVDUPLEX_PORT=tcp://IP:8000``
and the like) are no settings, so both start and answer. Each takes its address from
its ``--config`` file, below the environment in precedence, as a deployment's
ConfigMap would give it. The injected address is only a value in the environment;
nothing contacts it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.support.service_links import SERVICE_LINK_ENV

pytestmark = pytest.mark.integration


BODY = {"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0.0,
        "ignore_eos": True}  # fmt: skip


def start_configured(cluster: LocalCluster, name: str, args: list[str]) -> Process:
    """``python -m kvduplex <args> --config FILE``, the file naming 127.0.0.1 and a free
    port, in the cluster's environment; the cluster stops it."""
    port = free_port()
    config = cluster.log_dir / f"{name}.yaml"
    config.write_text(f"host: 127.0.0.1\nport: {port}\n")
    log_path = cluster.log_dir / f"{name}.log"
    cmd = [sys.executable, "-m", "kvduplex", *args, "--config", str(config)]
    with open(log_path, "wb") as log:
        popen = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **cluster.env},
            start_new_session=True,
        )  # fmt: skip
    proc = Process(name=name, url=f"http://127.0.0.1:{port}", popen=popen, log_path=log_path)
    cluster.processes.append(proc)
    return proc


def test_serve_and_router_start_and_answer_beside_a_service_named_kvduplex(
    tmp_path: Path,
) -> None:
    env = {"OMP_NUM_THREADS": "1", **SERVICE_LINK_ENV}
    with LocalCluster(log_dir=tmp_path, env=env) as cluster:
        serve = ["serve", "--model", "tiny", "--role", "both", "--num-blocks", "64"]
        instance = start_configured(cluster, "instance", serve)
        cluster.wait_healthy(timeout_s=180)
        router = start_configured(cluster, "router", ["router", "--model", "tiny",
                                                      "--decode", instance.url])  # fmt: skip
        cluster.wait_healthy(timeout_s=60)
        for url in (instance.url, router.url):
            resp = httpx.post(url + "/v1/completions", json=BODY, timeout=120)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 4
        for proc in (instance, router):
            assert "10.96.0.12" not in proc.log_tail(100_000), "an injected value was read"
