"""RMSNorm (torch's and the Llama family's): gain gradient Σ_t G_t ⊙ x̂_t with x̂ = x / rms(x)."""

from __future__ import annotations

import torch
from torch import nn

from ..terms import SampleTerm, in_compute_dtype
from .base import LayerHandler
from .registry import register_layer


def _llama_family_rms_norms() -> tuple[type, ...]:
    """HF copies of LlamaRMSNorm (fp32 statistics, then `weight * x̂.to(input_dtype)`)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    return (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm)


@register_layer(nn.RMSNorm)
class TorchRMSNormHandler(LayerHandler):
    rule = "RMSNorm"
    params = ("weight",)
    input_params = ("weight",)

    def normalize(self, module, x: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        """x̂ as F.rms_norm computes it: from the input in the op's dtype, statistics in at least float32 (a bf16
        input's default eps is float32's, not bf16's)."""
        x = in_compute_dtype(x, grad_output)
        x = x.to(torch.promote_types(x.dtype, torch.float32))
        dims = tuple(range(-len(module.normalized_shape), 0))
        eps = module.eps if module.eps is not None else torch.finfo(x.dtype).eps
        return x * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)

    def terms(self, module, saved, grad_output, trainable):
        batch = grad_output.shape[0]
        shape = tuple(module.weight.shape)
        normalized = self.normalize(module, saved, grad_output).reshape(batch, -1, *shape)
        return {"weight": SampleTerm((grad_output.reshape(batch, -1, *shape) * normalized).sum(1))}


@register_layer(*_llama_family_rms_norms())
class LlamaRMSNormHandler(TorchRMSNormHandler):
    def normalize(self, module, x, grad_output):
        """The module's own forward, on the input as saved: it chooses its dtypes itself (x̂ back in x's dtype)."""
        hidden = x.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        return hidden.to(x.dtype)
