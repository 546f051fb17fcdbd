"""Multi-host run on one machine (not a test): two prefill, two decode and two router hosts,
each in its own network namespace, found by DNS, under a steady agentic load while a third
decode joins, a prefill drains and a router is killed. Needs root.

    sudo .venv/bin/python benchmarks/bench_multihost.py                 # 150 s of load
    sudo .venv/bin/python benchmarks/bench_multihost.py --duration-s 60 --sessions 4

Hosts (`benchmarks.multihost`): a bridge in the root namespace and one
namespace per process; the routers resolve ``prefill.kvd.test`` and
``decode.kvd.test`` at a DNS server on the bridge's address; the instances move
KV with UCX over TCP on their host's interface. Push mode with the duplex return,
the ``tiny`` preset; a colocated reference in the root namespace. No process is
pinned: every figure here is a count, not a time.

Load (`benchmarks.multihost_load`): `--sessions` clients, each running
seeded agentic sessions of `--turns` turns back to back; a session's turns
alternate the two routers; a turn refused or cut off by a router is sent once
more to the other.

Timeline (seconds from the start of the load; defaults at 25%, 45%, 65%):

* `--join-at-s`: host decode-2 starts; once healthy, its address joins the decode name.
* `--drain-at-s`: prefill-1's address leaves the prefill name and it gets SIGTERM at once
  (as a pod that turns unready; no preStop wait), so a router may still send it a
  prefill until its next probe or DNS round: that one is refused (draining, or the
  connection once it has exited) and decode computes the prompt.
* `--kill-at-s`: router-1 gets SIGKILL, once a turn is in flight on it (waiting up to
  10 s for one).

Afterwards (`benchmarks.multihost_report`): every completed turn against the
reference (token ids), failures by whether they were in flight on the killed router,
duplex hits of turns >= 2 by whether the previous turn went through the other router,
blocks in use on every instance still up, and the turns decode-2 answered. Writes
results/multihost[-TAG].json and .md; exits 1 if a bar was missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_results
from benchmarks.multihost import Fleet
from benchmarks.multihost import FleetConfig
from benchmarks.multihost import Host
from benchmarks.multihost import HostRole
from benchmarks.multihost_load import LoadConfig
from benchmarks.multihost_load import LoadState
from benchmarks.multihost_load import TurnRecord
from benchmarks.multihost_load import check_exact
from benchmarks.multihost_load import run_load
from benchmarks.multihost_report import Labels
from benchmarks.multihost_report import Membership
from benchmarks.multihost_report import Observed
from benchmarks.multihost_report import Timeline
from benchmarks.multihost_report import duplex_hits
from benchmarks.multihost_report import failures
from benchmarks.multihost_report import format_report
from benchmarks.multihost_report import served_by_decode
from kvduplex.bench.netns import netns_unavailable_reason
from kvduplex.bench.report import scrape

KILLED_ROUTER = 1
JOINED, DRAINED = "decode-2", "prefill-1"
KILL_WAIT_S = 10.0
"""How long after --kill-at-s the kill waits for a turn in flight on the router."""
DECLINED = "kvduplex_kv_return_declined_total"
"""Prefill's counter of the return offers it declined, by reason."""
DRAINED_IN = re.compile(r"drained in ([0-9.]+) s")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--duration-s", type=float, default=150.0, help="seconds of load")
    ap.add_argument("--sessions", type=int, default=6, help="clients at once (default 6)")
    ap.add_argument("--turns", type=int, default=6, help="turns per session (default 6)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--join-at-s", type=float, default=None, help="decode-2 starts")
    ap.add_argument("--drain-at-s", type=float, default=None, help="prefill-1 drains")
    ap.add_argument("--kill-at-s", type=float, default=None, help="router-1 is killed")
    ap.add_argument("--model", default="tiny", help="preset (default tiny)")
    ap.add_argument("--tag", default="", help="results/multihost-TAG.json (default: no tag)")
    ap.add_argument("--log-dir", default="", help="process logs (default: a temp dir)")
    args = ap.parse_args()
    d = args.duration_s
    args.join_at_s = 0.25 * d if args.join_at_s is None else args.join_at_s
    args.drain_at_s = 0.45 * d if args.drain_at_s is None else args.drain_at_s
    args.kill_at_s = 0.65 * d if args.kill_at_s is None else args.kill_at_s
    times = (args.join_at_s, args.drain_at_s, args.kill_at_s)
    if min(times) < 0 or max(times) >= d:
        ap.error("--join-at-s, --drain-at-s and --kill-at-s must fall within the load")
    return args


async def _at(t0: float, at_s: float) -> None:
    await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))  # the run's own schedule


