"""CUDA checks (issue 23d), skipped without a GPU: run them with

    python -m pytest -q -m gpu tests

- every method's loss and gradients through flex (BlockMask) equal the dense SDPA path:
  fp32 tight, bf16 loose;
- --compile (train.py's torch.compile of the model forward) gives the eager loss, and with --cuda_graphs the
  eager loss and gradients;
- generation from a Memory equals generation with the memory spelled out, on the dense and flex paths;
- generation with CUDA graphs (captured prefill and decode steps) equals eager generation;
- a 1-process torchrun training run over NCCL; --resume restores the device's generator (LoRA dropout);
- SDPA's GQA calls take the memory-efficient kernel where flash cannot (masked; fp32).
Shapes are tiny (bench.py's "tiny" shape, bench.build_row's batches, >= 128 queries so
the flex path is the one a compiled run takes).
"""
import json

import pytest
import torch

import bench
import data
import kernels
import train
from common import torchrun
from model import Memory, compile_layers

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::FutureWarning")]
CUDA = torch.device("cuda")
TOL = {torch.float32: dict(rtol=1e-3, atol=1e-4), torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own graphs, as one run does (no recompile limit across tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def tok():
    return data.load_tokenizer(bench.TINY_BASE)


def loss_and_grads(tok, row, dtype, backend):
    _, method, objective, ratio = row
    kernels.BACKEND = backend
    try:
        base = bench.random_model("tiny", tok, CUDA, dtype)
        m, batch, _ = bench.build_row(base, tok, method, objective, ratio, 2, 192)
        torch.manual_seed(0)  # ata's LoRA dropout: the same masks on both paths
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, n, _ = m(batch, train.ratios_of(ratio))
        (loss / max(float(n), 1.0)).backward()
        return loss.float() / max(float(n), 1.0), {k: p.grad.float() for k, p in m.named_parameters() if p.grad is not None}
    finally:
        kernels.BACKEND = None


METHOD_ROWS = [r for r in bench.ROWS if not r[0].endswith("per ratio")]  # those rows time another path, same math


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("row", METHOD_ROWS, ids=[r[0].replace(" ", "-") for r in METHOD_ROWS])
def test_flex_equals_dense_loss_and_grads(tok, row, dtype):
    loss_d, grads_d = loss_and_grads(tok, row, dtype, "dense")
    loss_f, grads_f = loss_and_grads(tok, row, dtype, "flex")
    torch.testing.assert_close(loss_f, loss_d, **TOL[dtype])
    assert grads_f.keys() == grads_d.keys() and grads_d
    for k in grads_d:
        scale = grads_d[k].abs().max().clamp(min=1e-6)  # relative to the tensor's largest entry
        torch.testing.assert_close(grads_f[k] / scale, grads_d[k] / scale, **TOL[dtype], msg=k)


def test_dense_attention_takes_the_memory_efficient_kernel():
    """An eager run's masked attention (SmolLM2-135M's heads: 9 over 3 K/V heads, hd 64), bf16, forward and
    backward, with SDPA held to its memory-efficient kernel: it raises where that kernel cannot take the call,
    and the math kernel would hold B x H x Q x S fp32 scores per layer. Odd lengths, a prefix mask with padding
    (keys and a query row that sees none)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, H, Hkv, Q, S, hd = 4, 9, 3, 301, 333, 64
    q = torch.randn(B, H, Q, hd, device=CUDA, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, Hkv, S, hd, device=CUDA, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    lengths = torch.tensor([S, S - 40, S - 100, 0], device=CUDA)  # keys each example has; the last: none

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < lengths[b]) & (kv_idx <= q_idx + S - Q)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = kernels.attention(q, k, v, kernels.Mask(mask_mod, B, Q, S, CUDA))
        out.float().square().sum().backward()
    assert torch.isfinite(out).all() and out[3].abs().max() == 0
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_resume_on_cuda_draws_the_dropout_masks_of_an_uncut_run(base_dir, tmp_path, monkeypatch):
    """--resume restores the CUDA generator too: ata's LoRA dropout (Table 4: 0.2) draws on the device, so a run cut
    after step 4 and resumed starts step 5 from the generator state of the run that was not cut."""
    states, real_step, real_call = [], train.train_step, train.Batches.__call__

    def recording_step(*a, **k):  # the device generator as each step starts
        states.append(torch.cuda.get_rng_state())
        return real_step(*a, **k)
    monkeypatch.setattr(train, "train_step", recording_step)

    def run(out, *more):
        train.main(["--method", "ata", "--objective", "qa", "--init_from", str(base_dir), "--lora_dropout", "0.2",
                    "--device", "cuda", "--max_iters", "8", "--eval_interval", "4", "--eval_examples", "0",
                    "--batch_size", "4", "--quiet", "--out_dir", str(out), *more])
    run(tmp_path / "full")
    full = states[:]

    def stop_at_4(self, step):  # Ctrl-C during step 4: the loop saves after it and exits
        if step == 3:
            train.STOP.append(1)
        return real_call(self, step)
    monkeypatch.setattr(train.Batches, "__call__", stop_at_4)
    run(tmp_path / "cut")
    monkeypatch.setattr(train.Batches, "__call__", real_call)
    del states[:]
    run(tmp_path / "cut", "--resume")
    assert len(full) == 8 and len(states) == 4 and not torch.equal(full[4], full[0])  # dropout drew on the device
    assert all(torch.equal(a, b) for a, b in zip(states, full[4:]))


def test_fp32_causal_attention_takes_the_memory_efficient_kernel():
    """eval.py's fp32 passes without a mask (the teacher's full context) on SmolLM2's GQA heads: flash takes no fp32,
    so K/V go repeated to the memory-efficient kernel (it raises where it cannot), not to math's fp32 scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, H, Hkv, L, hd = 2, 9, 3, 257, 64
    q = torch.randn(B, H, L, hd, device=CUDA)
    k, v = (torch.randn(B, Hkv, L, hd, device=CUDA) for _ in range(2))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        out = kernels.attention(q, k, v)
    with sdpa_kernel([SDPBackend.MATH]):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("row", [bench.ROWS[0], bench.ROWS[2]], ids=["meanpool-kd", "pic-qa"])
def test_compile_loss_equals_eager(tok, row):
    _, method, objective, ratio = row
    losses = []
    for compiled in (False, True):
        base = bench.random_model("tiny", tok, CUDA, torch.float32)
        m, batch, _ = bench.build_row(base, tok, method, objective, ratio, 2, 192)
        if compiled:
            compile_layers(base)  # as train.py --compile
        loss, n, _ = m(batch, train.ratios_of(ratio))
        losses.append(loss.item() / n)
    assert abs(losses[1] - losses[0]) <= 1e-3 * abs(losses[0]), losses


@pytest.mark.parametrize("row", [bench.ROWS[0], bench.ROWS[2]], ids=["meanpool-kd", "pic-qa"])
def test_cuda_graph_step_equals_eager(tok, row):
    """--compile --cuda_graphs: the loss and every gradient of the eager step (bf16 autocast), on a replay."""
    _, method, objective, ratio = row
    runs = []
    for graphs in (False, True):
        torch.manual_seed(0)
        base = bench.random_model("tiny", tok, CUDA, torch.float32)
        m, batch, _ = bench.build_row(base, tok, method, objective, ratio, 2, 192)
        if graphs:
            compile_layers(base, cuda_graphs=True)  # as train.py --compile --cuda_graphs
        for _ in range(3):  # the first records, the next replay
            torch.compiler.cudagraph_mark_step_begin()
            m.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss, n, _ = m(batch, train.ratios_of(ratio))
            (loss / n).backward()
        runs.append((loss.item() / n, {k: p.grad.float().clone() for k, p in m.named_parameters() if p.grad is not None}))
    (eager, grads_e), (graphed, grads_g) = runs
    assert abs(graphed - eager) <= 2e-2 * abs(eager), (eager, graphed)
    assert grads_g.keys() == grads_e.keys() and grads_e
    for k in grads_e:
        scale = grads_e[k].abs().max().clamp(min=1e-6)
        torch.testing.assert_close(grads_g[k] / scale, grads_e[k] / scale, **TOL[torch.bfloat16], msg=k)


@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_generate_from_memory_equals_spelled_out(tok, backend, monkeypatch):
    """K/V and embedding memories of a 200-token context, 140-token prompts: the dense prefill (eager runs and
    eval) and the flex one (compiled layers)."""
    monkeypatch.setattr(kernels, "BACKEND", backend)
    model = bench.random_model("tiny", tok, CUDA, torch.float32)
    ids = torch.randint(10, tok.vocab_size, (2, 340), generator=torch.Generator().manual_seed(0)).to(CUDA)
    a, b = ids[:, :200], ids[:, 200:]
    ref = model.generate(ids, 8, eos_ids=[])
    with torch.no_grad():
        _, kv = model(a, return_kv=True)
        e = model.model.embed_tokens(a)
    assert model.generate(b, 8, memory=Memory(kv=kv), eos_ids=[]) == ref
    assert model.generate(b, 8, memory=Memory(embeds=e), eos_ids=[]) == ref


def test_generate_cuda_graphs_equals_eager(tok):
    """Captured prefill and decode give the eager tokens: plain, left-padded, from K/V and embedding memories
    (140-token prompts), twice (the second call replays the captured prefill)."""
    model = bench.random_model("tiny", tok, CUDA, torch.float32)
    ids = torch.randint(10, tok.vocab_size, (2, 340), generator=torch.Generator().manual_seed(1)).to(CUDA)
    with torch.no_grad():
        _, kv = model(ids[:, :200], return_kv=True)
        e = model.model.embed_tokens(ids[:, :200])
    cases = [(ids, None), ([ids[0, 5:].tolist(), ids[1].tolist()], None),
             (ids[:, 200:], Memory(kv=kv)), (ids[:, 200:], Memory(embeds=e))]
    for prompts, memory in cases:
        ref = model.generate(prompts, 8, memory=memory, eos_ids=[])
        for _ in range(2):
            assert model.generate(prompts, 8, memory=memory, eos_ids=[], cuda_graphs=True) == ref
    (prefill,) = model.prefill_graphs.values()  # one set of adapters, one mode, one backend
    assert len(prefill.graphs) == len(cases)


def test_torchrun_one_process_nccl(base_dir, tmp_path):
    out = tmp_path / "run"
    p = torchrun(["--method", "meanpool", "--init_from", base_dir, "--max_iters", 2, "--batch_size", 2,
                  "--eval_examples", 0, "--out_dir", out, "--quiet"], nproc=1)
    assert (out / "run.json").exists(), p.stdout[-2000:]
