"""`spirit sol`: calibrate, model, module, measure."""

from __future__ import annotations

import argparse
import json

import torch


def register(subparsers) -> None:
    p = subparsers.add_parser("sol", help="speed-of-light bounds for models, modules and this machine")
    sub = p.add_subparsers(dest="sol_command", required=True)

    c = sub.add_parser("calibrate", help="measure this machine: bandwidth and matmul peak per dtype")
    c.add_argument("--quick", action="store_true", help="smaller buffers and fewer repeats (a few seconds)")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_calibrate)

    m = sub.add_parser("model", help="per-token SOL of decoding a model (from its config; no weights read)")
    m.add_argument("name", help="bundled name, HF folder, or config.json")
    _hardware_arg(m)
    m.add_argument("--context", type=int, default=512, help="cached positions before the step (default 512)")
    m.add_argument("--dtype", default="auto", help="auto (bf16 on GPUs; this CPU's default), bf16, fp16 or fp32")
    m.add_argument("--skip", default=None, help="draft skip set, e.g. 'attn:1,2;mlp:3'")
    m.add_argument("--weights", default=None, choices=("bf16", "int8", "int4"),
                   help="the linear layers' format (default: --dtype); int8/int4: the bound of a low-bit target's packed bytes")
    m.add_argument("--acceptance", type=float, default=None, help="per-token acceptance rate for the speedup bound")
    m.add_argument("--draft-len", type=int, default=4, help="drafted tokens per round for the speedup bound")
    m.add_argument("--trace", action="store_true", help="also trace one decode step (meta device) and cross-check")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_model)

    pr = sub.add_parser("probe", help="this machine's cost of a pass over 1..16 rows per weight format, for a model's shapes")
    pr.add_argument("name", help="bundled name, HF folder, or config.json")
    pr.add_argument("--fresh", action="store_true", help="measure again instead of reading the kept result")
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=cmd_probe)

    for name, func, text in (("module", cmd_module, "bound a KernelBench-style file: Model, get_inputs(), get_init_inputs()"),
                             ("measure", cmd_measure, "bound a KernelBench-style file and run it: measured time, %% of SOL, SOL score")):
        k = sub.add_parser(name, help=text)
        k.add_argument("file", nargs="?" if name == "measure" else None,
                       help="path/to/file.py or path/to/file.py:ClassName (default Model)")
        _hardware_arg(k)
        k.add_argument("--ops", type=int, default=0, help="list the N most expensive ops")
        k.add_argument("--json", action="store_true")
        if name == "measure":
            k.add_argument("--candidate", default=None, help="file.py:ModelNew to score against the file's Model")
            k.add_argument("--baseline-ms", type=float, default=None, help="baseline time for the SOL score (default: measured Model)")
            k.add_argument("--repeats", type=int, default=10)
            k.add_argument("--model", default=None, help="instead of a file: time decode steps of this model (weights loaded)")
            k.add_argument("--context", type=int, default=512, help="with --model: cached positions (default 512)")
            k.add_argument("--dtype", default="auto", help="with --model: auto, bf16 or fp32")
            k.add_argument("--skip", default=None, help="with --model: time the draft with this skip set")
        k.set_defaults(func=func)


def _hardware_arg(p: argparse.ArgumentParser) -> None:
    from spirit.sol.hardware import available

    p.add_argument("--hardware", default="this-cpu", help=f"{', '.join(available())} or a spec .json (default this-cpu)")


