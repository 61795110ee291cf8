"""The GPU session driver (benchmarks/gpu_session.py): its two device calls fit their time, the driver
starts no step whose timeout does not fit what is left, stops a step past its timeout with everything it
started, names the test a stopped test step was running, and the second call takes up what the first did
not finish; the test step selects every area it is meant to on a GPU machine; the rehearsal of both calls
at toy sizes passes."""

import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.benchmark_scripts import load_benchmark
from tests.cuda_names import cuda_parameters

ROOT = Path(__file__).resolve().parents[1]
FIRST = ["env", "cuda-tests", "kernel-tests", "trainer-1.5b", "learn-char-e"]
SECOND = ["other-cuda-tests", "trainer-1.5b-microbatch-8", "trainer-1.5b-per-microbatch", "trainer-qwen3-1.7b",
          "trainer-llama-3.2-1b", "trainer-gemma-3-1b", "trainer-3b", "trainer-1.5b-compiled-layers",
          "trainer-8b-24gb", "trainer-7b-24gb", "trainer-7b-8gb", "decode", "head-speed", "trainer-1.5b-4096",
          "trainer-0.5b-gsm8k", "head-memory"]  # in order of importance


def _gpu_session():
    return load_benchmark("gpu_session")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _steps(records: list[dict]) -> dict:
    return {r["key"]: r for r in records if r.get("event") == "step"}


# ----- time -------------------------------------------------------------------------------------------
def test_the_calls_fit_nine_and_six_minutes_with_a_margin_for_start_up(tmp_path):
    # 15 device minutes: on an H200 the machine started in about 30 s and the first call's steps took 318 s
    # (benchmarks/RESULTS.md, "Third GPU run"), which leaves the second call its 6 minutes and a margin
    gs = _gpu_session()
    assert gs.CALL_SECONDS["first"] <= 9 * 60 and gs.CALL_SECONDS["second"] <= 6 * 60
    assert gs.MARGIN_S >= 20  # Python's start and the last lines (the wheels' install is in the budget)
    first = gs.first_call(False, tmp_path)
    assert [s.key for s in first] == FIRST
    assert sum(s.timeout_s for s in first) <= gs.budget_of("first") == gs.CALL_SECONDS["first"] - gs.MARGIN_S
    # the second call's own steps, in order of importance: each can start in it, as time allows
    second = gs.second_call(False, tmp_path)
    assert [s.key for s in second] == SECOND
    assert gs.budget_of("second") == gs.CALL_SECONDS["second"] - gs.MARGIN_S
    assert all(s.timeout_s <= gs.budget_of("second") for s in second)
    assert sum(s.timeout_s for s in gs.memory_call(False)) <= gs.budget_of("memory")


def test_the_budget_counts_from_the_calls_start_before_the_driver():
    gs = _gpu_session()
    assert gs.budget_left(510, {"GPU_SESSION_STARTED": "1000.0"}, now=1012.5) == 497.5  # 12.5 s of wheels
    assert gs.budget_left(510, {}, now=1012.5) == 510


def _python_step(gs, key: str, code: str, timeout_s: float):
    return gs.Step(key, key, [sys.executable, "-c", code], timeout_s, json_out=False)


def test_a_step_starts_only_if_its_whole_timeout_fits_what_is_left(tmp_path):
    gs = _gpu_session()
    now = iter([0.0, 0.0, 50.0, 55.0])  # the call's start, then before each step (a fake clock)
    steps = [_python_step(gs, "a", "print('a ran')", 30),  # 60 s left: starts
             _python_step(gs, "b", "print('b ran')", 20),  # 10 s left: would need 20, not started
             _python_step(gs, "c", "print('c ran')", 5)]  # 5 s left: fits exactly, starts
    passed = gs.run_steps("first", steps, tmp_path, 60, state=tmp_path / "state", clock=lambda: next(now))
    assert not passed  # a step not started is not a pass
    steps = _steps(_records(tmp_path / "first.jsonl"))
    assert steps["a"]["status"] == "ok" and steps["c"]["status"] == "ok"
    assert steps["b"]["status"] == "not started: needs 20 s, 10 s left"
    log = (tmp_path / "first.log").read_text()
    assert "a ran" in log and "c ran" in log and "b ran" not in log
    assert _records(tmp_path / "state" / "first.jsonl") == _records(tmp_path / "first.jsonl")


