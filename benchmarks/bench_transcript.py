"""What building one chat prompt costs as an agent's tool loop grows (`splice_chat_ids`).

An agent loop of N turns on an HF byte-level BPE (trained here, as the unit tests build
it) with a template that renders past calls its own way: even turns a forced tool call
(sent back as returned, then a tool result), odd turns a content answer (sent back, then
a user message). One `AnswerBook` carries the records and remembered heads across turns,
as a router's does. Printed per N: the last turn's prompt build time (median of
`--repeats` builds of that turn, each with the book as the loop left it), how many
times it rendered the template and how many times it decoded ids to text.

    PYTHONPATH=. python benchmarks/bench_transcript.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from kvduplex.common.openai.prompt import prompt_token_ids
from kvduplex.common.openai.transcript import AnswerBook
from kvduplex.common.openai.transcript import AnswerRecord
from tests.unit.test_transcript import CALLS_CHATML
from tests.unit.test_transcript import _bpe
from tests.unit.test_transcript import _chat
from tests.unit.test_transcript import _single_pieces
from tests.unit.test_transcript import count_calls
from tests.unit.test_transcript import count_renders


def main(args: argparse.Namespace) -> None:
    tok = _bpe(Path(tempfile.mkdtemp()), CALLS_CHATML, "<|im_end|>")
    eos = tok.encode("<|im_end|>", add_special_tokens=False)[0]
    renders = count_renders(tok)
    decodes = count_calls(tok, "decode")
    print("| turns | last turn's prompt tokens | build ms (median) | template renders | decodes |")
    print("|---|---|---|---|---|")
    for n in args.turns:
        book = AnswerBook()
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an agent. " * 20},
            {"role": "user", "content": "fix the build"},
        ]
        for turn in range(n):
            if turn == n - 1:
                break
            prompt_token_ids(_chat(messages), tok, book, now=float(turn))
            if turn % 2 == 0:
                args_text = json.dumps({"path": f"/tmp/{turn}"})
                call = {"id": f"call-{turn}", "type": "function",
                        "function": {"name": "ls", "arguments": args_text}}  # fmt: skip
                written = json.dumps([{"name": "ls", "parameters": {"path": f"/tmp/{turn}"}}])
                returned = {"role": "assistant", "content": "", "tool_calls": [call]}
                book.add(AnswerRecord((*_single_pieces(tok, written), eos), returned), float(turn))
                messages += [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": call["id"],
                              "content": "the quick brown fox " * 5}]  # fmt: skip
            else:
                text = "hello world paged attention " * 3
                answer = {"role": "assistant", "content": text}
                book.add(AnswerRecord((*_single_pieces(tok, text), eos), answer), float(turn))
                messages += [answer, {"role": "user", "content": "the lazy dog " * 4}]
        times, counts, decoded = [], [], []
        for _ in range(args.repeats):
            before, decodes_before = renders(), decodes()
            t0 = time.perf_counter()
            ids = prompt_token_ids(_chat(messages), tok, book, now=float(n))
            times.append(time.perf_counter() - t0)
            counts.append(renders() - before)
            decoded.append(decodes() - decodes_before)
        print(f"| {n} | {len(ids)} | {statistics.median(times) * 1e3:.1f} | {counts[0]} "
              f"| {decoded[0]} |")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 32, 64, 128])
    parser.add_argument("--repeats", type=int, default=5)
    main(parser.parse_args())
