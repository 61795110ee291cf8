"""Checkpoints: a save_pretrained folder plus everything needed to continue the run exactly.

    output_dir/checkpoint-<step>/
        config.json, model.safetensors, tokenizer files   <- loadable with from_pretrained
        trainer_state.pt    optimizer, scheduler, RNG states, data position, unfinished generation batch
        trainer_state.json  step, run config (for people)
        manifest.json       size and sha256 of every other file; written last

trainer_state.pt holds only tensors and plain values and is read with `torch.load(weights_only=True)`.
A save is atomic (written under `.tmp-checkpoint-*`, fsynced, renamed); a checkpoint whose files do not
match its manifest is skipped by `resume_from=latest` with a warning.

Design notes: docs/training.md
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .output_dir import disk_full

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp-checkpoint-"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written (disk full) or loaded (incomplete, corrupted, unsafe)."""


# ----- RNG state as tensors and plain values (weights_only-loadable) ---------------------------------
def rng_state() -> dict:
    version, keys, gauss_next = random.getstate()
    algorithm, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "keys": torch.tensor(keys, dtype=torch.int64), "gauss_next": gauss_next},
        "numpy": {"algorithm": str(algorithm), "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["keys"].tolist()), py["gauss_next"]))
    np.random.set_state((npy["algorithm"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def plain(value):
    """`value` with every non-tensor leaf made JSON-like (str, int, float, bool, None, list, dict), so that
    `torch.load(weights_only=True)` reads it back; unknown objects become their str()."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, (int, str)) else k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value)
    if isinstance(value, np.ndarray):
        return plain(value.tolist())
    return str(value)


# ----- finding checkpoints ----------------------------------------------------------------------------
def _named(output_dir: str | Path) -> list[tuple[int, Path]]:
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in out.iterdir() if (m := _NAME.match(p.name)) and p.is_dir())


def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoints in output_dir that were completed (have a manifest), oldest first."""
    return [(s, p) for s, p in _named(output_dir) if (p / MANIFEST).is_file()]


def verify(path: str | Path) -> None:
    """Check every file of a checkpoint against its manifest (size, then sha256); CheckpointError names
    the first file that is missing, truncated or changed."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise CheckpointError(f"{path} has no {MANIFEST}: the save did not finish (or an older lowmem-grpo wrote it)")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest} is corrupted ({e})") from None
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing (listed in {MANIFEST})")
        size = f.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{f} is truncated or changed: {size} bytes, the manifest says {entry['size']}")
        if _sha256(f) != entry["sha256"]:
            raise CheckpointError(f"{f} is corrupted: its sha256 does not match {MANIFEST}")


def resolve_resume(resume_from: str, output_dir: str | Path) -> Path:
    """'latest' -> the newest checkpoint in output_dir that verifies (newer broken ones are skipped with a
    warning saying why); a path -> that folder, verified. Removes leftovers of interrupted saves."""
    remove_leftovers(output_dir)
    if resume_from == "latest":
        skipped = []
        for step, path in reversed(_named(output_dir)):
            try:
                verify(path)
            except CheckpointError as e:
                logger.warning(f"resume_from=latest: skipping {path.name}: {e}")
                skipped.append(str(e))
                continue
            return path
        why = f" (skipped: {'; '.join(skipped)})" if skipped else ""
        raise FileNotFoundError(f"resume_from=latest but {output_dir} has no complete checkpoint-<step> folder{why}")
    path = Path(resume_from).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"resume_from={resume_from!r} is not a checkpoint folder (no such folder); give a "
                                f"checkpoint-<step> folder or 'latest', or leave it unset (null) to start fresh")
    try:
        verify(path)
        if not (path / STATE_FILE).is_file():
            raise CheckpointError(f"{path / STATE_FILE} is missing")
    except CheckpointError as e:
        raise CheckpointError(f"resume_from={resume_from}: {e}; resume from another checkpoint-<step> folder "
                              "(resume_from=latest picks the newest complete one), or start a new run from its "
                              f"weights with model.name_or_path={resume_from}") from None
    return path


def remove_leftovers(output_dir: str | Path) -> None:
    """Delete `.tmp-checkpoint-*` folders left by a save or prune that was killed (one trainer per output_dir)."""
    out = Path(output_dir)
    if out.is_dir():
        for p in out.iterdir():
            if p.name.startswith(TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


# ----- writing ----------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms where a folder cannot be opened (Windows): rename is all they offer
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_manifest(folder: Path) -> None:
    """fsync every file, then record its size and hash; the manifest is the last file written."""
    files = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST):
        _fsync_file(f)
        files[f.relative_to(folder).as_posix()] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    for d in sorted({f.parent for f in folder.rglob("*") if f.is_file()}, reverse=True):
        _fsync_dir(d)
    with open(folder / MANIFEST, "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)


def _discard(folder: Path, out: Path, tag: str) -> None:
    """Rename `folder` to a temporary name (atomic: it stops being a checkpoint), then delete it."""
    doomed = out / f"{TMP_PREFIX}{tag}-{os.getpid()}"
    os.replace(folder, doomed)
    _fsync_dir(out)
    shutil.rmtree(doomed, ignore_errors=True)


def new_tmp_folder(output_dir: str | Path, step: int) -> Path:
    """The folder checkpoint-<step> is written in before its rename (other ranks may add files to it)."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_leftovers(out)
    tmp = out / f"{TMP_PREFIX}{step}-{os.getpid()}"
    tmp.mkdir()
    return tmp


def save_rank_file(tmp: str | Path, name: str, value) -> None:
    """One rank's own part of a checkpoint (FSDP2: its optimizer-state shard), written into the
    folder rank 0 will list in the manifest and rename."""
    with open(Path(tmp) / name, "wb") as f:
        torch.save(value, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(output_dir: str | Path, step: int, model, tokenizer, state: dict, keep: int,
                    run_config: Optional[dict] = None, *, tmp: Optional[Path] = None,
                    weights: Optional[dict] = None) -> Path:
    """Write checkpoint-<step> atomically and durably, then prune to the last `keep` checkpoints.

    `tmp`: a folder from new_tmp_folder that already holds other ranks' files; `weights`: the state dict
    to save instead of the model's own (FSDP2: the whole weights gathered from the shards)."""
    out = Path(output_dir)
    tmp = new_tmp_folder(out, step) if tmp is None else Path(tmp)
    final = out / f"checkpoint-{step}"
    try:
        model.save_pretrained(tmp, state_dict=weights)
        if not any(tmp.glob("*.safetensors")):  # transformers skips the write on ranks other than 0
            raise CheckpointError(f"save_pretrained wrote no weights into {tmp}: under torch.distributed only "
                                  "rank 0 may save (or leave the process group first)")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        with open(tmp / STATE_FILE, "wb") as f:
            torch.save(state, f)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "config": run_config}, indent=2,
                                                           default=str))
        _write_manifest(tmp)
    except BaseException as e:
        free = shutil.disk_usage(out).free if out.is_dir() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and disk_full(e):
            previous = list_checkpoints(out)
            kept = f"; the previous checkpoint {previous[-1][1]} is intact" if previous else ""
            raise CheckpointError(
                f"no space left on the disk holding {out.resolve()} while writing checkpoint-{step} "
                f"({free / 2**20:.0f} MiB free): free space there (or set output_dir on a bigger disk, "
                f"or lower save_total_limit), then continue with resume_from=latest{kept}") from e
        raise
    if final.exists():  # the same step saved again (e.g. interrupted right after a scheduled save)
        _discard(final, out, f"replaced-{step}")
    os.replace(tmp, final)
    _fsync_dir(out)
    for _, old in list_checkpoints(out)[:-keep]:  # only now that the new one is on disk
        _discard(old, out, f"pruned-{old.name}")
    return final


# ----- loading ----------------------------------------------------------------------------------------
def load_state(path: str | Path) -> dict:
    """trainer_state.pt, read with weights_only=True: tensors and plain values only, never code."""
    file = Path(path) / STATE_FILE
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refused to load {file}: it holds pickled Python objects, not only tensors and plain values, and "
            f"unpickling them could run code. lowmem-grpo's own checkpoints never do; this one was written by "
            f"something else (or an older lowmem-grpo). Details: {str(e).splitlines()[0]}") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"{file} is corrupted or truncated and cannot be read ({e}); resume from an "
                              f"earlier checkpoint (resume_from=latest skips broken ones)") from None


def load_weights(model, path: str | Path) -> None:
    """Load a checkpoint's weights into an already built model (keeps tied weights tied)."""
    from safetensors.torch import load_file
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no .safetensors weights in {path}: it is not a lowmem-grpo checkpoint; resume from a "
                              "checkpoint-<step> folder (or resume_from=latest)")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise CheckpointError(f"{f} is corrupted or truncated and cannot be read ({e})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained stores a tied weight once; the other name shares its storage and is loaded too.
    current = model.state_dict()
    loaded_ptrs = {current[k].data_ptr() for k in state if k in current}
    missing = [k for k in missing if current[k].data_ptr() not in loaded_ptrs]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected "
                              f"{unexpected[:5]}; resume with the model.name_or_path (or model.config) that wrote it")


def load_rank_file(path: str | Path, name: str):
    """A file save_rank_file wrote, read with weights_only=True (tensors and plain values only)."""
    file = Path(path) / name
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: {path} was not written by this strategy and number of ranks")
    return torch.load(file, map_location="cpu", weights_only=True)
