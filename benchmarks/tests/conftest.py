"""The benchmarks' smoke tests run on the product's fixtures. tests/ goes on sys.path, so a module's
`pytest_plugins = ["serve_fixtures"]` and `from gateway_fixtures import ...` resolve as they do in tests/;
tests/conftest.py (the tiny and real models, the harness) loads under a name of its own, since this module is
the one pytest calls conftest here, and its fixtures are taken in as if written here. The repository root
goes on sys.path for `benchmarks`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_CONFTEST = "kev_tests_conftest"

for path in (ROOT, ROOT / "tests"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))


def _product_conftest():
    if PRODUCT_CONFTEST not in sys.modules:
        spec = importlib.util.spec_from_file_location(PRODUCT_CONFTEST, ROOT / "tests" / "conftest.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[PRODUCT_CONFTEST] = module
        spec.loader.exec_module(module)
    return sys.modules[PRODUCT_CONFTEST]


globals().update({name: value for name, value in vars(_product_conftest()).items()
                  if not name.startswith("_") and name not in globals()})
