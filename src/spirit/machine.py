"""What a pass costs on this machine, per weight format and number of rows: plain Python.

Measured by the hardware probe (`model/probe.py`) on the model's own weight shapes, and read
by the loader (`--dtype auto` takes the faster plain step), the draft builder (each low-bit
kernel gets the activation dtype it is fast with) and the spirit policy (the cost side of its
speed prediction: costs are the machine's, acceptance is the task's).

Why measure rather than read a CPU flag: on an AVX-512 BF16 Xeon a bf16 pass over 16 rows
costs about one row's time, so verifying many drafted tokens is nearly free; on an AVX2-only
CPU 4 rows cost ~3-4x one row in bf16 and fp32, and speculation that pays on the first
machine loses on the second (docs/benchmarks/).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

FLOAT_FORMATS = ("float32", "bfloat16")
LOWBIT_FORMATS = ("int8", "int4")
DRAFT_BITS_FORMAT = {8: "int8", 4: "int4"}


def last_level_cache_bytes(default: int = 32 * 2**20) -> int:
    """Size of the largest CPU cache sysfs reports (the L3 on most x86 machines), or
    `default` where it reports none."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * unit)
    return best or default


@dataclass(frozen=True)
class FormatCosts:
    """One weight format: milliseconds of one decoder layer's linear layers per pass size."""

    activation: str  # the activation dtype the kernel was fed (the faster one, for low-bit)
    attention_ms: tuple[float, ...]  # q, k, v and o projections, per entry of PassCosts.rows
    mlp_ms: tuple[float, ...]  # gate, up and down projections
    # the activation dtypes not chosen, with a one-row MLP's milliseconds, for the record
    rejected: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PassCosts:
    """A model's full-pass linear-layer cost on this machine, by weight format and rows.

    `target` is the format plain decoding and verification run in, and `plain_rows` the
    rows of a plain step (exact decoding pads 1-row steps on some CPUs: model/exactness.py);
    the relative costs below are against that plain step.
    """

    rows: tuple[int, ...]
    num_layers: int
    head_to_mlp: float  # the lm_head's bytes over one layer's MLP bytes (its cost scales alike)
    formats: dict[str, FormatCosts]
    machine: str = ""
    probe_time_s: float = 0.0
    target: str = "bfloat16"
    plain_rows: int = 1

    # -- absolute -----------------------------------------------------------------------

    def _at(self, series: tuple[float, ...], rows: float) -> float:
        """Piecewise-linear in rows between the measured pass sizes, extended past the ends."""
        xs = self.rows
        if rows <= xs[0]:
            return series[0]
        for i in range(1, len(xs)):
            if rows <= xs[i] or i == len(xs) - 1:
                x0, x1, y0, y1 = xs[i - 1], xs[i], series[i - 1], series[i]
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        return series[-1]  # unreachable: the loop returns

    def layer_ms(self, fmt: str, rows: float) -> float:
        f = self.formats[fmt]
        return self._at(f.attention_ms, rows) + self._at(f.mlp_ms, rows)

    def pass_ms(self, fmt: str, rows: float) -> float:
        """Every layer's linears and the lm_head over `rows` rows, all in `fmt`."""
        f = self.formats[fmt]
        return self.num_layers * self.layer_ms(fmt, rows) + self.head_to_mlp * self._at(f.mlp_ms, rows)

    # -- choices --------------------------------------------------------------------------

    def plain_dtype(self) -> tuple[str, str]:
        """The faster float format for plain decoding (one row), and a line saying why."""
        available = [f for f in FLOAT_FORMATS if f in self.formats]
        best = min(available, key=lambda f: self.pass_ms(f, 1))
        times = ", ".join(f"{f} {self.pass_ms(f, 1):.1f} ms" for f in available)
        return best, f"fastest plain step measured on this machine ({times} per token of linear layers)"

    def activation(self, fmt: str) -> str:
        """The activation dtype `fmt`'s kernel is fast with here (bfloat16 if not probed)."""
        return self.formats[fmt].activation if fmt in self.formats else "bfloat16"

    def with_target(self, target: str, plain_rows: int = 1) -> "PassCosts":
        if target not in self.formats:
            raise ValueError(f"the probe did not measure {target}; it has {', '.join(self.formats)}")
        return replace(self, target=target, plain_rows=max(1, plain_rows))

    # -- relative to one plain step (the policy's units) ------------------------------------

    def plain_ms(self) -> float:
        return self.pass_ms(self.target, self.plain_rows)

    def verify(self, rows: float) -> float:
        """A full-model pass over `rows` rows, in plain steps."""
        return self.pass_ms(self.target, max(rows, self.plain_rows)) / self.plain_ms()

    def draft_step(self, attention_kept: float, mlp_kept: float, bits: int = 0, vocab_fraction: float = 1.0) -> float:
        """One draft pass, in plain steps: the kept fraction of layers' attention in the
        target format and MLPs at `bits` (0: the target's), and `vocab_fraction` of the head."""
        mlp_fmt = DRAFT_BITS_FORMAT.get(bits, self.target)
        if mlp_fmt not in self.formats:
            mlp_fmt = self.target
        target, draft = self.formats[self.target], self.formats[mlp_fmt]
        layers = self.num_layers
        ms = (layers * attention_kept * self._at(target.attention_ms, 1)
              + layers * mlp_kept * self._at(draft.mlp_ms, 1)
              + self.head_to_mlp * vocab_fraction * self._at(target.mlp_ms, 1))
        return ms / self.plain_ms()

    # -- reporting ---------------------------------------------------------------------------

    def table(self) -> str:
        """Milliseconds of a full pass's linear layers by format and rows, and each pass
        relative to one row of the same format."""
        head = f"{'format':<10}{'activations':<13}" + "".join(f"{f'{r} row' + ('s' if r > 1 else ''):>15}" for r in self.rows)
        lines = [head]
        for fmt, f in self.formats.items():
            one = self.pass_ms(fmt, self.rows[0])
            cells = "".join(f"{f'{self.pass_ms(fmt, r):.1f} ({self.pass_ms(fmt, r) / one:.1f}x)':>15}" for r in self.rows)
            lines.append(f"{fmt:<10}{f.activation:<13}{cells}")
            for act, ms in f.rejected.items():
                chosen = self._at(f.mlp_ms, 1)
                lines.append(f"{'':<10}{act:<13} one-row MLPs {ms * self.num_layers:.1f} ms "
                             f"({ms / chosen:.1f}x the {f.activation} figure: not used)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "PassCosts":
        formats = {
            k: FormatCosts(v["activation"], tuple(v["attention_ms"]), tuple(v["mlp_ms"]), dict(v.get("rejected", {})))
            for k, v in d["formats"].items()
        }
        return cls(tuple(d["rows"]), int(d["num_layers"]), float(d["head_to_mlp"]), formats,
                   d.get("machine", ""), float(d.get("probe_time_s", 0.0)), d.get("target", "bfloat16"),
                   int(d.get("plain_rows", 1)))
