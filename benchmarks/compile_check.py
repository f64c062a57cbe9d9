"""Issue 7, lever 4: does `torch.compile` make a decode step cheaper on this CPU?

    python benchmarks/compile_check.py --model qwen2.5-coder-1.5b --steps 24

Times one plain decoding step (q=1) and one 8-token verification pass (q=8) of the same
model, eager and compiled (inductor, `dynamic=True` so a growing context does not recompile,
with and without weight freezing), interleaved after warm-up. What is compiled: each
decoder layer's MLP and the lm_head, about 85% of the weights read per step (attention
writes the KV cache, a side effect dynamo would break the graph on). torch.compile returns
wrappers, so nothing in the library is patched: the script runs its own plain-decoding
forward over them. Prints milliseconds per pass and the ratio to eager.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import spirit
from spirit.skipset import SkipSet


def step_times(model, compiled: dict | None, q: int, steps: int, context: int) -> list[float]:
    cache = model.new_cache(context + steps * q + 8)
    prompt = torch.randint(0, 1000, (1, context))
    model.forward(prompt, 0, cache, SkipSet(), last_only=True)
    times, start = [], context
    for _ in range(steps):
        ids = torch.randint(0, 1000, (1, q))
        t0 = time.perf_counter()
        if compiled is None:
            model.forward(ids, start, cache, SkipSet())
        else:
            compiled["forward"](ids, start, cache)
        times.append(time.perf_counter() - t0)
        start += q
    return times


def compiled_forward(model, freezing: bool):
    torch._inductor.config.freezing = freezing
    mlps = [torch.compile(layer.mlp, dynamic=True) for layer in model.layers]
    head = torch.compile(model.lm_head, dynamic=True)

    @torch.inference_mode()
    def forward(ids, start, cache):
        q = ids.shape[1]
        cache.begin(start, q)
        positions = torch.arange(start, start + q)
        hidden = model.embed_tokens(ids)
        rotary = model._rotary(hidden, positions[None])
        mask = model._mask(start, positions, None, None)
        for layer, mlp in zip(model.layers, mlps):
            attn, _ = layer.self_attn(hidden_states=layer.input_layernorm(hidden),
                                      position_embeddings=rotary[model.layer_types[0]],
                                      attention_mask=mask, **{model._cache_kw: cache})
            hidden = hidden + attn
            hidden = hidden + mlp(layer.post_attention_layernorm(hidden))
        return head(model.norm(hidden)).float()

    return {"forward": forward}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    lm = spirit.load(args.model)
    model = lm.engine.model
    variants = {"eager": None}
    for freezing in (False, True):
        name = f"compiled{'+freezing' if freezing else ''}"
        t0 = time.perf_counter()
        variants[name] = compiled_forward(model, freezing)
        for q in (1, 8):  # compile (and warm) both shapes before timing
            step_times(model, variants[name], q, 3, args.context)
        print(f"{name}: compiled and warmed in {time.perf_counter() - t0:.0f} s", flush=True)
    for q in (1, 8):
        step_times(model, None, q, 3, args.context)
    results = {(n, q): [] for n in variants for q in (1, 8)}
    for _ in range(args.rounds):  # interleaved: drift hits every variant alike
        for q in (1, 8):
            for name, compiled in variants.items():
                results[(name, q)] += step_times(model, compiled, q, args.steps, args.context)
    for q in (1, 8):
        eager = statistics.median(results[("eager", q)])
        for name in variants:
            ms = statistics.median(results[(name, q)])
            print(f"q={q} {name:18s} {1000 * ms:7.1f} ms/pass  {eager / ms:.2f}x eager")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
