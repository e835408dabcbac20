"""scripts/reproduce.sh --smoke: every entry of the reproduction suite runs; one table, the
claims with verdicts and a generated RESULTS.md result (all under tmp_path)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile

import pytest

from common import ROOT, squad_file
from conftest import ASSETS


@pytest.mark.slow
def test_suite_smoke_runs_every_entry(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "suite"), OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce.sh"), "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    entries = [l for l in p.stdout.splitlines() if l.startswith("== ")]
    results = json.load(open(tmp_path / "suite-smoke" / "results.json"))
    assert len(entries) == len(results) == 21
    first = [e for e in entries[:2] if e.startswith("== pic-blockwise-ae+lm:")]  # the longest first (two start
    assert first and "--pretrain 2" in first[0], entries[:2]  # at once: either one's line may come first)
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


@pytest.mark.slow
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
    # (the same command again resumes each seed's run: test_suite_scripts_resume_their_own_runs_..., below)
    p = subprocess.run(["bash", str(ROOT / "scripts" / "seeds.sh"), "1", "--method", "meanpool", "--init_from",
                        str(base_dir), "--max_iters", "2", "--batch_size", "2", "--eval_examples", "6"],
                       cwd=ROOT, env=env, capture_output=True, text=True)  # (its table kept the first command's 4)
    assert p.returncode == 0 and json.load(open(tmp_path / "seeds" / "seed1" / "metrics.json"))["asked"]["n"] == 6
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
    for name in ("d.json", "e.json"):  # the suite checks that they exist
        (tmp_path / name).write_text("{}")
    env = dict(os.environ, PATH=f"{stub.parent}:{os.environ['PATH']}", OUT=str(tmp_path / "suite"),
               RESULTS=str(tmp_path / "RESULTS.md"), INIT_FROM=init_from,
               **(dict(DATA=str(tmp_path / "d.json"), EVAL_DATA=str(tmp_path / "e.json")) if init_from else {}))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce.sh")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    ata = [l for l in (tmp_path / "calls").read_text().splitlines() if "--method ata" in l]
    pretrain = [l for l in ata if "--pretrain 100" in l]  # train.py's --pretrain runs rel, then qa from it
    assert len(ata) == 3 and len(pretrain) == (3 if init_from else 0), ata


def test_suite_scripts_resume_their_own_runs_and_stop_the_others_when_one_fails(tmp_path):
    """reproduce.sh and seeds.sh again on their OUT resume the runs an earlier command began (they trained them anew,
    and a Ctrl-C lost the finished ones), only on the same code (OUT/code.txt); a failed run stops the runs beside it
    (they trained on after the script had exited). `python` is a stub: it logs its arguments; seeds.sh's seed 2
    fails, its seed 1 sleeps."""
    stub, calls, pids = tmp_path / "bin" / "python", tmp_path / "calls", tmp_path / "pids"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\ncase "$*" in\n  *"--seed 2 "*) exit 1 ;;\n'
                    f'  *"--seed 1 "*) echo $$ >> {pids}; exec sleep 60 ;;\nesac\n')
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stub.parent}:{os.environ['PATH']}", OUT=str(tmp_path / "suite"),
               RESULTS=str(tmp_path / "RESULTS.md"))
    (tmp_path / "suite" / "meanpool").mkdir(parents=True)
    (tmp_path / "suite" / "meanpool" / "run.json").write_text("{}")
    p = subprocess.run(["bash", "scripts/reproduce.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    runs = [line for line in calls.read_text().splitlines() if line.startswith("train.py")]
    assert [r.endswith("--resume") for r in runs].count(True) == 1 and "suite/meanpool " in [
        r for r in runs if r.endswith("--resume")][0], runs
    (tmp_path / "suite" / "code.txt").write_text("0abc123 000000000000\n")
    p = subprocess.run(["bash", "scripts/reproduce.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.startswith(f"error: OUT={tmp_path / 'suite'} holds runs of other code ("), p.stderr
    p = subprocess.run(["bash", "scripts/reproduce.sh", "--smoke"], cwd=ROOT, env=dict(env, INIT_FROM="/ckpt/x"),
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr == "error: INIT_FROM, DATA, EVAL_DATA: --smoke trains its own tiny base " \
                                             "on the synthetic set\n", p.stderr
    p = subprocess.run(["bash", "scripts/seeds.sh", "1,2", "--method", "meanpool"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(env, OUT=str(tmp_path / "seeds")), timeout=30)
    assert p.returncode == 1 and "seed2 failed" in p.stderr, p.stderr
    time.sleep(0.5)
    sleeper = f"/proc/{pids.read_text().split()[0]}/status"
    assert not os.path.exists(sleeper) or "\nState:\tZ" in open(sleeper).read(), "seed 1's run outlived seeds.sh"


SQUAD_ZIP = ASSETS / "qa" / "squad" / "dev-v1.1.json.zip"


@pytest.fixture(scope="module")
def small_squad(tmp_path_factory):
    """SQuAD v1.1 dev's 14 smallest articles (1,568 questions: 4 articles to train, 10 held out), the real file's
    format on the suite's path, read by each of its processes in a seventh of the whole file's time."""
    with zipfile.ZipFile(SQUAD_ZIP) as z:
        doc = json.loads(z.read("dev-v1.1.json"))
    doc["data"] = sorted(doc["data"], key=lambda a: sum(len(p["qas"]) for p in a["paragraphs"]))[:14]
    path = tmp_path_factory.mktemp("squad") / "dev-small.json"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.slow
@pytest.mark.skipif(not SQUAD_ZIP.exists(), reason="assets absent")
def test_real_suite_smoke_runs_every_entry_on_smollm2s_path(tmp_path, small_squad):
    """scripts/real_suite.sh --smoke: the GPU suite's code path on CPU (a random stand-in with a byte-level
    tokenizer.json and ChatML; SQuAD dev split by article): the teacher, 13 compressor runs from it, one
    table, the claims, RESULTS.md's section. `python` here stands in for two runs: one fails, one stops as
    at the deadline (`timeout`'s exit 124); the table and claims hold the other 11, the section names both."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\ncase "$*" in\n  *"/meanpool-single4 "*) exit 3 ;;\n  *"/meanpool-single16 "*) exit 124 ;;\n'
                    f'esac\nexec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "real"), SQUAD=str(small_squad),
               PATH=f"{stub.parent}:{os.environ['PATH']}")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "real_suite.sh"), "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 1 and "error: failed: meanpool-single4" in p.stderr, p.stdout[-2000:] + p.stderr[-2000:]
    assert "   meanpool-single16: stopped at the deadline" in p.stdout
    entries = [line.split(":")[0][3:] for line in p.stdout.splitlines() if line.startswith("== ")]
    assert entries[0] == "teacher" and len(entries) == 14 and entries[1] == "meanpool"
    out = tmp_path / "real-smoke"
    results = json.load(open(out / "results.json"))
    assert [os.path.basename(r["run"]) for r in results] == entries[1:-2]
    for name, objectives in (("pic-blockwise", ["ae+lm", "qa"]), ("gist-4", ["lm"] * 3), ("ata", ["rel", "qa"])):
        recipe = json.load(open(out / name / "run.json"))["recipe"]
        assert [st["objective"] for st in recipe] == objectives and recipe[0]["values"]["max_iters"][1].startswith("flag")
    for name in ("meanpool", "pic-causal", "sac-r5", "ata-no_aac"):  # STEPS=2 a run; a pretraining stage half of them
        recipe = json.load(open(out / name / "run.json"))["recipe"]
        want = [[2, "flag"]] if name == "meanpool" else \
            [[1, "flag (--pretrain)"], [1, "flag (--max_iters, shared by the stages)"]]
        assert [st["values"]["max_iters"] for st in recipe] == want, (name, recipe)
    report = (out / "RESULTS.md").read_text()
    assert "## SmolLM2-135M-Instruct on SQuAD: every method on one GPU" in report
    assert "4 articles" in report and "held out" in report and "| teacher | 1.0x |" in report
    assert "- every compressor starts from the teacher (--teacher" in report  # (the decoder pic, sac and ata freeze)
    assert "| pic_blockwise_causal T4 |" in report and "(none " in report  # (no BOS: the "none" ppl reads EOS first)
    assert "not finished by the deadline" in report and ": meanpool-single16\n" in report
    assert "- failed, so not in the table: meanpool-single4\n" in report
    assert re.search(r"^- seconds each run took in the command that finished it, train \+ eval \(JOBS=2 at a time\): "
                     r"teacher: \d+; "
                     r".*meanpool: \d+ \+ \d+", report, re.M), report  # in the order they finished
    single = [line for line in report.splitlines() if "multi-ratio ~ single-ratio" in line]
    assert len(single) == 2 and all("**no data**" in line for line in single)
    # a later part: one run and its own teacher; the first part's runs head its table and join its claims
    env.update(OUT=str(tmp_path / "part2"), ONLY="meanpool-single4", PRIOR=str(out / "results.json"))
    p = subprocess.run(["bash", str(ROOT / "scripts" / "real_suite.sh"), "--smoke"], cwd=ROOT, capture_output=True,
                       text=True, env={**env, "PATH": os.environ["PATH"]})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert [line.split(":")[0][3:] for line in p.stdout.splitlines() if line.startswith("== ")] == \
        ["teacher", "meanpool-single4"]
    merged = json.load(open(tmp_path / "part2-smoke" / "results.json"))
    assert [os.path.basename(r["run"]) for r in merged] == entries[1:-2] + ["meanpool-single4"]
    report = (tmp_path / "part2-smoke" / "RESULTS.md").read_text()
    assert f"come from an earlier part ({out / 'results.json'}: its own command and teacher" in report
    assert f"- command: `ONLY=meanpool-single4 PRIOR={out / 'results.json'} bash scripts/real_suite.sh --smoke`" in report
    single = [line for line in report.splitlines() if "multi-ratio ~ single-ratio" in line]
    assert "**no data**" not in single[0] and "**no data**" in single[1], single


