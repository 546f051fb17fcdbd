"""Shared machinery of the fault and abort tests on real processes.

A `Rig` is one prefill (P), one decode (D) and a push router over them, plus
a colocated reference for the right tokens. P is slow on purpose: one
request at a time (``--max-num-seqs 1``) and 4 prompt tokens per step, so a
long prompt spends about a second in its prefill, streaming its KV to D
layer by layer, while the next one waits in P's queue. Deadlines are short
(2 s), so that a fallback or a quarantine ends within a test.

A `Victim` is one request in flight in its own thread; it ends in one
`Outcome`. A `Tally` counts outcomes per (fault, moment) and prints the table
at the end of the module (docs/reliability.md quotes it).
"""

from __future__ import annotations

import enum
import json
import threading
import time
import uuid
from collections.abc import Callable
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.integration.conftest import kv_stats
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until
from tests.support.faults import Faults
from tests.support.faults import start_instance

BS = 8
DEADLINE_S = 2.0
SERVE = ["serve", "--model", "tiny", "--block-size", str(BS), "--log-level", "warning"]
SERVE += ["--kv-wait-timeout-s", str(DEADLINE_S), "--transfer-timeout-s", str(DEADLINE_S)]
P_FLAGS = ["--role", "prefill", "--num-blocks", "640", "--max-num-batched-tokens", "4"]
P_FLAGS += ["--max-num-seqs", "1"]
D_FLAGS = ["--role", "decode", "--num-blocks", "1280"]
HEALTH_INTERVAL_S = 0.5
"""The routers' probe interval: a restarted instance is taken back within about this."""
REQUEST_BOUND_S = 40.0
"""Every request ends (an answer or an error) within this, whatever the fault."""
CLEAN_BOUND_S = 20.0
"""Every surviving pool holds no request blocks within this after the fault."""


class Outcome(enum.Enum):
    COMPLETED = "completed"
    """The whole answer, token for token the colocated instance's."""
    ERROR = "error"
    """An OpenAI error: an HTTP error status with error JSON, or an SSE error event."""
    CUT = "cut"
    """The connection closed without an error body (the process serving it died)."""
    WRONG = "wrong"
    """An answer with other tokens: must never happen."""
    HUNG = "hung"
    """No end within REQUEST_BOUND_S: must never happen."""


def body(prompt: list[int], max_tokens: int, **extra: object) -> dict[str, Any]:
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, **extra,
    }  # fmt: skip


def prompt_ids(n: int, salt: int) -> list[int]:
    """`n` token ids, distinct per salt (so that no prefix cache helps)."""
    return [(salt * 7919 + i * 31 + (i * i) % 97) % 500 + 5 for i in range(n)]


def reference_tokens(reference: str, b: dict[str, Any]) -> list[int]:
    plain = {k: v for k, v in b.items() if k not in ("stream", "kv_transfer_params")}
    resp = httpx.post(reference + "/v1/completions", json=plain, timeout=120)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["choices"][0]["token_ids"])


@dataclass(eq=False)
class Victim:
    """One request in flight: the tokens it has seen so far and how it ended."""

    url: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    path: str = "/v1/completions"
    tokens: list[int] = field(default_factory=list)
    first_token: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    status: int | None = None
    error: str | None = None
    """The error's message (an OpenAI error), or why the request ended without one."""
    api_error: bool = False
    """The request ended with an OpenAI error (HTTP error JSON or an SSE error event)."""
    timed_out: bool = False
    finished: bool = False
    """The answer ended normally (a 200 JSON body, or an SSE stream to [DONE])."""
    started_at: float = 0.0
    elapsed_s: float = 0.0
    client_timeout_s: float = REQUEST_BOUND_S

    def start(self) -> Victim:
        self.started_at = time.monotonic()
        threading.Thread(target=self._run, daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            if self.body.get("stream"):
                self._stream()
            else:
                self._call()
        except httpx.TimeoutException as exc:
            self.timed_out = True
            self.error = f"timeout: {exc!r}"
        except httpx.TransportError as exc:
            self.error = f"connection: {exc!r}"
        finally:
            self.elapsed_s = time.monotonic() - self.started_at
            self.done.set()

    def _call(self) -> None:
        resp = httpx.post(
            self.url + self.path,
            json=self.body,
            headers=self.headers,
            timeout=self.client_timeout_s,
        )
        self.status = resp.status_code
        try:
            data = resp.json()
        except ValueError:
            self.error = f"HTTP {resp.status_code}, not JSON: {resp.text[:200]!r}"
            return
        if resp.status_code == 200 and "choices" in data:
            self.tokens = list(data["choices"][0].get("token_ids") or [])
            self.finished = True
        else:
            self._fail(_error_message(data), f"HTTP {resp.status_code}: {resp.text[:200]}")

    def _fail(self, api_message: str | None, otherwise: str) -> None:
        self.api_error = api_message is not None
        self.error = api_message or otherwise

    def _stream(self) -> None:
        with httpx.stream(
            "POST", self.url + self.path, json=self.body, headers=self.headers,
            timeout=self.client_timeout_s,
        ) as resp:  # fmt: skip
            self.status = resp.status_code
            if resp.status_code != 200:
                resp.read()
                self._fail(_error_message(_json_or_none(resp.text)), resp.text[:200])
                return
            for line in resp.iter_lines():
                if line == "data: [DONE]":
                    self.finished = True
                    return
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                message = _error_message(chunk)
                if message is not None:
                    self._fail(message, "")
                    return
                for choice in chunk.get("choices", []):
                    self.tokens.extend(choice.get("token_ids") or [])
                if self.tokens:
                    self.first_token.set()
        self.error = "the stream ended without [DONE]"

    def outcome(self, want: list[int]) -> Outcome:
        """How it ended, once `done` (waited for up to the bound by `Trial.settle`)."""
        if not self.done.is_set() or self.timed_out:
            return Outcome.HUNG
        if self.finished:
            return Outcome.COMPLETED if self.tokens == want else Outcome.WRONG
        return Outcome.ERROR if self.api_error else Outcome.CUT


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _error_message(data: Any) -> str | None:
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str) and err["message"]:
        return str(err["message"])
    return None


