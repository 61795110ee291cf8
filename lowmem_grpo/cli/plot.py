"""`lowmem-grpo plot RUN_DIR [--out PATH]`: draw a run's metrics as a PNG (default RUN_DIR/run.png).

The same picture `train` writes at its end (lowmem_grpo/training/plot.py), on demand: for a run that
is still going, one that was killed, or with a different output path.
"""

from __future__ import annotations

from typing import Optional

from ..training.plot import plot_run


def run(run_dir: str, out: Optional[str]) -> int:
    print(f"wrote {plot_run(run_dir, out)}")
    return 0
