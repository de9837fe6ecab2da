"""EAGLE-3 features of a Gemma-3 target: the residual stream, on every device.

An EAGLE-3 head reads the target's hidden state at the inputs of three layers (SpecForge trains it
on HF's ``hidden_states``: the residual stream). SGLang 0.5.23's Gemma-3 keeps its residual apart
from each layer's output branch (``hidden_states, residual = layer(...)``) and captures the input of
layer i as ``hidden_states`` alone, so the head is fed something else, and something different per
device:

* on a CPU (``Gemma3RMSNorm.forward_native``): layer i-1's output *branch* (its
  ``post_feedforward_layernorm``), the residual missing;
* on CUDA (``forward_cuda``: ``gemma_fused_add_rmsnorm`` works in place): the captured tensor is
  overwritten by layer i's *normed* input (``input_layernorm``) before the head reads it.

A head trained on either would not serve on the other device, and one trained by SpecForge on
neither. This module makes Gemma-3 capture the residual stream: after SGLang's
``set_eagle3_layers_to_capture`` it puts a forward pre-hook on each capturing layer that, given the
layer's ``(hidden_states h, residual r)``, adds ``r`` into ``h`` in place (``h`` is the very tensor
SGLang has just appended to its capture list) and hands the layer ``(0, copy of h)`` instead: the
layer's fused add-and-norm computes ``0 + h = h + r``, the same floating-point sum as without the
hook, so the target's outputs are bit-identical to a server without speculation; on CUDA the
in-place norm writes into the zeros and the copy, not into the captured tensor. (Layer 0, whose
input is the embedding, gets a copy too: its residual would alias the captured tensor, which the
next layer's in-place norm on CUDA overwrites.)

Worked example (layer 2 captured; values per element): layer 1 returns ``h = 0.5`` (its branch)
and ``r = 3.0``; SGLang appends ``h`` to the capture list; the hook makes it ``3.5`` (the residual
stream HF reports as ``hidden_states[2]``) and calls layer 2 with ``hidden_states=0, residual=3.5`` (a copy);
layer 2 normalises ``0 + 3.5``, as it would have normalised ``0.5 + 3.0``.
"""

from __future__ import annotations

from typing import Any

from sglang_graft.sglang import seams

_HANDLES = "_graft_capture_hooks"  # attribute on the model: the pre-hook handles of its captured layers


def _stream_into_capture(_module, args: tuple, kwargs: dict):
    """Forward pre-hook of a capturing Gemma-3 layer (called with keyword arguments by SGLang's
    ``Gemma3TextModel.forward``), or of the final norm (positional ``(hidden_states, residual)``)
    where the last layer's output is captured: ``h += r`` in place, the module gets
    ``(zeros, copy of h)``; layer 0 (no residual: ``h`` is the embedding, the stream itself) gets
    a copy of ``h``. The copies keep the residual chain, which CUDA's fused norm updates in place,
    from aliasing the captured tensor."""
    import torch

    positional = "hidden_states" not in kwargs
    h, r = (args[0], args[1] if len(args) > 1 else None) if positional else (kwargs["hidden_states"],
                                                                            kwargs.get("residual"))
    if r is None:
        new = (h.clone(),)
    else:
        h.add_(r)
        new = (torch.zeros_like(h), h.clone())
    if positional:
        return (*new, *args[len(new):]), kwargs
    return args, {**kwargs, **dict(zip(("hidden_states", "residual"), new))}


def _capture_residual_stream(result: Any, model: Any, *args, **kwargs) -> Any:
    """AFTER ``Gemma3ForCausalLM.set_eagle3_layers_to_capture``: pre-hooks on the capturing layers
    (index ``len(layers)``, the last layer's output, on the final norm)."""
    for handle in getattr(model, _HANDLES, ()):
        handle.remove()
    inner = model.model
    modules = [inner.layers[i] if i < len(inner.layers) else inner.norm for i in inner.layers_to_capture]
    setattr(model, _HANDLES, [m.register_forward_pre_hook(_stream_into_capture, with_kwargs=True) for m in modules])
    return result


def register() -> None:
    seams.register_hook(seams.GEMMA3_CAPTURE, _capture_residual_stream, "AFTER")