async def run_timeline(
    fleet: Fleet, args: argparse.Namespace, load: LoadState, tl: Timeline,
    members: dict[HostRole, list[tuple[float, list[str]]]],
) -> None:  # fmt: skip
    """The three events, each at its time; returns once the drained prefill has exited
    (or its drain timeout and 15 s have passed)."""
    t0 = load.t0

    def note(role: HostRole) -> None:
        members[role].append((time.monotonic() - t0, [h.url for h in fleet.published(role)]))

    await _at(t0, args.join_at_s)
    tl.join_started_s = time.monotonic() - t0
    joined = fleet.start_instance(HostRole.DECODE, JOINED)
    await _wait_healthy(joined, 300.0)
    fleet.publish(joined)
    tl.join_published_s = time.monotonic() - t0
    note(HostRole.DECODE)

    await _at(t0, args.drain_at_s)
    drained = fleet.hosts[DRAINED]
    fleet.unpublish(drained)
    fleet.signal(drained, signal.SIGTERM)
    tl.drain_s = time.monotonic() - t0
    note(HostRole.PREFILL)
    exited = asyncio.create_task(_wait_exit(drained, fleet.config.drain_timeout_s + 15, t0))

    await _at(t0, args.kill_at_s)
    await load.wait_in_flight(KILLED_ROUTER, KILL_WAIT_S)
    fleet.signal(fleet.hosts[f"router-{KILLED_ROUTER}"], signal.SIGKILL)
    tl.kill_s = time.monotonic() - t0
    tl.drain_exit_code, tl.drain_exit_s = await exited


async def _wait_healthy(host: Host, timeout_s: float) -> None:
    """Until `host` answers /health with 200 (without blocking the load's event loop)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as http:
        while True:
            if not host.proc.is_alive():
                raise RuntimeError(f"{host.label} exited during start-up:\n{host.proc.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(host.url + "/health")).status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{host.label} not healthy after {timeout_s} s")
            await asyncio.sleep(0.2)  # polling a process we do not control


async def _wait_exit(host: Host, timeout_s: float, t0: float) -> tuple[int | None, float | None]:
    """`host`'s exit code and when it exited (from `t0`); (None, None) if it runs on."""
    deadline = time.monotonic() + timeout_s
    while (code := host.proc.popen.poll()) is None:
        if time.monotonic() > deadline:
            return None, None
        await asyncio.sleep(0.1)  # polling a process we do not control
    return code, time.monotonic() - t0


def start(fleet: Fleet) -> tuple[list[Host], str]:
    """Prefill 0-1 and decode 0-1 published, both routers ready, and the reference."""
    instances = [fleet.start_instance(HostRole.PREFILL, f"prefill-{i}") for i in range(2)]
    instances += [fleet.start_instance(HostRole.DECODE, f"decode-{i}") for i in range(2)]
    reference = fleet.start_reference()
    fleet.wait_healthy([h.proc for h in instances] + [reference])
    for h in instances:
        fleet.publish(h)
    routers = [fleet.start_router(f"router-{i}") for i in range(2)]
    fleet.wait_healthy([r.proc for r in routers])
    for r in routers:
        _poll(lambda r=r: _sees(r.url, {h.url for h in instances}), 60, f"{r.label} to see all")
    return routers, reference.url


def _sees(router: str, urls: set[str]) -> bool:
    instances = httpx.get(router + "/health", timeout=5).json()["instances"]
    return {i["url"] for i in instances if i["healthy"]} == urls


