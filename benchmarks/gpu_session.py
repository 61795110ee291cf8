"""The GPU session: the measurements a lent GPU is for, in two device calls made one right after the other.

    bash benchmarks/gpu_session.sh first       # device call 1, timeout_s 540 (9 minutes)
    bash benchmarks/gpu_session.sh second      # device call 2, timeout_s 360 (6 minutes), on the warm machine
    bash benchmarks/gpu_session.sh rehearse    # both calls (and `memory`) at toy sizes on a CPU (CI)

(gpu_session.sh installs the wheels carried in .whl/ and puts this bare tree first on sys.path, then runs
this file.) A call is a list of steps, each a subprocess with its own timeout, run in order. A step starts
only if its whole timeout fits in what is left of the call's budget (--budget, default the device call's
limit less MARGIN_S, counted from the call's start: installing the wheels comes out of it): no step runs
on a cut timeout, and a step that does not fit is recorded as not started while later, shorter ones may
still run. A step that overruns its timeout is stopped (its process group: SIGTERM, then SIGKILL 5 s on).

first, in this order:
  env           versions, the GPU, every import the steps need, and that the offloaded optimizer's host
                AdamW kernel built natively (`host_kernel_check`: fails loudly where it falls back)
  cuda-tests    the cuda tests most likely to break (CUDA_TEST_FILES), verbose, each under a per-test
                timeout (pytest-timeout), a JUnit report (first-junit.xml, written when pytest ends) and
                a line per test as it starts and ends (gpu_session_pytest.py, into first.jsonl)
  kernel-tests  every op test's CUDA cases (KERNEL_TEST_FILES: the kernels' `device` fixture's cuda-torch
                and cuda-triton, ~400 cases: the loss variants, the real-vocabulary heads), the same way
                (first-kernels-junit.xml)
  trainer-1.5b  three steps of the 1.5B recipe as shipped (compiled decode, layer-major backward) on random
                weights at full lengths (prompt 256, completion 512) under an 8 GiB cap, the third under the
                profiler: peaks, pinned host memory against the plan, time split into generation, training
                and host update, and where the profiled step's time went (trainer_step.py --profile,
                step_profile.py: per phase GPU busy and idle, device time by kind, copies' bytes and GB/s,
                syncs, the ten kernels with the most time)
  learn-char-e  char_e, a from-scratch model, trained on the GPU by `lowmem-grpo train`: its reward rising and
                the held-out evaluation before and after
second: the first call's steps that did not finish on this machine (not started, stopped at their timeout,
  or cut by the call's end; of a test step, only its tests that did not end), read from gpu-results/state/,
  which a warm machine keeps between calls (`--redo KEY ...` names them instead); then, as time allows, in
  this order of importance: every other cuda test (OTHER_CUDA_TEST_FILES); the 1.5B recipe in micro-batches
  of 8 (MICROBATCH_8), profiled; the 1.5B recipe with the
  per-micro-batch path the layer-major backward replaced, profiled the same way; one step each of the
  Qwen3-1.7B, Llama-3.2-1B and Gemma-3-1B 8 GB recipes; the 3B recipe, profiled; the 1.5B recipe with its
  layers compiled (model.torch_compile), profiled; one step each of the
  Llama-3.1-8B and Qwen2.5-7B 24 GB recipes under a 24 GiB cap; the 7B 8 GB recipe (its layers in host RAM,
  NF4 rollouts, eager decode); the 1.5B rollout's decode eager against graphed; the fused head's time
  against plain torch; the 1.5B 4096-token and 0.5B GSM8K recipes; the fused head's peak. The trainer steps
  compile the decode step as the recipes do: on an H200 a first 1.5B step's eager rollout took 40 s, where
  compiling the decode step and decoding took 36 s (and later rollouts 2 s).
Step timeouts: what each took on an H100 (benchmarks/RESULTS.md, "Second GPU run"), plus about a quarter
(trainer-1.5b: a third step, profiled, and the trace read back, added); kernel-tests: what it took on an H200
from a cold Triton cache, plus a half; other-cuda-tests and the steps after it: the third GPU run's H200
(RESULTS.md, "Third GPU run"), or an estimate where that run did not finish them (the new recipes', 3B's,
the 8B and 7B ones').
memory (a call of its own, for a later session): the planner against the profiler on the 8 GB recipes,
  one step each (plan_accuracy.py --gpu-recipes).

Output, in $OUT (default gpu-results/): CALL.log (everything the steps print, as they print it) and
CALL.jsonl (a line when the call starts, a line per step as it ends: command, status, seconds, the JSON the
step wrote; a test step's per-test lines; a step stopped at its timeout names the test it was running),
both appended as things happen, so a call killed at its limit still returns what it did; and
CALL-junit.xml from a test step. The exit code is 0 only if every step passed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# What each call did, on this machine (read by `second`); GPU_SESSION_STATE moves it (tests).
STATE = Path(os.environ.get("GPU_SESSION_STATE") or ROOT / "gpu-results" / "state")
CALL_SECONDS = {"first": 540, "second": 360, "memory": 540}  # the device call's timeout_s
# Of each call, outside its budget: Python's start, the last lines, slack before the device tool's kill. (The
# wheels' install, ~10 s on a fresh machine, none on a warm one, comes out of the budget: budget_left.)
MARGIN_S = 25
PER_TEST_TIMEOUT_S = 60  # pytest-timeout, for each test of a test step
KILL_GRACE_S = 5

# The cuda tests most likely to break on first contact, in the order they run: the offloaded optimizer and
# its tied-head split (and its update thread), activation offload, the host arena, the streamed reference,
# the decode step's CUDA graphs, the memory profiler, then the kernels at Qwen sizes (> 2^31 logits, the fused
# head at the 1.5B's width: the largest tensors). 30 tests, 105 s on an H100 (second GPU run).
CUDA_TEST_FILES = [
    "tests/optim/test_offload_cuda.py",
    "tests/optim/test_offload_update_thread.py",
    "tests/training/test_activation_offload.py",
    "tests/optim/test_host_arena_cuda.py",
    "tests/policy/test_reference.py",
    "tests/policy/test_decode_graphs.py",
    "tests/memory/test_profile.py",
    "tests/kernels/test_cuda_large.py",
]
# Every op test's CUDA cases: the kernels' `device` fixture (tests/kernels/conftest.py) makes a cuda-torch and a
# cuda-triton case of each, marked `cuda`. 399 cases: 39 s on an H200 from a cold Triton cache (123 kernel
# specializations compiled once each), 15 s warm (RESULTS.md, "GPU session rehearsal").
KERNEL_TEST_FILES = [
    "tests/kernels/test_linear_loss.py",
    "tests/kernels/test_grpo_loss.py",
    "tests/kernels/test_one_formula.py",
    "tests/kernels/test_logprobs.py",
    "tests/kernels/test_linear.py",
    "tests/kernels/test_mask_count.py",
]
# Every other file of cuda tests (the second call's): 15 tests in 73.6 s on an H200 (third GPU run), then the
# compiled layers against the eager ones (3 tests, each compiling a toy model's layers: not yet run on a GPU).
OTHER_CUDA_TEST_FILES = [
    "tests/optim/test_optimizer_in_backward_cuda.py",
    "tests/training/test_lookup_rows.py",
    "tests/optim/test_sr_adamw.py",
    "tests/optim/test_host_adamw.py",
    "tests/policy/test_packing.py",
    "tests/memory/test_fit.py",
    "tests/training/test_step_metrics.py",
    "tests/test_trainer_step.py",
    "tests/training/test_compiled_layers.py",
    "tests/rewards/test_reward_model.py",
]


@dataclass
class Step:
    key: str
    name: str
    argv: list[str]
    timeout_s: float
    json_out: bool = True  # the step takes --json PATH and writes its results there
    ok_codes: tuple[int, ...] = (0,)
    selection: Optional[list[str]] = None  # a test step: the files or node ids its argv ends with
    shapes: Optional[list[str]] = None  # decode_speed.py: its --shape values (ARCH:RECIPE), in order


def _decode_step(shapes: list[str], tiny: bool, timeout_s: float) -> Step:
    """decode_speed.py over `shapes`: it writes its JSON after each shape, so a step stopped at its timeout
    keeps the shapes it finished and `unfinished` gives back the rest."""
    argv = [PY, "benchmarks/decode_speed.py", *(a for shape in shapes for a in ("--shape", shape)),
            *(["--tiny"] if tiny else ["--device", "cuda"])]
    return Step("decode", f"decode tokens/s, {' and '.join(s.split(':')[0] for s in shapes)}: static step "
                "eager vs compiled", argv, timeout_s, shapes=list(shapes))


def _test_step(key: str, name: str, selection: list[str], timeout_s: float, junit: Path) -> Step:
    argv = [PY, "-m", "pytest", "-m", "cuda", "-v", "-rfEs", "-p", "no:cacheprovider",
            "-p", "gpu_session_pytest",  # (benchmarks/ is on the step's PYTHONPATH: _run)
            "--timeout", str(PER_TEST_TIMEOUT_S), f"--junitxml={junit}", *selection]
    return Step(key, name, argv, timeout_s, json_out=False, selection=list(selection))


def _trainer_step(key: str, arch: str, recipe: str, completion_len: int, steps: int, timeout_s: float,
                  tiny: bool, overrides: Sequence[str] = (), cap_gib: int = 8, profile: bool = False) -> Step:
    """trainer_step.py: `steps` steps of `recipe` at its full lengths (prompt 256) under a `cap_gib` GiB cap,
    with `overrides` (key=value); `profile`: the last step under the profiler (step_profile.py)."""
    lengths = ["--prompt-len", "16", "--completion-len", "8", "--tiny"] if tiny else \
        ["--prompt-len", "256", "--completion-len", str(completion_len), "--memory-cap-gib", str(cap_gib)]
    return Step(key, f"{steps} trainer step(s), {recipe}, random weights, {cap_gib} GiB cap"
                + (", the last one profiled" if profile else ""),
                [PY, "benchmarks/trainer_step.py", "--arch", arch, "--recipe", f"recipes/{recipe}.yaml",
                 "--steps", str(steps), *lengths, *(["--profile"] if profile else []), *overrides], timeout_s)


def _learning_step(tiny: bool) -> Step:
    """char_e (a from-scratch model, 30 steps) trained with `lowmem-grpo train` on the GPU: its reward per
    step and the held-out evaluation before and after, as the CLI prints them."""
    device = "cpu" if tiny else "cuda"
    return Step("learn-char-e", f"char_e learns on {device}: lowmem-grpo train, held-out evaluation",
                [PY, "-m", "lowmem_grpo", "train", "recipes/char_e.yaml", f"train.device={device}",
                 "generation.compile_decode=false",
                 f"output.output_dir={tempfile.gettempdir()}/gpu_session_char_e", "overwrite_output_dir=true"],
                60, json_out=False)


# The path the layer-major backward replaced: each micro-batch's gradients cross PCIe.
PER_MICROBATCH = ["train.layer_major_backward=false", "train.head_gradient_once_per_step=false"]
# The same 32 completions per optimizer step in 4 micro-batches of 8: half the layer calls, and so half the
# host's launches, in the training passes (planned peak 6.23 GiB against 6.02).
MICROBATCH_8 = ["train.per_device_train_batch_size=8", "train.gradient_accumulation_steps=4",
                "train.steps_per_generation=4"]


def first_call(tiny: bool, out: Path) -> list[Step]:
    """Device call 1 (9 minutes): its steps' timeouts sum to at most its budget, so every step starts."""
    return [
        Step("env", "versions, GPU, imports, host AdamW kernel",
             [PY, "benchmarks/gpu_session.py", "--check-env"], 30),
        _test_step("cuda-tests", "the cuda tests most likely to break", CUDA_TEST_FILES, 130,
                   out / "first-junit.xml"),
        _test_step("kernel-tests", "every op test on CUDA tensors, torch and Triton", KERNEL_TEST_FILES, 60,
                   out / "first-kernels-junit.xml"),
        # the recipe as shipped (compiled decode, layer-major backward): three steps, the third profiled
        _trainer_step("trainer-1.5b", "Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k_8gb", 512, 3, 200, tiny, profile=True),
        _learning_step(tiny),
    ]


