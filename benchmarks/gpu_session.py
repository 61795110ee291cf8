"""The GPU session driver: the measurements a lent GPU is for, in parts that fit the device tool's calls.

    bash benchmarks/gpu_session.sh env cuda-tests          # on the GPU machine, from the repository root
    bash benchmarks/gpu_session.sh rehearse                # on a CPU: every part's code path at toy sizes

(gpu_session.sh installs the carried wheels from .whl/ and puts this bare tree first on sys.path, then
runs this file.) A device call runs for at most 10 minutes and brings back at most 8 files, and the
machine reaches no registry. So:
- each part is a list of steps, each step a subprocess with its own timeout; a part also stops
  starting steps when the call's budget (--budget, default 540 s) would be overrun, and says so;
- each part writes exactly two files into $OUT: PART.log (everything its steps print, as they print
  it) and PART.jsonl (one line per finished step: command, exit code, seconds, and the JSON the step
  wrote). Lines are appended as steps end, so a call killed at its limit still returns what it did;
- `env` checks, in seconds, every import the other parts need and prints the versions and the GPU.
The exit code is 0 only if every step of every part asked for passed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
RECIPES = "recipes"


@dataclass
class Step:
    name: str
    argv: list[str]
    timeout_s: int
    json_out: bool = True  # the step takes --json PATH and writes its results there
    ok_codes: tuple[int, ...] = (0,)


def _trainer_steps(arch: str, recipe: str, prompt_len: int, completion_len: int, tiny: bool) -> list[Step]:
    """trainer_step.py for one recipe at its full lengths, under an 8 GiB cap (an 8 GB card) and a
    7.5 GiB one (a desktop card that also drives a display)."""
    lengths = ["--prompt-len", "16", "--completion-len", "8", "--steps", "2", "--tiny"] if tiny else \
        ["--prompt-len", str(prompt_len), "--completion-len", str(completion_len), "--steps", "3"]
    return [Step(f"trainer_step {recipe} cap {cap} GiB",
                 [PY, "benchmarks/trainer_step.py", "--arch", arch, "--recipe", f"{RECIPES}/{recipe}.yaml",
                  "--memory-cap-gib", str(cap), *lengths], timeout_s=120 if tiny else 260) for cap in (8, 7.5)]


def _rollout_steps(arch: str, rows: list[int], tiny: bool) -> list[Step]:
    """rollout_speed.py eager vs compiled (CUDA graphs per bucket): `rows` rows decoding at once (G = 8
    samples of rows / 8 prompts), every row 512 tokens (no early EOS), bf16 random weights (issue 27)."""
    if tiny:  # one bucket, a few tokens: the CPU compiles one graph with Inductor
        return [Step(f"rollout speed {arch} (tiny)",
                     [PY, "benchmarks/rollout_speed.py", "--arch", arch, "--tiny", "--prompts", "2", "--G", "2",
                      "--micro-batch", "2", "--max-new", "8", "--prompt-len", "8", "--eos-hazard", "0",
                      "--repeats", "1", "--paths", "refill,static,compiled"], 60)]
    return [Step(f"rollout speed {arch}, {n} rows x 512 tokens: eager vs graphed",
                 [PY, "benchmarks/rollout_speed.py", "--arch", arch, "--prompts", str(n // 8), "--G", "8",
                  "--micro-batch", str(n), "--max-new", "512", "--prompt-len", "128", "--eos-hazard", "0",
                  "--repeats", "2", "--paths", "refill,static,compiled", "--dtype", "bf16", "--device", "cuda"],
                 260 if len(rows) > 1 else 500) for n in rows]


def parts(tiny: bool) -> dict[str, list[Step]]:
    """Every part's steps; `tiny` is the CPU rehearsal (same scripts, same code paths, toy sizes)."""
    kernel_tokens = ["64"] if tiny else ["4096", "8192"]
    cuda_only = [] if tiny else ["--device", "cuda"]
    pytest = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
    return {
        "env": [Step("versions, GPU and imports", [PY, "benchmarks/gpu_session.py", "--check-env"], 120)],
        # Every cuda-marked test, then every other op test on CUDA tensors, selected by the kernels'
        # `device` fixture ids (cpu-torch, cpu-triton, cuda-torch, cuda-triton). Not `-k cuda`: that
        # also matches file names (test_cuda_large.py), which ran its ~13 GB tests in both steps.
        # tests/test_gpu_session.py checks that no test is in both. On a CPU both select only skips.
        "cuda-tests": [
            Step("cuda-marked tests", [*pytest, "-m", "cuda", "tests"], 300, json_out=False),
            Step("kernel tests on CUDA tensors", [*pytest, "tests/kernels", "-m", "not cuda",
                                                  "-k", "cuda-torch or cuda-triton"], 420, json_out=False,
                 ok_codes=(0, 5) if tiny else (0,)),  # 5: nothing selected (no CUDA ids on a CPU)
        ],
        # The whole default suite: on a GPU, device `auto` means CUDA wherever a test does not pin the CPU.
        "suite": [Step("the default test suite", [*pytest, "tests"], 530, json_out=False)],
        "kernels": [
            Step("row kernels: bandwidth", [PY, "benchmarks/row_kernel_bandwidth.py", "--tokens", kernel_tokens[-1],
                                            *(["--vocab", "4096", "--repeats", "1"] if tiny else []), *cuda_only], 200),
            Step("loss head: peak memory", [PY, "benchmarks/loss_head_memory.py", "--tokens", *kernel_tokens,
                                            *(["--vocab", "4096"] if tiny else []), *cuda_only], 200),
            Step("loss head: time", [PY, "benchmarks/loss_head_speed.py", "--tokens", *kernel_tokens,
                                     *(["--vocab", "4096", "--repeats", "1"] if tiny else []), *cuda_only], 200),
        ],
        # The 8 GB recipes on random-weight models of their architectures (no hub weights there).
        "trainer-0.5b-gsm8k": _trainer_steps("Qwen2.5-0.5B", "qwen2.5-0.5b_gsm8k_8gb", 256, 1024, tiny),
        "trainer-0.5b-string": _trainer_steps("Qwen2.5-0.5B", "qwen2.5-0.5b_expected-string_8gb", 128, 64, tiny),
        "trainer-1.5b-gsm8k": _trainer_steps("Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k_8gb", 256, 512, tiny),
        # Host RAM the 1.5B recipe pins (offloaded optimizer, streamed reference) against the planner's
        # figure and against per-tensor pin_memory's power-of-two blocks.
        "pinned": [Step("pinned host memory vs the planner, 1.5B recipe",
                        [PY, "benchmarks/pinned_host_memory.py", "--arch", "Qwen2.5-1.5B",
                         "--recipe", f"{RECIPES}/qwen2.5-1.5b_gsm8k_8gb.yaml", *(["--tiny"] if tiny else [])], 240)],
        # Decode tokens/s, eager (today's dynamic step, and the static step) vs compiled and graphed.
        "rollout-0.5b": _rollout_steps("Qwen2.5-0.5B", [16, 64], tiny),
        # (its tiny version would repeat rollout-0.5b's: at toy width both are the same Qwen2 model)
        "rollout-1.5b": [] if tiny else _rollout_steps("Qwen2.5-1.5B", [64], tiny),
        "memory": [
            Step("planner tables", [PY, "benchmarks/memory_accounting.py"], 120),
            Step("planner vs profiler, 8 GB recipes", [PY, "benchmarks/plan_accuracy.py", "--gpu-recipes",
                                                       "--memory-cap-gib", "8",
                                                       *(["--tiny", "--steps", "1"] if tiny else ["--steps", "2"])], 420),
        ],
    }


