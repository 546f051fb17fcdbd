"""An agent's tool loop with the official `openai` client, through a push+duplex router.

The agent defines a shell tool. On even turns it forces a call (``tool_choice``
``required``: grammar-constrained, so even random weights answer a valid call), runs
it and sends the result back as a ``tool`` message; on odd turns it lets the model
answer (``auto``, with the router's ``hermes`` tool-call parser and ``deepseek_r1``
reasoning parser: a random model's answer is all reasoning) and strips the reasoning
before sending the answer back, as Qwen3 and DeepSeek clients do. Every reply must
parse into the client's types, and each must be token for token the reply of a
colocated instance (same flags) given the same messages.

The duplex return gives prefill only what the next prompt holds: an answer without
reasoning whole, a reasoning turn (whose reasoning the client strips) up to its prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from tests.integration.conftest import assert_pool_clean
from tests.integration.conftest import metric
from tests.integration.conftest import wait_until
from tests.skips import skip_module_without_nixl

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.integration

skip_module_without_nixl()

_PARSERS = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice",
            "--reasoning-parser", "deepseek_r1"]  # fmt: skip
_SERVE = ["serve", "--model", "tiny", "--num-blocks", "600", "--log-level", "warning"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "maxLength": 24}},
                "required": ["command"],
            },
        },
    }
]
NUM_TURNS = 6


@dataclass
class Rig:
    prefill: str
    decode: str
    reference: str
    router: str


@pytest.fixture(scope="module")
def rig(cluster: LocalCluster) -> Iterator[Rig]:
    p = cluster.start("prefill", [*_SERVE, "--role", "prefill"], free_port())
    d = cluster.start("decode", [*_SERVE, "--role", "decode"], free_port())
    ref = cluster.start("reference", [*_SERVE, "--role", "both", *_PARSERS], free_port())
    cluster.wait_healthy(timeout_s=180)
    args = ["router", "--model", "tiny", "--prefill", p.url, "--decode", d.url,
            "--return-mode", "push", *_PARSERS]  # fmt: skip
    router = cluster.start("router", args, free_port())
    cluster.wait_healthy(timeout_s=60)
    yield Rig(p.url, d.url, ref.url, router.url)


def _ask(client: Any, messages: list[dict[str, Any]], turn: int) -> tuple[Any, list[int]]:
    """One request; the parsed reply and its token ids (``return_token_ids``)."""
    resp = client.chat.completions.create(
        model="tiny",
        messages=messages,
        tools=TOOLS,
        tool_choice="required" if turn % 2 == 0 else "auto",
        parallel_tool_calls=False,  # a forced answer is one call, not an array of them
        max_tokens=96,
        temperature=0.0,
        extra_body={"return_token_ids": True, "session_id": "agent-loop"},
    )
    choice = resp.choices[0]
    return choice, list((choice.model_extra or {})["token_ids"])


def _without_call_ids(message: Any) -> dict[str, Any]:
    """The reply as parsed, but for the tool calls' ids (each server makes its own)."""
    out = dict(message.model_dump(exclude_none=True))
    out["tool_calls"] = [
        {k: v for k, v in call.items() if k != "id"} for call in out.get("tool_calls", [])
    ]
    return out