def second_call(tiny: bool, out: Path) -> list[Step]:
    """Device call 2's own steps, in order of importance, after what the first did not finish; each starts
    only if its whole timeout fits in what is left (together they need more than the call has: a later GPU
    session's `second --budget` runs more of them)."""
    cuda = [] if tiny else ["--device", "cuda"]
    head = ["--tokens", "64", "--vocab", "4096"] if tiny else ["--tokens", "8192"]
    return [
        _test_step("other-cuda-tests", "every other cuda test", OTHER_CUDA_TEST_FILES, 170,
                   out / "second-other-junit.xml"),
        # the training phase is host-bound (the third run's profile): does halving its launches halve it?
        _trainer_step("trainer-1.5b-microbatch-8", "Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k_8gb", 512, 2, 130, tiny,
                      MICROBATCH_8, profile=True),
        _trainer_step("trainer-1.5b-per-microbatch", "Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k_8gb", 512, 2, 130, tiny,
                      PER_MICROBATCH, profile=True),
        _trainer_step("trainer-qwen3-1.7b", "Qwen3-1.7B", "qwen3-1.7b_gsm8k_8gb", 1024, 1, 120, tiny),
        _trainer_step("trainer-llama-3.2-1b", "Llama-3.2-1B", "llama-3.2-1b_gsm8k_8gb", 512, 1, 100, tiny),
        _trainer_step("trainer-gemma-3-1b", "Gemma-3-1B", "gemma-3-1b_gsm8k_8gb", 512, 1, 100, tiny),
        _trainer_step("trainer-3b", "Qwen2.5-3B", "qwen2.5-3b_gsm8k_8gb", 384, 2, 170, tiny, profile=True),
        # model.torch_compile: does compiling the layers shorten the host-bound training phase on a GPU?
        _trainer_step("trainer-1.5b-compiled-layers", "Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k_8gb", 512, 2, 150, tiny,
                      ["model.torch_compile=true"], profile=True),
        _trainer_step("trainer-8b-24gb", "Llama-3.1-8B", "llama-3.1-8b_gsm8k_24gb", 1024, 1, 240, tiny, cap_gib=24),
        _trainer_step("trainer-7b-24gb", "Qwen2.5-7B", "qwen2.5-7b_gsm8k_24gb", 1024, 1, 240, tiny, cap_gib=24),
        # 7.6B with its layers in host RAM (model.offload_weights) and an NF4 rollout copy: one step, eager
        # decode (the NF4 layers in a compiled step have not met a GPU either; one thing at a time)
        _trainer_step("trainer-7b-8gb", "Qwen2.5-7B", "qwen2.5-7b_gsm8k_8gb", 1024, 1, 240, tiny,
                      ["generation.compile_decode=false"]),
        _decode_step(["Qwen2.5-1.5B:recipes/qwen2.5-1.5b_gsm8k_8gb.yaml"], tiny, 130),
        Step("head-speed", "fused loss head vs plain torch: time",
             [PY, "benchmarks/loss_head_speed.py", *head, "--repeats", "1" if tiny else "3", *cuda], 30),
        _trainer_step("trainer-1.5b-4096", "Qwen2.5-1.5B", "qwen2.5-1.5b_gsm8k-4096_8gb", 4096, 1, 150, tiny),
        _trainer_step("trainer-0.5b-gsm8k", "Qwen2.5-0.5B", "qwen2.5-0.5b_gsm8k_8gb", 1024, 2, 120, tiny),
        Step("head-memory", "fused loss head vs plain torch: peak",
             [PY, "benchmarks/loss_head_memory.py", *head, *cuda], 25),
    ]


