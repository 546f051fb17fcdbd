"""What a multi-host run showed: failures by cause, duplex hits by route, where turns went.

Duplex hit of a turn (its index >= 1, the previous turn of its session completed):
of the previous answer's KV that a return can give prefill (the answer but its
last token, which has no KV, up to the last full block), the share that the
turn's prefill found cached (``usage.prompt_tokens_details.cached_tokens``, the
prompt-computing instance's prefix-cache hit)::

    previous prompt | previous answer       |x| new input
    ^0              ^p                  ^end    (end = (p + answer - 1) // block * block)
    hit = clamp(cached - p, 0, end - p) / (end - p)

Only the duplex return puts an answer's KV in prefill's cache, so this is the
return's hit. Each turn falls in one group, the first that applies:

* decode computed the prompt (``usage.kv.prefill_computed_tokens`` = 0: prefill
  refused it, e.g. draining, or could not be reached): its cached tokens are
  decode's own, prefill's cache was not asked;
* decode computed the previous turn's prompt: that answer was returned to the
  prefill instance that failed it, if to any;
* the session's prefill changed since the previous turn (its rendezvous choice
  among the published prefill instances: the drain moved it);
* the previous turn went through the other router, or through the same one.
"""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field

from benchmarks.multihost_load import TurnRecord
from kvduplex.router import rendezvous

HIT_GROUPS = (
    "previous turn via the same router",
    "previous turn via the other router",
    "session's prefill changed (drain)",
    "decode computed the previous turn's prompt",
    "decode computed the prompt",
)


@dataclass
class HitGroup:
    num_turns: int = 0
    num_full: int = 0
    """Turns that found all of the previous answer's returnable KV cached."""
    num_hit_tokens: int = 0
    num_returnable_tokens: int = 0

    @property
    def rate(self) -> float | None:
        if not self.num_returnable_tokens:
            return None
        return self.num_hit_tokens / self.num_returnable_tokens


@dataclass(frozen=True)
class Membership:
    """The published instances of one role over time: ``(seconds, urls)`` from then on."""

    changes: list[tuple[float, list[str]]]

    def at(self, t_s: float) -> list[str]:
        urls: list[str] = []
        for since, now in self.changes:
            if since > t_s:
                break
            urls = now
        return urls


def rendezvous_choice(session: str, urls: list[str]) -> str | None:
    return rendezvous.rank(session, urls, str)[0] if urls else None


def duplex_hits(
    turns: list[TurnRecord], block_size: int, prefill: Membership
) -> dict[str, HitGroup]:
    """Turns with index >= 1 by group (`HIT_GROUPS`, see the module docstring)."""
    groups = {g: HitGroup() for g in HIT_GROUPS}
    by_key = {(t.session, t.turn): t for t in turns}
    for t in turns:
        prev = by_key.get((t.session, t.turn - 1))
        if prev is None or not prev.ok or not t.ok:
            continue
        p = len(prev.prompt)
        end = (p + len(prev.result.token_ids) - 1) // block_size * block_size
        if end <= p:
            continue
        kv, prev_kv = t.result.kv, prev.result.kv
        p_then = rendezvous_choice(t.session, prefill.at(prev.attempts[-1].start_s))
        p_now = rendezvous_choice(t.session, prefill.at(t.attempts[-1].start_s))
        if kv is not None and kv.prefill_computed_tokens == 0:
            group = groups["decode computed the prompt"]
        elif prev_kv is not None and prev_kv.prefill_computed_tokens == 0:
            group = groups["decode computed the previous turn's prompt"]
        elif p_then != p_now:
            group = groups["session's prefill changed (drain)"]
        elif prev.router != t.router:
            group = groups["previous turn via the other router"]
        else:
            group = groups["previous turn via the same router"]
        hit = min(max(t.result.cached_tokens - p, 0), end - p)
        group.num_turns += 1
        group.num_full += hit == end - p
        group.num_hit_tokens += hit
        group.num_returnable_tokens += end - p
    return groups


@dataclass
class Failures:
    """Turns by what happened to their attempts around the router kill."""

    num_in_flight_at_kill: int = 0
    """First attempts to the killed router that had begun and not ended at the kill."""
    num_in_flight_completed: int = 0
    """Of those, the turns that completed on the other router."""
    num_refused_after_kill: int = 0
    """First attempts to the killed router that began after the kill (sent once more)."""
    num_retried_other: int = 0
    """Turns sent twice for another reason (none expected)."""
    failed_in_flight: list[str] = field(default_factory=list)
    """Errors of failed turns whose first attempt was in flight at the kill."""
    failed_other: list[str] = field(default_factory=list)
    """Errors of every other failed turn."""


