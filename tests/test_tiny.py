"""tiny.py: the embedded default's base (its targets, curriculum), the compressors'
curriculum, the attention-distillation aid, and the shipped tiny_base/."""
import json

import pytest
import torch

import tiny
import train
from test_meanpool import _method


def test_base_attention_targets(tmp_path):
    """collate_base's supervision targets: point keys hold the answer token the query
    predicts, inside the asked person's biography (every answer token is found there:
    "." is its own token, so a date ending a sentence reads as in the answer); bind keys
    hold the asked last name and precede their query."""
    import random
    import data
    from common import default_tokenizer
    tok = default_tokenizer(tmp_path)
    rng = random.Random(0)
    syn = tiny.Synthetic(0, "train")
    exs = [dict(syn.example(rng, 4, 3, n_questions=4), template=i) for i in range(6)]
    batch = tiny.collate_base(exs, tok, 0.3)
    ids, labels = batch["ids"], batch["labels"]
    n_answer_tokens = sum(len(tok.encode(" " + a, start=False)) for ex in exs for _, a in ex["qas"])
    assert len(batch["point_rows"]) == n_answer_tokens  # every answer token, none for the end of text
    for r, p, keys in zip(batch["point_rows"], batch["point_pos"], batch["point_keys"]):
        assert keys.any() and (ids[r, keys] == labels[r, p]).all() and keys.nonzero().max() < p
    lasts = {tok.encode(" " + name.split()[-1], start=False)[0] for ex in exs for name in ex["qa_people"]}
    assert len(batch["bind_rows"]) > 24
    for r, p, keys in zip(batch["bind_rows"], batch["bind_pos"], batch["bind_keys"]):
        assert keys.any() and keys.nonzero().max() < p and set(ids[r, keys].tolist()) <= lasts
        assert len(set(ids[r, keys].tolist())) == 1  # one person's name per query
    # the point keys of the first question sit in its person's biography, not elsewhere
    ex, ctx = exs[0], data.format_qa(tok, exs[0]["context"], *exs[0]["qas"][0], chunks=exs[0]["chunks"])
    lo, hi = ctx["chunk_spans"][ex["chunks"].index(ex["qa_relevant"][0])]
    keys = batch["point_keys"][0].nonzero().flatten() - 1  # minus [BOS]
    assert ((keys >= lo) & (keys < hi)).all()


def test_base_head_nll_is_the_attention_mass(base_dir):
    """Base.head_nll equals -log of the attention mass read from the model's own attention
    (SDPA with one-hot values returns the attention weights)."""
    import torch.nn.functional as F
    from model import Transformer, apply_rope
    base = Transformer.from_pretrained(base_dir)
    method = tiny.Base(base, tiny.BaseConfig(), None, None)
    torch.manual_seed(0)
    ids = torch.randint(4, 200, (2, 12))
    base(ids)
    rows, pos = torch.tensor([0, 1, 1]), torch.tensor([5, 11, 3])
    keys = torch.zeros(3, 12, dtype=torch.bool)
    keys[0, [1, 4]] = keys[1, [0, 7, 11]] = keys[2, 2] = True
    layer = base.config.num_hidden_layers - 1
    att = base.model.layers[layer].self_attn
    x, cos, sin = method.layer_inputs[layer][:3]
    q = apply_rope(att.qkv_proj(x, "q_proj").view(2, 12, att.H, att.hd).transpose(1, 2), cos, sin)
    k = apply_rope(att.qkv_proj(x, "k_proj").view(2, 12, att.Hkv, att.hd).transpose(1, 2), cos, sin)
    weights = F.scaled_dot_product_attention(q, k, torch.eye(12).expand(2, att.Hkv, 12, 12), is_causal=True,
                                             enable_gqa=True)  # (B, H, T, T)
    want = -torch.stack([weights[r, 0, p][m].sum().log() for r, p, m in zip(rows, pos, keys)]).mean()
    got = method.head_nll(layer, rows, pos, keys)
    assert torch.allclose(got, want, atol=1e-5), (got, want)