def test_a_tool_loop_through_push_and_duplex_matches_colocated(rig: Rig) -> None:
    agent = openai.OpenAI(base_url=rig.router + "/v1", api_key="unused", max_retries=0)
    colocated = openai.OpenAI(base_url=rig.reference + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Use the shell tool."},
        {"role": "user", "content": "Find why the build fails and fix it."},
    ]
    forced_hits: list[tuple[int, int]] = []  # (hit, returnable) of each forced call's answer
    for turn in range(NUM_TURNS):
        before = _session_hits(rig, "agent-loop")
        choice, ids = _ask(agent, messages, turn)
        if turn % 2 == 1:  # this prompt sent the forced call back as returned
            after = _session_hits(rig, "agent-loop")
            forced_hits.append((after[0] - before[0], after[1] - before[1]))
        ref_choice, ref_ids = _ask(colocated, messages, turn)
        assert ids == ref_ids, f"turn {turn}: the router's answer is not colocated's"
        message = choice.message
        assert _without_call_ids(message) == _without_call_ids(ref_choice.message), turn
        if turn % 2 == 0:  # a forced call: valid arguments for the tool's schema
            assert choice.finish_reason == "tool_calls", (turn, message)
            assert message.tool_calls, turn
            call = message.tool_calls[0]
            assert call.function.name == "run_shell"
            args = json.loads(call.function.arguments)
            assert isinstance(args["command"], str) and len(args["command"]) <= 24
            messages.append(message.model_dump(exclude_none=True))
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": f"exit 1: step {turn}"}
            )
        else:  # the parser split the answer: all of a random model's text is reasoning
            assert message.tool_calls is None, turn
            reasoning = (message.model_extra or {}).get("reasoning_content")
            assert reasoning, f"turn {turn}: no reasoning_content"
            # The client strips the reasoning before sending the answer back.
            messages.append({"role": "assistant", "content": message.content or ""})
            messages.append({"role": "user", "content": f"Now try step {turn + 1}."})
    # The forced calls' returned blocks were read: the next prompt spliced the generated ids
    # (the template renders a call otherwise), so the session kept returning.
    hit = sum(h for h, _ in forced_hits)
    returnable = sum(r for _, r in forced_hits)
    assert returnable > 0 and hit / returnable >= 0.95, forced_hits
    view = _session_view(rig, "agent-loop")
    assert view["is_returning"], view
    push = httpx.get(rig.decode + "/internal/kv/push/stats", timeout=10).json()
    assert push["num_received"] == NUM_TURNS and push["num_fallbacks"] == 0, push
    returns = httpx.get(rig.decode + "/internal/kv/return/stats", timeout=10).json()
    assert returns["num_offered"] >= 1 and returns["num_failed"] == 0, returns
    for url in (rig.prefill, rig.decode, rig.reference):
        assert_pool_clean(url)


def _session_view(rig: Rig, session_id: str) -> dict[str, Any]:
    sessions = httpx.get(rig.router + "/sessions", timeout=10).json()["sessions"]
    view = [v for v in sessions if v["session_id"] == session_id]
    return dict(view[0]) if view else {}


def _session_hits(rig: Rig, session_id: str) -> tuple[int, int]:
    """The router's count of the session's returned answer tokens hit, and returnable."""
    view = _session_view(rig, session_id)
    return view.get("answer_tokens_hit", 0), view.get("answer_tokens_returnable", 0)


def _returned(rig: Rig) -> tuple[int, float]:
    """Returns decode offered, and blocks it sent back, once every return settled."""

    def settled() -> bool:
        st = httpx.get(rig.decode + "/internal/kv/return/stats", timeout=10).json()
        return bool(st["num_offered"] == st["num_done"] + st["num_declined"] + st["num_failed"])

    wait_until(settled, timeout_s=60, what="returns to settle")
    st = httpx.get(rig.decode + "/internal/kv/return/stats", timeout=10).json()
    return st["num_offered"], metric(
        rig.decode, "kvduplex_kv_return_blocks_total", direction="sent"
    )