def memory_call(tiny: bool) -> list[Step]:
    return [Step("memory", "planner vs profiler, 8 GB recipes, one step each",
                 [PY, "benchmarks/plan_accuracy.py", "--gpu-recipes", "--steps", "1",
                  *(["--tiny"] if tiny else ["--memory-cap-gib", "8"])], 480)]


def budget_of(call: str) -> float:
    return CALL_SECONDS[call] - MARGIN_S


def budget_left(budget: float, environ=os.environ, now: Optional[float] = None) -> float:
    """`budget` less what the call spent before this driver started (gpu_session.sh installing the wheels):
    GPU_SESSION_STARTED is the call's start (seconds since the epoch), set by gpu_session.sh."""
    started = environ.get("GPU_SESSION_STARTED")
    spent = max(0.0, (time.time() if now is None else now) - float(started)) if started else 0.0
    return budget - spent


# ----- environment --------------------------------------------------------------------------------------
def host_kernel_check() -> dict:
    """The offloaded optimizer's host AdamW kernel (optim/host_adamw.cpp) built natively here and
    loads: what it returns is recorded. Raises host_adamw.HostKernelUnavailable (a RuntimeError), with the
    reason, where the optimizer would fall back (no compiler or ninja, a failed build,
    LOWMEM_GRPO_HOST_KERNEL=0)."""
    from lowmem_grpo.optim import host_adamw
    t0 = time.perf_counter()
    status = host_adamw.kernel_status(require=True)  # builds on first use (torch's extension cache), else loads
    return {"host_adamw_kernel": status.path, "host_adamw_simd_lanes": status.simd_lanes,
            "host_adamw_threads": status.threads, "host_adamw_kernel_s": round(time.perf_counter() - t0, 2)}


