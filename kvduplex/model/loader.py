"""Load a model for serving: a built-in preset or a local Hugging Face folder.

A folder holds ``config.json``, the weights as ``model.safetensors`` or as
shards listed in ``model.safetensors.index.json``, and ``tokenizer.json`` (+
``tokenizer_config.json``). Weights are read tensor by tensor straight into
the (already placed) parameters; every parameter must be covered exactly.

The model identity (`LoadedModel.identity`) enters every prefix-cache block
key, so two instances share cached blocks only if they would compute the same
KV: it hashes the architecture config, the dtype and the weight source (preset
name + seed, or the weight files' names and sizes). The device is deliberately
not part of it.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.fingerprint import preset_weights
from kvduplex.common.fingerprint import safetensors_digest
from kvduplex.common.model_config import DecoderConfig
from kvduplex.common.model_source import load_tokenizer
from kvduplex.common.model_source import model_config
from kvduplex.common.model_source import model_folder
from kvduplex.common.presets import PRESETS
from kvduplex.common.tokenizer import Tokenizer
from kvduplex.model.decoder import DecoderForCausalLM
from kvduplex.model.decoder import Linear
from kvduplex.model.decoder import can_pack_for_onednn
from kvduplex.model.decoder import fused_shard_rows
from kvduplex.model.decoder import hf_weight_target
from kvduplex.model.decoder import pack_for_onednn
from kvduplex.model.dtypes import dtype_from_name

logger = logging.getLogger(__name__)

INIT_STD = 0.02
"""Standard deviation of a preset's random matrix weights (as transformers'
initializer_range)."""

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: weights placed, eval mode, plus what serving needs around it."""

    model: DecoderForCausalLM
    """The decoder, in eval mode, on `device`, in `dtype`."""
    config: DecoderConfig
    """Its architecture."""
    tokenizer: Tokenizer
    """Its tokenizer."""
    name: str
    """The name clients use (served_model_name, else the model argument)."""
    identity: bytes
    """32-byte digest of what determines the KV (see the module docstring)."""
    weights: str
    """The weights' identity in the instance's fingerprint (`kvduplex.common.fingerprint`):
    a preset's name and seed, or a digest of the folder's safetensors files."""
    dtype: torch.dtype
    """Parameter and KV dtype."""
    device: torch.device
    """Where the parameters live."""


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda if available else cpu; anything else as torch parses it."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → float32 on CPU, bfloat16 on CUDA; otherwise the named dtype."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return dtype_from_name(name)


def load_model(cfg: ModelLoadConfig) -> LoadedModel:
    """Load `cfg.model` (preset name or folder path) onto the configured device and dtype.

    Side effect: ``torch.set_num_threads(cfg.num_threads)`` when it is > 0.
    Raises ValueError for an unknown preset, a folder missing required files,
    an unsupported architecture, or weights that do not match the config.
    """
    if cfg.num_threads > 0:
        torch.set_num_threads(cfg.num_threads)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    name = cfg.served_model_name or cfg.model
    config = model_config(cfg.model)
    if cfg.model in PRESETS:
        model = _empty_model(config, dtype, device)
        init_random_weights(model, cfg.seed)
        source = f"preset:{cfg.model}:seed={cfg.seed}"
        weights = preset_weights(cfg.model, cfg.seed)
    else:
        files = weight_files(model_folder(cfg.model))
        model = _empty_model(config, dtype, device)
        load_safetensors(model, files)
        source = "files:" + ",".join(f"{f.name}={f.stat().st_size}" for f in files)
        weights = safetensors_digest(files)
    tokenizer = load_tokenizer(cfg.model)
    model.eval()
    if device.type == "cpu":
        _prepare_cpu_weights(model, packed=cfg.cpu_packed_weights)
    identity = model_identity(config, dtype, source)
    logger.info(
        "loaded model %s (%s, %d layers, %s on %s)", name, config.architecture,
        config.num_layers, str(dtype).removeprefix("torch."), device,
    )
    return LoadedModel(model, config, tokenizer, name, identity, weights, dtype, device)


