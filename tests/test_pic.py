"""pic.py: the three masks as literal grids, receptive fields checked through outputs,
padding and positions, eq. 6-8 by hand, encoder/decoder of different widths, Memory round
trip, CLI errors, DDP and real checkpoints."""
import json
import random

import pytest
import torch

import eval as evaluate
import torch.nn.functional as F

import data
import tiny
import kernels
import pic
import train
from common import DDP_ATOL, cli_error, hf_checkpoint, method_smoke, read_params, run, torchrun
from model import Memory, ModelConfig, Transformer




def make(base_dir, objective="qa", ratio="3", **kw):
    """A PIC on the tiny base with random (non-zero) encoder adapters."""
    tok = data.load_tokenizer(base_dir)
    base = Transformer.from_pretrained(str(base_dir))
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    m = pic.PIC(base, pic.PICConfig(**kw), tok, train.TrainConfig(objective=objective, ratio=ratio))
    for n, p in m.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return m, tok


# -----------------------------------------------------------------------------
# masks

# Z = [c_1 = 3 tokens, c_2 = 3 tokens, m_1, m_2]; row = query, column = key. Rules (eq. 5):
# context -> context causal; memory -> memory causal; m_t -> context of chunk t only.
BLOCKWISE = ["#.......",
             "##......",
             "###.....",
             "####....",
             "#####...",
             "######..",
             "###...#.",   # m_1: c_1 and itself
             "...#####"]   # m_2: c_2, m_1 and itself
CAUSAL = ["#" * (i + 1) + "." * (7 - i) for i in range(8)]
BIDIR = CAUSAL[:6] + ["########", "########"]


@pytest.mark.parametrize("name,expected", [("blockwise", BLOCKWISE), ("causal", CAUSAL), ("bidir", BIDIR)])
def test_masks_are_the_literal_grids(name, expected):
    z, widths = pic.layout(torch.tensor([6]), 6, [3])
    assert kernels.draw(getattr(pic, name)(z), 8).split("\n") == expected
    assert z["pos"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]] and widths == [2]


def test_padding_keys_are_never_seen():
    # example 1: 4 real tokens of 6 (chunks {0,1,2} {3}, then 2 pads): 2 memory slots at positions 4, 5
    z, widths = pic.layout(torch.tensor([6, 4]), 6, [3])
    dense = kernels.dense_mask(pic.blockwise(z), 2, 8, 8, "cpu")[1, 0]
    assert ["".join("#" if x else "." for x in row) for row in dense.tolist()] == [
        "#.......",
        "##......",
        "###.....",
        "####....",
        "####....",   # padding queries (outputs unused) see the real tokens only
        "####....",
        "###...#.",
        "...#..##"]   # m_2: the real part of c_2, m_1, itself
    assert z["pos"][1].tolist() == [0, 1, 2, 3, 4, 5, 4, 5] and z["valid"][:, 6:].sum(1).tolist() == [2, 2]


def test_centre_positions_put_memory_t_at_chunk_t_middle_token():
    # EPL: chunk {0,1,2} -> 1, chunk {3,4,5} -> 4; a partial last chunk {3} -> its last real token 3
    pos = pic.layout(torch.tensor([6, 4]), 6, [3], centre=True)[0]["pos"]
    assert pos.tolist() == [[0, 1, 2, 3, 4, 5, 1, 4], [0, 1, 2, 3, 4, 5, 1, 3]]
    pos = pic.layout(torch.tensor([8]), 8, [4], centre=True)[0]["pos"]  # even r: the left middle, (r - 1) // 2
    assert pos[0, 8:].tolist() == [1, 5]


# -----------------------------------------------------------------------------
# receptive fields, through the encoder's outputs (L = 9, r = 3: three chunks, N = 3)


def memory_states(m, ctx, mem_embed=None):
    with torch.no_grad():
        if mem_embed is not None:
            m.mem_embed.copy_(mem_embed)
        return m.encode(ctx, torch.tensor([ctx.shape[1]]), [3])[0][0][0]  # (N, d)


def changed(a, b):
    return (a - b).abs().max().item() > 1e-4


