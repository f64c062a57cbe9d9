import pytest
from torch import nn

from spirit.sol import graph_cost
from spirit.sol.capture import capture


class Fn(nn.Module):
    """Wrap a function as a module so it goes through torch.export like a real model."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@pytest.fixture(params=["export", "make_fx"])
def cost_of(request):
    """cost_of(fn, *inputs) -> GraphCost, through each capture path."""

    def run(fn, *inputs):
        target = fn if isinstance(fn, nn.Module) else Fn(fn)
        captured = capture(target, inputs, use_export=request.param == "export")
        assert captured.method == request.param, captured.fallback_reason
        return graph_cost(captured)

    return run


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIRIT_CACHE", str(tmp_path))
    return tmp_path

