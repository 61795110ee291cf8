"""Skip markers for tests that need an optional package.

The GPU machine's image has no datasets, no bitsandbytes (unless carried as a wheel) and no
math-verify; the suite must still mean something there (benchmarks/gpu_session.sh runs it), so a test
that needs one of them says so and is skipped, naming the package, instead of failing.
"""

import importlib.util

import pytest


def _needs(module: str, dist: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(importlib.util.find_spec(module) is None, reason=f"needs {dist} (pip install {dist})")


needs_datasets = _needs("datasets", "datasets")
needs_bitsandbytes = _needs("bitsandbytes", "bitsandbytes")
needs_math_verify = _needs("math_verify", "math-verify")