def test_blockwise_receptive_field(base_dir):
    m, _ = make(base_dir, mask="blockwise")
    ctx = torch.randint(5, 500, (1, 9), generator=torch.Generator().manual_seed(0))
    h = memory_states(m, ctx)
    for lo in (3, 6):  # change chunk 2 or chunk 3: m_1 is unchanged
        other = ctx.clone()
        other[0, lo:lo + 3] = (other[0, lo:lo + 3] + 7) % 500
        h2 = memory_states(m, other)
        assert torch.allclose(h[0], h2[0], atol=1e-6)
        assert changed(h[lo // 3], h2[lo // 3])  # m_t changes with chunk t
    assert torch.allclose(h[1], h2[1], atol=1e-6)  # chunk 3 changed: m_2 unchanged
    first = ctx.clone()
    first[0, 1] = (first[0, 1] + 7) % 500
    assert changed(h[0], memory_states(m, first)[0])
    table = m.mem_embed.detach().clone()
    table[2] += 1.0  # m_3's input embedding: m_1 is causal over memory
    assert torch.allclose(h[0], memory_states(m, ctx, table)[0], atol=1e-6)


def test_causal_receptive_field(base_dir):
    m, _ = make(base_dir, mask="causal")
    ctx = torch.randint(5, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    h = memory_states(m, ctx)
    last = ctx.clone()
    last[0, 8] = (last[0, 8] + 7) % 500
    assert changed(h[0], memory_states(m, last)[0])  # m_1 reads the last chunk
    table = m.mem_embed.detach().clone()
    table[2] += 1.0
    assert torch.allclose(h[0], memory_states(m, ctx, table)[0], atol=1e-6)  # but not m_3


def test_bidir_receptive_field(base_dir):
    m, _ = make(base_dir, mask="bidir")
    ctx = torch.randint(5, 500, (1, 9), generator=torch.Generator().manual_seed(2))
    h = memory_states(m, ctx)
    table = m.mem_embed.detach().clone()
    table[2] += 1.0
    assert changed(h[0], memory_states(m, ctx, table)[0])  # m_1 reads m_N


@pytest.mark.parametrize("mask", [*pic.MASKS])
@pytest.mark.parametrize("mem", ["table", "single"])
def test_one_encoder_pass_equals_a_pass_per_ratio(base_dir, mask, mem):
    """--ratio 4,8,16 encodes [context, memory at 4, at 8, at 16] once: each ratio's memory equals
    its own pass over [context, its memory] (padded contexts of three lengths; after / centre positions)."""
    m, tok = make(base_dir, mask=mask, mem=mem)
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(3), tok, pad_multiple=8)
    assert len(set(batch["context_len"].tolist())) == 3
    with torch.no_grad():
        for r, packed in zip((4, 8, 16), m.memories(batch, [4, 8, 16])):
            alone = m.compress(batch, r)
            assert torch.equal(packed.mask, alone.mask)
            torch.testing.assert_close(packed.embeds, alone.embeds, atol=1e-5, rtol=1e-5)


def test_single_memory_token_is_one_row(base_dir):
    m, _ = make(base_dir, mem="single", mask="bidir")
    assert m.mem_embed.shape[0] == 1
    ctx = torch.randint(5, 500, (1, 9), generator=torch.Generator().manual_seed(3))
    h = memory_states(m, ctx)
    assert changed(h, memory_states(m, ctx, m.mem_embed.detach() + 1.0))


def test_batch_padding_and_positions_match_one_example_alone(base_dir):
    m, tok = make(base_dir, mask="blockwise")
    recs = tiny.Synthetic(0, "val").qa_examples(3)
    batch = data.collate_qa(recs, tok, pad_multiple=64)  # training padding, pad id in the gaps
    batch["context"][batch["context"] == tok.pad_id] = 9  # garbage in the padding
    with torch.no_grad():
        mem = m.compress(batch, 16)
        for b, r in enumerate(recs):
            alone = m.compress(data.collate_qa([r], tok, pad_multiple=1), 16)  # eval padding: none
            n = int(alone.slots()[0])
            assert int(mem.slots()[b]) == n == len(batch["prefix"]) - (-int(batch["context_len"][b]) // 16)
            assert torch.allclose(mem.embeds[b, :n], alone.embeds[0], atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mask", ["blockwise", "causal", "bidir"])
def test_flex_backend_gives_the_dense_memory(base_dir, monkeypatch, mask):
    """The same mask_mods as a BlockMask (the CUDA path; flex forward runs on CPU too), at one
    ratio and at two in one pass."""
    m, tok = make(base_dir, mask=mask)
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=64)
    with torch.no_grad():
        dense = [m.compress(batch, 8)] + m.memories(batch, [4, 8])
        monkeypatch.setattr(kernels, "BACKEND", "flex")
        flex = [m.compress(batch, 8)] + m.memories(batch, [4, 8])
    for d, f in zip(dense, flex):
        assert torch.allclose(d.embeds, f.embeds, atol=1e-4) and torch.equal(d.mask, f.mask)


# -----------------------------------------------------------------------------
# losses


def test_ae_lm_is_eq8_per_example_by_hand(base_dir):
    m, tok = make(base_dir, objective="ae+lm")
    rng = random.Random(0)
    syn = tiny.Synthetic(0, "train")
    texts = [syn.lm_text(rng, n) for n in (1, 2, 3)]
    batch = data.collate_lm(texts, tok, 1024)
    loss, n, metrics = m(batch, [4])
    assert n == 3 and set(metrics) == {"tr_r4", "tc_r4"}
    expected, emb, base = 0.0, m.base.model.embed_tokens, m.base
    with torch.no_grad(), base.adapter(None):
        for t in texts:
            x = tok.encode(t, bos=False, eos=True)
            k = len(x) // 2
            mem = m.compress({"context": torch.tensor([x[:k]]), "context_len": torch.tensor([k]),
                              "prefix": [tok.bos_id]}, 4).embeds  # [BOS, H]
            N = mem.shape[1]
            tr_in = torch.cat([mem, m.ae[None, None], emb(torch.tensor([x[:k - 1]]))], 1)  # [H, <AE>, x_<k]
            tr = F.cross_entropy(base(embeds=tr_in)[0, N:], torch.tensor(x[:k]))  # eq. 6
            tc_in = torch.cat([mem, emb(torch.tensor([x[k - 1:-1]]))], 1)  # [H, x_k .. x_{L-1}]
            tc = F.cross_entropy(base(embeds=tc_in)[0, N:], torch.tensor(x[k:]))  # eq. 7
            expected += 0.5 * tc + 0.5 * tr  # eq. 8
    assert torch.allclose(loss, expected, rtol=1e-4)
    loss.backward()
    assert m.ae.grad.abs().sum() > 0 and m.mem_embed.grad.abs().sum() > 0


def test_qa_loss_counts_answer_tokens_and_trains_the_encoder(base_dir):
    m, tok = make(base_dir)
    assert not m.ae.requires_grad  # <AE> is only trained by ae+lm
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=8)
    loss, n, metrics = m(batch, [4, 8])
    assert n == int((batch["qa_labels"] != -100).sum()) and set(metrics) == {"loss_r4", "loss_r8"}
    loss.backward()
    trained = {k for k, p in m.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert {"mem_embed", "converter.0.weight"} <= trained and any("lora_A.encoder" in k for k in trained)
    assert not any(k.startswith("base.") and "lora_" not in k for k in trained)


def tiny_model(path, vocab, d, layers=1):
    torch.manual_seed(d)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                      num_attention_heads=2, tie_word_embeddings=True, eos_token_id=[2])
    model = Transformer(cfg)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)
    model.save_pretrained(str(path))
    return str(path)


def test_encoder_and_decoder_of_different_widths(base_dir, tmp_path):
    vocab = Transformer.from_pretrained(str(base_dir)).config.vocab_size
    enc, dec = tiny_model(tmp_path / "enc", vocab, 32), tiny_model(tmp_path / "dec", vocab, 48)
    batch = None
    for objective, lora_r in (("kd", 4), ("qa", 0)):
        m, tok = make(base_dir, objective=objective, encoder=enc, decoder=dec, lora_r=lora_r)
        batch = batch or data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=8)
        mem = m.compress(batch, 4)
        assert mem.embeds.shape[2] == 48 and m.enc.config.hidden_size == 32
        loss, n, _ = m(batch, [4])
        loss.backward()
        assert loss.item() > 0 and m.converter[0].weight.grad.shape == (48, 32)
        assert all(not p.requires_grad for p in m.dec_model.parameters())  # the decoder is frozen
        full = m.enc_model.model.layers[0].mlp.down_proj.weight
        assert full.requires_grad == (lora_r == 0) and (lora_r > 0 or full.grad.abs().sum() > 0)
        outs, _ = evaluate.answer(m, batch, 4, 3, data.stop_ids(tok))
        assert len(outs) == 2
    wrong = tiny_model(tmp_path / "wrong", vocab + 1, 32)
    with pytest.raises(ValueError, match="vocab_size"):
        make(base_dir, encoder=wrong)


