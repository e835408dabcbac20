"""meanpool.py: pooling by hand, one encoder pass for all ratios, bidirectional encoder."""
import torch

import data
import tiny
import kernels
import meanpool
import train
from common import tiny_base
from model import Transformer


def test_mean_pool_by_hand_partial_last_window():
    h = torch.arange(7 * 2, dtype=torch.float32).view(1, 7, 2)  # L = 7, d = 2
    z, mask = meanpool.mean_pool(h, torch.tensor([7]), 3)  # windows {0,1,2} {3,4,5} {6}
    expected = torch.tensor([[[2.0, 3.0], [8.0, 9.0], [12.0, 13.0]]])
    assert torch.equal(z, expected)
    assert mask.tolist() == [[True, True, True]]


def test_mean_pool_sums_bf16_states_in_fp32():
    """A bf16 encoder's states (real checkpoints on CUDA) are averaged in fp32: no bf16 rounding of the sums."""
    h = torch.randn(2, 1024, 8, generator=torch.Generator().manual_seed(0)).bfloat16()
    z, _ = meanpool.mean_pool(h, torch.tensor([1024, 700]), 128)
    exact = torch.stack([h[0].double().view(8, 128, 8).mean(1), h[1].double().view(8, 128, 8).mean(1)])
    exact[1, 5] = h[1, 640:700].double().mean(0)  # example 1's last window: its 60 real tokens
    assert z.dtype == torch.float32 and torch.allclose(z[:, :6].double(), exact[:, :6], rtol=1e-5, atol=1e-6)
    assert torch.allclose(z[0].double(), exact[0], rtol=1e-5, atol=1e-6)


def test_mean_pool_padding_and_per_example_ratio():
    h = torch.randn(2, 9, 4)
    lengths = torch.tensor([9, 5])
    z, mask = meanpool.mean_pool(h, lengths, 4)  # C = ceil(9/4) = 3; example 1 has ceil(5/4) = 2
    assert mask.tolist() == [[True, True, True], [True, True, False]]
    assert torch.allclose(z[1, 1], h[1, 4])  # the partial window holds token 4 only
    h2 = h.clone()
    h2[1, 5:] = 100.0  # padding never changes a pooled vector
    assert torch.equal(meanpool.mean_pool(h2, lengths, 4)[0][1, :2], z[1, :2])
    z3, _ = meanpool.mean_pool(h, lengths, torch.tensor([2, 5]))  # one ratio per example
    assert torch.allclose(z3[0, 0], h[0, :2].mean(0)) and torch.allclose(z3[1, 0], h[1, :5].mean(0))


def _method(tmp_path, **kw):
    base_dir = tiny_base(tmp_path / "base")
    tok = data.load_tokenizer(base_dir)
    base = Transformer.from_pretrained(base_dir)
    for p in base.parameters():
        p.requires_grad_(False)
    run = train.TrainConfig(objective="kd")
    m = meanpool.MeanPool(base, meanpool.MeanPoolConfig(**kw), tok, run)
    # non-zero adapters so the encoder is not the base
    for n, p in m.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    recs = tiny.Synthetic(0, "val").qa_examples(3)
    batch = data.collate_qa(recs, tok, pad_multiple=8)
    return m, batch


def test_one_encoder_pass_serves_all_ratios(tmp_path):
    m, batch = _method(tmp_path)
    calls = []
    real_encode = m.encode
    m.encode = lambda b: calls.append(1) or real_encode(b)
    loss, n, metrics = m(batch, [4, 8, 16])
    assert len(calls) == 1 and set(metrics) == {"loss_r4", "loss_r8", "loss_r16"}
    assert loss.item() > 0 and n == int((batch["qa_labels"] != -100).sum())
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for n_, p in m.named_parameters() if "encoder" in n_)


def test_encoder_is_bidirectional_and_ignores_padding(tmp_path):
    m, batch = _method(tmp_path)
    with torch.no_grad():
        mem = m.compress(batch, 4)
        ctx = batch["context"].clone()
        last = batch["context_len"][0] - 1
        ctx[0, last] = (ctx[0, last] + 1) % 100 + 5
        changed = m.compress(dict(batch, context=ctx), 4)
        P = len(batch["prefix"])  # the prefix slots (BOS) come first
        assert not torch.allclose(mem.embeds[0, P], changed.embeds[0, P])  # first slot sees the last token
        ctx = batch["context"].clone()
        L = batch["context_len"][1]
        ctx[1, L:] = 7  # garbage in the padding of example 1
        padded = m.compress(dict(batch, context=ctx), 4)
        valid = mem.mask[1]
        assert torch.allclose(mem.embeds[1][valid], padded.embeds[1][valid], atol=1e-6)


