"""train.py: loss goes down, exact resume, atomic checkpoints, DDP, compile, real checkpoints, CLI errors."""
import copy
import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError

import model
import train
from common import DDP_ATOL, ROOT, cli_error, hf_checkpoint, method_smoke, read_params, run, squad_file, torchrun



def args(base_dir, out, *extra):
    return ["--method", "meanpool", "--init_from", base_dir, "--out_dir", str(out), "--batch_size", 2,
            "--ratio", "4,8", "--lr", "3e-3", "--device", "cpu", "--quiet", "--max_context", 256, *extra]


def in_process(argv):
    train.main([str(a) for a in argv])


def test_twenty_steps_lower_the_loss(base_dir, tmp_path):
    in_process(args(base_dir, tmp_path / "r", "--max_iters", 20, "--eval_interval", 20))
    log = [json.loads(l) for l in open(tmp_path / "r" / "log.jsonl")]
    first, last = sum(r["loss"] for r in log[:4]) / 4, sum(r["loss"] for r in log[-4:]) / 4
    assert len(log) == 20 and last < first


def test_a_run_validates_about_four_times_by_default(base_dir, tmp_path):
    """--eval_interval 0: every ceil(max_iters / 4) steps and at the last (6 steps: 2, 4, 6; not every step)."""
    in_process(args(base_dir, tmp_path / "r", "--max_iters", 6, "--eval_examples", 0))
    log = [json.loads(line) for line in open(tmp_path / "r" / "log.jsonl")]
    assert [r["step"] for r in log if "val_loss" in r] == [2, 4, 6], log


def test_a_step_counts_the_input_tokens_its_passes_read_not_their_labels():
    """The bar's tok_s: ids and every pass's input (padding included), not the labels beside them."""
    w = torch.nn.Parameter(torch.ones(()))
    long = lambda b, t: torch.zeros(b, t, dtype=torch.long)
    mb = {"ids": long(2, 5), "labels": long(2, 5), "qa": long(2, 3), "qa_labels": long(2, 3), "len": torch.ones(2)}
    opt = train.AdamW([{"params": [w], "weight_decay": 0.0}], lr=0.0, betas=(0.9, 0.95))
    out = train.train_step(lambda mb, ratios: (w * 2, 1, {}), [mb], [w], opt, [4], torch.device("cpu"),
                           nullcontext(), False, 1, train.TrainConfig())
    assert out[0] == 2.0 and out[2] == 2 * 5 + 2 * 3


def test_training_again_into_a_run_dir_drops_its_stale_metrics(base_dir, tmp_path):
    """eval.py serves <run>/metrics.json from cache: a new checkpoint in the same dir must not keep
    the scores of the one before it (a folder with a metrics.json and no run.json is no run's: test_inputs)."""
    out = tmp_path / "r"
    in_process(args(base_dir, out, "--max_iters", 1, "--eval_examples", 0))
    (out / "metrics.json").write_text(json.dumps({"rows": [{"f1": 99.0}]}))
    in_process(args(base_dir, out, "--max_iters", 2, "--eval_examples", 0))
    assert (out / "run.json").exists() and not (out / "metrics.json").exists()


def test_resume_reaches_the_same_parameters(base_dir, tmp_path, monkeypatch):
    in_process(args(base_dir, tmp_path / "full", "--max_iters", 12, "--eval_interval", 4))
    real_call = train.Batches.__call__

    def stop_at_6(self, step):  # Ctrl-C during step 6: the loop saves after it and exits
        if step == 5:
            train.STOP.append(1)
        return real_call(self, step)
    monkeypatch.setattr(train.Batches, "__call__", stop_at_6)
    in_process(args(base_dir, tmp_path / "cut", "--max_iters", 12, "--eval_interval", 4))
    assert json.load(open(tmp_path / "cut" / "run.json"))["step"] == 6
    monkeypatch.setattr(train.Batches, "__call__", real_call)
    in_process(args(base_dir, tmp_path / "cut", "--max_iters", 12, "--eval_interval", 4, "--resume"))
    a, b = read_params(tmp_path / "full"), read_params(tmp_path / "cut")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_a_run_dir_is_never_a_mix_of_two_runs(base_dir, tmp_path, monkeypatch):
    """A run starting anew in a used dir drops the old run's commit point with its log at step 1: killed before its
    first checkpoint, it leaves no run.json for --resume to join to the new log. Another method's run there is
    never replaced."""
    out = tmp_path / "r"
    in_process(args(base_dir, out, "--max_iters", 2, "--eval_examples", 0))
    monkeypatch.setattr(train, "save_checkpoint", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("killed")))
    with pytest.raises(RuntimeError, match="killed"):
        in_process(args(base_dir, out, "--max_iters", 4, "--eval_interval", 2, "--lr", "1e-4"))
    monkeypatch.undo()
    assert not (out / "run.json").exists() and [json.loads(line)["step"] for line in open(out / "log.jsonl")] == [1, 2]
    with pytest.raises(SystemExit, match="--resume but .* has no checkpoint"):
        in_process(args(base_dir, out, "--max_iters", 4, "--resume"))
    in_process(args(base_dir, out, "--max_iters", 2, "--eval_examples", 0))
    pic = ["--method", "pic", "--init_from", base_dir, "--out_dir", out, "--max_iters", 1, "--quiet", "--device", "cpu"]
    with pytest.raises(SystemExit, match=f"--out_dir '{out}' holds a --method meanpool run \\(step 2\\); give this"):
        in_process(pic)
    assert json.load(open(out / "run.json"))["train"]["method"] == "meanpool"