def test_eval_reads_teacher_rows_from_the_decoder_that_answers(base_dir, tmp_path, monkeypatch):
    """With --decoder, the teacher and no-context rows (and F1/teacher) read that decoder, as pic's kd teacher does,
    and sibling runs share them only under the same decoder."""
    vocab = Transformer.from_pretrained(str(base_dir)).config.vocab_size
    dec = tiny_model(tmp_path / "dec", vocab, 48)
    out = tmp_path / "run"
    train.main(["--method", "pic", "--init_from", str(base_dir), "--decoder", dec, "--objective", "qa", "--max_iters",
                "1", "--batch_size", "2", "--max_context", "64", "--device", "cpu", "--quiet", "--eval_examples", "0",
                "--out_dir", str(out)])
    widths, teacher_rows = [], evaluate.teacher_rows
    monkeypatch.setattr(evaluate, "teacher_rows", lambda model, *a: widths.append(model.config.hidden_size)
                        or teacher_rows(model, *a))
    key = evaluate.main([str(out), "--n", "2"])[0]["teacher_key"]
    cfg = train.run_config(str(out))[0]
    records = evaluate.eval_records(cfg, evaluate.EvalConfig(n=2))
    assert widths == [48] and key == evaluate.teacher_key(cfg, evaluate.EvalConfig(n=2), records, "cpu", dec)
    assert key != evaluate.teacher_key(cfg, evaluate.EvalConfig(n=2), records, "cpu")  # the base's rows: not these


