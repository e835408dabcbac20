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


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine
    OpenMP spin-waiting makes them 10x slower; restored after each module."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A random tiny base in out/base's layout (tests/common.tiny_base), one per module."""
    from common import tiny_base
    return tiny_base(tmp_path_factory.mktemp("base") / "base")
