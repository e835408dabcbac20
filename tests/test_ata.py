"""ata.py: encoder prompt, policy (eq. 5), Huber (eq. 10), "compute k_max, keep k" equals
"append k", the objectives and ablations, Memory round trips, bad input, the real-checkpoint
path and DDP."""
import collections
import json
import warnings
from types import SimpleNamespace

import pytest
import torch

import ata
import data
import tiny
import eval as evaluate
import train
from conftest import ASSETS
from common import cli_error, method_smoke, read_params, run, squad_file, torchrun
from model import Memory, Transformer




def _method(base_dir, objective="qa+rel", n=3, **kw):
    tok = data.load_tokenizer(base_dir)
    base = Transformer.from_pretrained(base_dir)
    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(0)
    m = ata.ATA(base, ata.ATAConfig(lora_r=4, lora_dropout=0.0, **kw), tok, train.TrainConfig(objective=objective, ratio="10"))
    for name, p in m.named_parameters():  # non-zero adapters so the encoder is not the base
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    recs = tiny.Synthetic(0, "val").qa_examples(n, n_people=(2, 4))
    return m, m.prepare(data.collate_qa(recs, tok, pad_multiple=8))


def test_encoder_prompt_three_chunks():
    got = ata.encoder_prompt("Who won?", ["Ann ran.", "Bob won the race.", "Cid slept."])
    assert got == ("<QUESTION> Who won? </QUESTION> <CONTEXT> <PA> Ann ran. </PA> <PA> Bob won the race. </PA> "
                   "<PA> Cid slept. </PA> </CONTEXT> <INST> Please identify and extract the <PA> sections that "
                   "can answer the question (which may not be unique) </INST>")


def test_policy_hand_cases():
    L = torch.tensor([-5.0, 0.0, 0.4, 10.0, 10.1, 35.0, 80.0, 81.0, 1000.0])
    assert ata.policy(L, 10, 8).tolist() == [1, 1, 1, 1, 2, 4, 8, 8, 8]  # ceil, floor 1, cap 8
    assert ata.policy(torch.tensor([3.0, 7.2, 9.0]), 1, 8).tolist() == [3, 8, 8]
    assert ata.policy(torch.tensor([120.0, 49.0]), 50, 8).tolist() == [3, 1]


def test_huber_hand_values():
    pred, gold = torch.tensor([3.0, -30.0, 10.0, 12.0]), torch.tensor([0.0, 0.0, 0.0, 20.0])
    # 0.5*3^2 = 4.5 ; 10*(30 - 5) = 250 ; 0.5*10^2 = 50 (|x| = delta) ; 0.5*8^2 = 32
    assert ata.huber(pred, gold, 10.0).item() == pytest.approx(4.5 + 250 + 50 + 32)
    assert ata.huber(torch.tensor([7.0]), torch.tensor([0.0]), 2.0).item() == pytest.approx(2 * (7 - 1))


def test_encoder_adapter_and_parameters(base_dir):
    m, _ = _method(base_dir, k_max=5, lora_alpha=8)
    assert m.base.adapter_configs["encoder"] == dict(r=4, alpha=8, dropout=0.0, targets=sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))  # all linear layers
    trainable = {n for n, p in m.named_parameters() if p.requires_grad}
    assert m.comp.shape == (5, 64) and all("lora_" in n or not n.startswith("base.") for n in trainable)


def test_prepare_prompt_target_and_gold_length(base_dir):
    m, batch = _method(base_dir)
    tok, rec = m.tok, batch["records"][0]
    T = batch["enc_ids"].shape[1]
    ids = batch["enc_ids"][0, T - batch["enc_len"][0]:].tolist()  # left-padded
    assert ids == tok.encode(ata.encoder_prompt(rec["question"], rec["chunks"]), bos=True)
    assert tok.decode(ids).endswith("</INST>") and batch["enc_ids"][0, :T - batch["enc_len"][0]].eq(tok.pad_id).all()
    gold = tok.encode(rec["relevant"][0])  # the asked person's biography
    assert batch["rel_len"][0] == len(gold)
    assert batch["rel_ids"][0, :len(gold) + 2].tolist() == [tok.bos_id] + gold + tok.eos_ids[:1]
    assert batch["rel_labels"][0, :len(gold) + 2].tolist() == gold + tok.eos_ids[:1] + [-100]
    _, whole = _method(base_dir, no_selective=True)
    assert whole["rel_len"][0] == len(tok.encode(" ".join(rec["chunks"]))) > batch["rel_len"][0]


