"""KernelBench-style problem: RMSNorm + SwiGLU MLP + residual, one decode row (memory-bound)."""

import torch
from torch import nn

HIDDEN, INTERMEDIATE, ROWS = 1024, 2816, 1


class Model(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden)
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, hidden]
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def get_inputs():
    return [torch.randn(ROWS, HIDDEN)]


def get_init_inputs():
    return [HIDDEN, INTERMEDIATE]