def check_env(json_path: str | None) -> int:
    """Print versions and the GPU, and import everything the parts need; exit 1 naming what is missing."""
    import importlib
    import importlib.metadata as md
    info, missing = {"python": sys.version.split()[0]}, []
    for dist in ("torch", "triton", "transformers", "accelerate", "bitsandbytes", "numpy", "pytest", "matplotlib"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    import torch
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count(),
                    free_gib=round(free / 2**30, 2), total_gib=round(total / 2**30, 2))
    else:
        info["gpu"] = None
    sys.path.insert(0, str(ROOT / "benchmarks"))
    modules = ["lowmem_grpo.kernels", "lowmem_grpo.training.trainer", "lowmem_grpo.memory.profile",
               "lowmem_grpo.memory.plan", "lowmem_grpo.memory_modes.sr_adamw", "lowmem_grpo.cli",
               "bitsandbytes", "triton", "matplotlib", "bench_utils", "trainer_step", "plan_accuracy", "rollout_speed"]
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report every failure, not only the first
            missing.append(f"{name}: {type(e).__name__}: {e}")
    import lowmem_grpo.kernels as kernels
    info["kernels_from"] = str(Path(kernels.__file__).parent)
    if Path(kernels.__file__).resolve().parent != ROOT / "lowmem_grpo" / "kernels":
        missing.append(f"lowmem_grpo.kernels comes from {kernels.__file__}, not this tree's lowmem_grpo/kernels/")
    info["import_errors"] = missing
    print(json.dumps(info, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(info, indent=2))
    if missing:
        print("missing for the other parts (carry wheels in .whl/, see README's GPU section):\n  " + "\n  ".join(missing),
              file=sys.stderr)
    return 1 if missing else 0


def run_part(name: str, steps: list[Step], out: Path, deadline: float, timeout_scale: float = 1.0) -> bool:
    log_path, jsonl_path = out / f"{name}.log", out / f"{name}.jsonl"
    passed = True
    with open(log_path, "a") as log:
        for step in steps:
            left = deadline - time.monotonic()
            record = {"part": name, "step": step.name, "argv": step.argv}
            if left < min(step.timeout_s, 60):
                record.update(status="not started: the call's budget is spent", seconds=0)
                _append(jsonl_path, record)
                print(f"[{name}] {step.name}: not started ({left:.0f} s left of the budget)", flush=True)
                passed = False
                continue
            timeout = int(min(step.timeout_s * timeout_scale, left - 5))
            json_file = Path(tempfile.mkdtemp(prefix="gpu_session_")) / "result.json"
            argv = step.argv + (["--json", str(json_file)] if step.json_out else [])
            header = f"\n===== [{name}] {step.name} (timeout {timeout} s)\n$ {' '.join(argv)}\n"
            log.write(header), log.flush()
            print(header, end="", flush=True)
            t0 = time.monotonic()
            proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                _tee(proc, log, t0 + timeout)
                status = "ok" if proc.returncode in step.ok_codes else f"failed (exit {proc.returncode})"
            except TimeoutError:
                status = f"timed out after {timeout} s"
            record.update(status=status, exit_code=proc.returncode, seconds=round(time.monotonic() - t0, 1))
            if json_file.is_file():
                record["result"] = json.loads(json_file.read_text())
            _append(jsonl_path, record)
            print(f"[{name}] {step.name}: {status} in {record['seconds']} s", flush=True)
            passed &= status == "ok"
    return passed


def _tee(proc: subprocess.Popen, log, deadline: float) -> None:
    """Copy the child's output, line by line as it comes, to the log and our stdout; TimeoutError past
    `deadline` (the copying thread ends with the child's output)."""
    def copy():
        for line in proc.stdout:
            log.write(line), log.flush()
            sys.stdout.write(line), sys.stdout.flush()
    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        raise TimeoutError from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def main(argv=None) -> int:
    every = list(parts(tiny=False))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="*", help=f"parts to run, in order: {', '.join(every)}; or `rehearse [PART ...]` "
                                             "(those parts, default all, on a CPU at toy sizes)")
    ap.add_argument("--budget", type=float, default=540, help="seconds this call may take (device calls: 600)")
    ap.add_argument("--check-env", action="store_true", help="only check versions, the GPU and imports (part env)")
    ap.add_argument("--json", default=None, help="with --check-env: write what it found here")
    args = ap.parse_args(argv)
    if args.check_env:
        return check_env(args.json)
    rehearse = args.parts[:1] == ["rehearse"]
    chosen = (args.parts[1:] or every) if rehearse else args.parts
    unknown = [p for p in chosen if p not in every]
    if not chosen or unknown:
        ap.error(f"give parts from: {', '.join(every)} (or `rehearse`); unknown: {unknown}")
    if rehearse:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the rehearsal is the CPU path, even on a GPU machine
    out = Path(os.environ.get("OUT") or ROOT / "gpu-results")
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + (float("inf") if rehearse else args.budget)
    table = parts(tiny=rehearse)
    # A 2-core CI machine is slower than the GPU machine's 16 cores: the rehearsal's timeouts are 4x.
    results = {name: run_part(name, table[name], out, deadline, 4.0 if rehearse else 1.0) for name in chosen}
    print("\n" + "\n".join(f"{name:<14} {'passed' if ok else 'FAILED'}" for name, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