def test_compute_kmax_keep_k_equals_append_k(base_dir):
    m, batch = _method(base_dir)
    with torch.no_grad():
        h8, kv8 = m.encode(batch)  # all k_max = 8
        for k in range(1, 9):
            hk, kvk = m.encode(batch, n=k)  # append only k
            for (k8, v8), (kk, vk) in zip(kv8, kvk):  # every layer
                assert torch.allclose(k8[:, :, :k], kk, atol=1e-5) and torch.allclose(v8[:, :, :k], vk, atol=1e-5)
            assert torch.allclose(h8, hk, atol=1e-5)  # the probe's input does not see compression tokens
        kb = torch.tensor([2, 5, 8])  # per-example k through the validity mask
        keep = m.memory(kv8, kb, batch["enc_len"])
        assert keep.slots().tolist() == [2, 5, 8] and (keep.next_pos == batch["enc_len"] + kb).all()
        with m.base.adapter(None):
            got = m.base(batch["qa"], memory=keep)
            for b, k in enumerate(kb.tolist()):
                one = {key: batch[key][b:b + 1] for key in ("enc_ids", "enc_len", "qa")}
                mem = m.memory(m.encode(one, n=k)[1], torch.tensor([k]), one["enc_len"])
                assert torch.allclose(got[b:b + 1], m.base(one["qa"], memory=mem), atol=1e-4)


def test_loss_terms_and_ablations(base_dir):
    m, batch = _method(base_dir, objective="rel", rel_ratios="1000", huber_lambda=0.0)
    loss0, n, metrics = m(batch, [10])
    assert metrics["k_rel"] == 1.0 and "qa_ce" not in metrics  # r = 1000: one slot each
    assert n == int((batch["rel_labels"] != -100).sum())
    m.cfg.huber_lambda, m.cfg.huber_delta = 0.5, 3.0
    with torch.no_grad():
        L_hat = m.length(batch, m.encode(batch)[0])
    loss1, _, _ = m(batch, [10])
    assert (loss1 - loss0).item() == pytest.approx(0.5 * ata.huber(L_hat, batch["rel_len"], 3.0).item(), rel=1e-4)
    m.cfg.no_aac = True
    assert m(batch, [10])[2]["k_rel"] == 6.0  # w/o AAC: the fixed k of Table 2 (6.00)
    m, batch = _method(base_dir, objective="qa+rel", k_max=3)
    loss, n, metrics = m(batch, [1])
    assert metrics["k_qa"] == 3.0 and n == int((batch["rel_labels"] != -100).sum() + (batch["qa_labels"] != -100).sum())
    loss.backward()
    for name in ("comp", "probe.mlp.2.weight", "base.model.layers.0.self_attn.qkv_proj.lora_A.encoder"):
        assert dict(m.named_parameters())[name].grad.abs().sum() > 0, name


def test_qa_trains_the_encoder_on_eq_11_alone(base_dir):
    """eq. 11 (qa) has no probe term: lam * Huber trains the probe on detached states and leaves the encoder's gradient
    as CE's; in rel (eq. 8) it reaches the encoder, but not under --no_aac (Table 2's "w/o AAC" has no controller:
    it did)."""
    lora = "base.model.layers.0.self_attn.qkv_proj.lora_A.encoder"
    for objective, flags, reaches in (("qa", {}, False), ("rel", {}, True), ("rel", {"no_aac": True}, False)):
        grads = []
        for lam in (0.0, 0.5):
            m, batch = _method(base_dir, objective=objective, huber_lambda=lam, **flags)
            m(batch, [10])[0].backward()
            params = dict(m.named_parameters())
            grads.append(params[lora].grad.clone())
            assert bool(params["probe.mlp.2.weight"].grad.abs().sum() > 0) == (lam > 0)
            unused = [k for k, p in params.items() if p.requires_grad and p.grad is None]  # (DDP fails on one)
            assert not unused, (objective, unused)
        assert torch.allclose(grads[0], grads[1]) != reaches, objective


