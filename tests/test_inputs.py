"""Every input a run names is checked before work (issue 76): a broken file or flag gets one line
naming the file (and line or key) or the flag, exit != 0, no traceback, and nothing already written
is lost; --resume continues the log where its checkpoint was taken."""
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import eval as evaluate
import model
import tiny
import train
from common import ROOT, hf_checkpoint, load_script, run, squad_file
from model import Memory

FAST = ["--max_iters", 1, "--batch_size", 2, "--eval_examples", 0, "--quiet", "--device", "cpu", "--lora_r", 4]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    ckpt = Path(hf_checkpoint(root / "hf"))
    squad_file(root / "squad.json")

    def broken(name, edit):
        d = root / name
        shutil.copytree(ckpt, d)
        edit(d)

    def config_file(d, name, change):
        c = json.loads((d / name).read_text())
        change(c)
        (d / name).write_text(json.dumps(c))

    def config(d, change):
        config_file(d, "config.json", change)
    broken("config-json", lambda d: (d / "config.json").write_text('{"model_type": "llama",'))
    broken("config-key", lambda d: config(d, lambda c: c.pop("hidden_size")))
    broken("config-type", lambda d: config(d, lambda c: c.update(num_hidden_layers="two")))
    broken("config-eps", lambda d: config(d, lambda c: c.update(rms_norm_eps=-1e-6)))
    broken("config-eos", lambda d: config(d, lambda c: c.update(eos_token_id=[1, "x"])))
    broken("chat-template", lambda d: config_file(d, "tokenizer_config.json", lambda c: c.update(chat_template=5)))
    broken("index", lambda d: ((d / "model.safetensors").unlink(),
                               (d / "model.safetensors.index.json").write_text('{"weight_map": 5}')))
    broken("weights-cut", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:999]))
    broken("tokenizer", lambda d: (d / "tokenizer.json").write_text("{oops"))
    broken("config-list", lambda d: (d / "generation_config.json").write_text("[]"))

    def shards(d, outside=False):  # model.safetensors as two shards, the second with a zeroed copy of the first tensor
        state = load_file(d / "model.safetensors")
        (d / "model.safetensors").unlink()
        (*keys, last), first = state, next(iter(state))
        save_file({k: state[k] for k in keys}, d / "a.safetensors")
        save_file({last: state[last], first: state[first] * 0}, d / "b.safetensors")
        where = {**{k: "../a.safetensors" if outside else "a.safetensors" for k in keys}, last: "b.safetensors"}
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": where}))
    broken("shard-twice", shards)
    broken("shard-outside", lambda d: shards(d, outside=True))
    broken("eos-past", lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [1, 9999]}'))
    broken("eos-list", lambda d: config_file(d, "tokenizer_config.json", lambda c: c.update(eos_token=["</s>"])))
    (root / "edited").mkdir()
    (root / "edited" / "run.json").write_text('{"train": {"method": "meanpool"}, "method": {"lora_r": "abc"}}')
    (root / "bad.json").write_text('{"data": [')
    (root / "bad.jsonl").write_text('{"context": "a b", "question": "q", "answers": ["b"]}\n{oops\n')
    (root / "latin1.json").write_bytes(b"\xff\xfe garbage")
    (root / "surrogate.jsonl").write_text('{"context": "a \\ud800 b", "question": "q?", "answers": ["a"]}\n')
    (root / "surrogate_text.jsonl").write_text('{"text": "a b."}\n{"text": "a \\udfff b"}\n')
    (root / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"context": "a b", "question": "q", "answers": ["a"]}\n')[:30])
    (root / "texts.jsonl").write_text('{"text": "A b."}\n')
    (root / "dangling").symlink_to(root / "nothing")
    (root / "teacher" / "teacher").mkdir(parents=True)
    (root / "teacher" / "teacher" / "adapter_config.json").write_text("{}")
    return root


