"""The model fingerprint: what it tells apart, and the handshake that refuses a peer whose
fingerprint differs, naming what differs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from kvduplex.common import fingerprint as fp
from kvduplex.common.engine_config import ModelLoadConfig
from kvduplex.common.fingerprint import ModelFingerprint
from kvduplex.common.fingerprint import model_fingerprint
from kvduplex.common.fingerprint import safetensors_digest
from kvduplex.common.kv_layout import KVCacheLayout
from kvduplex.common.presets import preset_config
from kvduplex.engine.kv_cache import allocate_kv_pool
from kvduplex.model.loader import load_model
from kvduplex.transport import IncompatibleLayoutError
from kvduplex.transport import IncompatibleModelError
from kvduplex.transport import TransferState
from kvduplex.transport.handshake import PeerDirectory
from kvduplex.transport.messages import decode_handshake
from kvduplex.transport.messages import encode_handshake
from kvduplex.transport.metrics import TransferMetrics
from kvduplex.transport.protocol import TransferOp
from tests.support.fake_transport import InProcessFabric
from tests.support.fake_transport import InProcessTransport
from tests.transfer.test_handshake import URL
from tests.transfer.test_handshake import Switchboard
from tests.unit.test_tokenizer import write_hf_tokenizer

pytestmark = pytest.mark.timeout(60)

LAYOUT = KVCacheLayout(num_layers=4, num_blocks=8, block_size=16, num_kv_heads=2, head_dim=32)


def _preset_fingerprint(seed: int, block_size: int = 16) -> ModelFingerprint:
    loaded = load_model(ModelLoadConfig(model="tiny", seed=seed))
    layout = KVCacheLayout(4, 8, block_size, 2, 32)
    return model_fingerprint("tiny", loaded.config, loaded.weights, "float32", layout)


def _endpoint(fabric: InProcessFabric, fingerprint: ModelFingerprint | None) -> InProcessTransport:
    return fabric.endpoint(
        allocate_kv_pool(LAYOUT), LAYOUT, metrics=TransferMetrics(None), fingerprint=fingerprint
    )


def _directory_to(
    ours: ModelFingerprint | None, theirs: ModelFingerprint | None
) -> tuple[InProcessTransport, InProcessTransport, PeerDirectory]:
    """Our endpoint, the peer's (served at `URL`: its handshake goes over HTTP as JSON)
    and our directory, which reaches the peer."""
    fabric = InProcessFabric()
    local, peer = _endpoint(fabric, ours), _endpoint(fabric, theirs)
    sb = Switchboard()
    sb.serve(peer)
    return local, peer, PeerDirectory(local, client=TestClient(sb))


def test_instances_of_one_preset_with_other_seeds_are_refused_naming_the_weights() -> None:
    seed1, seed2 = _preset_fingerprint(1), _preset_fingerprint(2)
    assert seed1.differences(seed2) == [
        "weights: preset:tiny:seed=1 here vs preset:tiny:seed=2 there"
    ]
    local, peer, directory = _directory_to(seed1, seed2)
    with pytest.raises(IncompatibleModelError, match=r"serves another model") as refused:
        directory.get_peer(URL)
    message = str(refused.value)
    assert "weights: preset:tiny:seed=1 here vs preset:tiny:seed=2 there" in message
    assert message.count(" here vs ") == 1  # only the weights differ
    assert isinstance(refused.value, IncompatibleLayoutError)  # callers that catch that
    assert directory.peers() == {} and not local.is_connected(peer.engine_id)
    # The refusal is mutual: the peer's own connect to us fails the same way.
    with pytest.raises(IncompatibleModelError, match="seed=2 here vs preset:tiny:seed=1 there"):
        peer.connect(local.local_metadata())


def test_identical_instances_pair_and_move_kv() -> None:
    ours, theirs = _preset_fingerprint(7), _preset_fingerprint(7)
    assert ours == theirs and ours.digest == theirs.digest
    local, peer, directory = _directory_to(ours, theirs)
    handle = directory.get_peer(URL)
    assert handle.engine_id == peer.engine_id
    assert local.transfer(TransferOp.WRITE, handle, "x", [0], [1]).wait(5) is TransferState.DONE


def test_the_fingerprint_travels_in_the_handshake_and_is_required_on_both_sides() -> None:
    ours = _preset_fingerprint(0)
    fabric = InProcessFabric()
    with_one, without = _endpoint(fabric, ours), _endpoint(fabric, None)
    info = decode_handshake(encode_handshake(with_one.local_metadata()))
    assert info.fingerprint == ours
    with pytest.raises(IncompatibleModelError, match="sent no model fingerprint"):
        with_one.connect(without.local_metadata())
    with pytest.raises(IncompatibleModelError, match="this instance has no model fingerprint"):
        without.connect(with_one.local_metadata())
    _endpoint(fabric, None).connect(without.local_metadata())  # two without: transfer tests


def test_block_size_dtype_and_architecture_are_named() -> None:
    base = _preset_fingerprint(0)
    other_block = _preset_fingerprint(0, block_size=8)
    assert [d.split(":")[0] for d in base.differences(other_block)] == ["block_size"]
    small = model_fingerprint(
        "small", preset_config("small"), "preset:small:seed=0", "bfloat16", LAYOUT
    )
    names = [d.split(":")[0] for d in base.differences(small)]
    assert names == ["architecture", "weights", "dtype"]


def _folder(root: Path, name: str, vocab_size: int = 300, template: str | None = None) -> Path:
    folder = root / name
    if template is None:
        write_hf_tokenizer(folder, vocab_size=vocab_size)
    else:
        write_hf_tokenizer(folder, vocab_size=vocab_size, chat_template=template)
    return folder


def _folder_fingerprint(folder: Path) -> ModelFingerprint:
    return model_fingerprint(
        str(folder), preset_config("tiny"), "safetensors:" + "0" * 64, "float32", LAYOUT
    )


def test_a_tokenizer_only_difference_is_refused_naming_the_tokenizer(tmp_path: Path) -> None:
    a = _folder_fingerprint(_folder(tmp_path, "a", vocab_size=300))
    b = _folder_fingerprint(_folder(tmp_path, "b", vocab_size=310))
    same = _folder_fingerprint(_folder(tmp_path, "same", vocab_size=300))
    assert a == same
    assert [d.split(":")[0] for d in a.differences(b)] == ["tokenizer"]
    _, _, directory = _directory_to(a, b)
    with pytest.raises(IncompatibleModelError, match=r"\(tokenizer: sha256:[0-9a-f]{16}\.\.\. here"):
        directory.get_peer(URL)


def test_a_chat_template_only_difference_names_the_chat_template(tmp_path: Path) -> None:
    a = _folder_fingerprint(_folder(tmp_path, "a"))
    b = _folder_fingerprint(_folder(tmp_path, "b", template="{{ messages[0]['content'] }}"))
    assert [d.split(":")[0] for d in a.differences(b)] == ["chat_template"]
    assert a.to_json()["chat_template"].startswith("sha256:") and "digest" in a.to_json()


def _save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


def test_a_folders_weights_are_told_apart_by_content(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64, generator=gen)}
    (tmp_path / "a").mkdir()
    (tmp_path / "copy").mkdir()
    (tmp_path / "changed").mkdir()
    _save(tmp_path / "a" / "model.safetensors", tensors)
    shutil.copy(tmp_path / "a" / "model.safetensors", tmp_path / "copy" / "model.safetensors")
    changed = {**tensors, "b": tensors["b"].clone()}
    changed["b"][3] += 1.0  # same names, shapes and sizes: one value differs
    _save(tmp_path / "changed" / "model.safetensors", changed)
    digest = safetensors_digest([tmp_path / "a" / "model.safetensors"])
    assert digest.startswith("safetensors:")
    assert safetensors_digest([tmp_path / "copy" / "model.safetensors"]) == digest
    assert safetensors_digest([tmp_path / "changed" / "model.safetensors"]) != digest
    with pytest.raises(ValueError, match="not a safetensors file"):
        (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
        safetensors_digest([tmp_path / "bad.safetensors"])


def test_large_files_are_sampled_and_still_told_apart(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the whole-file limit the data is hashed in windows: other weights of one
    shape (every value differs, as a fine-tune's) are still told apart."""
    monkeypatch.setattr(fp, "FULL_HASH_MAX_BYTES", 4096)
    monkeypatch.setattr(fp, "SAMPLE_BYTES", 256)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(128, 128, generator=gen)  # 64 KiB of data: 32 windows of 256 bytes
    _save(tmp_path / "a.safetensors", {"w": w})
    _save(tmp_path / "b.safetensors", {"w": w + 1e-3})
    first = safetensors_digest([tmp_path / "a.safetensors"])
    assert first == safetensors_digest([tmp_path / "a.safetensors"])
    assert first != safetensors_digest([tmp_path / "b.safetensors"])