# -----------------------------------------------------------------------------
# Memory round trip, one-shot eval, CLI errors


def test_memory_round_trip(base_dir, tmp_path):
    m, tok = make(base_dir)
    m.eval()
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=1)
    outs, mem = evaluate.answer(m, batch, 8, 6, data.stop_ids(tok))
    mem.save(tmp_path / "mem.safetensors")
    loaded = Memory.load(tmp_path / "mem.safetensors")
    prompts = [batch["qa"][b, :batch["prompt_len"][b]].tolist() for b in range(2)]
    assert torch.equal(loaded.embeds, mem.embeds)
    assert evaluate.answer_from_memory(m, loaded, prompts, 6, data.stop_ids(tok)) == outs


def test_one_shot_eval_from_a_saved_memory(base_dir, tmp_path):
    out = tmp_path / "run"
    train.main([str(a) for a in ["--method", "pic", "--init_from", base_dir, "--max_iters", 2, "--batch_size", 2,
                                 "--out_dir", out, "--device", "cpu", "--quiet", "--max_context", 256]])
    ctx = tmp_path / "doc.txt"
    ctx.write_text(tiny.Synthetic(0, "val").qa_examples(1)[0]["context"])
    q = "Where was the first person born?"
    first = run([out, "--context", ctx, "--question", q, "--save_memory", tmp_path / "doc.mem"], script="eval.py")
    again = run([out, "--memory", tmp_path / "doc.mem", "--question", q], script="eval.py")
    answer = [line for line in first.stdout.splitlines() if line.startswith("answer:")]
    assert answer and answer == [line for line in again.stdout.splitlines() if line.startswith("answer:")]
    assert "tokens; the answer reads its first 256 (the run's --max_context)" in first.stderr  # (it said nothing)
    assert "note" not in again.stderr  # (the run and checkpoint that saved it)
    train.main([str(a) for a in ["--method", "pic", "--init_from", base_dir, "--max_iters", 2, "--batch_size", 2,
                                 "--out_dir", out, "--device", "cpu", "--quiet", "--max_context", 256, "--seed", 7]])
    later = run([out, "--memory", tmp_path / "doc.mem", "--question", "Who?"], script="eval.py")  # (no note)
    assert f"note: --memory {tmp_path / 'doc.mem'} was saved by an earlier checkpoint of {out}" in later.stderr


