"""The residual-stream capture of EAGLE-3 features on a Gemma-3 target (``target_capture``): the
captured tensor is HF's ``hidden_states`` (the residual stream) and the layer's output is
bit-identical to an uncaptured one, with SGLang's own ``Gemma3RMSNorm`` (native, as on a CPU) and
with a stand-in of the CUDA kernel's in-place fused add-and-norm. The served end to end (GRAFT
token-exact on a Gemma-3 target with sliding windows) is ``test_gemma3_sliding.py``."""

from __future__ import annotations

import pytest
import torch

from sglang_graft.sglang import target_capture


def _norm(dim: int):
    from sglang.srt.layers.layernorm import Gemma3RMSNorm

    norm = Gemma3RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(dim) * 0.1)
    return norm


def _in_place_fused(norm):
    """The CUDA path of ``Gemma3RMSNorm`` with a residual (``gemma_fused_add_rmsnorm``): ``residual
    <- x + residual`` and ``x <- norm(residual)``, both in place."""

    def forward(x, residual=None):
        if residual is None:
            return norm.forward_native(x)
        out, stream = norm.forward_native(x, residual)
        residual.copy_(stream)
        x.copy_(out)
        return x, residual

    return forward


class _Layer(torch.nn.Module):
    """The shape of SGLang's ``Gemma3DecoderLayer``: fused add-and-norm of its input and residual,
    then a branch; returns ``(branch, residual)``."""

    def __init__(self, dim: int, in_place: bool):
        super().__init__()
        self.input_layernorm = _norm(dim)
        self.fused = _in_place_fused(self.input_layernorm) if in_place else self.input_layernorm.forward_native
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, hidden_states, residual=None):
        if residual is None:
            residual, hidden_states = hidden_states, self.fused(hidden_states)
        else:
            hidden_states, residual = self.fused(hidden_states, residual)
        return self.proj(hidden_states), residual


class _Model(torch.nn.Module):
    """SGLang's ``Gemma3TextModel.forward`` loop: the capture appends ``hidden_states`` before the
    layer runs; the final norm adds the last residual."""

    def __init__(self, dim: int, n: int, in_place: bool):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer(dim, in_place) for _ in range(n))
        self.norm = _norm(dim)
        self.layers_to_capture: list[int] = []

    def forward(self, x):
        aux, hidden, residual, streams = [], x, None, []
        for i, layer in enumerate(self.layers):
            streams.append(hidden.clone() if residual is None else hidden + residual)  # HF's hidden_states[i]
            if i in self.layers_to_capture:
                aux.append(hidden)
            hidden, residual = layer(hidden_states=hidden, residual=residual)
        streams.append(hidden + residual)
        if len(self.layers) in self.layers_to_capture:
            aux.append(hidden)
        out, _ = self.norm(hidden, residual)  # forward_native on a CPU
        return out, aux, streams


class _Causal(torch.nn.Module):
    def __init__(self, dim: int = 16, n: int = 5, in_place: bool = False):
        super().__init__()
        self.model = _Model(dim, n, in_place)


@pytest.mark.parametrize("in_place", [False, True], ids=["native", "cuda-like in place"])
def test_gemma3_capture_is_the_residual_stream_and_leaves_outputs_bit_identical(in_place):
    torch.manual_seed(0)
    model = _Causal(in_place=in_place)
    x = torch.randn(3, 16) * 4
    with torch.no_grad():
        plain_out, _, streams = model.model(x.clone())
        model.model.layers_to_capture = [0, 2, 4]
        unfixed_out, unfixed_aux, _ = model.model(x.clone())
        assert torch.equal(unfixed_out, plain_out)
        assert not torch.allclose(unfixed_aux[1], streams[2])  # SGLang's capture: not the stream
        target_capture._capture_residual_stream(None, model, [1, 3])  # what the AFTER hook does
        target_capture._capture_residual_stream(None, model, [1, 3])  # a second call replaces, not stacks
        out, aux, _ = model.model(x.clone())
    assert torch.equal(out, plain_out)
    for got, i in zip(aux, [0, 2, 4]):
        assert torch.equal(got, streams[i])


def test_gemma3_capture_of_the_last_layer_output_goes_through_the_final_norm():
    torch.manual_seed(1)
    model = _Causal(n=3)
    x = torch.randn(2, 16)
    with torch.no_grad():
        plain_out, _, streams = model.model(x.clone())
        model.model.layers_to_capture = [3]
        target_capture._capture_residual_stream(None, model, [2])
        out, aux, _ = model.model(x.clone())
    assert torch.equal(out, plain_out)
    assert torch.equal(aux[0], streams[3])
