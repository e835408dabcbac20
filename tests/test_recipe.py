"""The papers' recipes on real checkpoints (issue 76): every stage and value as each paper states it
(hand-written here from the papers, not read from the method files), the tiny base's own recipe, the
global batch, one shuffle an epoch, validation that training never sees."""
import json
import random

import pytest

import train
from common import hf_checkpoint, squad_file

TABLE6 = dict(lr=2e-4, min_lr_frac=0.1, warmup_frac=0.05, weight_decay=0.0, grad_clip=1.0, max_iters=48_000,
              batch_size=32, max_context=1024, max_answer=256, lora_r=16, lora_alpha=16)  # meanpool_multi_ratio
SAC = dict(ratio="5", batch_size=16, warmup_iters=300, min_lr_frac=1.0, weight_decay=0.1, grad_clip=2.0,
           lora_r=128, lora_alpha=256, sub_len=510, max_iters=20_000)  # SAC §4.1, Table 6
ATA = dict(lr=1e-5, min_lr_frac=1.0, warmup_iters=300, weight_decay=0.2, batch_size=16, max_context=600,
           ratio="10", hotpot_distractors=True, lora_r=64, lora_alpha=32, lora_dropout=0.2, k_max=8,
           huber_lambda=1e-4, huber_delta=10.0, rel_ratios="1,5,10,20,50")  # ATA Tables 4-5, App. C
GIST = dict(weight_decay=0.1, max_context=4096, lora_r=0)  # sentence_gist Table 3, App. A, §3.5
PAPERS = {  # method (and flags): [(objective, values)] per stage
    ("teacher",): [("sft", TABLE6)],
    ("meanpool",): [("kd", dict(TABLE6, ratio="4,8,16,32,64,128"))],
    ("pic", "--mem", "single", "--mask", "bidir"): [("kd", dict(TABLE6, ratio="4,8,16,32,64,128", mem_pos="after"))],
    ("pic",): [("ae+lm", dict(lr=1e-4, max_iters=90_000, ratio="16")), ("qa", dict(ratio="16"))],
    ("sac",): [("lm", dict(SAC, lr=1e-4, max_context=1020)), ("qa", dict(SAC, lr=5e-5))],  # App. A: 2,040-token texts
    ("ata",): [("rel", dict(ATA, max_iters=52_500)), ("qa", dict(ATA, max_iters=17_500))],  # 3 and 1 epochs of 280k / 16
    ("sentence_gist",): [("lm", dict(GIST, stage=1, max_iters=1000, batch_size=64, lr=1e-4, min_lr_frac=0.5,
                                     warmup_frac=0.1, grad_clip=1.0)),
                         ("lm", dict(GIST, stage=2, max_iters=9000, batch_size=128, lr=1e-4, min_lr_frac=0.5,
                                     warmup_frac=1000 / 9000, grad_clip=2.0)),
                         ("lm", dict(GIST, stage=3, max_iters=2000, batch_size=512, lr=5e-5, min_lr_frac=0.0,
                                     warmup_frac=0.05, grad_clip=2.0))],
}


def resolved(argv):
    cfg, mcfg, explicit, cls = train.configure([str(a) for a in argv])
    return train.resolve(cfg, mcfg, explicit, cls)


def value(c, m, key):
    return getattr(c if hasattr(c, key) else m, key)


@pytest.mark.parametrize("method", list(PAPERS), ids=" ".join)
def test_a_real_checkpoint_gets_the_papers_stages_and_values(base_dir, method):
    stages = resolved([*("--method", method[0]), *method[1:], "--init_from", base_dir, "--out_dir", "/o"])
    assert [c.objective for c, _, _ in stages] == [objective for objective, _ in PAPERS[method]]
    for (c, m, sources), (_, paper) in zip(stages, PAPERS[method]):
        assert {k: value(c, m, k) for k in paper} == pytest.approx(paper), c.objective
        assert all(sources[k].startswith("paper") for k in paper), sources
    assert stages[-1][0].out_dir == "/o" and all(c.out_dir.startswith("/o/") for c, _, _ in stages[:-1])
    assert [c.init_from for c, _, _ in stages[1:]] == [c.out_dir for c, _, _ in stages[:-1]]  # each from the last


