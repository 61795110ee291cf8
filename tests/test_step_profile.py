"""benchmarks/step_profile.py: the summary of a profiled step that the GPU session records."""

import time

import pytest
import torch

from tests.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def sp():
    return load_benchmark("step_profile")


def _host(name, ts, dur, cat="user_annotation", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}


def _device(name, ts, dur, correlation, cat="kernel", **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
            "args": {"correlation": correlation, **args}}


def _trace(sp):
    """A 1000 us call: forward [100, 400), backward [400, 900) holding an optimizer range [700, 800)."""
    launch = lambda corr, ts: _host("cudaLaunchKernel", ts, 5, cat="cuda_runtime", correlation=corr)  # noqa: E731
    return [
        {"ph": "M", "name": "process_name", "ts": 0, "pid": 1, "tid": 0, "args": {"name": "python"}},
        _host(sp.CALL_MARK, 0, 1000),
        _host(sp.PHASE_PREFIX + "forward", 100, 300),
        _host(sp.PHASE_PREFIX + "backward", 400, 500),
        _host(sp.PHASE_PREFIX + "optimizer", 700, 100),
        # launched in forward, run late (in backward's window): the launch names the phase
        launch(1, 110), _device("sm90_xmma_gemm_bf16bf16_bf16f32", 380, 60, 1),
        # cuDNN's attention as an H200 named it: wgmma, yet not a GEMM
        launch(2, 150), _device("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7", 150, 40, 2),
        # two streams in backward, overlapping: busy is their union, 120 us
        launch(3, 410), _device("grpo_token_kernel", 420, 100, 3),
        launch(4, 420), _device("triton_poi_fused_add_0", 440, 100, 4),
        # in the optimizer range, inside backward's: the innermost range wins
        launch(5, 710), _device("Memcpy HtoD (Pinned -> Device)", 720, 50, 5, cat="gpu_memcpy", bytes=2_000_000),
        launch(6, 950), _device("Memcpy DtoH (Device -> Pinned)", 950, 20, 6, cat="gpu_memcpy", bytes=1_000_000),
        launch(7, 960), _device("vectorized_elementwise_kernel", 960, 10, 7),
        _host("cudaStreamSynchronize", 970, 25, cat="cuda_runtime"),
        _host("cudaDeviceSynchronize", 996, 2, cat="cuda_runtime"),
        _host("cudaMemcpyAsync", 940, 3, cat="cuda_runtime"),  # not a wait
    ]


def test_phases_hold_the_work_launched_in_them_and_their_idle_time(sp):
    s = sp.summarise(_trace(sp), head_kernels=frozenset({"grpo_token_kernel"}))
    assert s["wall_ms"] == pytest.approx(1.0)
    p = s["phases"]
    assert set(p) == {"forward", "backward", "optimizer", sp.OUTSIDE}
    assert p["forward"]["wall_ms"] == pytest.approx(0.3)
    assert p["forward"]["gpu_busy_ms"] == pytest.approx(0.1)  # 60 + 40 us, though the GEMM ran past forward's end
    assert p["backward"]["wall_ms"] == pytest.approx(0.4)  # 500 us less the optimizer's 100
    assert p["backward"]["gpu_busy_ms"] == pytest.approx(0.12)
    assert p["backward"]["gpu_idle_ms"] == pytest.approx(0.28)
    assert p["optimizer"] == pytest.approx({"wall_ms": 0.1, "gpu_busy_ms": 0.05, "gpu_idle_ms": 0.05})
    assert p[sp.OUTSIDE]["wall_ms"] == pytest.approx(0.2)  # [0, 100) and [900, 1000)
    assert p[sp.OUTSIDE]["gpu_busy_ms"] == pytest.approx(0.02)  # the copy and the kernel overlap
    # all of it at once: [150, 190), [380, 540) (the late GEMM overlaps backward's work), [720, 770), [950, 970)
    assert s["gpu_busy_ms"] == pytest.approx((40 + 160 + 50 + 20) / 1e3)


def test_device_time_by_kind_with_the_copies_bytes_and_rate(sp):
    k = sp.summarise(_trace(sp), head_kernels=frozenset({"grpo_token_kernel"}))["kinds"]
    assert {n: v["count"] for n, v in k.items()} == {
        "GEMM": 1, "attention": 1, "fused loss head": 1, "Inductor-generated": 1, "copy HtoD": 1, "copy DtoH": 1,
        "other kernels": 1}
    assert k["GEMM"]["ms"] == pytest.approx(0.06) and list(k)[0] in ("fused loss head", "Inductor-generated")
    assert k["copy HtoD"]["bytes"] == 2_000_000 and k["copy HtoD"]["GB_per_s"] == pytest.approx(40.0)
    assert k["copy DtoH"]["GB_per_s"] == pytest.approx(50.0)
    assert "bytes" not in k["GEMM"]