def test_reasoning_the_client_strips_is_never_returned_and_whole_answers_are_hit(
    rig: Rig,
) -> None:
    """Turns alternate: a JSON answer (``response_format``: no reasoning), sent back whole,
    and a free answer (all reasoning, for a random model), sent back stripped."""
    bs = int(httpx.get(rig.decode + "/health", timeout=10).json()["block_size"])
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Answer in JSON. " * 3},
        {"role": "user", "content": "Find why the tests fail."},
    ]
    prev: tuple[int, int] | None = None  # the previous turn's prompt and answer tokens
    for turn in range(NUM_TURNS):
        offered, sent = _returned(rig)
        is_json = turn % 2 == 0
        body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 96,
                                "min_tokens": 40, "temperature": 1.0, "seed": 7,
                                "session_id": "agent-strip"}  # fmt: skip
        if is_json:
            body.update(
                response_format={"type": "json_object"},
                max_tokens=48,
                min_tokens=0,
                temperature=0.0,
                ignore_eos=True,
            )
        resp = httpx.post(rig.router + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        out = resp.json()
        message, usage = out["choices"][0]["message"], out["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if prev is not None and not is_json:  # the JSON answer came back whole: hit
            assert cached >= (prev[0] + prev[1] - 1) // bs * bs, (turn, cached, prev)
        prev = (usage["prompt_tokens"], usage["completion_tokens"])
        now_offered, now_sent = _returned(rig)
        if is_json:  # returned whole: its answer's blocks
            assert now_offered == offered + 1 and now_sent > sent, turn
            messages.append(message)
        else:  # all reasoning: nothing of it went back
            assert message["reasoning_content"], (
                message,
                usage,
                out["choices"][0].get("finish_reason"),
            )
            assert usage["completion_tokens"] >= 2 * bs
            assert now_offered == offered and now_sent == sent, turn
            messages.append({"role": "assistant", "content": message["content"] or ""})
        messages.append({"role": "user", "content": f"Try step {turn + 1}."})
    view = [v for v in httpx.get(rig.router + "/sessions", timeout=10).json()["sessions"]
            if v["session_id"] == "agent-strip"]  # fmt: skip
    assert view and view[0]["is_returning"] and view[0]["answer_hit_rate"] == 1.0, view
    for url in (rig.prefill, rig.decode, rig.reference):
        assert_pool_clean(url)


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_a_parsed_answer_through_push_match_colocated(rig: Rig, stream: bool) -> None:
    """Every token of an answer the router parses (all reasoning) has its logprobs entry,
    the first one (prefill's) included, as on a colocated instance with the same parser."""
    body = {"model": "tiny", "max_tokens": 12, "temperature": 1.0, "seed": 5, "min_tokens": 12,
            "messages": [{"role": "user", "content": "Think first."}], "logprobs": True,
            "top_logprobs": 2, "stream": stream}  # fmt: skip

    def entries(url: str) -> list[dict[str, Any]]:
        if not stream:
            resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            return list(resp.json()["choices"][0]["logprobs"]["content"])
        out: list[dict[str, Any]] = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        out.extend((choice.get("logprobs") or {}).get("content") or [])
        return out

    got, want = entries(rig.router), entries(rig.reference)
    assert len(got) == len(want) == 12
    for g, w in zip(got, want, strict=True):
        assert g["token"] == w["token"] and abs(g["logprob"] - w["logprob"]) <= 1e-5, (g, w)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]


def test_a_call_the_agent_edits_is_rendered_as_sent_and_never_hit(rig: Rig) -> None:
    """An agent that rewrites a forced call's arguments before sending it back (a sanitised
    command, say) gets the answer a colocated instance gives for those messages: the edited
    call is rendered from its text, not spliced from the ids generated. The prompt no longer
    holds the answer returned, so the router counts nothing against it (its hit rate is
    over answers sent back) and stops returning the session's turns."""
    agent = openai.OpenAI(base_url=rig.router + "/v1", api_key="unused", max_retries=0)
    colocated = openai.OpenAI(base_url=rig.reference + "/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent. Use the shell tool."},
        {"role": "user", "content": "List the files, then read the build log."},
    ]
    session = "agent-edit"

    def ask(client: Any, turn: int) -> tuple[Any, list[int]]:
        resp = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS,
            tool_choice="required" if turn % 2 == 0 else "auto", parallel_tool_calls=False,
            max_tokens=96, temperature=0.0,
            extra_body={"return_token_ids": True, "session_id": session},
        )  # fmt: skip
        choice = resp.choices[0]
        return choice, list((choice.model_extra or {})["token_ids"])

    choice, ids = ask(agent, 0)
    assert ids == ask(colocated, 0)[1]
    call = choice.message.tool_calls[0]
    edited = choice.message.model_dump(exclude_none=True)
    command = json.loads(call.function.arguments)["command"]
    edited["tool_calls"][0]["function"]["arguments"] = json.dumps({"command": command + " -l"})
    messages += [edited, {"role": "tool", "tool_call_id": call.id, "content": "exit 0"}]
    before = _session_hits(rig, session)
    assert _session_view(rig, session)["is_returning"]  # turn 0's call was returned
    choice, ids = ask(agent, 1)
    ref_choice, ref_ids = ask(colocated, 1)
    assert ids == ref_ids, "the router's answer after an edited call is not colocated's"
    assert _without_call_ids(choice.message) == _without_call_ids(ref_choice.message)
    assert _session_hits(rig, session) == before
    assert not _session_view(rig, session)["is_returning"]
    for url in (rig.prefill, rig.decode, rig.reference):
        assert_pool_clean(url)