def _poll(cond: Any, timeout_s: float, what: str) -> bool:
    """Poll `cond` (other processes' state) until it holds; False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            print(f"warning: timed out waiting for {what}", file=sys.stderr)
            return False
        time.sleep(0.2)
    return True


def _get(url: str) -> dict[str, Any]:
    resp = httpx.get(url, timeout=10)
    resp.raise_for_status()
    out: dict[str, Any] = resp.json()
    return out


def _returns_settled(decodes: list[Host]) -> bool:
    stats = [_get(d.url + "/internal/kv/return/stats") for d in decodes]
    ended = sum(s["num_done"] + s["num_failed"] + s["num_declined"] for s in stats)
    return ended == sum(s["num_offered"] for s in stats)


def after_load(fleet: Fleet, reference: str) -> dict[str, Any]:
    """Pools, stats and return records of every instance still up, once the returns have
    ended and no block is in use (or after a while: then as they are)."""
    up = [h for h in fleet.hosts.values() if h.role is not HostRole.ROUTER and h.proc.is_alive()]
    decodes = [h for h in up if h.role is HostRole.DECODE]
    out: dict[str, Any] = {
        "returns_settled": _poll(lambda: _returns_settled(decodes), 60, "the returns")
    }
    targets = {h.label: h.url for h in up} | {"reference": reference}
    for url in targets.values():
        _poll(lambda url=url: _get(url + "/internal/kv/stats")["num_in_use"] == 0, 30, url)
    out["pools"] = {label: _get(url + "/internal/kv/stats") for label, url in targets.items()}
    out["push_stats"] = {h.label: _get(h.url + "/internal/kv/push/stats") for h in up}
    out["return_stats"] = {h.label: _get(h.url + "/internal/kv/return/stats") for h in up}
    out["return_records"] = {d.label: _get(d.url + "/internal/kv/return/records") for d in decodes}
    out["declined"] = {
        h.label: {dict(labels)["reason"]: v for (name, labels), v in scrape(h.url).items()
                  if name == DECLINED}
        for h in up if h.role is HostRole.PREFILL
    }  # fmt: skip
    return out


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop, remove the hosts
    args = parse_args()
    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    fleet_cfg = FleetConfig(model=args.model)
    load_cfg = LoadConfig(num_sessions=args.sessions, num_turns=args.turns, seed=args.seed)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvduplex-multihost-"))
    tl = Timeline()
    with Fleet(fleet_cfg, log_dir) as fleet:
        routers, reference = start(fleet)
        members = {
            role: [(0.0, [h.url for h in fleet.published(role)])]
            for role in (HostRole.PREFILL, HostRole.DECODE)
        }

        async def run() -> tuple[list[TurnRecord], float]:
            load = LoadState(time.monotonic(), [0] * len(routers))
            urls = [r.url for r in routers]
            turns, _ = await asyncio.gather(
                run_load(urls, args.model, load_cfg, args.duration_s, load),
                run_timeline(fleet, args, load, tl, members),
            )
            return turns, time.monotonic() - load.t0

        turns, load_s = asyncio.run(run())
        state = after_load(fleet, reference)
        found = DRAINED_IN.search(fleet.hosts[DRAINED].proc.log_tail(1_000_000))
        drained_in_s = None if found is None else float(found.group(1))
        asyncio.run(check_exact(reference, args.model, turns))
    hits = duplex_hits(turns, fleet_cfg.block_size, Membership(members[HostRole.PREFILL]))
    fails = failures(turns, KILLED_ROUTER, tl.kill_s)
    records = state.pop("return_records")
    by_decode = served_by_decode(turns, records)
    decodes = [h.label for h in fleet.hosts.values() if h.role is HostRole.DECODE]
    labels = Labels(tuple(r.label for r in routers), KILLED_ROUTER, JOINED, DRAINED)
    returns = {label: state["return_stats"][label] for label in decodes}
    declined: dict[str, float] = {}
    for reasons in state["declined"].values():
        for reason, n in reasons.items():
            declined[reason] = declined.get(reason, 0.0) + n
    obs = Observed(
        turns, labels, tl, hits, fails, by_decode, state["pools"], drained_in_s, returns, declined
    )
    title = (
        f"Multi-host run: {args.model}, push + duplex return, 2 prefill + 2 decode (+1 joining) "
        f"+ 2 routers, each in its own network namespace; {args.sessions} clients, sessions of "
        f"{args.turns} turns alternating routers, {load_s:.0f} s"
    )
    table, is_ok = format_report(title, obs)
    data = {
        "args": vars(args), "fleet": asdict(fleet_cfg),
        "load": {**asdict(load_cfg), "shape": asdict(load_cfg.shape)},
        "timeline": asdict(tl), "load_s": load_s,
        "published": {role.value: changes for role, changes in members.items()},
        "drained_in_s": drained_in_s,
        "hits": {g: {**asdict(h), "rate": h.rate} for g, h in hits.items()},
        "failures": asdict(fails),
        "turns_by_decode": {label: len(ts) for label, ts in by_decode.items()},
        "turns": [_turn_row(t, records) for t in turns], **state,
    }  # fmt: skip
    path = write_results("multihost" + (f"-{args.tag}" if args.tag else ""), data, table)
    print(table)
    print(f"written: {path}, {path.with_suffix('.md')}; process logs: {log_dir}")
    return 0 if is_ok else 1


def _turn_row(t: TurnRecord, records: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One turn for the JSON; `records`: each decode's return records by request id."""
    rid = t.result.response_id
    decode = next((label for label, recs in records.items() if rid and rid in recs), None)
    return {
        "session": t.session, "turn": t.turn, "prompt_tokens": len(t.prompt),
        "max_tokens": t.max_tokens, "ok": t.ok, "exact": t.is_exact,
        "cached_tokens": t.result.cached_tokens, "response_id": rid,
        "prefill_computed_tokens": t.result.kv.prefill_computed_tokens if t.result.kv else None,
        "decode": decode, "return": None if decode is None else records[decode][rid],
        "attempts": [
            {"router": a.router, "start_s": round(a.start_s, 3), "end_s": round(a.end_s, 3),
             "ok": a.result.ok, "error": a.result.error[:200]}
            for a in t.attempts
        ],
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
