"""Benchmark figures, aggregated from the engine's own `GenerationStats` (spirit.stats).

Conventions (per-request metrics are those of spirit.stats and are not redefined here):
- *tokens/s of a question* = its new tokens over its wall time, summed over its turns
  (prefill included); *tokens/s of a group* (a category, a block, a method overall) = the
  mean over its questions. This is Spec-Bench's `speed.py`.
- *speedup* = a group's tokens/s over vanilla's tokens/s on the same questions (`speedup`;
  `spirit bench` and benchmarks/ablation.py both use it).
- *acceptance rate* and *mean accepted* come from the group's summed `Counters`: accepted /
  drafted, and accepted drafts per draft round (bonus token NOT included).
- *decoding steps* of a turn = full-model passes that committed tokens: the prefill, each
  draft round's verification and each plain step. *committed per step* = new tokens /
  decoding steps, Spec-Bench's "#Mean accepted tokens" (bonus included; 1.0 for vanilla).
- *time split*: prefill, drafting, verifying (verify time = every full-model pass after the
  prefill, see spirit.stats), probing, and the rest of the wall time (policy, tokenizer).
- *peak RSS* of a group: the highest resident set size of the process sampled while its
  questions ran; one process holds one copy of the weights for all methods.
- *identical*: a method's greedy tokens equal vanilla's, token for token, on every turn of a
  question. Speculation is lossless, so for spirit's methods anything less is a bug; for
  `hf` (transformers' own generate) it measures transformers, not spirit, and for `llamacpp`
  / `llamacpp-lookup` llama.cpp on the GGUF file's own quantized weights (bench/llamacpp.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from spirit.bench.questions import Question
from spirit.stats import Counters, GenerationStats

BASELINE = "vanilla"
# methods that are another library's decoding, not spirit's: their agreement with vanilla is
# a property of that library, reported apart from spirit's lossless check
OTHER_ENGINES = {
    "hf": "transformers' generate",
    "llamacpp": "llama.cpp (llama-cpp-python)",
    "llamacpp-lookup": "llama.cpp prompt-lookup drafting",
}


@dataclass
class TurnResult:
    text: str
    token_ids: list[int]
    stats: GenerationStats
    finish_reason: str


@dataclass
class QuestionRun:
    """One method answering one question, all its turns."""

    method: str
    question: Question
    turns: list[TurnResult]
    slot: int = 0  # index of the question in the run's question sequence, same for every method
    order: int = 0  # position in the run's global sequence (interleaved across methods)
    block: int | None = None  # stream block index, in stream mode
    peak_rss_bytes: int = 0  # highest resident set size seen while this question ran

    @property
    def new_tokens(self) -> int:
        return sum(t.stats.new_tokens for t in self.turns)

    @property
    def wall_time_s(self) -> float:
        return sum(t.stats.wall_time_s for t in self.turns)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s else 0.0


def decoding_steps(stats: GenerationStats) -> int:
    """Full-model passes that committed tokens: prefill + draft rounds + plain steps.

    A draft round commits its accepted drafts plus one token, a plain step one token, the
    prefill one token; the plain steps are what remains (a round cut short at the request's
    last token can make this an estimate by at most one step)."""
    if stats.new_tokens == 0:
        return 0
    c = stats.counters
    plain = max(0, stats.new_tokens - 1 - c.accepted - c.draft_rounds)
    return 1 + c.draft_rounds + plain


@dataclass
class Figures:
    """Aggregated figures of one group of question runs (see the module docstring)."""

    questions: int = 0
    turns: int = 0
    new_tokens: int = 0
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0  # summed new tokens / summed (wall - prefill) time
    decoding_steps: int = 0
    counters: Counters = field(default_factory=Counters)
    peak_rss_bytes: int = 0
    speedup: float | None = None  # filled in against the baseline

    @property
    def committed_per_step(self) -> float:
        return self.new_tokens / self.decoding_steps if self.decoding_steps else 0.0

    def time_split(self) -> dict[str, float]:
        """Share of the wall time spent in each phase."""
        c = self.counters
        parts = {
            "prefill": self.prefill_time_s,
            "draft": c.draft_time_s,
            "verify": c.verify_time_s,
            "probe": c.probe_time_s,
        }
        parts["other"] = max(0.0, self.wall_time_s - sum(parts.values()))
        total = self.wall_time_s or 1.0
        return {k: v / total for k, v in parts.items()}

    def to_dict(self) -> dict:
        return {
            "questions": self.questions,
            "turns": self.turns,
            "new_tokens": self.new_tokens,
            "wall_time_s": round(self.wall_time_s, 6),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 3),
            "speedup": None if self.speedup is None else round(self.speedup, 4),
            **self.counters.to_dict(),
            "decoding_steps": self.decoding_steps,
            "committed_per_step": round(self.committed_per_step, 4),
            "prefill_time_s": round(self.prefill_time_s, 6),
            "time_split": {k: round(v, 4) for k, v in self.time_split().items()},
            "peak_rss_mb": round(self.peak_rss_bytes / 2**20, 1),
        }


def aggregate(runs: list[QuestionRun]) -> Figures:
    f = Figures()
    for run in runs:
        f.questions += 1
        f.peak_rss_bytes = max(f.peak_rss_bytes, run.peak_rss_bytes)
        for turn in run.turns:
            s = turn.stats
            f.turns += 1
            f.new_tokens += s.new_tokens
            f.wall_time_s += s.wall_time_s
            f.prefill_time_s += s.prefill_time_s
            f.decoding_steps += decoding_steps(s)
            f.counters.add(s.counters)
    f.tokens_per_s = statistics.fmean(r.tokens_per_s for r in runs) if runs else 0.0
    decode_time = f.wall_time_s - f.prefill_time_s
    f.decode_tokens_per_s = f.new_tokens / decode_time if decode_time > 0 else 0.0
    return f


OVERALL = "overall"


def summarize(runs: list[QuestionRun], key=lambda run: run.question.category, baseline: str = BASELINE) -> dict[str, dict[str, Figures]]:
    """Figures per method and group (`key`, the category by default), plus each method's
    "overall"; speedups against `baseline` on the same group."""
    methods = list(dict.fromkeys(r.method for r in runs))
    groups = list(dict.fromkeys(key(r) for r in runs))
    table: dict[str, dict[str, Figures]] = {}
    for method in methods:
        mine = [r for r in runs if r.method == method]
        row = {g: aggregate([r for r in mine if key(r) == g]) for g in groups if any(key(r) == g for r in mine)}
        row[OVERALL] = aggregate(mine)
        table[method] = row
    if baseline in table:
        for method, row in table.items():
            for group, fig in row.items():
                base = table[baseline].get(group)
                if base is not None:
                    fig.speedup = speedup(fig, base)
    return table


def speedup(group: Figures, baseline: Figures) -> float | None:
    """The one definition of speedup: a group's tokens/s (the mean over its questions of new
    tokens / wall time) over the baseline's on the same questions; None without a baseline speed."""
    return group.tokens_per_s / baseline.tokens_per_s if baseline.tokens_per_s > 0 else None