def test_zero_steps_batch_or_lr_is_the_recipes_value(base_dir):
    """--max_iters, --batch_size and --lr 0 name the recipe's value, as their help says: the stages of no flag."""
    argv = ["--method", "sac", "--init_from", base_dir, "--out_dir", "/o"]
    plain, zeros = resolved(argv), resolved(argv + ["--max_iters", 0, "--batch_size", 0, "--lr", 0])
    assert [(vars(c), vars(m), s) for c, m, s in zeros] == [(vars(c), vars(m), s) for c, m, s in plain]
    assert plain[-1][0].max_iters == 20_000


def test_the_tiny_base_keeps_its_own_recipe_and_no_aids_is_the_papers_at_its_scale():
    (c, m, sources), = resolved(["--method", "meanpool"])
    assert (c.lr, c.max_iters, c.batch_size, c.ratio, m.lora_r) == (2e-3, 700, 8, "4,8,16", 64)
    assert sources["lr"] == sources["lora_r"] == "tiny"
    (c, m, sources), = resolved(["--method", "meanpool", "--no_aids"])  # the paper's, but the steps, batch, lr
    assert (c.lr, c.max_iters, c.batch_size, c.ratio, m.lora_r, c.max_answer) == (2e-3, 700, 8, "4,8,16", 16, 256)
    assert sources["lora_r"].startswith("paper") and sources["min_lr_frac"].startswith("paper")
    scale = "tiny (--no_aids: the tiny base's scale)"  # (they were labelled the paper's: Table 6's lr is 2e-4)
    assert sources["lr"] == sources["max_iters"] == sources["batch_size"] == scale
    tiny_gist, = resolved(["--method", "sentence_gist"])  # qa, stage 2, LoRA
    assert (tiny_gist[0].objective, tiny_gist[1].stage, tiny_gist[1].lora_r) == ("qa", 2, 16)
    paper_gist = resolved(["--method", "sentence_gist", "--no_aids"])  # lm, three stages, every weight
    assert [(c.objective, m.stage, m.lora_r) for c, m, _ in paper_gist] == [("lm", s, 0) for s in (1, 2, 3)]
    assert sum(c.max_iters for c, _, _ in paper_gist) == 700 and paper_gist[1][0].max_iters == 525  # 1 : 9 : 2
    pic_stages = resolved(["--method", "pic"])  # ae+lm 100, then qa 1100
    assert [(c.objective, c.max_iters) for c, _, _ in pic_stages] == [("ae+lm", 100), ("qa", 1100)]
    paper_pic = resolved(["--method", "pic", "--no_aids"])  # 90,000 : 5,427 (its qa steps are ours: they read 1)
    assert [(c.objective, c.max_iters) for c, _, _ in paper_pic] == [("ae+lm", 1132), ("qa", 68)]


