"""int8 inference layers (precision.Int8Linear) against the quantisation formulas written here."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from aiayn.precision import INT8_ROUTES, Int8Linear, for_inference, kernels


def quantise_rows(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: m ~ scale * q, q in [-127, 127], scale = max|row| / 127."""
    scale = m.abs().amax(dim=1) / 127
    return (m / scale[:, None]).round().clamp(-127, 127), scale


@pytest.fixture
def linear():
    torch.manual_seed(0)
    layer = nn.Linear(64, 48)
    return layer, torch.randn(5, 4, 64)  # 20 rows: W8A8 (2 to 15 are weight-only)


def quantise_rows_around_midpoints(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row int8 around each row's midpoint: m ~ mid + scale * q, q in [-127, 127], scale = range / 254."""
    high, low = m.max(dim=1).values, m.min(dim=1).values
    mid, scale = (high + low) / 2, (high - low) / 254
    return ((m - mid[:, None]) / scale[:, None]).round().clamp(-127, 127), mid, scale


@pytest.mark.parametrize("shift", [0.0, 3.0])  # 3: every input > 0, as after a ReLU
def test_w8a8_is_integer_products_of_both_quantised_sides(linear, shift):
    layer, x = linear
    x = x + shift
    wq, ws = quantise_rows(layer.weight.detach())
    xq, mid, xs = quantise_rows_around_midpoints(x.reshape(-1, 64))
    # x W^T = (mid + xs * xq) (ws * wq)^T, summed as integers where it can be
    integer = (xq.long() @ wq.long().t()).double()  # (20, 48)
    row_sums = wq.double().sum(dim=1) * ws.double()  # (48,)
    exact = (
        integer * xs.double()[:, None] * ws.double() + mid.double()[:, None] * row_sums + layer.bias.double()
    )
    got = Int8Linear(layer, "w8a8")(x)
    assert got.shape == (5, 4, 48) and got.dtype == torch.float32
    torch.testing.assert_close(got.reshape(-1, 48).double(), exact, atol=1e-4, rtol=1e-5)


def test_w8a8_quantises_positive_inputs_finer_than_around_zero(linear):
    """Inputs all > 0 (a ReLU's): around the midpoint their 255 levels span the range; around 0 only 128
    of them would: the error against fp32 is about half (weights on the int8 grid: the activations' error alone)."""
    layer, x = linear
    x = x.abs()
    with torch.no_grad():
        grid = torch.randint(-127, 128, (48, 64)).float()
        grid[:, 0] = 127  # every row's largest value: its scale is exactly 1/64
        layer.weight.copy_(grid / 64)
        reference = layer(x).reshape(-1, 48).double()
    wq, ws = quantise_rows(layer.weight.detach())
    xq, xs = quantise_rows(x.reshape(-1, 64))  # the symmetric alternative
    around_zero = (xq.double() * xs.double()[:, None]) @ (
        wq.double() * ws.double()[:, None]
    ).t() + layer.bias.double()
    midpoint = Int8Linear(layer, "w8a8")(x).reshape(-1, 48).double()
    assert (midpoint - reference).abs().mean() < 0.6 * (around_zero - reference).abs().mean()


def test_weight_only_int8_uses_bf16_activations(linear):
    layer, x = linear
    wq, ws = quantise_rows(layer.weight.detach())
    dequantised = wq * ws.bfloat16().float()[:, None]
    expected = x.bfloat16().float() @ dequantised.t() + layer.bias.detach()
    torch.testing.assert_close(Int8Linear(layer, "woq")(x), expected, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 4, 15, 16, 32])
def test_with_vnni_the_rows_of_a_decoding_step_take_bf16_activations(linear, rows):
    """With VNNI, up to 15 rows (R, L) take the weight-only path: integer products of both sides are the
    slower kernel there (oneDNN's matrix-vector call costs the same at any size, and it packs the weight
    on every call from two rows on); 16 or more are W8A8."""
    layer, _ = linear
    x = torch.randn(rows, 1, 64)
    w8a8 = Int8Linear(layer, INT8_ROUTES["vnni"])
    weight_only = Int8Linear(layer, "woq")
    with torch.no_grad():
        want_weight_only = rows < 16
        got = w8a8(x)
        assert torch.equal(got, weight_only(x)) == want_weight_only
        if not want_weight_only:  # W8A8 quantises row by row: the same numbers among 20 more rows
            more = torch.cat([x, x[:1].expand(20, -1, -1)])  # (rows + 20, 1, 64)
            torch.testing.assert_close(got, w8a8(more)[:rows])


@pytest.mark.parametrize("rows", [1, 4, 15, 16, 32])
def test_without_vnni_a_batch_takes_the_float_weights(linear, rows):
    """The route of a CPU without VNNI: int8 weights with bf16 activations up to 15 rows, the float
    weights, exactly, from 16 rows on (and for a count a compiled graph leaves dynamic: 2-D here)."""
    layer, _ = linear
    x = torch.randn(rows, 1, 64)
    int8 = Int8Linear(layer, INT8_ROUTES["avx2"])
    with torch.no_grad():
        want = layer(x) if rows >= 16 else Int8Linear(layer, "woq")(x)
        assert torch.equal(int8(x), want)
        assert torch.equal(int8(x.reshape(rows, 64)), layer(x.reshape(rows, 64)))


@pytest.mark.parametrize("w8a8", [True, False])
def test_int8_is_close_to_fp32_and_its_rows_dequantise(linear, w8a8):
    layer, x = linear
    int8 = Int8Linear(layer, "w8a8" if w8a8 else "woq")
    with torch.no_grad():
        reference = layer(x)
    error = (int8(x) - reference).abs().max() / reference.abs().max()
    assert 0 < error < 0.03  # another computation, but close
    index = torch.tensor([3, 0, 47])
    wq, ws = quantise_rows(layer.weight.detach()[index])
    scale = ws if w8a8 else ws.bfloat16().float()
    torch.testing.assert_close(int8.rows(index), wq * scale[:, None])


def test_for_inference_int8_replaces_every_linear_of_a_copy():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    int8 = for_inference(model, "int8")
    assert [type(m) for m in int8.modules() if isinstance(m, (nn.Linear, Int8Linear))] == [Int8Linear] * 2
    assert all(m.routes == INT8_ROUTES[kernels()] for m in int8.modules() if isinstance(m, Int8Linear))
    assert [type(m) for m in model.modules()].count(nn.Linear) == 2  # the float model is as it was


def test_the_int8_routes_without_vnni_are_the_fastest_kernels_measured_under_avx2():
    """INT8_ROUTES["avx2"] is what bench_gemm.py measured capped at AVX2 (docs/bench_gemm_cpu_avx2.json):
    for each row class (1, 4 and 32 rows of a decoding step's matrix products), the route whose kernel
    took the least time over the model's shapes."""
    results = json.loads((Path(__file__).parents[1] / "docs" / "bench_gemm_cpu_avx2.json").read_text())
    assert "capped at AVX2" in results["machine"]
    kernels = {"fp32": "mkl_fp32", "woq": "int8_weights_bf16_act", "w8a8": "int_mm_int8"}
    for row_class, rows in (("one", 1), ("few", 4), ("many", 32)):
        cells = [cell for cell in results["us_per_call"] if cell["rows"] == rows]
        times = {route: sum(cell[kernel] for cell in cells) for route, kernel in kernels.items()}
        assert INT8_ROUTES["avx2"][row_class] == min(times, key=times.get), (row_class, times)
