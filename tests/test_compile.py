"""Compiled flex attention (issue 23a): lengths bucketed to kernels.BLOCK compile one graph
per bucket, whatever the prefix lengths; the compiled forward on CPU equals dense SDPA."""
import pytest
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import bench
import kernels
import pic
import train

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def compiled_flex(monkeypatch):
    """Install a compiled flex as kernels does on CUDA; returns a function that installs it
    with a given backend. Dynamo state is reset before and after. Torch's config is never
    monkeypatched (pytest's undo deletes a config key it did not see in __dict__): kernels.compiled
    raises the recompile limit inside its own calls, and conftest checks nothing leaks."""
    torch._dynamo.reset()
    counters.clear()
    monkeypatch.setattr(kernels, "BACKEND", "flex")

    def install(backend):
        monkeypatch.setattr(kernels, "_compiled_flex", kernels.compiled(flex_attention, backend))
    yield install
    torch._dynamo.reset()


def test_recompiles_bounded_by_buckets(compiled_flex):
    """A decoder over K/V memory (sac, ata: C = 1..8 slots, T tokens): twelve distinct
    (C, T) pairs in two length buckets compile two graphs, not twelve (before the fix:
    one per distinct C, then the recompile limit and eager flex). The backend is dynamo's
    "eager": guards and recompiles are dynamo's, whatever the backend."""
    compiled_flex("eager")
    B, H, Hkv, hd = 2, 4, 2, 8
    shapes = [(C, T) for C in (1, 2, 3, 5, 8, 7) for T in (130, 200)]  # bucket(C + T): 256; bucket(T): 256
    shapes += [(C, T) for C in (4, 6) for T in (300, 320)]  # bucket(C + T) 384, bucket(T) 384
    buckets = {(kernels.bucket(T), kernels.bucket(C + T)) for C, T in shapes}
    for i, (C, T) in enumerate(shapes):
        q, k, v = rand(B, H, T, hd, seed=i), rand(B, Hkv, C + T, hd, seed=i + 1), rand(B, Hkv, C + T, hd, seed=i + 2)
        valid = torch.ones(B, C + T, dtype=torch.bool)
        valid[1, C - 1] = False  # one memory slot of example 1 is padding
        mask = kernels.Mask(kernels.causal_after_prefix(C, valid), B, T, C + T, q.device)
        out = kernels.attention(q, k, v, mask)
        assert out.shape == (B, H, T, hd)
    compiles = counters["frames"]["ok"]  # frames dynamo compiled (before the fix: 8, then the limit)
    assert len(buckets) == 2 and compiles <= len(buckets), f"{compiles} compiles, {len(shapes)} shapes, {len(buckets)} buckets"
    assert not counters["unimplemented"], dict(counters["unimplemented"])  # no recompile limit, no graph break


def test_compiled_flex_forward_equals_dense_cpu(compiled_flex):
    """Inductor-compiled flex forward (CPU) under PIC's block-wise mask, with padding
    queries and keys from bucketing, equals dense SDPA with the same mask_mod."""
    compiled_flex("inductor")
    B, H, Hkv, hd, L, r = 2, 4, 2, 16, 80, 16
    lengths = torch.tensor([80, 53])
    z, _ = pic.layout(lengths, L, [r])
    T = z["valid"].shape[1]  # 80 + 5 memory slots: bucket 128
    mask_mod = pic.blockwise(z)
    q, k, v = rand(B, H, T, hd, seed=0), rand(B, Hkv, T, hd, seed=1), rand(B, Hkv, T, hd, seed=2)
    flex = kernels.attention(q, k, v, kernels.Mask(mask_mod, B, T, T, q.device))
    kernels.BACKEND = "dense"
    dense = kernels.attention(q, k, v, kernels.Mask(mask_mod, B, T, T, q.device))
    torch.testing.assert_close(flex, dense, atol=2e-5, rtol=2e-5)


def test_compiled_layers_recompile_a_bounded_number_of_times(compiled_flex):
    """train.py --compile (model.compile_layers) on a decoder over K/V memory of 1..16 slots
    (ata's rel C, sac's memories) and two token lengths, equal to eager. The layers share their
    graphs and the shapes go dynamic after a first recompile: once memories of 1..8 slots have
    compiled, 9..16 compile nothing new. Before: a graph per memory length, then dynamo's
    recompile limit (8) and eager for the rest of the run."""
    from model import Memory, ModelConfig, Transformer, compile_layers
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
    model.requires_grad_(False)  # flex (the CUDA path) has no backward on CPU

    def forward(C, T):
        kv = [(rand(2, 2, C, 8, seed=C), rand(2, 2, C, 8, seed=C + 1)) for _ in range(2)]
        ids = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(T))
        return model(ids, memory=Memory(kv=kv, mask=torch.tensor([[True] * C, [False] + [True] * (C - 1)])),
                     output="hidden")
    eager = {(C, T): forward(C, T) for C, T in ((3, 64), (12, 128))}
    compile_layers(model, backend="eager")
    frames = []
    for Cs in (range(1, 9), range(9, 17)):
        for C in Cs:
            for T in (64, 128):
                out = forward(C, T)
                if (C, T) in eager:
                    torch.testing.assert_close(out, eager[C, T], atol=1e-5, rtol=1e-5)
        frames.append(counters["frames"]["ok"])
    assert frames[1] == frames[0] <= 16 and not counters["unimplemented"], (frames, dict(counters["unimplemented"]))


@pytest.mark.slow
def test_one_run_compiles_every_graph_it_needs(compiled_flex, monkeypatch):
    """meanpool kd over nine context lengths, one per 128-token bucket (130..1154 tokens), as one run's batches
    vary: flex and create_block_mask need more than 16 graphs between them (query and key buckets x mask_mods),
    past dynamo's default limit of 8 per function, after which flex ran unfused for the rest of
    the run (an H200 measured sentence_gist lm 3x slower so). kernels.compiled raises the limit:
    every frame compiles, none falls back."""
    compiled_flex("eager")
    monkeypatch.setattr(kernels, "_compiled_block_mask", kernels.compiled(create_block_mask, "eager"))
    tok = bench.data.load_tokenizer(bench.TINY_BASE)
    base = bench.random_model("tiny", tok, torch.device("cpu"), torch.float32)
    for context in range(130, 1155, 128):
        m, batch, _ = bench.build_row(base, tok, "meanpool", "kd", "4,8,16", 2, context)
        with torch.no_grad():  # the forward is what compiles (flex has no backward on CPU)
            m(batch, train.ratios_of("4,8,16"))
    frames = dict(counters["frames"])
    assert frames["ok"] == frames["total"] > 2 * 8 and not counters["unimplemented"], (frames, dict(counters["unimplemented"]))
