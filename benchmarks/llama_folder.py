"""A Llama-shaped Hugging Face folder with random weights, built with transformers (benchmarks only).

About 50M parameters (hidden 512, 6 layers, 8 heads / 4 KV heads of 64, MLP
1408, vocabulary 32,000, untied output head): a real checkpoint's layout and
a large vocabulary without a download. The tokenizer is a small byte-level
BPE; ids above its vocabulary decode to placeholders, as with any model whose
embedding table is larger than its tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA_50M = dict(
    hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, vocab_size=32000, max_position_embeddings=8192,
    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, initializer_range=0.02,
)  # fmt: skip
"""The folder's `LlamaConfig` arguments."""


def build_llama_folder(folder: Path, seed: int = 0, max_positions: int = 8192) -> Path:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into `folder`.

    `max_positions` changes only the config (the weights of a seed are the same): 16k
    contexts need a folder built with more than the default 8,192."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers import decoders
    from tokenizers import models
    from tokenizers import pre_tokenizers
    from tokenizers import trainers
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(LLAMA_50M | {"max_position_embeddings": max_positions})))  # type: ignore[arg-type]
    model.save_pretrained(folder, safe_serialization=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(["paged attention reads the pool in place", "hello world"], trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
