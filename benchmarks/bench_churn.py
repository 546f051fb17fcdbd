"""Churn soak (not a test): peers that come and go under steady agentic traffic, and
whether the long-lived instances' memory and peer tables stay bounded.

    .venv/bin/python benchmarks/bench_churn.py                 # 20 minutes on tiny
    .venv/bin/python benchmarks/bench_churn.py --quick         # a 2-minute smoke run
    .venv/bin/python benchmarks/bench_churn.py --churning 3 --churn-min-s 12 --churn-max-s 24
                                                               # more peers: ~50 met by each long-lived one (est.)
    .venv/bin/python benchmarks/bench_churn.py --churning 4 --churn-min-s 30 --churn-max-s 60 \
        --churn-after-s 120 --warmup-s 180       # the long-lived pair alone first: RSS at
                                                 # its working set before the churn begins

Two routers find prefill and decode instances by DNS (`tests.support.static_dns`):
one long-lived instance of each role, and `--churning` of each role that are
replaced by new ones on new loopback addresses (127.0.1.N for prefill, 127.0.2.N
for decode), as a rescheduled pod comes back on a new IP: the new one is started,
DNS names it, DNS drops the old one, and the old one is stopped (SIGTERM, drained).
Each of `--churning` churners replaces its own prefill and decode instance in turn,
one every `--churn-min-s`..`--churn-max-s` seconds (seeded). Every long-lived
instance thus meets a new peer at each churn of the other role.

Traffic: `--sessions` multi-turn sessions (token-id prompts: the history, the last
answer and seeded new input; greedy, fixed length), alternating between the
routers. Every answer is checked token for token against a colocated instance
given the same prompt; a request past `--deadline-s` counts as hung.

`--churning 0` runs the same traffic on the long-lived pair alone: no peer comes or
goes, which tells growth that follows requests from growth that follows peers.

Every `--sample-s` the long-lived instances' RSS, their RSS and Private_Dirty by
mapping class (``/proc/PID/smaps``: heap, anonymous, shared libraries, other files,
shared memory, stack; see `benchmarks.soak.parse_smaps`), their threads, and their
peer tables (``kvduplex_kv_peers{table}``, ``kvduplex_kv_peers_forgotten_total``,
``kvduplex_kv_peers_met_total``: the distinct peers each met) are recorded.
Writes results/churn-<model>.json (every sample, every failure with its error, the
RSS slope after the warm-up in all and by mapping class, the final peer counts and
the peers met) and .md. Exits 1 if a request failed, hung or answered other tokens
than the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from dataclasses import field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import md_table
from benchmarks.common import write_results
from benchmarks.soak import MAPPING_CLASSES
from benchmarks.soak import read_rss_bytes
from benchmarks.soak import read_smaps_by_class
from benchmarks.soak import read_threads
from kvduplex.cluster import LocalCluster
from kvduplex.cluster import Process
from kvduplex.cluster import free_port
from tests.support.static_dns import StaticDns

ROLES = {"prefill": "127.0.1", "decode": "127.0.2"}
"""Role -> the /24 of loopback addresses its instances listen on."""


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=20.0, help="length of the run (default 20)")
    ap.add_argument(
        "--quick", action="store_true",
        help="2 minutes, 30 s warm-up, churn every 20-30 s, --peer-idle-s 25",
    )  # fmt: skip
    ap.add_argument("--warmup-s", type=float, default=120.0, help="left out of the RSS slope")
    ap.add_argument("--model", default="tiny", help="preset or local HF folder (default tiny)")
    ap.add_argument("--sessions", type=int, default=6, help="sessions at once (default 6)")
    ap.add_argument("--turns", type=int, default=5, help="turns per session (default 5)")
    ap.add_argument("--churn-min-s", type=float, default=30.0)
    ap.add_argument("--churn-max-s", type=float, default=60.0)
    ap.add_argument(
        "--churning", type=int, default=1,
        help="churning instances of each role, each pair replaced by its own churner; 0: "
        "the long-lived pair alone (default 1)",
    )  # fmt: skip
    ap.add_argument("--peer-idle-s", type=float, default=45.0, help="instances' --peer-idle-s")
    ap.add_argument("--deadline-s", type=float, default=90.0, help="a request past it is hung")
    ap.add_argument(
        "--churn-after-s",
        type=float,
        default=0.0,
        help="the churning instances join (and churn) only after this long: the long-lived "
        "pair takes all the traffic first and reaches its working set",
    )
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--kv-cache-mb", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default="", help="process logs (default: a temp dir)")
    args = ap.parse_args()
    if args.churning < 0:
        ap.error("--churning must be 0 (no churn) or more")
    if args.quick:
        args.minutes, args.warmup_s = 2.0, 30.0
        args.churn_min_s, args.churn_max_s, args.peer_idle_s = 20.0, 30.0, 25.0
    return args


@dataclass
class Tally:
    """What the traffic saw."""

    num_ok: int = 0
    num_mismatch: int = 0
    num_hung: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    failures: list[dict[str, Any]] = field(default_factory=list)

    def fail(self, kind: str, router: int, session: str, error: str) -> None:
        self.errors[f"{kind}: {error[:200]}"] += 1
        if len(self.failures) < 200:
            self.failures.append({"kind": kind, "router": router, "session": session, "error": error})


class Churn:
    """The instances and routers of the run, and the DNS that names them."""

    def __init__(self, cluster: LocalCluster, dns: StaticDns, args: argparse.Namespace) -> None:
        self.cluster, self.dns, self.args = cluster, dns, args
        self.ports = {role: free_port() for role in ROLES}
        self.next_host = dict.fromkeys(ROLES, 1)
        self.long_lived: dict[str, Process] = {}
        self.churning: dict[str, list[Process]] = {role: [] for role in ROLES}
        """Each role's churning instances, by churner."""
        self.num_started = 0
        self._lock = threading.Lock()  # churners replace instances side by side

    def serve(self, role: str) -> Process:
        with self._lock:
            host = f"{ROLES[role]}.{self.next_host[role]}"
            self.next_host[role] += 1
            self.num_started += 1
        args = ["serve", "--model", self.args.model, "--role", role, "--log-level", "warning",
                "--kv-cache-mb", str(self.args.kv_cache_mb),
                "--peer-idle-s", str(self.args.peer_idle_s)]  # fmt: skip
        proc = self.cluster.start(f"{role}-{host}", args, self.ports[role], host=host)
        self.cluster.wait_healthy(timeout_s=300, procs=[proc])
        return proc

    def name(self) -> None:
        """DNS names each role's live instances."""
        with self._lock:
            for role in ROLES:
                procs = [self.long_lived[role], *self.churning[role]]
                hosts = [p.url.split("//")[1].split(":")[0] for p in procs]
                self.dns.set(f"{role}.churn.test", hosts)

    def start(self) -> list[str]:
        """Long-lived and first churning instances, two routers; the routers' URLs."""
        for role in ROLES:
            self.long_lived[role] = self.serve(role)
        if not self.args.churn_after_s:
            self.start_churning()
        self.name()
        routers = []
        for i in range(2):
            r = self.cluster.start(f"router-{i}", [
                "router", "--model", self.args.model, "--mode", "push", "--return-mode", "push",
                "--prefill-dns", f"prefill.churn.test:{self.ports['prefill']}",
                "--decode-dns", f"decode.churn.test:{self.ports['decode']}",
                "--dns-server", self.dns.address, "--dns-interval-s", "1",
                "--health-interval-s", "1",
            ], free_port())  # fmt: skip
            routers.append(r)
        self.cluster.wait_healthy(timeout_s=60, procs=routers, path="/ready")
        return [r.url for r in routers]

    def start_churning(self) -> None:
        """The first churning instances of each role, named at once."""
        for role in ROLES:
            started = [self.serve(role) for _ in range(self.args.churning)]
            with self._lock:
                self.churning[role] = started
        self.name()

    def replace(self, role: str, slot: int) -> None:
        """A new instance of `role` on a new address takes churner `slot`'s one's place."""
        new = self.serve(role)
        with self._lock:
            old, self.churning[role][slot] = self.churning[role][slot], new
        self.name()
        time.sleep(3.0)  # the routers resolve every second: let them stop choosing `old`
        self.cluster.stop_process(old, grace_s=30.0)


