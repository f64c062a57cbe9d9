"""What the benchmark ran on, and how close plain decoding came to the speed-of-light bound."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import sys


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def peak_rss_bytes() -> int:
    """The process's high-water mark (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if platform.system() == "Darwin" else peak * 1024


def machine_line(m: dict) -> str:
    """The reports' one line about the machine, from a `machine_info` dict."""
    return (f"machine: {m.get('cpu')}, {m.get('cores')} usable cores, {m.get('torch_threads')} torch threads; "
            f"torch {m.get('torch')}, transformers {m.get('transformers')}, Python {m.get('python')}")


def kernel_lines(m: dict) -> list[str]:
    """The reports' lines on which kernels ran: torch's held back (and by what), spirit's
    int4/int8 kernel build, and llama.cpp's build, each where it applies."""
    lines = []
    if m.get("kernel_env"):
        lines.append(f"kernels held back by {' '.join(f'{k}={v}' for k, v in m['kernel_env'].items())}")
    if m.get("spirit_kernel"):
        lines.append(f"int4/int8 kernel: {m['spirit_kernel']}")
    if m.get("llamacpp"):
        lines.append(f"llama.cpp build: {m['llamacpp']}")
    return lines


def machine_info(lm, llamacpp_ran: bool = False) -> dict:
    import torch
    import transformers

    from spirit.model.probe import KERNEL_ENV

    return {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(lm.dtype).removeprefix("torch."),
        "dtype_reason": getattr(lm, "dtype_reason", None),
        # the variables that hold PyTorch's kernels back (e.g. to AVX2), if set
        "kernel_env": {n: os.environ[n] for n in KERNEL_ENV if os.environ.get(n)},
        # this machine's pass costs per weight format and rows (model/probe.py)
        "probe": lm.costs.to_dict() if getattr(lm, "costs", None) is not None else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "model": lm.name,
        "num_layers": lm.num_layers,
        "spirit_kernel": spirit_kernel(),
        "llamacpp": llamacpp_build() if llamacpp_ran else None,
    }


def llamacpp_build() -> str | None:
    """The instruction sets of the llama.cpp build the bench ran (its own system info line), or
    None where it did not run. Its build is fixed at compile time, not by the variables that
    hold torch's kernels back: an AVX2-class comparison needs an AVX2 build of it as well."""
    module = sys.modules.get("llama_cpp")
    if module is None:
        return None
    info = module.llama_print_system_info().decode(errors="replace").strip().rstrip("|").strip()
    return f"{info} ({os.path.dirname(module.__file__)})"


def spirit_kernel() -> str | None:
    """Which build of spirit's int4/int8 kernel ran, where the run loaded it (never builds it)."""
    from spirit.model import qgemm

    status = qgemm.loaded_status()
    return status.reason if status is not None else None


def vanilla_sol(lm, runs) -> dict | None:
    """Vanilla decoding as a share of the speed-of-light bound of `spirit.sol`.

    percent = 100 * bound seconds per token / measured decode seconds per token, at the mean
    context length of vanilla's turns. Optional: without spirit.sol (or if it fails) the
    reason is reported instead of a number.
    """
    turns = [t.stats for r in runs if r.method == "vanilla" for t in r.turns]
    decode_tokens = sum(max(0, s.new_tokens - 1) for s in turns)  # the prefill's token is not decoded
    decode_time = sum(s.wall_time_s - s.prefill_time_s for s in turns)
    if not turns or decode_tokens == 0 or decode_time <= 0:
        return None
    context = statistics.fmean(s.prompt_tokens + s.new_tokens / 2 for s in turns)
    measured = decode_time / decode_tokens
    try:
        from spirit.sol import decode_step_seconds

        weights = getattr(lm, "weights", None)  # a low-bit target's bound is its packed bytes
        bound = float(decode_step_seconds(lm.hf_model.config, lm.dtype, int(context), hardware="this-cpu", weights=weights))
    except Exception as exc:  # optional subsystem: absent, unfinished, or no data for this CPU
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}", "measured_s_per_token": measured}
    return {
        "available": True,
        "weights": weights,
        "context_tokens": round(context, 1),
        "sol_s_per_token": bound,
        "measured_s_per_token": measured,
        "percent_of_sol": 100.0 * bound / measured if measured > 0 else None,
    }
