"""Soak: many concurrent multi-turn streaming sessions for a while, and each process's memory.

`run_sessions` keeps `SoakConfig.num_sessions` sessions going until a deadline:
each sends `num_turns` streaming turns (every turn the whole history, the last
answer included, plus seeded new input), then starts over as a new session.
Even-numbered workers send token-id prompts to ``/v1/completions``, odd ones
chat messages to ``/v1/chat/completions``; every request names its session.

`ProcessSampler` reads each process's resident memory (VmRSS in
``/proc/<pid>/status``) and counts its TCP connections in CLOSE-WAIT (the peer
closed, the process never did: a leaked connection) every few seconds in a
thread of its own. `summarize` turns both into one report: requests, errors,
TTFT and TPOT percentiles, each process's memory growth after the warm-up and
the most connections it held in CLOSE-WAIT::

    RSS │        ┌──── after warm-up: growth = (last - first) / first
        │   ╱────┘
        │  ╱
        └──┴───────────────────────► time
         warm-up
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import threading
import time
from dataclasses import asdict
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx

from kvduplex.bench.client import RequestResult
from kvduplex.bench.client import percentile
from kvduplex.bench.client import stream_request
from kvduplex.bench.conversation import ChatConversation
from kvduplex.bench.conversation import Conversation
from kvduplex.bench.conversation import TokenConversation
from kvduplex.bench.session import seeded_text


@dataclass(frozen=True)
class SoakConfig:
    """The session mix of a soak."""

    num_sessions: int = 16
    """Sessions running at once."""
    num_turns: int = 6
    """Turns of a session before it ends and a new one starts."""
    first_turn_chars: int = 200
    """New input of a session's first turn, in characters (byte tokenizer: tokens)."""
    turn_chars: int = 40
    """New input of each later turn."""
    max_tokens: tuple[int, int] = (4, 24)
    """Answer length of a turn, drawn uniformly in [lo, hi]."""
    seed: int = 0
    """Seed of every session's input and length draws."""
    request_timeout_s: float = 120.0
    """A turn that takes longer counts as an error."""

    def __post_init__(self) -> None:
        if self.num_sessions < 1 or self.num_turns < 1:
            raise ValueError("num_sessions and num_turns must be >= 1")
        lo, hi = self.max_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"max_tokens must be a range 1 <= lo <= hi, got {self.max_tokens}")


@dataclass
class Turn:
    """One finished turn: when it ended (seconds from the start) and how it went."""

    end_s: float
    session: str
    result: RequestResult


async def _session(
    client: httpx.AsyncClient, url: str, model: str, cfg: SoakConfig, worker: int, n: int,
    rng: random.Random, deadline: float, t0: float, turns: list[Turn],
) -> None:  # fmt: skip
    name = f"soak-{cfg.seed}-{worker}-{n}"
    system = "You are a coding agent. " + seeded_text(rng, cfg.first_turn_chars)
    conv: Conversation = (
        TokenConversation(model, name, system)
        if worker % 2 == 0
        else ChatConversation(model, name, system, use_tools=False)
    )
    for turn in range(cfg.num_turns):
        if time.monotonic() >= deadline:
            return
        new_input = seeded_text(rng, cfg.turn_chars if turn else cfg.turn_chars // 2 + 1)
        req = conv.next_request(new_input, rng.randint(*cfg.max_tokens))
        res = await stream_request(client, url, req.path, req.body, req.headers)
        turns.append(Turn(time.monotonic() - t0, name, res))
        if not res.ok:
            return
        conv.add_answer(res.text, res.token_ids, res.message)


async def run_sessions(url: str, model: str, cfg: SoakConfig, duration_s: float) -> list[Turn]:
    """Keep `cfg.num_sessions` sessions going against `url` for `duration_s` seconds.

    Turns that started before the deadline finish; every turn is returned.
    """
    turns: list[Turn] = []
    t0 = time.monotonic()
    deadline = t0 + duration_s
    limits = httpx.Limits(max_connections=cfg.num_sessions * 2)

    async def worker(i: int) -> None:
        rng = random.Random(cfg.seed * 1_000_003 + i)
        n = 0
        while time.monotonic() < deadline:
            await _session(client, url, model, cfg, i, n, rng, deadline, t0, turns)
            n += 1

    async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits) as client:
        await asyncio.gather(*(worker(i) for i in range(cfg.num_sessions)))
    return turns


