"""scripts/hf_generate.py (issue 80): a Memory answered by transformers' `generate` gives our greedy
tokens, for every method that bridges (embeddings: meanpool, pic, the token baseline; K/V: sac, ata),
on Llama and Qwen3 checkpoints, two prompts of different lengths; first-token logits within 1e-4.
sentence_gist, whose answering rule changes the cache while decoding, and a Memory that does not fit
get one line each."""
import itertools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data
import eval as evaluate
import train
from common import ROOT, SQUAD_TEXTS, hf_checkpoint, load_script, run, squad_file
from model import Memory

hf_generate = load_script("hf_generate")
METHODS = [("meanpool", dict(), "4"), ("pic", dict(), "4"), ("pic", dict(mem="single", mask="bidir"), "4"),
           ("sac", dict(), "5"), ("ata", dict(lora_dropout=0.0), "10")]
METHODS += [(name, dict(), "4") for name, cls in train.method_registry().items()  # a method added later
            if hasattr(cls, "compress") and name not in {m[0] for m in METHODS} | {"sentence_gist"}]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def ckpt(request, tmp_path_factory):
    """qwen3: its generation_config.json samples with a repetition penalty, as Qwen2.5-Instruct's (1.05) does: greedy
    answers ignore both (transformers' generate applied the penalty, and its answers left ours)."""
    path = hf_checkpoint(tmp_path_factory.mktemp(request.param) / "hf", request.param)
    if request.param == "qwen3":
        gen = Path(path) / "generation_config.json"
        gen.write_text(json.dumps({**json.loads(gen.read_text()), "do_sample": True, "temperature": 0.7, "top_k": 20,
                                   "repetition_penalty": 1.3}))
    return path


def batch_of_two(tok, method, cfg):
    recs = [dict(id=str(i), context=c, question=q, answers=[a]) for i, (c, q, a, _) in enumerate(SQUAD_TEXTS[:2])]
    recs[1]["question"] += " Answer in a few words, please."  # prompts of different lengths
    b = data.collate_qa(recs, tok, pad_multiple=1, format=cfg.prompt)
    return method.prepare(b) if hasattr(method, "prepare") else b


