"""Command-line options and helpers that every `spirit` subcommand shares (generate, bench,
serve): one definition of each option, and of how the options become a model and a request."""

from __future__ import annotations

import argparse

from spirit.model.bundled import DEFAULT_MODEL
from spirit.sampling import SAMPLING_MODES


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"bundled name, local folder, .gguf file or cached hub id (default {DEFAULT_MODEL})")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto (default): CUDA where torch sees a GPU, else the CPU. CUDA is untested so far")
    p.add_argument("--weights", default="auto", choices=("auto", "bf16", "int8", "int4"),
                   help="precision of the linear layers that decode: auto/bf16 keep the dtype's; int8/int4 pack "
                        "them (the output is then that low-bit model's)")
    p.add_argument("--dtype", default="auto", help="auto (the faster of bf16 and fp32 for a plain step, measured on this machine by the hardware probe: seconds once, then kept), bf16 or fp32")


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", default="spirit", help="spirit, fixed, lookup, sp2ec, swift, dv, static, vanilla or hf (default spirit)")
    p.add_argument("--skip", default=None, help="skip set for --method static, e.g. 'attn:4,9;mlp:4,9,12'")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-draft", type=int, default=25, help="most tokens drafted per round (SWIFT: 25)")
    p.add_argument("--threshold", type=float, default=None,
                   help="stop drafting below this top-1 probability (default: 0.5 for spirit, SWIFT's 0.8 otherwise)")
    p.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=None,
                   help="prompt-lookup drafts first (default: on for spirit, off for the baselines)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="draft scores only the N most frequent tokens; 0 = all (default: 32768 for spirit, 0 otherwise)")
    p.add_argument("--branches", type=int, default=None,
                   help="token-tree leaves per unsure draft position, 1 = chains (default: 2 for spirit, 1 otherwise)")
    p.add_argument("--draft-bits", type=int, default=None, choices=(0, 4, 8),
                   help="the draft's MLP weights at 4 or 8 bits, 0 = the model's own (default: 4 for spirit, 0 otherwise)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--sampling-mode", default="auto", choices=SAMPLING_MODES,
                   help="gumbel: a seeded request's text is plain seeded decoding's whatever the draft; "
                        "rejection: speculative sampling; auto (default): gumbel when --seed is given")
    p.add_argument("--profile-file", default=None, help="load and save the policy's learned state here")


def load_for_cli(args: argparse.Namespace):
    import spirit

    return spirit.load(args.model, dtype=args.dtype, device=args.device, weights=args.weights)


def generation_kwargs(args: argparse.Namespace) -> dict:
    return dict(
        max_new_tokens=args.max_new_tokens, method=args.method, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, sampling_mode=args.sampling_mode, skip=args.skip,
        draft=draft_config(args), profile_file=args.profile_file,
    )


def draft_config(args: argparse.Namespace):
    """The method's default drafting knobs with what the command line sets."""
    from dataclasses import replace

    from spirit.request import default_draft

    given = dict(ngram=args.ngram, draft_vocab=args.draft_vocab, branches=args.branches, threshold=args.threshold,
                 draft_bits=args.draft_bits)
    return replace(default_draft(args.method), max_draft=args.max_draft,
                   **{k: v for k, v in given.items() if v is not None})