@pytest.mark.slow
@pytest.mark.skipif(not SQUAD_ZIP.exists(), reason="assets absent")
def test_real_suite_continues_what_a_deadline_stopped(tmp_path, small_squad):
    """A run the deadline stops while training saves its step (train.py's Ctrl-C: `timeout -s INT`); the same
    command again resumes it from there, the teacher too (nothing left to train), and evaluates it. `timeout`
    here is a stand-in that sends meanpool's run INT once it has logged a step, as the deadline would later
    (its exit 124 as `timeout`'s); the real `timeout` runs the rest (the kill test below meets its deadline)."""
    out, log = tmp_path / "real-smoke", tmp_path / "real-smoke" / "meanpool.log"
    stub = tmp_path / "bin" / "timeout"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/bash\ncase "$*" in\n  *"--out_dir {out / "meanpool"} "*) ;;\n'
                    f'  *) exec {shutil.which("timeout")} "$@" ;;\nesac\n'
                    f'shift 5; "$@" & run=$!\n'  # (-s INT -k GRACE SECONDS)
                    f'until [ -s {out / "meanpool" / "log.jsonl"} ] || ! kill -0 $run 2> /dev/null; do sleep 0.2; done\n'
                    f'kill -INT $run 2> /dev/null; wait $run; exit 124\n')
    stub.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "real"), SQUAD=str(small_squad), ONLY="meanpool", STEPS="100000",
               DEADLINE="100000", PATH=f"{stub.parent}:{os.environ['PATH']}")

    def suite(env):
        return subprocess.run(["bash", str(ROOT / "scripts" / "real_suite.sh"), "--smoke"], cwd=ROOT, env=env,
                              capture_output=True, text=True)
    p = suite(env)
    assert p.returncode == 1 and "   meanpool: stopped at the deadline" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    saved = re.search(r"^interrupted: saved step (\d+) ", log.read_text(), re.M)
    assert saved and int(saved[1]) > 0, log.read_text()[-2000:]
    step = int(saved[1])
    p = suite({**env, "STEPS": str(step + 2), "DEADLINE": ""})
    assert p.returncode == 0 and "   meanpool: train" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert f"resuming {out / 'meanpool'} from step {step}\n" in log.read_text()
    assert "nothing to train" in (out / "teacher.log").read_text()
    lines = (out / "meanpool" / "log.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, step + 3))
    assert [os.path.basename(r["run"]) for r in json.load(open(out / "results.json"))] == ["meanpool"]
    assert "(which resumed runs an earlier one began: meanpool teacher)" in (out / "RESULTS.md").read_text()
    times = (out / "times.txt").read_text()  # the teacher's from the first command, meanpool's from the second
    assert re.fullmatch(r"   teacher: train \d+ s\n   meanpool: train \d+ s, eval \d+ s\n", times), times
    before = log.read_text()  # once more: the finished run is read back, neither trained nor evaluated again
    files = {f: f.stat().st_mtime_ns for f in (out / "meanpool" / "metrics.json", out / "model" / "squad-heldout.json",
                                               out / "model" / "model.safetensors")}
    p = suite({**env, "STEPS": str(step + 2), "DEADLINE": ""})
    assert p.returncode == 0 and log.read_text() == before, p.stdout[-2000:] + p.stderr[-2000:]
    assert {f: f.stat().st_mtime_ns for f in files} == files  # (a rewritten split: its rows no longer cached)
    assert "   meanpool: finished by an earlier command" in p.stdout and (out / "times.txt").read_text() == times


def test_device_suite_sends_the_gguf_in_two_parts(tmp_path):
    """prepare splits it (each part well under a call's 64 MiB), part1 parks part 1 there, part2 joins (sha256
    checked), runs the suite and keeps a few small files for $OUT; part2 with part 1 gone stops at once. A prepare
    whose SQUAD is missing keeps the last prepare's files (they were deleted first); a part on a machine without
    nvidia-smi (part2 trained the suite on the CPU) and a LIMIT the suite cannot run in are one line."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(os.urandom(3_000_001))
    squad = tmp_path / "squad.zip"
    squad.write_bytes(b"zip")
    stub = tmp_path / "suite.sh"  # the suite's stand-in: it checks the joined file and writes a result
    stub.write_text(f'cmp "$GGUF" {gguf} && mkdir -p "$OUT" && echo "{{}}" > "$OUT/results.json" && echo "ran by $DEADLINE"\n')
    env = dict(os.environ, DIR=str(tmp_path / "dev"), STATE=str(tmp_path / "state"), GGUF=str(gguf), SQUAD=str(squad),
               WHEEL_DIR="", SUITE=f"bash {stub}", OUT=str(tmp_path / "back"))
    sh = lambda verb: subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), verb], cwd=ROOT, env=env,  # noqa: E731
                                     capture_output=True, text=True)
    assert sh("prepare").returncode == 0
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "prepare"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(env, SQUAD=str(tmp_path / "gone.zip")))
    assert p.returncode == 1 and p.stderr == f"error: SQUAD={tmp_path / 'gone.zip'}: no such file\n", p.stderr
    assert (tmp_path / "dev" / "dev-v1.1.json.zip").read_bytes() == b"zip"  # the last prepare's, kept
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "prepare"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(env, DIR=str(tmp_path)))  # a folder holding more than a prepare's files
    assert p.returncode == 1 and p.stderr.startswith(f"error: DIR={tmp_path} holds {tmp_path}/"), p.stderr
    assert gguf.exists() and squad.exists()  # (it was deleted whole)
    p = sh("part2")  # (no nvidia-smi on PATH)
    assert p.returncode == 1 and p.stderr.startswith("error: part2 runs on the GPU machine (no nvidia-smi"), p.stderr
    smi = tmp_path / "bin" / "nvidia-smi"  # the GPU machine's, for the parts below
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 143771\n")
    smi.chmod(0o755)
    env["PATH"] = f"{smi.parent}:{env['PATH']}"
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "part2"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(env, LIMIT="60"))  # (it said "DEADLINE=-31", after the join and install)
    assert p.returncode == 1 and p.stderr.startswith("error: LIMIT=60: want more than 150 s"), p.stderr
    parts = [(tmp_path / "dev" / f"gguf.part{i}").stat().st_size for i in (1, 2)]
    assert sum(parts) == 3_000_001 and max(parts) <= 1_500_001
    p = sh("part2")
    assert p.returncode != 0 and "gguf.part1 is gone" in p.stderr
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "part2"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(env, LIMIT="6OO"))
    assert p.returncode == 1 and p.stderr == "error: LIMIT=6OO: want a whole number > 0\n", p.stderr
    assert sh("part1").returncode == 0
    p = sh("part2")
    assert p.returncode == 0 and re.search(r"ran by 5[0-1]\d$", p.stdout, re.M), p.stdout + p.stderr  # 600 - 90 - s spent
    assert sorted(f.name for f in (tmp_path / "back").iterdir()) == ["results.json", "runs.log", "suite.log"]
    env["LIMIT"] = "200"  # part3: on the machine part2 left, the suite again on part2's files, in the time left
    p = sh("part3")
    assert p.returncode == 1 and "real/model is gone" in p.stderr, p.stderr
    (tmp_path / "state" / "real" / "model").mkdir(parents=True)
    (tmp_path / "state" / "real" / "model" / "model.safetensors").write_bytes(b"")
    p = sh("part3")
    assert p.returncode == 0 and re.search(r"ran by 1[0-1]\d$", p.stdout, re.M), p.stdout + p.stderr
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "part3"], cwd=ROOT, capture_output=True,
                       text=True, env=dict(env, SUITE="false", OUT=str(tmp_path / "back3")))  # a suite writing nothing
    assert p.returncode == 1 and sorted(f.name for f in (tmp_path / "back3").iterdir()) == ["runs.log", "suite.log"]
    p = subprocess.run(["bash", str(ROOT / "scripts" / "device_suite.sh"), "part3"], cwd=ROOT, capture_output=True,
                       text=True, env={k: v for k, v in env.items() if k != "LIMIT"})
    assert p.returncode == 1 and p.stderr.startswith("error: part3 needs LIMIT="), p.stderr
    del env["LIMIT"]
    (tmp_path / "dev" / "gguf.sha256").write_text("0" * 64)
    p = sh("part2")
    assert p.returncode != 0 and "sha256 differs" in p.stderr


@pytest.mark.slow
def test_gpu_bench_smoke_runs_every_step(tmp_path):
    """scripts/gpu_bench.sh part1 to part4 --smoke: every step runs to rc 0 at the tiny shapes and writes its file,
    into OUT-smoke (it replaced a GPU run's files in OUT); part4's CUDA graphs, on a CPU, stop at their flag's
    one-line error. An OUT that is a file is one line (it went on, exit 0, writing nothing)."""
    env = dict(os.environ, OUT=str(tmp_path / "gb"))
    for args in (["part5"], ["part1", "--smok"]):  # (part5 wrote device.txt; part1 ran on a GPU, --smok unread)
        p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), *args], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        assert p.returncode == 2 and p.stderr.startswith("usage:") and not list(tmp_path.iterdir()), args
    (tmp_path / "gb-smoke").write_text("a file\n")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), "part2", "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr == f"error: OUT={tmp_path / 'gb-smoke'}: not a folder this can make or " \
        "write to\n", p.stderr
    (tmp_path / "gb-smoke").unlink()
    smi = tmp_path / "bin" / "nvidia-smi"  # part1 on an 80 GB GPU: the 8B training rows at half the batch
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(0o755)
    for part in ("part1", "part2", "part3", "part4"):
        path = f"{smi.parent}:{env['PATH']}" if part == "part1" else env["PATH"]
        p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_bench.sh"), part, "--smoke"], cwd=ROOT,
                           env={**env, "PATH": path}, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        half = "train rows at --train_batch 4: this GPU has 79 GiB"
        assert (half in (tmp_path / "gb-smoke" / "device.txt").read_text()) == (part == "part1"), part
    assert not (tmp_path / "gb").exists()
    out = tmp_path / "gb-smoke"
    steps = (out / "steps.txt").read_text().splitlines()
    assert [s.split(":")[0] for s in steps] == ["gpu_tests", "train", "attention", "ttft", "twins", "gpu_graph_tests",
                                                "train_graphs"]
    assert all(": rc 0," in s for s in steps[:-1]) and ": rc 1," in steps[-1], steps
    assert "--cuda_graphs needs --compile" in (out / "train_graphs.txt").read_text()
    train_rows = (out / "train.txt").read_text()
    assert "meanpool kd per ratio" in train_rows and "tokens kd per ratio" in train_rows
    assert "sentence_gist" in (out / "attention.txt").read_text() and "speed-up" in (out / "ttft.txt").read_text()
    assert "ours / HF + peft" in (out / "twins.txt").read_text()


def test_real_suite_settings_are_one_line_before_any_work(tmp_path):
    for setting in ("STEPS=abc", "JOBS=0", "SEED=-1", "DEADLINE=-5", "GRACE=0", "TEACHER_STEPS=1.5", "EVAL_BATCH=0"):
        name, value = setting.split("=")
        env = dict(os.environ, OUT=str(tmp_path / "out"), SQUAD=str(ROOT / "README.md"), **{name: value})
        p = subprocess.run(["bash", str(ROOT / "scripts" / "real_suite.sh")], cwd=ROOT, capture_output=True,
                           text=True, env=env)
        want = f"error: {setting}: want a whole number{'' if name == 'SEED' else ' > 0'}\n"
        assert p.returncode == 1 and p.stderr == want and not (tmp_path / "out").exists(), p.stderr
    p = subprocess.run(["bash", str(ROOT / "scripts" / "real_suite.sh")], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(tmp_path / "out"), SQUAD=str(ROOT / "README.md"), STEPS="1"))
    assert p.returncode == 1 and p.stderr.startswith("error: STEPS=1: want at least 2")
    assert not (tmp_path / "out").exists()
    (tmp_path / "prior.json").write_text('{"rows": []}')  # one run's metrics.json, not an earlier part's results.json
    p = subprocess.run(["bash", str(ROOT / "scripts" / "real_suite.sh")], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, OUT=str(tmp_path / "out"), SQUAD=str(ROOT / "README.md"),
                                PRIOR=str(tmp_path / "prior.json")))
    assert p.returncode == 1 and p.stderr.startswith(f"error: {tmp_path / 'prior.json'}: not an eval.py --out JSON")
    assert p.stderr.count("\n") == 1 and not (tmp_path / "out").exists()  # (the table read it after every run)


def test_real_suite_runs_three_at_a_time_on_a_gpu_without_room_for_six(tmp_path):
    """JOBS unset: six runs at a time on an H200 (139 GiB), three on an H100 (80 GB: six hold ~107 GiB), as
    nvidia-smi reports the GPU's memory; a JOBS given wins."""
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    for mib, jobs, want in (("81559", "", "JOBS=3: this GPU has 79 GiB"), ("143771", "", ""), ("81559", "5", "")):
        smi.write_text(f"#!/bin/sh\necho {mib}\n")
        smi.chmod(0o755)
        env = dict(os.environ, OUT=str(tmp_path / "out"), SQUAD=str(ROOT / "README.md"), EVAL_BATCH="0", JOBS=jobs,
                   PATH=f"{smi.parent}:{os.environ['PATH']}")
        p = subprocess.run(["bash", str(ROOT / "scripts" / "real_suite.sh")], cwd=ROOT, capture_output=True, text=True,
                           env=env)
        assert p.returncode == 1 and p.stderr == "error: EVAL_BATCH=0: want a whole number > 0\n", p.stderr
        assert p.stdout.startswith(want) and (want or not p.stdout), (mib, jobs, p.stdout)


def test_suite_scripts_answer_help_and_refuse_unknown_arguments_before_any_work(tmp_path):
    """--help prints the script's header and its settings with their defaults, and exits 0; an argument it does not
    take is a one-line error (exit 2). Neither starts a run (they once ran the whole suite on --help)."""
    env = dict(os.environ, OUT=str(tmp_path / "out"))
    for script, first in (("real_suite.sh", "Every method on a real pretrained model"),
                          ("reproduce.sh", "Every paper's headline comparison"),
                          ("smollm2_squad.sh", "A real pretrained model on real QA"), ("seeds.sh", "One setting over")):
        p = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], cwd=tmp_path, capture_output=True,
                           text=True, env=env)
        assert p.returncode == 0 and p.stdout.startswith(first) and "#" not in p.stdout.split("\n")[0], p.stdout[:300]
        assert f"settings (NAME=value bash scripts/{script}), their defaults:\n  " in p.stdout
        assert "  OUT=${OUT:-" in p.stdout
        if script != "seeds.sh":  # seeds.sh's first argument is the seeds (their own error, above)
            p = subprocess.run(["bash", str(ROOT / "scripts" / script), "--smoke", "--bogus"], cwd=ROOT,
                               capture_output=True, text=True, env=env)
            assert p.returncode == 2 and p.stderr.startswith("error: unknown argument(s) ") and \
                p.stderr.count("\n") == 1, p.stderr
        assert not (tmp_path / "out").exists() and not (tmp_path / "out-smoke").exists()


