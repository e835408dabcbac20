import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ASSETS = Path(os.environ.get("NANOCOMPRESS_ASSETS", ROOT.parent / "shared" / "assets"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it)")
    config.addinivalue_line("markers", "slow: slower end-to-end test (still runs in CI)")


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
