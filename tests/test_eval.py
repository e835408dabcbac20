"""eval.py: SQuAD metrics (hand cases and the official script's numbers), the table builder,
bootstrap intervals and scripts/compare.py."""
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
import zipfile
from dataclasses import replace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import data
import eval as evaluate
import meanpool
import sac
import tiny
import train
from common import hf_checkpoint, load_script, squad_file
from conftest import ASSETS, ROOT
from model import Memory


def test_qa_metrics_hand_cases():
    m = evaluate.qa_metrics(["The Eiffel Tower!", "in Paris", "", "red car"],
                            [["eiffel tower"], ["Paris", "in France"], ["x"], ["a blue car", "red"]])
    # 1) articles and punctuation vanish -> EM 1; 2) "in paris" vs "paris": F1 2/3, vs "in france" 1/2 -> 2/3
    # 3) empty prediction -> 0; 4) "red car" vs "blue car" F1 .5, vs "red" F1 2/3 -> 2/3, EM 0
    assert m["em"] == pytest.approx(25.0)
    assert m["f1"] == pytest.approx(100 * (1 + 2 / 3 + 0 + 2 / 3) / 4)
    assert evaluate.qa_metrics([], []) == {"em": 0.0, "f1": 0.0}
    assert evaluate.normalize_answer("  An  apple, the PIE. ") == "apple pie"


@pytest.mark.skipif(not (ASSETS / "qa" / "squad" / "dev-v1.1.json.zip").exists(), reason="assets absent")
def test_qa_metrics_agree_with_official_squad_numbers():
    """The dev numbers published for these two prediction files (unanswered ids score 0):
    BERT paper Table 2, BERT-Large ensemble dev 86.2 EM / 92.2 F1; the SQuAD paper's
    logistic regression dev F1 51.0 (its EM, 40.0, was from an earlier file: 40.1 here)."""
    with zipfile.ZipFile(ASSETS / "qa" / "squad" / "dev-v1.1.json.zip") as z:
        dev = json.loads(z.read(next(n for n in z.namelist() if n.endswith(".json"))))
    golds = {qa["id"]: [a["text"] for a in qa["answers"]]
             for art in dev["data"] for p in art["paragraphs"] for qa in p["qas"]}
    expected = {"LogisticRegression_baseline": (40.1, 51.0), "BERT_ensemble_GoogleAI": (86.2, 92.2)}
    for name, (em, f1) in expected.items():
        preds = json.load(open(ASSETS / "qa" / "squad" / f"pred_v1.1_dev_{name}.json"))
        ids = list(golds)
        m = evaluate.qa_metrics([preds.get(i, "") for i in ids], [golds[i] for i in ids])
        assert m["em"] == pytest.approx(em, abs=0.05) and m["f1"] == pytest.approx(f1, abs=0.05), (name, m)


def _fake_run(dir, method, ratios):
    dir.mkdir()
    rows = [{"method": method, "ratio": float(r), "ratio_requested": r, "em": 50.0, "f1": 60.0 - r, "f1_norm": 0.5,
             "memory_bytes": 1000.0 / r, "examples_per_s": 10.0, "n": 4} for r in ratios]
    teacher = {"method": "teacher", "ratio": 1.0, "em": 90.0, "f1": 95.0, "examples_per_s": 5.0}
    noctx = {"method": "no-context", "ratio": None, "em": 0.0, "f1": 3.0, "examples_per_s": 20.0}
    (dir / "run.json").write_text(json.dumps({"train": {"method": method}}))
    asked = evaluate.asked(dir, evaluate.EvalConfig())  # what eval.py with no flags asks
    (dir / "metrics.json").write_text(json.dumps({"run": str(dir), "asked": asked, "teacher": teacher,
                                                  "no_context": noctx, "rows": rows}))
    return dir