@pytest.mark.parametrize("name, mkw, ratio", METHODS, ids=[m[0] + ("-tokens" if m[1].get("mem") else "") for m in METHODS])
def test_transformers_generate_from_the_bridged_memory_gives_our_tokens(ckpt, name, mkw, ratio):
    cfg = train.TrainConfig(method=name, init_from=ckpt, ratio=ratio, objective="kd" if mkw.get("mem") else "qa")
    mcfg = train.method_registry()[name].Config(lora_r=4, **mkw)
    torch.manual_seed(0)
    tok, base, method = train.build(cfg, mcfg, "cpu", torch.float32)
    for n, p in method.named_parameters():  # trained-looking adapters, so merging them matters
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    method.eval()
    b = batch_of_two(tok, method, cfg)
    prompts = [b["qa"][i, :b["prompt_len"][i]].tolist() for i in range(2)]
    assert len(set(map(len, prompts))) == 2
    with torch.no_grad():
        memory = method.compress(b, int(ratio))
        ours = evaluate.answer_from_memory(method, memory, prompts, 8, data.stop_ids(tok, cfg.prompt))
        decoder = getattr(method, "dec", method.base)
        with decoder.adapter(method.dec_adapter):  # our first answer token's logits, as generate starts
            T = max(map(len, prompts))
            ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
            valid = ids.new_tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts]).bool()
            pos = (valid.long().cumsum(1) - 1).clamp(min=0) + memory.next_pos[:, None]
            first = decoder(ids, pos=pos, memory=memory, valid=valid)[:, -1]
    hf = hf_generate.hf_decoder(method, cfg)
    theirs, logits = hf_generate.hf_answer(hf, memory, prompts, 8, data.stop_ids(tok, cfg.prompt))
    assert theirs == ours
    torch.testing.assert_close(logits, first, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_sentence_gist_and_a_memory_that_does_not_fit_are_one_line(tmp_path):
    ckpt, squad = hf_checkpoint(tmp_path / "hf"), squad_file(tmp_path / "squad.json")
    common = ["--init_from", ckpt, "--data", squad, "--max_iters", 1, "--batch_size", 2, "--eval_examples", 0,
              "--quiet", "--lora_r", 4, "--device", "cpu"]
    for name, flags in (("gist", ["--method", "sentence_gist", "--stage", 2]), ("mp", ["--method", "meanpool"]),
                        ("sac", ["--method", "sac", "--pretrain", 0])):
        train.main([str(a) for a in [*flags, "--out_dir", tmp_path / name, *common]])
    (tmp_path / "doc.txt").write_text(SQUAD_TEXTS[0][0])
    for name in ("gist", "sac"):
        evaluate.main([str(a) for a in [tmp_path / name, "--context", tmp_path / "doc.txt", "--question", "Where?",
                                        "--save_memory", tmp_path / f"{name}.mem"]])
    (tmp_path / "doc2.txt").write_text(SQUAD_TEXTS[0][0] + "\n\n")  # an editor's last newlines: the same memory
    evaluate.main([str(a) for a in [tmp_path / "sac", "--context", tmp_path / "doc2.txt", "--question", "Where?",
                                    "--save_memory", tmp_path / "sac2.mem"]])
    assert all(torch.equal(a, b) for a, b in zip(*(itertools.chain(*Memory.load(str(tmp_path / f)).kv)
                                                   for f in ("sac.mem", "sac2.mem"))))
    question = "Which city was Ada Lovelace born in?"  # README's
    p = run([tmp_path / "sac", "--memory", tmp_path / "sac.mem", "--question", question], script="scripts/hf_generate.py")
    assert p.stdout.startswith("answer:")
    snippet = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)[1]  # README's Python use,
    snippet = snippet.replace("out/pic", str(tmp_path / "sac")).replace("out/doc.mem", str(tmp_path / "sac.mem"))
    (tmp_path / "api.py").write_text(snippet)  # as a file of its own, run from the repo's root
    api = subprocess.run([sys.executable, tmp_path / "api.py"], cwd=ROOT, capture_output=True, text=True)
    assert api.returncode == 0 and question in snippet and f"answer: {api.stdout}" == p.stdout, api.stderr[-2000:]
    other = Memory.load(str(tmp_path / "sac.mem"))
    other.kv = [(k[:, :1], v[:, :1]) for k, v in other.kv]  # another model's: 1 K/V head, not 2
    other.save(str(tmp_path / "other.mem"))
    bare = Memory.load(str(tmp_path / "sac.mem"))
    bare.origin = None  # saved without its run: the tensors' kind is what tells
    bare.save(str(tmp_path / "bare.mem"))
    for run_dir, mem, message in (("gist", "gist.mem", "answers under its own rule"),
                                  ("mp", "sac.mem", "was saved by a --method sac run"),
                                  ("mp", "bare.mem", "it holds K/V; this run's method answers from embeddings"),
                                  ("sac", "other.mem", "its K/V is")):
        with pytest.raises(SystemExit, match=message):
            hf_generate.main([str(tmp_path / run_dir), "--memory", str(tmp_path / mem), "--question", "Where?"])
    p = run([tmp_path / "mp", "--memory", tmp_path / "sac.mem", "--question", "Where?"], script="scripts/hf_generate.py",
            check=False)
    assert p.returncode != 0 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr  # the script: one line
    with pytest.raises(SystemExit, match=r"--question is \d+ tokens: with --max_new_tokens 32, more than half"):
        hf_generate.main([str(tmp_path / "sac"), "--memory", str(tmp_path / "sac.mem"), "--question", "where " * 3000])
