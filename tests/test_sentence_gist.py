"""sentence_gist.py: layout and mask, mean-resizing, cache equivalence, stages, end to end."""
import json
import os

import pytest
import torch

import eval as evaluate

import data
import tiny
import kernels
import sentence_gist as sg
import train
from model import Memory, Transformer
from sentence_gist import GIST, SINK, TOKEN
from conftest import ROOT
from common import DDP_ATOL, cli_error, method_smoke, read_params, run, torchrun


def make(base_dir, randomize=True, objective="lm", **kw):
    """A SentenceGist on a fresh copy of the tiny base; randomize: a non-zero `gist` LoRA."""
    torch.manual_seed(0)  # the adapter's A draws from the global generator: the same model in any test order
    tok = data.load_tokenizer(os.path.join(base_dir, "tokenizer.model"))
    base = Transformer.from_pretrained(base_dir)
    for p in base.parameters():
        p.requires_grad_(False)
    m = sg.SentenceGist(base, sg.SentenceGistConfig(**{"gists": 2, **kw}), tok, train.TrainConfig(objective=objective))
    g = torch.Generator().manual_seed(1)
    for n, p in base.named_parameters():
        if randomize and n.endswith("lora_B.gist"):
            p.data.copy_(0.05 * torch.randn(p.shape, generator=g))
    return m


# --- layout and mask ------------------------------------------------------------------

IS_END = torch.tensor([False] * 9 + [True])  # a 10-token vocabulary where token 9 is "."

MASK_3_SENTENCES = """
#...........
##..........
###.........
####........
#####.......
######......
#...###.....
#...####....
#...#####...
#...######..
#...##..###.
#...##..####
"""  # <s> | t t . g1 g2 | t . g1 g2 | t t   (sink, two finished sentences, one open)


def test_mask_literal_three_sentences():
    L = sg.layout([([0], [1, 2, 9, 3, 9], [4, 5]), ([0], [], [1])], IS_END, 2, 64, multiple=1)
    assert L["ids"][0].tolist() == [0, 1, 2, 9, 10, 11, 3, 9, 10, 11, 4, 5]
    assert L["kind"][0].tolist() == [SINK] + [TOKEN] * 3 + [GIST] * 2 + [TOKEN] * 2 + [GIST] * 2 + [TOKEN] * 2
    assert L["sentence"][0].tolist() == [0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3] and L["open"].tolist() == [3, 1]
    dense = kernels.dense_mask(sg.sentence_mask(L["sentence"], L["kind"]), 2, 12, 12, "cpu")[:, 0]
    want = [[c == "#" for c in row] for row in MASK_3_SENTENCES.split()]
    assert dense[0].tolist() == want
    assert not dense[1, :, 2:].any()  # example 2 is 2 tokens long: its padding is never seen


def test_gists_every_max_sentence_len_without_punctuation():
    ids, sent, kind, src = sg.insert_gists([1, 2, 3, 4, 5, 6, 7], IS_END, 1, 3)
    assert ids.tolist() == [1, 2, 3, 10, 4, 5, 6, 10, 7]
    assert sent.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2]
    assert src.tolist() == [0, 1, -1, 2, 3, 4, -1, 5, 6]  # the gist carries its sentence's last target
    ids, *_ = sg.insert_gists([1, 9, 2, 3, 4, 5], IS_END, 1, 3)  # punctuation resets the count
    assert ids.tolist() == [1, 9, 10, 2, 3, 4, 10, 5]
    ids, *_ = sg.insert_gists([1, 2, 3], IS_END, 1, 3, run=2)  # 2 tokens of the open sentence came before
    assert ids.tolist() == [1, 10, 2, 3]
    ids, *_ = sg.insert_gists([1, 9, 2], IS_END, 1, 64, close=True)  # a context's end ends its sentence
    assert ids.tolist() == [1, 9, 10, 2, 10]


