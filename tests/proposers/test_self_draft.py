"""The layer-skip (and quantized) draft's chain: where it stops."""

import torch

from spirit.proposers.self_draft import draft_layerskip
from spirit.model.adapter import SkippableModel
from spirit.sampling import SamplingParams
from spirit.skipset import DraftConfig, SkipSet
from spirit.testing import tiny_model


def draft(stop_ids=frozenset()):
    model = SkippableModel(tiny_model("qwen2", num_layers=4))
    ids = list(range(20, 36))
    cache = model.new_cache(64)
    with torch.inference_mode():
        model.forward(torch.tensor([ids[:-1]]), 0, cache, SkipSet())
        config = DraftConfig(skip=SkipSet.parse("mlp:2"), threshold=0.0, max_draft=8)
        return draft_layerskip(model, ids, cache, config, SamplingParams(), None, 8, stop_ids=stop_ids)


def test_the_chain_ends_at_an_end_of_sequence_token():
    free = draft()
    assert free.drafted == 8  # threshold 0: nothing else stops it
    chain = free.tokens[1:]
    stop = chain[2]
    stopped = draft(frozenset({stop}))
    first = chain.index(stop)
    assert stopped.tokens[1:] == chain[: first + 1]
