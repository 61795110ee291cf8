"""benchmarks/compare_heads.py --quick: every path has a row, and ours is as close to fp64 as the naive head.

TRL and Liger come from the `bench` extra; without them (CI) their rows must say "not installed", and
with them their rows must have run."""

import importlib.util

import pytest

from tests.benchmark_scripts import load_benchmark



def _compare_heads():
    return load_benchmark("compare_heads")


@pytest.fixture(scope="module")
def quick_rows():
    return _compare_heads().main(["--quick"])


def test_every_path_has_a_row_per_setting(quick_rows):
    settings = {(r.setting.dtype, r.setting.loss_type, r.setting.beta) for r in quick_rows}
    assert {d for d, _, _ in settings} == {"float32", "bfloat16"}
    for setting in settings:
        paths = [r.path for r in quick_rows if (r.setting.dtype, r.setting.loss_type, r.setting.beta) == setting]
        assert paths == ["naive", "trl", "liger", "ours"]


@pytest.mark.parametrize("path, module", [("trl", "trl"), ("liger", "liger_kernel")])
def test_missing_packages_are_reported_not_dropped(quick_rows, path, module):
    installed = importlib.util.find_spec(module) is not None
    for row in (r for r in quick_rows if r.path == path):
        if installed:
            assert row.status.startswith(("ok", "compiled=False")) and row.seconds, row.status
        else:
            assert row.status.startswith("not installed") and row.peak_bytes is None


def test_ours_is_as_close_to_fp64_as_the_naive_head(quick_rows):
    """The tolerance rule (DESIGN.md): ours in dtype D within (a small factor of) the plain head in D."""
    for naive, ours in ((n, o) for n in quick_rows for o in quick_rows
                        if n.path == "naive" and o.path == "ours" and n.setting == o.setting):
        assert naive.status == ours.status == "ok"
        floor = 2e-5 if ours.setting.dtype == "float32" else 0.0
        for name in ("loss_rel_err", "dh_rel_err", "dw_rel_err"):
            assert getattr(ours, name) <= 2.0 * getattr(naive, name) + floor, (ours.setting, name)
        assert ours.peak_bytes > 0 and ours.median_s > 0