def test_final_gist_predicts_the_next_sentence():
    body = [1, 2, 9, 3, 4]
    L = sg.layout([([0], body, [5, 9])], IS_END, 2, 64, labels=[[1, 2, 9, 3, 4, 5, 9, -100]], multiple=1)
    # <s> t1 t2 . g1 g2 t3 t4 g1 g2 | t5 . g1 g2: the final gist predicts what follows its
    # sentence (App. C.3), a sentence's last token and the other gists predict nothing
    assert L["ids"][0].tolist() == [0, 1, 2, 9, 10, 11, 3, 4, 10, 11, 5, 9, 10, 11]
    assert L["labels"][0].tolist() == [1, 2, 9, -100, -100, 3, 4, -100, -100, 5, 9, -100, -100, -100]


# --- mean-resizing --------------------------------------------------------------------


def test_mean_resize_is_hewitts():
    g = torch.Generator().manual_seed(0)
    A = torch.randn(6, 6, generator=g)
    w = torch.randn(4000, 6, generator=g) @ A + torch.arange(6.0)  # correlated, non-zero mean
    new = sg.mean_resize(w, 20000, torch.Generator().manual_seed(1))
    mu, cov, sigma = w.mean(0), torch.cov(w.T, correction=0), w.std(0)
    assert new.shape == (20000, 6)
    assert ((new - mu).abs() < 0.02 * sigma).all()  # N(mu, 1e-5 Sigma): sd 3.2e-3 sigma, so < 6 sd
    assert torch.allclose(torch.cov(new.T), 1e-5 * cov, atol=1e-6 * cov.diagonal().max().item())
    assert torch.equal(new, sg.mean_resize(w, 20000, torch.Generator().manual_seed(1)))
    assert torch.equal(sg.mean_resize(w[:3], 2), w[:3].mean(0).repeat(2, 1))  # V <= d: Sigma singular, mu


def test_base_unchanged_by_the_gist_vocabulary(base_dir):
    base = Transformer.from_pretrained(base_dir)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    emb, ref = base.model.embed_tokens.weight.clone(), base(ids)
    m = make(base_dir, randomize=False, gists=4)
    m_base = m.base
    assert m.gist.shape == (4, base.config.hidden_size) and m_base.config.vocab_size == base.config.vocab_size
    assert torch.equal(m_base.model.embed_tokens.weight, emb) and m_base.lm_head.weight.shape == emb.shape
    with m_base.adapter("gist"):  # a fresh adapter; regular ids embed as before
        assert torch.allclose(m_base(embeds=m.embed(ids)), ref, atol=1e-6)
    assert torch.allclose(m_base(ids), ref, atol=1e-6)
    gist_ids = torch.tensor([[m.V, m.V + 3]])
    assert torch.equal(m.embed(gist_ids)[0], m.gist[[0, 3]].detach())


def test_a_sentence_ends_in_its_mark_also_before_a_closing_quote_or_bracket(base_dir):
    """§3.2's ".", "!", "?" end a sentence, also inside a token that closes a quote or bracket after them (a
    BPE vocabulary's `."`, `.)`: an open sentence till the max_sentence_len guard, in web text's quotes)."""
    tok = data.load_tokenizer(os.path.join(base_dir, "tokenizer.model"))
    base = Transformer.from_pretrained(base_dir)
    texts = [".", '."', " .)", "?\u201d", "!\u2019 ", ")", '"', "a", "e.g", "..."]
    tok.token_texts = lambda: texts + ["x"] * (base.config.vocab_size - len(texts))
    m = sg.SentenceGist(base, sg.SentenceGistConfig(gists=1), tok, train.TrainConfig(objective="lm"))
    assert m.is_end[:len(texts)].tolist() == [True] * 5 + [False] * 4 + [True]


# --- cache equivalence ----------------------------------------------------------------