def first_in_category(runs: list[QuestionRun], baseline: str = BASELINE) -> dict[str, dict[str, float]]:
    """Per method, its speedup on the first question of each category that it answered (a
    task new to its policy), against the baseline on the same question."""
    base = {r.slot: r for r in runs if r.method == baseline}
    out: dict[str, dict[str, float]] = {}
    for method in dict.fromkeys(r.method for r in runs):
        if method == baseline:
            continue
        firsts: dict[str, QuestionRun] = {}
        for run in sorted((r for r in runs if r.method == method), key=lambda r: r.order):
            firsts.setdefault(run.question.category, run)
        out[method] = {
            category: run.tokens_per_s / base[run.slot].tokens_per_s
            for category, run in firsts.items()
            if run.slot in base and base[run.slot].tokens_per_s > 0
        }
    return out


# -- losslessness ------------------------------------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """Where a method's greedy tokens first differ from the baseline's."""

    method: str
    question_id: int | str
    category: str
    turn: int  # 0-based
    position: int  # index of the first differing new token
    baseline_token: int | None  # None: the baseline's answer ended here
    method_token: int | None  # None: the method's answer ended here
    baseline_context: str = ""  # decoded text around the divergence
    method_context: str = ""
    baseline_piece: str = ""  # the differing token, decoded
    method_piece: str = ""

    def to_dict(self) -> dict:
        return dict(vars(self))