def _prepare_cpu_weights(model: DecoderForCausalLM, packed: bool) -> None:
    """Lay out linear weights for CPU matmuls: column-major for MKL's few-row sgemm and,
    with `packed`, a oneDNN-packed copy for two or more rows (`decoder.pack_for_onednn`)."""
    copies = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.store_transposed()
            if packed and can_pack_for_onednn(module.weight):
                module.pack_for_onednn()
                copies += module.weight.numel() * module.weight.element_size()
    if packed and model.lm_head is None and can_pack_for_onednn(model.embed_tokens.weight):
        model.tied_head_packed = pack_for_onednn(model.embed_tokens.weight)
        copies += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    if copies:
        logger.info("linear weights also packed for oneDNN: %.1f MiB more", copies / 2**20)


def model_identity(config: DecoderConfig, dtype: torch.dtype, source: str) -> bytes:
    """sha256 over the canonical config JSON, the dtype name and the weight source."""
    h = hashlib.sha256()
    for part in (config.to_json(), str(dtype), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.digest()


def _empty_model(config: DecoderConfig, dtype: torch.dtype, device: torch.device) -> DecoderForCausalLM:
    """Parameters allocated on `device` in `dtype`, uninitialised."""
    return DecoderForCausalLM(config, dtype, device)


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of `folder`, via the shard index when there is one."""
    index = folder / _INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{folder}: shards listed in {_INDEX_FILE} are missing: {missing}")
        return files
    single = folder / _SINGLE_FILE
    if single.is_file():
        return [single]
    raise ValueError(f"{folder} has neither {_SINGLE_FILE} nor {_INDEX_FILE}")


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles have no __iter__
                yield key, f.get_tensor(key)


@torch.no_grad()
def load_safetensors(model: DecoderForCausalLM, files: list[Path]) -> None:
    """Copy checkpoint tensors into `model`, casting to its dtype; checks full coverage.

    Raises ValueError on an unknown tensor name, a shape mismatch, or
    parameters (or fused shards) that no tensor filled.
    """
    config = model.config
    params = dict(model.named_parameters())
    pending: set[tuple[str, int | None]] = set()
    for pname, _ in params.items():
        if ".qkv_proj." in pname:
            pending.update((pname, s) for s in range(3))
        elif ".gate_up_proj." in pname:
            pending.update((pname, s) for s in range(2))
        else:
            pending.add((pname, None))
    for key, tensor in _iter_tensors(files):
        target = hf_weight_target(key, config)
        if target is None:
            continue
        pname, shard = target
        param = params.get(pname)
        if param is None:
            raise ValueError(f"checkpoint tensor {key!r} matches no parameter of a {config.architecture} model")
        dest = param if shard is None else param.narrow(0, *_start_len(fused_shard_rows(pname, shard, config)))
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        pending.discard((pname, shard))
    if pending:
        names = sorted(f"{p}[{s}]" if s is not None else p for p, s in pending)
        raise ValueError(f"checkpoint is missing weights for: {', '.join(names[:8])}"
                         + (f" and {len(names) - 8} more" if len(names) > 8 else ""))


def _start_len(rows: tuple[int, int]) -> tuple[int, int]:
    return rows[0], rows[1] - rows[0]


def count_parameters(model: nn.Module) -> int:
    """Number of parameter elements (tied matrices counted once)."""
    return sum(p.numel() for p in model.parameters())


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int) -> None:
    """Fill `model` deterministically (a preset's weights): norms 1, biases 0, other
    weights N(0, INIT_STD).

    Values are drawn in float32 on CPU from one ``torch.Generator`` seeded with
    `seed`, parameter by parameter in module order, and then copied (cast, moved)
    into each parameter: the same (preset, seed) gives the same weights in every
    process, whatever the model's dtype or device beyond that final rounding.
    """
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            values = torch.empty(param.shape, dtype=torch.float32)
            values.normal_(0.0, INIT_STD, generator=gen)
            param.copy_(values)
