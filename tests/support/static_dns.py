"""A DNS server for tests and benchmarks: A and AAAA records from a dict that they change.

It listens on a free UDP port of `host` (127.0.0.1 unless told; an address that
other network namespaces reach, such as a `NetnsLan`'s bridge, serves them), in a
thread, and answers with dnspython's own message codec: a name in `records` gets
its addresses of the asked type (none: an empty answer), any other name
NXDOMAIN. The router reaches it with ``--dns-server HOST:PORT`` (`address`).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from types import TracebackType

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


class StaticDns:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.records: dict[str, list[str]] = {}
        """Name (no final dot, lower case) → its addresses, IPv4 and IPv6."""
        self.num_queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self._sock.settimeout(0.05)  # how often the thread checks that it must stop
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="static-dns", daemon=True)

    @property
    def address(self) -> str:
        """``HOST:PORT``, as ``--dns-server`` takes it."""
        host, port = self._sock.getsockname()
        return f"{host}:{port}"

    def set(self, name: str, addresses: list[str]) -> None:
        with self._lock:
            self.records[name.lower()] = list(addresses)

    def _answer(self, wire: bytes) -> bytes:
        query = dns.message.from_wire(wire)
        response = dns.message.make_response(query)
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        with self._lock:
            self.num_queries += 1
            addresses = self.records.get(name)
        if addresses is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        version = 4 if question.rdtype == dns.rdatatype.A else 6
        found = [a for a in addresses if ipaddress.ip_address(a).version == version]
        if found and question.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            rrset = dns.rrset.from_text_list(question.name, 0, "IN", question.rdtype, found)
            response.answer.append(rrset)
        return response.to_wire()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                wire, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            self._sock.sendto(self._answer(wire), peer)

    def __enter__(self) -> StaticDns:
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