def test_a_loss_that_is_not_finite_stops_the_run(base_dir, tmp_path):
    """--lr 1e30: the loss turns nan or inf; the run stops there with one line, keeping its last checkpoint."""
    out = tmp_path / "r"
    with pytest.raises(SystemExit) as e:
        in_process(args(base_dir, out, "--max_iters", 40, "--eval_interval", 1, "--lr", "1e30", "--grad_clip", 0,
                        "--eval_examples", 0))
    m = re.fullmatch(rf"error: step (\d+): the (training|validation) loss is (nan|inf); stopped \({out} (keeps step "
                     r"(\d+)|holds no checkpoint of this run)\)\. A lower --lr \(or --grad_clip\) may keep it finite",
                     str(e.value))
    assert m, e.value
    if m[5]:  # what is kept is finite: the weights of a non-finite validation loss are not saved
        assert json.load(open(out / "run.json"))["step"] == int(m[5]) < int(m[1])
        assert all(torch.isfinite(t).all() for t in read_params(out).values())
    else:
        assert not (out / "run.json").exists()


def test_a_signal_in_a_stages_last_step_stops_the_run_with_the_stage_whole(base_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C during a stage's last step: the stage is saved whole, and the run stops there (a first stage's next
    stage does not start; main returns None: exit status 130, no evaluation)."""
    real_call = train.Batches.__call__

    def stop_in_the_last(self, step):
        if step == 1:
            train.STOP.append(1)
        return real_call(self, step)
    monkeypatch.setattr(train.Batches, "__call__", stop_in_the_last)
    argv = ["--method", "pic", "--init_from", base_dir, "--out_dir", tmp_path / "r", "--max_iters", 4, "--pretrain", 2,
            "--batch_size", 2, "--max_context", 128, "--quiet", "--device", "cpu"]
    try:
        assert train.main([str(a) for a in argv]) is None
    finally:
        train.STOP.clear()
    assert json.load(open(tmp_path / "r" / "pretrain" / "run.json"))["step"] == 2
    assert not (tmp_path / "r" / "run.json").exists()
    stage = tmp_path / "r" / "pretrain"
    assert f"interrupted: {stage} finished its 2 steps; the run stops here" in capsys.readouterr().out


def test_sigterm_saves_the_step_and_exits_130(base_dir, tmp_path):
    """SIGTERM (a scheduler's, `timeout`'s) as Ctrl-C: the step in progress ends, is saved, the exit status is 130
    (a script's `train.py && next` stops); --resume continues it."""
    out = tmp_path / "r"
    p = subprocess.Popen([sys.executable, "train.py", *map(str, args(base_dir, out, "--max_iters", 100000))], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(600):  # (its first step within 60 s)
        if (out / "log.jsonl").exists() or p.poll() is not None:
            break
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 130 and "Traceback" not in stderr, stderr[-2000:]
    step = json.load(open(out / "run.json"))["step"]
    assert f"interrupted: saved step {step} to {out}; continue with --resume" in stdout and step >= 1


def test_resume_takes_the_runs_objective_ratio_and_aids(base_dir, tmp_path):
    """--resume continues the run it finds: a flag that shaped its tensors or its loss, given with another value, is
    one line (--objective qa trained a kd run on qa in silence; --prompt sac added a parameter: a traceback); left
    out, the run's value holds. A checkpoint that lacks a trainable tensor is one line too."""
    out = tmp_path / "r"
    in_process(args(base_dir, out, "--max_iters", 2, "--eval_examples", 0))  # meanpool kd at 4,8
    for flags in (["--objective", "qa"], ["--ratio", "4"], ["--no_aids"]):
        with pytest.raises(SystemExit, match=f"--{flags[0][2:]} .* conflicts with the run --resume continues"):
            in_process(args(base_dir, out, "--max_iters", 3, "--resume", *flags))
    in_process(["--method", "meanpool", "--init_from", base_dir, "--out_dir", out, "--max_iters", 3, "--resume",
                "--quiet", "--device", "cpu", "--eval_examples", 0])
    state = json.load(open(out / "run.json"))
    assert state["train"]["ratio"] == "4,8" and "ratio" in state["flags"]  # (the recipe's is 4,8,16; the row's label)
    (tmp_path / "cut" / "pretrain").mkdir(parents=True)  # a run stopped in its first stage, resumed without its flags
    (tmp_path / "cut" / "pretrain" / "run.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"has no checkpoint \(.*/cut/pretrain has: give the flags its run was"):
        in_process(args(base_dir, tmp_path / "cut", "--max_iters", 3, "--resume"))
    in_process(args(base_dir, tmp_path / "qa", "--max_iters", 2, "--eval_examples", 0, "--objective", "qa"))
    saved = json.load(open(tmp_path / "qa" / "run.json"))
    json.dump({k: v for k, v in saved.items() if k != "command"}, open(tmp_path / "qa" / "run.json", "w"))  # older
    with pytest.raises(SystemExit, match=f"--resume: {tmp_path / 'qa'} was trained with objective='qa', this command "
                                         "gives 'kd': give --objective as the run's"):
        in_process(args(base_dir, tmp_path / "qa", "--max_iters", 3, "--resume"))
    json.dump(saved, open(tmp_path / "qa" / "run.json", "w"))  # its command names --objective qa: --resume reruns it
    in_process(args(base_dir, tmp_path / "qa", "--max_iters", 3, "--resume"))
    assert json.load(open(tmp_path / "qa" / "run.json"))["train"]["objective"] == "qa"
    in_process(args(base_dir, out, "--max_iters", 4, "--resume", "--ratio", "4, 8"))  # (the same ratios)
    cfg, mcfg, tok, base, method = train.load_run(str(out))
    method.extra = torch.nn.Parameter(torch.zeros(2))
    opt = train.AdamW([{"params": [p for p in method.parameters() if p.requires_grad], "weight_decay": 0.0}], 1.0,
                      (0.9, 0.95))
    with pytest.raises(SystemExit, match=r"its checkpoint lacks this method's trainable \['extra'\]"):
        train.load_checkpoint(str(out), method, opt)
    with pytest.raises(SystemExit, match=r"its checkpoint lacks this method's trainable \['extra'\]"):
        train.load_checkpoint(str(out), method)  # eval's (it read `extra` at its initial value, and scored that)
    assert train.load_checkpoint(str(out), method, partial=True) == 4  # a stage that trains more starts from it


def test_adamw_is_torchs_step_for_step_and_reads_its_state():
    """train.AdamW against torch.optim.AdamW: decay and no-decay groups, a parameter without a gradient for a
    step, the lr changed between steps, and each optimizer resumed from the other's state_dict."""
    torch.manual_seed(0)
    start = [torch.randn(5, 3), torch.randn(3), torch.randn(4, 4)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(6)]

    def groups(params):
        return [{"params": [params[0], params[2]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]

    def steps(opt, params, first, last):
        for t in range(first, last):
            for g in opt.param_groups:
                g["lr"] = 1e-2 / (t + 1)
            for p, grad in zip(params, grads[t]):
                p.grad = None if (t == 1 and p is params[2]) else grad.clone()
            opt.step()
            opt.zero_grad()

    ours, theirs = ([torch.nn.Parameter(p.clone()) for p in start] for _ in range(2))
    opt_ours = train.AdamW(groups(ours), lr=1e-2, betas=(0.9, 0.95))
    opt_theirs = torch.optim.AdamW(groups(theirs), lr=1e-2, betas=(0.9, 0.95), foreach=False)
    steps(opt_ours, ours, 0, 3)
    steps(opt_theirs, theirs, 0, 3)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
    swapped_ours, swapped_theirs = ([torch.nn.Parameter(p.detach().clone()) for p in ours] for _ in range(2))
    resumed_ours = train.AdamW(groups(swapped_ours), lr=1.0, betas=(0.9, 0.95))
    resumed_ours.load_state_dict(opt_theirs.state_dict())
    resumed_theirs = torch.optim.AdamW(groups(swapped_theirs), lr=1.0, betas=(0.9, 0.95), foreach=False)
    resumed_theirs.load_state_dict(copy.deepcopy(opt_ours.state_dict()))  # not the tensors opt_ours goes on with
    for opt, params in [(opt_ours, ours), (resumed_ours, swapped_ours), (resumed_theirs, swapped_theirs)]:
        steps(opt, params, 3, 6)
    assert (ours[0] - start[0]).abs().max() > 1e-3
    for params in (swapped_ours, swapped_theirs):
        for a, b in zip(params, ours):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)


def test_resume_of_an_earlier_stages_dir_names_its_run(base_dir, tmp_path):
    """--resume --out_dir RUN/pretrain (pic's first stage): one line naming RUN (it looked for RUN/pretrain/pretrain)."""
    out = tmp_path / "p"
    in_process(["--method", "pic", "--init_from", base_dir, "--out_dir", out, "--pretrain", 1, "--max_iters", 1,
                "--batch_size", 2, "--device", "cpu", "--quiet", "--eval_examples", 0])
    with pytest.raises(SystemExit, match=f"^error: --resume: {out / 'pretrain'} is an earlier stage of the run in "
                                         f"{out}: resume that one$"):
        in_process(["--method", "pic", "--out_dir", out / "pretrain", "--resume"])


def test_a_second_ctrl_c_in_a_step_stops_at_once():
    """The first Ctrl-C / SIGTERM asks the loop to save at the step's end; a second raises KeyboardInterrupt (exit 130,
    the last checkpoint standing): a step of a batch too large for the host may not end."""
    train.STOP.clear()
    train.stop_at_the_step_end()
    with pytest.raises(KeyboardInterrupt):
        train.stop_at_the_step_end()
    assert train.STOP == [1]
    train.STOP.clear()


def test_a_moved_teacher_is_named_by_run_json_and_resume_takes_its_new_path(base_dir, tmp_path):
    """A run's teacher moved after it trained: eval (load_run) names run.json's key, not a --teacher never given;
    --resume --teacher NEW continues the run (it was a conflict with the old path) and records the new path."""
    import eval as evaluate
    teacher, moved, out = tmp_path / "teacher", tmp_path / "moved", tmp_path / "mp"
    in_process(["--method", "teacher", "--init_from", base_dir, "--out_dir", teacher, "--max_iters", 1,
                "--batch_size", 2, "--device", "cpu", "--quiet"])
    in_process(args(base_dir, out, "--teacher", teacher, "--max_iters", 1, "--eval_examples", 0))
    teacher.rename(moved)
    with pytest.raises(SystemExit, match=f"^error: {out}: its run.json's train.teacher '{teacher}' is gone"):
        evaluate.main([str(out), "--n", "2"])
    in_process(["--out_dir", out, "--resume", "--teacher", moved, "--max_iters", 2])
    state = json.load(open(out / "run.json"))
    assert state["step"] == 2 and state["train"]["teacher"] == str(moved)


def test_resume_from_an_optimizer_state_keyed_by_name_is_one_line(base_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    out = tmp_path / "r"
    in_process(args(base_dir, out, "--max_iters", 2, "--eval_interval", 2))
    path = out / json.load(open(out / "run.json"))["files"]["optim"]
    save_file({k.replace("0::", "encoder.lora_A::", 1): v for k, v in load_file(path).items()}, path)
    with pytest.raises(SystemExit, match="optimizer state in an older format"):
        in_process(args(base_dir, out, "--max_iters", 4, "--eval_interval", 2, "--resume"))


def test_interrupted_checkpoint_write_keeps_the_previous_one(base_dir, tmp_path, monkeypatch):
    out = tmp_path / "r"
    in_process(args(base_dir, out, "--max_iters", 4, "--eval_interval", 2))
    before = read_params(out)
    real_replace = os.replace

    def crash_on_commit(src, dst):
        if str(dst).endswith("run.json"):
            raise OSError("killed during save")
        return real_replace(src, dst)
    monkeypatch.setattr(os, "replace", crash_on_commit)
    with pytest.raises(OSError):
        in_process(args(base_dir, out, "--max_iters", 8, "--eval_interval", 2, "--resume"))
    monkeypatch.setattr(os, "replace", real_replace)
    assert json.load(open(out / "run.json"))["step"] == 4
    after = read_params(out)  # the files run.json names are still there and whole
    assert all(torch.equal(before[k], after[k]) for k in before)
    cfg, mcfg, tok, base, method = train.load_run(str(out))  # and the run loads
    assert cfg.method == "meanpool"


def test_a_failed_write_keeps_the_file_and_names_it(tmp_path):
    """atomic_write on a full disk (a write that fails half way, an OSError or safetensors' own error): the file keeps
    what it held, no .tmp is left, and the error names the file."""
    path = str(tmp_path / "metrics.json")
    Path(path).write_text("earlier results")

    def full_disk(p, error):
        Path(p).write_text("half")
        raise error
    for error in (OSError(28, "No space left on device"), SafetensorError("Error while serializing: IoError")):
        with pytest.raises(OSError, match=f"^{re.escape(path)}: could not write it"):
            train.atomic_write(path, lambda p: full_disk(p, error))
        assert Path(path).read_text() == "earlier results" and os.listdir(tmp_path) == ["metrics.json"]


@pytest.mark.slow
def test_ddp_two_ranks_equal_one_rank_with_double_batch(base_dir, tmp_path):
    common = ["--method", "meanpool", "--init_from", base_dir, "--max_iters", 3, "--ratio", "4",
              "--device", "cpu", "--quiet", "--max_context", 128, "--eval_interval", 3, "--lr", "1e-2", "--eval_examples", 0]
    torchrun(common + ["--batch_size", 2, "--out_dir", tmp_path / "ddp"])  # the global batch, 1 per rank
    train.main([str(a) for a in common + ["--batch_size", 2, "--out_dir", tmp_path / "one"]])  # one rank, in this process
    recipes = [json.load(open(tmp_path / d / "run.json"))["recipe"][0]["values"] for d in ("ddp", "one")]
    assert recipes[0] == recipes[1] and recipes[0]["batch_size"] == [2, "flag"]  # --batch_size: the global batch
    a, b = read_params(tmp_path / "ddp"), read_params(tmp_path / "one")
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=DDP_ATOL), k
    p = torchrun(common + ["--batch_size", 3, "--out_dir", tmp_path / "odd"], check=False)  # 3 over 2 ranks
    assert p.returncode != 0 and p.stderr.count("error: --batch_size 3") == 1, p.stderr[-2000:]  # (once per rank)


@pytest.mark.slow
def test_compile_gives_the_eager_loss(base_dir, tmp_path, monkeypatch):
    """--compile's graphs, forward and backward, as AOTAutograd builds them (backend aot_eager): inductor's code
    generation is torch's own, costs ~100 s of CPU compiling here, and test_gpu.py runs it on CUDA."""
    monkeypatch.setattr(train, "compile_layers", functools.partial(model.compile_layers, backend="aot_eager"))
    in_process(args(base_dir, tmp_path / "eager", "--max_iters", 2, "--eval_interval", 2))
    in_process(args(base_dir, tmp_path / "comp", "--max_iters", 2, "--eval_interval", 2, "--compile"))
    a = [json.loads(l)["loss"] for l in open(tmp_path / "eager" / "log.jsonl")]
    b = [json.loads(l)["loss"] for l in open(tmp_path / "comp" / "log.jsonl")]
    assert a == pytest.approx(b, rel=1e-4)


def test_a_teacher_merges_in_fp32_and_rounds_once(base_dir, tmp_path):
    """A bf16 base (CUDA) gets W + dW rounded once: merged into bf16 weights, W would round twice."""
    teacher = model.Transformer.from_pretrained(base_dir)
    teacher.add_adapter("teacher", 4, 4)
    g = torch.Generator().manual_seed(0)
    for name, p in teacher.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=g) * 1e-3)  # |dW| about 1e-3 |W|, as a short SFT's
    teacher.save_adapter("teacher", str(tmp_path / "t" / "teacher"))
    want = {n: w.clone() for n, w in teacher.base_state().items()}  # (base_state shares the weights)
    teacher.merge_adapter("teacher")
    merged = teacher.base_state()
    cfg = train.TrainConfig(init_from=base_dir, teacher=str(tmp_path / "t"))
    got = train.load_base(cfg, "cpu", torch.bfloat16)[1].base_state()
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert all(torch.equal(got[n], merged[n].to(torch.bfloat16)) for n in got)
    twice = {n: w.to(torch.bfloat16) + (merged[n] - want[n]).to(torch.bfloat16) for n, w in want.items()}
    assert any(not torch.equal(got[n], twice[n]) for n in got)  # the old merge, into bf16: not the same weights


@pytest.mark.slow
def test_real_checkpoint_teacher_then_meanpool(tmp_path):
    ckpt = hf_checkpoint(tmp_path / "hf", "llama")
    squad = squad_file(tmp_path / "squad.json")
    common = ["--init_from", ckpt, "--data", squad, "--eval_data", squad, "--max_iters", 2, "--batch_size", 2,
              "--device", "cpu", "--quiet"]
    run(["--method", "teacher", "--out_dir", tmp_path / "teacher", *common])
    assert (tmp_path / "teacher" / "teacher" / "adapter_config.json").exists()
    p = run(["--method", "meanpool", "--teacher", tmp_path / "teacher", "--out_dir", tmp_path / "mp", "--ratio", "4",
             *common, "--eval_examples", 4])
    assert "no --teacher" not in p.stderr  # (the note of a kd run from the base as it is: the Gemma 2 test below)
    metrics = json.load(open(tmp_path / "mp" / "metrics.json"))
    assert metrics["rows"][0]["ratio_requested"] == 4 and "f1" in metrics["teacher"]


def test_every_method_runs_on_gemma2(tmp_path, capsys):
    """2 training steps of each method on a Gemma 2 checkpoint (soft-capping, a sliding
    window shorter than the contexts), in process, then eval.py on two of them. meanpool without --teacher: a note."""
    import eval as evaluate
    ckpt = hf_checkpoint(tmp_path / "hf", "gemma2")
    squad = squad_file(tmp_path / "squad.json")
    runs = []
    for method, extra in (("meanpool", ["--ratio", 4]), ("pic", ["--pretrain", 0]), ("sac", ["--ratio", 5, "--pretrain", 0]),
                          ("sentence_gist", ["--gists", 2, "--stage", 2]), ("ata", ["--pretrain", 0])):  # one stage each
        runs.append(str(tmp_path / method))
        in_process(["--method", method, "--init_from", ckpt, "--data", squad, "--max_iters", 2, "--batch_size", 2,
                    "--out_dir", runs[-1], "--eval_examples", 0, "--device", "cpu", "--quiet", "--lora_r", 4, *extra])
        losses = [json.loads(line)["loss"] for line in open(tmp_path / method / "log.jsonl")]
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (method, losses)
        assert ("note: no --teacher: " in capsys.readouterr().err) == (method == "meanpool"), method
    results = evaluate.main([runs[0], runs[-1], "--n", 2])  # greedy answers from embedding and K/V memory
    assert len(results) == 2 and all("f1" in r["teacher"] and r["rows"] for r in results)


@pytest.mark.parametrize("argv, message", [
    (["--method", "pik"], "unknown --method 'pik'"),
    (["--ratio", "0"], "every ratio must be a positive integer"),
    (["--ratio", "4,x"], "must be a positive integer or a comma list"),
    (["--ratio", "4,8,4"], "names a ratio twice"),
    (["--max_iters", "ten"], "argument --max_iters: invalid int value"),
    (["--frobnicate", "1"], "unrecognized arguments: --frobnicate"),
    (["--method", "meanpool", "--objective", "ae+lm"], "does not apply to --method meanpool"),
    (["--method", "base", "--no_linear"], "--no_linear does not apply to --method base"),
    (["--method", "meanpool", "--pretrain", "5"], "this --method meanpool run has one stage (kd)"),
    (["--method", "sentence_gist", "--lora_r", "-1"], "--lora_r -1 must be >= 0 (0: full finetuning, no LoRA)"),
    (["--method", "sac", "--lora_r", "0"], "--lora_r 0 must be >= 1"),
    (["--method", "ata", "--lora_dropout", "1"], "--lora_dropout 1.0 must lie in [0, 1)"),
    (["--method", "ata", "--huber_delta", "0"], "--huber_delta 0.0 must be a finite number > 0"),
    (["--method", "ata", "--huber_lambda", "inf"], "--huber_lambda inf one >= 0"),  # was a NaN loss
    (["--method", "ata", "--k_max", "100000"], "--k_max 100000: 1 to --max_context 600"),  # was killed for memory
    (["--method", "base", "--n_heads", "3"], "d_model a multiple of 2 x n_heads"),
    (["--method", "base", "--qa_per_context", "0"], "--qa_per_context 0: each >= 1"),
    (["--method", "base", "--vocab_size", "300"], "--vocab_size 300 must lie in [512, 3500]"),
    (["--method", "base", "--vocab_size", "9999"], "--vocab_size 9999 must lie in [512, 3500]"),  # (a traceback)
    (["--method", "base", "--attn_weight", "-1"], "--attn_weight -1.0 must be a number >= 0"),
    *(([*"--method base".split(), f"--{flag}", "x.json"], f"--{flag} does not apply to --method base: it trains")
      for flag in ("data", "teacher")),  # (--data: a KeyError at the first batch; --teacher: ignored)
    (["--method", "base", "--init_from", "tiny_base"], "--init_from does not apply to --method base"),
    (["--method", "base", "--max_context", "8"], "--max_context does not apply to --method base"),  # (ignored)
    (["--method", "base", "--prompt", "auto", "--max_answer", "9"], "--max_answer does not apply"),  # (auto: default)
    (["--method", "meanpool", "--ratio_sampling", "--ratio", "4"], "--ratio_sampling draws one of several"),
    (["--method", "pic", "--max_mem", "-1", "--mem", "single", "--mask", "causal"], "--max_mem -1 must lie in 1..2^20"),
    (["--method", "pic", "--max_mem", str(10**12)], "--max_mem 1000000000000 must lie in 1..2^20"),  # (out of memory)
    (["--pretrain", "-1"], "--pretrain -1 must be a finite number >= 0 (0: no first stage)"),
    (["--method", "base", "--context_weight", "nan"], "--context_weight nan must lie in [0, 1]"),
    (["--micro_batch", "2", "--grad_accum", "2"], "--micro_batch 2 sets --grad_accum: give one of them"),
    (["--method", "ata", "--hotpot_distractors"], "--hotpot_distractors applies to reading a --data file"),  # (ignored)
    (["--skip_bad"], "--skip_bad applies to reading a --data file; the synthetic set is read without it"),  # (ignored)
    *((["--method", "pic", f"--{flag}", " "], f"--{flag} is empty: name a path") for flag in  # (read as not given:
      ("data", "eval_data", "teacher", "out_dir", "decoder")),  # the synthetic set, no teacher, out/pic, ...)
])
def test_cli_errors_are_one_line(argv, message, tmp_path):
    # --method base takes no --init_from: there a check that fails trains one step in tmp_path, not the repo's out/.
    # Every run dir is in tmp_path: the lock on out/METHOD made out/ in the repo and removed it again, and a test
    # beside this one, checking that out/ was writable, saw it vanish. argv's own --out_dir comes later and wins
    real = ["--init_from", "/nonexistent"] if "base" not in argv else ["--out_dir", tmp_path, "--max_iters", 1]
    assert message in cli_error(["--out_dir", tmp_path / "out"] + argv + real)  # argparse's errors too


def test_no_run_writes_into_the_checkpoint_it_reads():
    """The shipped tiny base (--init_from's default) or a dir in it as --out_dir: one line (the run replaced the
    base's run.json with its own and left its checkpoints and log among the base's files). Resolved here, not run:
    a test never writes into the repo, even where this check fails."""
    for out_dir in (ROOT / "tiny_base", f"{ROOT}/tiny_base/", ROOT / "tiny_base" / "run"):
        cfg, mcfg, explicit, cls = train.configure(["--method", "pic", "--out_dir", str(out_dir)])
        with pytest.raises(SystemExit, match="the run would write into the --init_from it reads"):
            train.check_out_dirs(train.resolve(cfg, mcfg, explicit, cls))


def test_cli_errors_in_a_process_are_one_line():
    """As a user sees them: exit != 0, stderr one line, no traceback."""
    for argv, message in ((["--max_iters", "ten"], "argument --max_iters: invalid int value"),
                          (["--method", "pic", "--ratio", "0"], "every ratio must be a positive integer")):
        p = run(argv + ["--init_from", "/nonexistent"], check=False)
        assert p.returncode != 0 and p.stderr.startswith("error:") and p.stderr.count("\n") == 1, p.stderr
        assert message in p.stderr, p.stderr


@pytest.mark.parametrize("method,extra", [("sac", ["--ratio", 5, "--lora_r", 4]), ("ata", ["--lora_r", 4])])
def test_pretrain_runs_the_papers_first_stage(base_dir, tmp_path, method, extra):
    """--pretrain 1 on sac and ata: their pretraining objective into OUT_DIR/pretrain, then qa from it. Run again
    into the same dir with another method flag, both stages train anew (the qa stage was held to the old first
    stage's config, a one-line conflict, before its own first stage was trained)."""
    argv = ["--method", method, "--init_from", base_dir, "--max_iters", 1, "--pretrain", 1, "--batch_size", 2,
            "--max_context", 128, "--out_dir", tmp_path, "--eval_examples", 0, "--quiet", *extra]
    in_process(argv)
    first, second = (json.load(open(d / "run.json"))["train"] for d in (tmp_path / "pretrain", tmp_path))
    pretraining = train.method_registry()[method].recipe(None)[0]["objective"]  # the paper's first stage
    assert (first["objective"], first["max_iters"]) == (pretraining, 1)
    assert (second["objective"], second["init_from"]) == ("qa", str(tmp_path / "pretrain"))
    flag, value = {"sac": ("anchor_emb", "table"), "ata": ("k_max", 4)}[method]
    in_process(argv + [f"--{flag}", value])
    assert all(json.load(open(d / "run.json"))["method"][flag] == value for d in (tmp_path / "pretrain", tmp_path))


def test_help_lists_every_flag():
    """--help: the run's flags and meanpool's (the default method); --method pic --help: pic's, with field comments."""
    p = run(["--help"])
    for flag in ("--method", "--ratio", "--init_from", "--resume", "--compile", "--no_linear", "--ratio_sampling"):
        assert flag in p.stdout
    p = run(["--method", "pic", "--help"])
    assert "--mem_pos" in p.stdout and "--no_linear" not in p.stdout and "blockwise" in p.stdout


def test_lr_schedules():
    cfg = train.TrainConfig(lr=1.0, max_iters=100, warmup_frac=0.1, min_lr_frac=0.1)
    assert train.lr_at(0, cfg) == pytest.approx(0.1) and train.lr_at(9, cfg) == pytest.approx(1.0)
    assert train.lr_at(100, cfg) == pytest.approx(0.1)  # cosine ends at lr * min_lr_frac
    assert train.lr_at(55, cfg) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: the mean
    assert train.lr_at(55, cfg, "linear") == pytest.approx(0.1 + 0.9 * 0.5)  # linear: to lr * min_lr_frac too
    assert train.lr_at(100, cfg, "linear") == pytest.approx(0.1) and train.lr_at(77, cfg, "linear") > train.lr_at(77, cfg)
    assert train.lr_at(100, train.TrainConfig(lr=1.0, max_iters=100, min_lr_frac=0.0), "linear") == 0.0


def test_new_inputs_start_at_the_scale_the_model_reads(tmp_path):
    """Gemma 2 reads token embeddings times sqrt(d): pic's memory table and ata's
    compression tokens start at that scale, sentence_gist's gist rows are read at it."""
    import ata
    import pic
    import sentence_gist
    import data
    from model import Transformer
    ckpt = hf_checkpoint(tmp_path / "hf", "gemma2")
    tok, base = data.load_tokenizer(ckpt), Transformer.from_pretrained(ckpt)
    fed = base.model.embed_tokens(torch.arange(base.config.vocab_size)).std().item()
    assert base.model.embed_tokens.scale and abs(base.model.embed_tokens.input_std() / fed - 1) < 0.05
    run = train.TrainConfig(objective="qa", ratio="4", max_context=128)
    m = pic.PIC(base, pic.PICConfig(), tok, run)
    assert 0.8 < m.mem_embed.std().item() / fed < 1.2
    a = ata.ATA(Transformer.from_pretrained(ckpt), ata.ATAConfig(lora_r=4), tok, run)
    assert 0.7 < a.comp.std().item() / fed < 1.3
    g = sentence_gist.SentenceGist(Transformer.from_pretrained(ckpt), sentence_gist.SentenceGistConfig(gists=2), tok, run)
    rows = g.embed(torch.tensor([[g.V, g.V + 1]]))[0]
    assert torch.allclose(rows, g.gist * base.model.embed_tokens.scale)


def test_prompt_format_follows_the_checkpoints_chat_template(tmp_path):
    """--prompt auto (default): an instruct checkpoint's chat_template picks its format
    (ChatML here); --prompt plain overrides; a bad value is one line (issue 21.4)."""
    import data
    ckpt = hf_checkpoint(tmp_path / "hf", "llama", chat=True)
    squad = squad_file(tmp_path / "squad.json")
    tok = data.load_tokenizer(ckpt)
    start, user = tok.special("<|im_start|>"), tok.encode("user\n", start=False)
    for prompt, prefix in (("auto", [tok.bos_id, start] + user), ("plain", [tok.bos_id])):
        cfg = train.TrainConfig(method="teacher", init_from=ckpt, data=squad, prompt=prompt, batch_size=2)
        batch = train.Batches(cfg, tok, object())(0)[0]
        assert batch["prefix"] == prefix and batch["full"][0, :len(prefix)].tolist() == prefix
    in_process(["--method", "teacher", "--init_from", ckpt, "--data", squad, "--max_iters", 1, "--batch_size", 2,
                "--out_dir", tmp_path / "t", "--device", "cpu", "--quiet"])
    assert json.load(open(tmp_path / "t" / "run.json"))["train"]["prompt"] == "auto"
    p = run(["--method", "teacher", "--init_from", ckpt, "--prompt", "vicuna"], check=False)
    assert p.returncode != 0 and "--prompt 'vicuna'" in p.stderr and "Traceback" not in p.stderr


CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN3_TEMPLATE = (  # the parts of Qwen3's chat template a one-turn QA renders
    "{%- for m in messages %}{%- if m.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


@pytest.mark.parametrize("template", ["chatml", "qwen3"])
def test_chat_prompts_are_what_the_checkpoints_template_renders(tmp_path, template):
    """--prompt auto's question and answer, as transformers' apply_chat_template renders them (a BOS before, the
    newline after the turn end aside); Qwen3's, with its template's empty think block (an answer without thinking:
    a prompt ending at "assistant\\n" asks Qwen3 to think first)."""
    import transformers
    import data
    ckpt = Path(hf_checkpoint(tmp_path / "hf", "llama", chat=True))
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": QWEN3_TEMPLATE if template == "qwen3" else CHATML_TEMPLATE}))
    tok, hf = data.load_tokenizer(ckpt), transformers.AutoTokenizer.from_pretrained(ckpt)
    context, question, answer = "Ada Lovelace was born in London.", "Where was Ada born?", "London"
    ex = data.format_qa(tok, context, question, answer, format="auto")
    user = [{"role": "user", "content": context + data.QA_TEMPLATES[0].format(question=question)}]
    ours = tok.decode(ex["prefix"][len(ex["bos"]):] + ex["context"] + ex["prompt"])
    assert ours == hf.apply_chat_template(user, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    whole = hf.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=False)
    assert ours + tok.decode(ex["answer"]) + "\n" == whole, (ours, whole)


def test_a_run_says_its_prompt_format_and_a_template_it_does_not_know(tmp_path, capsys):
    """The start line names the format --prompt auto picked; a chat template of none of the known formats (Mistral's
    [INST] here) is a note, as it trains on plain prompts (it did so in silence)."""
    ckpt = Path(hf_checkpoint(tmp_path / "hf", "llama"))
    squad = squad_file(tmp_path / "squad.json")
    flags = ["--method", "teacher", "--init_from", ckpt, "--data", squad, "--max_iters", 1, "--batch_size", 2,
             "--device", "cpu", "--quiet"]
    in_process(flags + ["--out_dir", tmp_path / "a"])
    out = capsys.readouterr()
    assert ", plain prompts -> " in out.out and "chat template" not in out.err
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% for m in messages %}[INST] "
                                                            "{{ m.content }} [/INST]{% endfor %}"}))
    in_process(flags + ["--out_dir", tmp_path / "b"])
    assert f"note: the chat template of {ckpt} is none of llama3, chatml, gemma: --prompt auto reads plain prompts" \
        in capsys.readouterr().err


