"""GPUs people train on: the figures a step-time estimate needs, each with where it comes from.

`card(name)` finds one by a loose name ("4060 Ti", "rtx4090", "H100"); an unknown name raises a
ConfigError that lists the table. `bf16_tflops` is the dense tensor-core rate for bf16 inputs with
fp32 accumulation (what training's matmuls use; GeForce cards run it at half their fp16-accumulate rate),
`memory_gbps` the memory bandwidth in GB/s (10^9 bytes), `memory_gib` the card's memory as sold, and the
PCIe link the card's own (its generation and lanes: a gen-4 x8 card stays x8 in a gen-5 slot).

Design notes: docs/planner.md ("Step time on a named card")
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..config import ConfigError

# GB/s per lane and direction after line coding (8b/10b for gen 1-2, 128b/130b from gen 3): PCI-SIG's
# transfer rates 2.5, 5, 8, 16, 32 GT/s
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 8 * 128 / 130 / 8, 4: 16 * 128 / 130 / 8, 5: 32 * 128 / 130 / 8}

# The GeForce tensor rate with fp32 accumulation per SM and clock: the GA102 whitepaper's RTX 3090 figure,
# 71 TFLOPS over 82 SMs at 1.695 GHz, and the Ada whitepaper's RTX 4090 figure, 165.2 TFLOPS over 128 SMs
# at 2.52 GHz, are both 512 FLOP/clock/SM. Cards the whitepapers do not list are derived from it.
GEFORCE_FLOP_PER_CLOCK_SM = 512
GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix table (RTX 3090)"
ADA = "NVIDIA Ada GPU Architecture whitepaper, appendix table (RTX 4090)"


def _derived(sms: int, boost_ghz: float, page: str) -> tuple[float, str]:
    """A GeForce card's bf16 rate from its SMs and boost clock (its spec page) and the rate per SM."""
    tflops = round(sms * GEFORCE_FLOP_PER_CLOCK_SM * boost_ghz / 1e3, 1)
    return tflops, (f"derived: {sms} SMs x {boost_ghz} GHz boost ({page}) x {GEFORCE_FLOP_PER_CLOCK_SM} "
                    f"FLOP/clock/SM ({GA102}; {ADA})")


@dataclass(frozen=True)
class Card:
    """One card's figures (module docstring for their meaning) and, per figure, its source."""

    name: str
    bf16_tflops: float
    memory_gbps: float
    memory_gib: float
    pcie_gen: int
    pcie_lanes: int
    sources: dict = field(default_factory=dict, compare=False)  # figure name -> URL or document

    @property
    def pcie_gbps(self) -> float:
        """The link's rate per direction in GB/s (lanes x the generation's rate after line coding)."""
        return self.pcie_lanes * PCIE_LANE_GBPS[self.pcie_gen]

    def as_dict(self) -> dict:
        return {"name": self.name, "bf16_tflops": self.bf16_tflops, "memory_gbps": self.memory_gbps,
                "memory_gib": self.memory_gib, "pcie": f"gen{self.pcie_gen} x{self.pcie_lanes}",
                "pcie_gbps": round(self.pcie_gbps, 2), "sources": dict(self.sources)}


def _geforce(name: str, sms: int, boost_ghz: float, pin_gbps: float, bus_bits: int, gib: float, lanes: int,
             page: str, tflops: tuple[float, str] | None = None) -> Card:
    """A GeForce card from its spec page's SMs, boost clock, memory speed and bus width, and PCIe 4.0 lanes."""
    rate, rate_source = tflops or _derived(sms, boost_ghz, page)
    gbps = pin_gbps * bus_bits / 8
    return Card(name, rate, gbps, gib, 4, lanes, {"bf16_tflops": rate_source, "memory_gib": page, "pcie": page,
                                                  "memory_gbps": f"derived: {pin_gbps} Gbps x {bus_bits}-bit / 8 "
                                                                 f"({page})"})


_GEFORCE = "https://www.nvidia.com/en-us/geforce/graphics-cards/"
H100 = "https://www.nvidia.com/en-us/data-center/h100/ (NVIDIA H100 Tensor Core GPU datasheet, H100 SXM)"
A100 = "https://www.nvidia.com/en-us/data-center/a100/ (NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM)"
L4 = "https://www.nvidia.com/en-us/data-center/l4/ (NVIDIA L4 Tensor Core GPU datasheet)"

CARDS: tuple[Card, ...] = (
    # (SMs: CUDA cores / 128)
    _geforce("RTX 3060 12GB", 28, 1.78, 15, 192, 12, 16, _GEFORCE + "30-series/rtx-3060-3060ti/"),
    _geforce("RTX 4060", 24, 2.46, 17, 128, 8, 8, _GEFORCE + "40-series/rtx-4060-4060ti/"),
    _geforce("RTX 4060 Ti 16GB", 34, 2.54, 18, 128, 16, 8, _GEFORCE + "40-series/rtx-4060-4060ti/"),
    _geforce("RTX 4070", 46, 2.48, 21, 192, 12, 16, _GEFORCE + "40-series/rtx-4070-family/"),
    _geforce("RTX 3090", 82, 1.695, 19.5, 384, 24, 16, _GEFORCE + "30-series/rtx-3090-3090ti/", (71.0, GA102)),
    _geforce("RTX 4090", 128, 2.52, 21, 384, 24, 16, _GEFORCE + "40-series/rtx-4090/", (165.2, ADA)),
    # data-centre cards: their datasheets give the bf16 rate "with sparsity"; the dense rate is half of it
    Card("A100 80GB SXM", 312, 2039, 80, 4, 16, {"bf16_tflops": A100, "memory_gbps": A100, "memory_gib": A100,
                                                "pcie": A100}),
    Card("H100 SXM", 989, 3350, 80, 5, 16, {"bf16_tflops": H100 + ": 1,979 with sparsity", "memory_gbps": H100,
                                           "memory_gib": H100, "pcie": H100}),
    Card("L4", 121, 300, 24, 4, 16, {"bf16_tflops": L4 + ": 242 with sparsity", "memory_gbps": L4,
                                     "memory_gib": L4, "pcie": L4}),
)


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower()).removeprefix("nvidia").removeprefix("geforce").removeprefix("rtx")


def card(name: str) -> Card:
    """The card whose name matches `name` ignoring case, spaces, dashes and an "NVIDIA"/"GeForce"/"RTX"
    prefix, or whose name starts with it when only one does ("A100", "4060 Ti"); ConfigError otherwise."""
    key = _key(name)
    exact = [c for c in CARDS if _key(c.name) == key]
    found = exact or [c for c in CARDS if key and _key(c.name).startswith(key)]
    if len(found) == 1:
        return found[0]
    listed = "\n".join(f"  {format_card(c)}" for c in CARDS)
    problem = f"--card {name!r} matches {', '.join(c.name for c in found)}" if found else f"no card {name!r}"
    raise ConfigError(f"{problem}; give one of these names (bf16 dense TFLOPS, memory GB/s, memory GiB, PCIe):"
                      f"\n{listed}")


def format_card(c: Card) -> str:
    return (f"{c.name:<17} {c.bf16_tflops:>6.1f} TFLOPS {c.memory_gbps:>5.0f} GB/s {c.memory_gib:>3.0f} GiB "
            f"PCIe gen{c.pcie_gen} x{c.pcie_lanes} ({c.pcie_gbps:.1f} GB/s)")
