"""Shared fixtures for the method tests: tiny checkpoints, data files and subprocess runs.

- ``tiny_base(dir)``: a random tiny Llama in our default layout (HF config.json +
  model.safetensors + the default sentencepiece tokenizer.model), standing in for out/base.
- ``hf_checkpoint(dir, family)``: a tiny random Llama / Qwen3 / Gemma 2 saved by ``transformers``,
  with a byte-level BPE ``tokenizer.json`` trained here (no download).
- ``squad_file(path)``: a small SQuAD v1.1 file.
- ``run(args)`` / ``torchrun(args)``: train.py / eval.py in a subprocess; raise on failure.
- ``load_script(name, folder)``: scripts/<name>.py (or benchmarks/) as a module.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import data  # noqa: E402
import tiny  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

_TOKENIZER_CACHE = {}


def load_script(name, folder="scripts"):
    """<folder>/<name>.py as a module (scripts/ and benchmarks/ are not packages)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def default_tokenizer(dir):
    """The default sentencepiece tokenizer, trained once per test session (small corpus)."""
    key = "spm"
    if key not in _TOKENIZER_CACHE:
        path = Path(dir) / "tokenizer.model"
        tiny.train_default_tokenizer(path, seed=0, vocab_size=512, n_chars=60_000)
        _TOKENIZER_CACHE[key] = path.read_bytes()
    Path(dir).mkdir(parents=True, exist_ok=True)
    (Path(dir) / "tokenizer.model").write_bytes(_TOKENIZER_CACHE[key])
    return data.load_tokenizer(Path(dir) / "tokenizer.model")


def tiny_base(dir, d=64, layers=2, heads=4, kv_heads=2, seed=0):
    """A random tiny base in the layout `--method base` writes (usable as --init_from)."""
    tok = default_tokenizer(dir)
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tok.vocab_size, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, tie_word_embeddings=True,
                      bos_token_id=tok.bos_id, eos_token_id=list(tok.eos_ids))
    model = Transformer(cfg)
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.05)
    model.save_pretrained(str(dir))
    return str(dir)


SQUAD_TEXTS = [
    ("The Eiffel Tower is in Paris. It was built in 1889 for the World's Fair.", "Where is the Eiffel Tower?", "Paris", 24),
    ("Marie Curie was a physicist. She won two Nobel Prizes, in physics and chemistry.", "What did Marie Curie win?",
     "two Nobel Prizes", 37),
    ("The Nile flows north through Egypt. It is among the longest rivers on Earth.", "Through which country does the Nile flow?",
     "Egypt", 29),
    ("Bees make honey from nectar. A colony can hold fifty thousand bees.", "What do bees make honey from?", "nectar", 21),
]


def squad_file(path):
    """A small SQuAD v1.1-format file (answer_start checked)."""
    paragraphs = []
    for i, (ctx, q, a, start) in enumerate(SQUAD_TEXTS):
        start = ctx.index(a)
        paragraphs.append({"context": ctx, "qas": [{"id": f"q{i}", "question": q,
                                                     "answers": [{"text": a, "answer_start": start}]}]})
    Path(path).write_text(json.dumps({"version": "1.1", "data": [{"title": "t", "paragraphs": paragraphs}]}))
    return str(path)


def hf_checkpoint(dir, family="llama", chat=False):
    """A tiny random HF checkpoint saved by transformers, plus a tokenizer.json trained here
    (chat: an instruct checkpoint, ChatML specials and chat_template)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"] + ["<|im_start|>", "<|im_end|>"] * chat
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [t for ctx, q, a, _ in SQUAD_TEXTS for t in (ctx, q, a)] * 20 + \
        [tiny.synthetic_corpus(0, 20_000)]
    tk.train_from_iterator(corpus, trainer)
    tk.save(str(dir / "tokenizer.json"))
    ids = {s: tk.token_to_id(s) for s in specials}
    template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    (dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": specials[0], "eos_token": specials[1],
                                                            "pad_token": specials[2]} | ({"chat_template": template} if chat else {})))
    common = dict(vocab_size=tk.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, bos_token_id=ids[specials[0]],
                  eos_token_id=ids[specials[1]], max_position_embeddings=2048)
    torch.manual_seed(0)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **common))
    elif family == "gemma2":  # soft-capping, a window shorter than the contexts, head_dim != 64 / 4
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            head_dim=24, query_pre_attn_scalar=24, sliding_window=32, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, pad_token_id=ids[specials[2]], **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, **common))
    model.save_pretrained(str(dir))
    return str(dir)


def run(args, script="train.py", env=None, check=True):
    """python <script> args in a subprocess at the repo root; returns the CompletedProcess."""
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    p = subprocess.run([sys.executable, str(ROOT / script)] + [str(a) for a in args], cwd=ROOT,
                       capture_output=True, text=True, env=e)
    if check and p.returncode != 0:
        raise AssertionError(f"{script} {' '.join(map(str, args))} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def cli_error(argv):
    """train.main(argv) in process must exit with a one-line "error: ..." message; returns it (test_train.py
    checks such errors once in a real process, as a user sees them)."""
    import pytest
    import train
    with pytest.raises(SystemExit) as e:
        train.main([str(a) for a in argv])
    err = str(e.value.code)
    assert err.startswith("error:") and "\n" not in err, err
    return err


def torchrun(args, nproc=2, check=True):
    """train.py under torchrun with the gloo backend on CPU."""
    e = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
           str(ROOT / "train.py")] + [str(a) for a in args]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=e)
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


# DDP vs one process: the CPU sums a batch of 1 and of 2 in different orders, and Adam turns
# near-zero gradient differences into steps of up to ~lr (measured: up to 2.5e-4 after 3
# steps at lr 1e-2 on a 2-core Xeon). A real fault (no all-reduce, wrong shard) moves
# parameters by ~lr = 1e-2.
DDP_ATOL = 1e-3


def read_params(run_dir):
    """The trainable tensors of a run dir's latest checkpoint."""
    from safetensors.torch import load_file
    files = json.loads((Path(run_dir) / "run.json").read_text())["files"]
    return load_file(str(Path(run_dir) / files["ckpt"]))


def method_smoke(tmp, method, extra=(), family="llama"):
    """The "as for every method" checks: 2 training steps on a real HF checkpoint and a
    SQuAD file, then eval.py on it. Returns the run dir."""
    ckpt = hf_checkpoint(tmp / "hf", family)
    squad = squad_file(tmp / "squad.json")
    out = tmp / f"run-{method}"
    run(["--method", method, "--init_from", ckpt, "--data", squad, "--eval_data", squad, "--max_iters", 2,
         "--batch_size", 2, "--out_dir", out, "--eval_examples", 4, "--device", "cpu", "--quiet", *extra])
    assert (out / "metrics.json").exists()
    return out