def first_divergence(reference: list[int], candidate: list[int]) -> tuple[int, int | None, int | None] | None:
    """(position, reference token, candidate token) of the first difference, or None if the
    sequences are identical; a missing token (one sequence is a prefix) is None."""
    for i, (a, b) in enumerate(zip(reference, candidate)):
        if a != b:
            return i, a, b
    if len(reference) != len(candidate):
        i = min(len(reference), len(candidate))
        return i, reference[i] if i < len(reference) else None, candidate[i] if i < len(candidate) else None
    return None


@dataclass
class Lossless:
    """Token-by-token agreement of one method with the baseline over the same questions."""

    method: str
    questions: int = 0
    identical_questions: int = 0
    turns_compared: int = 0
    identical_turns: int = 0
    tokens_compared: int = 0  # baseline tokens checked (up to and including a divergence)
    divergences: list[Divergence] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """Share of questions whose every turn matches the baseline exactly."""
        return self.identical_questions / self.questions if self.questions else 0.0

    @property
    def lossless(self) -> bool:
        return self.questions > 0 and self.identical_questions == self.questions

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "lossless": self.lossless,
            "rate": round(self.rate, 4),
            "questions": self.questions,
            "identical_questions": self.identical_questions,
            "turns_compared": self.turns_compared,
            "identical_turns": self.identical_turns,
            "divergences": [d.to_dict() for d in self.divergences],
        }


def compare_lossless(
    runs: list[QuestionRun], decode=None, baseline: str = BASELINE, context_tokens: int = 12
) -> dict[str, Lossless]:
    """Compare every method's tokens with the baseline's, question by question.

    Turns are compared in order; once a turn diverges the later turns had different prompts
    (each method continues its own conversation, as Spec-Bench does) and are not compared.
    `decode(ids) -> str` renders the text around a divergence.
    """
    decode = decode or (lambda ids: " ".join(map(str, ids)))
    reference = {r.slot: r for r in runs if r.method == baseline}
    results: dict[str, Lossless] = {}
    for run in runs:
        if run.method == baseline:
            continue
        base = reference.get(run.slot)
        if base is None:
            continue
        result = results.setdefault(run.method, Lossless(run.method))
        result.questions += 1
        same = True
        for t, (b, m) in enumerate(zip(base.turns, run.turns)):
            result.turns_compared += 1
            found = first_divergence(b.token_ids, m.token_ids)
            if found is None:
                result.identical_turns += 1
                result.tokens_compared += len(b.token_ids)
                continue
            pos, bt, mt = found
            result.tokens_compared += pos + 1
            lo = max(0, pos - context_tokens)
            result.divergences.append(
                Divergence(
                    run.method, run.question.question_id, run.question.category, t, pos, bt, mt,
                    decode(b.token_ids[lo : pos + context_tokens]), decode(m.token_ids[lo : pos + context_tokens]),
                    decode([bt]) if bt is not None else "<end>", decode([mt]) if mt is not None else "<end>",
                )
            )
            same = False
            break
        if same and len(base.turns) == len(run.turns):
            result.identical_questions += 1
    return results