def test_two_stage_recipe_starts_qa_from_ae_lm(base_dir, tmp_path):
    common = ["--method", "pic", "--max_iters", 1, "--batch_size", 2, "--device", "cpu", "--quiet",
              "--max_context", 128]
    train.main([str(a) for a in common + ["--init_from", base_dir, "--objective", "ae+lm", "--out_dir", tmp_path / "pt",
                                          "--mask", "causal", "--max_mem", 48]])
    train.main([str(a) for a in common + ["--init_from", tmp_path / "pt", "--objective", "qa", "--lr", "1e-12",
                                          "--out_dir", tmp_path / "ft"]])
    pt, ft = read_params(tmp_path / "pt"), read_params(tmp_path / "ft")
    assert "ae" in pt and "ae" not in ft and torch.allclose(pt["mem_embed"], ft["mem_embed"], atol=1e-6)
    # a table names a first stage read as it is by its objective (it said "pic")
    assert evaluate.run_label(tmp_path / "pt", pic.PICConfig()).startswith("pic (objective=ae+lm, mask=")
    assert evaluate.run_label(tmp_path / "ft", pic.PICConfig()) == "pic (objective=qa, after ae+lm)"  # (given)
    method = json.load(open(tmp_path / "ft" / "run.json"))["method"]  # the second stage inherits the first's config
    assert (method["mask"], method["max_mem"]) == ("causal", 48)
    with pytest.raises(SystemExit, match="--mask 'blockwise' conflicts with the first stage"):
        train.main([str(a) for a in common + ["--init_from", tmp_path / "pt", "--mask", "blockwise",
                                              "--out_dir", tmp_path / "bad"]])
    assert not (tmp_path / "bad").exists()  # refused before anything is written


def test_pretrain_in_one_command_equals_the_two_commands(base_dir, tmp_path):
    """--pretrain N is `--objective ae+lm --max_iters N` into OUT_DIR/pretrain, then qa with --init_from it."""
    common = ["--method", "pic", "--batch_size", 2, "--device", "cpu", "--quiet", "--max_context", 128,
              "--eval_examples", 0, "--init_from", base_dir]
    train.main([str(a) for a in common + ["--objective", "ae+lm", "--max_iters", 2, "--out_dir", tmp_path / "pt"]])
    train.main([str(a) for a in common + ["--max_iters", 1, "--init_from", tmp_path / "pt", "--out_dir", tmp_path / "ft"]])
    train.main([str(a) for a in common + ["--max_iters", 1, "--pretrain", 2, "--out_dir", tmp_path / "one"]])
    for two, one in ((tmp_path / "pt", tmp_path / "one" / "pretrain"), (tmp_path / "ft", tmp_path / "one")):
        a, b = read_params(two), read_params(one)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = json.load(open(tmp_path / "one" / "run.json"))["train"]
    assert (state["objective"], state["init_from"], state["pretrain"]) == ("qa", str(tmp_path / "one" / "pretrain"), 0)
    lines = [len(open(d / "log.jsonl").readlines()) for d in (tmp_path / "one", tmp_path / "one" / "pretrain")]
    train.main([str(a) for a in common + ["--max_iters", 1, "--pretrain", 2, "--out_dir", tmp_path / "one", "--resume"]])
    assert [len(open(d / "log.jsonl").readlines()) for d in (tmp_path / "one", tmp_path / "one" / "pretrain")] == lines


def test_check_config_errors():
    cfg = train.TrainConfig(ratio="1", max_context=600)
    for kw, message in ((dict(), "--max_mem 256"), (dict(mask="diag"), "--mask"), (dict(mem="two"), "--mem"),
                        (dict(mem_pos="end"), "--mem_pos"), (dict(lora_r=0, max_mem=600), "needs a separate --encoder"),
                        (dict(lora_r=0, mem="single", mask="bidir", encoder="E"), "--lora_r 0 with --mem single")):
        with pytest.raises(SystemExit, match=message):
            pic.PIC.check_config(cfg, pic.PICConfig(**kw))
    pic.PIC.check_config(cfg, pic.PICConfig(mem="single", mask="bidir"))  # one token repeated: no table to outgrow
    with pytest.raises(SystemExit, match="--mem single is meanpool §5.1's compression tokens: add --mask causal"):
        pic.PIC.check_config(cfg, pic.PICConfig(mem="single"))  # PIC's mask: in neither paper
    with pytest.raises(SystemExit, match="--max_context 600 at --eval_ratio 16,2 needs 300 memory tokens"):
        pic.PIC.check_config(train.TrainConfig(ratio="4", eval_ratio="16,2", max_context=600), pic.PICConfig())


