"""Router pieces without processes: backend choice, first-token handling of D's stream."""

from __future__ import annotations

import json

from kvduplex.model.tokenizer import ByteTokenizer
from kvduplex.server.router import (
    _NOT_CONTENT,
    Backend,
    PrefixAffinity,
    RouterState,
    _drop_first_token,
)


def _state(n: int) -> RouterState:
    return RouterState(
        prefill=[Backend(f"http://p{i}") for i in range(n)],
        decode=[Backend(f"http://d{i}") for i in range(n)],
        tokenizer=ByteTokenizer(),
        model="tiny",
        affinity=PrefixAffinity(chunk=4),
    )


def test_least_loaded_without_history() -> None:
    st = _state(3)
    st.decode[0].in_flight, st.decode[1].in_flight = 2, 0
    st.decode[2].in_flight = 1
    assert st.pick(st.decode, list(range(20))) is st.decode[1]


def test_prefers_the_backend_that_served_the_prefix_unless_much_busier() -> None:
    st = _state(2)
    history = list(range(1, 30))
    st.remember(st.decode[1], history)
    next_turn = [*history, 40, 41, 42, 43, 44]
    assert st.pick(st.decode, next_turn) is st.decode[1]
    st.decode[1].in_flight = 1  # one more than the least loaded: still worth the cache
    assert st.pick(st.decode, next_turn) is st.decode[1]
    st.decode[1].in_flight = 2
    assert st.pick(st.decode, next_turn) is st.decode[0]
    assert st.pick(st.decode, [99, 98, 97, 96, 95]) is st.decode[0]  # unrelated prompt


def test_affinity_forgets_beyond_capacity() -> None:
    aff = PrefixAffinity(chunk=2, capacity=4)
    b = Backend("http://x")
    aff.add(b, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])  # 5 chunks, only 4 kept (oldest dropped)
    assert aff.best([b], [1, 2, 3, 4]) == (None, 0)


def _event(choice: dict) -> bytes:
    return f"data: {json.dumps({'id': 'c', 'choices': [choice]})}\n\n".encode()


def test_drop_first_token_of_decode_stream() -> None:
    mid = _event({"index": 0, "text": "a", "token_ids": [97], "finish_reason": None})
    assert _drop_first_token(mid, "a") is None
    final = _event({"index": 0, "text": "\ufffd", "token_ids": [226], "finish_reason": "length"})
    kept = _drop_first_token(final, "")
    assert kept is not None and kept is not _NOT_CONTENT
    choice = json.loads(kept[6:])["choices"][0]
    assert choice == {"index": 0, "text": "\ufffd", "token_ids": [], "finish_reason": "length"}
    chat = _event({"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"})
    kept = _drop_first_token(chat, "hi")
    assert kept is not None and json.loads(kept[6:])["choices"][0]["delta"] == {"content": ""}
    assert _drop_first_token(b"data: [DONE]\n\n", "") is _NOT_CONTENT
    usage_only = f"data: {json.dumps({'choices': [], 'usage': {}})}\n\n".encode()
    assert _drop_first_token(usage_only, "") is _NOT_CONTENT
