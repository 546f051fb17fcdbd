"""What Kubernetes injects into every pod of a namespace that has a Service named kvduplex."""

from __future__ import annotations

SERVICE_LINK_ENV = {
    "KVDUPLEX_PORT": "tcp://10.96.0.12:8000",
    "KVDUPLEX_SERVICE_HOST": "10.96.0.12",
    "KVDUPLEX_SERVICE_PORT": "8000",
    "KVDUPLEX_SERVICE_PORT_HTTP": "8000",
    "KVDUPLEX_PORT_8000_TCP": "tcp://10.96.0.12:8000",
    "KVDUPLEX_PORT_8000_TCP_PROTO": "tcp",
    "KVDUPLEX_PORT_8000_TCP_PORT": "8000",
    "KVDUPLEX_PORT_8000_TCP_ADDR": "10.96.0.12",
}
"""What a Service named ``kvduplex`` with a port named ``http`` injects into every pod."""