@pytest.mark.parametrize("extra,message", [(["--ratio", "0"], "--ratio"), (["--no_linear"], "does not apply"),
                                           (["--max_context", "4000"], "max_position_embeddings 2048"),
                                           (["--mem", "single", "--mask", "bidir", "--pretrain", "5"],
                                            "--pretrain runs a pretraining")])
def test_cli_errors_are_one_line(base_dir, tmp_path, extra, message):
    assert message in cli_error(["--method", "pic", "--init_from", base_dir, "--out_dir", tmp_path / "x", *extra])
    assert not (tmp_path / "x").exists()  # before any work


# -----------------------------------------------------------------------------
# DDP and real checkpoints


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_rank_with_double_batch(base_dir, tmp_path):
    # qa after one ae+lm step (--pretrain: both stages in one process group; ae+lm counts examples, not tokens)
    common = ["--method", "pic", "--init_from", base_dir, "--max_iters", 2, "--ratio", "8", "--pretrain", 1,
              "--device", "cpu", "--quiet", "--max_context", 128, "--eval_interval", 2, "--lr", "1e-2",
              "--eval_examples", 1]
    torchrun(common + ["--batch_size", 2, "--out_dir", tmp_path / "ddp"])  # the global batch, 1 per rank
    train.main([str(a) for a in common + ["--batch_size", 2, "--out_dir", tmp_path / "one"]])  # one rank, in this process
    a, b = read_params(tmp_path / "ddp"), read_params(tmp_path / "one")
    assert read_params(tmp_path / "ddp" / "pretrain").keys() >= {"ae", "mem_embed"}
    assert (tmp_path / "ddp" / "metrics.json").exists()  # rank 0 evaluates after the process group ends
    assert a.keys() == b.keys() and "mem_embed" in a and "ae" not in a
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=DDP_ATOL), k


@pytest.mark.slow
def test_real_checkpoints(tmp_path):  # (its defaults on Llama: test_train.py's test of every registered method)
    method_smoke(tmp_path / "qwen3", "pic", extra=["--objective", "ae+lm", "--mem", "single", "--mask", "bidir"],
                 family="qwen3")


def test_single_token_baseline_has_meanpool_papers_setup(base_dir):
    """--mem single is meanpool §5.1's compression-token baseline: decoder adapter, linear W
    (identity init), kd by default; PIC (--mem table) keeps a frozen decoder and the MLP converter."""
    m, tok = make(base_dir, objective="kd", mem="single", mask="bidir")
    assert m.dec_adapter == "decoder" and len(m.converter) == 1
    assert torch.equal(m.converter[0].weight, torch.eye(m.base.config.hidden_size))
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=8)
    loss, n, _ = m(batch, [4])
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for k, p in m.named_parameters() if "lora_B.decoder" in k)
    pic_m, _ = make(base_dir)
    assert pic_m.dec_adapter is None and len(pic_m.converter) == 3
    for mem, objective, pretrain in (("single", "kd", 0), ("table", "qa", 100)):  # PIC pretrains; the tokens do not
        cfg, mcfg = train.TrainConfig(method="pic"), pic.PICConfig(mem=mem)
        train.resolve(cfg, mcfg, set(), pic.PIC)  # on the tiny base both train at 4 and read at 4 and 16
        assert (cfg.objective, cfg.ratio, cfg.eval_ratio, cfg.max_iters, cfg.pretrain) == (
            objective, "4", "4,16", 1100, pretrain)


def test_compression_tokens_default_to_chunk_centres(base_dir, monkeypatch):
    """--mem single defaults to EPL's layout, the memory table to PIC's; --mem_pos overrides either."""
    seen, layout = [], pic.layout
    monkeypatch.setattr(pic, "layout", lambda *a: seen.append(a[3]) or layout(*a))
    for kw in (dict(mem="single"), dict(), dict(mem="single", mem_pos="after"), dict(mem_pos="centre")):
        memory_states(make(base_dir, **kw)[0], torch.arange(5, 14)[None])
    assert seen == [True, False, False, True]