_TCP_CLOSE_WAIT = "08"
"""The state column's value for CLOSE-WAIT in ``/proc/net/tcp`` (include/net/tcp_states.h)."""


def count_close_wait(pid: int) -> int | None:
    """TCP connections of `pid` in CLOSE-WAIT, or None once it is gone (or on a system
    without ``/proc/net/tcp``)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):  # an fd closed meanwhile
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
        n = 0
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                n += cols[3] == _TCP_CLOSE_WAIT and cols[9] in inodes
        return n
    except OSError:
        return None


def read_rss_bytes(pid: int) -> int | None:
    """Resident memory of `pid` (VmRSS), or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


MAPPING_CLASSES = ("heap", "anon", "lib", "file", "shm", "stack", "other")
"""The classes `parse_smaps` sorts a process's mappings into: the brk heap, anonymous
mappings (malloc's mmap'd chunks and arenas, thread stacks, torch's and UCX's own
allocations), shared libraries (``*.so*``), other files, shared memory (``/dev/shm``,
memfd, SysV), the main thread's stack, and the kernel's (``[vdso]``, ``[vvar]``...)."""


@dataclass
class MappingClassUsage:
    """One class of mappings of a process: how many, their resident and private dirty KiB."""

    num_mappings: int = 0
    rss_kib: int = 0
    private_dirty_kib: int = 0


def mapping_class(path: str) -> str:
    """The class (one of `MAPPING_CLASSES`) of a mapping named `path` in ``/proc/PID/maps``."""
    if not path or path.startswith("[anon:"):
        return "anon"
    if path == "[heap]":
        return "heap"
    if path == "[stack]" or path.startswith("[stack:"):
        return "stack"
    if path.startswith("["):
        return "other"
    if path.startswith(("/dev/shm/", "/memfd:", "/SYSV")):
        return "shm"
    name = path.rsplit("/", 1)[-1].removesuffix(" (deleted)")
    return "lib" if name.endswith(".so") or ".so." in name else "file"


def parse_smaps(text: str) -> dict[str, MappingClassUsage]:
    """Sum a ``/proc/PID/smaps`` text's Rss and Private_Dirty by mapping class.

    Every class of `MAPPING_CLASSES` is in the result, a class without mappings at 0.
    """
    out = {c: MappingClassUsage() for c in MAPPING_CLASSES}
    cur: MappingClassUsage | None = None
    for line in text.splitlines():
        key, _, rest = line.partition(" ")
        if key.endswith(":"):  # a field of the current mapping: "Rss:   12 kB"
            if cur is not None and key in ("Rss:", "Private_Dirty:"):
                kib = int(rest.split()[0])
                if key == "Rss:":
                    cur.rss_kib += kib
                else:
                    cur.private_dirty_kib += kib
            continue
        # A mapping's header: "start-end perms offset dev inode [path]".
        cols = line.split(maxsplit=5)
        if len(cols) < 5 or "-" not in cols[0]:
            continue
        cur = out[mapping_class(cols[5].strip() if len(cols) == 6 else "")]
        cur.num_mappings += 1
    return out


def read_smaps_by_class(pid: int) -> dict[str, MappingClassUsage] | None:
    """`parse_smaps` of `pid`'s ``/proc/PID/smaps``, or None once it is gone."""
    try:
        return parse_smaps(Path(f"/proc/{pid}/smaps").read_text())
    except OSError:
        return None