def test_table_has_one_row_per_method_and_ratio(tmp_path):
    _fake_run(tmp_path / "a", "meanpool", [4, 8])
    _fake_run(tmp_path / "b", "pic", [16])
    results = evaluate.main([str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "all.json")])
    text = evaluate.table(results)
    lines = text.splitlines()
    assert lines[0].startswith("| method | ratio | EM | F1 | F1/teacher |")
    body = [l for l in lines[2:]]
    assert [l.split("|")[1].strip() for l in body] == ["teacher", "no-context", "meanpool", "meanpool", "pic"]
    assert "| 8.0x |" in body[3] and "| 52.0 |" in body[3]
    assert json.load(open(tmp_path / "all.json"))[1]["rows"][0]["method"] == "pic"
    _fake_run(tmp_path / "c", "pic", [16])  # two runs of one label (say, another --lr): each named by its dir
    two = evaluate.main([str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c")])
    assert [l.split("|")[1].strip() for l in evaluate.table(two).splitlines()[2:]] == \
        ["teacher", "no-context", "meanpool", "meanpool", f"pic [{tmp_path / 'b'}]", f"pic [{tmp_path / 'c'}]"]
    again = evaluate.main([str(tmp_path / "all.json"), "--out", str(tmp_path / "again.json")])  # read as it is
    assert again == json.load(open(tmp_path / "all.json"))
    with pytest.raises(SystemExit, match=r"^error: --n evaluates run dirs; .*all.json is an earlier --out JSON"):
        evaluate.main([str(tmp_path / "all.json"), "--n", "7"])  # (it reprinted the table, --n unread)
    for twice in ([tmp_path / "all.json", tmp_path / "a"], [tmp_path / "all.json", tmp_path / "again.json"]):
        with pytest.raises(SystemExit, match=f"^error: the run {tmp_path / 'a'} is named twice, by "):
            evaluate.main([str(p) for p in twice])  # (the table listed its rows twice, and --out kept both)
    (tmp_path / "b" / "metrics.json").unlink()
    (tmp_path / "b" / "metrics.json").mkdir()  # (the scores were to be written there, after the run was evaluated)
    with pytest.raises(SystemExit, match=r"b/metrics.json: a folder, not a file; eval.py writes the run's scores"):
        evaluate.main([str(tmp_path / "a"), str(tmp_path / "b")])
    for argv, why in ((["--ratio", ""], "--ratio is empty"),  # (it read the run's own ratios)
                      ([], "not an eval.py --out JSON, a list of runs: a run's run.json (name its dir)")):
        with pytest.raises(SystemExit, match=re.escape(why)):
            evaluate.main([str(tmp_path / ("a" if argv else "a/run.json"))] + argv)
    results[1]["rows"][0]["f1_norm"] = float("nan")  # a teacher that gains nothing over no context: no share of it
    assert evaluate.table(results).splitlines()[-1].split(" | ")[4] == "-"  # (was "nan")
    results[0]["teacher"].update(context_bytes=4096.0, ttft_ms=12.34)  # SPEC §4: a Memory against the full context
    teacher = evaluate.table(results).splitlines()[2].split(" | ")
    assert lines[0].split(" | ")[5:7] == ["memory bytes", "TTFT ms"] and teacher[5:7] == ["4096", "12.3"]


def test_run_dirs_with_spaces_and_a_glob_of_runs_beside_their_logs(tmp_path):
    """A run dir whose path holds a space is one run (it was split into two words); a glob names the runs it matches,
    not the .log files beside them (scripts/reproduce.sh writes NAME.log next to each NAME)."""
    for name in ("run a", "run b"):
        _fake_run(tmp_path / name, "meanpool", [4])
        (tmp_path / f"{name}.log").write_text("training log\n")
    assert [res["run"] for res in evaluate.main([str(tmp_path / "run a")])] == [str(tmp_path / "run a")]
    assert [res["run"] for res in evaluate.main([str(tmp_path / "run*")])] == [str(tmp_path / n) for n in ("run a",
                                                                                                         "run b")]
    with pytest.raises(SystemExit, match=r"zz\*' matches no run dir"):
        evaluate.main([str(tmp_path / "zz*")])


def test_an_out_json_names_its_runs_by_absolute_paths(tmp_path, monkeypatch):
    """eval.py --out from the runs' folder: results_md.py and claims.py, run elsewhere, read each run's run.json by
    the JSON's path (a relative one was not found there: its header read "seeds: ?")."""
    _fake_run(tmp_path / "run a", "meanpool", [4])
    monkeypatch.chdir(tmp_path)
    assert evaluate.main(["run a", "--out", "all.json"])[0]["run"] == "run a"  # (the table's name: as given)
    assert json.loads((tmp_path / "all.json").read_text())[0]["run"] == str(tmp_path / "run a")


def test_corrupt_metrics_or_unknown_method_is_one_line(tmp_path):
    bad = _fake_run(tmp_path / "bad", "meanpool", [4])
    good = json.loads((bad / "metrics.json").read_text())
    (bad / "metrics.json").write_text("{not json")
    with pytest.raises(SystemExit, match="bad/metrics.json: corrupt metrics file"):
        evaluate.main([str(bad)])
    rows = good["rows"]
    for edit, why in (({"asked": "junk"}, "key 'asked' is 'junk'"),  # (tracebacks where the cache was matched)
                      ({"rows": [dict(rows[0], ratio_requested=[4])]}, r"requested \[4\]\), expected > 0"),
                      ({"rows": [dict(rows[0], ratio=-1)]}, "key 'rows\\[0\\].ratio' is -1")):  # (shown as -1.0x)
        (bad / "metrics.json").write_text(json.dumps({**good, **edit}))
        with pytest.raises(SystemExit, match=f"bad/metrics.json: corrupt metrics file \\(.*{why}"):
            evaluate.main([str(bad)])
    unknown = tmp_path / "unk"
    unknown.mkdir()
    (unknown / "run.json").write_text(json.dumps({"train": {"method": "pik"}, "method": {}}))
    with pytest.raises(SystemExit, match="unknown method 'pik'"):
        evaluate.main([str(unknown)])
    with pytest.raises(SystemExit, match="not a run dir"):
        evaluate.main([str(tmp_path / "nothing")])


def test_method_specific_columns():
    row = {"k": 3.0, "probe_abs_err": 2.46, "ppl_compressed": 5.5}
    assert evaluate.extra_text(row) == "mean k 3.00, probe MAE 2.5, ppl 5.50"
    assert evaluate.extra_text({}) == "-"


# -----------------------------------------------------------------------------
# confidence intervals


def test_teacher_normalised_score_of_f1_and_em_hand_values():
    """SPEC §4 (meanpool §5.1): (M - M_noctx) / (M_teacher - M_noctx) of F1 and of EM; nan where the teacher gains
    nothing over no context."""
    row, teacher, noctx = dict(em=30.0, f1=50.0), dict(em=50.0, f1=70.0), dict(em=10.0, f1=20.0)
    assert evaluate.teacher_normalised(row, teacher, noctx) == dict(f1_norm=0.6, em_norm=0.5)
    norm = evaluate.teacher_normalised(row, dict(em=10.0, f1=80.0), noctx)
    assert norm["f1_norm"] == pytest.approx(0.5) and math.isnan(norm["em_norm"])


def test_bootstrap_ci_constant_covers_mean_and_is_seeded():
    assert evaluate.bootstrap_ci([40.0] * 30) == pytest.approx([40.0, 40.0])
    scores = np.random.default_rng(1).choice([0.0, 100.0], size=200, p=[0.4, 0.6])  # true mean 60
    lo, hi = evaluate.bootstrap_ci(scores)
    assert lo < scores.mean() < hi and lo < 60 < hi and hi - lo < 20, (lo, hi)
    assert evaluate.bootstrap_ci(scores, seed=3) == evaluate.bootstrap_ci(scores, seed=3)
    assert evaluate.bootstrap_ci(scores, seed=3) != evaluate.bootstrap_ci(scores, seed=4)


def test_paired_diff_ci_excludes_or_includes_zero():
    rng = np.random.default_rng(0)
    b = {f"q{i}": float(x) for i, x in enumerate(rng.uniform(0, 80, 100))}
    better = {q: v + 10 + rng.uniform(-5, 5) for q, v in b.items()}  # +10 +- 5 on every question
    c = evaluate.paired_diff_ci(better, b)
    assert c["n"] == 100 and c["diff"] == pytest.approx(c["a"] - c["b"]) and 5 < c["ci"][0] < c["ci"][1] < 15
    assert evaluate.paired_diff_ci(b, better)["ci"][1] < 0
    assert evaluate.paired_diff_ci(b, dict(b))["ci"] == [0.0, 0.0]  # identical runs
    swapped = {q: 100.0 * (i % 2) for i, q in enumerate(b)}, {q: 100.0 * (1 - i % 2) for i, q in enumerate(b)}
    lo, hi = evaluate.paired_diff_ci(*swapped)["ci"]  # each wins half the questions
    assert lo < 0 < hi
    only = evaluate.paired_diff_ci({"x": 1.0, **b}, {"y": 0.0, **b})  # pairs over shared ids only
    assert only["n"] == 100 and only["ci"] == [0.0, 0.0]
    assert evaluate.paired_diff_ci(better, b) == evaluate.paired_diff_ci(better, b, seed=0)
    with pytest.raises(ValueError, match="share no question ids"):
        evaluate.paired_diff_ci({"x": 1.0}, {"y": 1.0})
    for bad in (float("nan"), float("inf")):  # a diverged run's NLL (numpy warned on two lines, then "+nan [...]")
        with pytest.raises(ValueError, match="1 of the 2 shared questions have a value that is not finite"):
            evaluate.paired_diff_ci({"x": 1.0, "y": bad}, {"x": 0.0, "y": 1.0})


class FakeBase:
    """A stand-in base: greedy answers say(prompts); every token equally likely (answer NLL log V a token)."""
    V = 4096
    config = types.SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=4,  # K/V: 64 bytes a token
                                   max_position_embeddings=2048)
    lm_head = types.SimpleNamespace(weight=torch.zeros(1))

    def __init__(self, say):
        self.say = say

    def adapter(self, name):
        return torch.no_grad()

    def generate(self, prompts, k, eos_ids=None):
        return self.say(prompts)

    def __call__(self, ids, memory=None, output="hidden"):
        return torch.zeros(*ids.shape, 1)

    def logits(self, h):
        return torch.zeros(*h.shape[:-1], self.V)


def test_answer_nll_is_each_questions_mean_answer_ce():
    """eval.answer_nll on the shipped tiny base against cross-entropy written out; and the base reading the
    context finds the answers far likelier than with no context."""
    tok, base = train.load_base(train.TrainConfig(), "cpu", torch.float32)
    records = tiny.Synthetic(seed=0, split="val").qa_examples(6)
    b = data.collate_qa(records, tok, pad_multiple=1)
    with torch.no_grad():
        h = {key: base(b[key], output="hidden") for key in ("full", "noctx")}
        logits = h["full"] @ base.lm_head.weight.T  # (B, T, V)
    nll = {key: evaluate.answer_nll(base, h[key], b[f"{key}_labels"]) for key in ("full", "noctx")}
    for i, labels in enumerate(b["full_labels"]):
        keep = labels != -100
        expected = torch.nn.functional.cross_entropy(logits[i][keep], labels[keep]).item()
        assert nll["full"][i] == pytest.approx(expected, rel=1e-5) and keep.sum() > 1
    assert sum(nll["full"]) / 6 + 2 < sum(nll["noctx"]) / 6


def test_a_method_rows_nll_is_its_qa_training_loss():
    """A meanpool row's per-question NLL, weighted by answer tokens, sums to the `qa` objective's training loss
    on the same questions: eval reads the memory as training does; its control (nll_other) to that loss with
    each question moved to the next question's context that is not its own (questions 0 and 1 share one)."""
    cfg = train.TrainConfig(method="meanpool", objective="qa", ratio="4", no_aids=True)
    tok, base, method = train.build(cfg, meanpool.MeanPoolConfig(), "cpu", torch.float32)
    torch.manual_seed(0)
    for p in method.parameters():  # adapters away from their no-op start
        if p.requires_grad:
            p.data += 0.02 * torch.randn_like(p)
    records = tiny.Synthetic(seed=0, split="val").qa_examples(5)
    records[1] = {**records[1], **{k: records[0][k] for k in ("context", "chunks", "relevant")}}
    row = evaluate.method_rows(method, tok, records, cfg, evaluate.EvalConfig(batch_size=5), [4], "cpu")[0]
    b = data.collate_qa(records, tok, pad_multiple=1)
    with torch.no_grad():
        loss, n, _ = method(b, [4])
    tokens = (b["qa_labels"] != -100).sum(1).tolist()
    summed = sum(row["scores"]["nll"][r["id"]] * k for r, k in zip(records, tokens))
    assert summed == pytest.approx(loss.item(), rel=1e-5)
    assert row["nll_ci"][0] <= row["nll"] <= row["nll_ci"][1] and n == sum(tokens) and row["truncated_context"] == 0
    cut = replace(cfg, max_context=int(b["context_len"].min()))
    long = int((b["context_len"] > cut.max_context).sum())
    assert long and evaluate.method_rows(method, tok, records, cut, evaluate.EvalConfig(batch_size=5), [4],
                                         "cpu")[0]["truncated_context"] == long
    for j, r in enumerate(records):  # the control: question j after the next other context's, alone
        k = {0: 2, 1: 2, 2: 3, 3: 4, 4: 0}[j]
        one = {**b, "context": b["context"][k:k + 1], "context_len": b["context_len"][k:k + 1],
               "qa": b["qa"][j:j + 1], "qa_labels": b["qa_labels"][j:j + 1]}
        with torch.no_grad():
            other, n_j, _ = method(one, [4])
        # (a batch of 5 against a batch of 1, padded otherwise: fp32 sums differ by ~1e-5; own and other, by > 0.4)
        assert row["scores"]["nll_other"][r["id"]] == pytest.approx(other.item() / n_j, rel=1e-4)
        assert abs(row["scores"]["nll_other"][r["id"]] - row["scores"]["nll"][r["id"]]) > 1e-4


@pytest.mark.parametrize("method", ["meanpool", "sentence_gist"])
def test_answers_stop_at_the_chat_turn_end_that_the_checkpoints_eos_leaves_out(tmp_path, method):
    """A base checkpoint with a chat template (Qwen2.5, Llama 3.1): its config's eos is its end-of-text, and --prompt
    auto's answers end with the turn end (<|im_end|> here). Every row stops there: a decoder that writes "Paris", the
    turn end, then "Paris" again answers "Paris" (it answered "Paris<|im_end|>ParisParis...", F1 0). A special token
    inside the answer is not written (HF's skip_special_tokens)."""
    ckpt = hf_checkpoint(tmp_path / "hf", chat=True)
    cfg = train.TrainConfig(method=method, init_from=ckpt, objective="qa" if method == "meanpool" else "lm", ratio="4")
    tok, base, m = train.build(cfg, train.method_registry()[method].Config(), "cpu", torch.float32)
    end = tok.special("<|im_end|>")
    assert end not in base.config.eos_token_id and data.stop_ids(tok, "auto")[0] == end
    paris = [tok.special("<|im_start|>")] + tok.encode(" Paris", start=False)
    script, at = paris + [end] + tok.encode(" Paris", start=False) * 4, [0]
    real_prefill = base.prefill

    def logits(h):  # (..., V): the script's next token, counted from each answer's first
        out = torch.full((*h.shape[:-1], base.config.vocab_size), -1e4)
        out[..., script[min(at[0], len(script) - 1)]] = 0.0
        at[0] += 1
        return out
    base.logits = logits
    base.prefill = lambda *a: (at.__setitem__(0, 0), real_prefill(*a))[1]
    if method == "sentence_gist":  # (its answers extend a gist cache, not generate)
        answer_from_memory = m.answer_from_memory
        m.answer_from_memory = lambda *a: (at.__setitem__(0, 0), answer_from_memory(*a))[1]
    records = [{**r, "answers": ["Paris"]} for r in data.read_dataset(squad_file(tmp_path / "squad.json"))[:2]]
    ecfg = evaluate.EvalConfig(batch_size=2, max_new_tokens=8)
    rows = [evaluate.method_rows(m, tok, records, cfg, ecfg, [1 if method == "sentence_gist" else 4], "cpu")[0]]
    if method == "meanpool":
        rows += evaluate.teacher_rows(base, tok, records, cfg, ecfg, "cpu").values()
    assert [row["em"] for row in rows] == [100.0] * len(rows), [row.get("examples") for row in rows]


def test_asking_for_more_questions_than_the_file_holds_is_a_note(tmp_path, capsys):
    """--n, and a run's --eval_examples (train.py's final evaluation), past the questions there are: all of them are
    read, with a note (the run's said nothing: --eval_examples 4 read the one held-out question)."""
    squad = squad_file(tmp_path / "squad.json")
    cfg = train.TrainConfig(data=squad, eval_examples=50)
    held = len(train.held_out(data.read_dataset(squad), cfg.seed)[1])
    for ecfg, flag in ((evaluate.EvalConfig(), "the run's --eval_examples 50"), (evaluate.EvalConfig(n=60), "--n 60")):
        assert len(evaluate.eval_records(cfg, ecfg)) == held
        assert capsys.readouterr().err == f"note: {flag}: the held-out questions of {squad} holds {held} questions; " \
                                          "evaluating them all\n"
    assert len(evaluate.eval_records(replace(cfg, eval_examples=held), evaluate.EvalConfig())) == held
    assert capsys.readouterr().err == ""


def _stand_in_run(run, train_config):
    """A run dir for a stand-in method (train.load_run patched): its run.json and a checkpoint of no tensors."""
    run.mkdir()
    save_file({}, run / "ckpt.safetensors")
    (run / "run.json").write_text(json.dumps({"train": train_config, "method": {}, "step": 0,
                                              "files": {"ckpt": "ckpt.safetensors"}}))
    return run


def test_metrics_json_has_per_question_scores_and_cis(tmp_path, monkeypatch):
    """evaluate_run with a fake base and method (no model, no training): every row of the
    written metrics.json carries {id: score} and the table prints the intervals."""
    tok = data.load_tokenizer(str(ROOT / "tiny_base" / "tokenizer.model"))
    say = lambda prompts: [tok.encode(w) for w in (["Paris", "x"] * len(prompts))[:len(prompts)]]
    base = FakeBase(say)
    memory = lambda n: types.SimpleNamespace(slots=lambda: torch.ones(n), nbytes=lambda: torch.ones(n),
                                             rows=lambda idx: memory(len(idx)))
    method = types.SimpleNamespace(compress=lambda batch, r: memory(len(batch["qa"])), base=base, dec_adapter=None,
                                   answer_from_memory=lambda mem, prompts, k, stop: say(prompts))
    cfg = train.TrainConfig(ratio="4", eval_examples=6)
    monkeypatch.setattr(train, "load_run", lambda run_dir, device: (cfg, None, tok, base, method))
    run = _stand_in_run(tmp_path / "run", {"method": "meanpool", "init_from": "", "ratio": "4", "eval_examples": 6})
    evaluate.main([str(run), "--batch_size", "4"])
    res = json.load(open(run / "metrics.json"))
    ids = [r["id"] for r in evaluate.eval_records(cfg, evaluate.EvalConfig())]
    for row in [res["teacher"], res["no_context"]] + res["rows"]:
        for k in ("em", "f1"):
            assert list(row["scores"][k]) == ids
            assert sum(row["scores"][k].values()) / 6 == pytest.approx(row[k])
            assert row[f"{k}_ci"][0] <= row[k] <= row[f"{k}_ci"][1]
    for row, key in ((res["teacher"], "nll"), (res["no_context"], "nll"), (res["rows"][0], "nll_other")):
        assert row[key] == pytest.approx(np.log(FakeBase.V)) and list(row["scores"][key]) == ids
    lo, hi = res["rows"][0]["f1_ci"]
    assert f"{res['rows'][0]['f1']:.1f} [{lo:.1f}, {hi:.1f}]" in evaluate.table([res])
    batch = data.collate_qa(evaluate.eval_records(cfg, evaluate.EvalConfig()), tok, pad_multiple=1)
    context = (batch["context_len"] + len(batch["prefix"])).float().mean()  # SPEC §4: against the full context's K/V
    assert res["teacher"]["context_bytes"] == pytest.approx(64 * float(context)) and res["teacher"]["ttft_ms"] >= 0
    assert "ttft_ms" not in res["no_context"] and res["rows"][0]["ttft_ms"] >= 0
    ratios = res["rows"][0]["scores"]["ratio"]  # the achieved ratio per question (SPEC §4), its mean the row's
    assert list(ratios) == ids and sum(ratios.values()) / 6 == pytest.approx(res["rows"][0]["ratio"])
    assert len(set(ratios.values())) > 1  # (one slot each here: a question's ratio is its context's length)

    def load_then_save(run_dir, device):  # the run's training saves its next checkpoint while this evaluates
        state = json.load(open(run / "run.json"))
        (run / "run.json").write_text(json.dumps(dict(state, files={"ckpt": "ckpt-2.safetensors"})))
        return cfg, None, tok, base, method
    monkeypatch.setattr(train, "load_run", load_then_save)
    (run / "metrics.json").unlink()  # (kept as the new checkpoint's rows, then served for it)
    res = evaluate.main([str(run), "--batch_size", "4"])
    assert not (run / "metrics.json").exists() and res[0]["asked"]["ckpt"] == "ckpt.safetensors"


def test_eval_ratio_reads_the_run_at_other_ratios(tmp_path, monkeypatch):
    """A run trained at one ratio is read at its --eval_ratio ("" = the trained ones), and an
    explicit eval.py --ratio wins over both."""
    tok = data.load_tokenizer(str(ROOT / "tiny_base" / "tokenizer.model"))
    say = lambda prompts: [tok.encode("Paris") for _ in prompts]
    base = FakeBase(say)
    read_at = []
    memory = lambda n: types.SimpleNamespace(slots=lambda: torch.ones(n), nbytes=lambda: torch.ones(n),
                                             rows=lambda idx: memory(len(idx)))
    method = types.SimpleNamespace(compress=lambda batch, r: read_at.append(r) or memory(len(batch["qa"])),
                                   base=base, dec_adapter=None,
                                   answer_from_memory=lambda mem, prompts, k, stop: say(prompts))
    for name, eval_ratio, extra, expected in (("a", "", [], [5]), ("b", "5,15", [], [5, 15]),
                                              ("c", "5,15", ["--ratio", "51"], [51])):
        cfg = train.TrainConfig(ratio="5", eval_ratio=eval_ratio, eval_examples=4)
        monkeypatch.setattr(train, "load_run", lambda run_dir, device: (cfg, None, tok, base, method))
        _stand_in_run(tmp_path / name, {"method": "sac", "init_from": "", "ratio": "5", "eval_ratio": eval_ratio})
        read_at.clear()
        evaluate.main([str(tmp_path / name)] + extra)
        rows = json.load(open(tmp_path / name / "metrics.json"))["rows"]
        assert [r["ratio_requested"] for r in rows] == expected and sorted(set(read_at)) == expected, name
    # another --ratio adds its row to metrics.json (it replaced the run's own rows); one read before is not computed
    for extra, computed, shown, kept in ((["--ratio", "51"], [51], [51], [5, 15, 51]), (["--ratio", "15"], [], [15],
                                         [5, 15, 51]), ([], [], [5, 15], [5, 15, 51])):
        read_at.clear()
        res = evaluate.main([str(tmp_path / "b")] + extra)[0]
        rows = json.load(open(tmp_path / "b" / "metrics.json"))["rows"]
        assert sorted(set(read_at)) == computed and [r["ratio_requested"] for r in res["rows"]] == shown, extra
        assert [r["ratio_requested"] for r in rows] == kept, extra
    state = json.loads((tmp_path / "b" / "run.json").read_text())  # a later checkpoint: no row of the earlier one
    save_file({}, tmp_path / "b" / "ckpt-2.safetensors")  # (one evaluated while training saved the next: a mix)
    (tmp_path / "b" / "run.json").write_text(json.dumps({**state, "files": {"ckpt": "ckpt-2.safetensors"}}))
    for extra, computed, kept in ((["--ratio", "15"], [15], [15]), (["--ratio", "5"], [5], [5, 15]),
                                  (["--recompute", "--ratio", "15"], [15], [15])):  # --recompute: every row anew
        read_at.clear()
        evaluate.main([str(tmp_path / "b")] + extra)
        rows = json.load(open(tmp_path / "b" / "metrics.json"))["rows"]
        assert sorted(set(read_at)) == computed and [r["ratio_requested"] for r in rows] == kept, extra


def test_a_cached_result_is_of_the_questions_file_as_it_is_and_of_the_dir_named(tmp_path, monkeypatch, capsys):
    """metrics.json serves its rows while the questions file is the one they read: a file rewritten in place
    (smollm2.py's split, say) is read again (its old rows were served); a run dir copied or moved names itself in the
    rows it serves (claims.py read the old dir's name); the note that rows are replaced comes only with a
    replacement (a failing command printed it)."""
    tok = data.load_tokenizer(str(ROOT / "tiny_base" / "tokenizer.model"))
    say = lambda prompts: [tok.encode("Paris") for _ in prompts]
    base, compressed = FakeBase(say), []
    memory = lambda n: types.SimpleNamespace(slots=lambda: torch.ones(n), nbytes=lambda: torch.ones(n),
                                             rows=lambda idx: memory(len(idx)))
    method = types.SimpleNamespace(compress=lambda batch, r: compressed.append(r) or memory(len(batch["qa"])),
                                   base=base, dec_adapter=None,
                                   answer_from_memory=lambda mem, prompts, k, stop: say(prompts))
    cfg = train.TrainConfig(ratio="4", eval_examples=4)
    monkeypatch.setattr(train, "load_run", lambda run_dir, device: (cfg, None, tok, base, method))
    run = _stand_in_run(tmp_path / "run", {"method": "meanpool", "init_from": "", "ratio": "4", "eval_examples": 4})
    qa = tmp_path / "qa.jsonl"

    def write(city):
        qa.write_text("".join(json.dumps({"id": f"q{i}", "context": f"Ada was born in {city}.", "question": "Where?",
                                          "answers": [city]}) + "\n" for i in range(4)))
    write("Paris")
    f1 = lambda: evaluate.main([str(run), "--eval_data", str(qa)])[0]["rows"][0]["f1"]
    assert f1() == f1() == 100.0 and len(compressed) == 1  # the second: metrics.json's
    write("Rome")
    os.utime(qa, ns=(1, 1))  # (a rewrite in the same clock tick keeps the size: the time differs)
    capsys.readouterr()
    assert f1() == 0.0 and len(compressed) == 2
    assert "holds rows read with another file: this evaluation replaces them" in capsys.readouterr().err
    (tmp_path / "doc.txt").write_text("Some text.")
    with pytest.raises(ValueError, match="doc.txt: plain text"):
        evaluate.main([str(run), "--eval_data", str(tmp_path / "doc.txt")])
    assert "replaces" not in capsys.readouterr().err  # (nothing was replaced)
    shutil.copytree(run, tmp_path / "moved")
    res = evaluate.main([str(tmp_path / "moved"), "--eval_data", str(qa)])[0]
    assert len(compressed) == 2 and res["run"] == str(tmp_path / "moved")  # served, named as the dir it is in
    assert {row["run"] for row in res["rows"]} == {str(tmp_path / "moved")}


def test_smollm2_zero_shot_prints_the_teacher_rows(tmp_path):
    """smollm2.py --zero_shot (smollm2_squad.sh's first step): a model's teacher and no-context rows, a result with no
    method row (eval.table read its first row: an IndexError, on every run of the script)."""
    smollm2 = load_script("smollm2")
    model = hf_checkpoint(tmp_path / "hf")
    lines = smollm2.zero_shot(str(model), squad_file(tmp_path / "squad.json"), 2).splitlines()
    assert [line.split(" |")[0] for line in lines[2:]] == ["| teacher", "| no-context"], lines


def test_a_row_label_names_what_the_run_trained_on(tmp_path):
    """--objective given, --no_aids, --prompt, --hotpot_distractors: a row says them (two runs read alike)."""
    state = {"train": {"method": "sac", "objective": "qa", "ratio": "5", "init_from": "", "no_aids": True,
                       "prompt": "sac", "hotpot_distractors": False, "pretrain": 0},
             "method": {}, "flags": ["objective", "no_aids", "prompt", "causal"]}
    (tmp_path / "run.json").write_text(json.dumps(state))
    label = evaluate.run_label(tmp_path, sac.SACConfig(causal=True))
    assert label == "sac (objective=qa, no_aids=True, prompt=sac, causal=True)"


def test_sibling_runs_share_the_teacher_rows(tmp_path, monkeypatch):
    """Runs beside each other with the same base and questions compute the teacher rows
    once; other questions (--n) or --recompute compute them again. A run's own metrics.json serves only
    what it answered (questions, ratios, answer length); another ratio adds its row."""
    tok = data.load_tokenizer(str(ROOT / "tiny_base" / "tokenizer.model"))
    say = lambda prompts: [tok.encode("Paris") for _ in prompts]
    base = FakeBase(say)
    memory = lambda n: types.SimpleNamespace(slots=lambda: torch.ones(n), nbytes=lambda: torch.ones(n),
                                             rows=lambda idx: memory(len(idx)))
    compressed = []
    method = types.SimpleNamespace(compress=lambda batch, r: compressed.append(1) or memory(len(batch["qa"])),
                                   base=base, dec_adapter=None,
                                   answer_from_memory=lambda mem, prompts, k, stop: say(prompts))
    cfg = train.TrainConfig(ratio="4", eval_examples=4)
    monkeypatch.setattr(train, "load_run", lambda run_dir, device: (cfg, None, tok, base, method))
    calls = []
    real = evaluate.teacher_rows
    monkeypatch.setattr(evaluate, "teacher_rows", lambda *a: calls.append(1) or real(*a))
    (tmp_path / "summary").mkdir()  # a folder beside them holding an --out list named metrics.json: not a run's
    (tmp_path / "summary" / "metrics.json").write_text("[1]")
    for name, extra in (("a", []), ("b", []), ("c", ["--n", "3"]), ("d", ["--recompute"])):
        _stand_in_run(tmp_path / name, {"method": "meanpool", "init_from": "", "eval_examples": 4, "ratio": "4"})
        evaluate.main([str(tmp_path / name)] + extra)
        assert len(calls) == {"a": 1, "b": 1, "c": 2, "d": 3}[name]
    a, b = (json.load(open(tmp_path / n / "metrics.json")) for n in "ab")
    assert a["teacher_key"] == b["teacher_key"] and a["teacher"] == b["teacher"]
    c = json.load(open(tmp_path / "c" / "metrics.json"))  # 3 questions: its F1/teacher is against its own rows
    methods = [line.split(" | ")[0] for line in evaluate.table([a, b, c]).splitlines()[2:]]
    assert methods == ["| teacher", "| no-context", f"| meanpool [{tmp_path / 'a'}]", f"| meanpool [{tmp_path / 'b'}]",
                       "| teacher", "| no-context", f"| meanpool [{tmp_path / 'c'}]"]
    for extra, computed in (([], False), (["--n", 3], True), (["--n", 3], False), ([], True), (["--ratio", 8], True),
                            (["--ratio", "4,8"], False), (["--ratio", 4, "--max_new_tokens", 5], True),
                            (["--batch_size", 2], True), ([], True)):  # a cached metrics.json: what it was asked
        before = len(compressed)
        evaluate.main([str(tmp_path / "a")] + [str(x) for x in extra])
        assert (len(compressed) > before) is computed, extra


def _scores_file(path, f1_by_ratio, teacher=None):
    """A metrics.json whose method rows score {ratio: {id: f1}}."""
    row = lambda name, s, **kw: {"method": name, "em": 0.0, "f1": sum(s.values()) / len(s), "examples_per_s": 1.0,
                                 "scores": {"em": {q: 0.0 for q in s}, "f1": s}, **kw}
    teacher = teacher or {"q0": 100.0}
    rows = [row("m", s, ratio_requested=r, ratio=float(r)) for r, s in f1_by_ratio.items()]
    path.write_text(json.dumps({"run": str(path.parent), "teacher": row("teacher", teacher, ratio=1.0),
                                "no_context": row("no-context", teacher), "rows": rows}))
    return str(path)


def test_compare_cli_prints_verdicts(tmp_path, capsys):
    compare = load_script("compare")
    ids = [f"q{i}" for i in range(60)]
    good = {q: 80.0 + 20 * (i % 2) for i, q in enumerate(ids)}
    bad = {q: 20.0 * (i % 3) for i, q in enumerate(ids)}
    coin = {q: 100.0 * (i % 2) for i, q in enumerate(ids)}
    a = _scores_file(tmp_path / "a.json", {4: good, 16: coin}, teacher=coin)
    b = _scores_file(tmp_path / "b.json", {4: bad, 16: {q: 100 - v for q, v in coin.items()}}, teacher=coin)
    lines = compare.main([a, b])
    assert capsys.readouterr().out.splitlines() == lines and len(lines) == 2
    assert lines[0].startswith("A m@4 F1 90.0 vs B m@4 F1 20.0 on 60 questions: A - B +70.0 [")
    assert lines[0].endswith("-> A > B")
    assert lines[1].startswith("A m@16 F1 50.0 vs B m@16 F1 50.0") and lines[1].endswith("-> cannot tell")
    assert compare.main([b, a, "--row_a", "@4", "--row_b", "@4"])[0].endswith("-> B > A")
    with pytest.raises(SystemExit, match="no rows to pair"):  # (@1 was a part of m@16: it compared m@16 with m@16)
        compare.main([a, a, "--row_a", "@1", "--row_b", "@16"])
    assert compare.main([a, b, "--row_a", "teacher", "--row_b", "teacher"])[0].endswith(
        "A - B +0.0 [+0.0, +0.0] -> cannot tell")
    lines = compare.main([a, a, "--row_b", "no-context"])  # picked alone, a row without ratio pairs with each
    assert [line.split(" on ")[0] for line in lines] == ["A m@4 F1 90.0 vs B no-context F1 50.0",
                                                         "A m@16 F1 50.0 vs B no-context F1 50.0"]
    res = json.load(open(a))
    res["rows"][0]["scores"]["nll"] = {q: 1.0 + i % 2 for i, q in enumerate(ids)}
    res["no_context"]["scores"]["nll"] = dict.fromkeys(ids, 3.0)
    (tmp_path / "c.json").write_text(json.dumps(res))
    lines = compare.main([str(tmp_path / "c.json")] * 2 + ["--row_b", "no-context", "--metric", "nll"])
    assert lines[0].startswith("A m@4 NLL 1.50 vs B no-context NLL 3.00 on 60 questions: A - B -1.50 [-1.6")
    assert lines[0].endswith("-> A better (lower NLL)")  # (it read "B > A (A better)")
    assert lines[1].startswith("A m@16 vs B no-context: NLL not in both rows (an older eval.py")


def test_compare_bad_input_is_one_line(tmp_path):
    compare = load_script("compare")
    a = _scores_file(tmp_path / "a.json", {4: {"q0": 1.0, "q1": 2.0}})
    b = _scores_file(tmp_path / "b.json", {4: {"z0": 1.0}})
    for args, expected in [([a, str(tmp_path / "nope.json")], "cannot read .*nope.json \\(No such file"),
                           ([a, b], "share no question ids")]:
        p = subprocess.run([sys.executable, "scripts/compare.py", *args], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode != 0 and "Traceback" not in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and re.match(f"error: .*{expected}", p.stderr), p.stderr
    with pytest.raises(SystemExit, match="no rows to pair; pick them with --row_a/--row_b from A: teacher, no-context"):
        compare.main([a, a, "--row_b", "@16"])
    for text, why in (('{"rows": []}', "missing key 'run'"), ("[1]", "1 is not a run's result"),
                      ("[]", "[] is not a run's result")):  # (KeyError: 'teacher', TypeError: not subscriptable)
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(SystemExit, match=f"bad.json is not an eval.py results JSON: {re.escape(why)}"):
            compare.main([a, str(tmp_path / "bad.json")])
    with pytest.raises(SystemExit, match="the following arguments are required: b"):
        compare.main([a])
    both = tmp_path / "both.json"  # eval.py --out of two runs whose rows share names: which pairs is not a guess
    both.write_text(json.dumps([json.load(open(a)), json.load(open(b))]))
    with pytest.raises(SystemExit, match="both.json: two different rows named 'm@4': compare the runs' own"):
        compare.main([str(both), a])
    both.write_text(json.dumps([json.load(open(a))] * 2))  # one run's rows twice (a suite's shared teacher): fine
    assert compare.main([str(both), a])[0].endswith("-> cannot tell")


def _suite_results(runs):
    """An eval.py --out list: {run dir name: {requested ratio: {id: f1}}} plus scalars."""
    def row(name, s, **kw):
        return {"method": name, "em": 0.0, "f1": sum(s.values()) / len(s), "examples_per_s": 1.0,
                "em_ci": [0.0, 0.0], "f1_ci": evaluate.bootstrap_ci(list(s.values())),
                "scores": {"em": {q: 0.0 for q in s}, "f1": s}, **kw}
    ids = {q for by_ratio in runs.values() for s, _ in by_ratio.values() for q in s}
    teacher, noctx = row("teacher", {q: 100.0 for q in ids}, ratio=1.0), row("no-context", {q: 0.0 for q in ids})
    return [{"run": f"out/suite/{name}", "teacher": teacher, "no_context": noctx,
             "rows": [row(name, s, ratio_requested=r, **{"ratio": float(r), **extra})
                      for r, (s, extra) in by_ratio.items()]}
            for name, by_ratio in runs.items()]


def test_claims_three_verdicts_from_a_fake_results_json(tmp_path, capsys):
    claims = load_script("claims")
    ids = [f"q{i}" for i in range(200)]
    high = {q: 80.0 + 20 * (i % 2) for i, q in enumerate(ids)}           # F1 90
    low = {q: 20.0 * (i % 3) for i, q in enumerate(ids)}                  # F1 ~20
    coin = {q: 100.0 * (i % 2) for i, q in enumerate(ids)}                # F1 50, each side wins half
    zero = {q: 0.0 for q in ids}
    near = {q: v + (1.0 if i % 2 else -1.0) for i, (q, v) in enumerate(high.items())}  # within +-1 of high
    results = _suite_results({"a": {4: (high, {}), 16: (low, {})}, "b": {4: (low, {}), 16: (high, {})},
                              "c": {4: (coin, {}), 16: (near, {})}, "z": {4: (zero, {}), 16: (zero, {})}, "d": {4: ({q: 100 - v for q, v in coin.items()}, {})},
                              "g1": {8: (coin, {"ratio": 8.1, "ppl_compressed": 9.0, "ppl_none": 10.0})},
                              "g2": {4: (coin, {"ratio": 4.0, "ppl_compressed": 12.0, "ppl_none": 10.0})},
                              "h1": {8: (coin, {"ppl_compressed": 11.0, "ppl_none": 10.0})},
                              "h2": {4: (coin, {"ppl_compressed": 12.0, "ppl_none": 10.0})},
                              "p": {4: (high, {})}, "q": {4: (near, {})}})
    results.insert(0, _suite_results({"o": {4: ({"other": 50.0}, {})}})[0])  # a run read on other questions
    for res in results[-2:]:  # p and q: another part's runs, whose own no-context row is where they are
        res["no_context"] = {**res["no_context"], "scores": {"em": zero, "f1": high}}
    C = claims.Claim
    cases = [(C("t", "a beats b", "a@4", "b@4", 60, 50), "agrees"),
             (C("t", "a beats b", "a@16", "b@16", 60, 50), "disagrees"),
             (C("t", "c beats d", "c@4", "d", 60, 50), "cannot tell"),        # "d": the run's one row
             (C("t", "c ~ b", "c@16", "b@16", 70, 71, "~"), "agrees"),         # |diff| ~1 < 5
             (C("t", "a ~ b", "a@4", "b@4", 70, 71, "~"), "disagrees"),        # diff +70: outside the band
             (C("t", "c ~ d", "c@4", "d", 70, 71, "~"), "cannot tell"),        # diff 0 but CI ~[-14, 14]
             (C("t", "zero ~ zero", "z@4", "z@16", 70, 71, "~"), "cannot tell"),  # both at no context
             (C("t", "p ~ q", "p", "q", 70, 71, "~"), "cannot tell"),  # both at their own run's no context
             (C("t", "a beats zz", "a@4", "zz@4", 60, 50), "no data"),
             (C("t", "a beats o", "a@4", "o@4", 60, 50), "no data"),  # (other questions: the whole table stopped)
             (C("t", "halves", "g1", "g2", 16.55, 8.28, "~", "ratio", 0.5), "agrees (no CI)"),
             (C("t", "lower ppl", "g1", "g2", 7.2, 12.8, "<", "ppl_compressed"), "agrees (no CI)"),  # g1 < none
             (C("t", "lower ppl", "h1", "h2", 7.2, 12.8, "<", "ppl_compressed"), "cannot tell (no CI)"),  # both >=
             (C("t", "ppl under 8", "g1", "8", 7.2, 8, "<", "ppl_compressed"), "disagrees (no CI)")]
    got = [claims.judge(c, results)["verdict"] for c, _ in cases]
    assert got == [v for _, v in cases]
    few = _suite_results({"a": {4: (dict(list(high.items())[:29]), {})}, "b": {4: (dict(list(low.items())[:29]), {})}})
    assert claims.judge(cases[0][0], few)["verdict"] == "cannot tell"  # 29 shared questions: under MIN_SHARED
    assert claims.controls(few).splitlines()[3].endswith("| cannot tell | - | no data |")
    few[0]["rows"][0]["scores"]["f1"]["q29"] = few[1]["rows"][0]["scores"]["f1"]["q29"] = 0.0  # 30
    assert claims.judge(cases[0][0], few)["verdict"] == "agrees"
    j = claims.judge(cases[0][0], results)
    assert j["diff"] == pytest.approx(sum(high.values()) / 200 - sum(low.values()) / 200) and j["ci"][0] > 0
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    claims.main([str(path)])
    out = capsys.readouterr().out
    assert "| meanpool_multi_ratio T1 | mean pooling > bidirectional compression tokens, 4x |" in out
    assert f"{len(claims.CLAIMS)} claims: {len(claims.CLAIMS)} no data" in out  # no suite run names here
    with pytest.raises(SystemExit, match="one run's metrics.json"):
        claims.main([_scores_file(tmp_path / "one.json", {4: high})])


def test_each_row_against_its_controls(tmp_path, capsys):
    """claims.py's second table: each row's paired F1 difference from its run's no-context row, and its answer
    NLL's from its own reading another question's memory."""
    claims = load_script("claims")
    ids = [f"q{i}" for i in range(200)]
    high = {q: 80.0 + 20 * (i % 2) for i, q in enumerate(ids)}
    zero = dict.fromkeys(ids, 0.0)
    results = _suite_results({"a": {4: (high, {}), 16: (zero, {})}, "g": {4: (high, {})}})
    nll = {4: ({q: 1.0 + i % 2 for i, q in enumerate(ids)}, dict.fromkeys(ids, 3.0)),  # 1.5 below its control
           16: (dict.fromkeys(ids, 3.0), {q: 3.0 + (1 if i % 2 else -1) for i, q in enumerate(ids)})}  # as likely
    for row in results[0]["rows"]:
        row["scores"]["nll"], row["scores"]["nll_other"] = nll[row["ratio_requested"]]
    lines = claims.controls(results).splitlines()
    assert lines[2] == "| teacher | +100.0 [+100.0, +100.0] | above | - | no data |"
    assert lines[3].startswith("| a@4 | +90.0 [+8") and lines[3].endswith("| above | -1.50 [-1.57, -1.43] | below |")
    assert lines[4].startswith("| a@16 | +0.0 [+0.0, +0.0] | cannot tell | +0.00 [-0.1") and lines[4].endswith(
        "| cannot tell |")
    assert lines[5].startswith("| g | +90.0") and lines[5].endswith("| above | - | no data |")  # "RUN": one row
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    claims.main([str(path)])
    assert capsys.readouterr().out.rstrip().endswith("\n".join(lines))


def test_claims_over_seeds_one_verdict_per_seed_and_their_count(tmp_path, capsys):
    """Two suite runs (seeds): a claim both agree on, one they split, one neither has."""
    claims = load_script("claims")
    ids = [f"q{i}" for i in range(200)]
    high = {q: 80.0 + 20 * (i % 2) for i, q in enumerate(ids)}
    low = {q: 20.0 * (i % 3) for i, q in enumerate(ids)}
    seed_a = _suite_results({"a": {4: (high, {})}, "b": {4: (low, {})}, "c": {4: (high, {})}})
    seed_b = _suite_results({"a": {4: (high, {})}, "b": {4: (low, {})}, "c": {4: (low, {})}})
    C = claims.Claim
    cs = [C("t", "a beats b", "a@4", "b@4", 60, 50), C("t", "c beats b", "c@4", "b@4", 60, 50),
          C("t", "c beats a", "c@4", "a@4", 60, 50), C("t", "a beats zz", "a@4", "zz@4", 60, 50),
          C("t", "b beats b", "b@4", "b@4", 60, 50)]
    out = claims.seeds_table({"s1": seed_a, "s2": seed_b}, cs).splitlines()
    assert out[0] == "| source | claim | A vs B | s1 | s2 | over seeds |"
    assert out[2].endswith("agrees | **every seed agrees** |")
    assert "**1 agrees, 1 cannot tell** |" in out[3]                     # c = b on s2: +0.0 [..]
    assert "**1 cannot tell, 1 disagrees** |" in out[4]                  # c = a on s1, c < a on s2
    assert out[5].endswith("| 90.0 / - no data | 90.0 / - no data | **2 no data** |")
    assert out[6].endswith("**every seed cannot tell** |")
    assert out[-1] == "5 claims over 2 seeds: 1 every seed agrees, 1 every seed cannot tell, 2 mixed, 1 no data"
    for name, res in (("suite", seed_a), ("suite-s1", seed_b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps(res))
    claims.main([str(tmp_path / "suite" / "results.json"), str(tmp_path / "suite-s1" / "results.json")])
    assert "| source | claim | A vs B | suite | suite-s1 | over seeds |" in capsys.readouterr().out
    for seed, res in ((1337, seed_a), (1, seed_b)):  # runs whose run.json names their seed: a column per seed
        for run in res:
            run["run"] = str(tmp_path / f"s{seed}" / os.path.basename(run["run"]))
            os.makedirs(run["run"])
            (tmp_path / run["run"] / "run.json").write_text(json.dumps({"train": {"seed": seed}}))
        (tmp_path / f"s{seed}" / "results.json").write_text(json.dumps(res))
    claims.main([str(tmp_path / "s1337" / "results.json"), str(tmp_path / "s1" / "results.json")])
    assert "| source | claim | A vs B | seed 1337 | seed 1 | over seeds |" in capsys.readouterr().out
    shutil.copy(tmp_path / "s1" / "results.json", tmp_path / "copy.json")  # (counted as a second seed)
    with pytest.raises(SystemExit, match=r"copy.json holds the same results as .*s1/results.json: name each seed"):
        claims.main([str(tmp_path / "s1" / "results.json"), str(tmp_path / "copy.json")])
    os.mkfifo(tmp_path / "fifo")  # (reading it waited forever)
    with pytest.raises(SystemExit, match=r"fifo: not a regular file"):
        claims.main([str(tmp_path / "fifo")])


def test_claims_name_rows_of_the_suite():
    """Every row a claim names is a run of scripts/reproduce.sh (and trains that ratio)."""
    claims = load_script("claims")
    script = (ROOT / "scripts" / "reproduce.sh").read_text()
    runs = set(re.findall(r"^\s*run (\S+)", script, re.M))
    runs |= {f"gist-{g}" for g in (1, 2, 4, 8)} | {f"sac{v}-r{r}" for v in ("", "-causal", "-no_emb", "-random")
                                                   for r in (5, 15)} | {"ata", "ata-no_aac", "ata-no_selective"}
    for c in claims.CLAIMS:
        for side in (c.a, c.b):
            if not re.fullmatch(r"[\d.]+", side):
                assert side.split("@")[0] in runs, (c.text, side)
        assert c.kind in (">", "<", "~") and (c.metric != "f1" or c.kind != "<"), c.text


def test_results_md_is_generated_whole(tmp_path, base_dir):
    """The report: header (command, commit, machine, base tokens/s, wall time, seeds,
    steps, questions), the table with intervals, the claims, the controls; rerunning rewrites it."""
    results_md = load_script("results_md")
    ids = [f"q{i}" for i in range(40)]  # (an F1 verdict needs claims.MIN_SHARED questions)
    runs = {"meanpool": {4: ({q: 100.0 * (i % 2) for i, q in enumerate(ids)}, {"n": 40})},
            "ctok-bidir": {4: ({q: 0.0 for q in ids}, {"n": 40})}}
    results = _suite_results(runs)
    for res in results:
        res["run"] = str(tmp_path / os.path.basename(res["run"]))
        os.makedirs(res["run"])
        (tmp_path / res["run"] / "run.json").write_text(json.dumps({"train": {"max_iters": 150, "batch_size": 16, "seed": 1337}}))
    (tmp_path / "results.json").write_text(json.dumps(results))
    out = tmp_path / "report" / "RESULTS.md"
    out.parent.mkdir()
    out.write_text(results_md.REPORT_TITLE + "\n\nhand-written history\n")  # (another file is refused: below)
    args = [str(tmp_path / "results.json"), "--out", str(out), "--base", str(base_dir), "--command", "bash x.sh",
            "--wall_s", "125"]
    results_md.main(args)
    text = out.read_text()
    assert "hand-written" not in text and text.startswith("# Results: the reproduction suite")
    for want in ("- command: `bash x.sh`", "- wall time: 125 s (2.1 min) for 2 evaluated runs",
                 "- seeds: 1337; training steps x batch per run: 150 x 16; held-out questions per row: 40",
                 "tokens/s (fwd + bwd", "| meanpool | 4.0x | 0.0 [0.0, 0.0] | 50.0 [",
                 "| mean pooling > bidirectional compression tokens, 4x | meanpool@4 > ctok-bidir@4 | 70.55 / 69.57 |"
                 " 50.0 / 0.0 | +50.0 [", "agrees** |", "no data** |", "F1 claims (per question",
                 "## Each row against its controls", "| meanpool | +50.0 [",
                 "| ctok-bidir | +0.0 [+0.0, +0.0] | cannot tell |"):
        assert want in text, want
    assert ("RESULTS.png" in text) == (tmp_path / "report" / "RESULTS.png").exists()
    results_md.main(args)
    assert out.read_text().split("- machine")[1].split("- base")[0] == text.split("- machine")[1].split("- base")[0]
    with pytest.raises(SystemExit, match="--base .*: no config.json"):
        results_md.main(args[:3] + ["--base", str(tmp_path)])
    (tmp_path / "other.json").write_text(json.dumps(_suite_results({"x": runs["meanpool"]})))  # another suite's runs
    with pytest.raises(SystemExit, match="other.json: no claim reads its runs \\(named x\\): not the output"):
        results_md.main([str(tmp_path / "other.json"), "--out", str(out)])  # (it replaced RESULTS.md, exit 0)
    assert out.read_text().startswith("# Results: the reproduction suite")


def test_results_md_keeps_other_commands_sections(tmp_path):
    """--section puts a block into RESULTS.md (appended, then replaced in place), and the
    suite's regeneration of the file keeps it while dropping hand-written text."""
    results_md = load_script("results_md")
    out, body = tmp_path / "RESULTS.md", tmp_path / "body.md"
    out.write_text(results_md.REPORT_TITLE + "\n\nhand-written history\n")
    body.write_text("first table\n")
    results_md.main(["--section", "SmolLM2", "--body", str(body), "--out", str(out)])
    body.write_text("second table\n")
    results_md.main(["--section", "SmolLM2", "--body", str(body), "--out", str(out)])
    text = out.read_text()
    assert text.count("## SmolLM2") == 1 and "second table" in text and "first table" not in text
    ids = [f"q{i}" for i in range(4)]
    results = _suite_results({"meanpool": {4: ({q: 50.0 for q in ids}, {"n": 4})}})
    (tmp_path / "results.json").write_text(json.dumps(results))
    results_md.main([str(tmp_path / "results.json"), "--out", str(out)])
    text = out.read_text()
    assert text.startswith("# Results: the reproduction suite") and "hand-written" not in text
    assert "<!-- section: SmolLM2 -->\n## SmolLM2\n\nsecond table\n<!-- end section -->" in text
    with pytest.raises(SystemExit, match="--body .*: no such file"):
        results_md.main(["--section", "x", "--body", str(tmp_path / "missing.md"), "--out", str(out)])
    before = out.read_text()
    for args in ([str(tmp_path / "results.json"), "--section", "x", "--body", str(body)],  # which one to write?
                 [str(tmp_path / "results.json"), "--body", str(body)],
                 *([str(tmp_path / "results.json"), "--wall_s", w] for w in ("-5", "nan"))):
        with pytest.raises(SystemExit, match="error: (name the suite's results JSON .*: one of them|--wall_s)"):
            results_md.main(args + ["--out", str(out)])
    assert out.read_text() == before
    data = tmp_path / "squad.json"  # an --out that is not a report is not overwritten or appended to
    data.write_text('{"data": []}')
    (tmp_path / "latin1.md").write_bytes(b"Caf\xe9\n")
    for target, why in ((data, "name a markdown file"), (tmp_path / "latin1.md", "not UTF-8 text")):
        with pytest.raises(SystemExit, match=f"^error: --out '{target}': {why}"):
            results_md.main(["--section", "x", "--body", str(body), "--out", str(target)])
    assert data.read_text() == '{"data": []}' and (tmp_path / "latin1.md").read_bytes() == b"Caf\xe9\n"
    with pytest.raises(SystemExit, match=f"^error: RESULTS '{data}': name a markdown file"):  # a script's check
        results_md.main(["--check", "RESULTS", "--out", str(data)])
    assert results_md.main(["--check", "RESULTS", "--out", str(tmp_path / "new" / "R.md")]) is None


# -----------------------------------------------------------------------------
# bad input: one line naming the flag, file or key, before any work

def _one_line(main, argv):
    """main(argv)'s one-line "error: ..." (a SystemExit, as each script's __main__ prints it)."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    line = str(e.value.code)
    assert line.startswith("error: ") and "\n" not in line, line
    return line


def test_eval_flags_of_the_other_mode_and_one_shot_edges_are_one_line(tmp_path):
    """Flags the mode would ignore, --context with --memory, --ratio or --save_memory with --memory (ignored before),
    a ratio list or several runs in one-shot mode, an empty
    --context, an --out its plot would overwrite: one line before any run is read."""
    (tmp_path / "doc.txt").write_text("The Nile flows north through Egypt.")
    (tmp_path / "empty.txt").write_text(" \n")
    run, doc = tmp_path / "no-run", tmp_path / "doc.txt"
    for argv, message in (([run, "--context", doc, "--n", 2], "--n applies to evaluating runs, not to one-shot mode"),
                          ([run, "--question", "Q", "--out", tmp_path / "o.json"], "--out applies to evaluating runs"),
                          ([run, "--save_memory", tmp_path / "x.mem"], "--save_memory applies to one-shot mode"),
                          ([run, "--context", doc, "--memory", doc], "--context and --memory: give one"),
                          ([run, "--context", doc, "--ratio", "4,8"], "--ratio '4,8': one-shot mode answers at one"),
                          ([run, "--memory", doc, "--ratio", 8], "--ratio applies to compressing a --context"),
                          ([run, "--memory", doc, "--save_memory", tmp_path / "x.mem"], "--save_memory applies to com"),
                          ([run, run, "--context", doc], "one-shot mode answers from one run dir; 2 given"),
                          ([run, "--context", tmp_path / "empty.txt"], "empty.txt: empty, nothing to compress"),
                          ([run, "--out", tmp_path / "o.png"], f"--out '{tmp_path / 'o.png'}': name a .json"),
                          # files it would write over (each was overwritten): the input, a run's own files
                          ([run, "--context", doc, "--save_memory", doc], "--save_memory '%s' is the --context" % doc),
                          ([run, "--context", doc, "--save_memory", tmp_path / "r" / "ckpt-0000001.safetensors"],
                           f"ckpt-0000001.safetensors' is a file of the run {tmp_path / 'r'}; name another"),
                          ([tmp_path / "r", "--out", tmp_path / "r" / "metrics.json"], "is a file of the run"),
                          # or any file but what it writes: a dataset, a text
                          ([run, "--out", tmp_path / "squad.json"], "squad.json' is not an eval.py --out JSON; name"),
                          ([run, "--context", doc, "--save_memory", tmp_path / "empty.txt"],
                           "empty.txt' is not a saved Memory; name another")):
        (tmp_path / "squad.json").write_text('{"data": []}')
        (tmp_path / "r").mkdir(exist_ok=True)
        (tmp_path / "r" / "run.json").write_text("{}")
        assert message in _one_line(evaluate.main, argv), argv
    assert doc.read_text() == "The Nile flows north through Egypt." and os.listdir(tmp_path / "r") == ["run.json"]
    shutil.rmtree(tmp_path / "r")
    assert sorted(os.listdir(tmp_path)) == ["doc.txt", "empty.txt", "squad.json"]
    assert (tmp_path / "squad.json").read_text() == '{"data": []}' and (tmp_path / "empty.txt").read_text() == " \n"
    p = subprocess.run([sys.executable, "eval.py", run, "--context", doc, "--n", "2"], cwd=ROOT, capture_output=True,
                       text=True)
    assert p.returncode != 0 and p.stderr.startswith("error: --n applies") and p.stderr.count("\n") == 1, p.stderr


def test_eval_reads_every_results_file_before_any_work(tmp_path, monkeypatch):
    """A cached metrics.json or an earlier --out JSON of the wrong shape (what the table, the plot and claims.py
    read) is one line naming the file and the key, before any run named before it is evaluated."""
    loaded = []
    monkeypatch.setattr(train, "load_run", lambda run_dir, device: loaded.append(run_dir))
    todo = tmp_path / "todo"  # a run to evaluate: listed first, never loaded
    todo.mkdir()
    (todo / "run.json").write_text(json.dumps({"train": {"method": "meanpool"}, "method": {}}))
    good = json.loads((_fake_run(tmp_path / "good", "meanpool", [4]) / "metrics.json").read_text())
    bad_row = dict(good, rows=[dict(good["rows"][0], f1="high")])
    bad_scores = dict(good, teacher=dict(good["teacher"], scores={"em": {}, "f1": {"q0": None}}))
    row = lambda **change: dict(good, rows=[dict(good["rows"][0], **change)])  # noqa: E731
    for i, (content, message) in enumerate([
            ([], "([] is not a run's result (an object)); rerun with --recompute"),
            (dict(good, rows=[]), "corrupt metrics file (key 'rows' is empty)"),
            ({k: v for k, v in good.items() if k != "no_context"}, "corrupt metrics file (missing key 'no_context')"),
            (bad_row, "corrupt metrics file (key 'rows[0].f1' is 'high', expected a finite number)"),
            (bad_scores, "key 'teacher.scores' is not {\"em\": {id: number}, \"f1\": {id: number}, ...}"),
            (row(ratio=float("nan")), "key 'rows[0].ratio' is nan, expected a finite number"),  # claims: "disagrees"
            (row(f1=True), "key 'rows[0].f1' is True, expected a finite number"),
            (row(memory_bytes="8"), "key 'rows[0].memory_bytes' is '8', expected a finite number"),
            (row(probe_abs_err="x"), "key 'rows[0].probe_abs_err' is 'x'"),  # (a traceback in claims.py)
            (row(f1_ci=5), "key 'rows[0].f1_ci' is 5, expected [low, high]"),
            (row(f1_norm="0.5"), "key 'rows[0].f1_norm' is '0.5', expected a number"),
            (row(scores={"em": {"q0": 1.0}, "f1": {"q0": float("nan")}}), "key 'rows[0].scores' is not")]):
        run = _fake_run(tmp_path / f"bad{i}", "meanpool", [4])
        (run / "metrics.json").write_text(json.dumps(content))
        line = _one_line(evaluate.main, [todo, run])
        assert f"bad{i}/metrics.json: corrupt metrics file" in line and message in line, line
    for i, (content, message) in enumerate([([], "not an eval.py --out JSON, a list of runs: []"),
                                            ([good, 3], "not an eval.py --out JSON: run 1: 3 is not a run's result"),
                                            ([dict(good, run=None)], "run 0: key 'run' is None, expected str")]):
        (tmp_path / f"out{i}.json").write_text(json.dumps(content))
        line = _one_line(evaluate.main, [todo, tmp_path / f"out{i}.json"])
        assert f"out{i}.json: not an eval.py --out JSON" in line and message in line, line
    assert "'" + str(tmp_path / "gone") + "' is not a run dir (no run.json)" in _one_line(
        evaluate.main, [todo, tmp_path / "gone"])
    assert loaded == [] and not (todo / "metrics.json").exists()
    evaluate.main([str(tmp_path / "good"), "--out", str(tmp_path / "new" / "all.json")])  # its folder is made
    assert json.loads((tmp_path / "new" / "all.json").read_text())[0]["rows"] == good["rows"]


def test_eval_checks_ratio_and_max_new_tokens_against_the_run(tmp_path):
    """A --ratio above the run's --max_context (every context one slot) and a --max_new_tokens above the
    decoder's positions (a 1 TB KV cache) are one line before any answer, in both modes; nothing is written.
    --save_memory into a folder not made yet makes it."""
    run = tmp_path / "mp"
    train.main([str(a) for a in ["--method", "meanpool", "--max_iters", 1, "--batch_size", 2, "--eval_examples", 0,
                                 "--quiet", "--device", "cpu", "--out_dir", run]])
    (tmp_path / "doc.txt").write_text("The Nile flows north through Egypt.")
    before = sorted(os.listdir(run))
    for mode in (["--n", 2], ["--context", tmp_path / "doc.txt"]):
        for argv, message in ((["--ratio", 2048], f"above {run}'s --max_context 1024"),
                              (["--max_new_tokens", 10 ** 9], f"above the 2048 positions of {run}'s decoder")):
            assert message in _one_line(evaluate.main, [run, *mode, *argv]), (mode, argv)
    assert sorted(os.listdir(run)) == before
    wide = tmp_path / "wide"  # a run whose decoder has 4096 positions, named first: it was evaluated, then the
    shutil.copytree(tiny.BASE_DIR, tmp_path / "wide_base")  # command failed on the second run
    config = json.loads((tmp_path / "wide_base" / "config.json").read_text())
    (tmp_path / "wide_base" / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    shutil.copytree(run, wide)
    state = json.loads((wide / "run.json").read_text())
    state["train"]["init_from"] = str(tmp_path / "wide_base")
    (wide / "run.json").write_text(json.dumps(state))
    line = _one_line(evaluate.main, [wide, run, "--n", 2, "--max_new_tokens", 3000])
    assert f"--max_new_tokens 3000: above the 2048 positions of {run}'s decoder" in line and not (
        wide / "metrics.json").exists()
    evaluate.main([str(a) for a in [run, "--context", tmp_path / "doc.txt", "--max_new_tokens", 2,
                                    "--save_memory", tmp_path / "new" / "doc.mem"]])
    assert (tmp_path / "new" / "doc.mem").is_file()
    shutil.copytree(run, tmp_path / "at16")
    state = json.loads((run / "run.json").read_text())
    state["train"]["eval_ratio"] = "16"
    (tmp_path / "at16" / "run.json").write_text(json.dumps(state))
    for run_dir, ratio in ((run, 4), (tmp_path / "at16", 16)):  # one-shot: the run's --eval_ratio (it read --ratio)
        out = subprocess.run([sys.executable, "eval.py", run_dir, "--context", tmp_path / "doc.txt",
                              "--max_new_tokens", "2"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert f"memory at ratio {ratio}: " in out, out


def test_a_saved_memory_says_which_run_saved_it(tmp_path, capsys):
    """--save_memory records the run and method: another method's run reading it is one line before any model
    loads (pic's memory is embeddings as wide as meanpool's: it answered from it), another run of the same method
    a note."""
    runs = {m: tmp_path / m for m in ("meanpool", "pic")}
    for method, run in runs.items():
        first_stage = ["--pretrain", 0] if method == "pic" else []  # (its ae+lm: not needed here)
        train.main([str(a) for a in ["--method", method, "--max_iters", 1, "--batch_size", 2, "--eval_examples", 0,
                                     "--quiet", "--device", "cpu", "--out_dir", run, *first_stage]])
    (tmp_path / "doc.txt").write_text("The Nile flows north through Egypt.")
    mem = tmp_path / "doc.mem"
    evaluate.main([str(a) for a in [runs["meanpool"], "--context", tmp_path / "doc.txt", "--max_new_tokens", 2,
                                    "--save_memory", mem]])
    assert Memory.load(str(mem)).origin == {"run": str(runs["meanpool"]), "method": "meanpool",
                                            "base": os.path.realpath(tiny.BASE_DIR),
                                            "checkpoint": evaluate.checkpoint_stamp(runs["meanpool"])}
    line = _one_line(evaluate.main, [runs["pic"], "--memory", mem, "--question", "Where?"])
    assert f"was saved by a --method meanpool run ({runs['meanpool']}); {runs['pic']} is a --method pic run" in line
    shutil.copytree(runs["meanpool"], tmp_path / "copy")
    capsys.readouterr()
    evaluate.main([str(a) for a in [tmp_path / "copy", "--memory", mem, "--question", "Where?", "--max_new_tokens", 2]])
    assert f"was saved by {runs['meanpool']}; answering with {tmp_path / 'copy'}" in capsys.readouterr().err
    saved = Memory.load(str(mem))  # a run on another base: its answers were garbage after the note
    saved.origin = dict(saved.origin, base="/another/base")
    saved.save(str(tmp_path / "other.mem"))
    line = _one_line(evaluate.main, [tmp_path / "copy", "--memory", tmp_path / "other.mem"])
    assert "was saved by a run on the base /another/base;" in line, line
    saved.origin, saved.next_pos = None, torch.tensor([1 << 40])  # past the decoder's positions
    saved.save(str(tmp_path / "far.mem"))
    line = _one_line(evaluate.main, [tmp_path / "copy", "--memory", tmp_path / "far.mem"])
    assert "does not fit" in line and "its next position 1099511627776 is past the decoder's 2048" in line, line


def test_a_run_or_ratio_eval_cannot_read_is_one_line_before_any_run_is_evaluated(tmp_path, capsys):
    """eval.py's --ratio meets each run's own rules, as its --eval_ratio would, before the first run is evaluated:
    pic's memory table (an IndexError at --ratio 1), sentence_gist's achieved ratio (was silently ignored). So does
    a teacher run (its line came after the runs before it; one-shot: an AttributeError). An --n above the file's
    questions reads them all and says so."""
    runs = {}
    for method, flags in (("meanpool", []), ("pic", ["--pretrain", 0]), ("sentence_gist", []), ("teacher", [])):
        runs[method] = tmp_path / method
        train.main([str(a) for a in ["--method", method, "--max_iters", 1, "--batch_size", 2, "--eval_examples", 0,
                                     "--quiet", "--device", "cpu", "--out_dir", runs[method], *flags]])
    for argv, message in (([runs["pic"], "--ratio", 1], "1024 memory tokens > --max_mem 256"),
                          ([runs["meanpool"], runs["sentence_gist"], "--ratio", 4], "--eval_ratio 4 does not apply"),
                          ([runs["meanpool"], runs["pic"], "--ratio", "4,2"], "--max_mem 256"),
                          ([runs["meanpool"], runs["teacher"]], "is a --method teacher run; eval.py evaluates comp")):
        assert message in _one_line(evaluate.main, [*argv, "--n", 2]), argv
    (tmp_path / "doc.txt").write_text("The Nile flows north through Egypt.")
    assert "is a --method teacher run" in _one_line(evaluate.main, [runs["teacher"], "--context", tmp_path / "doc.txt"])
    assert not any((run / "metrics.json").exists() for run in runs.values())
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps({"id": f"q{i}", "context": "Ada was born in Paris.", "question": "Where?",
                                      "answers": ["Paris"]}) + "\n" for i in range(3)))
    capsys.readouterr()
    (res,) = evaluate.main([str(runs["sentence_gist"]), "--eval_data", str(qa), "--n", "50", "--max_new_tokens", "2"])
    assert res["rows"][0]["n"] == 3 and f"--n 50: {qa} holds 3 questions" in capsys.readouterr().err


def test_scripts_bad_input_is_one_line(tmp_path, monkeypatch, capsys):
    """claims.py, results_md.py, compare.py, hf_generate.py: a results JSON of the wrong shape, a run.json that is
    not JSON, an unknown flag, an --out that is a folder: one line, no traceback, and RESULTS.md kept."""
    claims, results_md, compare, hf_generate = (load_script(n) for n in ("claims", "results_md", "compare",
                                                                         "hf_generate"))
    ids = [f"q{i}" for i in range(4)]
    results = _suite_results({"gist-8": {4: ({q: 50.0 for q in ids}, {}), 8: ({q: 50.0 for q in ids}, {})}})
    (tmp_path / "two_rows.json").write_text(json.dumps(results))
    (tmp_path / "junk.json").write_text(json.dumps([{"run": "x", "rows": [1]}]))
    broken = tmp_path / "gist-8"  # (a run of the suite's)
    broken.mkdir()
    (broken / "run.json").write_text("{oops")
    (tmp_path / "broken.json").write_text(json.dumps([dict(results[0], run=str(broken), rows=results[0]["rows"][:1])]))
    out, kept = tmp_path / "RESULTS.md", results_md.REPORT_TITLE + "\n\nkept\n"
    out.write_text(kept)
    readme = tmp_path / "README.md"  # (named as --out, it was replaced by the report, exit 0)
    readme.write_text("# a project\n")
    os.mkfifo(tmp_path / "fifo.md")  # (reading it waited forever)
    (tmp_path / "empty.md").write_text("\n")
    (tmp_path / "marked.md").write_text("text\n<!-- end section -->\n")
    (tmp_path / "latin.md").write_bytes(b"caf\xe9\n")
    for main, argv, message in (
            (claims.main, [tmp_path / "junk.json"], "junk.json: not an eval.py --out JSON: run 0: missing key"),
            (claims.main, [tmp_path / "two_rows.json"], "run out/suite/gist-8 has 2 rows and a claim names it alone"),
            (claims.main, ["--seeds", tmp_path / "junk.json"], "unknown flag --seeds; usage: python scripts/claims.py"),
            (claims.main, [""], "a results JSON named '': name an eval.py --out JSON"),  # (cannot read . (Is a ...))
            (compare.main, ["", tmp_path / "junk.json"], "a results JSON named '': name a metrics.json"),
            (results_md.main, [tmp_path / "junk.json", "--out", out], "junk.json: not an eval.py --out JSON: run 0"),
            (results_md.main, [tmp_path / "junk.json", "--out", tmp_path], "is a folder; name a file"),
            (results_md.main, ["--section", "S", "--body", tmp_path, "--out", out], f"--body '{tmp_path}': a folder"),
            (results_md.main, ["--section", "", "--body", tmp_path / "marked.md", "--out", out], "--section is empty"),
            (results_md.main, ["--check", "", "--out", out], "--check is empty"),
            (results_md.main, [tmp_path / "junk.json", "--check", "RESULTS", "--out", out],
             "--check only checks --out; "),
            *((results_md.main, argv + ["--out", tmp_path / "fifo.md"], "fifo.md': not a regular file")
              for argv in ([tmp_path / "junk.json"], ["--check", "RESULTS"])),
            *((results_md.main, argv + ["--out", readme], "README.md': it holds text this did not write")
              for argv in ([tmp_path / "junk.json"], ["--check", "RESULTS"], ["--section", "S", "--body", out])),
            (results_md.main, ["--section", "S", "--body", tmp_path / "empty.md", "--out", out], "empty.md: empty"),
            (results_md.main, ["--section", "S", "--body", tmp_path / "marked.md", "--out", out], "a section marker"),
            (results_md.main, ["--section", "S", "--body", tmp_path / "latin.md", "--out", out], "not UTF-8 text"),
            # a title that broke the file's section markers; a flag that was ignored
            (results_md.main, ["--section", "a -->", "--body", tmp_path / "latin.md", "--out", out], "a title of one"),
            (results_md.main, ["--section", "S", "--body", tmp_path / "latin.md", "--wall_s", "3", "--out", out],
             "--wall_s describes a suite's results JSON, not a --section"),
            (results_md.main, [tmp_path / "junk.json", "--wall_s", "x"], "argument --wall_s: invalid float value"),
            (hf_generate.main, [tmp_path, "--memory", "m", "--question", "q", "--max_new_tokens", 0],
             "--max_new_tokens 0 must be a positive integer"),
            (hf_generate.main, [tmp_path, "--memory", "m"], "the following arguments are required: --question"),
            (hf_generate.main, [tmp_path, "--memory", "m", "--question", " "], "--question is empty"),
            (hf_generate.main, [tmp_path, "--memory", "m", "--question", "why\udcff"], "--question is not UTF-8 text")):
        assert message in _one_line(main, argv), argv
    assert out.read_text() == kept and readme.read_text() == "# a project\n"
    capsys.readouterr()
    claims.main(["--help"])
    assert "python scripts/claims.py out/suite/results.json " in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["benchmarks/hf_twins.py", "--help"])
    load_script("hf_twins", "benchmarks").main()
    assert capsys.readouterr().out.startswith("bench.py train's meanpool kd")  # (it was bench.py's)
    a = _scores_file(tmp_path / "a.json", {4: {"q0": 1.0}})
    bad = json.load(open(a))
    bad["rows"][0]["scores"]["f1"] = {"q0": "x"}
    (tmp_path / "b.json").write_text(json.dumps(bad))
    assert "b.json is not an eval.py results JSON: key 'rows[0].scores' is not {\"em\": {id: number}" in \
        _one_line(compare.main, [a, tmp_path / "b.json"])
    bad["rows"][0]["scores"]["f1"] = {"q0": float("nan")}  # (its verdict looked like any other)
    (tmp_path / "nan.json").write_text(json.dumps(bad))
    assert "nan.json is not an eval.py results JSON: key 'rows[0].scores' is not" in \
        _one_line(compare.main, [a, tmp_path / "nan.json"])
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)  # (a RecursionError traceback)
    for main, n in ((compare.main, 2), (claims.main, 1)):
        assert "deep.json: JSON nested too deeply to read" in _one_line(main, [tmp_path / "deep.json"] * n)
    shutil.copy(tmp_path / "broken.json", tmp_path / "broken2.json")
    assert "two_rows.json is named twice" in _one_line(claims.main, [tmp_path / "two_rows.json"] * 2)
    for script, args in (("scripts/claims.py", [tmp_path / "broken.json", tmp_path / "broken2.json"]),
                         ("scripts/results_md.py", [tmp_path / "broken.json", "--out", out])):
        p = subprocess.run([sys.executable, script, *map(str, args)], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode != 0 and p.stderr == f"error: {broken}/run.json:1: invalid JSON: Expecting property name " \
            "enclosed in double quotes\n", (script, p.stderr[-2000:])
    assert out.read_text() == kept