def test_compressed_cache_equals_full_sequence(base_dir):
    m = make(base_dir)
    tok, base = m.tok, m.base
    ctx = tok.encode("Ada Chen lives in Paris. Ada Chen works at Acme! Is she happy? She likes")
    tail = tok.encode(" tennis and golf", start=False)
    L = m.layout([(m.prefix(), ctx, tail)])
    n = int(L["length"][0])
    want = base.lm_head(m.hidden(L)[0, n - len(tail):n])  # (a) one pass under the sentence mask
    memory = m.compress({"prefix": m.prefix(), "context": torch.tensor([ctx]), "context_len": torch.tensor([len(ctx)])})
    assert int(memory.slots()[0]) == 1 + 4 * 2  # sink + (3 sentences + the open one, closed) x N_g
    assert int(memory.next_pos[0]) == len(ctx) + 1 + 4 * 2
    with base.adapter("gist"):
        got = base(torch.tensor([tail]), memory=memory)[0]  # (b) the tail after the compressed cache
        assert (got - want).abs().max() < 1e-5
        cache = memory  # (c) token by token, as generate does
        for i, t in enumerate(tail):
            logits, kv = base(torch.tensor([[t]]), memory=cache, return_kv=True)
            assert (logits[0, 0] - want[i]).abs().max() < 1e-5
            cache = Memory(kv=kv, mask=torch.cat([cache.mask, torch.ones(1, 1, dtype=torch.bool)], 1),
                           next_pos=cache.next_pos + 1)