def failures(turns: list[TurnRecord], killed_router: int | None, kill_s: float | None) -> Failures:
    """Attempts classified by the kill of router `killed_router` at `kill_s` (None: none)."""
    out = Failures()
    kill = float("inf") if kill_s is None else kill_s
    for t in turns:
        first = t.attempts[0]
        on_killed = first.router == killed_router
        in_flight = on_killed and first.start_s < kill <= first.end_s
        if in_flight:
            out.num_in_flight_at_kill += 1
            out.num_in_flight_completed += t.ok
        elif len(t.attempts) > 1:
            if on_killed and first.start_s >= kill:
                out.num_refused_after_kill += 1
            else:
                out.num_retried_other += 1
        if not t.ok:
            err = f"{t.session} turn {t.turn}: {t.result.error[:200]}"
            (out.failed_in_flight if in_flight else out.failed_other).append(err)
    return out


def served_by_decode(
    turns: list[TurnRecord], records: dict[str, dict[str, dict[str, object]]]
) -> dict[str, list[TurnRecord]]:
    """Completed turns by the decode instance that answered them (`records`: each decode's
    duplex-return records by request id, which a response's id is); unknown ones under ''."""
    where = {rid: label for label, recs in records.items() for rid in recs}
    out: dict[str, list[TurnRecord]] = {}
    for t in turns:
        if t.ok:
            out.setdefault(where.get(t.result.response_id, ""), []).append(t)
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


@dataclass
class Timeline:
    """When each event of the run happened, in seconds from the start of the load."""

    join_started_s: float | None = None
    """The joining decode's process was started."""
    join_published_s: float | None = None
    """It was healthy, and its address joined the decode name."""
    drain_s: float | None = None
    """The drained prefill's address left the prefill name, and it got SIGTERM."""
    drain_exit_s: float | None = None
    """It exited (None: it had not by the end)."""
    drain_exit_code: int | None = None
    kill_s: float | None = None
    """The killed router got SIGKILL."""


@dataclass(frozen=True)
class Labels:
    """Who played each part."""

    routers: tuple[str, ...]
    killed_router: int
    joined: str
    drained: str


HIT_BAR = 0.99
"""Duplex hit of turns whose previous turn went through the other router: at least this."""


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _hit_cell(g: HitGroup, whose: str = "") -> str:
    if not g.num_turns:
        return "no such turn"
    if whose:
        return f"{g.num_turns} turns ({pct(g.rate)} cached, {whose})"
    return (f"{pct(g.rate)} of {g.num_returnable_tokens} returnable tokens "
            f"({g.num_full} of {g.num_turns} turns whole)")  # fmt: skip


def _pool_ok(st: dict[str, object]) -> bool:
    return bool(
        st["integrity_ok"] and st["num_in_use"] == 0 and st["num_running"] == 0
        and st["num_waiting"] == 0
    )  # fmt: skip


@dataclass
class Observed:
    """What a run saw, for `format_report`."""

    turns: list[TurnRecord]
    labels: Labels
    timeline: Timeline
    hits: dict[str, HitGroup]
    failures: Failures
    by_decode: dict[str, list[TurnRecord]]
    """Completed turns by the decode instance that answered them (`served_by_decode`)."""
    pools: dict[str, dict[str, object]]
    """``/internal/kv/stats`` of every instance still up, by label."""
    drained_in_s: float | None
    """What the drained instance logged (``drained in N s``); None: nothing."""
    returns: dict[str, dict[str, int]]
    """``/internal/kv/return/stats`` of each decode instance, by label."""
    declined: dict[str, float]
    """Return offers prefill declined, by reason (``kvduplex_kv_return_declined_total``)."""


Row = tuple[str, str, str, bool | None]
"""(what, bar, seen, met: None where there is no bar)."""


def _answer_rows(obs: Observed) -> list[Row]:
    completed = [t for t in obs.turns if t.ok]
    wrong = [t for t in completed if t.is_exact is False]
    unchecked = [t for t in completed if t.is_exact is None]
    f, lb = obs.failures, obs.labels
    killed, other = lb.routers[lb.killed_router], lb.routers[1 - lb.killed_router]
    return [
        ("turns completed", "", f"{len(completed)} of {len(obs.turns)}", None),
        ("completed turns not token-exact against the reference", "0",
         f"{len(wrong)}" + (f" ({len(unchecked)} not checked)" if unchecked else ""),
         not wrong and not unchecked),
        ("failed turns, other than in flight on the killed router", "0",
         f"{len(f.failed_other)}", not f.failed_other),
        (f"turns in flight on {killed} at its kill", "may fail",
         f"{f.num_in_flight_at_kill}: {f.num_in_flight_completed} completed when sent "
         f"to {other}, {len(f.failed_in_flight)} failed", None),
        (f"turns sent to {killed} after its kill (refused), sent to {other}", "",
         f"{f.num_refused_after_kill}", None),
        ("turns sent twice for another reason", "", f"{f.num_retried_other}", None),
    ]  # fmt: skip


