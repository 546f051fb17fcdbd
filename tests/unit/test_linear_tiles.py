"""Prefill matmuls on the oneDNN-packed weight in tiles (`decoder.onednn_linear_tiled`):
the same result as `F.linear`, and a bounded set of row counts reaching oneDNN, which keeps
a primitive and its buffers per distinct row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvduplex.model import decoder
from kvduplex.model.decoder import ONEDNN_MAX_ROWS
from kvduplex.model.decoder import PREFILL_TILE_ROWS
from kvduplex.model.decoder import can_pack_for_onednn
from kvduplex.model.decoder import linear
from kvduplex.model.decoder import pack_for_onednn

pytestmark = pytest.mark.skipif(
    not can_pack_for_onednn(torch.empty(2, 2)), reason="this PyTorch has no oneDNN linear"
)

ROW_COUNTS = [2, 64, 65, 200, 256, 257, 511, 700, 2048]


@pytest.mark.parametrize("num_rows", ROW_COUNTS)
@pytest.mark.parametrize("strided", [False, True], ids=["contiguous", "split-view"])
def test_tiled_linear_equals_f_linear(num_rows: int, strided: bool) -> None:
    gen = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(96, 80, generator=gen)
    bias = torch.randn(96, generator=gen)
    if strided:  # the MLP's down projection takes the gate half of the fused gate/up output
        x = torch.randn(num_rows, 160, generator=gen).split(80, dim=-1)[0]
    else:
        x = torch.randn(num_rows, 80, generator=gen)
    with torch.no_grad():
        got = linear(x, weight, bias, pack_for_onednn(weight))
    assert got.shape == (num_rows, 96) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, weight, bias), atol=1e-4, rtol=1e-4)


def test_row_counts_reaching_onednn_are_bounded_whatever_the_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: set[int] = set()
    onednn = decoder._onednn_linear

    def record(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        seen.add(x.shape[0])
        return onednn(x, packed, bias)

    monkeypatch.setattr(decoder, "_onednn_linear", record)
    weight = torch.randn(16, 8)
    packed = pack_for_onednn(weight)
    with torch.no_grad():
        for num_rows in range(ONEDNN_MAX_ROWS + 1, 3 * PREFILL_TILE_ROWS + 1):
            linear(torch.randn(num_rows, 8), weight, None, packed)
    tails = set(range(2 * ONEDNN_MAX_ROWS, PREFILL_TILE_ROWS, ONEDNN_MAX_ROWS))
    assert seen <= set(range(1, ONEDNN_MAX_ROWS + 1)) | tails | {PREFILL_TILE_ROWS}
    assert PREFILL_TILE_ROWS in seen and tails <= seen
