"""The decode step's few-row Triton products (``kernels/skinny_triton.py``) vs ``F.linear``: odd widths and column
counts (not multiples of a tile), 1-16 rows, one to three weights, biases, a residual added, both activations.

CPU: only under ``TRITON_INTERPRET=1``, small shapes. GPU: Llama-3.1-8B's shapes in bf16 (``-m gpu``)."""

import pytest
import torch

from tests.support.triton_env import triton_device

INTERPRET, HAS_CUDA, DEVICE = triton_device("Triton kernels")


def _skinny():
    from cca_convert.kernels import skinny_triton

    return skinny_triton


def _rand(*shape, seed, dtype=torch.float32, device=DEVICE, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device, dtype)


def _close_bf16(got, x, weights, biases, dtype):
    """got (dtype) vs the fp32 reference: within twice the error of the reference run in ``dtype`` (+ atol)."""
    sk = _skinny()
    exact = sk.skinny_linear_reference(x.float(), [w.float() for w in weights],
                                       None if biases is None else [b.float() for b in biases])
    rounded = sk.skinny_linear_reference(x, weights, biases)
    for g, e, r in zip(got, exact, rounded):
        assert g.dtype == dtype and g.shape == e.shape
        bound = 2 * (r.float() - e).abs().max().item() + 1e-2
        assert (g.float() - e).abs().max().item() <= bound


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("widths", [(40,), (17, 5, 33), (64, 16)], ids=["one", "three", "two"])
@pytest.mark.parametrize("K", [24, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_reference(rows, widths, K, bias):
    sk = _skinny()
    x = _rand(rows, K, seed=rows + K)
    weights = [_rand(n, K, seed=i, scale=K**-0.5) for i, n in enumerate(widths)]
    biases = [_rand(n, seed=10 + i) for i, n in enumerate(widths)] if bias else None
    assert sk.usable(x, *weights)
    got = sk.skinny_linear(x, weights, biases)
    for g, r in zip(got, sk.skinny_linear_reference(x, weights, biases)):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("N,K", [(37, 24), (96, 300)])
def test_gated_matches_reference(rows, act, N, K):
    sk = _skinny()
    x = _rand(rows, K, seed=rows)
    gate, up = _rand(N, K, seed=1, scale=2 * K**-0.5), _rand(N, K, seed=2, scale=K**-0.5)
    torch.testing.assert_close(sk.skinny_gated(x, gate, up, act), sk.skinny_gated_reference(x, gate, up, act),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize("N,K", [(40, 24), (97, 300)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_adds_a_residual(rows, N, K, bias):
    sk = _skinny()
    x, w = _rand(rows, K, seed=rows), _rand(N, K, seed=1, scale=K**-0.5)
    b = [_rand(N, seed=2)] if bias else None
    residual = _rand(rows, N, seed=3, scale=30.0)
    (got,) = sk.skinny_linear(x, [w], b, residual)
    (expected,) = sk.skinny_linear_reference(x, [w], b, residual)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    with pytest.raises(ValueError, match="a residual is added to one weight's product"):
        sk.skinny_linear(x, [w, w], None, residual)
    with pytest.raises(ValueError, match=f"contiguous \\({rows}, {N}\\) tensor"):
        sk.skinny_linear(x, [w], None, residual[:, :-1])


def test_strided_rows_and_refusals():
    sk = _skinny()
    x = _rand(3, 2 * 48, seed=0)[:, ::1][:, :48]  # rows 96 apart in memory
    w = _rand(20, 48, seed=1)
    torch.testing.assert_close(sk.skinny_linear(x, [w])[0], x @ w.T, atol=1e-5, rtol=1e-5)
    assert not sk.usable(_rand(17, 48, seed=2), w)  # more rows than one tile: cuBLAS's job
    assert not sk.usable(x, _rand(20, 40, seed=3))  # widths differ
    assert not sk.usable(x, w.T.contiguous().T)  # a column-major weight
    with pytest.raises(ValueError, match="1-3 weights"):
        sk.skinny_linear(x, [w] * 4)
    with pytest.raises(ValueError, match="a bias for every weight or for none"):
        sk.skinny_linear(x, [w, w], [torch.zeros(20, device=DEVICE), None])
    with pytest.raises(ValueError, match="activation 'relu'"):
        sk.skinny_gated(x, w, w, "relu")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_llama_8b_shapes(rows, dtype):
    """One decode step's products at Llama-3.1-8B's sizes: q/k/v in one launch, o, the gated MLP, down."""
    sk = _skinny()
    x = _rand(rows, 4096, seed=rows, dtype=dtype)
    q, k, v, o = (_rand(n, 4096, seed=i, dtype=dtype, scale=4096**-0.5) for i, n in enumerate((4096, 1024, 1024, 4096)))
    assert sk.usable(x, q, k, v) and not sk.usable(x.float(), q.float())  # fp32: cuBLAS
    _close_bf16(sk.skinny_linear(x, [q, k, v]), x, [q, k, v], None, dtype)
    bias = [_rand(n, seed=7, dtype=dtype) for n in (4096, 1024, 1024)]
    _close_bf16(sk.skinny_linear(x, [q, k, v], bias), x, [q, k, v], bias, dtype)
    _close_bf16(sk.skinny_linear(x, [o]), x, [o], None, dtype)
    gate, up = (_rand(14336, 4096, seed=s, dtype=dtype, scale=4096**-0.5) for s in (8, 9))
    down = _rand(4096, 14336, seed=10, dtype=dtype, scale=14336**-0.5)
    for act in sk.ACTIVATIONS:
        got = sk.skinny_gated(x, gate, up, act)
        exact = sk.skinny_gated_reference(x.float(), gate.float(), up.float(), act)
        rounded = sk.skinny_gated_reference(x, gate, up, act).float()
        assert (got.float() - exact).abs().max() <= 2 * (rounded - exact).abs().max() + 1e-2
        _close_bf16(sk.skinny_linear(got, [down]), got, [down], None, dtype)
    # a residual in the product's launch: the bits of the product, then eager code's add
    residual = _rand(rows, 4096, seed=11, dtype=dtype, scale=20.0)
    for h, w in ((x, o), (sk.skinny_gated(x, gate, up, "silu"), down)):
        (plain,) = sk.skinny_linear(h, [w])
        assert torch.equal(sk.skinny_linear(h, [w], None, residual)[0], residual + plain)