def check_env(json_path: Optional[str]) -> int:
    """Print versions and the GPU, import everything the steps need and check the host AdamW kernel; exit 1
    naming whatever is missing or fell back."""
    import importlib
    import importlib.metadata as md
    info, missing = {"python": sys.version.split()[0]}, []
    for dist in ("torch", "triton", "transformers", "accelerate", "bitsandbytes", "numpy", "pytest",
                 "pytest-timeout", "ninja", "matplotlib"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    import torch
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                    gpu_count=torch.cuda.device_count(), free_gib=round(free / 2**30, 2),
                    total_gib=round(total / 2**30, 2))
    else:
        info["gpu"] = None
    sys.path.insert(0, str(ROOT / "benchmarks"))
    modules = ["lowmem_grpo.kernels", "lowmem_grpo.training.trainer", "lowmem_grpo.memory.profile",
               "lowmem_grpo.memory.plan", "lowmem_grpo.optim.sr_adamw", "lowmem_grpo.cli",
               "bitsandbytes", "triton", "matplotlib", "pytest_timeout", "bench_utils", "trainer_step",
               "plan_accuracy", "decode_speed", "loss_head_memory", "loss_head_speed", "gpu_session_pytest"]
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report every failure, not only the first
            missing.append(f"{name}: {type(e).__name__}: {e}")
    import lowmem_grpo.kernels as kernels
    info["kernels_from"] = str(Path(kernels.__file__).parent)
    if Path(kernels.__file__).resolve().parent != ROOT / "lowmem_grpo" / "kernels":
        missing.append(f"lowmem_grpo.kernels comes from {kernels.__file__}, not this tree's "
                       "lowmem_grpo/kernels/")
    try:
        info.update(host_kernel_check())
    except Exception as e:  # noqa: BLE001 - any failure to build or load is a fallback
        missing.append(f"host AdamW kernel: {e}")
    info["import_errors"] = missing
    print(json.dumps(info, indent=2))
    if json_path:
        Path(json_path).write_text(json.dumps(info, indent=2))
    if missing:
        print("MISSING OR FALLEN BACK (carry wheels in .whl/, see docs/gpu-notes.md):\n  "
              + "\n  ".join(missing), file=sys.stderr)
    return 1 if missing else 0