def read_threads(pid: int) -> int | None:
    """Threads of `pid` (Threads in ``/proc/<pid>/status``), or None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Threads:"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class ProcessSampler:
    """Samples the RSS and the CLOSE-WAIT connections of named processes every `every_s`
    seconds, in its own thread.

    `samples` holds ``(seconds since start, {name: bytes})``, `close_wait` ``(seconds
    since start, {name: connections})``; a process that is gone is left out of the
    samples after it. `start` takes the first sample at once; `stop` takes a last one
    and joins the thread.
    """

    pids: dict[str, int]
    every_s: float = 2.0
    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    close_wait: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)
    _thread: threading.Thread | None = field(default=None, repr=False)
    _t0: float = 0.0

    def start(self) -> ProcessSampler:
        self._t0 = time.monotonic()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="rss-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def _sample(self) -> None:
        t = time.monotonic() - self._t0
        now = {name: read_rss_bytes(pid) for name, pid in self.pids.items()}
        self.samples.append((t, {k: v for k, v in now.items() if v is not None}))
        waiting = {name: count_close_wait(pid) for name, pid in self.pids.items()}
        self.close_wait.append((t, {k: v for k, v in waiting.items() if v is not None}))

    def close_wait_max(self, from_s: float, until_s: float) -> dict[str, int]:
        """Per process: the most connections in CLOSE-WAIT in a sample taken between
        `from_s` and `until_s` (under load: an idle pooled connection that its peer
        closed is dropped at the pool's next request, a leaked one never is)."""
        out: dict[str, int] = {}
        for t, counts in self.close_wait:
            if from_s <= t <= until_s:
                for name, n in counts.items():
                    out[name] = max(out.get(name, 0), n)
        return out

    def growth_after(self, warmup_s: float) -> dict[str, dict[str, float]]:
        """Per process: RSS (MiB) at the first sample after `warmup_s` and at the last one,
        and the growth between them in percent."""
        out: dict[str, dict[str, float]] = {}
        for name in self.pids:
            series = [(t, s[name]) for t, s in self.samples if name in s]
            after = [rss for t, rss in series if t >= warmup_s] or [rss for _, rss in series[-1:]]
            if not after:
                continue
            first, last = after[0], after[-1]
            out[name] = {
                "rss_after_warmup_mib": first / 2**20,
                "rss_end_mib": last / 2**20,
                "peak_mib": max(after) / 2**20,
                "growth_pct": 100.0 * (last - first) / first,
            }
        return out


@dataclass(frozen=True)
class SoakSummary:
    """What a soak showed: the load it carried, how it was served, and memory."""

    duration_s: float
    num_requests: int
    num_errors: int
    num_sessions_started: int
    errors: list[str]
    """The first few error messages."""
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    memory: dict[str, dict[str, float]]
    """Per process: see `ProcessSampler.growth_after`."""
    close_wait_max: dict[str, int]
    """Per process: the most connections in CLOSE-WAIT in a sample after the warm-up and
    before the load ended (see `ProcessSampler.close_wait_max`)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    turns: list[Turn], sampler: ProcessSampler, warmup_s: float, duration_s: float
) -> SoakSummary:
    """Latencies over turns that ended after the warm-up; errors over all turns."""
    measured = [t.result for t in turns if t.end_s >= warmup_s and t.result.ok]
    errors = [t.result.error for t in turns if not t.result.ok]
    ttft = [r.ttft_s * 1e3 for r in measured]
    tpot = [r.tpot_s * 1e3 for r in measured if r.completion_tokens > 1]
    return SoakSummary(
        duration_s=duration_s,
        num_requests=len(turns),
        num_errors=len(errors),
        num_sessions_started=len({t.session for t in turns}),
        errors=errors[:5],
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p99_ms=percentile(tpot, 99),
        memory=sampler.growth_after(warmup_s),
        close_wait_max=sampler.close_wait_max(warmup_s, duration_s),
    )


def format_summary(s: SoakSummary) -> str:
    """A Markdown report: the load, then one row per process."""
    lines = [
        f"{s.num_requests} streaming requests in {s.duration_s:.0f} s "
        f"({s.num_sessions_started} sessions), {s.num_errors} errors; "
        f"TTFT p50 {s.ttft_p50_ms:.1f} ms, p99 {s.ttft_p99_ms:.1f} ms; "
        f"TPOT p50 {s.tpot_p50_ms:.2f} ms, p99 {s.tpot_p99_ms:.2f} ms.",
        "",
        "| process | RSS after warm-up (MiB) | RSS at the end (MiB) | peak (MiB) | growth "
        "| CLOSE-WAIT (most) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in s.memory.items():
        lines.append(
            f"| {name} | {m['rss_after_warmup_mib']:.0f} | {m['rss_end_mib']:.0f} | "
            f"{m['peak_mib']:.0f} | {m['growth_pct']:+.1f}% | {s.close_wait_max.get(name, '-')} |"
        )
    return "\n".join(lines)