def test_reproduce_seeds_and_smollm2_squad_settings_are_one_line_before_any_work(tmp_path):
    squad = squad_file(tmp_path / "squad.json")
    for script, setting, args, want in (
            ("smollm2_squad.sh", "ITERS=-1", [], "ITERS=-1: want a whole number > 0"),  # (it converted first)
            ("smollm2_squad.sh", "COMPRESS=yes", [], "COMPRESS=yes: want 0 or 1"),
            ("smollm2_squad.sh", "LR=fast", [], "LR=fast: want a learning rate > 0 (at most 3.4e37), like 5e-4"),
            *(("smollm2_squad.sh", f"LR={lr}", [], f"LR={lr}: want a learning rate > 0 (at most 3.4e37), like 5e-4")
              for lr in ("0", "1e39", "1e400")),  # (failed after converting)
            ("smollm2_squad.sh", "BATCH=1048577", [], "BATCH=1048577: want at most 2^20 (train.py's and eval.py's "
                                                      "limit)"),  # (each after converting)
            ("real_suite.sh", "EXAMPLES=1048577", ["--smoke"], "EXAMPLES=1048577: want at most 2^20 (train.py's and "
                                                               "eval.py's limit)"),  # (after every run had trained)
            ("reproduce.sh", "ITERS=1099511627777", [], "ITERS=1099511627777: want at most 2^40 (train.py's and "
                                                        "eval.py's limit)"),  # (one line per run started)
            ("reproduce.sh", "ITERS=abc", [], "ITERS=abc: want a whole number > 0"),
            ("reproduce.sh", "JOBS=0", [], "JOBS=0: want a whole number > 0"),
            ("reproduce.sh", "ITERS=99999999999999999999", [],  # (bash's "integer expression expected" first)
             "ITERS=99999999999999999999: want a whole number > 0 of at most 18 digits"),
            ("reproduce.sh", "INIT_FROM=/ckpt", [], "INIT_FROM needs DATA=a QA file (DATA=: no such file)"),
            ("reproduce.sh", "DATA=t.json", [], "DATA=t.json without INIT_FROM: the tiny base's suite trains on its "
                                                 "synthetic set"),  # (it trained the tiny suite)
            ("seeds.sh", "JOBS=x", ["1"], "JOBS=x: want a whole number > 0"),
            *(("seeds.sh", "JOBS=1", ["1", "--method", "pic", flag, "3", "--max_iters", "1"],
               f"{flag}: seeds.sh sets each run's --seed and --out_dir (OUT={tmp_path}/out/seedN)")
              for flag in ("--seed", "--out_dir")),  # (each was overridden in silence)
            ("seeds.sh", "SEED=1", ["1,b", "--method", "pic"], "seeds 1,b: want whole numbers of at most 18 digits, "
                                                                "like 1337,1,2"),
            ("seeds.sh", "SEED=1", ["3,99999999999999999999"], "seeds 3,99999999999999999999: want whole numbers of at "
                                                               "most 18 digits, like 1337,1,2"),  # (after 3 trained)
            ("seeds.sh", "SEED=1", ["1,01"], "seeds 1,01: 1 twice (two runs would train into one dir)"),  # (they did)
            ("seeds.sh", "SEED=1", ["1,2", "--eval_examples=0"], "--eval_examples 0: seeds.sh's table reads each "
                                                                 "run's evaluation"),  # (after every run had trained)
            ("seeds.sh", "SEED=1", ["1,2", "--eval_examples", "00"], "--eval_examples 0: seeds.sh's table reads each "
                                                                      "run's evaluation"),
            ("seeds.sh", "SEED=1", ["1", "--method=teacher"], "--method teacher: seeds.sh's table reads a compressor's "
                                                             "evaluation (eval.py)"),
            ("seeds.sh", f"OUT={tmp_path / 'squad.json'}", ["1"],
             f"OUT={tmp_path / 'squad.json'}: cannot make this folder (a file is in its way?)"),  # (mkdir's own words)
            ("reproduce.sh", "EXAMPLES=08", [], "EXAMPLES=08: want a whole number > 0 (no leading 0)"),  # (bash: octal)
            *((script, "OUT= ", args, "OUT=' ': a blank name; name a folder")  # (" -smoke" made in the repo)
              for script, args in (("reproduce.sh", ["--smoke"]), ("seeds.sh", ["1"]), ("real_suite.sh", ["--smoke"]))),
            *((script, f"RESULTS={tmp_path / 'squad.json' / 'R.md'}", args,  # (it failed after every run)
               f"RESULTS '{tmp_path / 'squad.json' / 'R.md'}': {tmp_path / 'squad.json'} is a file, not a folder")
              for script, args in (("reproduce.sh", ["--smoke"]), ("real_suite.sh", []), ("smollm2_squad.sh", []))),
            ("real_suite.sh", "ONLY=meanpool gist-4", ["--smoke"],  # (the teacher trained, then no run did)
             "ONLY=meanpool gist-4: run names separated by commas, like meanpool,ctok-bidir")):
        name, value = setting.split("=")
        env = {**os.environ, "OUT": str(tmp_path / "out"), "SQUAD": squad, name: value}  # (a clone without ../shared)
        p = subprocess.run(["bash", str(ROOT / "scripts" / script), *args], cwd=ROOT, capture_output=True,
                           text=True, env=env)
        assert p.returncode == 1 and p.stderr == f"error: {want}\n" and not (tmp_path / "out").exists(), p.stderr