def test_ae_lm_pretrains_the_lengths_finetuning_compresses(base_dir, tmp_path):
    """ae+lm compresses the first half of a text: texts are cut at 2 x max_context, so
    memory rows up to ceil(max_context / r) are pretrained (issue 20.17)."""
    text = tmp_path / "long.txt"
    text.write_text(" ".join(f"word{i}" for i in range(400)) + "\n")
    cfg = train.TrainConfig(method="pic", objective="ae+lm", data=str(text), max_context=32, batch_size=1,
                            init_from=base_dir)
    tok = data.load_tokenizer(base_dir)
    for method, longest in ((pic.PIC, 2 * 32), (object, 32)):  # BOS included; a method that reads whole texts
        batch = train.Batches(cfg, tok, method.__new__(method))(0)[0]
        assert int(batch["lengths"][0]) == longest


def test_encoder_with_its_own_tokenizer(base_dir, tmp_path):
    """PIC's cross-model setup (issue 20.15): an encoder of another vocabulary reads its own
    tokenizer's ids of the same context text; the converter maps its width to the decoder's."""
    enc = hf_checkpoint(tmp_path / "enc", "llama")  # byte-level BPE, vocab 400+, width 64
    m, tok = make(base_dir, objective="qa", encoder=enc, lora_r=4)
    assert m.enc_tok is not None and m.enc.config.vocab_size != m.base.config.vocab_size
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=8)
    ids, lengths = m.encoder_context(batch)
    for b in range(2):
        text = tok.decode(batch["context"][b, :batch["context_len"][b]].tolist())
        assert ids[b, :lengths[b]].tolist() == m.enc_tok.encode(text)[:m.run.max_context]  # cut at max_context
    mem = m.compress(batch, 4)
    assert mem.embeds.shape[2] == m.base.config.hidden_size
    assert mem.slots().tolist() == [1 + -(-int(n) // 4) for n in lengths]  # BOS + ceil(L_enc / r)
    loss, n, _ = m(batch, [4])
    loss.backward()
    assert loss.item() > 0 and m.converter[0].weight.grad.shape == (m.base.config.hidden_size, 64)
    outs, _ = evaluate.answer(m, batch, 4, 3, data.stop_ids(tok))
    assert len(outs) == 2


def _losses_and_grads(m, batch, ratio_groups):
    """The summed loss, per-ratio metrics and every trainable gradient of m over calls on ratio_groups."""
    m.zero_grad(set_to_none=True)
    total, metrics = 0.0, {}
    for ratios in ratio_groups:
        loss, _, mets = m(batch, ratios)
        loss.backward()
        total, metrics = total + loss.item(), {**metrics, **mets}
    return total, metrics, {k: p.grad.clone() for k, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("method,objective", [("pic", "qa"), ("pic", "kd"), ("meanpool", "kd"), ("meanpool", "qa")])
def test_one_decoder_pass_for_all_ratios_equals_a_pass_per_ratio(base_dir, tmp_path, method, objective):
    """Without the tiny aids the decoder reads every ratio's memory in one pass, stacked along the batch
    (model.decode_each): the same losses, per-ratio metrics and gradients as one pass per ratio."""
    from test_meanpool import _method
    if method == "pic":
        m, tok = make(base_dir, objective)
        batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(3), tok, pad_multiple=8)
    else:
        m, batch = _method(tmp_path)
    m.run.objective = objective
    passes, decode = [], m.decode_hidden
    m.decode_hidden = lambda memory, ids: passes.append(len(ids)) or decode(memory, ids)
    stacked = _losses_and_grads(m, batch, [[4, 8, 16]])
    alone = _losses_and_grads(m, batch, [[4], [8], [16]])
    assert passes == [9, 3, 3, 3]  # one pass over 3 ratios x 3 examples, then one per ratio
    assert stacked[0] == pytest.approx(alone[0], rel=1e-5) and stacked[1].keys() == alone[1].keys()
    assert all(stacked[1][k] == pytest.approx(alone[1][k], rel=1e-5) for k in alone[1])
    assert stacked[2].keys() == alone[2].keys() and len(alone[2]) > 0
    for k, g in alone[2].items():
        assert torch.allclose(stacked[2][k], g, rtol=1e-4, atol=1e-6), k
