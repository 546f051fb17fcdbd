"""The router builds prompts off its event loop, and never imports torch.

* A subprocess imports the router's modules and its command line's way to serving
  (``kvduplex router``: parsing, its config, its tokenizer, its app) and finds neither
  torch, nor transformers, nor the engine's or the model's torch code loaded.
* With every prompt thread stuck in a chat template, the router's /health answers
  and its prober keeps probing: the event loop is not the one rendering. Only a short
  request's prompt is built on the loop (`INLINE_PROMPT_BYTES`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from fastapi.testclient import TestClient

from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.tokenizer import Messages
from kvduplex.common.tokenizer import Tools
from kvduplex.router.app import create_router_app
from kvduplex.router.config import RouterConfig
from kvduplex.router.routing import INLINE_PROMPT_BYTES
from kvduplex.router.state import RouterState
from tests.support.fake_instances import mock_instances
from tests.unit.test_router import D
from tests.unit.test_router import FakeInstances
from tests.unit.test_router import P
from tests.unit.test_tokenizer import write_hf_tokenizer

REPO = Path(__file__).resolve().parents[2]

_IMPORTS = """
import json, sys
import kvduplex.router
import kvduplex.router.app
from kvduplex.cli.main import main, parse_args
from kvduplex.router.app import create_router_app, serve_router
from kvduplex.router.state import RouterState
from kvduplex.common.model_source import load_tokenizer, model_config

config = parse_args(["router", "--decode", "http://127.0.0.1:9", "--model", "tiny"]).router_config()
create_router_app(RouterState.create(config, load_tokenizer(config.model)))
tok = load_tokenizer(sys.argv[1])
ids = tok.encode_chat([{"role": "user", "content": "hello world"}])
heavy = ("torch", "numpy", "transformers", "safetensors", "xgrammar")
print(json.dumps({
    "loaded": sorted(m for m in sys.modules if m.split(".")[0] in heavy),
    "kvduplex": sorted(m for m in sys.modules if m.startswith("kvduplex.")),
    "num_ids": len(ids), "tiny_layers": model_config("tiny").num_layers,
}))
"""


def test_the_router_and_its_command_line_import_no_torch(tmp_path: Path) -> None:
    write_hf_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 1, "intermediate_size": 128, "vocab_size": 300,
    }))  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-c", _IMPORTS, str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    seen = json.loads(out.stdout)
    assert seen["loaded"] == []
    assert "kvduplex.router.app" in seen["kvduplex"]
    torch_code = ("kvduplex.engine.engine", "kvduplex.model.loader", "kvduplex.model.decoder",
                  "kvduplex.engine.kv_cache", "kvduplex.transport.base", "kvduplex.bench")  # fmt: skip
    assert not [m for m in seen["kvduplex"] if m.startswith(torch_code)]
    assert seen["num_ids"] > 0 and seen["tiny_layers"] == 4  # a folder's tokenizer; a preset


class GatedTemplate(ByteTokenizer):
    """The byte tokenizer whose chat template waits for `gate`: a template that takes long."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.started = threading.Semaphore(0)
        self._lock = threading.Lock()
        self.num_rendering = 0
        self.most_rendering = 0
        self.threads: set[str] = set()

    def _chat_text(self, messages: Messages, add_generation_prompt: bool, tools: Tools) -> str:
        with self._lock:
            self.num_rendering += 1
            self.most_rendering = max(self.most_rendering, self.num_rendering)
            self.threads.add(threading.current_thread().name)
        self.started.release()
        try:
            assert self.gate.wait(60), "the test never opened the gate"
            return super()._chat_text(messages, add_generation_prompt, tools)
        finally:
            with self._lock:
                self.num_rendering -= 1


class CountedProbes:
    """The fake instances, with their health probes counted."""

    def __init__(self, fake: FakeInstances) -> None:
        self.fake = fake
        self.num_probes = 0
        self.probed = threading.Condition()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/ready", "/health"):
            with self.probed:
                self.num_probes += 1
                self.probed.notify_all()
        return await self.fake.handle(request)

    def wait_for_probes(self, num_more: int, timeout_s: float) -> bool:
        with self.probed:
            target = self.num_probes + num_more
            return self.probed.wait_for(lambda: self.num_probes >= target, timeout_s)


def test_health_and_probes_go_on_while_every_prompt_thread_renders() -> None:
    tok = GatedTemplate()
    probes = CountedProbes(FakeInstances())
    config = RouterConfig(prefill=(P,), decode=(D,), prompt_threads=2, health_interval_s=0.05)
    state = RouterState.create(config, tok, make_client=mock_instances(probes.handle))
    content = "hi " * (INLINE_PROMPT_BYTES // 3)  # a body over the size built on the loop
    body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    num_requests = 5  # more than the pool: the rest wait for a thread, not the loop
    with TestClient(create_router_app(state)) as client, ThreadPoolExecutor(8) as clients:
        try:
            posts = [
                clients.submit(client.post, "/v1/chat/completions", json=body)
                for _ in range(num_requests)
            ]
            for _ in range(config.prompt_threads):  # both prompt threads are in a template
                assert tok.started.acquire(timeout=30)
            health = clients.submit(client.get, "/health").result(timeout=30)
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert clients.submit(client.get, "/ready").result(timeout=30).status_code == 200
            assert probes.wait_for_probes(4, timeout_s=30)  # two rounds of P and D at least
            assert tok.num_rendering == config.prompt_threads
        finally:
            tok.gate.set()
        answers = [post.result(timeout=60) for post in posts]
    assert [a.status_code for a in answers] == [200] * num_requests
    assert tok.most_rendering == config.prompt_threads  # bounded by the pool
    assert all(name.startswith("kvduplex-prompt") for name in tok.threads)


def test_a_short_prompt_is_built_on_the_event_loop_and_a_long_one_in_the_pool() -> None:
    tok = GatedTemplate()
    tok.gate.set()  # no waiting: only where each prompt is rendered
    config = RouterConfig(prefill=(P,), decode=(D,), prompt_threads=2, health_interval_s=0.05)
    state = RouterState.create(config, tok, make_client=mock_instances(FakeInstances().handle))
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    long = {"messages": [{"role": "user", "content": "hi " * INLINE_PROMPT_BYTES}], "max_tokens": 2}
    with TestClient(create_router_app(state)) as client:
        assert client.post("/v1/chat/completions", json=short).status_code == 200
        assert not any(name.startswith("kvduplex-prompt") for name in tok.threads)
        assert client.post("/v1/chat/completions", json=long).status_code == 200
    assert any(name.startswith("kvduplex-prompt") for name in tok.threads)


def test_settle_heap_freezes_the_start_up_heap_and_collects_the_young_less_often() -> None:
    """In a process of its own (it changes the process's collector)."""
    code = (
        "import gc, json\n"
        "from kvduplex.router.app import GC_YOUNG_THRESHOLD, settle_heap\n"
        "before = gc.get_threshold()\n"
        "settle_heap()\n"
        "print(json.dumps([gc.get_freeze_count(), before, gc.get_threshold(), GC_YOUNG_THRESHOLD]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    frozen, before, after, young = json.loads(out.stdout)
    assert frozen > 10_000  # the modules' objects, the app's
    assert after == [young, *before[1:]] and young > before[0]
