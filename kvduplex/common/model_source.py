"""What a model argument names, torch-free: a built-in preset or a local Hugging Face
folder, its architecture config and its tokenizer.

The instance loads its weights over this (`loader.load_model`); the router, which renders
and tokenizes prompts exactly as the instances do, loads only the tokenizer, and so never
imports torch.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvduplex.common.model_config import DecoderConfig
from kvduplex.common.presets import PRESETS
from kvduplex.common.presets import preset_config
from kvduplex.common.tokenizer import ByteTokenizer
from kvduplex.common.tokenizer import HFTokenizer
from kvduplex.common.tokenizer import Tokenizer


def model_folder(model: str) -> Path:
    """`model` as a local folder; ValueError naming the presets if it is not one."""
    folder = Path(model)
    if not folder.is_dir():
        raise ValueError(
            f"model {model!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a local folder"
        )
    return folder


def read_config(folder: Path) -> DecoderConfig:
    """A folder's config.json as a `DecoderConfig`; ValueError if it has none."""
    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json")
    return DecoderConfig.from_hf_config(json.loads(path.read_text()))


def model_config(model: str) -> DecoderConfig:
    """The architecture of `model` (a preset's name or a folder)."""
    if model in PRESETS:
        return preset_config(model)
    return read_config(model_folder(model))


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer `loader.load_model` gives `model` (preset name or folder), without
    the weights: a preset's is the built-in byte tokenizer; a folder's also ends generation
    at config.json's EOS ids."""
    if model in PRESETS:
        return ByteTokenizer()
    folder = model_folder(model)
    return HFTokenizer(folder, extra_eos_token_ids=read_config(folder).eos_token_ids)