CASES = [  # (what is broken, flags, what the one line says)
    ("config.json", ["--init_from", "config-json"], "config-json/config.json:1: invalid JSON"),
    ("config key", ["--init_from", "config-key"], "config-key/config.json: missing key 'hidden_size'"),
    ("config type", ["--init_from", "config-type"], "key 'num_hidden_layers' is 'two', expected int"),
    ("config range", ["--init_from", "config-eps"], "key 'rms_norm_eps' is -1e-06, expected > 0"),  # was a NaN loss
    ("config eos", ["--init_from", "config-eos"], "config.json: key 'eos_token_id' is [1, 'x'], expected a token id"),
    ("chat template", ["--init_from", "chat-template"], "tokenizer_config.json: key 'chat_template' is 5"),  # was a
    # a copy in the second shard won; a shard outside the dir was read
    ("shard twice", ["--init_from", "shard-twice"], "is in b.safetensors, its weight_map names a.safetensors"),
    ("shard outside", ["--init_from", "shard-outside"], "shard file ../a.safetensors is not in the checkpoint's dir"),
    ("shard index", ["--init_from", "index"], "model.safetensors.index.json: key 'weight_map' should map"),  # traceback
    ("weights", ["--init_from", "weights-cut"], "weights-cut/model.safetensors: not a readable safetensors file"),
    ("tokenizer", ["--init_from", "tokenizer"], "tokenizer/tokenizer.json:1: invalid JSON"),
    ("config list", ["--init_from", "config-list"], "generation_config.json: a JSON list, expected an object"),  # (a
    ("token id", ["--init_from", "eos-past"], "token id 9999 (of its tokenizer, or a bos / eos / pad id of its "
                                              "config files) is past config.json's vocab_size"),  # (an IndexError)
    ("token list", ["--init_from", "eos-list"], "key 'eos_token' is ['</s>'], expected a token text"),  # traceback)
    ("run.json", ["--init_from", "edited"], "--init_from %s/edited: %s/edited/run.json: method.lora_r is 'abc', "
                                            "expected int"),  # (a KeyError or a TypeError, for each flag below)
    ("run.json teacher", ["--teacher", "edited"], "--teacher %s/edited: "),
    ("run.json out_dir", ["--out_dir", "edited"], "--out_dir %s/edited: "),
    ("data", ["--data", "bad.json"], "bad.json:1: invalid JSON"),
    ("data line", ["--data", "bad.jsonl"], "bad.jsonl:2: invalid JSON"),
    ("data bytes", ["--data", "latin1.json"], "latin1.json: not UTF-8 text"),
    ("data missing", ["--data", "nothere.json"], "--data"),
    ("data folder", ["--data", "teacher"], "teacher': a folder, not a file"),
    ("data texts", ["--data", "texts.jsonl"], "texts.jsonl: JSONL of {\"text\"} lines, read by the text stages"),
    ("data cut", ["--data", "cut.jsonl.gz"], "cut.jsonl.gz: a cut or corrupt compressed file"),  # was a traceback
    ("text cut", ["--method=sac", "--pretrain", 1, "--pretrain_data", "cut.jsonl.gz"], "cut.jsonl.gz: a cut or corrupt"),
    ("eval_data", ["--eval_data", "bad.json"], "bad.json:1: invalid JSON"),
    ("eval_data text", ["--method=sac", "--objective", "lm", "--pretrain_data", "texts.jsonl", "--eval_data",
                        "texts.jsonl", "--eval_examples", 2],  # (validation read it; the final evaluation failed)
     "--eval_data %s/texts.jsonl is text: the final evaluation asks questions"),
    ("teacher", ["--teacher", "teacher"], "teacher/adapter_config.json: missing key 'r'"),
    ("encoder", ["--method", "pic", "--encoder", "config-json"], "config-json/config.json:1: invalid JSON"),
    ("ratio", ["--ratio", "4,99999999999999999999"], "every ratio must be a positive integer, at most 2^20"),
    ("lr", ["--lr", "nan"], "--lr nan must be a finite number"),
    ("lr negative", ["--lr", "-1e-3"], "--lr -0.001 must be a finite number"),  # (argparse: "expected one argument")
    ("lr huge", ["--lr", "1e39"], "--lr 1e+39: above 3.4e37"),  # (a traceback after the first step)
    ("lr tiny", ["--lr", "1e-400"], "argument --lr: '1e-400' is too small for a float"),  # (0: the recipe's lr)
    ("max_iters huge", ["--max_iters", 10**23], "--max_iters 100000000000000000000000: at most 2^40"),
    ("max_iters 400 digits", ["--max_iters", 10**400], "0: at most 2^40"),  # (isfinite's OverflowError)
    ("eval_examples", ["--eval_examples", 10**8], "--eval_examples 100000000 must lie in 0..2^20"),  # (it trained
    # first, then built 10^8 questions)
    ("ratio list", ["--ratio", "4,,8"], "--ratio '4,,8' must be a positive integer"),
    ("ratio digits", ["--ratio", "4_0"], "--ratio '4_0' must be a positive integer"),  # (int() reads 40)
    ("ratio sign", ["--ratio", "-1"], "--ratio '-1' must be a positive integer"),  # (-1 is an integer)
    ("ratio context", ["--eval_ratio", "4,128", "--max_context", 64], "--eval_ratio '4,128': above --max_context 64"),
    ("method value", ["--method"], "argument --method: expected one argument"),
    ("global batch", ["--batch_size", 3, "--grad_accum", 2], "--batch_size 3 (the global batch)"),
    ("cuda graphs", ["--cuda_graphs", "--compile"], "--cuda_graphs replays --compile's layers"),  # FAST: --device cpu
    ("cuda graphs accum", ["--cuda_graphs", "--compile", "--batch_size", 4, "--grad_accum", 2],
     "--cuda_graphs with 2 micro-batches a step"),
    ("device", ["--device", "tpu"], "--device 'tpu' is not a device"),
    ("seed", ["--seed", 1 << 64], "--seed 18446744073709551616 must lie in -2^63..2^63-1"),
    ("out_dir", ["--out_dir", "bad.json"], "bad.json is a file, not a folder"),
    ("out_dir below", ["--out_dir", "bad.json/run"], "bad.json is a file, not a folder"),
    ("out_dir link", ["--out_dir", "dangling/run"], "dangling is a link to %s/nothing, which does not exist"),
    ("out_dir read", ["--out_dir", "hf"], "the run would write into the --init_from it reads"),  # (it wrote there)
    ("warmup_frac", ["--warmup_frac", 2], "--warmup_frac 2.0 is a fraction"),
    # three flags that were ignored: the frac; the teacher's evaluation; the --pretrain 0 (ae+lm ran)
    ("warmup twice", ["--warmup_iters", 1, "--warmup_frac", 0.5], "--warmup_iters and --warmup_frac both set"),
    ("teacher eval", ["--method=teacher", "--eval_examples", 5], "--eval_examples: a --method teacher run is not"),
    ("pretrain objective", ["--method=pic", "--pretrain", 0, "--objective", "ae+lm"],
     "--pretrain 0 drops the ae+lm stage that --objective ae+lm runs"),
    ("pretrain_data", ["--pretrain_data", "bad.jsonl"], "--pretrain_data is read by a text stage"),
    ("device absent", ["--device", "cuda:99"], "--device 'cuda:99': use cpu or cuda[:N]; this machine has"),
    ("max_iters", ["--max_iters", -3], "--max_iters -3 must be a finite number >= 0 (0: the recipe's)"),
    ("grad_accum", ["--grad_accum", 0], "--grad_accum 0 must be a positive integer"),
    ("lora_r", ["--lora_r", 0], "--lora_r 0 must be >= 1 (the adapters' rank)"),
    ("lora_alpha", ["--lora_alpha", 0], "--lora_alpha 0 must lie in (0, 65536]"),
    ("lora_alpha huge", ["--lora_alpha", 10 ** 41], f"--lora_alpha {10 ** 41} must lie in (0, 65536]"),  # (a nan loss)
    ("weight_decay", ["--weight_decay", 1e10], "--weight_decay 10000000000.0 at --lr"),  # (a nan loss at step 2)
    ("prompt", ["--prompt", "gemma"], "--prompt gemma: the tokenizer of"),  # was an error at the first batch
    ("teacher ratio", ["--method=teacher", "--ratio", 4], "--ratio does not apply to --method teacher"),
    ("nothing trains", ["--fixed_encoder", "--fixed_decoder", "--no_linear"], "(kd) with these flags trains no"),
    ("teacher decoder", ["--method=pic", "--decoder", "hf", "--teacher", "hf"],  # (it reached the encoder alone,
     "--teacher with --decoder: the teacher's adapter merges into"),  # and eval served another run's teacher row)
    ("batch size", ["--batch_size", 10**20], "at most 2^20 examples a step"),  # (it filled the host's memory)
    ("lora rank", ["--lora_r", 10**11], "--lora_r 100000000000: at most 65536"),  # (a traceback)
    ("data surrogate", ["--data", "surrogate.jsonl"],  # (a tokenizer's traceback after the run had started)
     "surrogate.jsonl:1: field 'context': '\\ud800' at character 2 is a lone UTF-16 surrogate"),
    ("data pipe", ["--data", "/dev/null"], "--data '/dev/null': not a regular file"),  # (was "no such file")
    ("text surrogate", ["--method=sac", "--pretrain", 1, "--pretrain_data", "surrogate_text.jsonl"],
     "surrogate_text.jsonl:2: field 'text': '\\udfff' at character 2 is a lone UTF-16 surrogate"),
]


def in_process(argv, main=train.main):
    """train.py's (or eval.py's) one line for argv, as its __main__ prints it (a reader's ValueError or OSError too)."""
    try:
        main([str(a) for a in argv])
    except SystemExit as e:
        return str(e)
    except (ValueError, OSError) as e:
        return f"error: {e}"
    return ""


@pytest.mark.parametrize("what, flags, message", CASES, ids=[c[0] for c in CASES])
def test_a_broken_input_is_one_line_before_any_work(files, tmp_path, what, flags, message):
    flags = [str(files / f) if os.path.lexists(files / str(f).split("/")[0]) or str(f).endswith(".json") else f
             for f in flags]
    argv = ["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST,
            "--out_dir", tmp_path / "out", *flags]
    line = in_process(argv)
    message = message.replace("%s", str(files)) if "%s" in message else message
    assert line.startswith("error: ") and "\n" not in line and message in line, line
    assert not (tmp_path / "out").exists()  # nothing written
    if what in ("config type", "weights", "data bytes"):  # the script itself: one line on stderr, no traceback
        p = run(argv, check=False)
        assert p.returncode != 0 and p.stderr.strip() == line, p.stderr[-2000:]


