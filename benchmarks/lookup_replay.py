"""Replay prompt-lookup strategies on plain decoding's greedy outputs, without the model.

    python benchmarks/lookup_replay.py --model qwen2.5-coder-1.5b \
        --answers results/run1/answers/vanilla.jsonl

Greedy speculative decoding accepts a drafted token exactly when it is the token plain
decoding produced, so the rounds a lookup strategy takes on a recorded answer are known
without running the model: accepted = the longest drafted path that agrees with the answer.
Each round costs one verification pass over 1 + (tree size) tokens; with the measured cost of
a q-token pass relative to a one-token one (--costs), the replay gives the speedup over plain
decoding in pass-equivalents (prefill excluded). It is how proposers/prompt_lookup.py's DRAFT_LENGTH
was chosen; it replays spirit's own NgramIndex, not a copy of it.

The answer file is Spec-Bench's answer format (what `spirit bench --out` writes); answers are
re-tokenized from their text, which can differ from the generated ids in rare places.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from spirit.proposers.prompt_lookup import DRAFT_LENGTH, NgramIndex
from spirit.tree import DraftTree

# q-token pass / one-token pass, q = 1..16: qwen2.5-coder-1.5b, bf16, 2 threads, context 300
MEASURED_COSTS = (1.0, 0.95, 1.03, 1.07, 1.15, 1.24, 1.22, 1.20, 1.28, 1.32, 1.36, 1.40, 1.42, 1.44, 1.45, 1.46)

STRATEGIES = {  # name: (shortest match, draft length by match length or None: max tokens)
    "8 tokens after a match of 2+ (the earlier default)": (2, None, 8),
    "4 tokens after a match of 2+": (2, None, 4),
    "by match length, 2+ only": (2, DRAFT_LENGTH, 10),
    "by match length, 1+ (the default)": (1, DRAFT_LENGTH, 10),
    "1 token after a 1-token match, else 8": (1, {1: 1}, 8),
}


def load_turns(model: str, questions: Path, answers: Path) -> list[tuple[str, list[int], list[int]]]:
    """(category, prompt ids, answer ids) for every turn, the conversation rebuilt as the
    bench asked it (chat template, earlier answers as assistant turns)."""
    from transformers import AutoTokenizer

    from spirit.bench.questions import load_questions
    from spirit.model.loader import resolve

    tokenizer = AutoTokenizer.from_pretrained(str(resolve(model)[1]), local_files_only=True)
    by_id = {q.question_id: q for q in load_questions(questions)}
    turns = []
    for line in answers.read_text().splitlines():
        record = json.loads(line)
        question = by_id[record["question_id"]]
        messages: list[dict] = []
        for text, answer in zip(question.turns, record["choices"][0]["turns"]):
            messages.append({"role": "user", "content": text})
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            turns.append((question.category, tokenizer.encode(prompt, add_special_tokens=False),
                          tokenizer.encode(answer, add_special_tokens=False)))
            messages.append({"role": "assistant", "content": answer})
    return turns


def replay(turns, shortest: int, lengths: dict | None, max_tokens: int, branches: int, costs) -> dict[str, tuple[int, float]]:
    """category -> (tokens produced, passes paid in one-token-pass units)."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for category, prompt, answer in turns:
        if len(answer) < 2:
            continue
        index = NgramIndex(lengths=lengths)
        ids = prompt + answer[:1]  # the prefill's token
        produced, paid = 0, 0.0
        while (done := len(ids) - len(prompt)) < len(answer):
            truth = answer[done:]
            if len(truth) == 1:  # as in the engine: the last token has nothing to draft for
                tree = DraftTree(ids[-1])
            else:
                tree = index.propose(ids, min(max_tokens, len(truth) - 1), branches, shortest=shortest)
            path = accepted_path(tree, truth)
            step = truth[: len(path) + 1]
            paid += costs[min(tree.size, len(costs)) - 1]
            produced += len(step)
            ids += step
        totals[category][0] += produced
        totals[category][1] += paid
    return {c: (int(t), p) for c, (t, p) in totals.items()}


def accepted_path(tree, truth: list[int]) -> list[int]:
    """The drafted tokens greedy verification accepts: walk the tree along the answer."""
    node, path = 0, []
    for token in truth:
        nxt = tree.child(node, token)
        if nxt is None:
            break
        node = nxt
        path.append(token)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="for its tokenizer and chat template")
    parser.add_argument("--questions", type=Path, default=Path(__file__).resolve().parents[2] / "shared/data/specbench/dev.jsonl")
    parser.add_argument("--answers", type=Path, required=True, help="plain decoding's answers (Spec-Bench answer JSONL)")
    parser.add_argument("--branches", type=int, default=1)
    parser.add_argument("--costs", type=lambda s: tuple(float(x) for x in s.split(",")), default=MEASURED_COSTS,
                        help="cost of a q-token pass / a one-token pass, q = 1, 2, ...")
    args = parser.parse_args(argv)
    for path in (args.questions, args.answers):
        if not path.exists():
            print(f"error: {path} does not exist", file=sys.stderr)
            return 2
    turns = load_turns(args.model, args.questions, args.answers)
    categories = list(dict.fromkeys(c for c, _, _ in turns))
    print(f"{len(turns)} turns; speedup over plain decoding in one-token-pass units (prefill excluded)")
    print("| strategy | overall | " + " | ".join(categories) + " |")
    print("|---|---|" + "---|" * len(categories))
    for name, (shortest, lengths, max_tokens) in STRATEGIES.items():
        totals = replay(turns, shortest, lengths, max_tokens, args.branches, args.costs)
        overall = sum(t for t, _ in totals.values()) / sum(p for _, p in totals.values())
        cells = " | ".join(f"{totals[c][0] / totals[c][1]:.2f}x" if c in totals else "-" for c in categories)
        print(f"| {name} | {overall:.2f}x | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