# ----- the driver ---------------------------------------------------------------------------------------
class Sink:
    """Where a call's lines go: $OUT/CALL.jsonl and its copy in the state folder (kept on the machine)."""

    def __init__(self, call: str, out: Path, state: Path):
        state.mkdir(parents=True, exist_ok=True)
        self.paths = [out / f"{call}.jsonl", state / f"{call}.jsonl"]
        self.paths[1].write_text("")  # this call's record on this machine starts now

    def append(self, record: dict) -> None:
        for path in self.paths:
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_state(call: str, state: Path = STATE) -> Optional[list[dict]]:
    """The lines a call wrote on this machine; None if it did not run here (or its record is gone)."""
    path = state / f"{call}.jsonl"
    if not path.is_file():
        return None
    records = read_lines(path)
    return records if any(r.get("event") == "call" for r in records) else None


def tests_not_ended(records: list[dict], key: str) -> Optional[list[str]]:
    """A test step's tests that did not end, in order, from its per-test lines; None if pytest did not get
    as far as listing them."""
    collected = [r["tests"] for r in records if r.get("step") == key and r.get("event") == "collected"]
    if not collected:
        return None
    ended = {r["test"] for r in records if r.get("step") == key and r.get("event") == "end"}
    return [t for t in collected[-1] if t not in ended]


def running_when_stopped(records: list[dict], key: str) -> Optional[str]:
    """The test a test step had started and not ended when it stopped, from its per-test lines."""
    started = [r["test"] for r in records if r.get("step") == key and r.get("event") == "start"]
    ended = {r["test"] for r in records if r.get("step") == key and r.get("event") == "end"}
    left = [t for t in started if t not in ended]
    return left[-1] if left else None