def reference_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip


async def session_worker(
    i: int, routers: list[str], reference: str, args: argparse.Namespace, stop_at: float,
    tally: Tally,
) -> None:  # fmt: skip
    rng = random.Random(args.seed * 1_000_003 + i)
    async with httpx.AsyncClient(timeout=args.deadline_s + 30) as client:
        n = 0
        while time.monotonic() < stop_at:
            session = f"churn-{args.seed}-{i}-{n}"
            history = [rng.randrange(5, 500) for _ in range(rng.randint(80, 200))]
            for turn in range(args.turns):
                if time.monotonic() >= stop_at:
                    return
                router = (i + turn) % len(routers)
                history += [rng.randrange(5, 500) for _ in range(rng.randint(8, 40))]
                b = reference_body(history, rng.randint(4, 16))
                b["model"] = args.model
                headers = {"x-session-id": session}
                try:
                    resp = await asyncio.wait_for(
                        client.post(routers[router] + "/v1/completions", json=b, headers=headers),
                        args.deadline_s,
                    )
                except TimeoutError:
                    tally.num_hung += 1
                    tally.fail("hung", router, session, f"no answer in {args.deadline_s:g} s")
                    break
                except httpx.HTTPError as exc:
                    tally.fail("transport", router, session, f"{type(exc).__name__}: {exc}")
                    break
                if resp.status_code != 200:
                    tally.fail("http", router, session, f"HTTP {resp.status_code}: {resp.text}")
                    break
                got = list(resp.json()["choices"][0]["token_ids"])
                ref = await client.post(reference + "/v1/completions", json=b)
                want = list(ref.json()["choices"][0]["token_ids"])
                if got != want:
                    tally.num_mismatch += 1
                    tally.fail("mismatch", router, session, f"got {got}, reference {want}")
                    break
                tally.num_ok += 1
                history += got
            n += 1