def test_the_host_waits_and_the_kernels_with_the_most_time(sp):
    s = sp.summarise(_trace(sp), head_kernels=frozenset())
    assert s["syncs"] == {"cudaStreamSynchronize": {"count": 1, "host_ms": pytest.approx(0.025)},
                          "cudaDeviceSynchronize": {"count": 1, "host_ms": pytest.approx(0.002)}}
    top = s["top_kernels"]
    assert [t["name"] for t in top[:2]] == ["grpo_token_kernel", "triton_poi_fused_add_0"]
    assert len(top) == 5 and all(t["count"] == 1 and t["ms"] == t["longest_ms"] for t in top)
    assert "grpo_token_kernel" in sp.format_summary(s)


def test_host_time_by_phase_is_each_ops_self_time_on_its_thread(sp):
    # forward: linear [100, 200) holds addmm [110, 190), which holds a launch [120, 130); backward: two mm on
    # autograd's own thread, one of them inside an optimizer range; ranges (user annotations) are no ops
    op = lambda name, ts, dur, tid=1: {**_host(name, ts, dur, cat="cpu_op"), "tid": tid}  # noqa: E731
    events = [
        _host(sp.CALL_MARK, 0, 1000),
        _host(sp.PHASE_PREFIX + "forward", 100, 300),
        _host(sp.PHASE_PREFIX + "backward", 400, 500),
        _host(sp.PHASE_PREFIX + "optimizer", 700, 100),
        op("aten::linear", 100, 100), op("aten::addmm", 110, 80),
        _host("cudaLaunchKernel", 120, 10, cat="cuda_runtime", correlation=1), _device("gemm", 130, 40, 1),
        op("aten::mm", 450, 50, tid=2), op("aten::mm", 600, 30, tid=2), op("aten::mm", 710, 20, tid=2),
        op("aten::add_", 460, 10),  # the main thread, while autograd's runs mm: both count
    ]
    h = sp.summarise(events, head_kernels=frozenset())["host"]
    assert h["forward"]["launches"] == 1 and h["forward"]["op_ms"] == pytest.approx(0.1)
    assert {o["name"]: (o["count"], o["self_ms"]) for o in h["forward"]["top_ops"]} == {
        "aten::addmm": (1, pytest.approx(0.07)), "aten::linear": (1, pytest.approx(0.02)),
        "cudaLaunchKernel": (1, pytest.approx(0.01))}
    assert [o["name"] for o in h["forward"]["top_ops"]] == ["aten::addmm", "aten::linear", "cudaLaunchKernel"]
    assert h["backward"]["launches"] == 0 and h["backward"]["op_ms"] == pytest.approx(0.09)
    assert h["backward"]["top_ops"][0] == {"name": "aten::mm", "count": 2, "self_ms": pytest.approx(0.08)}
    assert h["optimizer"]["top_ops"] == [{"name": "aten::mm", "count": 1, "self_ms": pytest.approx(0.02)}]
    assert h[sp.OUTSIDE] == {"launches": 0, "op_ms": 0.0, "top_ops": []}
    text = sp.format_summary(sp.summarise(events, head_kernels=frozenset()))
    assert "forward: 1 device launches, 0.1 ms in host ops; aten::addmm 1x 0.1 ms" in text


def test_the_package_kernels_are_found_in_its_source(sp):
    names = sp.package_triton_kernels()
    assert {"grpo_token_kernel", "grpo_row_kernel", "logits_stats_kernel", "logits_grad_kernel"} <= names


def test_a_profiled_call_on_the_cpu_names_its_phases(sp):
    from lowmem_grpo.phases import phase

    def work():
        with phase("forward"):
            time.sleep(0.02)
        with phase("backward"):
            time.sleep(0.01)
        return 7

    result, s = sp.profile_call(work, torch.device("cpu"))
    assert result == 7 and s["call_s"] >= 0.03
    assert s["phases"]["forward"]["wall_ms"] >= 20 and s["phases"]["backward"]["wall_ms"] >= 10
    assert s["phases"]["forward"]["gpu_busy_ms"] == 0 and s["kinds"] == {}
    assert set(s["host"]) == set(s["phases"]) and s["host"]["forward"]["launches"] == 0