LIMITED = """import re, resource, runpy, sys, torch
mapped = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read())[1]) << 10  # torch imported
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30),) * 2)  # 1 GiB of address space more
sys.argv = sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")"""


def test_out_of_memory_is_one_line(tmp_path):
    """The host's allocator refusing a run too large for it: one line that says so, not a traceback."""
    argv = ["--method", "meanpool", "--lora_r", 30000, "--max_context", 64, *FAST[:-2], "--out_dir", tmp_path / "out"]
    p = subprocess.run([sys.executable, "-c", LIMITED, "train.py", *map(str, argv)], cwd=ROOT, capture_output=True,
                       text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # (--lora_r 30000: ~5 GB to train)
    assert p.returncode == 1 and p.stderr.startswith("error: out of memory (") and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_python_memory_error_and_a_piped_checkpoint_are_one_line(tmp_path):
    """Python's own MemoryError (a batch of 10^6 examples built on the host) was a traceback; a model.safetensors
    that is a pipe made train.py wait forever."""
    with pytest.raises(SystemExit, match=r"^error: out of memory \(the host's\): lower --batch_size$"):
        with train.one_line_errors("lower --batch_size"):
            raise MemoryError
    os.mkfifo(tmp_path / "model.safetensors")
    for read in (model.read_tensors, model.tensor_names):
        with pytest.raises(ValueError, match="model.safetensors: not a regular file"):
            read(str(tmp_path / "model.safetensors"))


def test_a_tiny_stage_the_method_lacks_is_one_line(tmp_path):
    assert in_process(["--method", "sentence_gist", "--stage", -1, *FAST[:-2], "--out_dir", tmp_path / "out"]) == (
        "error: --stage -1: choose 1 (gist rows), 2 (+ the base) or 3 (cool-down)")  # (a StopIteration traceback)


def test_eval_data_is_read_before_any_work_and_validates_synthetic_training(files, tmp_path, capsys):
    """--eval_data without --data (the tiny base's synthetic training): a broken file is one line before any step,
    and a good one is what validation reads (it was read only by the final evaluation, after training)."""
    out = tmp_path / "out"
    line = in_process(["--method", "meanpool", *FAST, "--out_dir", out, "--eval_data", files / "bad.json"])
    assert line.startswith("error: ") and "bad.json:1: invalid JSON" in line, line
    assert not out.exists()
    assert in_process(["--method", "meanpool", *FAST, "--out_dir", out, "--eval_interval", 1,
                       "--eval_data", files / "squad.json"]) == ""
    assert f"validation: {files / 'squad.json'}" in capsys.readouterr().out
    synthetic = tmp_path / "synthetic"
    in_process(["--method", "meanpool", *FAST, "--out_dir", synthetic, "--eval_interval", 1])
    val = [json.loads(line)["val_loss"] for run in (out, synthetic) for line in open(run / "log.jsonl")]
    assert len(val) == 2 and val[0] != val[1], val  # the same step and weights, other validation items


def test_resume_keeps_the_runs_method_and_its_config(files, tmp_path):
    """--resume continues a run under the method config that shaped its tensors: another method or a flag with
    another value is one line, a flag left out is inherited; tensors of another shape are one line too."""
    out = tmp_path / "run"
    common = ["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST, "--out_dir", out]
    assert in_process(common) == ""
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    for flags, message in ((["--max_iters", 2, "--resume", "--lora_r", 8], "--lora_r 8 conflicts with the run --resume "
                                                                          f"continues, {out} (lora_r=4)"),
                           (["--max_iters", 2, "--resume", "--method", "pic"], f"--resume: {out} is not a --method pic")):
        line = in_process(common + flags)
        assert line.startswith("error: ") and message in line, line
    state = json.loads(before["run.json"])
    (out / "run.json").write_text(json.dumps(dict(state, method=dict(state["method"], lora_r=8),
                                                  command=dict(state["command"], lora_r=8))))  # (the command's too)
    line = in_process([a for a in common if a not in ("--lora_r", 4)] + ["--max_iters", 2, "--resume"])
    assert line.startswith("error: ") and "do not match this method's parameters (names or shapes)" in line, line
    (out / "run.json").write_text(json.dumps(dict(state, method=dict(state["method"], lora_r=-4))))
    with pytest.raises(SystemExit, match=f"error: {out}/run.json: --lora_r -4 must be >= 1"):
        train.run_config(str(out))  # what eval.py and hf_generate.py read (a traceback in add_adapter)
    (out / "run.json").write_bytes(before["run.json"])
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert in_process([a for a in common if a not in ("--lora_r", 4)] + ["--max_iters", 2, "--resume"]) == ""
    assert json.loads((out / "run.json").read_text())["method"]["lora_r"] == 4


def test_resume_keeps_the_runs_data_and_schedule(files, tmp_path):
    """--resume alone trained the steps after the checkpoint on the synthetic set (no --data given) at the recipe's
    batch, seed and steps: it takes the run's data, batch, seed and schedule; another data file, batch or seed given
    is one line; --max_iters given goes on to that step."""
    out = tmp_path / "run"
    flags = ["--method", "meanpool", "--init_from", files / "hf", "--out_dir", out, "--quiet", "--device", "cpu"]
    first = ["--data", files / "squad.json", "--batch_size", 3, "--seed", 5, "--lr", 3e-4, "--max_iters", 2,
             "--eval_examples", 0, "--lora_r", 4]
    assert in_process(flags + first) == ""
    state = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps(dict(state, step=1)))  # as if stopped after step 1
    assert in_process(flags + ["--resume"]) == ""
    train_cfg = json.loads((out / "run.json").read_text())["train"]
    assert {k: train_cfg[k] for k in ("data", "batch_size", "seed", "lr", "max_iters", "eval_examples")} == {
        "data": str(files / "squad.json"), "batch_size": 3, "seed": 5, "lr": 3e-4, "max_iters": 2, "eval_examples": 0}
    for given, message in ((["--data", files / "bad.json"], "--data"), (["--batch_size", 4], "--batch_size 4"),
                           (["--seed", 6], "--seed 6")):
        line = in_process(flags + ["--resume", "--max_iters", 3, *given])
        assert line.startswith(f"error: {message}") and "conflicts with the run --resume continues" in line, line
    assert in_process(flags + ["--resume", "--max_iters", 3]) == ""
    assert json.loads((out / "run.json").read_text())["step"] == 3
    assert in_process(flags + ["--resume", "--max_iters", 4, "--weight_decay", 0.1]) == ""  # a value it may change
    state = json.loads((out / "run.json").read_text())  # (the optimizer applies it: not the checkpoint's 0.0)
    assert [g["weight_decay"] for g in state["param_groups"]] == [0.1, 0.0] == [state["train"]["weight_decay"], 0.0]
    line = in_process(flags + ["--resume", "--max_iters", 2])
    assert line == f"error: --max_iters 2: the run --resume continues, {out}, is at step 4 already", line


def test_a_folder_that_is_no_run_keeps_its_files_and_a_failed_base_leaves_no_trained_one_behind(base_dir, tmp_path):
    """A folder with a metrics.json, or a log.jsonl that is not a run's, and no run.json is not a run's: its files were
    replaced (one line now); a log of a run stopped before its first checkpoint is a run's. A new
    --method base run in a trained base's dir replaces the model first: run.json goes with it, so a run that fails
    leaves no run.json claiming the old training over random weights."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.json").write_text('{"my": 1}')
    line = in_process(["--method", "meanpool", *FAST, "--out_dir", mine])
    assert line == f"error: --out_dir '{mine}' holds a metrics.json and no run.json: not a train.py run dir (a run " \
                   "replaces its files); give this run another dir", line
    assert os.listdir(mine) == ["metrics.json"]
    (mine / "metrics.json").unlink()
    (mine / "log.jsonl").write_text('{"my": 1}\n')  # a log no train.py run wrote: kept too
    line = in_process(["--method", "meanpool", *FAST, "--out_dir", mine])
    assert line == f"error: --out_dir '{mine}' holds a log.jsonl and no run.json: not a train.py run dir (a run " \
                   "replaces its files); give this run another dir", line
    assert (mine / "log.jsonl").read_text() == '{"my": 1}\n'
    (mine / "log.jsonl").write_text('{"step": 1, "loss": 9.0, "lr": 0.1}\n')  # a run stopped before its checkpoint
    assert in_process(["--method", "meanpool", *FAST, "--out_dir", mine]) == ""
    assert json.loads((mine / "log.jsonl").read_text())["loss"] != 9.0
    old = tmp_path / "old_base"
    shutil.copytree(base_dir, old)
    kept = {f.name: f.read_bytes() for f in old.iterdir()}
    for flag in ("--d_model", "--n_layers"):  # (10^8 and 10^5 ran out of memory after a trained base's run.json went)
        line = in_process(["--method", "base", "--out_dir", old, flag, 10 ** 8 if flag == "--d_model" else 10 ** 5,
                           *FAST[:6]])
        assert line.startswith("error: --d_model ") and "at most 2^26" in line, line
        assert {f.name: f.read_bytes() for f in old.iterdir()} == kept
    line = in_process(["--method", "base", "--out_dir", old, "--attn_weight", 1e38, *FAST[:6]])
    assert line.startswith("error: step 1: the training loss is inf"), line
    assert not (old / "run.json").exists()


def test_resume_with_a_stage_the_run_never_had_or_has_lost_is_one_line(tmp_path):
    """--resume --pretrain 1 on a run trained with --pretrain 0 said the run "began from" a pretrain dir it never had;
    a run whose first stage's dir has gone since says that."""
    out, two = tmp_path / "one", tmp_path / "two"
    assert in_process(["--method", "sac", *FAST, "--out_dir", out, "--pretrain", 0]) == ""
    line = in_process(["--method", "sac", "--out_dir", out, "--resume", "--pretrain", 1, "--max_iters", 3])
    assert line == f"error: --resume: {out} was trained with no pretrain stage before it, which this command adds: " \
                   "leave --pretrain out", line
    assert in_process(["--method", "sac", *FAST, "--out_dir", two, "--pretrain", 1]) == ""
    shutil.rmtree(two / "pretrain")
    line = in_process(["--method", "sac", "--out_dir", two, "--resume", "--max_iters", 3])
    assert line == f"error: --resume: {two} began from {two / 'pretrain'}, which holds no checkpoint now", line


def test_resume_after_a_stopped_first_stage_trains_the_rest_of_that_command(files, tmp_path, monkeypatch):
    """A run stopped in its first stage, in a dir holding an earlier finished run: --resume finished the first stage,
    then found the earlier run's last stage "at its step already" and kept its weights; and a last stage not begun
    took the recipe's steps and evaluation, not the command's. run.json keeps the command; --resume reruns it."""
    out = tmp_path / "run"
    flags = ["--method", "ata", "--init_from", files / "hf", "--data", files / "squad.json", "--out_dir", out,
             "--quiet", "--device", "cpu", "--batch_size", 2, "--lora_r", 4, "--max_context", 256]  # (its prompt fits)
    assert in_process(flags + ["--pretrain", 1, "--max_iters", 1, "--eval_examples", 0]) == ""  # run A: both stages
    step = train.train_step
    monkeypatch.setattr(train, "train_step", lambda *a: train.STOP.append(1) or step(*a))  # Ctrl-C in a step
    assert in_process(flags + ["--pretrain", 2, "--max_iters", 3, "--seed", 5, "--eval_examples", 0]) == ""  # run B
    assert json.loads((out / "pretrain" / "run.json").read_text())["step"] == 1
    assert not (out / "run.json").exists()  # A's last stage, trained from A's first: no longer a commit point
    monkeypatch.undo()
    assert in_process(["--method", "ata", "--out_dir", out, "--resume"]) == ""
    first, last = (json.loads((d / "run.json").read_text()) for d in (out / "pretrain", out))
    assert (first["step"], last["step"]) == (2, 3)  # B's steps (the recipe's: 17,500)
    assert last["train"]["seed"] == 5 and last["train"]["eval_examples"] == 0 and last["train"]["batch_size"] == 2
    assert last["command"]["max_iters"] == 3 and last["command"]["pretrain"] == 2
    assert in_process(["--method", "ata", "--out_dir", out, "--resume", "--max_iters", 4]) == ""  # goes on to 4
    assert json.loads((out / "run.json").read_text())["step"] == 4
    first = (out / "pretrain" / "run.json").read_bytes()  # the last stage has begun: the first stands as it is (a
    assert in_process(["--method", "ata", "--out_dir", out, "--resume", "--pretrain", 3, "--max_iters", 5]) == ""
    assert (out / "pretrain" / "run.json").read_bytes() == first  # 3 retrained it under the last one's weights)
    line = in_process(["--method", "ata", "--out_dir", out, "--resume", "--max_iters", 6, "--init_from", files])
    assert line.startswith(f"error: --init_from '{files}' conflicts with the run --resume continues"), line  # (kept)
    line = in_process(["--method", "ata", "--out_dir", out, "--resume", "--objective", "qa", "--max_iters", 6])
    assert line == f"error: --resume: {out} was trained after its pretrain stage, which this command leaves out " \
                   f"(--pretrain 0, --objective or --stage): drop that flag, or give --init_from {out / 'pretrain'}"
    assert in_process(["--method", "ata", "--out_dir", out, "--resume", "--objective", "qa", "--init_from",
                       out / "pretrain", "--max_iters", 6]) == ""  # its last stage alone (the command's --pretrain
    assert json.loads((out / "run.json").read_text())["step"] == 6  # 2 gives way to --objective)
    nested = tmp_path / "nested"  # a run of its own inside a dir is not the dir's run (a stopped first stage's)
    (nested / "aaa").mkdir(parents=True)
    (nested / "aaa" / "run.json").write_text(json.dumps({"command": {"lr": 0.01}, "last_stage": True}))
    assert train.started_command(["--resume", "--out_dir", str(nested)]) == ([], "")


def test_resume_from_another_folder_with_relative_paths_and_the_other_flag_of_a_pair(files, tmp_path, monkeypatch):
    """A run started with relative paths resumes from another folder (they are absolute in run.json: a relative
    --decoder conflicted with its absolute self); --micro_batch given on --resume replaces the run's --grad_accum
    (both counted as given: "give one of them"); the newest stage's command is the one rerun."""
    here = tmp_path / "here"  # the folder the run starts in, with its files
    shutil.copytree(files / "hf", here / "hf")
    shutil.copy(files / "squad.json", here)
    monkeypatch.chdir(here)
    flags = ["--method", "pic", "--init_from", "hf", "--decoder", "hf", "--data", "squad.json", "--out_dir", "run",
             "--quiet", "--device", "cpu", "--batch_size", 2, "--lora_r", 4, "--max_context", 64, "--eval_examples", 0]
    assert in_process(flags + ["--pretrain", 1, "--max_iters", 1, "--grad_accum", 2]) == ""
    state = json.loads((here / "run" / "run.json").read_text())
    assert state["train"]["data"] == str(here / "squad.json") and state["method"]["decoder"] == str(here / "hf")
    monkeypatch.chdir(tmp_path)
    assert in_process(["--method", "pic", "--out_dir", here / "run", "--resume", "--max_iters", 2,
                       "--micro_batch", 1]) == ""
    assert json.loads((here / "run" / "run.json").read_text())["step"] == 2
    (here / "run" / "run.json").unlink()  # as if the last stage had not begun: the first stage's command
    assert train.started_command(["--resume", "--out_dir", str(here / "run")])[1].endswith("pretrain/run.json")
    line = in_process(["--method", "ata", "--init_from", files / "hf", "--data", tmp_path / "nope.json",
                       "--hotpot_distractors"])  # (a missing file: "no ... file is HotpotQA")
    assert line.startswith("error: --data") and "nope.json" in line and "HotpotQA" not in line, line


def test_a_second_run_into_a_dir_in_use_is_one_line(files, tmp_path, monkeypatch, capsys):
    """Two runs started into one --out_dir both trained, their lines mixed in one log.jsonl and either one's files
    the last written: the second is one line now, the first's dir untouched."""
    out = tmp_path / "run"
    with train.locked([str(out)]):  # (a flock: another open of the dir, in this process too, cannot take it)
        (out / "mine").write_text("kept")
        line = in_process(["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST,
                           "--out_dir", out])
    assert line == f"error: {out}: another train.py run is writing into it; wait for it, or name another --out_dir"
    assert [f.name for f in out.iterdir()] == ["mine"]
    with train.locked([str(out / "pretrain")]):  # a stage dir of a run: one ata into out would write there too
        line = in_process(["--method", "ata", "--init_from", files / "hf", "--data", files / "squad.json", *FAST,
                           "--pretrain", 1, "--out_dir", out])
    assert line.startswith(f"error: {out / 'pretrain'}: another train.py run is writing into it"), line
    with train.locked([str(tmp_path / "a" / "b" / "c"), str(tmp_path / "a" / "b")]):  # nothing written: the
        pass  # folders it made go
    def no_locks(fd, operation):  # NFS, Lustre without -o flock: every run stopped at the lock
        raise OSError(37, "No locks available")
    monkeypatch.setattr(train.fcntl, "flock", no_locks)
    with train.locked([str(out)]):
        assert "no lock on this filesystem (No locks available): run one train.py at a time" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    if os.path.isdir("/proc"):  # writable by its mode as root, yet no file can be made there (an OSError later)
        with pytest.raises(SystemExit, match="error: --out_dir '/proc/x': /proc is not writable"):
            train.check_writable("/proc/x", "--out_dir")


def test_a_teacher_run_is_read_as_teacher_and_of_its_own_base_only(files, tmp_path):
    """A teacher run dir given as --init_from, or as --teacher of another base (its adapter merged into the shipped
    tiny base in silence where the shapes matched); a teacher whose base is gone (moved) meets the shape check (the
    shipped tiny base's MLP is 384 wide; the teacher's base's, 128): one line each, nothing written."""
    teacher, moved = tmp_path / "teacher", tmp_path / "moved"
    shutil.copytree(files / "hf", tmp_path / "hf")
    for run, base in ((teacher, files / "hf"), (moved, tmp_path / "hf")):
        assert in_process(["--method", "teacher", "--init_from", base, "--data", files / "squad.json", *FAST,
                           "--out_dir", run]) == ""
    shutil.rmtree(tmp_path / "hf")
    ours = os.path.realpath(tiny.BASE_DIR)
    for flags, message in ((["--init_from", teacher], f"--init_from '{teacher}' is a --method teacher run: pass it as "
                                                      "--teacher"),
                           (["--teacher", teacher], f"--teacher {teacher} was trained on the base "
                                                    f"{os.path.realpath(files / 'hf')}; this run's is {ours}"),
                           (["--teacher", moved], "down_proj.lora_A.weight is (4, 128), this model's (4, 384): an "
                                                  "adapter of another base")):
        line = in_process(["--method", "meanpool", *FAST, "--out_dir", tmp_path / "out", *flags])
        assert line.startswith("error: ") and message in line, line
    assert not (tmp_path / "out").exists()


def test_a_teacher_trained_again_since_its_compressor_distilled_it_is_one_line(files, tmp_path):
    """A compressor's run keeps a hash of the --teacher adapter it distilled; its teacher dir trained again (the
    compressor's rows were read on the new merged base, in silence) is one line naming the run, before any work."""
    teacher, run_dir = tmp_path / "teacher", tmp_path / "mp"
    common = ["--init_from", files / "hf", "--data", files / "squad.json", *FAST]
    assert in_process(["--method", "teacher", *common, "--out_dir", teacher]) == ""
    assert in_process(["--method", "meanpool", *common, "--teacher", teacher, "--out_dir", run_dir]) == ""
    assert json.loads((run_dir / "run.json").read_text())["teacher_stamp"] == train.teacher_stamp(str(teacher))
    assert in_process(["--method", "teacher", *common, "--seed", 2, "--out_dir", teacher]) == ""
    line = in_process([run_dir, "--n", 2], evaluate.main)
    assert line.startswith(f"error: {run_dir}: its --teacher {teacher} was trained again since"), line
    assert not (run_dir / "metrics.json").exists()


def test_resume_refuses_data_files_that_hold_other_records_now(files, tmp_path):
    """run.json keeps a hash of the records a stage read; --resume after its --data file was rewritten in place (the
    same path: it went on, in silence, on other records) is one line, nothing written; the same records go on."""
    qa, out = tmp_path / "qa.json", tmp_path / "run"
    shutil.copy(files / "squad.json", qa)
    argv = ["--method", "meanpool", "--init_from", files / "hf", "--data", qa, *FAST, "--out_dir", out]
    assert in_process(argv) == "" and json.loads((out / "run.json").read_text())["data_hash"]
    assert in_process([*argv, "--resume", "--max_iters", 2]) == ""  # the same records: it goes on
    doc = json.loads(qa.read_text())
    doc["data"][0]["paragraphs"].pop()
    qa.write_text(json.dumps(doc))
    before = {f: (out / f).read_bytes() for f in os.listdir(out)}
    line = in_process([*argv, "--resume", "--max_iters", 3])
    assert line.startswith(f"error: --resume: {out} trained on other records than its data files hold now"), line
    assert {f: (out / f).read_bytes() for f in os.listdir(out)} == before


def test_resume_of_a_tiny_base_run_takes_the_shipped_base_named(tmp_path):
    """--init_from tiny_base/ is what a run without the flag read: --resume accepts it (was: conflicts with '')."""
    out = tmp_path / "run"
    assert in_process(["--method", "meanpool", *FAST, "--out_dir", out]) == ""
    assert in_process(["--out_dir", out, "--resume", "--max_iters", 2, "--init_from", tiny.BASE_DIR, "--quiet"]) == ""
    state = json.loads((out / "run.json").read_text())
    assert state["step"] == 2 and state["train"]["init_from"] == ""  # (as the run named it)


def test_resume_keeps_what_was_written_and_continues_the_log(files, tmp_path):
    out = tmp_path / "run"
    common = ["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST[2:],
              "--out_dir", out, "--eval_interval", 2]
    assert in_process(common + ["--max_iters", 3]) == ""  # checkpoints at 2 and 3; the log has 3 lines
    state = json.loads((out / "run.json").read_text())
    (out / "log.jsonl").write_text((out / "log.jsonl").read_text() + json.dumps({"step": 4, "loss": 0.0}) + "\n")
    assert in_process(common + ["--max_iters", 5, "--resume"]) == ""  # a log line past the checkpoint goes
    assert [json.loads(line)["step"] for line in open(out / "log.jsonl")] == [1, 2, 3, 4, 5]
    assert json.loads(open(out / "log.jsonl").readlines()[3])["loss"] != 0.0
    with open(out / "log.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a write cut short (was a JSON traceback without the file)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert f"{out / 'log.jsonl'}:6: not a step's record" in in_process(common + ["--max_iters", 6, "--resume"])
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    (out / "log.jsonl").write_bytes(before["log.jsonl"][:before["log.jsonl"].rindex(b"\n") + 1])
    (out / json.loads((out / "run.json").read_text())["files"]["ckpt"]).write_bytes(b"cut")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert "not a readable safetensors file" in in_process(common + ["--max_iters", 6, "--resume"])
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before and state["step"] == 3
    assert in_process(common + ["--max_iters", 1]) == ""  # a new run in the used dir: its own log (was appended)
    assert [json.loads(line)["step"] for line in open(out / "log.jsonl")] == [1]


def test_the_training_file_as_eval_data_is_noted(files, tmp_path, capsys):
    """--eval_data naming --data's file (or a copy): validation and the final evaluation read training questions."""
    shutil.copy(files / "squad.json", tmp_path / "copy.json")
    argv = ["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST]
    assert in_process(argv + ["--eval_data", tmp_path / "copy.json", "--out_dir", tmp_path / "a"]) == ""
    assert "note: --eval_data" in capsys.readouterr().err
    assert in_process(argv + ["--out_dir", tmp_path / "b"]) == ""
    assert "note: --eval_data" not in capsys.readouterr().err
    cfg = train.run_config(tmp_path / "b")[0]
    evaluate.eval_records(cfg, evaluate.EvalConfig(eval_data=str(tmp_path / "copy.json"), n=2))
    assert "is the file the run trained on" in capsys.readouterr().err


def test_eval_inputs_are_one_line(files, tmp_path, monkeypatch):
    run_dir = tmp_path / "mp"
    in_process(["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST,
                "--out_dir", run_dir])
    (tmp_path / "doc.txt").write_text("The Nile flows north through Egypt.")
    (tmp_path / "one.json").write_text('{"run": "mp", "rows": []}')  # one run's metrics.json, not --out's list
    sac = tmp_path / "sac"
    in_process(["--method", "sac", "--init_from", files / "hf", "--data", files / "squad.json", *FAST, "--pretrain", 0,
                "--out_dir", sac])
    in_process([sac, "--context", tmp_path / "doc.txt", "--question", "Where?", "--save_memory", tmp_path / "doc.mem"],
               evaluate.main)
    gone = tmp_path / "gone"  # a run validated on a file deleted since
    shutil.copy(files / "squad.json", tmp_path / "held.json")
    in_process(["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST,
                "--eval_data", tmp_path / "held.json", "--out_dir", gone])
    (tmp_path / "held.json").unlink()
    bare = Memory.load(str(tmp_path / "doc.mem"))
    bare.origin = None  # as saved before memories named their run: the tensors' kind is what tells
    bare.save(str(tmp_path / "bare.mem"))
    twice = lambda x: torch.cat([x, x])  # noqa: E731  (two contexts in one file: one-shot answers one)
    Memory(kv=[(twice(k), twice(v)) for k, v in bare.kv], mask=twice(bare.mask), next_pos=twice(bare.next_pos)).save(
        str(tmp_path / "two.mem"))
    for argv, message in (([run_dir, "--memory", tmp_path / "doc.mem"], "was saved by a --method sac run"),
                          ([run_dir, "--memory", tmp_path / "bare.mem"], "it holds K/V; this run's method answers from"),
                          ([sac, "--memory", tmp_path / "two.mem"], "it holds 2 contexts; one is answered from"),
                          ([gone, "--n", 2], f"{gone}'s --eval_data '{tmp_path / 'held.json'}': no such file"),
                          ([run_dir, "--memory", files / "squad.json"], "squad.json: not a readable safetensors file"),
                          ([run_dir, "--context", tmp_path / "none.txt"], "--context"),
                          ([run_dir, "--context", tmp_path / "doc.txt", "--question", " "], "--question is empty"),
                          ([run_dir, "--context", tmp_path / "doc.txt", "--question", "why\udcff"],  # ($'why\xff')
                           "--question is not UTF-8 text"),
                          ([run_dir, "--context", tmp_path / "doc.txt", "--question", "why " * 3000],
                           "more than half of"),  # (an answer past the decoder's positions)
                          ([run_dir, "--context", files / "latin1.json"], "not UTF-8 text"),
                          ([tmp_path / "nothing", "--n", 2], "is not a run dir"),
                          ([tmp_path / "one.json", "--n", 2], "one.json: not an eval.py --out JSON"),
                          ([files / "latin1.json", "--n", 2], "cannot read it as an eval.py --out JSON"),
                          ([run_dir, "--n", 2, "--device", "cuda:99"], "--device 'cuda:99': use cpu or cuda"),
                          ([run_dir, "--n", -1], "--n -1 must lie in 0..2^20"),
                          ([run_dir, "--n", 1 << 21], "--n 2097152 must lie in 0..2^20"),  # (synthetic: a hang)
                          ([run_dir, "--context="], "--context is empty"),  # (was: every run evaluated)
                          ([run_dir, "--n", 2, "--out="], "--out is empty"),  # (wrote nothing)
                          ([run_dir, "--n", 2, "--eval_data", ""], "--eval_data is empty"),  # (read the run's own)
                          ([run_dir, "--context", tmp_path / "doc.txt", "--save_memory="], "--save_memory is empty"),
                          ([run_dir, "--n", 2, "--batch_size", 0], "--batch_size 0 must be a positive integer"),
                          ([run_dir, "--n", 2, "--max_new_tokens", 0], "--max_new_tokens 0 must be a positive"),
                          ([run_dir, "--n", 2, "--split", "dev"], "--split 'dev'; choose from"),
                          ([run_dir, "--n", 2, "--eval_data", tmp_path / "none.json"], "--eval_data"),
                          ([run_dir, "--n", 2, "--eval_data", tmp_path], "a folder, not a file"),
                          ([run_dir, "--n", 2, "--out", tmp_path / "doc.txt" / "x.json"], "is a file, not a folder"),
                          ([run_dir, "--n", 2, "--out", tmp_path], "is a folder; name a file")):
        line = in_process(argv + (["--question", "Where?"] if not {"--n", "--question"} & set(argv) else []),
                          evaluate.main)
        assert line.startswith("error: ") and message in line, (argv, line)
    p = run([run_dir, "--memory", files / "squad.json", "--question", "Where?"], script="eval.py", check=False)
    assert p.returncode != 0 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr  # the script itself
    monkeypatch.setattr(train, "load_run", lambda *a: pytest.fail("a model loaded before the questions were read"))
    line = in_process([run_dir, "--n", 2, "--eval_data", files / "bad.json"], evaluate.main)
    assert line.startswith("error: ") and "bad.json:1: invalid JSON" in line, line


def test_eval_checks_every_run_before_it_evaluates_one(files, tmp_path, monkeypatch, capsys):
    """A later run's missing checkpoint, a run.json value of the wrong kind, a file of no questions: one line before
    any run loads. A run short of its --max_iters is noted; a run named twice is read once."""
    run_dir = tmp_path / "mp"
    in_process(["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST,
                "--out_dir", run_dir])
    state = json.loads((run_dir / "run.json").read_text())

    def variant(name, edit):
        shutil.copytree(run_dir, tmp_path / name)
        edit(tmp_path / name, json.loads(json.dumps(state)))
        return tmp_path / name
    write = lambda d, st: (d / "run.json").write_text(json.dumps(st))  # noqa: E731
    no_ckpt = variant("no_ckpt", lambda d, st: (d / st["files"]["ckpt"]).unlink())
    typed = variant("typed", lambda d, st: write(d, {**st, "train": {**st["train"], "eval_examples": "4"}}))
    short = variant("short", lambda d, st: write(d, {**st, "train": {**st["train"], "max_iters": 1000}}))
    four = variant("four", lambda d, st: write(d, {**st, "train": {**st["train"], "eval_examples": 4}}))
    narrow = variant("narrow", lambda d, st: write(d, {**st, "train": {**st["train"], "max_context": -5}}))
    ratio = variant("ratio", lambda d, st: write(d, {**st, "train": {**st["train"], "eval_ratio": "abc"}}))
    cut = variant("cut", lambda d, st: (d / st["files"]["ckpt"]).write_bytes((run_dir / st["files"]["ckpt"])
                                                                             .read_bytes()[:-100]))
    (tmp_path / "empty.jsonl").write_text("")
    loaded = []
    monkeypatch.setattr(train, "load_run", lambda *a: loaded.append(a) or pytest.fail("a run loaded"))
    for argv, message in (([run_dir, no_ckpt, "--n", 2], f"{no_ckpt}: its checkpoint ckpt-0000001.safetensors is "
                                                           "missing"),
                          ([run_dir, typed, "--n", 2], "run.json: train.eval_examples is '4', expected int"),
                          ([run_dir, cut, "--n", 2], "ckpt-0000001.safetensors: not a readable safetensors file"),
                          ([four, run_dir], f"{run_dir}: no evaluation examples"),  # (its --eval_examples 0)
                          ([run_dir, narrow, "--n", 2], "run.json: train.max_context is -5, expected >= 1"),  # (it
                          # evaluated contexts "cut to -5"; a ratio: "--ratio 'abc'", a flag not given)
                          ([run_dir, ratio, "--n", 2], "run.json: train.eval_ratio: --eval_ratio 'abc' must be a "),
                          ([run_dir, "--eval_data", tmp_path / "empty.jsonl"], "empty.jsonl' holds no usable")):
        line = in_process(argv, evaluate.main)
        assert line.startswith("error: ") and message in line, (argv, line)
    monkeypatch.undo()
    for _ in range(2):  # evaluated, then read back from its metrics.json: noted both times
        results = evaluate.main([str(short), str(run_dir), f"{run_dir}/", "--n", "2"])
        assert [r["run"] for r in results] == [str(short), f"{run_dir}/"]
        assert f"note: {short} is at step 1 of its 1000 (still training" in capsys.readouterr().err
    evaluate.main([str(short), "--n", "3"])  # other questions replace the rows of --n 2: said before the work
    assert f"note: {short}/metrics.json holds rows read with another n: this evaluation replaces" in \
        capsys.readouterr().err
    monkeypatch.setattr(train, "atomic_write", lambda path, write: (_ for _ in ()).throw(
        OSError(f"{path}: could not write it ([Errno 13] Permission denied)")))  # a run dir read-only to this user
    assert evaluate.main([str(short), "--n", "2"])[0]["asked"]["n"] == 2  # (it failed after the whole evaluation)
    assert "metrics.json: could not write it ([Errno 13] Permission denied); its rows are in the table" in \
        capsys.readouterr().err


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_ctrl_c_while_torch_loads_is_130_without_a_traceback(tmp_path, script):
    """Ctrl-C in a command's first second (torch loading): exit 130, as at any later moment; it printed an import
    traceback and died of the signal."""
    args = ["--method", "meanpool", "--max_iters", "1", "--out_dir", tmp_path / "out"] if script == "train.py" else \
        [tmp_path / "out"]
    p = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    time.sleep(0.3)  # (torch takes 1-2 s to load)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, (p.returncode, err[-2000:])
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_ctrl_c_during_an_evaluation_is_one_line_and_130(tmp_path, sig):
    """Ctrl-C or SIGTERM while eval.py evaluates (after train.py handed it the run, say): one line, status 130, no
    traceback."""
    run_dir = tmp_path / "mp"
    assert in_process(["--method", "meanpool", "--max_iters", 1, "--batch_size", 2, "--eval_examples", 0, "--quiet",
                       "--device", "cpu", "--out_dir", run_dir]) == ""
    p = subprocess.Popen([sys.executable, "eval.py", str(run_dir), "--n", "20000"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    # wait until it handles SIGTERM, which it does from just before its main (SigCgt: the mask of handled signals)
    status, deadline = Path(f"/proc/{p.pid}/status"), time.time() + 60
    while p.poll() is None and time.time() < deadline:
        handled = int(re.search(r"SigCgt:\s*(\w+)", status.read_text())[1], 16)
        if handled >> (signal.SIGTERM - 1) & 1:
            break
        time.sleep(0.05)
    time.sleep(1)  # (evaluating by now, most likely; anywhere in its main reads the same)
    p.send_signal(getattr(signal, "SIG" + sig))
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip() == "interrupted: the runs evaluated before it keep their " \
        "metrics.json", err[-2000:]
    assert not (run_dir / "metrics.json").exists()


def test_smollm2_script_inputs_are_one_line_before_the_conversion(files, tmp_path):
    """scripts/smollm2.py: a broken --squad, a --gguf that is no file or cut (a traceback), no out_dir, an out_dir
    under a file: one line each on stderr, and no out_dir made (the SQuAD split runs before the conversion)."""
    smollm2 = load_script("smollm2")
    (tmp_path / "a_file").write_text("")
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "whole.gguf"), "llama")  # metadata past its first 100 bytes
    writer.add_name("a stand-in model")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "whole.gguf").read_bytes()[:100])
    for args, message in (([tmp_path / "out", "--squad", files / "bad.json"], "bad.json:1: invalid JSON"),
                          ([tmp_path / "out", "--gguf", tmp_path / "cut.gguf"], "cut.gguf: transformers cannot read "
                                                                                 "it as a GGUF model (cut"),
                          ([], "error: the following arguments are required: out_dir"),  # (argparse's usage)
                          ([tmp_path / "out", "--squad", files / "bad.jsonl"], "bad.jsonl: JSON lines; give SQuAD"),
                          ([tmp_path / "out", "--gguf", tmp_path], "--gguf"),
                          ([tmp_path / "a_file" / "out"], "a_file is a file, not a folder"),
                          ([tmp_path / "out", "--heldout_articles", 5], "--heldout_articles splits --squad's articles"),
                          ([files / "hf", "--gguf", tmp_path / "whole.gguf"], "holds a converted model already")):
        if not args:  # one in a process, as a user sees it; the others in this one (a process costs seconds)
            p = run(args, script="scripts/smollm2.py", check=False)
            assert p.returncode != 0 and p.stderr.count("\n") == 1 and message in p.stderr, (args, p.stderr[-2000:])
        else:
            line = in_process(args, smollm2.main)
            assert line.startswith("error: ") and "\n" not in line and message in line, (args, line)
        assert not (tmp_path / "out").exists()


def test_a_run_on_a_data_file_is_read_on_the_questions_training_held_out(files, tmp_path):
    """Without --eval_data a run's final evaluation reads the questions of --data that training held out (it read the
    synthetic biographies); a text --data, which holds no questions, is one line before any work."""
    run_dir = tmp_path / "mp"
    in_process(["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST,
                "--out_dir", run_dir])
    res = evaluate.main([str(run_dir), "--n", 4])[0]
    cfg = train.TrainConfig(data=str(files / "squad.json"))
    held = train.held_out(train.read_records(cfg.data, cfg), cfg.seed)[1]
    assert list(res["rows"][0]["scores"]["f1"]) == [r["id"] for r in held[:4]] and res["asked"]["held_out_of"]
    assert "--split picks synthetic questions" in in_process([run_dir, "--split", "val"], evaluate.main)  # (ignored)
    (tmp_path / "book.txt").write_text("One sentence. Another one.\n\nA second paragraph.\n")
    line = in_process(["--method", "sentence_gist", "--init_from", files / "hf", "--data", tmp_path / "book.txt",
                       *FAST, "--eval_examples", 2, "--out_dir", tmp_path / "sg"])
    assert "book.txt is text: the final evaluation asks questions" in line and not (tmp_path / "sg").exists()


def test_a_compressor_distils_its_teacher_in_the_prompt_format_it_was_trained_on(files, tmp_path):
    """--teacher's --prompt is the run's unless a flag says otherwise; a flag of another format is one line (a chatml
    student distilled a teacher finetuned on plain prompts in silence). "auto" on a chat checkpoint reads as chatml."""
    chat = tmp_path / "chat"
    hf_checkpoint(chat, chat=True)
    common = ["--init_from", chat, "--data", files / "squad.json", *FAST]
    for prompt in ("plain", "auto"):
        assert in_process(["--method", "teacher", *common, "--prompt", prompt, "--out_dir", tmp_path / prompt]) == ""
    line = in_process(["--method", "meanpool", *common, "--teacher", tmp_path / "plain", "--prompt", "chatml",
                       "--out_dir", tmp_path / "x"])
    assert f"--prompt chatml: --teacher {tmp_path / 'plain'} was trained on --prompt plain prompts" in line, line
    assert not (tmp_path / "x").exists()
    for teacher, flags, taken in (("plain", [], "plain"), ("auto", ["--prompt", "chatml"], "chatml")):
        out = tmp_path / f"mp-{teacher}"
        assert in_process(["--method", "meanpool", *common, "--teacher", tmp_path / teacher, *flags,
                           "--out_dir", out]) == ""
        assert json.load(open(out / "run.json"))["train"]["prompt"] == taken


def test_a_chat_template_whose_turn_tokens_the_tokenizer_lacks_is_one_line(files, tmp_path):
    """--prompt auto reads the chat template's format: one whose turn tokens the tokenizer lacks (a Llama 3 template
    beside a ChatML tokenizer) is one line before the model loads (it failed at the first batch, naming no file)."""
    chat = tmp_path / "chat"
    hf_checkpoint(chat, chat=True)
    config = json.loads((chat / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}<|start_header_id|>{{ m['content'] }}<|eot_id|>{% endfor %}"
    (chat / "tokenizer_config.json").write_text(json.dumps(config))
    line = in_process(["--method", "meanpool", "--init_from", chat, "--data", files / "squad.json", *FAST,
                       "--out_dir", tmp_path / "out"])
    assert line == f"error: --prompt auto (its chat template's llama3): the tokenizer of {chat} has no " \
        "<|start_header_id|> and <|eot_id|> tokens" and not (tmp_path / "out").exists(), line


def test_a_run_of_another_method_is_not_an_init_from(files, tmp_path):
    """--init_from another method's run: one line (pic trained from the base under it, the run's weights dropped in
    silence); a run of the same method continues from its weights ("after kd")."""
    mp = tmp_path / "mp"
    assert in_process(["--method", "meanpool", "--init_from", files / "hf", "--data", files / "squad.json", *FAST,
                       "--out_dir", mp]) == ""
    line = in_process(["--method", "pic", "--init_from", mp, "--data", files / "squad.json", *FAST,
                       "--out_dir", tmp_path / "pic"])
    assert f"--init_from '{mp}' is a --method meanpool run; a --method pic run starts from" in line, line
    assert not (tmp_path / "pic").exists()
    assert in_process(["--method", "meanpool", "--init_from", mp, "--data", files / "squad.json", *FAST,
                       "--out_dir", tmp_path / "again"]) == ""


def test_a_file_whose_every_record_is_skipped_is_one_line(tmp_path, capsys):
    """SQuAD v2 with unanswerable questions alone: the error, with the reader's counts, is the only line (a note of
    the same counts came before it, and a note of the checks before the data is read)."""
    qas = [{"id": f"q{i}", "question": "Where?", "answers": [], "is_impossible": True} for i in range(3)]
    doc = {"version": "v2.0", "data": [{"title": "t", "paragraphs": [{"context": "Paris is in France.", "qas": qas}]}]}
    (tmp_path / "v2.json").write_text(json.dumps(doc))
    with pytest.raises(SystemExit) as e:
        train.main(["--method", "teacher", "--data", str(tmp_path / "v2.json"), "--out_dir", str(tmp_path / "out")])
    assert str(e.value.code).startswith(f"error: '{tmp_path / 'v2.json'}' holds no usable records (")
    assert "'unanswerable': 3" in str(e.value.code) and capsys.readouterr().err == ""
    assert not (tmp_path / "out").exists()
    ckpt = hf_checkpoint(tmp_path / "hf")  # (2,048 positions: --max_context 2000's note waits for the checks)
    capsys.readouterr()
    with pytest.raises(SystemExit, match="holds no usable records"):
        train.main(["--method", "teacher", "--init_from", ckpt, "--max_context", "2000", "--data",
                    str(tmp_path / "v2.json"), "--out_dir", str(tmp_path / "out")])
    assert capsys.readouterr().err == ""
