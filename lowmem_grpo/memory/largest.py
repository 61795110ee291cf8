"""Which preset architectures fit a card with a run's settings, and the largest that does.

`candidates(cfg, budget, host_budget)` plans the run `cfg` (a recipe with its overrides, or the defaults)
once per preset of presets.py, the model replaced by the preset's config, and returns one `Candidate`
per preset, smallest first (by parameter count): its peak (bytes, phase), the margin (plan.margin_bytes),
the total, and whether it fits `budget` bytes of device memory and `host_budget` bytes of host RAM.
A preset the settings cannot be planned for (a ConfigError) has `error` set and fits nothing.
`largest(candidates)` is the one with the most parameters that fits both, or None.
One process only (no torchrun ranks). Only the configs are read: no weights, no download.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterable, Optional

from ..config import Config, ConfigError
from .plan import GiB, Arch, margin_bytes, plan
from .presets import PRESETS, preset


@dataclass
class Candidate:
    """One preset's predicted need with the run's settings."""

    name: str
    params: int
    budget_bytes: int
    host_budget_bytes: int
    peak_bytes: int = 0
    peak_phase: str = ""
    margin_bytes: int = 0
    host_bytes: int = 0
    error: Optional[str] = None  # why the settings could not be planned for this preset

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.margin_bytes

    @property
    def fits_gpu(self) -> bool:
        return self.error is None and self.total_bytes <= self.budget_bytes

    @property
    def fits_host(self) -> bool:
        return self.error is None and self.host_bytes <= self.host_budget_bytes

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host

    def as_dict(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "spare_bytes": self.budget_bytes - self.total_bytes,
                "fits_gpu": self.fits_gpu, "fits_host": self.fits_host, "fits": self.fits}


def candidates(cfg: Config, budget: int, host_budget: int, names: Optional[Iterable[str]] = None,
               autocast: Optional[bool] = None) -> list[Candidate]:
    """Every preset (or those in `names`) planned with `cfg`, smallest first. `autocast` as for plan()."""
    names = list(PRESETS if names is None else names)
    if not names:
        raise ConfigError("no presets to compare: give at least one preset name")
    out = []
    for name in names:
        try:
            arch = Arch.from_config(preset(name))
        except KeyError as e:
            raise ConfigError(str(e.args[0])) from None
        c = Candidate(name, arch.params, budget, host_budget)
        try:
            result = plan(cfg, arch, autocast=autocast, card_bytes=budget)
        except ConfigError as e:
            c.error = str(e)
        else:
            c.error = (result.vllm or {}).get("problem")  # vLLM would not start in its share
            c.peak_bytes, c.peak_phase = result.peak_bytes, result.peak_phase
            c.margin_bytes, c.host_bytes = margin_bytes(result.peak_bytes), result.host_bytes
        out.append(c)
    return sorted(out, key=lambda c: c.params)


def largest(found: list[Candidate]) -> Optional[Candidate]:
    """The candidate with the most parameters that fits the card and the host, or None."""
    fitting = [c for c in found if c.fits]
    return max(fitting, key=lambda c: c.params) if fitting else None


def verdict(found: list[Candidate]) -> str:
    """One sentence: the largest that fits, or why none does and what to do."""
    best = largest(found)
    if best is not None:
        return (f"largest that fits: {best.name} ({best.params / 1e9:.2f} B parameters), "
                f"{best.total_bytes / GiB:.3f} GiB with the margin of {best.budget_bytes / GiB:.2f} GiB "
                f"({(best.budget_bytes - best.total_bytes) / GiB:.3f} GiB to spare)")
    planned = [c for c in found if c.error is None]
    if not planned:
        return "none of the presets fits: these settings could not be planned for any of them (see each error)"
    smallest = min(planned, key=lambda c: c.total_bytes)
    where = ("the card" if not smallest.fits_gpu else "host RAM")
    need = (f"{smallest.total_bytes / GiB:.3f} GiB with the margin, of {smallest.budget_bytes / GiB:.2f} GiB"
            if not smallest.fits_gpu else
            f"{smallest.host_bytes / GiB:.2f} GiB of host RAM, of {smallest.host_budget_bytes / GiB:.2f} GiB")
    return (f"none of the presets fits with these settings; the least demanding, {smallest.name}, needs {need} "
            f"({where}): `lowmem-grpo plan RECIPE --model {smallest.name}` lists the changes that would make it "
            "fit, or give a larger --gpu-memory / --host-memory")


def format_candidates(found: list[Candidate]) -> str:
    """A table, smallest first: parameters, peak (phase), with the margin, host RAM, fits."""
    lines = [f"{'preset':<16}{'params (B)':>11}{'peak GiB':>10}  {'phase':<20}{'+margin':>9}{'host GiB':>10}  fits"]
    for c in found:
        if c.error is not None:
            lines.append(f"{c.name:<16}{c.params / 1e9:>11.3f}  cannot be planned: {c.error}")
            continue
        mark = "yes" if c.fits else ("no (GPU)" if not c.fits_gpu else "no (host RAM)")
        if not c.fits_gpu and not c.fits_host:
            mark = "no (GPU, host RAM)"
        lines.append(f"{c.name:<16}{c.params / 1e9:>11.3f}{c.peak_bytes / GiB:>10.3f}  {c.peak_phase:<20}"
                     f"{c.total_bytes / GiB:>9.3f}{c.host_bytes / GiB:>10.2f}  {mark}")
    return "\n".join(lines)
