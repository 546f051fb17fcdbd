"""A 16k-token prompt on the engine stepped directly: prefilled in chunks under the step's
token budget while another request keeps decoding, one token a step.

The model has the tiny preset's size with 32k positions (Llama-3.2-style RoPE, as the
`long` preset): the engine's chunking does not depend on the model's width, and a
tiny one keeps the 16k prefill cheap.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvduplex.common.engine_config import CacheConfig
from kvduplex.common.engine_config import EngineConfig
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.engine_config import SchedulerConfig
from kvduplex.common.presets import PRESETS
from kvduplex.common.sampling import SamplingParams
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.engine.engine import LLMEngine
from kvduplex.engine.request import Request
from kvduplex.model.decoder import DecoderForCausalLM
from kvduplex.model.loader import LoadedModel
from kvduplex.model.loader import init_random_weights
from kvduplex.model.loader import model_identity

PROMPT_TOKENS = 16_384
BUDGET = 2048
BLOCK_SIZE = 16


def _tiny_with_long_context() -> LoadedModel:
    long = PRESETS["long"]
    config = dataclasses.replace(
        PRESETS["tiny"], max_position_embeddings=32768, rope_theta=long.rope_theta,
        rope_type=long.rope_type, rope_scaling=long.rope_scaling,
    )  # fmt: skip
    model = DecoderForCausalLM(config, torch.float32, torch.device("cpu"))
    init_random_weights(model, seed=0)
    model.eval()
    identity = model_identity(config, torch.float32, "test:tiny-32k")
    return LoadedModel(model, config, ByteTokenizer(), "tiny-32k", identity, "test:tiny-32k",
                       torch.float32, torch.device("cpu"))  # fmt: skip


@pytest.mark.slow
def test_a_16k_prompt_prefills_in_chunks_while_another_request_decodes() -> None:
    num_blocks = (PROMPT_TOKENS + 256) // BLOCK_SIZE
    config = EngineConfig(
        model=ModelLoadConfig(model="tiny"),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET, enable_chunked_prefill=True),
    )
    engine = LLMEngine(config, loaded=_tiny_with_long_context())
    assert engine.max_model_len >= PROMPT_TOKENS + 8
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    # 1. A short request prefills and starts decoding.
    engine.add_request(Request("decoding", [5, 6, 7, 8], greedy))
    (first,) = engine.step()
    assert first.request_id == "decoding" and len(first.new_token_ids) == 1
    # 2. The long prompt arrives; every step runs the decode and a chunk of the prompt.
    prompt = [(i * 7919) % 250 + 1 for i in range(PROMPT_TOKENS)]
    long = engine.add_request(Request("long", prompt, dataclasses.replace(greedy, max_tokens=2)))
    chunks = []
    while not long.output_token_ids:
        before = long.num_computed_tokens
        outputs = {o.request_id: o for o in engine.step()}
        chunks.append(long.num_computed_tokens - before)
        assert len(outputs["decoding"].new_token_ids) == 1, "the decode kept its token a step"
        assert sum(chunks) == PROMPT_TOKENS or not outputs.get("long")
    # 3. The budget of each step is the decode's token and a chunk of the rest.
    assert chunks[:-1] == [BUDGET - 1] * (len(chunks) - 1)
    assert sum(chunks) == PROMPT_TOKENS and len(chunks) == -(-PROMPT_TOKENS // (BUDGET - 1))
    while engine.has_unfinished():
        engine.step()
    assert len(long.output_token_ids) == 2
    engine.check_integrity()
    assert engine.block_pool.stats().num_in_use == 0