def test_a_step_past_its_timeout_is_stopped_with_the_processes_it_started(tmp_path):
    gs = _gpu_session()
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
            "print('waiting', flush=True); time.sleep(60)\n")
    t0 = time.monotonic()
    assert not gs.run_steps("first", [_python_step(gs, "hangs", code, 3)], tmp_path, 60, state=tmp_path / "s")
    assert time.monotonic() - t0 < 3 + gs.KILL_GRACE_S + 5
    (record,) = _steps(_records(tmp_path / "first.jsonl")).values()
    assert record["status"] == "timed out after 3 s"
    child = int(pid_file.read_text())
    for _ in range(50):  # the child is killed with its group (a zombie until init reaps it, at most)
        try:
            os.kill(child, 0)
            if Path(f"/proc/{child}/stat").read_text().split(")")[-1].split()[0] == "Z":
                break
        except (ProcessLookupError, FileNotFoundError):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the step's child {child} outlived the step")


TESTS = """
import time
def test_quick():
    pass
def test_hangs():
    time.sleep(60)
def test_after():
    pass
"""


def test_a_stopped_test_step_names_its_running_test_and_the_second_call_redoes_the_tests_left(tmp_path):
    gs = _gpu_session()
    test_file = tmp_path / "test_three.py"
    test_file.write_text(TESTS)
    selection = [str(test_file)]
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "gpu_session_pytest", "-v",
            *selection]
    step = gs.Step("cuda-tests", "three tests", argv, 20, json_out=False, selection=selection)
    state = tmp_path / "state"
    assert not gs.run_steps("first", [step], tmp_path, 60, state=state, timeout_scale=0.3)  # 6 s
    records = _records(tmp_path / "first.jsonl")
    (record,) = _steps(records).values()
    assert record["status"] == "timed out after 6 s"
    (collected,) = [r["tests"] for r in records if r.get("event") == "collected"]  # node ids, pytest's
    quick, hangs, after = collected
    assert record["running_when_stopped"] == hangs and hangs.endswith("test_three.py::test_hangs")
    assert [(r["test"], r["outcome"]) for r in records if r.get("event") == "end"] == [(quick, "passed")]
    # the second call, on the same machine: the step again, with only the tests that did not end
    (again,) = gs.unfinished([step], gs.read_state("first", state))
    assert again.selection == [hangs, after] and again.argv == step.argv[:-1] + [hangs, after]