def unfinished(steps: list[Step], records: list[dict], keys: Optional[list[str]] = None) -> list[Step]:
    """The steps of a call that did not finish there, from its records: not started, stopped at their
    timeout, or without a line of their end (the call was cut); a step that passed or failed gave its
    result. A test step comes back with only its tests that did not end, a decode step with only the
    shapes its results lack. `keys`: these steps instead, whole (the records are not at hand)."""
    if keys is not None:
        return [s for s in steps if s.key in keys]
    ended = {r["key"]: r for r in records if r.get("event") == "step"}
    out = []
    for step in steps:
        record = ended.get(step.key, {})
        if record and not record["status"].startswith(("timed out", "not started")):
            continue
        if step.shapes is not None:
            measured = {s["arch"] for s in record.get("result", {}).get("shapes", [])}
            left = [s for s in step.shapes if s.split(":")[0] not in measured]
            if not left:
                continue
            step = _decode_step(left, "--tiny" in step.argv, step.timeout_s)
        if step.selection is not None:
            left = tests_not_ended(records, step.key)
            if left == []:
                continue
            if left:
                step = dataclasses.replace(step, argv=step.argv[:len(step.argv) - len(step.selection)] + left,
                                           selection=left)
        out.append(step)
    return out


def run_steps(call: str, steps: list[Step], out: Path, budget: float, *, state: Path = STATE,
              timeout_scale: float = 1.0, clock: Callable[[], float] = time.monotonic) -> bool:
    """Run `steps` in order within `budget` seconds (module docstring); True if every one passed."""
    sink = Sink(call, out, state)
    deadline = clock() + budget
    sink.append({"event": "call", "call": call, "budget_s": budget if budget != float("inf") else None,
                 "steps": [s.key for s in steps]})
    passed = True
    with open(out / f"{call}.log", "a") as log:
        for step in steps:
            timeout = step.timeout_s * timeout_scale
            left = deadline - clock()
            record = {"event": "step", "call": call, "key": step.key, "step": step.name, "argv": step.argv,
                      "timeout_s": timeout}
            if timeout > left:
                record.update(status=f"not started: needs {timeout:.0f} s, {left:.0f} s left", seconds=0)
                sink.append(record)
                print(f"[{call}] {step.key}: {record['status']}", flush=True)
                passed = False
                continue
            record.update(_run(step, timeout, log, sink.paths))
            if step.selection is not None and record["status"] != "ok":  # stopped, or pytest died
                running = running_when_stopped(read_lines(sink.paths[1]), step.key)
                if running:
                    record["running_when_stopped"] = running
            sink.append(record)
            print(f"[{call}] {step.key}: {record['status']} in {record['seconds']} s", flush=True)
            passed &= record["status"] == "ok"
    return passed


def _run(step: Step, timeout: float, log, line_files: list[Path]) -> dict:
    """Run one step in a process group of its own, its output copied to `log` and stdout as it comes."""
    json_file = Path(tempfile.mkdtemp(prefix="gpu_session_")) / "result.json"
    argv = step.argv + (["--json", str(json_file)] if step.json_out else [])
    env = {**os.environ, "GPU_SESSION_STEP": step.key,
           "GPU_SESSION_TEST_LINES": os.pathsep.join(map(str, line_files)),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"),  # the pytest plugin
                                                       os.environ.get("PYTHONPATH")]))}
    header = f"\n===== {step.key}: {step.name} (timeout {timeout:.0f} s)\n$ {' '.join(argv)}\n"
    log.write(header), log.flush()
    print(header, end="", flush=True)
    t0 = time.monotonic()
    # A process group of its own, to stop it with what it started; in the call's session, so that whatever
    # ends the call (the device tool at its limit) ends the step too.
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **group)
    try:
        _tee(proc, log, t0 + timeout)
        status = "ok" if proc.returncode in step.ok_codes else f"failed (exit {proc.returncode})"
    except TimeoutError:
        status = f"timed out after {timeout:.0f} s"
    record = {"status": status, "exit_code": proc.returncode, "seconds": round(time.monotonic() - t0, 1)}
    if json_file.is_file():
        try:
            record["result"] = json.loads(json_file.read_text())
        except json.JSONDecodeError as e:  # written when the step was stopped
            record["result_error"] = str(e)
    return record