def test_no_aac_fixed_k_is_a_flag_with_the_papers_value(base_dir):
    """Issue 20 item 10: Table 2's "w/o AAC" row uses k = 6.00, not k_max = 8."""
    m, batch = _method(base_dir, objective="qa+rel", no_aac=True)
    assert m.cfg.fixed_k == 6 and m.cfg.k_max == 8
    with torch.no_grad():
        metrics = m(batch, [10])[2]
        assert metrics["k_rel"] == metrics["k_qa"] == 6.0
        P = len(batch["prefix"])  # the prefix's slots lead the memory (issue 76: as in every method)
        assert m.compress(batch, 10).slots().tolist() == [P + 6] * 3  # the probe is not consulted
        m.cfg.fixed_k = 3
        assert m(batch, [10])[2]["k_rel"] == 3.0 and m.compress(batch, 1).slots().tolist() == [P + 3] * 3


def test_start_line_names_the_ratios_each_objective_draws(base_dir):
    """train.py's start line: `rel` draws r from --rel_ratios, `qa` from --ratio, --no_aac none (k = --fixed_k)."""
    assert _method(base_dir, "rel")[0].ratios_text == "rel ratios 1,5,10,20,50"
    assert _method(base_dir, "qa+rel")[0].ratios_text == "qa ratios 10, rel ratios 1,5,10,20,50"
    assert _method(base_dir, "rel", no_aac=True)[0].ratios_text == "k = --fixed_k 6"


def test_r_is_drawn_per_step_for_the_whole_batch(base_dir):
    """Issue 20 item 8: r is drawn "for each training batch" (§C), a pure function of (seed,
    step): one example meets different r over the steps; every micro-batch of a step (and
    every rank) shares one r; the same step gives the same r again (--resume)."""
    choices = [1, 5, 10, 20, 50]
    rs = [ata.draw_ratio(choices, 1337, s, "rel") for s in range(40)]
    assert rs == [ata.draw_ratio(choices, 1337, s, "rel") for s in range(40)] and set(rs) == set(choices)
    assert rs != [ata.draw_ratio(choices, 7, s, "rel") for s in range(40)]
    m, batch = _method(base_dir, objective="rel", huber_lambda=0.0)
    lo, hi = rs.index(1), rs.index(50)
    with torch.no_grad():  # the same batch: r = 1 at one step, r = 50 at another
        k_lo, k_hi = (m(dict(batch, step=s), [10])[2] for s in (lo, hi))
    L = batch["rel_len"].float()
    assert (k_lo["r_rel"], k_hi["r_rel"]) == (1, 50)
    assert k_lo["k_rel"] == ata.policy(L, 1, 8).float().mean().item()
    assert k_hi["k_rel"] == ata.policy(L, 50, 8).float().mean().item() < k_lo["k_rel"]
    cfg = train.TrainConfig(method="ata", objective="rel", init_from=base_dir, batch_size=2, grad_accum=2,
                            no_aids=True)
    batches = train.Batches(cfg, m.tok, m)
    for step in (lo, hi):
        micro = batches(step)
        assert [mb["step"] for mb in micro] == [step, step]
        with torch.no_grad():
            assert {m(mb, [10])[2]["r_rel"] for mb in micro} == {rs[step]}