def test_an_answer_end_the_checkpoint_never_learnt_to_write_is_a_note(tmp_path, capsys):
    """A base model's chat tokens can be untrained rows (Llama 3's <|eot_id|>): a frozen head never writes the turn
    end that chat answers stop at. A near-zero output row of the answer end is a note naming --prompt plain."""
    from safetensors.torch import load_file, save_file
    ckpt = Path(hf_checkpoint(tmp_path / "hf", "llama", chat=True))
    flags = ["--method", "teacher", "--init_from", ckpt, "--data", squad_file(tmp_path / "squad.json"), "--max_iters",
             1, "--batch_size", 2, "--device", "cpu", "--quiet"]
    in_process(flags + ["--out_dir", tmp_path / "a"])
    assert "output row near zero" not in capsys.readouterr().err
    weights = load_file(ckpt / "model.safetensors")
    end = json.loads((ckpt / "tokenizer.json").read_text())["added_tokens"]
    end = next(t["id"] for t in end if t["content"] == "<|im_end|>")
    weights["lm_head.weight"][end] *= 1e-3
    save_file(weights, ckpt / "model.safetensors", metadata={"format": "pt"})
    in_process(flags + ["--out_dir", tmp_path / "b"])
    assert f"note: <|im_end|>, which ends answers in chatml prompts, has an output row near zero in {ckpt}" in \
        capsys.readouterr().err


