"""Newton-Schulz in float32 for torch.optim.Muon, for the benches on a host without a bf16 matmul path.

torch.optim.Muon orthogonalizes each update in bfloat16 (torch/optim/_muon.py). On a CPU without
AVX512-BF16 or AMX, oneDNN has no fast bf16 kernel: on this project's AVX2-only host a 1024^2 bf16 matmul
takes 2.3 s on one thread against 0.032 s in float32, so one Muon step of bench/whole_tensor/whole_tensor.py's d_model
1024 GPT would take minutes and measure nothing but that slow path. `--newton-schulz float32` (in
whole_tensor.py and owner_bound.py alike, so a bound and the run it bounds do the same work) runs the same
quintic iteration, the same coefficients and steps, in float32. It changes the arithmetic of every arm
alike (one process, ddp, the owners), not what the engine moves or how it is timed.
"""

from __future__ import annotations

import torch
import torch.optim._muon as torch_muon

CHOICES = ("bfloat16", "float32")  # bfloat16: torch's own


def _float32_newton_schulz(grad: torch.Tensor, ns_coefficients, ns_steps: int, eps: float) -> torch.Tensor:
    """torch's iteration X <- aX + (bA + cA^2)X with A = XX^T, on the wide orientation, in float32."""
    a, b, c = ns_coefficients
    tall = grad.size(0) > grad.size(1)
    x = grad.float().T if tall else grad.float()
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def use(dtype: str) -> None:
    """Make this process's torch.optim.Muon orthogonalize in `dtype` (one of CHOICES)."""
    if dtype == "float32":
        torch_muon._zeropower_via_newtonschulz = _float32_newton_schulz
    elif dtype != "bfloat16":
        raise ValueError(f"--newton-schulz: {dtype!r}, not one of {CHOICES}")
