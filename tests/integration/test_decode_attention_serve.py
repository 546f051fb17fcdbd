"""``kvduplex serve --decode-attention``: real instances on each path answer the same tokens.

The flag reaching the runner, each step taking the path it names, and the two paths'
logits agreeing step by step are `tests/unit/test_decode_attention_flag.py`'s: the API
returns no logprobs, and tokens alone hardly depend on attention with tiny's random
weights. This checks the command line through the real server."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import httpx
import pytest

from kvduplex.cluster import LocalCluster
from kvduplex.cluster import free_port
from kvduplex.model.cpu_decode import load_kernel

pytestmark = pytest.mark.integration

SERVE = ["serve", "--model", "tiny", "--num-blocks", "128", "--log-level", "warning"]


async def _answers(url: str, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts' greedy token ids, all requests in flight at once (decodes batched)."""
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(prompt: list[int]) -> list[int]:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            resp = await client.post(url + "/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            return list(resp.json()["choices"][0]["token_ids"])

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_paged_copy_and_kernel_instances_answer_the_same_tokens(cluster: LocalCluster) -> None:
    paths = ("paged", "copy", "kernel") if load_kernel(32, 2) is not None else ("paged", "copy")
    urls = {
        path: cluster.start(
            f"decode-attention-{path}", [*SERVE, "--decode-attention", path], free_port()
        ).url
        for path in paths
    }
    cluster.wait_healthy(timeout_s=120)
    rng = random.Random(7)
    # two prompts past 256 tokens: ranges of blocks the paged path reads in place
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (300, 45, 270, 130)]
    answers = {path: asyncio.run(_answers(url, prompts)) for path, url in urls.items()}
    assert all(len(a) == 12 for a in answers["paged"])
    assert len({tuple(a) for a in answers["paged"]}) == len(prompts)  # not one constant answer
    assert all(answers[path] == answers["paged"] for path in paths)


def test_an_unknown_path_is_refused_at_the_command_line() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvduplex", *SERVE, "--decode-attention", "in-place"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--decode-attention" in out.stderr and "paged" in out.stderr
