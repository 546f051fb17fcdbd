"""Each session turn's plan, and whether its return is kept: by where the session's KV
likely is (`residency`), from what the session table noted of its previous turn."""

from __future__ import annotations

from collections.abc import Sequence

from kvduplex.router.backends import Backend
from kvduplex.router.config import RouterTuning
from kvduplex.router.policy import Route
from kvduplex.router.residency import Plan
from kvduplex.router.residency import Residency
from kvduplex.router.residency import choose_plan
from kvduplex.router.sessions import Session
from kvduplex.router.sessions import SessionTable


def turn_plan(config: RouterTuning, route: Route, num_prompt_tokens: int) -> Plan:
    """Push mode: the plan of a turn with `num_prompt_tokens` prompt tokens on `route`.

    Decode computes the turn alone (`Plan.DECODE_LOCAL`) when its new part is at most
    ``--short-append-tokens`` long. Else, with ``--plan-by-residency``, where decode likely
    holds more of the session's history than prefill, prefill fetches it from decode
    (`Plan.PREFILL_FETCH`) or decode computes the new tokens, whichever is cheaper by
    `residency.choose_plan` (``--fetch-token-cost``, ``--decode-token-cost``,
    ``--prefer-fetch``); else prefill computes what it lacks (`Plan.PUSH`).
    Either way decode must hold the previous turn (prompt and answer) as far as the router
    knows: it served it, and its answer ended."""
    prev, p = route.previous, route.prefill
    if p is None or prev is None or prev.num_answer_tokens is None:
        return Plan.PUSH
    if prev.decode_url != route.decode.url:
        return Plan.PUSH
    num_new = num_prompt_tokens - (prev.num_prompt_tokens + prev.num_answer_tokens - 1)
    if 0 < num_new <= config.short_append_tokens:
        return Plan.DECODE_LOCAL
    if not config.plan_by_residency:
        return Plan.PUSH
    where = Residency(
        prefill_tokens=_held(p, prev, route, prev.prefill_stamp, prev.prefill_tokens),
        decode_tokens=_held(route.decode, prev, route, prev.decode_stamp, prev.decode_tokens),
    )  # fmt: skip
    return choose_plan(
        num_prompt_tokens, where, config.decode_token_cost, config.fetch_token_cost,
        config.prefer_fetch,
    )  # fmt: skip


def _held(b: Backend, prev: Session, route: Route, stamp: int | None, num_tokens: int) -> int:
    """Tokens of this turn's prompt `b` likely holds: what it took of the session, if its
    pool has not turned over since, and only the previous prompt of it if this prompt does
    not hold the previous answer where it left it."""
    if not b.kv_clock.holds(stamp):
        return 0
    if route.reuses_answer is False:
        return min(num_tokens, prev.num_prompt_tokens)
    return num_tokens


def is_return_kept(route: Route, plan: Plan, now: float) -> bool:
    """Whether returning this turn to its prefill instance likely pays: prefill holds the
    history the returned blocks extend (it computes this prompt itself in a push; in a
    decode-local turn, only if it still holds the previous one), and will still hold it
    at the session's next turn. The history's blocks age from when prefill last computed
    them (a return refreshes only the answer's), so they must outlast this turn's answer
    and the client's think time, each expected as long as the previous turn's."""
    p, prev = route.prefill, route.previous
    if p is None:
        return False
    if plan is Plan.DECODE_LOCAL and (
        prev is None or prev.prefill_url != p.url or not p.kv_clock.holds(prev.prefill_stamp)
    ):
        return False
    if prev is None or prev.answered_at is None:
        return p.kv_clock.keeps_for(None if prev is None else prev.gap_s)
    answer_s = prev.answered_at - prev.last_used
    return p.kv_clock.keeps_for(answer_s + (now - prev.answered_at))


def note_turn_held(
    sessions: SessionTable, route: Route, ids: Sequence[int], num_answer_tokens: int, now: float
) -> None:
    """The turn with prompt `ids` on `route` answered `num_answer_tokens` tokens: decode
    holds its prompt and answer (but the answer's last token, which has no KV), released
    about now; if the turn is returned, prefill holds the answer too, after a history
    whose stamp stays that of its last computation there."""
    session = sessions.get(route.session_id, now)
    if session is None or session.num_prompt_tokens != len(ids):
        return  # a later turn was recorded meanwhile
    end = len(ids) + num_answer_tokens - 1
    stamp = route.decode.kv_clock.allocated
    sessions.note_held(route.session_id, ids, is_prefill=False, stamp=stamp, num_tokens=end)
    if session.is_returned and route.prefill is not None:
        limit = session.return_limit
        sessions.note_held(
            route.session_id, ids, is_prefill=True, stamp=None,
            num_tokens=end if limit is None else min(end, limit),
        )  # fmt: skip
