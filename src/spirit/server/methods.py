"""Which decoding methods a client may name (`--allow-methods`), and readying them before the
server answers any request.

Two things cost far more than the request that first asks for them, and stall every other
user behind it while they run on the one engine thread:

- an offline calibration: a policy whose class says `calibrated = False` (`dv`) decodes its
  calibration prompts once per candidate skip set before its first answer (13 runs of 32
  tokens with dv's defaults: some 400 tokens of decoding);
- a quantization build: a method whose default draft has `draft_bits` (`spirit`, `fixed`: 4)
  drafts with quantized MLPs, built on first use (17.5 s for int4 of a 1.5B model on 2 cores)
  or read from the disk cache.

So by default a server allows its own `--method` and the methods that need neither, or whose
quantized MLPs are the very ones its `--method` uses. Whatever the allowed methods need is
built when the app is made (`prepare`), before it answers anything, so no request ever starts
a build; an operator who allows `dv` pays its calibration once at start.
"""

from __future__ import annotations

from spirit.policies import REGISTRY
from spirit.request import default_draft
from spirit.skipset import SkipSet


def servable_methods() -> tuple[str, ...]:
    """Every registered policy ("hf", transformers' generate, cannot stream: never served)."""
    return tuple(REGISTRY.names())


def calibrates_offline(method: str) -> bool:
    return not getattr(REGISTRY.factories[method], "calibrated", True)


def draft_bits(method: str) -> int:
    """Width of the quantized draft MLPs the method's default draft uses (0: none). A request
    cannot change a method's draft knobs, so this is what serving it builds."""
    return default_draft(method).draft_bits


def default_allowed(method: str, skip: str | None) -> tuple[str, ...]:
    """The methods a client may name unless the operator says otherwise (see the module doc);
    `static` only with a skip set, which it cannot run without."""
    bits = draft_bits(method)

    def cheap(name: str) -> bool:
        if calibrates_offline(name) or draft_bits(name) not in (0, bits):
            return False
        return name != "static" or skip is not None

    return tuple(name for name in servable_methods() if name == method or cheap(name))


def parse_methods(text: str) -> tuple[str, ...]:
    """'vanilla, spirit' -> ("vanilla", "spirit"): blanks dropped, repeats once."""
    return tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))


def check_allowed(allowed: tuple[str, ...], method: str, skip: str | None) -> None:
    """Raise ValueError, worded for the command line, when the list cannot be served."""
    if not allowed:
        raise ValueError("--allow-methods is empty; name at least the server's --method")
    unknown = [m for m in allowed if m not in servable_methods()]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r} in --allow-methods; choose from {', '.join(servable_methods())}")
    if method not in allowed:
        raise ValueError(f"--method {method} is not in --allow-methods ({', '.join(allowed)}); "
                         "requests that name no method would all be refused")
    if "static" in allowed and not skip:
        raise ValueError("--allow-methods has static, which needs --skip, e.g. --skip 'attn:4,9;mlp:4,9,12'")


def prepare(lm, allowed: tuple[str, ...], skip: str | None) -> None:
    """Build what the allowed methods need (quantized draft MLPs, offline calibrations) now, so
    that no request starts a build. Calibrated policies are kept by `lm` under the same key a
    request's policy lookup uses (method, skip, the method's default draft)."""
    for method in allowed:
        draft = default_draft(method)
        lm.engine.quantized_mlps(draft.draft_bits)  # nothing for 0 bits or a packed low-bit target
        if calibrates_offline(method):
            lm.policy(method, SkipSet.parse(skip) if method == "static" and skip else None, draft)