def test_train_does_not_import_eval():
    """No import cycle: eval.py reads runs through train.py; train.py's __main__ hands over to eval.py."""
    out = subprocess.run([sys.executable, "-c", "import sys, train; print('eval' in sys.modules)"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_tiny_base_trains_on_user_qa_records(tmp_path):
    """The shipped tiny base with --data: aid 3 (extra QA pairs per context) needs synthetic items,
    so QA records train with one question each (was a KeyError 'qas' for meanpool, pic, sac)."""
    squad = squad_file(tmp_path / "squad.json")
    for method in ("meanpool", "pic", "sac"):
        in_process(["--method", method, "--data", squad, "--max_iters", 1,
                    "--batch_size", 2, "--out_dir", tmp_path / method, "--eval_examples", 0, "--quiet"])
        assert len(open(tmp_path / method / "log.jsonl").readlines()) == 1, method


def test_a_run_of_an_older_version_is_one_line(tmp_path):
    """run.json keys that are no config field (ata's prefix, now --no_prefix): one line naming them, no TypeError."""
    (tmp_path / "run.json").write_text(json.dumps({"train": {"method": "ata"}, "method": {"prefix": False}}))
    with pytest.raises(SystemExit, match=r"run.json: method keys \['prefix'\] are not ATAConfig fields"):
        train.load_run(str(tmp_path))


def readme_commands(script):
    """README's command lines that run `script` (backslash continuations joined, comments cut), as argv lists."""
    import shlex
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    lines = [shlex.split(line.split("  #")[0]) for line in text.splitlines()
             if line.startswith(("python ", "torchrun ")) and f" {script} " in f" {line} "]
    return [words[words.index(script) + 1:] for words in lines]


def test_readme_commands_parse_and_resolve(base_dir, tmp_path):
    """Each `python train.py` / `torchrun ... train.py` and `python eval.py` line of README.md parses and resolves
    into stages that pass check_stage, its paths swapped for test files: a renamed flag fails here, not for a
    reader. (/ckpt/... -> a tiny checkpoint, *.json -> a QA file, out/... -> tmp_path.)"""
    squad = squad_file(tmp_path / "squad.json")
    swap = lambda w: (str(base_dir) if w.startswith("/ckpt/") else squad if w.endswith(".json")  # noqa: E731
                      else str(tmp_path / w) if w.startswith("out/") or w.endswith((".txt", ".mem")) else w)
    train_lines, eval_lines = readme_commands("train.py"), readme_commands("eval.py")
    assert len(train_lines) >= 8 and len(eval_lines) >= 4, (train_lines, eval_lines)
    for argv in train_lines:
        cfg, mcfg, explicit, cls = train.configure([swap(w) for w in argv])
        for c, m, _ in train.resolve(cfg, mcfg, explicit, cls):
            train.check_stage(c, m, cls)
    import eval as evaluate
    for argv in eval_lines:
        (ecfg,), given = train.parse_args([swap(w) for w in argv], evaluate.EvalConfig, positional="runs")
        evaluate.check_flags(ecfg, given)


def test_dtype_flag_sets_autocast_and_a_real_bases_weights(base_dir):
    """--dtype float32 on CUDA keeps a real checkpoint's weights fp32 (they were bf16 whatever the flag said); by
    default, bf16 there; the tiny base and CPU runs keep fp32 weights."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    real = dict(init_from=str(base_dir), method="meanpool")  # (a copy of the tiny base outside tiny_base/: real)
    bf16, fp32 = torch.bfloat16, torch.float32
    cases = [(dict(real), cuda, ("bfloat16", bf16)), (dict(real, dtype="float32"), cuda, ("float32", fp32)),
             (dict(real), cpu, ("float32", fp32)), (dict(real, dtype="bfloat16"), cpu, ("bfloat16", fp32)),
             (dict(method="meanpool"), cuda, ("bfloat16", fp32)), (dict(method="base"), cuda, ("bfloat16", fp32))]
    for kw, device, expected in cases:
        assert train.run_dtypes(train.TrainConfig(**kw), device) == expected, (kw, device)


def test_class_lines_are_what_inspect_finds():
    """make_parser reads each config's field comments from train.class_lines, a scan that skips inspect.getsource's
    parse of the whole module: the same lines (but its decorators and trailing blank lines) for every config class
    a command reads."""
    import dataclasses
    import inspect
    import eval as evaluate

    @dataclasses.dataclass
    class Nested:  # (in a function, as a fork's test may define one: inspect's lines)
        window: str = "last"

    def from_class(lines):
        lines = [line.rstrip("\n") for line in lines]
        while not lines[-1].strip():
            lines.pop()
        return lines[[line.lstrip().startswith("class ") for line in lines].index(True):]

    classes = [train.TrainConfig, evaluate.EvalConfig, Nested] + [c.Config for c in train.method_registry().values()]
    for c in classes:
        assert from_class(train.class_lines(c)) == from_class(inspect.getsource(c).splitlines()), c


def test_a_config_subclassing_another_keeps_its_fields_help():
    """A fork's method may subclass another's config (README: Add a method): the inherited flags keep their help."""
    import dataclasses
    import meanpool

    @dataclasses.dataclass
    class Variant(meanpool.MeanPoolConfig):
        window: str = "last"  # which token of a window stands for it

    help_text = train.make_parser([Variant]).format_help()
    assert "which token of a window stands for it" in help_text
    assert "Table 3 ablation: no projection W" in help_text  # meanpool's --no_linear, inherited


@pytest.mark.slow
@pytest.mark.parametrize("method", [n for n, c in train.method_registry().items() if hasattr(c, "compress")])
def test_every_registered_method_trains_and_is_read_on_its_papers_recipe(tmp_path, method):
    """Every compressor in method_registry(), a fork's new one too (README: Add a method), with its defaults on a
    real HF checkpoint: its paper's stages for 2 steps, then eval.py's rows."""
    rows = json.loads((method_smoke(tmp_path, method) / "metrics.json").read_text())["rows"]
    assert rows and all(0 <= row["f1"] <= 100 and row["ratio"] > 0 for row in rows)


def test_a_switch_turns_off_a_recipes_true(base_dir, tmp_path):
    """ata's recipe keeps HotpotQA's distractors (hotpot_distractors True): `--hotpot_distractors false` wins, as any
    flag; a bare switch is true, a value other than true / false one line."""
    (tmp_path / "hotpot.json").write_text("[]")  # (resolve reads no record; a HotpotQA file is a JSON list)
    argv = ["--method", "ata", "--init_from", base_dir, "--data", str(tmp_path / "hotpot.json"), "--out_dir", "/o"]
    for extra, want in (([], True), (["--hotpot_distractors"], True), (["--hotpot_distractors", "false"], False),
                        (["--hotpot_distractors=0", "--compile"], False)):
        cfg, mcfg, explicit, cls = train.configure(argv + extra)
        assert all(c.hotpot_distractors is want for c, _, _ in train.resolve(cfg, mcfg, explicit, cls)), extra
    with pytest.raises(SystemExit, match=r"argument --compile: invalid true / false value: 'x'"):
        train.configure(["--compile", "x"])


def test_a_steps_metrics_are_the_target_weighted_mean_of_its_micro_batches():
    """--grad_accum 2: the logged per-ratio loss is the step's (3 x 1 + 7 x 3) / 4, not its last micro-batch's 7."""
    w = torch.nn.Parameter(torch.ones(1))

    class Fake(torch.nn.Module):
        def forward(self, mb, ratios):  # (loss summed over n targets, n, metrics)
            return w.sum() * mb["n"], mb["n"], {"loss_r4": mb["value"]}

    opt = train.AdamW([{"params": [w], "weight_decay": 0.0}], lr=0.0, betas=(0.9, 0.95))
    micro = [{"n": 1, "value": 3.0}, {"n": 3, "value": 7.0}]
    loss, metrics, _, _ = train.train_step(Fake(), micro, [w], opt, [4], torch.device("cpu"), nullcontext(),
                                           False, 1, train.TrainConfig())
    assert loss == 1.0 and metrics == {"loss_r4": 6.0}
