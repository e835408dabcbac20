"""eval.py: SQuAD metrics (hand cases and the official script's numbers), the table builder."""
import json
import zipfile

import pytest

import eval as evaluate
from conftest import ASSETS


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
    (dir / "metrics.json").write_text(json.dumps({"run": str(dir), "teacher": teacher, "no_context": noctx,
                                                  "rows": rows}))
    (dir / "run.json").write_text(json.dumps({"train": {"method": method}}))
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


def test_corrupt_metrics_or_unknown_method_is_one_line(tmp_path):
    bad = _fake_run(tmp_path / "bad", "meanpool", [4])
    (bad / "metrics.json").write_text("{not json")
    with pytest.raises(SystemExit, match="bad/metrics.json: corrupt metrics file"):
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