@pytest.mark.skipif(not SQUAD_ZIP.exists(), reason="assets absent")
def test_real_suite_reads_a_converted_model_again_without_its_gguf(tmp_path, small_squad):
    """real_suite.sh on an OUT whose model an earlier call converted (device_suite.sh part3, the same command again)
    passes no --gguf: smollm2.py refuses a conversion into a converted dir, and part3 stopped there every time."""
    stubs, calls = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir()
    (stubs / "python").write_text(f'#!/bin/sh\ncase "$*" in\n  *smollm2.py*) echo "$*" >> {calls}; exit 3 ;;\nesac\n'
                                  f'exec {sys.executable} "$@"\n')
    (stubs / "python").chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "real"), SQUAD=str(small_squad), GGUF=str(tmp_path / "m.gguf"),
               PATH=f"{stubs}:{os.environ['PATH']}")
    for converted in (False, True):
        if converted:
            (tmp_path / "real" / "model").mkdir(parents=True)
            (tmp_path / "real" / "model" / "model.safetensors").write_bytes(b"")
        p = subprocess.run(["bash", "scripts/real_suite.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 3, p.stderr[-2000:]
        assert ("--gguf" in calls.read_text().splitlines()[-1]) == (not converted), calls.read_text()


@pytest.mark.skipif(not SQUAD_ZIP.exists(), reason="assets absent")
def test_real_suite_keeps_a_teacher_that_runs_beside_it_distilled(tmp_path, small_squad):
    """Another TEACHER_STEPS on an OUT whose runs distilled its teacher: one line, and the teacher is not trained (it
    trained on in place, and every run beside it failed on its changed --teacher). `python` stubs the conversion and
    the teacher."""
    stubs, calls = tmp_path / "bin", tmp_path / "calls"
    stubs.mkdir()
    (stubs / "python").write_text(f'#!/bin/sh\ncase "$*" in\n  *smollm2.py*) exit 0 ;;\n'
                                  f'  *"--method teacher"*) echo "$*" >> {calls}; exit 0 ;;\nesac\n'
                                  f'exec {sys.executable} "$@"\n')
    (stubs / "python").chmod(0o755)
    out = tmp_path / "real-smoke"
    for run in ("teacher", "meanpool"):
        (out / run).mkdir(parents=True)
        (out / run / "run.json").write_text("{}")
    (out / "teacher" / "log.jsonl").write_text('{"step": 1}\n')
    env = dict(os.environ, OUT=str(tmp_path / "real"), SQUAD=str(small_squad), TEACHER_STEPS="2",
               PATH=f"{stubs}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "scripts/real_suite.sh", "--smoke"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 1 and p.stderr == f"error: TEACHER_STEPS=2: the teacher in {out} trained 1 steps and runs " \
        f"there distilled it ({out / 'meanpool'}, ...): give another OUT, or TEACHER_STEPS=1\n", p.stderr
    assert not calls.exists()


@pytest.mark.skipif(not SQUAD_ZIP.exists(), reason="assets absent")
def test_real_suite_leaves_no_sampler_holding_its_pipe_when_the_teacher_fails(tmp_path, small_squad):
    """The GPU sampler (nvidia-smi -l 1) ends with the suite: left running after the teacher failed, it held the
    pipe device_suite.sh reads through `tee`, and the device call waited out its whole time limit."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    pid = tmp_path / "sampler.pid"
    (stubs / "nvidia-smi").write_text(f'#!/bin/sh\ncase "$*" in\n  *"-l 1"*) echo $$ > {pid}; i=0;'
                                      ' while [ $i -lt 90 ]; do echo "5, 100"; echo sampling >&2; sleep 1;'
                                      ' i=$((i+1)); done ;;\n  *) echo 143771 ;;\nesac\n')
    # python: the model's conversion a stand-in that makes none, the teacher one that fails
    (stubs / "python").write_text(f'#!/bin/sh\ncase "$*" in\n  *smollm2.py*) exit 0 ;;\n'
                                  f'  *"--method teacher"*) exit 5 ;;\nesac\nexec {sys.executable} "$@"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "real"), SQUAD=str(small_squad), ONLY="meanpool",
               PATH=f"{stubs}:{os.environ['PATH']}")
    p = subprocess.run(["bash", "-c", "bash scripts/real_suite.sh --smoke 2>&1 | cat"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)  # (the sampler alone would run 90 s)
    assert "error: the teacher did not finish (rc 5): " in p.stdout and "sampling" not in p.stdout, p.stdout[-2000:]
    time.sleep(0.5)
    status = f"/proc/{pid.read_text().strip()}/status"
    alive = os.path.exists(status) and "\nState:\tZ" not in open(status).read()  # (a zombie has ended)
    assert not alive, "the sampler outlived the suite"


@pytest.mark.slow
@pytest.mark.skipif(not SQUAD_ZIP.exists(), reason="assets absent")
def test_real_suite_counts_a_run_killed_after_the_deadline_as_stopped(tmp_path, small_squad):
    """A run still going GRACE s after the deadline's signal is killed (`timeout -k`, 137): stopped, as one that
    saved its step, not failed (the same command again continues it from its last checkpoint). `python` is a
    stand-in: the model and the teacher take no time (the deadline counts from the model's conversion), and
    meanpool ignores the signal."""
    stub = tmp_path / "bin" / "python"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/bash\ncase "$*" in\n  *smollm2.py*|*"--method teacher"*) exit 0 ;;\n'
                    f'  *"/meanpool "*) touch {tmp_path / "began"}; trap "" INT; sleep 100 ;;\nesac\n'
                    f'exec {sys.executable} "$@"\n')
    stub.chmod(0o755)
    env = dict(os.environ, OUT=str(tmp_path / "real"), SQUAD=str(small_squad), ONLY="meanpool", DEADLINE="3",
               GRACE="1", PATH=f"{stub.parent}:{os.environ['PATH']}")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "real_suite.sh"), "--smoke"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert "   meanpool: stopped at the deadline" in p.stdout and "failed" not in p.stderr, p.stdout + p.stderr
    assert (tmp_path / "began").exists()  # (killed: not a run the deadline had passed before it started)
