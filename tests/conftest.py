import os
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench, hf_twins
AT_START = pytest.StashKey[dict]()
ASSETS = Path(os.environ.get("NANOCOMPRESS_ASSETS", ROOT.parent / "shared" / "assets"))


def torch_globals():
    """The process-wide torch settings a test could leave changed for the next one: threads,
    numerics flags, and dynamo's and inductor's config (each once imported)."""
    import torch
    state = {"threads": torch.get_num_threads(), "interop threads": torch.get_num_interop_threads(),
             "default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
             "deterministic": torch.are_deterministic_algorithms_enabled(),
             "matmul precision": torch.get_float32_matmul_precision(),
             "cuda tf32": torch.backends.cuda.matmul.allow_tf32, "cudnn tf32": torch.backends.cudnn.allow_tf32}
    for name in ("torch._dynamo.config", "torch._inductor.config"):
        if config := sys.modules.get(name):  # a key pytest's monkeypatch undo deleted reads as hidden
            with warnings.catch_warnings():  # reading a deprecated key warns
                warnings.simplefilter("ignore")
                state[name] = {key: getattr(config, key, "<hidden>") for key in config.get_config_copy()}
    return state


def changed(before, after):
    """Names of the settings (config keys by name) that differ between two torch_globals()."""
    out = []
    for name in before.keys() & after.keys():
        if isinstance(before[name], dict):
            keys = before[name].keys() | after[name].keys()
            out += [f"{name}.{k}" for k in sorted(keys) if before[name].get(k, "unset") != after[name].get(k, "unset")]
        elif before[name] != after[name]:
            out.append(name)
    return out


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (skipped without it)")
    config.addinivalue_line("markers", "slow: slower end-to-end test (still runs in CI)")
    config.stash[AT_START] = torch_globals()


def pytest_collection_finish(session):
    """Importing a test module must not change torch's settings (the tests see them at start)."""
    if diff := changed(session.config.stash[AT_START], torch_globals()):
        raise pytest.UsageError(f"collecting the tests changed torch's global state: {', '.join(diff)}")


@pytest.fixture(autouse=True)
def torch_state_kept(request):
    """Every test leaves torch's global state as it found it (issue 75: a monkeypatched dynamo
    config key, deleted by the undo, broke every later compiled test in that worker)."""
    before = torch_globals()
    yield
    if diff := changed(before, torch_globals()):
        pytest.fail(f"{request.node.nodeid} left torch's global state changed: {', '.join(diff)}", pytrace=False)


def pytest_collection_modifyitems(config, items):
    """The `slow` tests first (a stable sort): with `-n 2 --dist loadgroup` each worker takes the next test as
    it finishes one, so the few long end-to-end tests start at once on both cores instead of one of them
    ending the run alone. Without CUDA, the `gpu` tests are skipped."""
    items.sort(key=lambda item: "slow" not in item.keywords)
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