def scrape(url: str) -> dict[str, float]:
    """An instance's peer-table gauges, forgotten and met counts from its /metrics."""
    return parse_peers(httpx.get(url + "/metrics", timeout=5).text)


def parse_peers(text: str) -> dict[str, float]:
    """The peer-table gauges (by table), forgotten counts (``forgotten_<reason>``) and
    peers met (``met``) in a Prometheus exposition."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("kvduplex_kv_peers", "kvduplex_kv_peers_forgotten"):
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue
                key = s.labels.get("table") or "forgotten_" + s.labels.get("reason", "")
                out[key] = s.value
        elif family.name == "kvduplex_kv_peers_met":
            out["met"] = sum(s.value for s in family.samples if s.name.endswith("_total"))
    return out


def sample_loop(procs: dict[str, Process], every_s: float, stop: threading.Event,
                samples: list[dict[str, Any]]) -> None:  # fmt: skip
    t0 = time.monotonic()
    while True:
        row: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1)}
        for name, p in procs.items():
            rss = read_rss_bytes(p.popen.pid)
            try:
                peers = scrape(p.url)
            except httpx.HTTPError as exc:
                peers = {"error": str(exc)}  # type: ignore[dict-item]
            row[name] = {"rss_mib": None if rss is None else round(rss / 2**20, 1),
                         "threads": read_threads(p.popen.pid), **peers}  # fmt: skip
            smaps = read_smaps_by_class(p.popen.pid)
            if smaps is not None:
                row[name]["smaps"] = {
                    c: {"n": u.num_mappings, "rss_mib": round(u.rss_kib / 1024, 2),
                        "private_dirty_mib": round(u.private_dirty_kib / 1024, 2)}
                    for c, u in smaps.items()
                }  # fmt: skip
        samples.append(row)
        if stop.wait(every_s):
            return


def slope_mib_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) points, in MiB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return None if den == 0 else 60 * sum((t - mt) * (v - mv) for t, v in points) / den


def by_class(series: list[tuple[float, dict[str, Any]]], warmup_s: float) -> dict[str, Any]:
    """Per mapping class, and ``all`` of them: RSS at the end, the RSS and Private_Dirty
    slopes after the warm-up, and the mappings at the end."""
    after = [(t, s["smaps"]) for t, s in series if t >= warmup_s and "smaps" in s]
    if not after:
        return {}
    rows_by_class = {c: [(t, sm[c]) for t, sm in after if c in sm] for c in MAPPING_CLASSES}
    rows_by_class["all"] = [
        (t, {k: sum(u[k] for u in sm.values()) for k in ("n", "rss_mib", "private_dirty_mib")})
        for t, sm in after
    ]
    out: dict[str, Any] = {}
    for c, rows in rows_by_class.items():
        out[c] = {
            "rss_end_mib": round(rows[-1][1]["rss_mib"], 2) if rows else None,
            "rss_slope_mib_per_min": slope_mib_per_min([(t, u["rss_mib"]) for t, u in rows]),
            "private_dirty_slope_mib_per_min": slope_mib_per_min(
                [(t, u["private_dirty_mib"]) for t, u in rows]
            ),
            "mappings_end": rows[-1][1]["n"] if rows else None,
        }
    return out


def summarize(samples: list[dict[str, Any]], names: list[str], warmup_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in names:
        series = [(r["t_s"], r[name]) for r in samples if name in r]
        rss = [(t, s["rss_mib"]) for t, s in series if t >= warmup_s and s.get("rss_mib")]
        last = series[-1][1] if series else {}
        out[name] = {
            "rss_slope_mib_per_min": slope_mib_per_min(rss),
            "rss_end_mib": last.get("rss_mib"),
            "threads_end": last.get("threads"),
            "by_class": by_class(series, warmup_s),
            "peers_transport_max": max((s.get("transport", 0) for _, s in series), default=0),
            "peers_transport_end": last.get("transport"),
            "peers_directory_end": last.get("directory"),
            "forgotten_end": {k[10:]: v for k, v in last.items() if k.startswith("forgotten_")},
            "peers_met": max((s.get("met", 0) for _, s in series), default=0),
        }
    return out


HEADER = ["long-lived", "RSS end MiB", "RSS slope MiB/min", "threads end", "peers max", "peers end",
          "directory end", "forgotten", "peers met"]  # fmt: skip


CLASS_HEADER = ["long-lived", "class", "RSS end MiB", "RSS slope MiB/min",
                "Private_Dirty slope MiB/min", "mappings end"]  # fmt: skip


def report(summary: dict[str, Any], tally: Tally, num_started: int, minutes: float) -> str:
    rows = [[name, s["rss_end_mib"], _fmt(s["rss_slope_mib_per_min"]), s.get("threads_end"),
             s["peers_transport_max"],
             s["peers_transport_end"], s["peers_directory_end"],
             ", ".join(f"{k} {v:g}" for k, v in sorted(s["forgotten_end"].items())),
             f"{s['peers_met']:g}"]
            for name, s in summary.items()]  # fmt: skip
    lines = [
        f"# Churn soak: {minutes:g} min, {num_started} instances started\n",
        f"requests ok {tally.num_ok}, token mismatches {tally.num_mismatch}, "
        f"hung {tally.num_hung}, failed {sum(tally.errors.values())}\n",
        md_table(HEADER, rows),
    ]
    class_rows = [
        [name, c, u["rss_end_mib"], _fmt(u["rss_slope_mib_per_min"]),
         _fmt(u["private_dirty_slope_mib_per_min"]), u["mappings_end"]]
        for name, s in summary.items() for c, u in s.get("by_class", {}).items()
    ]  # fmt: skip
    if class_rows:
        lines += ["", "## RSS by mapping class (slopes after the warm-up)\n",
                  md_table(CLASS_HEADER, class_rows)]  # fmt: skip
    if tally.errors:
        lines += ["", "## Failures", *(f"* {n} x {e}" for e, n in tally.errors.most_common(20))]
    return "\n".join(lines)


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:+.2f}"


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the cluster
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvduplex-churn-"))
    tally = Tally()
    samples: list[dict[str, Any]] = []
    with LocalCluster(log_dir=log_dir) as cluster, StaticDns() as dns:
        churn = Churn(cluster, dns, args)
        routers = churn.start()
        ref = cluster.start("reference", ["serve", "--model", args.model, "--role", "both",
                                          "--kv-cache-mb", str(args.kv_cache_mb)], free_port())  # fmt: skip
        cluster.wait_healthy(timeout_s=300, procs=[ref])
        watched = {f"{role}-long-lived": p for role, p in churn.long_lived.items()}
        stop = threading.Event()
        sampler = threading.Thread(target=sample_loop, args=(watched, args.sample_s, stop, samples))
        sampler.start()
        stop_at = time.monotonic() + args.minutes * 60
        rng = random.Random(args.seed)

        def churner(slot: int, rng: random.Random) -> None:
            role = slot  # churners start on alternate roles
            while not stop.wait(rng.uniform(args.churn_min_s, args.churn_max_s)):
                if time.monotonic() >= stop_at:
                    return
                churn.replace(list(ROLES)[role % 2], slot)
                role += 1

        rngs = [rng, *(random.Random(args.seed * 7919 + i) for i in range(1, args.churning))]
        rngs = rngs[: args.churning]
        churn_threads = [threading.Thread(target=churner, args=(i, r), daemon=True)
                         for i, r in enumerate(rngs)]  # fmt: skip

        def begin_churn() -> None:
            if args.churn_after_s:
                if stop.wait(args.churn_after_s):
                    return
                churn.start_churning()
            for t in churn_threads:
                t.start()

        beginner = threading.Thread(target=begin_churn, daemon=True)
        beginner.start()
        workers = [session_worker(i, routers, ref.url, args, stop_at, tally)
                   for i in range(args.sessions)]  # fmt: skip

        async def run_all() -> None:
            await asyncio.gather(*workers)

        try:
            asyncio.run(run_all())
        finally:  # on SIGTERM too: no churner starts an instance while the cluster stops
            stop.set()
            beginner.join()
            for t in churn_threads:
                if t.is_alive():
                    t.join()
            sampler.join()
    summary = summarize(samples, list(watched), args.warmup_s)
    table = report(summary, tally, churn.num_started, args.minutes)
    data = {"config": vars(args), "summary": summary, "requests_ok": tally.num_ok,
            "mismatches": tally.num_mismatch, "hung": tally.num_hung,
            "errors": dict(tally.errors), "failures": tally.failures, "samples": samples,
            "log_dir": str(log_dir)}  # fmt: skip
    path = write_results(f"churn-{Path(args.model).name}", data, table)
    print(table)
    print(f"wrote {path} (logs in {log_dir})")
    return 1 if tally.errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
