"""The expert kernels (torch's grouped GEMM and the per-expert loop) against autograd through a
naive per-row reference, on CPU and, where present, on CUDA (`tools/gpu_check.sh`)."""
import pytest
import torch

from megamoe.experts import ACTIVATIONS, GROUPED_MM, LOOP, expert_mlp
from megamoe.experts.grouped import grouped_mm_fits

from reference import naive_expert

HAS_GROUPED_MM = hasattr(torch.nn.functional, "grouped_mm")
KERNELS = [pytest.param(GROUPED_MM, id="grouped_mm", marks=pytest.mark.skipif(
               not HAS_GROUPED_MM, reason="this torch has no grouped_mm")),
           pytest.param(LOOP, id="loop")]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]
D, F = 16, 24
COUNTS = [3, 0, 5, 0, 4]  # experts 1 and 3 receive no rows
BF16_TOLERANCE = 1e-2  # a few bf16 roundings (2^-8 each) along the way


def expert_inputs(counts, activation, device="cpu", d=D, f=F):
    torch.manual_seed(0)
    fc1_out = 2 * f if activation == "swiglu" else f
    fc1 = (torch.randn(len(counts), fc1_out, d) / d**0.5).to(device).requires_grad_()
    fc2 = (torch.randn(len(counts), d, f) / f**0.5).to(device).requires_grad_()
    x = torch.randn(sum(counts), d, device=device, requires_grad=True)
    return x, fc1, fc2


def naive_rows(x, counts, fc1, fc2, activation):
    """Row by row: expert e's MLP on each of its rows (autograd gives the reference grads)."""
    experts = [e for e, n in enumerate(counts) for _ in range(n)]
    rows = [naive_expert(x[i], fc1[e], fc2[e], activation) for i, e in enumerate(experts)]
    return torch.stack(rows) if rows else x.new_zeros((0, fc2.shape[1]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ["swiglu", "gelu", "squared_relu"])
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_matches_naive_rows_with_empty_experts(kernel, activation, device):
    """Forward and all three gradients; the output gradient is the expanded one of a sum
    (zero strides), which grouped_mm's backward only takes made contiguous."""
    x, fc1, fc2 = expert_inputs(COUNTS, activation, device)
    out = expert_mlp(x, COUNTS, fc1, fc2, ACTIVATIONS[activation], gemm=kernel)
    got = torch.autograd.grad(out.sum(), (x, fc1, fc2))
    expected_out = naive_rows(x, COUNTS, fc1, fc2, activation)
    expected = torch.autograd.grad(expected_out.sum(), (x, fc1, fc2))
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    for expert in (1, 3):  # no rows: exactly zero gradient, not uninitialised memory
        assert float(got[1][expert].abs().sum()) == 0.0
        assert float(got[2][expert].abs().sum()) == 0.0


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_on_no_rows_at_all(kernel):
    """A rank whose experts receive no token: an empty output and zero weight gradients."""
    x, fc1, fc2 = expert_inputs([0, 0, 0], "swiglu")
    out = expert_mlp(x, [0, 0, 0], fc1, fc2, ACTIVATIONS["swiglu"], gemm=kernel)
    assert out.shape == (0, D)
    grads = torch.autograd.grad(out.sum(), (x, fc1, fc2))
    assert grads[0].shape == (0, D)
    assert float(grads[1].abs().sum()) == 0.0 and float(grads[2].abs().sum()) == 0.0


@pytest.mark.skipif(not HAS_GROUPED_MM, reason="this torch has no grouped_mm")
def test_grouped_mm_offsets_are_int32_ends():
    offsets = GROUPED_MM.groups(COUNTS, torch.device("cpu"))
    assert offsets.dtype == torch.int32 and offsets.tolist() == [3, 3, 8, 8, 12]


@pytest.mark.parametrize("device", DEVICES)
def test_default_kernel_is_grouped_mm_and_falls_back_when_misaligned(device):
    """Widths that are multiples of 16 bytes take grouped_mm; an FFN width of 6 fp32 elements
    (24 bytes), which grouped_mm refuses, takes the loop and still computes the right thing."""
    x, fc1, fc2 = expert_inputs(COUNTS, "swiglu", device)
    assert grouped_mm_fits(x, fc2) == HAS_GROUPED_MM
    x, fc1, fc2 = expert_inputs(COUNTS, "swiglu", device, f=6)
    assert not grouped_mm_fits(x, fc2)
    out = expert_mlp(x, COUNTS, fc1, fc2, ACTIVATIONS["swiglu"])
    torch.testing.assert_close(out, naive_rows(x, COUNTS, fc1, fc2, "swiglu"),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_kernel_matches_fp32_within_bf16_tolerance(kernel, device):
    """The bf16 path (what a GPU trains in) against the naive fp32 reference on the same
    bf16-rounded values."""
    counts = [40, 0, 72, 16]
    x, fc1, fc2 = expert_inputs(counts, "swiglu", device, d=64, f=32)
    grad = torch.randn(x.shape[0], 64, device=device).bfloat16()
    act = ACTIVATIONS["swiglu"]
    leaves16 = [t.detach().bfloat16().requires_grad_() for t in (x, fc1, fc2)]
    leaves32 = [t.detach().float().requires_grad_() for t in leaves16]
    out16 = expert_mlp(leaves16[0], counts, *leaves16[1:], act, gemm=kernel)
    out32 = naive_rows(leaves32[0], counts, *leaves32[1:], "swiglu")
    assert out16.dtype == torch.bfloat16
    out16.backward(grad)
    out32.backward(grad.float())
    assert relative_error(out16, out32) < BF16_TOLERANCE
    for low, high in zip(leaves16, leaves32):
        assert low.grad.dtype == torch.bfloat16
        assert relative_error(low.grad, high.grad) < BF16_TOLERANCE


def relative_error(low, high):
    """|low - high| / |high| over the whole tensor (bf16 rounds each element by up to 2^-8)."""
    return float((low.detach().float() - high.detach()).norm() / high.detach().norm())