def test_stage_flags_and_the_one_steps_rule(base_dir, capsys):
    real = ["--init_from", base_dir]
    assert [c.max_iters for c, _, _ in resolved(["--method", "sac", "--max_iters", 1000, *real])] == [500, 500]
    assert [c.max_iters for c, _, _ in resolved(["--method", "ata", "--max_iters", 1000, *real])] == [750, 250]
    # a warmup given in steps keeps its share of the stage: 300 of 20,000 -> 8 of 500 (7.5); 300 of 52,500 -> 4 of 750
    assert [c.warmup_iters for c, _, _ in resolved(["--method", "sac", "--max_iters", 1000, *real])] == [8, 8]
    assert [c.warmup_iters for c, _, _ in resolved(["--method", "ata", "--max_iters", 1000, *real])] == [4, 4]
    assert [c.warmup_iters for c, _, _ in resolved(["--method", "sac", "--max_iters", 4, *real])] == [1, 1]
    assert [c.warmup_iters for c, _, _ in resolved(["--method", "sac", *real])] == [300, 300]  # the recipe's steps
    assert [c.warmup_iters for c, _, _ in resolved(["--method", "sac", "--max_iters", 1000, "--warmup_iters", 50,
                                                    *real])] == [50, 50]
    assert capsys.readouterr().err == ""
    resolved(["--method", "sac", "--max_iters", 120, "--warmup_iters", 80, *real])  # steps 60 + 60: lr at 0.75 of --lr
    assert capsys.readouterr().err.count("note: --warmup_iters 80 outlasts the 60 steps of the") == 2
    _, _, sources = resolved(["--method", "ata", "--max_iters", 1000, *real])[1]
    assert sources["warmup_iters"] == "paper (§3.5, Table 5), x 250/17500 steps"
    assert [c.max_iters for c, _, _ in resolved(["--method", "sac", "--pretrain", 7, "--max_iters", 30, *real])] == [7, 30]
    assert [c.objective for c, _, _ in resolved(["--method", "sac", "--pretrain", 0, *real])] == ["qa"]
    assert [c.objective for c, _, _ in resolved(["--method", "pic", "--objective", "ae+lm", *real])] == ["ae+lm"]
    (c, m, _), = resolved(["--method", "sentence_gist", "--stage", 3, *real])
    assert (m.stage, c.lr, c.batch_size) == (3, 5e-5, 512)
    (c, _, sources), = resolved(["--method", "meanpool", "--lr", "3e-4", "--batch_size", 8, *real])
    assert (c.lr, c.batch_size, sources["lr"], sources["batch_size"]) == (3e-4, 8, "flag", "flag")
    with pytest.raises(SystemExit, match="global batch"):
        cfg, mcfg, explicit, cls = train.configure(["--method", "meanpool", "--batch_size", "6", "--grad_accum", "4", *real])
        train.resolve(cfg, mcfg, explicit, cls)
    with pytest.raises(SystemExit, match="2 ranks"):
        cfg, mcfg, explicit, cls = train.configure(["--method", "meanpool", "--batch_size", "3", *real])
        train.resolve(cfg, mcfg, explicit, cls, world=2)


