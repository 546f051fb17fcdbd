"""What an instance serves, as a fingerprint two instances compare before they exchange KV.

KV computed by one instance is correct on another only if both would have computed
the same KV for the same token ids, and read the same token ids out of the same
prompt. So each prefill and decode instance computes a `ModelFingerprint` once at
start (`model_fingerprint`), sends it in its KV handshake and shows it in its
``/health``; a handshake whose fingerprint differs from ours is refused, naming
each field that differs (`ModelFingerprint.differences`, checked by
`kvduplex.transport.base.check_compatible`), and no block moves between the two.

=============  ============================================================================
field          what it stands for
=============  ============================================================================
architecture   the decoder's family and a digest of its whole config (shapes, RoPE, norms)
weights        a preset's name and seed; a folder's safetensors: names, sizes, headers and
               sampled bytes (`safetensors_digest`)
dtype          the parameters' (and so the KV's) element type
tokenizer      tokenizer.json, tokenizer_config.json (but its chat template) and
               special_tokens_map.json; the built-in byte tokenizer's own name
chat_template  every chat template of the folder by name; the byte tokenizer's built-in one
block_size     tokens per KV block (prefix-cache keys hash whole blocks)
kv_layout      layers, KV heads, head dimension and dtype of the pool
=============  ============================================================================

The device, the pool's block count and the instance's flags are not part of it:
they change where KV lives and how fast, not what it holds. Digests are sha256,
hex. Torch-free: read by the instance and the transport, and by anyone who looks
at an instance's ``/health``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from typing import BinaryIO

import msgspec

from kvduplex.common.chat_template import read_chat_templates
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.model_config import DecoderConfig
from kvduplex.common.presets import PRESETS
from kvduplex.common.tokenizer import ByteTokenizer

FULL_HASH_MAX_BYTES = 32 << 20
"""A safetensors file's data up to this size is hashed whole; a larger one by sampling."""
NUM_SAMPLES = 32
"""Windows hashed in the data of a file past `FULL_HASH_MAX_BYTES`, evenly spaced."""
SAMPLE_BYTES = 256 << 10
"""Bytes of each sampled window."""
_MAX_HEADER_BYTES = 100 << 20
"""A safetensors header announced larger than this is taken for a corrupt file."""
_SHOWN_HEX = 16
"""Hex digits of a digest shown in a refusal (the whole digest is in ``/health``)."""