def _hit_rows(obs: Observed) -> list[Row]:
    via_other = obs.hits["previous turn via the other router"]
    rows: list[Row] = [
        ("duplex hit, turns >= 2, previous turn via the other router", f">= {pct(HIT_BAR)}",
         _hit_cell(via_other), via_other.rate is not None and via_other.rate >= HIT_BAR),
    ]  # fmt: skip
    for g in HIT_GROUPS[:1] + HIT_GROUPS[2:-1]:
        rows.append((f"duplex hit, turns >= 2, {g}", "", _hit_cell(obs.hits[g]), None))
    g = HIT_GROUPS[-1]
    rows.append((f"turns >= 2: {g}", "", _hit_cell(obs.hits[g], "by decode's own cache"), None))
    return rows


def _host_rows(obs: Observed) -> list[Row]:
    tl, lb, pools = obs.timeline, obs.labels, obs.pools
    published = tl.join_published_s if tl.join_published_s is not None else float("inf")
    joined = [t for t in obs.by_decode.get(lb.joined, []) if t.attempts[-1].start_s >= published]
    first = min((t.attempts[-1].start_s for t in joined), default=None)
    drained = "no 'drained in' logged" if obs.drained_in_s is None else (
        f"drained in {obs.drained_in_s:.2f} s")  # fmt: skip
    bad_pools = {label: st for label, st in pools.items() if not _pool_ok(st)}
    completed = [t for t in obs.turns if t.ok]
    return [
        (f"{lb.joined}: turns it answered after joining", "> 0",
         f"{len(joined)} (first sent at {_s(first)})", bool(joined)),
        (f"{lb.drained}: drain after SIGTERM", "exit 0, drained",
         f"exit {tl.drain_exit_code}, {drained}",
         tl.drain_exit_code == 0 and obs.drained_in_s is not None),
        ("blocks in use after the load, on every instance up", "0",
         ", ".join(f"{label} {st['num_in_use']}" for label, st in pools.items()),
         all(st["num_in_use"] == 0 for st in pools.values())),
        ("pool integrity; nothing running or waiting", "ok",
         "ok" if not bad_pools else "; ".join(f"{k}: {v}" for k, v in bad_pools.items()),
         not bad_pools),
        ("duplex returns offered by decode: done, failed, declined (why)", "",
         ", ".join(str(sum(r[k] for r in obs.returns.values()))
                   for k in ("num_done", "num_failed", "num_declined"))
         + "".join(f"; {reason} {n:.0f}" for reason, n in sorted(obs.declined.items()) if n),
         None),
        ("completed turns by router", "",
         ", ".join(f"{r} {sum(t.router == i for t in completed)}"
                   for i, r in enumerate(lb.routers)), None),
        ("completed turns by decode", "",
         ", ".join(f"{label or 'unknown'} {len(ts)}"
                   for label, ts in sorted(obs.by_decode.items())), None),
    ]  # fmt: skip


def format_report(title: str, obs: Observed) -> tuple[str, bool]:
    """The Markdown report, and whether every bar was met."""
    rows = _answer_rows(obs) + _hit_rows(obs) + _host_rows(obs)
    tl, lb = obs.timeline, obs.labels
    events = (
        f"{lb.joined} started at {_s(tl.join_started_s)}, joined DNS at "
        f"{_s(tl.join_published_s)}; {lb.drained} left DNS and got SIGTERM at "
        f"{_s(tl.drain_s)}, exited at {_s(tl.drain_exit_s)}; {lb.routers[lb.killed_router]} "
        f"got SIGKILL at {_s(tl.kill_s)} (seconds from the start of the load)."
    )
    lines = [f"# {title}", "", events, "", "| check | bar | seen | met |", "|---|---|---|---|"]
    for what, bar, seen, met in rows:
        mark = "" if met is None else "yes" if met else "NO"
        lines.append(f"| {what} | {bar} | {seen} | {mark} |")
    errors = obs.failures.failed_other[:5] + obs.failures.failed_in_flight[:5]
    if errors:
        lines += ["", "Failed turns (first few):", *(f"- {e}" for e in errors)]
    return "\n".join(lines), all(met is not False for *_, met in rows)