def test_micro_batch_sets_each_stages_accumulation(base_dir):
    """--micro_batch N: each stage's batch in the fewest micro-batches of at most N examples that divide it per rank
    (sentence_gist's 64, 128 and 512 texts; a 135M model's 512 texts in one micro-batch need ~360 GiB)."""
    real = ["--init_from", base_dir, "--method", "sentence_gist"]
    for world, micro, accum in ((1, 32, [2, 4, 16]), (2, 32, [1, 2, 8]), (1, 48, [2, 4, 16]), (1, 600, [1, 1, 1])):
        cfg, mcfg, explicit, cls = train.configure([str(a) for a in real + ["--micro_batch", micro]])
        stages = train.resolve(cfg, mcfg, explicit, cls, world=world)
        assert [c.grad_accum for c, _, _ in stages] == accum, (world, micro)
        assert all(c.batch_size // (world * c.grad_accum) <= micro for c, _, _ in stages)
        assert stages[0][2]["grad_accum"] == f"flag (--micro_batch {micro})"
    for flags in (["--micro_batch", "-1"], ["--micro_batch", "8", "--grad_accum", "2"]):
        with pytest.raises(SystemExit, match="--micro_batch"):
            resolved(real + flags)


@pytest.mark.slow
def test_one_step_per_stage_writes_the_papers_recipe_into_run_json(tmp_path):
    """Every method and the teacher, one step a stage on a tiny random HF checkpoint and a SQuAD file,
    at the papers' batch sizes: run.json holds each stage's values and where they came from."""
    ckpt, squad = hf_checkpoint(tmp_path / "hf"), squad_file(tmp_path / "squad.json")
    for method, stages in PAPERS.items():
        out = tmp_path / "-".join(method)
        max_context = "256" if method[0] == "ata" else "64"  # (ata trains on records whose encoder prompt fits)
        train.main([*("--method", method[0]), *method[1:], "--init_from", ckpt, "--data", squad, "--max_iters", "1",
                    "--max_context", max_context, "--out_dir", str(out), "--eval_examples", "0", "--quiet", "--lora_r",
                    "4"])
        recipe = json.loads((out / "run.json").read_text())["recipe"]
        assert [st["objective"] for st in recipe] == [objective for objective, _ in stages]
        for st, (_, paper) in zip(recipe, stages):
            for key, want in paper.items():
                got, source = st["values"][key]
                if key in ("max_iters", "max_context", "lora_r"):  # given as flags here
                    assert source.startswith("flag"), (method, key, source)
                elif key == "warmup_iters":  # scaled with the one step --max_iters gives each stage
                    assert got == 1 and source.startswith("paper") and source.endswith(" steps"), (method, source)
                else:
                    assert got == pytest.approx(want) and source.startswith("paper"), (method, key, got, source)
        assert [len(open(st["out_dir"] + "/log.jsonl").readlines()) for st in recipe] == [1] * len(stages)


def test_one_shuffle_an_epoch_and_the_same_items_as_before(monkeypatch):
    """100k records, batch 32: two epochs' steps build two permutations, not one per item (before:
    one per item, ~36 ms each at SQuAD's size); the items are those of the per-item rule."""
    records = [{"id": i} for i in range(100_000)]
    cfg = train.TrainConfig(method="meanpool", objective="kd", batch_size=32, seed=3)
    shuffles, shuffle = [], random.Random.shuffle
    monkeypatch.setattr(random.Random, "shuffle", lambda self, x: shuffles.append(len(x)) or shuffle(self, x))
    batches = train.Batches(cfg, None, None, records)
    steps = range(0, 2 * len(records) // 32 + 1, 97)
    got = {s: batches.raw(s, 32) for s in steps}
    assert shuffles == [100_000, 100_000]  # epochs 0 and 1
    monkeypatch.setattr(random.Random, "shuffle", shuffle)
    perms = {}
    for epoch in (0, 1):  # the rule before: item i = e * N + j is record perm_e[j], perm_e shuffled with seed + e
        perms[epoch] = list(range(len(records)))
        random.Random(3 + epoch).shuffle(perms[epoch])
    for s in steps:
        assert got[s] == [records[perms[i // len(records)][i % len(records)]] for i in range(s * 32, s * 32 + 32)]


def test_validation_never_reads_a_training_record(tmp_path):
    squad = squad_file(tmp_path / "squad.json")
    cfg = train.TrainConfig(method="meanpool", objective="kd", data=squad)
    items, val, text = train.stage_data(cfg)
    assert {r["id"] for r in items}.isdisjoint(r["id"] for r in val) and len(items) + len(val) == 4
    assert "held out" in text
    cfg.eval_data = squad  # validation on --eval_data, training on all of --data
    items, val, text = train.stage_data(cfg)
    assert len(items) == len(val) == 4 and squad in text
    text_cfg = train.TrainConfig(method="sac", objective="lm", data=squad)  # contexts as text: held out too
    items, val, _ = train.stage_data(text_cfg)
    assert set(items).isdisjoint(val) and all(isinstance(t, str) for t in items + val)


def test_no_held_out_question_has_a_context_training_reads(tmp_path, capsys):
    """held_out holds out contexts with all their questions (it drew questions: on SQuAD's dev set 210 of 211 held-out
    questions had their context in training, and a text stage on the file's contexts read 207 of them); a text stage
    on a QA file trains on the contexts of the QA stage's training questions; a file of one context holds none out;
    --eval_data questions on contexts of --data are a note."""
    rng = random.Random(0)
    records = [{"id": f"{c}.{q}", "context": f"context {c}", "question": f"q{q}", "answers": ["context"]}
               for c in range(120) for q in range(rng.randint(1, 9))]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    for seed in (0, 1, 1337):
        items, held = train.held_out(records, seed)
        assert len(items) + len(held) == len(records) and len(held) >= len(records) // 50
        assert {r["context"] for r in items}.isdisjoint(r["context"] for r in held)
        qa = train.stage_data(train.TrainConfig(method="meanpool", objective="kd", data=str(path), seed=seed))
        text = train.stage_data(train.TrainConfig(method="sac", objective="lm", data=str(path), seed=seed))
        assert [[r["id"] for r in part] for part in qa[:2]] == [[r["id"] for r in part] for part in (items, held)]
        assert "with their contexts" in qa[2]
        assert set(text[0]) == {r["context"] for r in items} and set(text[1]) == {r["context"] for r in held}
    one = [dict(r, context="the one context") for r in records[:5]]
    assert train.held_out(one, 0) == (one, one)
    (tmp_path / "one.jsonl").write_text("".join(json.dumps(r) + "\n" for r in one))
    assert "one context" in train.stage_data(train.TrainConfig(method="meanpool", data=str(tmp_path / "one.jsonl")))[2]
    (tmp_path / "some.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:40]))
    train.stage_data(train.TrainConfig(method="meanpool", data=str(path), eval_data=str(tmp_path / "some.jsonl")))
    assert "note: 40 of the 40 --eval_data questions have a context of" in capsys.readouterr().err


def test_contexts_longer_than_the_checkpoints_positions_are_a_note(tmp_path):
    """A stage whose --max_context and --max_answer reach past max_position_embeddings trains on, with a note (it
    read positions the model never saw, in silence: 1,024 on a 512-position checkpoint)."""
    ckpt = hf_checkpoint(tmp_path / "hf")  # (2,048 positions)
    for max_context, noted in ((1984, False), (1985, True), (1 << 20, False)):  # (2^20: sac's "any length")
        notes = train.check_files(train.TrainConfig(init_from=ckpt, max_context=max_context, max_answer=64), object())
        want = f"note: --max_context {max_context} and --max_answer 64 reach past the 2048 positions"
        assert any(note.startswith(want) for note in notes) == noted, notes


def test_split_steps_sums_to_max_iters_and_gives_every_stage_one():
    """--max_iters over a recipe's stages: their sum, each at least 1 (sentence_gist --max_iters 3 trained 1, 2, 1)."""
    rng = random.Random(0)
    for _ in range(2000):
        weights = [rng.randint(1, 10 ** rng.randint(0, 5)) for _ in range(rng.randint(1, 4))]
        total = rng.randint(1, 60)
        steps = train.split_steps(total, weights)
        assert min(steps) >= 1 and sum(steps) == max(total, len(weights)), (total, weights, steps)
    assert train.split_steps(3, [1000, 9000, 2000]) == [1, 1, 1] and train.split_steps(200, [1000, 9000, 2000]) == [
        17, 150, 33]


def test_a_text_stage_on_a_qa_files_contexts_says_how_often_it_reads_each(tmp_path, capsys):
    """pic ae+lm, sac lm, gist lm without --pretrain_data train on --data's contexts (PIC's recipe: 90k steps x 16 on
    SQuAD's ~19k paragraphs, ~76 passes, where the paper reads ~3B tokens of FineWeb once): a note says how often."""
    path, text = tmp_path / "qa.jsonl", tmp_path / "web.txt"
    path.write_text("".join(json.dumps({"id": str(c), "context": f"context {c}", "question": "q", "answers": ["c"]})
                            + "\n" for c in range(10)))  # (one context held out: 9 train)
    text.write_text("\n\n".join(f"text {i}" for i in range(9)))
    cfg = train.TrainConfig(method="pic", objective="ae+lm", data=str(path), max_iters=100, batch_size=16)
    assert len(train.stage_data(cfg)[0]) == 9
    assert capsys.readouterr().err == f"note: pic ae+lm trains on the 9 contexts of {path}, 178 times each (100 " \
                                      "steps x 16); a text corpus: --pretrain_data\n"
    for c in (train.TrainConfig(method="pic", objective="ae+lm", data=str(path), max_iters=1, batch_size=8),
              train.TrainConfig(method="sac", objective="lm", data=str(path), pretrain_data=str(text), max_iters=100,
                                batch_size=16)):
        train.stage_data(c)
        assert "note" not in capsys.readouterr().err  # (once over them at most; a text file of its own)


def test_skip_bad_skips_a_bad_line_of_jsonl_pretraining_text(tmp_path, capsys):
    path = tmp_path / "text.jsonl"
    path.write_text('{"text": "one"}\n{"text": 5}\n{"text": "two"}\n')
    cfg = train.TrainConfig(method="sac", objective="lm", pretrain_data=str(path))
    with pytest.raises(ValueError, match=r"text.jsonl:2: field 'text'"):
        train.stage_data(cfg)
    cfg.skip_bad = True  # (it was read without the flag)
    items, val, _ = train.stage_data(cfg)
    assert sorted(items + val) == ["one", "two"] and "'skipped_bad': 1" in capsys.readouterr().err


def test_resume_names_the_ratio_flag_it_cannot_read():
    with pytest.raises(SystemExit, match="--eval_ratio '4,,8'"):  # (it said --ratio)
        train.as_compared("eval_ratio", "4,,8")
    assert train.as_compared("ratio", "8, 4") == [8, 4]