def _hardware(name: str):
    from spirit.sol.hardware import THIS_CPU, load_hardware, this_cpu_path

    if name == THIS_CPU and not this_cpu_path().exists():
        print("spirit: this CPU is not calibrated; running a quick calibration (`spirit sol calibrate` for a full one)")
    return load_hardware(name, calibrate_if_missing=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def cmd_calibrate(args: argparse.Namespace) -> int:
    from spirit.sol.hardware import calibrate, save_hardware

    spec = calibrate(quick=args.quick)
    path = save_hardware(spec)
    if args.json:
        print(spec.to_json())
        return 0
    print(spec.summary())
    for key, value in spec.measured.items():
        print(f"  {key:26s} {value:10.3f}")
    print(f"saved to {path}")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from spirit.model.loader import choose_dtype, parse_dtype
    from spirit.skipset import SkipSet
    from spirit.sol import decode_cost, load_config, speculative_speedup, trace_decode_step

    if args.context < 0:
        raise ValueError(f"--context must be >= 0, got {args.context}")
    hw = _hardware(args.hardware)
    config = load_config(args.name)
    dtype = parse_dtype(args.dtype)
    if dtype is None:  # auto: bf16 on other hardware, this CPU's measured choice here
        dtype = torch.bfloat16 if args.hardware != "this-cpu" else choose_dtype(config)[0]
    skip = SkipSet.parse(args.skip) if args.skip else None
    if args.weights == "bf16":
        dtype = torch.bfloat16
    weights = args.weights if args.weights in ("int8", "int4") else None
    plain = decode_cost(config, dtype, args.context, weights=weights)
    rows = {"plain": plain}
    if skip is not None:
        rows["draft"] = decode_cost(config, dtype, args.context, skip, weights=weights)
    out: dict = {"model": args.name, "hardware": hw.name, "dtype": str(dtype).removeprefix("torch."),
                 "weights": weights or str(dtype).removeprefix("torch."), "context": args.context}
    for label, cost in rows.items():
        sec = cost.seconds(hw)
        out[label] = {"sol_s": sec, "tokens_per_s": 1 / sec, "bytes": cost.bytes, "weight_bytes": cost.weight_bytes,
                      "kv_bytes": cost.kv_read_bytes + cost.kv_write_bytes, "matrix_flops": cost.matrix_flops,
                      "compute_s": cost.compute_seconds(hw), "memory_s": cost.bytes / hw.memory_bandwidth}
    if skip is not None and args.acceptance is not None:
        spec = speculative_speedup(config, dtype, args.context, skip, args.acceptance, args.draft_len, hw, weights)
        out["speculation"] = {"acceptance": args.acceptance, "draft_len": args.draft_len, "verify_s": spec.verify_s,
                              "expected_tokens": spec.expected_tokens, "speedup_bound": spec.speedup}
    if args.trace:
        graph = trace_decode_step(config, args.context, skip, dtype=dtype)
        closed = rows["draft" if skip is not None else "plain"]
        out["trace"] = {"method": graph.method, "io_bytes": graph.io_bytes(), "matrix_flops": graph.matrix_flops,
                        "bytes_vs_closed_form": graph.io_bytes() / closed.bytes - 1,
                        "flops_vs_closed_form": graph.matrix_flops / closed.matrix_flops - 1,
                        "unknown_ops": dict(graph.unknown)}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.name} on {hw.name}, {out['weights']} weights, {out['dtype']} activations, context {args.context}")
    for label in rows:
        r = out[label]
        print(f"  {label:6s} SOL {_ms(r['sol_s'])}/token = {r['tokens_per_s']:.1f} tok/s  "
              f"({r['bytes'] / 1e6:.1f} MB: weights {r['weight_bytes'] / 1e6:.1f}, KV {r['kv_bytes'] / 1e6:.2f}; "
              f"{r['matrix_flops'] / 1e9:.2f} GFLOP; compute {_ms(r['compute_s'])}, memory {_ms(r['memory_s'])})")
    if "speculation" in out:
        s = out["speculation"]
        print(f"  speculation: acceptance {s['acceptance']}, draft {s['draft_len']}: {s['expected_tokens']:.2f} tokens/round, "
              f"verify {_ms(s['verify_s'])}, speedup <= {s['speedup_bound']:.2f}x")
    if "trace" in out:
        t = out["trace"]
        print(f"  traced step ({t['method']}): bytes {t['bytes_vs_closed_form']:+.2%}, matrix FLOPs "
              f"{t['flops_vs_closed_form']:+.2%} vs closed form; unknown ops {t['unknown_ops'] or 'none'}")
    return 0


def _bound_problem(args: argparse.Namespace):
    from spirit.sol import bounds, capture, graph_cost
    from spirit.sol.measure import load_problem

    hw = _hardware(args.hardware)
    problem = load_problem(args.file)
    model, inputs = problem.build()
    cost = graph_cost(capture(model, inputs))
    return hw, problem, model, inputs, cost, bounds(cost, hw)