def test_the_second_call_takes_up_what_the_first_did_not_finish(tmp_path):
    gs = _gpu_session()
    first = gs.first_call(False, tmp_path)
    state = tmp_path / "state"
    own = [s.key for s in gs.second_call(False, tmp_path)]
    # no record of the first call on this machine (a fresh one): its own steps only
    assert [s.key for s in gs.second_steps(False, tmp_path, state)] == own
    # named instead: those, whole
    assert [s.key for s in gs.second_steps(False, tmp_path, state, redo=["trainer-1.5b"])] == ["trainer-1.5b",
                                                                                                 *own]
    state.mkdir()
    lines = [{"event": "call", "call": "first"},
             {"event": "step", "key": "env", "status": "ok"},
             {"event": "step", "key": "cuda-tests", "status": "ok"},
             {"event": "collected", "step": "kernel-tests", "tests": ["t::a", "t::b"]},
             {"event": "end", "step": "kernel-tests", "test": "t::a", "outcome": "failed"},
             {"event": "step", "key": "kernel-tests", "status": "timed out after 160 s"},
             {"event": "step", "key": "trainer-1.5b", "status": "failed (exit 1)"},  # a result: not again
             {"event": "step", "key": "learn-char-e", "status": "not started: needs 60 s, 3 s left"}]
    (state / "first.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    steps = gs.second_steps(False, tmp_path, state)
    assert [s.key for s in steps] == ["kernel-tests", "learn-char-e", *own]
    tests = steps[0]
    assert tests.selection == ["t::b"] and tests.argv[-1] == "t::b"
    assert any(a.endswith("second-kernels-junit.xml") for a in tests.argv)
    assert not any("first-" in a for s in steps for a in s.argv)
    assert steps[1].argv == first[4].argv
    assert any(a.endswith("second-junit.xml") for a in gs.second_steps(False, tmp_path, state,
                                                                       redo=["cuda-tests"])[0].argv)


def test_a_decode_step_stopped_at_its_timeout_comes_back_with_the_shapes_it_did_not_measure(tmp_path):
    gs = _gpu_session()
    shapes = ["Qwen2.5-0.5B:recipes/qwen2.5-0.5b_gsm8k_8gb.yaml", "Qwen2.5-1.5B:recipes/qwen2.5-1.5b_gsm8k_8gb.yaml"]
    step = gs._decode_step(shapes, False, 140)
    records = [{"event": "step", "key": "decode", "status": "timed out after 140 s",  # the 0.5B measured
                "result": {"shapes": [{"arch": "Qwen2.5-0.5B"}]}}]
    (again,) = gs.unfinished([step], records)
    assert again.shapes == shapes[1:]
    assert again.argv == step.argv[:2] + ["--shape", shapes[1], "--device", "cuda"]
    records[0]["result"]["shapes"].append({"arch": "Qwen2.5-1.5B"})  # both measured: nothing again
    assert gs.unfinished([step], records) == []


# ----- the environment ----------------------------------------------------------------------------------
@pytest.mark.parametrize("cause", ["switched off", "build fails"])
def test_the_env_step_fails_loudly_where_the_host_kernel_falls_back(monkeypatch, cause):
    gs = _gpu_session()
    from lowmem_grpo.optim import host_adamw
    monkeypatch.setattr(host_adamw, "_library", None)  # untried, as in a fresh process
    monkeypatch.setattr(host_adamw, "_load_error", None)
    if cause == "switched off":
        monkeypatch.setenv("LOWMEM_GRPO_HOST_KERNEL", "0")
        reason = "LOWMEM_GRPO_HOST_KERNEL=0"
    else:
        monkeypatch.delenv("LOWMEM_GRPO_HOST_KERNEL", raising=False)

        def no_compiler(march):
            raise RuntimeError("Error building extension: g++: not found")
        monkeypatch.setattr(host_adamw, "_build", no_compiler)
        reason = "g\\+\\+: not found"
    with pytest.raises(host_adamw.HostKernelUnavailable, match=f"FALLBACK .*{reason}"):
        gs.host_kernel_check()


def test_the_env_step_records_the_native_host_kernel(monkeypatch):
    gs = _gpu_session()
    from lowmem_grpo.optim import host_adamw

    class Library:
        _name = "/cache/lowmem_grpo_host_adamw_0123.so"

        def simd_lanes(self):
            return 16
    monkeypatch.setattr(host_adamw, "_library", None)
    monkeypatch.setattr(host_adamw, "_load_error", None)
    monkeypatch.delenv("LOWMEM_GRPO_HOST_KERNEL", raising=False)
    monkeypatch.setattr(host_adamw, "_build", lambda march: Library())
    assert gs.host_kernel_check()["host_adamw_kernel"] == Library._name


# ----- what the test step selects ------------------------------------------------------------------------
def _collect(args: list[str]) -> set[str]:
    """The test ids these pytest arguments select on a GPU machine (collection only, CUDA faked)."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.fake_cuda_plugin", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_the_test_step_selects_every_area_it_is_for_on_a_gpu_machine(tmp_path):
    gs = _gpu_session()
    (step,) = [s for s in gs.first_call(False, tmp_path) if s.key == "cuda-tests"]
    assert step.argv[-len(step.selection):] == step.selection
    assert {"-v", "-rfEs", "--timeout", "gpu_session_pytest"} <= set(step.argv)
    selected = _collect(["-m", "cuda", *step.selection])
    areas = {"offloaded optimizer": "test_offload_cuda.py::test_offloaded_on_cuda",
             "its tied-head split": "test_offload_cuda.py::test_cuda_tied_head_split",
             "the update thread": "test_offload_update_thread.py::test_cuda",
             "activation offload": "test_activation_offload.py::test_offload_on_cuda_copies_into_one",
             "host arena": "test_host_arena_cuda.py::",
             "streamed reference": "test_reference.py::test_streamed_reference_on_cuda",
             "graphed decode step": "test_decode_graphs.py::test_graphed_step_matches_eager_on_cuda",
             "memory profiler": "test_profile.py::test_cuda_profile",
             "kernels at Qwen sizes": "test_cuda_large.py::test_linear_grpo_loss_at_qwen_sizes"}
    for area, part in areas.items():
        assert any(part in t for t in selected), f"the test step runs no test of the {area} ({part})"


def test_the_kernel_step_runs_every_op_test_on_cuda_tensors_with_torch_and_triton(tmp_path):
    gs = _gpu_session()
    (step,) = [s for s in gs.first_call(False, tmp_path) if s.key == "kernel-tests"]
    assert step.argv[-len(step.selection):] == step.selection
    assert {"-v", "-rfEs", "--timeout", "gpu_session_pytest"} <= set(step.argv)
    selected = [t["test"] for t in _collected_on_a_gpu_machine()  # what `-m cuda` selects of its files
                if t["cuda_marked"] and t["test"].split("::")[0] in step.selection]
    areas = {"loss variants at real vocabularies": "test_linear_loss.py::test_variants_at_real_vocabulary_sizes",
             "the per-token loss": "test_grpo_loss.py::test_matches_spec",
             "the Triton copy of the formula": "test_one_formula.py::test_triton_copy_matches_torch_copy",
             "log-probabilities": "test_logprobs.py::test_real_vocab_sizes",
             "the fused linear head": "test_linear.py::test_real_vocab_sizes"}
    for area, part in areas.items():
        for path in ("cuda-torch", "cuda-triton"):
            if area == "the Triton copy of the formula":
                path = "cuda"  # (its own parameter: one Triton path)
            assert any(part in t and path in t for t in selected), f"the kernel step runs no {path} test of " \
                f"{area} ({part})"
    assert not any("[cpu" in t or "-cpu" in t for t in selected)  # (the CPU cases run on every CI machine)


@functools.cache
def _collected_on_a_gpu_machine() -> tuple[dict, ...]:
    """Every test of the suite, slow ones too, as a GPU machine collects it (CUDA faked): for each, its node
    id, whether it is marked `cuda` and what in its parameters names a CUDA device (fake_cuda_plugin)."""
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "collected.json"
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
               "-p", "tests.fake_cuda_plugin", "-m", "", "tests"]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "FAKE_CUDA_COLLECTED": str(dump)})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return tuple(json.loads(dump.read_text()))


def test_cuda_is_named_by_a_cuda_device_in_a_parameter_or_its_id():
    import torch
    assert cuda_parameters({"device": ("cuda", "triton")}, ["cuda-triton"]) == ["device=('cuda', 'triton')",
                                                                              "id cuda-triton"]
    assert cuda_parameters({"dev": torch.device("cuda", 0), "d": {"x": "cuda:1"}}, ["dev0", "d0"]) == [
        "dev=device(type='cuda', index=0)", "d={'x': 'cuda:1'}"]
    assert cuda_parameters({"on": True}, ["bf16_cuda"]) == ["id bf16_cuda"]
    # a test's name, a path through a folder named after CUDA, a CPU device: none names one
    assert cuda_parameters({"device": torch.device("cpu"), "recipe": "/w/wt-cuda-markers/r.yaml",
                            "what": "cudagraphs"}, ["cpu-triton", "/w/wt-cuda-markers/r.yaml", "cudagraphs"]) == []


def test_every_test_whose_parameters_name_a_cuda_device_is_marked_cuda():
    """The GPU session runs `-m cuda`: a case on a CUDA device without the marker never runs on a GPU (and
    would not be skipped on a machine without one)."""
    collected = _collected_on_a_gpu_machine()
    on_cuda = [t for t in collected if t["names_cuda"]]
    assert any(t["test"].endswith("[cuda-triton]") for t in on_cuda)  # the kernels' device fixture
    unmarked = [f"{t['test']} ({', '.join(t['names_cuda'])})" for t in on_cuda if not t["cuda_marked"]]
    assert not unmarked, f"{len(unmarked)} of {len(on_cuda)} test cases on a CUDA device are not marked " \
        "cuda (pytest.param(..., marks=pytest.mark.cuda)):\n" + "\n".join(unmarked[:30])


def test_the_test_steps_run_every_file_of_cuda_tests():
    """A file of cuda tests left out of the test steps' lists would never run on a GPU (the calls run no
    other), and one listed twice would run twice."""
    gs = _gpu_session()
    marked = {t["test"].split("::")[0] for t in _collected_on_a_gpu_machine() if t["cuda_marked"]}
    lists = gs.CUDA_TEST_FILES + gs.KERNEL_TEST_FILES + gs.OTHER_CUDA_TEST_FILES
    assert marked <= set(lists), sorted(marked - set(lists))
    assert len(lists) == len(set(lists))


def test_the_decode_step_compares_graphed_tokens_with_eagers_row_by_row():
    import torch
    ds = load_benchmark("decode_speed")
    eager = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    graphed = torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4], [0, 6, 7, 8]])  # equal; differs from 1; from 0
    assert ds.first_differences(graphed, eager) == [4, 1, 0]
    assert ds.compare(graphed, eager) == {"rows_equal": 1 / 3, "first_difference_min": 0,
                                          "first_difference_median": 1}


# ----- the rehearsal ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_rehearsal_of_both_calls_at_toy_sizes(tmp_path):
    # CI runs this through `make gpu-rehearsal`, in an environment made like the GPU image's
    pytest.importorskip("pytest_timeout", reason="the GPU image's pytest-timeout (make gpu-image has it)")
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GPU_SESSION_STATE": str(tmp_path / "state"),
           "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "benchmarks/gpu_session.sh", "rehearse"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    for call, keys in (("first", FIRST), ("second", SECOND)):
        steps = _steps(_records(tmp_path / "out" / f"{call}.jsonl"))
        assert list(steps) == keys and all(s["status"] == "ok" for s in steps.values())
    assert (tmp_path / "out" / "first-junit.xml").is_file()


def test_a_triton_specialization_is_keyed_as_tritons_jit_keys_its_compiled_kernels():
    """benchmarks/triton_specializations.py, which counts the kernel-tests step's compiles: a new int value
    compiles again only if it is 1 or changes its divisibility by 16, a new constexpr value always; a new
    dtype also builds a new launcher."""
    import torch
    import triton.language as tl
    ts = load_benchmark("triton_specializations")

    def kernel(x_ptr, n, scale, BLOCK: tl.constexpr):
        pass
    names = ["x_ptr", "n", "scale", "BLOCK"]
    x = torch.zeros(64)

    def key(tensor=x, n=3, block=128, warps=4):
        return ts.specialization(kernel, names, (tensor, n, 0.5), {"BLOCK": block, "num_warps": warps})
    assert key(n=3) == key(n=5) != key(n=16) == key(n=32)
    assert key(n=1) != key(n=3) and key(n=2**31) != key(n=5)
    assert key(block=64) != key() and ts.launcher(key(block=64)) == ts.launcher(key())
    assert key(warps=8) != key() and key(tensor=x[1:]) != key()  # (4 bytes in: not 16-aligned)
    assert ts.launcher(key(tensor=x.double())) != ts.launcher(key())
    assert ts.launcher(key(n=1)) != ts.launcher(key())  # 1 is a constant: not an argument of the launcher
