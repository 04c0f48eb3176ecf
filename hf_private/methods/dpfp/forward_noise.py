"""DP-FP's forward-pass mechanism: a module's output released per example clipped and noised, during training only.

DP forward propagation (methods_spec §5.1) privatises representations instead of gradients: each example's
output of a chosen module is clipped to L2 norm C (over everything but the batch dimension) and N(0, σ²C²) is
added to every coordinate before the rest of the network sees it. The noise comes from the same secret ChaCha20
source as DP-SGD's (never from torch's generators or `args.seed`). At evaluation (module in eval mode) the output is
left as it is: only what training consumes is released.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...privacy.noise import GaussianNoise

_NORM_FLOOR = 1e-12


class ClippedNoisyOutput:
    """A forward hook: y_b ← y_b · min(1, C / ‖y_b‖₂) + N(0, σ²C²) for every example b, in training mode."""

    def __init__(self, clip: float, noise_multiplier: float, noise: GaussianNoise) -> None:
        if not clip > 0:
            raise ValueError(f"clip must be > 0, got {clip}.")
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}.")
        self.clip = float(clip)
        self.noise_multiplier = float(noise_multiplier)
        self.noise = noise

    def attach(self, module: nn.Module) -> RemovableHandle:
        """Clip and noise `module`'s output."""
        return module.register_forward_hook(self._hook)

    def attach_to_input(self, module: nn.Module) -> RemovableHandle:
        """Clip and noise `module`'s (first) input, e.g. RoBERTa's representation: the input of
        `classifier.out_proj`, computed by a functional tanh that no module outputs."""
        return module.register_forward_pre_hook(self._pre_hook)

    def _pre_hook(self, module: nn.Module, args: tuple):
        if not module.training or not args:
            return None
        return (self._hook(module, args, args[0]), *args[1:])

    def _hook(self, module: nn.Module, args: tuple, output):
        if not module.training:
            return output
        if torch._C._current_graph_task_id() != -1:  # a forward run by a backward pass: a checkpoint's recompute
            raise RuntimeError(
                f"DP-FP's noise point ({type(module).__name__}) lies inside an activation-checkpointed layer: the "
                "backward pass recomputes that layer and would draw the representation's noise a second time (a "
                "release the accountant does not count, and gradients of another forward than the loss's). Name a "
                "noise_point outside the checkpointed layers (the default, the pooled representation, is one), or "
                "train with gradient_checkpointing=False."
            )
        if not torch.is_tensor(output) or output.dim() < 1:
            raise TypeError(
                f"{type(module).__name__} returns {type(output).__name__}: a forward mechanism needs a tensor output "
                "whose first dimension is the example."
            )
        norms = output.detach().float().flatten(1).norm(dim=1) if output.dim() > 1 else output.detach().float().abs()
        factor = (self.clip / norms.clamp_min(_NORM_FLOOR)).clamp(max=1.0)
        clipped = output * factor.to(output.dtype).view(-1, *([1] * (output.dim() - 1)))
        if self.noise_multiplier == 0:
            return clipped
        noise = torch.zeros(output.shape, dtype=torch.float32, device=output.device)
        self.noise.add_([noise], self.noise_multiplier * self.clip)
        return clipped + noise.to(output.dtype)