def _tee(proc: subprocess.Popen, log, deadline: float) -> None:
    """Copy the child's output, line by line as it comes, to the log and our stdout; past `deadline` stop
    its process group (SIGTERM, SIGKILL after KILL_GRACE_S) and raise TimeoutError."""
    def copy():
        for line in proc.stdout:
            log.write(line), log.flush()
            sys.stdout.write(line), sys.stdout.flush()
    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        _stop_group(proc)
        raise TimeoutError from None
    else:
        _end_group(proc)  # anything the step left running (its output pipe would keep the copying open)
    finally:
        reader.join(timeout=10)


def _stop_group(proc: subprocess.Popen) -> None:
    """End the step's process group (the step and what it started: compile workers, test subprocesses):
    SIGTERM, then SIGKILL to whatever is left after KILL_GRACE_S."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    _end_group(proc)


def _end_group(proc: subprocess.Popen) -> None:
    """SIGKILL whatever is left of the step's process group, and reap the step."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _second_junit(arg: str) -> str:
    """A test step's `--junitxml=DIR/first-NAME` as the second call writes it, DIR/second-NAME; any other
    argument as it is."""
    if not arg.startswith("--junitxml="):
        return arg
    path = Path(arg.split("=", 1)[1])
    return f"--junitxml={path.with_name('second-' + path.name.removeprefix('first-'))}"


def second_steps(tiny: bool, out: Path, state: Path = STATE, redo: Optional[list[str]] = None) -> list[Step]:
    """Device call 2: the first call's steps that did not finish on this machine (`unfinished`, from the
    first call's record in `state`; `redo`: these steps of it instead, whole), then `second_call`'s own."""
    records = read_state("first", state)
    if redo is None and records is None:
        print("[second] no record of the first call on this machine (a fresh machine?): nothing to redo; "
              "--redo KEY ... names steps of the first call to run again", flush=True)
        again = []
    else:
        again = [dataclasses.replace(s, argv=[_second_junit(a) for a in s.argv])
                 for s in unfinished(first_call(tiny, out), records or [], redo)]
    return again + second_call(tiny, out)


def run_call(call: str, out: Path, budget: float, *, tiny: bool, timeout_scale: float = 1.0,
             redo: Optional[list[str]] = None, state: Path = STATE) -> bool:
    steps = {"first": lambda: first_call(tiny, out), "memory": lambda: memory_call(tiny),
             "second": lambda: second_steps(tiny, out, state, redo)}[call]()
    print(f"[{call}] steps: {', '.join(s.key for s in steps)}; budget {budget:.0f} s", flush=True)
    return run_steps(call, steps, out, budget, state=state, timeout_scale=timeout_scale)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("call", nargs="?", choices=["first", "second", "memory", "rehearse"],
                    help="the device call to make, or `rehearse` (every call at toy sizes, on a CPU)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds from the call's start that its steps may take (default: "
                         f"{budget_of('first'):.0f} for first, {budget_of('second'):.0f} for second)")
    ap.add_argument("--redo", nargs="+", default=None, metavar="KEY",
                    help="second: redo these steps of the first call, whole, instead of what its record says")
    ap.add_argument("--check-env", action="store_true",
                    help="only check versions, the GPU, imports, the host kernel (step env)")
    ap.add_argument("--json", default=None, help="with --check-env: write what it found here")
    args = ap.parse_args(argv)
    if args.check_env:
        return check_env(args.json)
    if args.call is None:
        ap.error("name a call: first, second, memory or rehearse")
    keys = [s.key for s in first_call(False, Path("."))]
    if args.redo and (args.call != "second" or set(args.redo) - set(keys)):
        ap.error(f"--redo goes with `second` and names steps of the first call: {', '.join(keys)}")
    out = Path(os.environ.get("OUT") or ROOT / "gpu-results")
    out.mkdir(parents=True, exist_ok=True)
    if args.call == "rehearse":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the CPU path, even on a GPU machine
        # A 2-core CI machine compiles and runs slower than the GPU machine's 16 cores: timeouts 4x, no
        # budget.
        results = {call: run_call(call, out, float("inf"), tiny=True, timeout_scale=4.0)
                   for call in ("first", "second", "memory")}
    else:
        budget = budget_left(args.budget if args.budget is not None else budget_of(args.call))
        results = {args.call: run_call(args.call, out, budget, tiny=False, redo=args.redo)}
    print("\n" + "\n".join(f"{call:<8} {'passed' if ok else 'FAILED'}" for call, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
