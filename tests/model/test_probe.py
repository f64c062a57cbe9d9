"""The hardware probe (model/probe.py) and the pass-cost table it fills (machine.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from spirit.machine import FormatCosts, PassCosts
from spirit.model import loader, probe
from spirit.model.probe import LayerShapes

TINY = LayerShapes(hidden=128, intermediate=256, q_out=128, kv_out=64, vocab=1000, num_layers=4)
ROWS = (1, 2, 4, 8, 16)


@pytest.fixture
def quick_probe(monkeypatch, tmp_path):
    """A probe that times little (the format is under test here, not the figures) and keeps
    its results under a temporary cache."""
    monkeypatch.setenv("SPIRIT_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "MIN_TIME_S", 0.0)
    monkeypatch.setattr(probe, "MIN_WORKING_SET", 2**20)
    monkeypatch.setattr(probe, "MAX_WORKING_SET", 2**21)
    monkeypatch.setattr(probe, "_KEPT", {})
    calls = []
    real = probe.measure
    monkeypatch.setattr(probe, "measure", lambda shapes: calls.append(shapes) or real(shapes))
    return calls


def test_probe_measures_every_format_at_every_pass_size(quick_probe):
    costs = probe.probe(TINY)
    assert costs.rows == ROWS and costs.num_layers == TINY.num_layers
    assert set(costs.formats) == {"float32", "bfloat16", "int8", "int4"}
    for fmt, f in costs.formats.items():
        assert len(f.attention_ms) == len(f.mlp_ms) == len(ROWS)
        assert all(ms > 0 for ms in f.attention_ms + f.mlp_ms)
        if fmt in ("int8", "int4"):
            # both activation dtypes were tried at one row; the slower is kept for the record
            assert {f.activation, *f.rejected} == {"bfloat16", "float32"}
        else:
            assert f.activation == fmt and not f.rejected
    # the head's cost is the MLP's scaled by bytes
    assert costs.head_to_mlp == pytest.approx(TINY.vocab * TINY.hidden / (3 * TINY.hidden * TINY.intermediate))
    assert costs.machine and costs.probe_time_s > 0
    table = costs.table()
    assert table.splitlines()[0].split()[:2] == ["format", "activations"]
    assert all(any(line.startswith(fmt) for line in table.splitlines()) for fmt in costs.formats)


def test_probe_is_kept_on_disk_and_read_back(quick_probe, tmp_path):
    first = probe.probe(TINY)
    files = list((tmp_path / "probe").glob("*.json"))
    assert len(files) == 1 and not list((tmp_path / "probe").glob("*.tmp"))
    probe._KEPT.clear()  # a new process: only the file is left
    assert probe.probe(TINY) == first
    assert len(quick_probe) == 1  # measured once
    # other shapes are another entry
    probe.probe(LayerShapes(128, 384, 128, 64, 1000, 4))
    assert len(quick_probe) == 2 and len(list((tmp_path / "probe").glob("*.json"))) == 2
    # the same shapes in a model with more layers reuse the per-layer figures
    deeper = probe.probe(LayerShapes(128, 256, 128, 64, 5000, 12))
    assert len(quick_probe) == 2 and deeper.num_layers == 12 and deeper.formats == first.formats


def test_a_damaged_probe_file_is_measured_again(quick_probe, tmp_path):
    probe.probe(TINY)
    (path,) = (tmp_path / "probe").glob("*.json")
    path.write_text('{"rows": [1, 2')
    probe._KEPT.clear()
    costs = probe.probe(TINY)
    assert len(quick_probe) == 2 and set(costs.formats) == {"float32", "bfloat16", "int8", "int4"}
    assert PassCosts.from_dict(json.loads(path.read_text())) == costs


def test_fresh_measures_again_and_replaces_what_was_kept(quick_probe):
    probe.probe(TINY)
    probe.probe(TINY, keep=False)
    assert len(quick_probe) == 2


def test_the_kernel_environment_is_part_of_the_machine(monkeypatch):
    native = probe.machine_key()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert probe.machine_key() != native
    assert "ATEN_CPU_CAPABILITY=avx2" in probe.machine_label()


def _costs(bf16, fp32=None, int4=None, layers=10) -> PassCosts:
    def fmt(series, act):
        return FormatCosts(act, tuple(x / 4 for x in series), tuple(3 * x / 4 for x in series))

    formats = {"bfloat16": fmt(bf16, "bfloat16")}
    if fp32:
        formats["float32"] = fmt(fp32, "float32")
    if int4:
        formats["int4"] = fmt(int4, "bfloat16")
    return PassCosts(ROWS, layers, 0.0, formats)


def test_costs_interpolate_between_measured_pass_sizes_and_past_them():
    costs = _costs((1, 2, 4, 8, 16))  # one layer's linears: 1 ms per row
    assert costs.layer_ms("bfloat16", 3) == pytest.approx(3.0)
    assert costs.layer_ms("bfloat16", 12) == pytest.approx(12.0)
    assert costs.layer_ms("bfloat16", 32) == pytest.approx(32.0)  # extended along the last segment
    assert costs.layer_ms("bfloat16", 0.5) == pytest.approx(1.0)
    assert costs.pass_ms("bfloat16", 2) == pytest.approx(20.0)  # 10 layers, no head
    # the policy's units: plain steps
    assert costs.verify(4) == pytest.approx(4.0)
    padded = costs.with_target("bfloat16", plain_rows=2)  # exact decoding pads 1-row steps to 2
    assert padded.verify(1) == pytest.approx(1.0) and padded.verify(8) == pytest.approx(4.0)


def test_draft_steps_cost_the_kept_layers_in_their_formats():
    costs = _costs((8, 8, 8, 8, 8), int4=(2, 2, 2, 2, 2))
    assert costs.draft_step(1.0, 1.0) == pytest.approx(1.0)  # nothing skipped, target format
    assert costs.draft_step(0.5, 0.5) == pytest.approx(0.5)
    # int4 MLPs (3/4 of the bytes) at a quarter of the cost; attention stays in bf16
    assert costs.draft_step(1.0, 1.0, bits=4) == pytest.approx(0.25 + 0.75 / 4)
    assert costs.draft_step(1.0, 1.0, bits=8) == pytest.approx(1.0)  # int8 not probed: the target's


def test_plain_dtype_is_the_faster_one_and_says_why():
    fp32_faster = _costs((10,) * 5, fp32=(8,) * 5)
    assert fp32_faster.plain_dtype()[0] == "float32"
    name, why = _costs((4,) * 5, fp32=(8,) * 5).plain_dtype()
    assert name == "bfloat16" and "float32 80.0 ms, bfloat16 40.0 ms" in why
    with pytest.raises(ValueError, match="did not measure int8"):
        fp32_faster.with_target("int8")


def test_costs_round_trip_through_json():
    costs = PassCosts(ROWS, 28, 1.9, {"int4": FormatCosts("bfloat16", (1, 2, 3, 4, 5), (5, 6, 7, 8, 9),
                                                          {"float32": 40.0})}, "a machine", 1.5, "int4", 2)
    assert PassCosts.from_dict(json.loads(json.dumps(costs.to_dict()))) == costs


def test_auto_dtype_follows_the_probe(monkeypatch):
    class Config:
        hidden_size, intermediate_size, num_attention_heads, num_hidden_layers, vocab_size = 64, 128, 4, 2, 100

    for fast, slow in (("float32", "bfloat16"), ("bfloat16", "float32")):
        measured = _costs((4,) * 5, fp32=(8,) * 5) if fast == "bfloat16" else _costs((8,) * 5, fp32=(4,) * 5)
        monkeypatch.setattr(probe, "probe", lambda shapes, keep=True: measured)
        dtype, why = loader.choose_dtype(Config())
        assert dtype == getattr(torch, fast) and "fastest plain step measured" in why


# -- both machine classes: the real probe under native and AVX2-held kernels -----------------

QWEN_1_5B = LayerShapes(hidden=1536, intermediate=8960, q_out=1536, kv_out=256, vocab=151936, num_layers=28)


def _probe_in_subprocess(env: dict[str, str], cache: Path) -> PassCosts:
    """The probe in a fresh process: the kernel variables act only before torch loads."""
    script = ("import json, sys; from spirit.model.probe import LayerShapes, probe; "
              f"print(json.dumps(probe(LayerShapes(**{QWEN_1_5B.__dict__!r})).to_dict()))")
    clean = {k: v for k, v in os.environ.items() if k not in probe.AVX2_HELD_ENV}
    out = subprocess.run([sys.executable, "-c", script], env={**clean, **env, "SPIRIT_CACHE": str(cache)},
                         capture_output=True, text=True, timeout=300, check=True)
    return PassCosts.from_dict(json.loads(out.stdout))


def _has_avx512_bf16() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and "avx512_bf16" in cpuinfo.read_text()


def test_probe_and_first_decisions_under_native_and_avx2_kernels(tmp_path):
    """On qwen2.5-1.5b's shapes: held back to AVX2 kernels, verifying several rows in bf16
    costs several steps, every draft is predicted slower than natively, and the policy's
    first decisions follow the prediction: plain decoding where no arm is predicted to pay
    (as measured in docs/benchmarks, 0.64-0.98x held to AVX2), speculation where one is
    (1.17-1.68x natively on an AVX-512 BF16 Xeon)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "policies"))
    from machines import DRAFT, VOCAB, landscape
    from sim import prompts_of, run

    from spirit.policies.base import ModelInfo, RequestInfo
    from spirit.policies.spirit import MARGIN, RATIO_GRID, SpiritPolicy

    def best_of(costs) -> float:
        """The best speedup a fresh policy predicts for any skip ratio on these costs."""
        fresh = SpiritPolicy(ModelInfo(costs.num_layers, costs=costs, vocab=VOCAB), DRAFT)
        fresh.start_request(RequestInfo(0, prompts_of(0, 1)[0], 64))
        return max(fresh.costs.predict(fresh._arm(fresh.pattern_for(r))) for r in RATIO_GRID)

    envs = {"native": {}, "avx2": probe.AVX2_HELD_ENV}
    runs = {name: _probe_in_subprocess(env, tmp_path) for name, env in envs.items()}
    best_predicted, first_speculative = {}, {}
    for name, costs in runs.items():
        costs = costs.with_target("bfloat16")
        best_predicted[name] = best_of(costs)
        policy = SpiritPolicy(ModelInfo(costs.num_layers, costs=costs, vocab=VOCAB), DRAFT)
        log = run(policy, landscape(costs, per_token=0.8), prompts_of(0, 1), tokens=64)
        first_speculative[name] = any(c.speculative for _, c, *_ in log.windows)
        # the first request's decisions follow the prediction
        assert first_speculative[name] == (best_predicted[name] >= 1 + MARGIN), (name, best_predicted[name])
    avx2 = runs["avx2"]
    # held to AVX2, 16 bf16 rows cost several single-row passes
    assert avx2.pass_ms("bfloat16", 16) > 3 * avx2.pass_ms("bfloat16", 1)
    if _has_avx512_bf16():
        native = runs["native"]
        # the variables really change the kernels: natively 16 rows cost far less than held to
        # AVX2 (about one row on the Xeon, 1.6 rows on an AVX-512 EPYC, over 3 held to AVX2).
        # Only the comparison is asserted: the native figure alone went to 2.2 on a loaded CI
        # machine, while the AVX2-held one stays well above it on the same machine.
        native_ratio = native.pass_ms("bfloat16", 16) / native.pass_ms("bfloat16", 1)
        avx2_ratio = avx2.pass_ms("bfloat16", 16) / avx2.pass_ms("bfloat16", 1)
        assert native_ratio < 0.8 * avx2_ratio, (native_ratio, avx2_ratio)
        if best_predicted["avx2"] >= 0.85 * best_predicted["native"]:
            # the machine is shared: probes taken under load are taken again, once, in a fresh
            # cache (a loaded CI run once predicted 1.95 held to AVX2 against 2.12 natively;
            # quiet, 1.27 against 2.14)
            best_predicted = {name: best_of(_probe_in_subprocess(env, tmp_path / "again").with_target("bfloat16"))
                              for name, env in envs.items()}
        assert best_predicted["avx2"] < 0.85 * best_predicted["native"], best_predicted
        assert first_speculative["native"]