def test_paper_defaults_warmup_steps_and_hotpot_distractors(base_dir, tmp_path):
    """Issue 20 items 7 and 9: on a real checkpoint 300 warmup steps (Tables 4-5) of the recipe's steps
    (--max_iters keeps their share: test_recipe); HotpotQA keeps its distractor paragraphs (explicit flags win)."""
    cfg, mcfg = train.TrainConfig(method="ata", init_from=base_dir), ata.ATAConfig()
    train.resolve(cfg, mcfg, set(), ata.ATA)
    assert cfg.warmup_iters == 300 and cfg.max_iters == 17_500 and cfg.hotpot_distractors and cfg.ratio == "10"
    assert train.lr_at(0, cfg) == pytest.approx(cfg.lr / 300) and train.lr_at(298, cfg) < cfg.lr
    assert train.lr_at(299, cfg) == train.lr_at(999, cfg) == pytest.approx(cfg.lr)  # then constant
    hotpot = tmp_path / "hotpot.json"
    paragraphs = [["A", ["Ann wrote A."]], ["B", ["Ann wrote B."]], ["C", ["Cid slept."]]]  # C: a distractor
    hotpot.write_text(json.dumps([{"_id": "h1", "question": "Who wrote both?", "answer": "Ann",
                                   "supporting_facts": [["A", 0], ["B", 0]], "context": paragraphs}]))
    rec = train.read_records(str(hotpot), cfg)[0]
    assert len(rec["chunks"]) == 3 and len(rec["relevant"]) == 2
    gold_only = train.TrainConfig(method="ata", init_from=base_dir, hotpot_distractors=False, data=str(hotpot))
    train.resolve(gold_only, ata.ATAConfig(), {"hotpot_distractors"}, ata.ATA)
    assert len(train.read_records(str(hotpot), gold_only)[0]["chunks"]) == 2
    squad = squad_file(tmp_path / "squad.json")  # (the flag was read by nothing)
    assert "no --data, --eval_data or --pretrain_data file is HotpotQA" in cli_error(
        ["--method", "ata", "--init_from", base_dir, "--data", squad, "--hotpot_distractors"])
    for given in ([str(hotpot)], [squad, "--eval_data", str(hotpot)], [squad, "--hotpot_distractors", "false"]):
        train.check_run_flags(*train.configure(["--method", "ata", "--hotpot_distractors", "--data", *given])[::2])
    tiny_cfg = train.TrainConfig(method="ata")  # the shipped tiny base: a short run, a short warmup
    train.resolve(tiny_cfg, ata.ATAConfig(), set(), ata.ATA)
    assert tiny_cfg.warmup_iters < tiny_cfg.max_iters // 10


