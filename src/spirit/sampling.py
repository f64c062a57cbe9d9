"""Turning logits into the distribution we sample from, identically for draft and target.

Speculative sampling is exact only if the draft distribution q and the target distribution
p are both processed the same way (temperature, then top-k, then top-p) and the accept /
resample rule in `verify.py` is applied to those processed distributions.

Two sampling modes (`SamplingParams.mode`), both exact samples of the full model's p:
- *rejection*: draws from a generator; speculative sampling's accept / resample rule
  (verify.py). The text depends on the draft (which draws were spent on it).
- *gumbel*: the randomness of each position is fixed in advance. The token at absolute
  position t (its index in prompt + output) is argmax(log p_t + g_t), where g_t is Gumbel
  noise over the vocabulary, a pure function of (seed, t). By the Gumbel-max trick (Gumbel,
  1954; Maddison, Tarlow & Minka, 2014, "A* Sampling", sec. 2) that token is distributed as
  p_t, and since g_t is independent of the tokens before t, the sequence is distributed as
  the model's own samples. The target's token at every position is then determined, so a
  draft token is accepted exactly when it equals it (verify.py), and a seeded request's
  text is plain seeded decoding's whatever the draft: drafter-invariant speculative decoding
  (Daliri, Musco & Suresh, 2024, arXiv:2408.07978). Drafts use the same noise at the same
  position, which makes them agree with the target as often as a shared-randomness coupling
  can: with probability at least (1 - TV(p, q)) / (1 + TV(p, q)) (same paper), against
  rejection sampling's 1 - TV(p, q).
  "Whatever the draft" assumes the full model's logits for a token are the same in a
  verification pass as in a plain step, bit for bit: the engine's exact passes
  (model/exactness.py). Where a machine's kernels do not allow them, the texts can differ
  only where two tokens' perturbed scores nearly tie.
Mode "auto" (the default) is gumbel for a seeded request and rejection for an unseeded one,
which has no text to repeat.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

SAMPLING_MODES = ("auto", "gumbel", "rejection")  # auto: gumbel for a seeded request, else rejection


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy (argmax); the default, as lossless checks need it
    top_p: float = 1.0  # nucleus mass kept; 1.0 keeps everything
    top_k: int = 0  # 0 keeps every token
    seed: int | None = None  # fixes the sampler's randomness, for reproducible samples
    # "gumbel", "rejection", or "auto": gumbel for a seeded request (its text then repeats
    # whatever the draft), rejection for an unseeded one (nothing to repeat; see `gumbel`)
    mode: str = "auto"

    def __post_init__(self) -> None:
        if self.mode not in SAMPLING_MODES:
            raise ValueError(f"sampling mode must be one of {', '.join(SAMPLING_MODES)}, got {self.mode!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def gumbel(self) -> bool:
        """Whether this request samples with per-position Gumbel noise (never when greedy)."""
        if self.greedy:
            return False
        return self.mode == "gumbel" or (self.mode == "auto" and self.seed is not None)

    def generator(self) -> torch.Generator:
        gen = torch.Generator()
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()  # a fresh nondeterministic seed, leaving torch's global generator alone
        return gen


def randomness(params: SamplingParams, vocab_size: int) -> torch.Generator | GumbelNoise | None:
    """What one request's sampling draws on: nothing (greedy), per-position Gumbel noise
    (gumbel mode) or a generator (rejection mode). Made once per request."""
    if params.greedy:
        return None
    if params.gumbel:
        seed = params.seed if params.seed is not None else torch.Generator().seed()
        return GumbelNoise(seed, vocab_size)
    return params.generator()


def pick(
    logits: torch.Tensor, params: SamplingParams, draws: torch.Generator | GumbelNoise | None, position: int
) -> int:
    """The token at absolute `position`, from the full model's logits [vocab] there (those
    of the token before it): greedy argmax, Gumbel-max with that position's noise, or a draw."""
    if params.greedy:
        return int(logits.argmax())
    if isinstance(draws, GumbelNoise):
        return gumbel_pick(logits, params, draws.at(position))
    assert draws is not None
    return sample(probabilities(logits, params), draws)


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 logits [..., vocab] -> processed probabilities [..., vocab] (sampling mode)."""
    logits = logits.float() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token id from probabilities [vocab]. Drawn on the CPU, where the request's
    generator lives, whatever device the model runs on: the same seed draws the same."""
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


# -- gumbel mode ------------------------------------------------------------------------------

# Noise rows a request keeps: a verification pass needs at most MAX_NODES positions past the
# pending token (tree.py), so positions are reused from draft to verification and
# across rounds; a row evicted early would only be generated again (it is a pure function).
KEEP_POSITIONS = 66  # MAX_NODES + 2


def position_seed(seed: int, position: int) -> int:
    """A 64-bit generator seed for (request seed, absolute position); blake2b so that nearby
    seeds and positions give unrelated streams."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def gumbel_noise(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [vocab] float32 for one position: -log(-log(u)), u uniform.

    u is drawn in float64: float32's 24 bits would cut off the noise's upper tail (largest
    value 16.6), which is what lets a token of probability ~1e-7 win. (u = 0, probability
    2^-53, gives -inf: that token is not picked.) 1.4 ms for a 152k vocabulary on one core of
    our Xeon, less than one torch.multinomial draw over it (4.6 ms), and made once per position."""
    gen = torch.Generator().manual_seed(position_seed(seed, position))
    u = torch.rand(vocab_size, dtype=torch.float64, generator=gen)
    return u.log_().neg_().log_().neg_().float()


class GumbelNoise:
    """One request's Gumbel noise, generated once per absolute position and kept for the
    draft and the verification that need it (the last KEEP_POSITIONS positions)."""

    def __init__(self, seed: int, vocab_size: int) -> None:
        self.seed = seed
        self.vocab_size = vocab_size
        self._rows: dict[int, torch.Tensor] = {}  # position -> noise [vocab]

    def at(self, position: int) -> torch.Tensor:
        """The noise [vocab] of the token at absolute `position`."""
        row = self._rows.get(position)
        if row is None:
            row = self._rows[position] = gumbel_noise(self.seed, position, self.vocab_size)
            if len(self._rows) > KEEP_POSITIONS:
                del self._rows[min(self._rows)]  # decoding only moves forward
        return row


def perturbed_logprobs(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """log of the processed probabilities (-inf where top-k / top-p left 0) plus Gumbel
    noise: [..., vocab]. Its argmax is an exact sample of `probabilities(logits, params)`."""
    return probabilities(logits, params).log_().add_(noise.to(logits.device))


def gumbel_pick(logits: torch.Tensor, params: SamplingParams, noise: torch.Tensor) -> int:
    """The Gumbel-max token of logits [vocab] under noise [vocab]."""
    return int(perturbed_logprobs(logits, params, noise).argmax())
