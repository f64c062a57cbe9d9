"""The report's statements about losslessness: exactness claimed or not, hf labelled apart."""

from spirit.bench.metrics import Lossless
from spirit.bench.report import exactness_line, lossless_cell, lossless_section


def test_exactness_line_says_whether_bit_exactness_is_claimed():
    assert "not stated" in exactness_line(None)
    assert exactness_line({"exact": True, "reason": "ok"}) == "bit-exact verification: claimed on this machine (ok)"
    assert "NOT claimed on this machine (1-row linear differs)" in exactness_line(
        {"exact": False, "reason": "1-row linear differs"})


def test_hf_agreement_is_transformers_not_spirits():
    hf = Lossless("hf", questions=4, identical_questions=3, turns_compared=4, identical_turns=3)
    ours = Lossless("spirit", questions=4, identical_questions=4, turns_compared=4, identical_turns=4)
    assert lossless_cell("hf", hf) == "3/4 agree (transformers' generate, not spirit)"
    assert lossless_cell("spirit", ours) == "yes (4/4)" and lossless_cell("vanilla", None) == "reference"
    text = "\n".join(lossless_section({"spirit": ours, "hf": hf}, None))
    assert "| spirit | 4/4 | 4/4 | 100.0% | 0 |" in text and "| hf |" not in text
    assert "hf agreed with vanilla on 3/4 questions (75.0%)" in text and "not of spirit" in text


def test_reports_say_which_kernels_ran():
    from spirit.bench.machine import kernel_lines

    assert kernel_lines({"kernel_env": {}, "spirit_kernel": None, "llamacpp": None}) == []
    lines = kernel_lines({"kernel_env": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
                          "spirit_kernel": "spirit's kernel (avx2 integer dot products, row-invariant)",
                          "llamacpp": "CPU : AVX2 = 1 | FMA = 1 (/opt/llama-avx2/llama_cpp)"})
    assert lines == ["kernels held back by ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2",
                     "int4/int8 kernel: spirit's kernel (avx2 integer dot products, row-invariant)",
                     "llama.cpp build: CPU : AVX2 = 1 | FMA = 1 (/opt/llama-avx2/llama_cpp)"]
