"""scripts/reproduce.sh --smoke: every entry of the reproduction suite runs; one table, the
claims with verdicts and a generated RESULTS.md result (all under tmp_path)."""
import json
import os
import re
import subprocess

import pytest

from common import ROOT


@pytest.mark.slow
def test_suite_smoke_runs_every_entry(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "suite"), OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce.sh"), "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    entries = [l for l in p.stdout.splitlines() if l.startswith("== ")]
    results = json.load(open(tmp_path / "suite-smoke" / "results.json"))
    assert len(entries) == len(results) == 21
    assert entries[0].startswith("== pic-blockwise-ae+lm:") and "--pretrain 2" in entries[0]  # the longest first
    assert (tmp_path / "suite-smoke" / "pic-blockwise-ae+lm" / "pretrain" / "run.json").exists()
    methods = [r["rows"][0]["method"].split(" ")[0] for r in results]  # the table in the papers' order
    assert list(dict.fromkeys(methods)) == ["meanpool", "pic", "sentence_gist", "sac", "ata"], methods
    table = (tmp_path / "suite-smoke" / "results.md").read_text()
    assert "| teacher |" in table and "suite:" in table
    assert "pic (after ae+lm)" in table and "| pic (pretrain=0) |" in table and "ata (no_aac=True)" in table
    report = (tmp_path / "suite-smoke" / "RESULTS.md").read_text()
    assert report.startswith("# Results: the reproduction suite")
    assert "- command: `bash scripts/reproduce.sh --smoke`" in report and "tokens/s (fwd + bwd" in report
    assert "training steps x batch per run: 2 x 2; held-out questions per row: 4" in report
    assert "| teacher | 1.0x |" in report and "| pic (after ae+lm) |" in report
    verdicts = re.findall(r"\*\*(.+?)\*\* \|$", report, re.M)  # one per claim; every row a claim names exists
    count = re.search(r"^(\d+) claims: ", report, re.M)
    assert count and int(count[1]) == len(verdicts) >= 25, report
    assert "no data" not in verdicts, [l for l in report.splitlines() if "no data" in l]
    assert "| meanpool_multi_ratio T1 | mean pooling > causal compression tokens, 16x |" in table  # printed too


def test_seeds_runs_one_setting_per_seed_with_a_table_each(base_dir, tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "seeds"))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "seeds.sh"), "1,2", "--method", "meanpool", "--init_from",
                        str(base_dir), "--max_iters", "2", "--batch_size", "2", "--eval_examples", "4"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert p.stdout.count("| teacher |") == 2  # a table per seed: each seed draws its own questions
    for s in (1, 2):
        assert json.load(open(tmp_path / "seeds" / f"seed{s}" / "run.json"))["train"]["seed"] == s
        assert f"== {tmp_path / 'seeds' / f'seed{s}'}" in p.stdout
    p = subprocess.run(["bash", str(ROOT / "scripts" / "seeds.sh"), "3", "--method", "nope"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode != 0 and "seed3 failed" in p.stderr


@pytest.mark.parametrize("init_from", ["", "/ckpt/Some-1B"])
def test_suite_ata_rows_pretrain_with_rel_only_on_a_real_checkpoint(tmp_path, init_from):
    """The suite's command lines, with `python` a stub that logs its arguments (no training)."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f"#!/bin/sh\necho \"$*\" >> {tmp_path / 'calls'}\n")
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stub.parent}:{os.environ['PATH']}", OUT=str(tmp_path / "suite"),
               RESULTS=str(tmp_path / "RESULTS.md"), INIT_FROM=init_from, DATA="d.json", EVAL_DATA="e.json")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce.sh")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ata = [l for l in (tmp_path / "calls").read_text().splitlines() if "--method ata" in l]
    pretrain = [l for l in ata if "--pretrain 100" in l]  # train.py's --pretrain runs rel, then qa from it
    assert len(ata) == 3 and len(pretrain) == (3 if init_from else 0), ata