def test_layout_pads_to_the_runs_multiple_and_padding_changes_nothing(base_dir):
    m = make(base_dir)
    rows = [(m.prefix(), m.tok.encode("Ada Chen lives in Paris. She likes"), [])]
    eager = m.layout(rows)
    m.run.compile = True  # compiled graphs serve lengths in steps of 64
    compiled, n = m.layout(rows), int(eager["length"][0])
    assert eager["ids"].shape[1] == -(-n // 8) * 8 < compiled["ids"].shape[1] == 64
    assert (m.hidden(eager)[0, :n] - m.hidden(compiled)[0, :n]).abs().max() < 1e-5


@pytest.mark.parametrize("case", ["rule", "guard"])
def test_answer_equals_one_pass_over_the_gisted_prompt_and_answer(base_dir, monkeypatch, case):
    """Answering from the cache (eval.answer) = one pass over context + prompt + answer under
    the sentence mask: gists after every sentence of prompt and answer, whose tokens leave
    the cache. guard: a sentence ends every 3 tokens, also in the answer (gists and eviction
    while decoding)."""
    m = make(base_dir, objective="qa", max_sentence_len=3 if case == "guard" else 64)
    batch = data.collate_qa(tiny.Synthetic(seed=0, split="val").qa_examples(3), m.tok, pad_multiple=1)
    steps, caches, extend = [], [], m.extend
    hook = m.base.lm_head.register_forward_hook(lambda mod, inp, out: steps.append(out[:, -1] if out.dim() == 3 else out))
    monkeypatch.setattr(m, "extend", lambda *a: caches.append(extend(*a)) or caches[-1])
    outs, memory = evaluate.answer(m, batch, 1, 7, data.stop_ids(m.tok))
    hook.remove()
    assert memory.stats["gist_rc"][0] > 1 and (memory.slots() < batch["context_len"]).all()
    assert all(len(out) == 7 for out in outs)  # no EOS from this model: the last token is never fed
    P = len(batch["prefix"])
    for b, out in enumerate(outs):
        ctx, prompt = batch["context"][b, :batch["context_len"][b]].tolist(), batch["qa"][b, :batch["prompt_len"][b]].tolist()
        L = m.layout([(batch["prefix"], ctx, prompt + out)], [[-100] * (P + len(ctx) + len(prompt) - 1) + out + [-100]])
        want = m.base.lm_head(m.hidden(L)[0][L["labels"][0] != -100])  # (7, V)
        assert want.argmax(-1).tolist() == out
        assert (torch.stack([s[b] for s in steps[:len(out)]]) - want).abs().max() < 1e-5
        L = m.layout([(batch["prefix"], ctx, prompt + out[:-1])])  # the cache holds the sink, gists, open sentence
        kept = (L["kind"] > 0) | ((L["kind"] == TOKEN) & (L["sentence"] == L["open"][:, None]))
        assert int(caches[-1][1].slots()[b]) == int(kept.sum()) < int(L["length"][0])
    loss, n, _ = m(batch, [1])
    loss.backward()
    assert n == int((batch["qa_labels"] != -100).sum()) and m.gist.grad.abs().sum() > 0


def test_extend_refuses_ids_that_end_the_open_sentence_and_begin_another(base_dir):
    """Every cached slot is seen by the ids fed: a new sentence's tokens would see the old open sentence's."""
    m = make(base_dir, objective="qa")
    memory = m.compress(data.collate_qa(tiny.Synthetic(seed=0, split="val").qa_examples(1), m.tok, pad_multiple=1))
    _, cache, is_open = m.extend(memory, torch.zeros_like(memory.mask), [m.tok.encode(" Bob likes")])
    assert is_open.sum() == len(m.tok.encode(" Bob likes"))
    with pytest.raises(ValueError, match="feed them in two calls"):
        m.extend(cache, is_open, [m.tok.encode(" tea. Then he")])
    _, _, is_open = m.extend(cache, is_open, [m.tok.encode(" tea.")])  # it ends the open sentence alone
    assert not is_open.any()


@pytest.mark.parametrize("max_sentence_len", [64, 3])
def test_answer_nll_and_its_control_are_the_qa_loss_of_one_pass(max_sentence_len):
    """eval.py's answer NLL reads the answering rule with the answers known: per question, weighted by answer
    tokens, it sums to the `qa` loss of one pass over context + prompt + answer; its control to that loss with
    each question after the next one's context. 3: sentences end inside prompts and answers too. On the shipped
    trained base, whose answers hang on where the gists go (a random one's NLL is about log V anywhere)."""
    m = make(str(ROOT / "tiny_base"), objective="qa", max_sentence_len=max_sentence_len)
    records = tiny.Synthetic(seed=0, split="val").qa_examples(4)
    row = evaluate.method_rows(m, m.tok, records, m.run, evaluate.EvalConfig(batch_size=4), [1], "cpu")[0]
    b = data.collate_qa(records, m.tok, pad_multiple=1)
    with torch.no_grad():
        loss, n, _ = m(b, [1])
    tokens = (b["qa_labels"] != -100).sum(1).tolist()
    assert sum(row["scores"]["nll"][r["id"]] * k for r, k in zip(records, tokens)) == pytest.approx(loss.item(),
                                                                                                   rel=1e-5)
    for j, r in enumerate(records):
        k = (j + 1) % len(records)
        one = {**b, "context": b["context"][k:k + 1], "context_len": b["context_len"][k:k + 1],
               "qa": b["qa"][j:j + 1], "qa_labels": b["qa_labels"][j:j + 1], "qa_len": b["qa_len"][j:j + 1]}
        with torch.no_grad():
            other, n_j, _ = m(one, [1])
        assert row["scores"]["nll_other"][r["id"]] == pytest.approx(other.item() / n_j, rel=1e-5)


def test_perplexity_compressed_equals_one_pass(base_dir):
    m = make(base_dir, gists=1)
    first, text = "Ada Chen lives in Paris.", "Ada Chen lives in Paris. Bob Baker works at Acme Foods."
    body, cut, P = m.tok.encode(text), len(m.tok.encode(first)), len(m.prefix())
    assert body[:cut] == m.tok.encode(first)  # two sentences: the only cut is after the first
    out = sg.perplexity(m, [text])
    assert sg.perplexity(m, [first]) == {"tokens": 0} and m.heldout_metrics([first], m.base) == {}  # nothing scored
    L = m.layout([(m.prefix(), body, [])], [[-100] * (P + cut - 1) + body[cut:] + [-100]])
    nll, n = kernels.chunked_ce(m.hidden(L), m.base.lm_head.weight, L["labels"])
    ids = torch.tensor([m.prefix() + body])
    alone = torch.tensor([m.prefix() + body[cut:]])  # "none": the second half after the sink alone
    with m.base.adapter(None):
        full = torch.nn.functional.cross_entropy(m.base(ids)[0, P + cut - 1:-1], ids[0, P + cut:])
        none = torch.nn.functional.cross_entropy(m.base(alone)[0, P - 1:-1], alone[0, P:])
    assert out["tokens"] == n == len(body) - cut
    assert abs(out["none"] - none.exp().item()) < 1e-3 * out["none"] and P == 1  # (a random base: no order)
    assert abs(out["compressed"] - (nll / n).exp().item()) < 1e-3 * out["compressed"]
    assert abs(out["full"] - full.exp().item()) < 1e-3 * out["full"]
    assert out["ratio"] == (P + cut) / 2  # the cache of the first half: sink + one gist


def test_eval_scores_full_perplexity_with_the_base_as_loaded(base_dir, tmp_path):
    """--lora_r 0 trains every base weight: ppl_full (Fig. 2: "compared to the base model") reads the base as
    loaded, not the trained one without gists."""
    out = tmp_path / "run"
    train.main(["--method", "sentence_gist", "--init_from", base_dir, "--stage", "2", "--lora_r", "0", "--max_iters",
                "2", "--lr", "1e-2", "--batch_size", "2", "--max_context", "128", "--device", "cpu", "--quiet",
                "--eval_examples", "0", "--out_dir", str(out)])
    row = evaluate.main([str(out), "--n", "4"])[0]["rows"][0]
    cfg, _, _, _, method = train.load_run(str(out))
    texts = [r["context"] for r in evaluate.eval_records(cfg, evaluate.EvalConfig(n=4))]
    assert row["ppl_full"] == pytest.approx(sg.perplexity(method, texts, Transformer.from_pretrained(base_dir))["full"],
                                            rel=1e-5)
    assert row["ppl_full"] != pytest.approx(sg.perplexity(method, texts)["full"], rel=1e-2)  # the trained base's


# --- stages and config ----------------------------------------------------------------


def test_stages_choose_the_trainables(base_dir):
    names = {}
    for stage in (1, 2, 3):
        m = make(base_dir, randomize=False, stage=stage)
        names[stage] = {n for n, p in m.named_parameters() if p.requires_grad}
        assert m.lr_schedule == ("linear" if stage == 3 else "cosine")
    assert names[1] == {"gist"}
    assert names[2] == names[3] and "gist" in names[2] and all("lora_" in n for n in names[2] - {"gist"})
    assert len(names[2]) == 1 + 2 * 4 * 2  # 2 layers x 4 weights (q/k/v and gate/up fused) x (A, B)


@pytest.mark.parametrize("lora_r", [0, 4])
def test_a_bf16_base_trains_fp32_master_weights(base_dir, lora_r):
    """train.build with a bf16 base (real checkpoints on CUDA): whatever trains is fp32 (stage 3 --lora_r 0 trains
    every base weight; a bf16 weight would drop AdamW's updates), whatever is frozen stays bf16."""
    argv = ["--method", "sentence_gist", "--init_from", base_dir, "--stage", "3", "--lora_r", str(lora_r)]
    (cfg, mcfg), explicit = train.parse_args(argv, train.TrainConfig, sg.SentenceGistConfig)
    train.resolve(cfg, mcfg, explicit, sg.SentenceGist)
    method = train.build(cfg, mcfg, torch.device("cpu"), torch.bfloat16)[2]
    dtypes = {(p.requires_grad, p.dtype) for p in method.parameters()}
    assert dtypes == ({(True, torch.float32)} if lora_r == 0 else {(True, torch.float32), (False, torch.bfloat16)})


@pytest.mark.parametrize("stage, iters, lr, warmup, clip, end_lr", [
    (1, 1000, 1e-4, 100, 1.0, 5e-5), (2, 9000, 1e-4, 1000, 2.0, 5e-5), (3, 2000, 5e-5, 100, 2.0, 0.0)])
def test_table3_presets_per_stage(tmp_path, stage, iters, lr, warmup, clip, end_lr):
    argv = ["--method", "sentence_gist", "--init_from", str(tmp_path / "hf"), "--stage", str(stage)]
    (cfg, mcfg), explicit = train.parse_args(argv, train.TrainConfig, sg.SentenceGistConfig)
    train.resolve(cfg, mcfg, explicit, sg.SentenceGist)  # a real checkpoint: the paper's values
    assert (cfg.max_iters, cfg.lr, int(cfg.warmup_frac * cfg.max_iters), cfg.grad_clip) == (iters, lr, warmup, clip)
    assert (cfg.weight_decay, cfg.objective) == (0.1, "lm")
    schedule = "linear" if stage == 3 else "cosine"
    assert train.lr_at(warmup - 1, cfg, schedule) == lr and abs(train.lr_at(iters, cfg, schedule) - end_lr) < 1e-12
    (cfg, mcfg), explicit = train.parse_args(argv + ["--grad_clip", "0.5"], train.TrainConfig, sg.SentenceGistConfig)
    train.resolve(cfg, mcfg, explicit, sg.SentenceGist)
    assert cfg.grad_clip == 0.5  # a flag wins over the preset


def test_ratio_one_in_any_spelling_and_an_empty_objective_are_the_defaults():
    """--ratio 01 is 1 (it was refused); --objective "" is every stage, as its help says (it was refused)."""
    def stages(*flags):
        cfg, mcfg, explicit, cls = train.configure(["--method", "sentence_gist", *flags])
        resolved = train.resolve(cfg, mcfg, explicit, cls)
        for c, m, _ in resolved:
            train.check_stage(c, m, cls)
        return [(c.objective, train.ratios_of(c.ratio), m.stage) for c, m, _ in resolved]
    assert stages("--ratio", "01") == stages("--objective", "") == stages()


def test_init_from_a_stage_runs_the_stages_after_it(tmp_path):
    """--init_from a stage's run dir runs the paper's stages after that one (all three are `lm`: stage 2's dir ran
    stage 2 again, then 3); the last stage's, that stage again (it ran all three)."""
    for done, after in ((1, [2, 3]), (2, [3]), (3, [3])):
        stage_dir = tmp_path / f"stage{done}"
        stage_dir.mkdir()
        (stage_dir / "run.json").write_text(json.dumps({"train": {"method": "sentence_gist", "objective": "lm",
                                                                  "ratio": "1", "init_from": str(tmp_path / "hf")},
                                                        "method": {"stage": done}}))
        argv = ["--method", "sentence_gist", "--init_from", str(stage_dir)]
        (cfg, mcfg), explicit = train.parse_args(argv, train.TrainConfig, sg.SentenceGistConfig)
        assert [m.stage for _, m, *_ in train.resolve(cfg, mcfg, explicit, sg.SentenceGist)] == after


@pytest.mark.parametrize("flags, message", [
    (["--gists", "3"], "--gists 3"), (["--gists", "0"], "--gists 0"), (["--stage", "4"], "--stage 4"),
    (["--max_sentence_len", "0"], "--max_sentence_len 0"), (["--ratio", "8"], "--ratio 8 does not apply"),
    (["--eval_ratio", "4"], "--eval_ratio 4 does not apply"),
    (["--ratio", "0"], "every ratio must be a positive"), (["--no_linear"], "--no_linear does not apply"),
])
def test_bad_input_in_process(base_dir, tmp_path, flags, message):
    """(A check that fails trains one step in tmp_path, not the recipe's steps in the repo's out/.)"""
    assert message in cli_error(["--method", "sentence_gist", "--init_from", base_dir, "--max_iters", 1,
                                 "--out_dir", tmp_path, *flags])


# --- end to end -----------------------------------------------------------------------


@pytest.mark.slow
def test_method_smoke_llama_lm(tmp_path):
    out = method_smoke(tmp_path, "sentence_gist", extra=["--gists", "2", "--lora_r", "4", "--lora_alpha", "8",
                                                          "--max_sentence_len", "16"])
    row = json.loads((out / "metrics.json").read_text())["rows"][0]  # perplexity rides along in the QA table
    assert row["ppl_compressed"] > 1 and row["ppl_full"] > 1 and row["ppl_ratio"] > 1


@pytest.mark.slow
def test_ddp_matches_one_process(base_dir, tmp_path):
    # the default objective on a base that is not ours (lm); --lr 1e-3: Adam amplifies float noise of ~0 grads
    args = ["--method", "sentence_gist", "--init_from", base_dir, "--stage", 2, "--lora_r", 16, "--max_iters", 2,
            "--lr", "1e-3", "--device", "cpu", "--quiet", "--eval_examples", 0, "--max_context", 128]
    torchrun(args + ["--batch_size", 2, "--out_dir", tmp_path / "ddp"])  # the global batch, 1 per rank
    train.main([str(a) for a in args + ["--batch_size", 2, "--out_dir", tmp_path / "one"]])  # one rank, in this process
    a, b = read_params(tmp_path / "ddp"), read_params(tmp_path / "one")
    assert set(a) == set(b) and any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=DDP_ATOL), k