@dataclass
class Counts:
    trials: int = 0
    completed: int = 0
    error: int = 0
    cut: int = 0
    hung: int = 0
    wrong: int = 0
    leaked_blocks: int = 0
    max_s: float = 0.0
    notes: dict[str, int] = field(default_factory=dict)
    """What else was seen, and how often (e.g. where a return was when its peer died)."""


@dataclass
class Tally:
    """Outcomes per (fault, moment), printed as a table and written as JSON."""

    title: str
    rows: dict[tuple[str, str], Counts] = field(default_factory=dict)

    def add(self, fault: str, moment: str, outcome: Outcome, elapsed_s: float) -> None:
        c = self.rows.setdefault((fault, moment), Counts())
        c.trials += 1
        setattr(c, outcome.value, getattr(c, outcome.value) + 1)
        c.max_s = max(c.max_s, elapsed_s)

    def leaked(self, fault: str, moment: str, num_blocks: int) -> None:
        self.rows.setdefault((fault, moment), Counts()).leaked_blocks += num_blocks

    def note(self, fault: str, moment: str, text: str) -> None:
        notes = self.rows.setdefault((fault, moment), Counts()).notes
        notes[text] = notes.get(text, 0) + 1

    def table(self) -> str:
        head = "| fault | moment | trials | completed | clear error | cut | hung | wrong | leaked blocks | slowest (s) |"
        lines = [self.title, "", head, "|" + "---|" * 10]
        for (fault, moment), c in self.rows.items():
            lines.append(
                f"| {fault} | {moment} | {c.trials} | {c.completed} | {c.error} | {c.cut} | "
                f"{c.hung} | {c.wrong} | {c.leaked_blocks} | {c.max_s:.1f} |"
            )
            lines += [
                f"|   | {n} ({k}x) |" + " |" * 8 for n, k in sorted(c.notes.items())
            ]
        return "\n".join(lines)

    def write(self, path: Path) -> None:
        rows = [
            {"fault": f, "moment": m, **vars(c)} for (f, m), c in self.rows.items()
        ]  # fmt: skip
        path.write_text(json.dumps({"title": self.title, "rows": rows}, indent=1))


def open_tally(request: pytest.FixtureRequest, title: str, name: str) -> Iterator[Tally]:
    """A module's ``tally`` fixture: ``yield from open_tally(request, title, name)``;
    reported (`report_tally`) when the module ends."""
    tally = Tally(title)
    yield tally
    report_tally(request, tally, name)


def report_tally(request: pytest.FixtureRequest, tally: Tally, name: str) -> None:
    """Print the tally in pytest's terminal summary and write it next to the test logs."""
    out = Path(str(request.config._tmp_path_factory.getbasetemp())) / f"{name}.json"  # type: ignore[attr-defined]
    tally.write(out)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(tally.table())
            reporter.write_line(f"(written to {out})")