def write_hf_llama(folder: Path, tokenizer_vocab: int = 300, seed: int = 0) -> None:
    """A tiny Llama saved by transformers (random weights from `seed`, vocabulary of 300)
    with a byte-level BPE tokenizer of `tokenizer_vocab` ids (at most 300)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(folder)
    write_hf_tokenizer(folder, vocab_size=tokenizer_vocab)


def _header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[: 8 + int.from_bytes(data[:8], "little")]


def _loaded_fingerprint(folder: Path) -> ModelFingerprint:
    loaded = load_model(ModelLoadConfig(model=str(folder), dtype="float32", device="cpu"))
    return model_fingerprint(str(folder), loaded.config, loaded.weights, "float32", LAYOUT)


def test_folders_loaded_are_told_apart_by_weights_and_by_tokenizer(tmp_path: Path) -> None:
    """Through the loader: a copy of a folder is the same model; the same files with one
    weight changed differ in the weights only; another tokenizer in the tokenizer only."""
    write_hf_llama(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "copy")
    shutil.copytree(tmp_path / "a", tmp_path / "retuned")
    from safetensors import safe_open
    from safetensors.torch import save_file

    original = tmp_path / "a" / "model.safetensors"
    with safe_open(str(original), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        metadata = f.metadata()
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
    retuned = tmp_path / "retuned" / "model.safetensors"
    save_file(tensors, str(retuned), metadata=metadata)
    assert _header(retuned) == _header(original)  # names, shapes, offsets: only data differs
    shutil.copytree(tmp_path / "a", tmp_path / "other-tok")
    write_hf_tokenizer(tmp_path / "other-tok", vocab_size=290)
    a = _loaded_fingerprint(tmp_path / "a")
    assert a.weights.startswith("safetensors:")
    assert _loaded_fingerprint(tmp_path / "copy") == a
    assert [d.split(":")[0] for d in a.differences(_loaded_fingerprint(tmp_path / "retuned"))] == [
        "weights"
    ]
    assert [
        d.split(":")[0] for d in a.differences(_loaded_fingerprint(tmp_path / "other-tok"))
    ] == ["tokenizer"]