def _report(args, hw, cost, b, extra: dict) -> int:
    out = {"file": args.file, "hardware": hw.name, "capture": cost.method, "sol_s": b.sol, "fused_s": b.fused,
           "cache_aware_s": b.cache_aware, "unfused_s": b.unfused, "limiter": b.limiter,
           "matrix_flops": b.matrix_flops, "vector_flops": b.vector_flops, "io_bytes": b.io_bytes,
           "op_bytes": b.op_bytes, "coverage": cost.coverage(), "unknown_ops": dict(cost.unknown), **extra}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.file} on {hw.name} (captured by {cost.method})")
    print(f"  SOL (fused) {_ms(b.fused)} [{b.limiter}-bound]; cache-aware {_ms(b.cache_aware)}; unfused {_ms(b.unfused)}")
    print(f"  {b.matrix_flops / 1e9:.4g} GFLOP matrix, {b.vector_flops / 1e9:.4g} GFLOP vector; "
          f"{b.io_bytes / 1e6:.4g} MB in/out, {b.op_bytes / 1e6:.4g} MB over all ops")
    print(f"  coverage {cost.coverage():.0%}" + (f"; unknown ops: {dict(cost.unknown)}" if cost.unknown else ""))
    if args.ops:
        from spirit.sol.bounds import compute_seconds

        ranked = sorted((o for o in cost.ops if o.kind not in ("view", "free")),
                        key=lambda o: -max(compute_seconds(o, hw), o.bytes / hw.memory_bandwidth))
        for o in ranked[: args.ops]:
            print(f"    {o.node:24s} {o.op:32s} {o.kind:10s} {(o.matrix_flops + o.vector_flops) / 1e6:10.3f} MFLOP {o.bytes / 1e6:10.3f} MB")
    for key, value in extra.items():
        print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from spirit.model.probe import LayerShapes, probe
    from spirit.sol import load_config

    costs = probe(LayerShapes.from_config(load_config(args.name)), keep=not args.fresh)
    if args.json:
        print(json.dumps(costs.to_dict(), indent=2))
        return 0
    best, why = costs.plain_dtype()
    print(f"{args.name} on {costs.machine} (probed in {costs.probe_time_s:.1f} s)")
    print(f"linear layers of a full pass ({costs.num_layers} layers and the lm_head), ms (x one row):")
    print(costs.table())
    print(f"--dtype auto: {best}: {why}")
    return 0


def cmd_module(args: argparse.Namespace) -> int:
    hw, _, _, _, cost, b = _bound_problem(args)
    return _report(args, hw, cost, b, {})


def cmd_measure(args: argparse.Namespace) -> int:
    from spirit.sol.hardware import THIS_CPU
    from spirit.sol.measure import load_problem, percent_of_sol, sol_score, time_call

    if args.hardware != THIS_CPU:
        raise ValueError(f"measure runs the module here; use --hardware {THIS_CPU} (or `sol module` for {args.hardware})")
    if args.model:
        return _measure_model(args)
    if not args.file:
        raise ValueError("sol measure needs a file.py[:Model] or --model NAME")
    hw, problem, model, inputs, cost, b = _bound_problem(args)
    measured = time_call(lambda: model(*inputs), repeats=args.repeats)
    extra = {"measured_s": measured, "percent_of_sol": percent_of_sol(measured, b.sol),
             "percent_of_cache_aware": percent_of_sol(measured, b.cache_aware)}
    baseline = args.baseline_ms / 1e3 if args.baseline_ms is not None else measured
    candidate = measured
    if args.candidate:
        cand = load_problem(args.candidate)
        cand_model = cand.model_cls(*(problem.get_init_inputs() if problem.get_init_inputs else [])).eval()
        candidate = time_call(lambda: cand_model(*inputs), repeats=args.repeats)
        extra["candidate_s"] = candidate
        extra["candidate_percent_of_sol"] = percent_of_sol(candidate, b.sol)
    if baseline > b.sol:
        extra["sol_score"] = sol_score(candidate, baseline, b.sol)
    extra["below_bound"] = measured < b.sol
    return _report(args, hw, cost, b, extra)


def _measure_model(args: argparse.Namespace) -> int:
    from spirit.model.loader import load
    from spirit.skipset import SkipSet
    from spirit.sol import decode_cost
    from spirit.sol.measure import measure_decode_step, percent_of_sol

    hw = _hardware(args.hardware)
    loaded = load(args.model, args.dtype, "cpu")  # the speed-of-light analyzer measures this CPU
    skip = SkipSet.parse(args.skip) if args.skip else None
    sol = decode_cost(loaded.hf_model.config, loaded.dtype, args.context, skip).seconds(hw)
    measured = measure_decode_step(loaded.hf_model, args.context, skip, steps=args.repeats)
    out = {"model": loaded.name, "hardware": hw.name, "dtype": str(loaded.dtype).removeprefix("torch."),
           "context": args.context, "skip": str(skip) if skip else None, "sol_s": sol, "measured_s": measured,
           "percent_of_sol": percent_of_sol(measured, sol), "below_bound": measured < sol}
    if args.baseline_ms is not None and args.baseline_ms / 1e3 > sol:
        from spirit.sol.measure import sol_score

        out["sol_score"] = sol_score(measured, args.baseline_ms / 1e3, sol)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    what = f"draft {skip}" if skip else "plain decode"
    print(f"{loaded.name} {what} on {hw.name}, {out['dtype']}, context {args.context}: measured {_ms(measured)}/token, "
          f"SOL {_ms(sol)} -> {out['percent_of_sol']:.1f}% of SOL" + (f", SOL score {out['sol_score']:.3f}" if "sol_score" in out else ""))
    return 0