def test_fresh_adapters_and_w_at_embedding_scale_reproduce_base_pooling(tmp_path):
    base_dir = tiny_base(tmp_path / "base")
    tok = data.load_tokenizer(base_dir)
    base = Transformer.from_pretrained(base_dir)
    m = meanpool.MeanPool(base, meanpool.MeanPoolConfig(), tok, train.TrainConfig())
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=1)
    real = torch.arange(batch["context"].shape[1])[None] < batch["context_len"][:, None]
    with torch.no_grad():
        h = base(batch["context"], mask=kernels.bidirectional(real), output="hidden")
        expected, _ = meanpool.mean_pool(h, batch["context_len"], 8)
        memory = m.compress(batch, 8)
        P = len(batch["prefix"])  # [BOS embedding, z_1 .. z_C]
        assert P == 1 and torch.equal(memory.embeds[:, 0], base.model.embed_tokens.weight[[tok.bos_id] * 2])
        s = base.model.embed_tokens.weight.std() / base.model.norm.weight.pow(2).mean().sqrt()  # W = s I
        assert 0.01 < s < 0.5 and torch.allclose(memory.embeds[:, P:], s * expected, atol=1e-6)
    no_w = meanpool.MeanPool(Transformer.from_pretrained(base_dir), meanpool.MeanPoolConfig(no_linear=True), tok,
                             train.TrainConfig())
    assert no_w.proj is None


def test_paper_defaults_on_a_real_checkpoint(base_dir):
    """Table 6 and §5.1 on a real checkpoint: R = {4..128}, 48k steps, answers up to 256
    tokens; the tiny default keeps 4,8,16; explicit flags win."""
    cfg, mcfg = train.TrainConfig(method="meanpool", init_from=base_dir), meanpool.MeanPoolConfig()
    train.resolve(cfg, mcfg, set(), meanpool.MeanPool)
    assert train.ratios_of(cfg.ratio) == [4, 8, 16, 32, 64, 128] and cfg.max_iters == 48000 and cfg.max_answer == 256
    assert cfg.lr == 2e-4 and cfg.batch_size == 32
    cfg = train.TrainConfig(method="meanpool", init_from=base_dir, ratio="16")
    train.resolve(cfg, mcfg, {"ratio"}, meanpool.MeanPool)
    assert cfg.ratio == "16"
    tiny_cfg = train.TrainConfig(method="meanpool")
    train.resolve(tiny_cfg, meanpool.MeanPoolConfig(), set(), meanpool.MeanPool)
    assert tiny_cfg.ratio == "4,8,16" and tiny_cfg.max_iters == 700


def test_table3_fixed_decoder_fixed_encoder_no_encoder(tmp_path):
    """Table 3: which adapters exist and train, and what each ablation pools."""
    def trained(m):
        loss, _, _ = m(batch, [4])
        loss.backward()
        return {n.split("lora_")[1].split(".")[1] if "lora_" in n else n for n, p in m.named_parameters()
                if p.grad is not None and p.grad.abs().sum() > 0}
    m, batch = _method(tmp_path, fixed_decoder=True)
    assert trained(m) == {"encoder", "proj.weight"}
    m, batch = _method(tmp_path, fixed_encoder=True)
    assert trained(m) == {"decoder", "proj.weight"}
    real = torch.arange(batch["context"].shape[1])[None] < batch["context_len"][:, None]
    with torch.no_grad():  # the frozen base, bidirectional, is the encoder
        h = m.base(batch["context"], mask=kernels.bidirectional(real), output="hidden")
        pooled = m.proj(meanpool.mean_pool(h, batch["context_len"], 4)[0])  # then W
        assert torch.allclose(m.compress(batch, 4).embeds[:, 1:], pooled, atol=1e-6)
    m, batch = _method(tmp_path, no_encoder=True, no_linear=True)
    assert trained(m) == {"decoder"}
    with torch.no_grad():  # window means of the token embeddings
        e = m.base.model.embed_tokens(batch["context"])
        assert torch.allclose(m.compress(batch, 4).embeds[:, 1:], meanpool.mean_pool(e, batch["context_len"], 4)[0])
