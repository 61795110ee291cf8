"""Checkpoints: a save_pretrained folder plus everything needed to continue the run exactly.

    output_dir/checkpoint-<step>/
        config.json, model.safetensors, tokenizer files   <- loadable with from_pretrained
        trainer_state.pt    optimizer, scheduler, RNG states, data position, unfinished generation batch
        trainer_state.json  step, run config (for people)

A checkpoint is written under a temporary name and renamed when complete, so a crash mid-write never
leaves a broken checkpoint; `latest` is the highest complete step. Only the last K are kept.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"
_NAME = re.compile(r"^checkpoint-(\d+)$")


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in output_dir, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = []
    for p in out.iterdir():
        m = _NAME.match(p.name)
        if m and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def resolve_resume(resume_from: str, output_dir: str | Path) -> Path:
    """'latest' -> the newest complete checkpoint in output_dir; a path -> that folder (checked)."""
    if resume_from == "latest":
        found = list_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from=latest but {output_dir} has no complete checkpoint-<step> folder")
        return found[-1][1]
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"resume_from={resume_from!r} is not a checkpoint folder (no {STATE_FILE} in it)")
    return path


def save_checkpoint(output_dir: str | Path, step: int, model, tokenizer, state: dict, keep: int,
                    run_config: Optional[dict] = None) -> Path:
    """Write checkpoint-<step> atomically and prune to the last `keep` checkpoints."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    final = out / f"checkpoint-{step}"
    tmp = out / f".tmp-checkpoint-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / STATE_FILE)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "config": run_config}, indent=2, default=str))
    if final.exists():  # the same step saved again (e.g. interrupted right after a scheduled save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    for _, old in list_checkpoints(out)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_state(path: str | Path) -> dict:
    # weights_only=False: the state holds Python RNG tuples and numpy arrays, written by us.
    return torch.load(Path(path) / STATE_FILE, map_location="cpu", weights_only=False)


def load_weights(model, path: str | Path) -> None:
    """Load a checkpoint's weights into an already built model (keeps tied weights tied)."""
    from safetensors.torch import load_file
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained stores a tied weight once; the other name shares its storage and is loaded too.
    current = model.state_dict()
    loaded_ptrs = {current[k].data_ptr() for k in state if k in current}
    missing = [k for k in missing if current[k].data_ptr() not in loaded_ptrs]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