def test_a_stage_flag_on_the_tiny_base_takes_that_stages_lr_end():
    """--stage 3 on the tiny base: TINY's values over Table 3's stage 3, whose lr decays linearly to 0."""
    for stage, end in ((None, 0.5), (3, 0.0)):
        argv = ["--method", "sentence_gist", "--max_iters", 10] + (["--stage", stage] if stage else [])
        cfg, mcfg, explicit, cls = train.configure([str(a) for a in argv])
        (c, m, sources), = train.resolve(cfg, mcfg, explicit, cls)
        assert (m.stage, c.min_lr_frac, c.lr, sources["min_lr_frac"]) == (stage or 2, end, sg.SentenceGist.TINY["lr"],
                                                                           "tiny")
        assert train.lr_at(10, c, "linear" if m.stage == 3 else "cosine") == pytest.approx(c.lr * end)


@pytest.mark.slow
def test_memory_round_trip_one_shot_and_stage_chain(base_dir, tmp_path):
    s1, s3 = tmp_path / "stage1", tmp_path / "stage3"
    common = ["--method", "sentence_gist", "--init_from", base_dir, "--max_iters", 2, "--batch_size", 2,
              "--device", "cpu", "--quiet", "--eval_examples", 2, "--objective", "qa"]
    run(common + ["--stage", "1", "--out_dir", s1])
    run(common[:3] + [s1] + common[4:] + ["--stage", "3", "--out_dir", s3])
    cfg, mcfg, tok, base, method = train.load_run(str(s3))
    assert mcfg.stage == 3 and method.lr_schedule == "linear"
    built = train.build(train.TrainConfig(**{**vars(cfg), "init_from": str(s1)}), mcfg, "cpu", torch.float32)[2]
    assert torch.equal(built.gist.detach(), read_params(s1)["gist"])  # stage 3 starts from stage 1's rows
    batch = data.collate_qa(tiny.Synthetic(seed=0, split="test").qa_examples(2), tok, pad_multiple=1)
    outs, memory = evaluate.answer(method, batch, 1, 8, data.stop_ids(tok))
    memory.save(str(tmp_path / "m.safetensors"))
    prompts = [batch["qa"][b, :batch["prompt_len"][b]].tolist() for b in range(2)]
    loaded = Memory.load(str(tmp_path / "m.safetensors"))
    assert method.answer_from_memory(loaded, prompts, 8, data.stop_ids(tok)) == outs
    (tmp_path / "ctx.txt").write_text(batch["records"][0]["context"])
    q = batch["records"][0]["question"]
    a = run([s3, "--context", tmp_path / "ctx.txt", "--question", q, "--save_memory", tmp_path / "doc.mem"],
            script="eval.py")
    b = run([s3, "--memory", tmp_path / "doc.mem", "--question", q], script="eval.py")
    answer = [line for line in a.stdout.splitlines() if line.startswith("answer:")]
    assert answer and answer == [line for line in b.stdout.splitlines() if line.startswith("answer:")]