class ModelFingerprint(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """What an instance serves (see the module docstring); equal on two instances that may
    exchange KV. Plain strings and an int, so that it travels in a handshake as it is."""

    architecture: str
    """``<family>:<sha256 of the config's canonical JSON>``."""
    weights: str
    """``preset:<name>:seed=<seed>`` or ``safetensors:<sha256>``."""
    dtype: str
    tokenizer: str
    """``builtin:byte`` or ``sha256:<hex>`` over the folder's tokenizer files."""
    chat_template: str
    """``builtin:chatml`` (the byte tokenizer's), ``none``, or ``sha256:<hex>``."""
    block_size: int
    kv_layout: str
    """``layers=<L> kv_heads=<H> head_dim=<D> dtype=<dtype>``."""

    def differences(self, other: ModelFingerprint) -> list[str]:
        """Each field that differs, as ``name: <ours> here vs <theirs> there``, in field
        order; empty if the two are equal."""
        out = []
        for name in self.__struct_fields__:
            ours, theirs = getattr(self, name), getattr(other, name)
            if ours != theirs:
                out.append(f"{name}: {_shown(ours)} here vs {_shown(theirs)} there")
        return out

    @property
    def digest(self) -> str:
        """sha256 (hex) of every field: one value to compare by eye or in a log."""
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """The fields and the digest, for ``/health``."""
        return {**msgspec.structs.asdict(self), "digest": self.digest}


def _shown(value: object) -> str:
    """A field's value in a refusal: a long digest cut to its first `_SHOWN_HEX` digits."""
    text = str(value)
    head, sep, tail = text.rpartition(":")
    if len(tail) == 64 and all(c in "0123456789abcdef" for c in tail):
        return f"{head}{sep}{tail[:_SHOWN_HEX]}..."
    return text


def model_fingerprint(
    model: str, config: DecoderConfig, weights: str, dtype: str, layout: KVCacheLayout
) -> ModelFingerprint:
    """The fingerprint of an instance serving `model` (a preset's name or a folder) with
    `config`, weights identified by `weights` (`preset_weights` or `safetensors_digest`),
    parameters in `dtype` and a KV pool of `layout`. Reads the folder's tokenizer files."""
    tokenizer, chat_template = tokenizer_digests(model)
    return ModelFingerprint(
        architecture=f"{config.architecture}:{_sha256(config.to_json().encode())}",
        weights=weights,
        dtype=dtype,
        tokenizer=tokenizer,
        chat_template=chat_template,
        block_size=layout.block_size,
        kv_layout=(
            f"layers={layout.num_layers} kv_heads={layout.num_kv_heads} "
            f"head_dim={layout.head_dim} dtype={layout.dtype}"
        ),
    )


def preset_weights(name: str, seed: int) -> str:
    """The weights' identity of preset `name` drawn with `seed`."""
    return f"preset:{name}:seed={seed}"


def safetensors_digest(files: Sequence[Path]) -> str:
    """The weights' identity of a folder's safetensors `files` (in this order):
    ``safetensors:<sha256>`` over each file's name, size and header (tensor names, dtypes,
    shapes, offsets, metadata) and its data, whole up to `FULL_HASH_MAX_BYTES`, else
    `NUM_SAMPLES` windows of `SAMPLE_BYTES` evenly spaced from its first byte to its last.

    Sampling keeps the start of a large model quick (a few MiB read per file): fine-tuned
    or other weights of one shape differ in every window; an edit confined to bytes
    between windows goes unseen. Raises ValueError for a file that is not safetensors.
    """
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        with path.open("rb") as f:
            announced = f.read(8)
            header_len = int.from_bytes(announced, "little") if len(announced) == 8 else -1
            if not 0 < header_len <= min(size - 8, _MAX_HEADER_BYTES):
                raise ValueError(f"{path} is not a safetensors file (its header is unreadable)")
            header = f.read(header_len)
            h.update(f"{path.name}\0{size}\0".encode())
            h.update(header)
            start = 8 + header_len
            for offset, length in _windows(start, size):
                f.seek(offset)
                _hash_range(h, f, length)
    return f"safetensors:{h.hexdigest()}"


def _windows(start: int, end: int) -> list[tuple[int, int]]:
    """(offset, length) of what is hashed of the data in [start, end)."""
    size = end - start
    if size <= FULL_HASH_MAX_BYTES:
        return [(start, size)]
    step = (size - SAMPLE_BYTES) // (NUM_SAMPLES - 1)
    return [(start + i * step, SAMPLE_BYTES) for i in range(NUM_SAMPLES)]


def _hash_range(h: Any, f: BinaryIO, length: int, chunk: int = 1 << 20) -> None:
    """Feed `h` (a hashlib object) the next `length` bytes of `f` (fewer at its end)."""
    while length > 0:
        data = f.read(min(chunk, length))
        if not data:
            return
        h.update(data)
        length -= len(data)


_TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json")


def tokenizer_digests(model: str) -> tuple[str, str]:
    """(tokenizer, chat template) identities of `model`: a preset's built-in byte tokenizer
    and its template, or digests of a folder's files (see `ModelFingerprint`)."""
    if model in PRESETS:
        specials = ",".join(ByteTokenizer.SPECIAL_TOKENS)
        return f"builtin:byte:{_sha256(specials.encode())}", "builtin:chatml"
    folder = Path(model)
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = folder / name
        h.update(f"{name}\0".encode())
        if path.is_file():
            h.update(path.read_bytes())
        h.update(b"\0")
    config = _read_json(folder / "tokenizer_config.json")
    without_template = {k: v for k, v in config.items() if k != "chat_template"}
    h.update(json.dumps(without_template, sort_keys=True, separators=(",", ":")).encode())
    templates = read_chat_templates(folder, config)
    if not templates:
        return f"sha256:{h.hexdigest()}", "none"
    encoded = json.dumps(sorted(templates.items()), separators=(",", ":")).encode()
    return f"sha256:{h.hexdigest()}", f"sha256:{_sha256(encoded)}"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


__all__ = [
    "ModelFingerprint",
    "model_fingerprint",
    "preset_weights",
    "safetensors_digest",
    "tokenizer_digests",
]
