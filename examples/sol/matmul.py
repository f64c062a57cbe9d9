"""KernelBench-style problem: a square fp32 matmul (C = A @ B)."""

import torch
from torch import nn

N = 1024


class Model(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b


class ModelNew(nn.Module):
    """A candidate: the same product through torch.mm (what a kernel author would replace)."""

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b)


def get_inputs():
    return [torch.randn(N, N), torch.randn(N, N)]


def get_init_inputs():
    return []