def test_base_curriculum_batches(tmp_path):
    """The base's curriculum: one person first, then two, then up to 8 x 6; short early
    examples come 4 to a batch slot, split evenly over ranks and accumulation steps."""
    from common import default_tokenizer
    tok = default_tokenizer(tmp_path)
    cfg = train.TrainConfig(method="base", max_iters=100, batch_size=8, grad_accum=2)  # global: 2 ranks x 2 x 2
    method = tiny.Base.__new__(tiny.Base)
    method.cfg = tiny.BaseConfig()
    people = {}
    for step in (0, 30, 99):
        items = train.Batches(cfg, tok, method).raw(step, 8)
        people[step] = {len(ex["chunks"]) for ex in items}, len(items)
        for rank in (0, 1):
            micro = train.Batches(cfg, tok, method, rank=rank, world=2)(step)
            assert [len(b["ids"]) for b in micro] == [len(items) // 4] * 2
    assert people[0] == ({1}, 32) and people[30] == ({2}, 32)
    assert people[99][1] == 8 and max(people[99][0]) > 2


def test_compressor_curriculum_batches(tmp_path):
    """Compressors on synthetic data: 1-2 people x 1-3 attributes, 2 to a slot, for the first
    30 % of steps; the eval set's mix (2-8 people, 3-6 attributes) from 70 % on."""
    from common import default_tokenizer
    tok = default_tokenizer(tmp_path)
    cfg = train.TrainConfig(method="meanpool", objective="kd", max_iters=100, batch_size=4)
    batches = train.Batches(cfg, tok, None)
    early, late = batches.raw(10, 16), batches.raw(80, 16)
    sentences = lambda ex: len(ex["chunks"][0].split(". "))
    assert len(early) == 32 and {len(ex["chunks"]) for ex in early} == {1, 2}
    assert max(sentences(ex) for ex in early) <= 3 and all(len(ex["qas"]) == 1 for ex in early)
    assert len(late) == 16 and min(len(ex["chunks"]) for ex in late) >= 2 and max(sentences(ex) for ex in late) >= 3
    assert len(batches(10)[0]["context"]) == 8  # 2 per slot: 2 x batch_size rows


def test_micro_batches_are_the_step_sorted_by_length(tmp_path):
    """A step's examples (each rank's share) are cut into its grad_accum micro-batches by
    context length: the same examples as in one batch, with less padding."""
    from common import default_tokenizer
    tok = default_tokenizer(tmp_path)
    one = train.TrainConfig(method="meanpool", objective="kd", max_iters=100, batch_size=8)
    split = train.TrainConfig(method="meanpool", objective="kd", max_iters=100, batch_size=8, grad_accum=2)
    whole, micro = train.Batches(one, tok, None)(80), train.Batches(split, tok, None)(80)
    lengths = [b["context_len"].tolist() for b in micro]
    assert sorted(lengths[0] + lengths[1]) == sorted(whole[0]["context_len"].tolist())
    assert max(lengths[0]) <= min(lengths[1]) and len(set(lengths[0] + lengths[1])) > 2
    assert sum(b["context"].numel() for b in micro) < whole[0]["context"].numel()


def test_query_agnostic_compressors_read_every_question_of_a_context(tmp_path):
    """Aid 3: meanpool/pic/sac batches hold all QA pairs of a context after the memory (qa)
    and after the context (full), answers labelled in the same order in both."""
    from common import default_tokenizer
    import data
    tok = default_tokenizer(tmp_path)
    cfg = train.TrainConfig(method="meanpool", objective="kd", max_iters=100, batch_size=4)
    method = type("MeanPool", (), {"compress": None})()  # a compressor blind to the question
    batches = train.Batches(cfg, tok, method)
    items = sorted(batches.raw(90, 4), key=lambda ex: len(ex["context"]))  # a batch's rows: sorted by length
    b = batches(90)[0]
    for i, ex in enumerate(items):
        assert len(ex["qas"]) == tiny.QUESTIONS
        want = [t for q, a in ex["qas"] for t in tok.encode(" " + a, start=False) + tok.eos_ids[:1]]
        for key in ("qa", "full"):
            lab = b[key + "_labels"][i]
            assert lab[lab != -100].tolist() == want
            row = tok.decode(b[key][i, :b[key + "_len"][i]].tolist())
            assert all(q in row for q, _ in ex["qas"])
    assert train.Batches(cfg, tok, None).questions == 1  # ata, sentence_gist: one question


def test_attention_loss_reads_the_window_of_the_teachers_token(tmp_path):
    """Attention distillation (tiny.py) on meanpool: the teacher's head-0 attention covers only context tokens; a teacher that
    looks at context token j makes the loss -log of the decoder's head-0 attention on slot
    j // r, read from the real decoder pass (SDPA with one-hot values = attention weights)."""
    import torch.nn.functional as F
    from model import apply_rope
    m, batch = _method(tmp_path)
    m.aid = tiny.AttentionDistillation(m, 1.0, max_iters=10)  # per slot in step 0 (tiny.SLOT_STAGE)
    _, (seen, *_) = m.aid.teacher(batch)  # (N, L)
    rows, pos = (batch["qa_labels"] != -100).nonzero(as_tuple=True)
    lens = batch["context_len"][rows]
    assert (seen.sum(-1) > 0.01).all() and (seen.sum(-1) <= 1 + 1e-5).all()
    assert all((seen[n, lens[n]:] == 0).all() for n in range(len(rows)))
    j, r = 5, 4
    onehot = torch.zeros_like(seen)
    onehot[:, j] = 1.0
    with torch.no_grad(), m.base.adapter("decoder"):
        memory = m.compress(batch, r)
        m.base(batch["qa"], memory=memory)
        got = m.aid.memory_loss((onehot, None), memory, batch, r)
        att = m.base.model.layers[m.aid.last].self_attn
        x, cos, sin = m.aid.inputs[m.aid.last][:3]
        B, T, _ = x.shape
        q = apply_rope(att.qkv_proj(x, "q_proj").view(B, T, att.H, att.hd).transpose(1, 2), cos, sin)
        k = apply_rope(att.qkv_proj(x, "k_proj").view(B, T, att.Hkv, att.hd).transpose(1, 2), cos, sin)
    C = memory.embeds.shape[1]
    keys = torch.cat([memory.mask, torch.ones_like(batch["qa"], dtype=torch.bool)], 1)  # (B, T)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None] & keys[:, None]  # (B, T, T)
    weights = F.scaled_dot_product_attention(q, k, torch.eye(T).expand(B, att.Hkv, T, T), attn_mask=mask[:, None],
                                             enable_gqa=True)  # (B, H, T, T)
    want = -weights[rows, 0, pos + C, len(batch["prefix"]) + j // r].log().mean()  # after the BOS slot
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    loss, n, _ = m(batch, [4])  # and the term enters the training loss
    m.aid = None
    assert loss.item() > m(batch, [4])[0].item()


def _repo_files():
    """Every file git sees in the repo, ignored ones included (out/, checkpoints, ...)."""
    import subprocess
    from common import ROOT
    p = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=ROOT,
                       capture_output=True, text=True)
    return {l for l in p.stdout.splitlines() if "__pycache__" not in l and ".pytest_cache" not in l}


@pytest.mark.slow
def test_a_run_on_another_tiny_base_trains_nothing_and_writes_nothing_in_the_repo(tmp_path, monkeypatch):
    """--init_from a tiny base run dir (as the suite's smoke mode does): the shipped base is
    neither trained nor touched, and every file lands under --out_dir."""
    from common import run
    before = _repo_files()
    base, out = tmp_path / "base", tmp_path / "mp"
    run(["--method", "base", "--out_dir", base, "--max_iters", 1, "--batch_size", 2, "--quiet"])
    p = run(["--method", "meanpool", "--init_from", base, "--out_dir", out, "--max_iters", 1, "--batch_size", 2,
             "--eval_examples", 2, "--quiet"], env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert "training the tiny base" not in p.stdout and (out / "metrics.json").exists()
    assert _repo_files() == before
    assert not tiny.needs_training(str(base)) and not tiny.needs_training(str(out))
    monkeypatch.setattr(tiny, "BASE_DIR", str(tmp_path / "deleted"))
    assert tiny.needs_training("") and not tiny.needs_training(str(out))


def test_a_base_stopped_while_a_run_trained_it_is_continued_not_used(tmp_path, monkeypatch, capsys):
    """Ctrl-C as a run trains the deleted shipped base first: that run exits 130 instead of training on the part-
    trained base, and the next run continues the base (--resume) before it starts."""
    base = tmp_path / "tiny_base"
    monkeypatch.setattr(tiny, "BASE_DIR", str(base))
    train.main(["--method", "base", "--out_dir", str(base), "--max_iters", "2", "--batch_size", "2", "--quiet"])
    assert not tiny.needs_training("")
    state = json.load(open(base / "run.json"))
    state["step"] = 1  # as if stopped after step 1 of 2
    (base / "run.json").write_text(json.dumps(state))
    assert tiny.needs_training("")
    mp = ["--method", "meanpool", "--out_dir", str(tmp_path / "mp"), "--max_iters", "1", "--batch_size", "2",
          "--eval_examples", "0", "--quiet"]
    real = train.main
    monkeypatch.setattr(train, "main", lambda argv: None)  # the base's run, interrupted again
    with pytest.raises(SystemExit) as e:
        real(mp)
    assert e.value.code == 130 and "interrupted while training" in capsys.readouterr().err
    assert not (tmp_path / "mp" / "run.json").exists()
    monkeypatch.setattr(train, "main", real)
    real(mp)
    assert f"resuming {base} from step 1" in capsys.readouterr().out and not tiny.needs_training("")
    assert json.load(open(tmp_path / "mp" / "run.json"))["step"] == 1


def test_base_path_stops_at_a_base_run_without_config_and_at_a_loop_of_run_dirs(tmp_path):
    """A `--method base` run dir is its own checkpoint (config.json gone: that dir, which check_files refuses, not
    the shipped base behind its init_from ""); run dirs naming each other end (the walk looped forever)."""
    base, a, b = tmp_path / "base", tmp_path / "a", tmp_path / "b"
    for run, method, init_from in ((base, "base", ""), (a, "meanpool", b), (b, "meanpool", a)):
        run.mkdir()
        (run / "run.json").write_text(json.dumps({"train": {"method": method, "init_from": str(init_from)}}))
    assert tiny.base_path(str(base)) == str(base) and tiny.base_path(str(a)) == str(b)


def _with_aid(base_dir, name, **kw):
    import ata
    import data
    import pic
    import sac
    import sentence_gist
    from model import Transformer
    tok, base = data.load_tokenizer(base_dir), Transformer.from_pretrained(base_dir)
    for p in base.parameters():
        p.requires_grad_(False)
    cls = {"pic": pic.PIC, "sac": sac.SAC, "sentence_gist": sentence_gist.SentenceGist, "ata": ata.ATA}[name]
    m = cls(base, cls.Config(**kw), tok, train.TrainConfig(method=name, objective="qa"))
    m.aid = tiny.AttentionDistillation(m, 1.0)
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(3), tok, pad_multiple=8)
    return m, (m.prepare(batch) if name == "ata" else batch)


def test_slots_follow_each_papers_layout(base_dir):
    """The memory slot the aid credits with a context token: pic's m_t holds chunk c_t; an
    SAC anchor holds itself; a gisted token is held by its sentence's gists, or by itself
    while its sentence is open."""
    from sentence_gist import GIST, TOKEN
    m, batch = _with_aid(base_dir, "pic")
    memory = m.compress(batch, 4)
    L = batch["context"].shape[1]
    assert m.token_slots(batch, memory, 4)[0].tolist() == [min(1 + i // 4, memory.mask.shape[1] - 1)
                                                               for i in range(L)]  # after the BOS slot
    m, batch = _with_aid(base_dir, "sac", lora_r=4, lora_alpha=8)
    memory = m.compress(batch, 4)
    slots = m.token_slots(batch, memory, 4)
    for b, g in enumerate(memory.anchors):
        assert slots[b, g].tolist() == [1 + t for t in range(len(g))]  # after the BOS slot
        assert memory.mask[b, slots[b, :batch["context_len"][b]]].all()
    m, batch = _with_aid(base_dir, "sentence_gist", gists=2)
    rows = [(batch["prefix"], batch["context"][b, :n].tolist(), []) for b, n in enumerate(batch["context_len"])]
    lay = m.layout(rows)
    keys = tiny.gist_keys(lay, batch["context_len"], L, 2)
    for b, n in enumerate(batch["context_len"].tolist()):
        pos = (lay["kind"][b] == TOKEN).nonzero().flatten()[:n]
        for j in range(n):
            k = keys[b, j]
            if lay["sentence"][b, pos[j]] == lay["open"][b]:
                assert (k == pos[j]).all()
            else:
                assert (lay["kind"][b, k] == GIST).all() and (lay["sentence"][b, k] == lay["sentence"][b, pos[j]]).all()
        assert (keys[b, n:] == -1).all()


def test_gist_kv_targets_pair_each_answers_gists_with_its_tokens(base_dir):
    """sentence_gist's K/V target: the N_g gists paired with a QA pair close the sentence that holds
    its answer and stand in a row; each target is an answer token in `full`; the loss is 0 where
    the gists' attention inputs equal the teacher's at those tokens, and positive otherwise."""
    from sentence_gist import GIST, TOKEN
    m, batch = _with_aid(base_dir, "sentence_gist", gists=2)
    rows = [(batch["prefix"], batch["context"][b, :n].tolist(), []) for b, n in enumerate(batch["context_len"])]
    lay = m.layout(rows)
    r, g, t = tiny.gist_answer_pairs(lay, batch, m.tok, 2)
    n_qas = sum(len(rec["qas"]) for rec in batch["records"])
    assert len(r) == 2 * n_qas  # every answer found
    for i in range(0, len(r), 2):
        b, qa = r[i], len([j for j in range(0, i, 2) if r[j] == r[i]])
        answer = m.tok.encode(" " + batch["records"][b]["qas"][qa][1], start=False)
        assert g[i + 1] == g[i] + 1 and (lay["kind"][b, g[i:i + 2]] == GIST).all()
        assert [batch["full"][b, k].item() for k in t[i:i + 2]] == [answer[0], answer[min(1, len(answer) - 1)]]
        tokens = (lay["kind"][b] == TOKEN).nonzero().flatten()  # the context's tokens come first
        last = tokens[t[i] - len(batch["prefix"]) + len(answer) - 1]  # the answer's last token
        assert lay["sentence"][b, g[i]] == lay["sentence"][b, last]
    last_layer = m.aid.last
    x_teacher = torch.randn(*batch["full"].shape, m.base.config.hidden_size)
    x = torch.randn(len(rows), lay["kind"].shape[1], m.base.config.hidden_size)
    m.aid.inputs[last_layer] = (x,)
    assert m.aid.gist_kv_loss(x_teacher, lay, batch).item() > 0.1
    x[r, g] = x_teacher[r, t]
    assert m.aid.gist_kv_loss(x_teacher, lay, batch).item() == pytest.approx(0.0, abs=1e-6)


def test_writer_loss_is_the_mass_compression_tokens_put_on_the_answer(base_dir):
    """ATA's writer loss: -log of the attention mass head 0 of encoder layer L-2 puts from each c_j
    on the answer's tokens in the encoder prompt, read from that layer's own attention (SDPA with
    one-hot values) under the encoder adapter; 0 when no prompt holds the answer."""
    import torch.nn.functional as F
    from model import apply_rope
    m, batch = _with_aid(base_dir, "ata", lora_r=4)
    layer, ids = m.aid.last - 1, batch["enc_ids"]
    with torch.no_grad():
        m.encode(batch)
        got = m.aid.writer_loss(batch)
        x, cos, sin = m.aid.inputs[layer][:3]
        (B, T), S = ids.shape, x.shape[1]
        att = m.base.model.layers[layer].self_attn
        with m.base.adapter("encoder"):
            q = apply_rope(att.qkv_proj(x, "q_proj").view(B, S, att.H, att.hd).transpose(1, 2), cos, sin)
            k = apply_rope(att.qkv_proj(x, "k_proj").view(B, S, att.Hkv, att.hd).transpose(1, 2), cos, sin)
        valid = torch.arange(S)[None] >= T - batch["enc_len"][:, None]
        valid[:, T:] = True
        mask = torch.ones(S, S, dtype=torch.bool).tril()[None] & valid[:, None]  # (B, S, S)
        weights = F.scaled_dot_product_attention(q, k, torch.eye(S).expand(B, att.Hkv, S, S),
                                                 attn_mask=mask[:, None], enable_gqa=True)  # (B, H, S, S)
    nll = []
    for b, rec in enumerate(batch["records"]):
        answer, row = m.tok.encode(" " + rec["answers"][0], start=False), ids[b].tolist()
        s = next(i for i in range(T) if row[i:i + len(answer)] == answer)
        nll += [-weights[b, 0, j, s:s + len(answer)].sum().log() for j in range(T, S)]
    assert torch.allclose(got, torch.stack(nll).mean(), atol=1e-5), got
    absent = batch["qa_labels"].masked_fill(batch["qa_labels"] != -100, int(ids.max()) + 1)
    assert m.aid.writer_loss(dict(batch, qa_labels=absent)) == 0.0


def test_attention_distillation_per_slot_only_where_the_layout_fixes_the_slots(base_dir):
    """Aid 2 applies to every compression method; per slot for layouts that say which slot holds
    which token (meanpool's windows, PIC's block-wise chunks or memory at the chunks' centres, SAC's
    anchors: a method's token_slots), its output form for compression tokens that read the whole
    context (PIC's causal and bidir masks with memory after the context, ATA)."""
    import data
    import meanpool
    import pic
    import sac
    from model import Transformer
    methods = train.method_registry()
    assert all(tiny.distills_attention(methods[n]) for n in ("meanpool", "pic", "sac", "sentence_gist", "ata"))
    assert not tiny.distills_attention(methods["teacher"]) and not tiny.distills_attention(methods["base"])
    assert methods["meanpool"].token_slots is meanpool.window_slots and methods["sac"].token_slots is sac.anchor_slots
    assert methods["ata"].token_slots is None and methods["sentence_gist"].token_slots is None
    tok = data.load_tokenizer(base_dir)
    for mask, mem, mem_pos, fixed in (("blockwise", "table", "", True), ("blockwise", "single", "after", True),
                                      ("causal", "single", "", True), ("causal", "table", "", False),
                                      ("bidir", "table", "after", False), ("bidir", "single", "centre", True)):
        m = pic.PIC(Transformer.from_pretrained(base_dir), pic.PICConfig(mask=mask, mem=mem, mem_pos=mem_pos), tok,
                    train.TrainConfig(method="pic", objective="qa"))
        assert (m.token_slots is meanpool.window_slots) == fixed and (m.token_slots is None) != fixed, (mask, mem)


@pytest.mark.parametrize("name,kw", [("pic", {"mask": "causal", "mem": "single"}), ("ata", {"lora_r": 4})])
def test_output_form_is_head_0s_output_in_the_real_passes(base_dir, name, kw):
    """Aid 2's output form, with embedding memory (pic) and K/V memory (ata): the teacher's and
    the decoder's head-0 outputs are the first hd inputs of the last layer's o_proj in their real
    passes, so the term is 0 against the decoder's own output and |o - o_t|^2 / |o_t|^2 (means
    over the answer positions) against the teacher's."""
    m, batch = _with_aid(base_dir, name, **kw)
    attn = m.base.model.layers[m.aid.last].self_attn
    seen = []
    attn.o_proj.register_forward_pre_hook(lambda mod, args: seen.append(args[0][..., :attn.hd]))
    with torch.no_grad():
        m.aid.hidden = True  # the full pass, as under a kd objective
        _, (_, teacher_out, _) = m.aid.teacher(batch)
        rows, pos = (batch["full_labels"] != -100).nonzero(as_tuple=True)
        assert torch.allclose(teacher_out, seen[-1][rows, pos], atol=1e-5)
        n_seen = len(seen)  # without the hidden states the teacher stops before the last layer, same head
        m.aid.hidden = False
        h, stopped = m.aid.teacher(batch)
        assert h is None and len(seen) == n_seen
        m.aid.hidden = True
        assert all(torch.equal(a, b) for a, b in zip(stopped, m.aid.teacher(batch)[1]))
        memory = m.compress(batch, 4)
        with m.base.adapter(m.dec_adapter):
            m.base(batch["qa"], memory=memory)
        rows, pos = (batch["qa_labels"] != -100).nonzero(as_tuple=True)
        at = pos + (memory.mask.shape[1] if memory.embeds is not None else 0)  # embedding memory: rows of x
        out = seen[-1][rows, at]
        assert len(out) == len(teacher_out)
        zero = m.aid.memory_loss((None, out), memory, batch, 4)
        got = m.aid.memory_loss((None, teacher_out), memory, batch, 4)
    want = (out - teacher_out).pow(2).sum(-1).mean() / teacher_out.pow(2).sum(-1).mean()
    assert zero.abs() < 1e-6 and torch.allclose(got, want, rtol=1e-4), (zero, got, want)


def test_slot_form_first_where_the_layout_fixes_the_slots(base_dir):
    """pic --mem single (memory at the chunks' centres): aid 2 is the per-slot CE (slot t for chunk
    t) in the first SLOT_STAGE of max_iters, the output form from then on, as for pic's block-wise
    chunks and SAC's anchors; with memory after the context (--mem_pos after) and for ATA the
    output form throughout."""
    m, batch = _with_aid(base_dir, "pic", mask="causal", mem="single")
    m.aid = tiny.AttentionDistillation(m, 1.0, max_iters=30)
    assert m.centre and m.aid.slot_steps == 3
    with torch.no_grad():
        teacher_attn, teacher_out, _ = m.aid.teacher(batch)[1]
        memory = m.compress(batch, 4)
        with m.base.adapter(m.dec_adapter):
            m.base(batch["qa"], memory=memory)
        rows, pos = (batch["qa_labels"] != -100).nonzero(as_tuple=True)
        keys_valid = torch.cat([memory.mask, torch.ones_like(batch["qa_labels"], dtype=torch.bool)], 1)
        C = memory.mask.shape[1]
        slot_form = m.aid.loss(teacher_attn, m.token_slots(batch, memory, 4), rows, pos, keys_valid, C)
        got = [m.aid.memory_loss((teacher_attn, teacher_out), memory, dict(batch, step=s), 4) for s in (0, 2, 3, 9)]
        m.aid.slot_steps = 0  # the output form, as every other reader of the whole context
        output_form = m.aid.memory_loss((teacher_attn, teacher_out), memory, batch, 4)
    assert not torch.allclose(slot_form, output_form)
    assert torch.equal(got[0], slot_form) and torch.equal(got[1], slot_form)
    assert torch.equal(got[2], output_form) and torch.equal(got[3], output_form)
    after, _ = _with_aid(base_dir, "pic", mask="causal", mem="single", mem_pos="after")
    assert tiny.AttentionDistillation(after, 1.0, max_iters=10).slot_steps == 0
    for name, kw in (("pic", {}), ("sac", {"lora_r": 4}), ("ata", {"lora_r": 4})):
        m, _ = _with_aid(base_dir, name, **kw)
        assert tiny.AttentionDistillation(m, 1.0, max_iters=30).slot_steps == (0 if name == "ata" else 3), name


@pytest.mark.parametrize("name,kw,r", [("pic", {}, 4), ("sac", {"lora_r": 4, "lora_alpha": 8}, 4),
                                       ("sentence_gist", {"gists": 2}, 1),
                                       ("pic", {"mask": "bidir", "mem": "single"}, 4), ("ata", {"lora_r": 4}, 10)])
def test_attention_distillation_enters_every_methods_loss(base_dir, name, kw, r):
    m, batch = _with_aid(base_dir, name, **kw)
    with_aid, n, _ = m(batch, [r])
    with_aid.backward()
    grads = [p.grad for p in m.parameters() if p.requires_grad and p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    m.aid = None
    without, n2, _ = m(batch, [r])
    assert n == n2 and with_aid.item() > without.item()


def test_shipped_base_reads_its_context():
    """tiny_base/ (what `python train.py --method base --out_dir tiny_base` wrote) loads and
    answers from its context: teacher F1 >= 85 on 64 synthetic test questions, no context far
    below (the eval's own seed and split)."""
    import data
    import eval as evaluate
    from model import Transformer
    base, tok = Transformer.from_pretrained(tiny.BASE_DIR).eval(), data.load_tokenizer(tiny.BASE_DIR)
    records = tiny.Synthetic(seed=train.TrainConfig.seed, split="test").qa_examples(64)
    rows = evaluate.teacher_rows(base, tok, records, train.TrainConfig(), evaluate.EvalConfig(batch_size=32), "cpu")
    assert rows["teacher"]["f1"] >= 85 and rows["no-context"]["f1"] < 20, rows
    assert tiny.is_tiny("") and not tiny.needs_training("")


@pytest.mark.parametrize("name,r", [("pic", 4), ("sac", 5), ("ata", 10)])
def test_frozen_decoder_methods_get_a_decoder_adapter_on_the_tiny_base(name, r):
    """Aid 4: on the shipped tiny base, the methods whose paper freezes the decoder read
    their memory through a trainable LoRA `decoder` (saved with the run); --no_aids keeps
    the paper's frozen decoder."""
    import data
    cls = train.method_registry()[name]
    for no_aids in (False, True):
        cfg = train.TrainConfig(method=name, objective="qa", no_aids=no_aids)
        tok, base, m = train.build(cfg, cls.Config(), "cpu", torch.float32)
        assert m.dec_adapter == (None if no_aids else "decoder")
        assert ("decoder" in base.adapter_configs) != no_aids
        assert any("lora_A.decoder" in n for n, p in m.named_parameters() if p.requires_grad) != no_aids
        used, adapter = [], base.adapter
        base.adapter = lambda a: used.append(a) or adapter(a)
        batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=8)
        m(m.prepare(batch) if name == "ata" else batch, [r])
        assert ("decoder" in used) != no_aids


def test_the_aids_act_on_pics_separate_decoder():
    """With pic's --decoder on the tiny base, aids 4 and 2 act on that decoder: its LoRA `decoder` is what the
    attention term reads (it looked for the adapter on the encoder's base, and the first step failed)."""
    import data
    cls = train.method_registry()["pic"]
    tok, base, m = train.build(train.TrainConfig(method="pic", objective="qa"), cls.Config(decoder=tiny.BASE_DIR),
                               "cpu", torch.float32)
    assert "decoder" in m.dec_model.adapter_configs and "decoder" not in base.adapter_configs
    m.aid = tiny.AttentionDistillation(m, tiny.ATTN_KD, 10)
    batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=8)
    with_aid = m(batch, [4])[0]
    m.aid = None
    assert with_aid.item() > m(batch, [4])[0].item()


@pytest.mark.parametrize("name,kw,which", [("meanpool", {}, "proj"), ("meanpool", {"no_encoder": True}, "proj"),
                                           ("pic", {"mem": "single"}, "converter"), ("pic", {}, None)])
def test_w_starts_at_identity_on_the_tiny_base_and_at_the_embeddings_scale_without_aids(name, kw, which):
    """Aid 5: meanpool's W starts at I; --no_aids keeps the real path's s I (s = embedding std / final-norm gain RMS,
    by hand), and I under --no_encoder (it pools embeddings). The compression tokens' W starts at I either way; PIC's
    own converter (an MLP) is left as it is."""
    cls = train.method_registry()[name]
    starts = []
    for no_aids in (False, True):
        torch.manual_seed(0)
        cfg = train.TrainConfig(method=name, objective="kd" if name == "meanpool" else "qa", no_aids=no_aids)
        tok, base, m = train.build(cfg, cls.Config(**kw), "cpu", torch.float32)
        starts.append((m.proj if which == "proj" else m.converter[0]).weight.detach())
    eye = torch.eye(base.config.hidden_size)
    s = base.model.embed_tokens.weight.std() / base.model.norm.weight.pow(2).mean().sqrt()
    if which is None:
        assert torch.equal(starts[0], starts[1]) and not torch.allclose(starts[0], eye)
    else:
        assert torch.equal(starts[0], eye)
        assert torch.allclose(starts[1], s * eye if kw == {} else eye) and 0.01 < s < 0.5


@pytest.mark.parametrize("name,kw,r", [("pic", {}, 4), ("sentence_gist", {"gists": 2}, 1)])
def test_attention_distillation_trains_the_heads_the_decoder_reads_with(base_dir, name, kw, r):
    """The aid's head 0 is the student's own: computed under the adapter the decoder ran
    with, so the term's gradient reaches that adapter's last-layer query projection."""
    m, batch = _with_aid(base_dir, name, **kw)
    tiny.add_decoder_adapter(m)
    m.aid = tiny.AttentionDistillation(m, 1.0)
    last = m.base.config.num_hidden_layers - 1
    qkv = m.base.model.layers[last].self_attn.qkv_proj
    B, q_rows = qkv.lora_B[m.dec_adapter], qkv.rows["q_proj"]  # q's B: the first rows of the stacked B

    def grad(aid):
        m.aid, B.grad = aid, None
        m(batch, [r])[0].backward()
        return B.grad[q_rows].clone()
    assert not torch.allclose(grad(m.aid), grad(None))


def test_a_base_trained_again_starts_from_a_new_model_of_its_shape(tmp_path):
    """--method base into a dir trained before: a new random model of the flags' shape, not the old weights;
    --resume keeps the old ones."""
    from safetensors.torch import load_file, save_file
    bc = tiny.BaseConfig(d_model=32, n_heads=2, vocab_size=600)
    path = tmp_path / "model.safetensors"
    tiny.init_base(str(tmp_path), bc, seed=0)
    init = load_file(path)
    save_file({k: v + 1 for k, v in init.items()}, path)  # as if trained
    tiny.init_base(str(tmp_path), bc, seed=0, resume=True)
    assert all(torch.equal(v, init[k] + 1) for k, v in load_file(path).items())
    tiny.init_base(str(tmp_path), bc, seed=0)
    assert all(torch.equal(v, init[k]) for k, v in load_file(path).items())
    tiny.init_base(str(tmp_path), tiny.BaseConfig(d_model=64, n_heads=2, vocab_size=600), seed=0)
    assert load_file(path)["model.embed_tokens.weight"].shape == (600, 64)


def test_aid_5_starts_only_a_w_that_starts_as_a_multiple_of_i_at_i():
    """Aid 5 resets meanpool's W (s I) to I and leaves a `proj` of another start alone (a forked method's, which it
    used to overwrite in silence)."""
    from types import SimpleNamespace
    torch.manual_seed(0)
    scaled = SimpleNamespace(proj=torch.nn.Linear(4, 4, bias=False))
    torch.nn.init.eye_(scaled.proj.weight).data.mul_(0.07)
    tiny.w_from_identity(scaled)
    assert torch.equal(scaled.proj.weight, torch.eye(4))
    zero = torch.nn.Linear(4, 4, bias=False)
    torch.nn.init.zeros_(zero.weight)
    for proj in (torch.nn.Linear(4, 4, bias=False), torch.nn.Linear(4, 3, bias=False), zero):
        before = proj.weight.clone()
        tiny.w_from_identity(SimpleNamespace(proj=proj))
        assert torch.equal(proj.weight, before)
    tiny.w_from_identity(SimpleNamespace(proj=None))  # --no_linear: nothing to start