@dataclass
class Rig:
    """P, D and a push router; `kill` and `restart` them (same port, new engine id)."""

    cluster: LocalCluster
    reference: str
    p: Process
    d: Process
    router: Process
    p_faults: Faults
    d_faults: Faults
    p_flags: list[str]

    @property
    def url(self) -> str:
        """The router's."""
        return self.router.url

    def proc(self, role: str) -> Process:
        return self.p if role == "P" else self.d

    def kill(self, role: str) -> None:
        self.cluster.kill_process(self.proc(role))

    def restart(self, role: str) -> None:
        """Start the (dead or stopped) P or D again at its address: a new engine id."""
        old = self.proc(role)
        self.cluster.stop_process(old)
        port = int(old.url.rsplit(":", 1)[1])
        flags, faults = (self.p_flags, self.p_faults) if role == "P" else (D_FLAGS, self.d_faults)
        new = start_instance(self.cluster, old.name, [*SERVE, *flags], port, faults)
        self.cluster.wait_healthy(timeout_s=120)
        if role == "P":
            self.p = new
        else:
            self.d = new
        wait_router_sees(self.url, new.url, "prefill" if role == "P" else "decode", healthy=True)
        engine_id = httpx.get(new.url + "/health", timeout=10).json()["engine_id"]
        poll(
            lambda: engine_id in {i["engine_id"] for i in httpx.get(self.url + "/health").json()["instances"]},
            f"the router to know {new.url}'s new engine id",
        )

    def stop(self) -> None:
        for proc in (self.router, self.p, self.d):
            self.cluster.stop_process(proc)


def start_reference(cluster: LocalCluster) -> str:
    """Start the colocated reference (role both, D's pool) and return its URL."""
    ref = cluster.start("reference", [*SERVE, "--role", "both", *D_FLAGS[2:]], free_port())
    cluster.wait_healthy(timeout_s=120)
    return ref.url


def start_rig(
    cluster: LocalCluster, reference: str, tag: str,
    p_faults: Faults | None = None, d_faults: Faults | None = None,
    p_flags: list[str] = P_FLAGS,
) -> Rig:  # fmt: skip
    """P and D (each with its own faults, e.g. a message to drop) and a router."""
    p_faults = p_faults if p_faults is not None else Faults()
    d_faults = d_faults if d_faults is not None else Faults()
    p = start_instance(cluster, f"prefill-{tag}", [*SERVE, *p_flags], free_port(), p_faults)
    d = start_instance(cluster, f"decode-{tag}", [*SERVE, *D_FLAGS], free_port(), d_faults)
    cluster.wait_healthy(timeout_s=120)
    args = ["router", "--mode", "push", "--model", "tiny", "--prefill", p.url, "--decode", d.url]
    args += ["--health-interval-s", str(HEALTH_INTERVAL_S), "--return-mode", "none"]
    router = cluster.start(f"router-{tag}", args, free_port())
    cluster.wait_healthy(timeout_s=60)
    return Rig(cluster, reference, p, d, router, p_faults, d_faults, list(p_flags))


def duplex_turn(rig: Rig, history: list[int], session: str, max_tokens: int) -> Victim:
    """One push turn sent to P and D directly, D returning the finished turn to P (what the
    router's push with a session does); the Victim is D's answer (P's is awaited too)."""
    xid = f"turn-{uuid.uuid4().hex}"
    p_req = {"xid": xid, "prompt_token_ids": history, "decode_url": rig.d.url}
    params = {"mode": "push", "xid": xid, "prefill_url": rig.p.url, "session_id": session,
              "return_to": rig.p.url}  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        p_ans = pool.submit(
            httpx.post, rig.p.url + "/internal/push/prefill", json=p_req, timeout=60
        )
        v = Victim(rig.d.url, body(history, max_tokens, kv_transfer_params=params)).start()
        v.done.wait(REQUEST_BOUND_S)
        p_ans.exception()  # P's answer (or its death) came too
    return v


def wait_router_sees(router: str, url: str, role: str, *, healthy: bool) -> None:
    """Poll the router's ``kvduplex_router_instance_healthy`` gauge (with a deadline) until
    it says `url` is (un)healthy."""
    want = 1.0 if healthy else 0.0
    poll(
        lambda: metric(router, "kvduplex_router_instance_healthy", url=url, role=role) == want,
        f"the router to see {url} {'healthy' if healthy else 'unhealthy'}",
    )


def write_bytes(url: str) -> float:
    return metric(url, "kvduplex_kv_transfer_bytes_total", direction="write")


def stats(url: str, route: str) -> dict[str, Any]:
    return dict(httpx.get(url + route, timeout=10).json())


def blocks_left(url: str, bound_s: float = CLEAN_BOUND_S) -> int:
    """Request blocks still in use on `url` once `bound_s` passed (0 as soon as it is 0);
    fails if the pool's integrity check fails."""
    deadline = time.monotonic() + bound_s
    while True:
        st = kv_stats(url)
        assert st["integrity_ok"], st["integrity_error"]
        assert st["num_free"] + st["num_cached"] + st["num_in_use"] == st["total"], st
        if st["num_in_use"] == 0 or time.monotonic() > deadline:
            return int(st["num_in_use"])
        time.sleep(0.05)  # polling another process's state, with a deadline


def poll(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    wait_until(cond, timeout_s, what)