def test_training_batch_with_every_chunk_relevant_warns(base_dir):
    """Issue 20 item 7: gold-only contexts make selective reconstruction --no_selective."""
    m, _ = _method(base_dir)
    one = tiny.Synthetic(0, "val").qa_examples(3, n_people=(1, 1))  # one biography, the relevant one
    assert all(len(r["chunks"]) == 1 for r in one)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.prepare(data.collate_qa(one, m.tok, pad_multiple=8))  # the synthetic default (no --data): none
    m.run.data = "gold_only.json"  # stands for a user's file
    with pytest.warns(UserWarning, match="every chunk"):
        m.prepare(data.collate_qa(one, m.tok, pad_multiple=8))
    many = tiny.Synthetic(0, "val").qa_examples(3, n_people=(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.prepare(data.collate_qa(many, m.tok, pad_multiple=8))  # distractors: no warning
        m.eval()
        m.prepare(data.collate_qa(one, m.tok, pad_multiple=8))  # eval of a one-chunk document: none
        m.train()
        m.cfg.no_selective = True
        m.prepare(data.collate_qa(one, m.tok, pad_multiple=8))  # the ablation means it


def test_training_batch_whose_gold_chunk_is_cut_warns(base_dir):
    """§4.1.4 keeps only inputs within the limit; a context cut before its every relevant chunk is said."""
    m, _ = _method(base_dir)
    recs = tiny.Synthetic(0, "val").qa_examples(8, n_people=(3, 4))
    m.run.max_context = 12  # one biography's first tokens: most gold chunks lie past it
    batch = data.collate_qa(recs, m.tok, max_context=12, pad_multiple=8)
    lost = sum(not idx for idx in batch["relevant_idx"])
    assert lost > 0
    with pytest.warns(UserWarning, match=f"{lost} example\\(s\\) of this training batch keep no relevant chunk"):
        m.prepare(batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m.eval()
        m.prepare(data.collate_qa(recs, m.tok, max_context=12, pad_multiple=8))  # evaluation: the row says it
    m.train()
    unmarked = [dict(r, relevant=[]) for r in recs[:3]]  # (MS MARCO: no passage selected)
    with pytest.warns(UserWarning, match="3 example\\(s\\) of this training batch keep no relevant chunk: C_rel"):
        m.prepare(data.collate_qa(unmarked, m.tok, pad_multiple=8))


def test_fit_chunks_drops_chunks_that_are_not_relevant_in_a_seeded_order():
    """§4.1.4 keeps only inputs within the limit: a longer record loses chunks that are not relevant, in an order its
    id seeds (last first left the gold chunk last), each kept one after its own separator, and one whose relevant
    chunks alone exceed it goes (hand-counted)."""
    rec = {"context": "> A a.\nB bb.\nC c.\nD dd. <", "chunks": ["A a.", "B bb.", "C c.", "D dd."],
           "relevant": ["B bb."], "question": "?"}  # 25 characters
    chars = SimpleNamespace(encode=list)  # a token a character
    size, chunk_size = (lambda r: len(r["context"])), (lambda c: len(c) + 1)  # noqa: E731
    assert data.keep_chunks(rec, {1, 3})["context"] == "> B bb.\nD dd. <"
    dropped = collections.Counter()
    for i in range(40):
        for limit in (25, 24, 14, 13, 9):  # any one chunk off fits 24; 14 takes two, unless A and C went first
            (got,), trimmed = data.fit_chunks([dict(rec, id=str(i))], chars, limit, size, chunk_size)
            assert len(got["context"]) <= limit and trimmed == (limit < 25) and got["relevant"] == ["B bb."]
            assert data.chunk_ends(got["context"], got["chunks"])  # the chunks in the new context, in order
            assert got == data.fit_chunks([dict(rec, id=str(i))], chars, limit, size, chunk_size)[0][0]  # seeded
            if limit == 24:
                dropped.update(set(rec["chunks"]) - set(got["chunks"]))
            assert limit > 13 or got["context"] == "> B bb. <"
    assert sorted(dropped) == ["A a.", "C c.", "D dd."] and min(dropped.values()) >= 5, dropped  # (last first: D)
    assert data.fit_chunks([rec], chars, 8, size, chunk_size) == ([], 0)  # (counted: kept ones only)
    whole = dict(rec, relevant=None)  # every chunk relevant: nothing to drop
    assert data.fit_chunks([whole, dict(whole, chunks=None)], chars, 24, size, chunk_size) == ([], 0)
    assert data.fit_chunks([whole, rec], chars, 25, size, chunk_size) == ([whole, rec], 0)
    unmarked = dict(rec, relevant=[])  # (MS MARCO, no passage selected): it lost every chunk and trained on nothing
    assert data.fit_chunks([unmarked], chars, 24, size, chunk_size) == ([], 0)
    prompt = lambda r: 2 + sum(map(len, r["chunks"]))  # noqa: E731  (a prompt of the chunks alone, not the lead)
    lead = dict(rec, context="a long lead of forty characters or so ... " + rec["context"])
    assert data.fit_chunks([lead], chars, 24, prompt, chunk_size) == ([], 0)  # collate_qa would cut its gold chunk


def test_training_records_fit_max_context_on_hotpotqa():
    """Real HotpotQA with its distractors and Llama 2's tokenizer: the cut context had lost every gold paragraph of
    a third of the records at 600 tokens; now each kept record's encoder input fits and keeps its gold paragraphs."""
    path = ASSETS / "qa" / "hotpotqa" / "hotpot_dev_distractor_v1_first53.json"
    if not path.exists():
        pytest.skip(f"asset {path} not present")
    tok = data.load_tokenizer(str(ASSETS / "tokenizers" / "llama2_tokenizer.model"))
    records = data.read_dataset(str(path), distractors=True)
    m = SimpleNamespace(tok=tok, run=SimpleNamespace(max_context=600))
    kept, note = ata.ATA.training_records(m, records)
    assert len(kept) > len(records) // 2 and note.startswith(f"ata: {len(kept)} of {len(records)} training records")
    ids = [r["id"] for r in records]
    assert [ids.index(r["id"]) for r in kept] == sorted(ids.index(r["id"]) for r in kept)  # in order
    stats = {}
    for r in kept:
        assert 1 + len(tok.encode(ata.encoder_prompt(r["question"], r["chunks"]))) <= 600
        assert all(g in r["chunks"] for g in r["relevant"])
        assert len(data.collate_qa([r], tok, max_context=600, stats=stats)["relevant_idx"][0]) == len(r["relevant"])
    assert not stats and sum(len(r["chunks"]) > len(r["relevant"]) for r in kept) > len(kept) // 2  # distractors too


def test_a_run_trains_on_the_records_within_max_context(base_dir, tmp_path, capsys):
    """train.py filters ata's training records (a note), and one whose gold paragraphs alone do not fit is an error."""
    hotpot = tmp_path / "hotpot.json"
    paragraphs = [["A", ["Ann wrote A."]], ["B", ["Ann wrote B."]], ["C", ["Cid slept in a long chair all day."]]]
    hotpot.write_text(json.dumps([{"_id": "h1", "question": "Who wrote both?", "answer": "Ann",
                                   "supporting_facts": [["A", 0], ["B", 0]], "context": paragraphs}]))
    tok = data.load_tokenizer(base_dir)
    gold = 1 + len(tok.encode(ata.encoder_prompt("Who wrote both?", ["A: Ann wrote A.", "B: Ann wrote B."])))
    run = ["--method", "ata", "--init_from", base_dir, "--data", hotpot, "--hotpot_distractors", "--max_iters", 1,
           "--batch_size", 1, "--eval_examples", 0, "--quiet", "--out_dir", tmp_path / "run"]
    assert cli_error(run + ["--max_context", gold - 1]) == (
        f"error: ata: 0 of 1 training records fit --max_context {gold - 1} tokens (§4.1.4), 0 after dropping "
        "chunks that are not relevant")
    with pytest.warns(UserWarning, match="every chunk of this training batch is relevant"):  # (room for no distractor)
        train.main([str(a) for a in run + ["--max_context", gold]])
    assert f"ata: 1 of 1 training records fit --max_context {gold} tokens" in capsys.readouterr().out


def test_probe_runs_in_fp32_under_autocast():
    torch.manual_seed(0)
    probe, h = ata.Probe(16, 32), torch.randn(2, 5, 16)
    valid = torch.tensor([[False, True, True, True, True], [True] * 5])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = probe(h.bfloat16(), valid)
    assert auto.dtype == torch.float32
    assert torch.equal(auto, probe(h.bfloat16().float(), valid))  # bf16 would round L^_rel to 0.25-2 tokens


def test_answer_stats_and_memory_round_trip(base_dir, tmp_path):
    m, batch = _method(base_dir)
    outs, memory = evaluate.answer(m, batch, 10, 6, data.stop_ids(m.tok))
    k = torch.tensor(memory.stats["k"])
    with torch.no_grad():
        L_hat = m.length(batch, m.encode(batch)[0])
    assert k.tolist() == ata.policy(L_hat, 10, 8).float().tolist() and (memory.slots() == len(batch["prefix"]) + k).all()
    assert memory.stats["probe_abs_err"] == pytest.approx((L_hat - batch["rel_len"]).abs().tolist(), rel=1e-5)
    memory.save(tmp_path / "m.safetensors")
    prompts = [batch["qa"][b, :batch["prompt_len"][b]].tolist() for b in range(3)]
    loaded = Memory.load(tmp_path / "m.safetensors")
    assert evaluate.answer_from_memory(m, loaded, prompts, 6, data.stop_ids(m.tok)) == outs


@pytest.mark.slow
def test_eval_one_shot_save_and_load_memory(base_dir, tmp_path):
    out = tmp_path / "run"
    train.main(["--method", "ata", "--init_from", base_dir, "--max_iters", "2", "--batch_size", "2", "--out_dir",
                str(out), "--eval_examples", "2", "--lora_r", "4", "--quiet"])
    doc = tmp_path / "doc.txt"
    doc.write_text("Ada Lovelace lives in Paris. Ada Lovelace works for Acme Labs.")
    q = "Where does Ada Lovelace live?"
    first = run([out, "--context", doc, "--question", q, "--save_memory", tmp_path / "doc.mem"], script="eval.py")
    again = run([out, "--memory", tmp_path / "doc.mem", "--question", q], script="eval.py")
    answer = [line for line in first.stdout.splitlines() if line.startswith("answer:")]
    assert answer and answer == [line for line in again.stdout.splitlines() if line.startswith("answer:")]
    other = run([out, "--memory", tmp_path / "doc.mem", "--question", "Who employs Ada Lovelace?"], script="eval.py",
                check=False)  # the encoder read the first question (the selective prompt): not this one's memory
    assert other.returncode == 1 and other.stderr == (f"error: --memory {tmp_path / 'doc.mem'} was compressed for the "
                                                      f"question {q!r}: a --method ata encoder reads the question; "
                                                      "compress the --context again for another\n"), other.stderr
    rows = evaluate.main([str(out), "--ratio", "5,20", "--n", "2"])[0]["rows"]  # policy r changed without retraining
    assert [r["ratio_requested"] for r in rows] == [5, 20] and all("k" in r and "probe_abs_err" in r for r in rows)


@pytest.mark.parametrize("args, msg", [(["--ratio", "0"], "--ratio"), (["--no_linear"], "--no_linear")])
def test_bad_input_one_line_error(base_dir, tmp_path, args, msg):
    assert msg in cli_error(["--method", "ata", "--init_from", base_dir, "--out_dir", tmp_path / "x", *args])
    assert not (tmp_path / "x").exists()  # before any work


@pytest.mark.parametrize("args, msg", [(["--k_max", "0"], "--k_max"), (["--rel_ratios", "5,x"], "--rel_ratios"),
                                       (["--rel_ratios", "5,0"], "--rel_ratios"),
                                       (["--rel_ratios", "5,5"], "distinct integers in 1..2^20"),
                                       (["--rel_ratios", "1" + "0" * 20], "distinct integers in 1..2^20"),  # overflow
                                       (["--objective", "kd"], "--objective"),
                                       (["--no_aac", "--fixed_k", "9", "--max_iters", "1"], "--fixed_k"),
                                       (["--no_aac", "--k_max", "4", "--max_iters", "1"], "--fixed_k"),
                                       (["--fixed_k", "3", "--max_iters", "1"], "--fixed_k 3 applies under --no_aac"),
                                       (["--fixed_k", "6"], "--fixed_k 6 applies under --no_aac"),  # (the default)
                                       (["--no_aac", "--ratio", "4,8"], "one ratio to train and read at"),  # (one
                                       (["--no_aac", "--eval_ratio", "4,50"], "--eval_ratio '4,50'"),  # row twice)
                                       (["--no_aac", "--eval_ratio", "5"], "not --ratio '10' --eval_ratio '5'")])
def test_bad_method_flags(base_dir, tmp_path, args, msg):  # in process: the same SystemExit line, no start-up cost
    with pytest.raises(SystemExit) as e:
        train.main(["--method", "ata", "--init_from", base_dir, "--out_dir", str(tmp_path / "x"), *args])
    assert str(e.value).startswith("error:") and msg in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_real_checkpoint_smoke(tmp_path):
    out = method_smoke(tmp_path, "ata", extra=["--lora_r", "4", "--objective", "rel", "--no_selective"])
    row = json.load(open(out / "metrics.json"))["rows"][0]
    assert 1 <= row["k"] <= 8 and row["probe_abs_err"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["qa+rel", "qa"])
def test_ddp_matches_single_process(base_dir, tmp_path, objective):
    common = ["--method", "ata", "--init_from", base_dir, "--max_iters", "2", "--lora_r", "4", "--lora_dropout", "0",
              "--eval_examples", "0", "--lr", "1e-3", "--objective", objective, "--quiet"]
    torchrun(common + ["--batch_size", 2, "--out_dir", tmp_path / "ddp"])  # the global batch, 1 per rank
    train.main(common + ["--batch_size", "2", "--out_dir", str(tmp_path / "one")])
    a, b = read_params(tmp_path / "ddp"), read_params(tmp_path / "one")
    assert a.keys() == b.keys() and len(a) > 3
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-5), key
