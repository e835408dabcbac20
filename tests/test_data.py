"""Tests for data.py: tokenizers token-exact against HF tokenizers / sentencepiece and the
real Llama 2 / Llama 3 / Qwen files, readers on fixtures and the real QA files, the
synthetic benchmark, and batching."""
import gzip
import json
import random
import re
import zipfile
import zlib
from collections import Counter

import pytest
import torch

import data
import tiny
import train

from conftest import ASSETS, ROOT


def need(path):
    if not path.exists():
        pytest.skip(f"asset {path} not present")
    return path


# -----------------------------------------------------------------------------
# texts that stress a tokenizer

FRAGMENTS = [
    "Hello world", " Hello World!", "Hello, world!", "I've been 'told he's there, 'RE you sure?",
    "we'Ve a'lL", "don't", "It'S", "ied 4 ½ months", "Äpfel", "naïve café", "e\u0301te\u0301",
    "нещо на Български", "我想在apple工作1314151天～", "កាន់តែពិសេសអាច😁", "🦙.cpp", "😶\u200d🌫️",
    "🚀 (normal)", "✅ 🦙🦙", "3 33 333 3333 33333 333333", "3.3 3..3 3...3", "2024-03-14", "1,234,567.89",
    "------=======", "''''''```````\"\"\"\"......!!!!!!??????", "def f(x):\n    return x**2  # square",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}", "<div class=\"a\">text</div>", "SELECT * FROM t;",
    "   leading spaces", "trailing spaces   ", "\n\n\nnewlines\n\n", "\t\ttabs\t", " \n \n\n \t \t\t \t\n  \n",
    "Ελληνικά κείμενα", "עברית", "العربية", "हिन्दी", "日本語のテキスト", "한국어 텍스트", "ÀÉÎÕÜ àéîõü ß",
    "x\u00a0y", "\u3000full width\u3000", "a\r\nb\rc", "MiXeD CaSe WoRdS", "snake_case_name", "camelCaseName",
    "https://example.com/path?q=1&r=2", "user@example.org", "$100 and 50% off", "(parentheses) [brackets]",
]


def varied_texts(n=300, seed=0):
    rng = random.Random(seed)
    seps = [" ", "  ", "\n", "\n\n", "\t", "", " \n ", "   "]
    texts = list(FRAGMENTS)
    while len(texts) < n:
        k = rng.randint(1, 6)
        texts.append("".join(rng.choice(FRAGMENTS) + rng.choice(seps) for _ in range(k)))
    return texts


@pytest.fixture(scope="module")
def texts():
    return varied_texts()


# -----------------------------------------------------------------------------
# byte-level BPE tokenizer.json trained with HF tokenizers, loaded into tiktoken

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def train_hf_bpe(pattern, specials_first, nfc, vocab_size=600):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS if specials_first else [], show_progress=False)
    corpus = varied_texts(400, seed=1) + tiny.synthetic_corpus(0, 30_000).split("\n")
    tok.train_from_iterator(corpus, trainer)
    if not specials_first:
        tok.add_special_tokens(SPECIALS)
    tok.add_tokens(["<tool_call>"])  # a non-special added token: HF matches it in any text
    return tok


@pytest.fixture(scope="module", params=["llama3", "qwen2", "letters"])
def hf_pair(request, tmp_path_factory):
    """letters: a Split regex that leaves text between its matches, which HF keeps as pieces (tiktoken's findall
    dropped every space and comma)."""
    llama = request.param != "qwen2"
    pattern = {"llama3": data.LLAMA3_PATTERN, "qwen2": data.QWEN2_PATTERN, "letters": "[A-Za-z]+"}[request.param]
    hf = train_hf_bpe(pattern, specials_first=llama, nfc=not llama)
    d = tmp_path_factory.mktemp(request.param)
    hf.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [hf.token_to_id("<|end_of_text|>"),
                                                                           hf.token_to_id("<|eot_id|>")]}))
    return hf, data.load_tokenizer(d)


def test_bpe_json_matches_hf(hf_pair, texts):
    hf, tok = hf_pair
    assert tok.kind == "tiktoken"
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    for t in texts + ["<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi <tool_call> a<|eot_id|>b"]:
        ids = tok.encode(t, allow_special=True)
        assert ids == hf.encode(t, add_special_tokens=False).ids, repr(t)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids, skip_special=True) == hf.decode(ids, skip_special_tokens=True), repr(t)
        if t == t.encode("utf-8").decode("utf-8") and hf.normalizer is None:
            assert tok.decode(ids) == t


def test_bpe_json_specials(hf_pair):
    hf, tok = hf_pair
    for s in SPECIALS:
        assert tok.special(s) == hf.token_to_id(s)
    assert tok.bos_id == hf.token_to_id("<|begin_of_text|>")
    assert tok.eos_ids == [hf.token_to_id("<|end_of_text|>"), hf.token_to_id("<|eot_id|>")]
    assert data.chat_format(tok) is None  # a tokenizer_config.json without chat_template: a base model
    tok.chat_template = None  # no config read: the special tokens decide
    assert data.chat_format(tok) == "llama3"
    text = "Hi<|eot_id|>there<tool_call>x"
    allowed = tok.encode(text, allow_special=True)
    assert allowed == hf.encode(text, add_special_tokens=False).ids
    assert tok.special("<|eot_id|>") in allowed
    plain = tok.encode(text)  # special strings are ordinary text unless allowed ...
    assert tok.special("<|eot_id|>") not in plain and tok.decode(plain) == text
    assert tok.special("<tool_call>") in plain  # ... non-special added tokens always match, as in HF
    assert tok.encode("a", bos=True, eos=True) == [tok.bos_id] + tok.encode("a") + [tok.eos_ids[0]]
    with pytest.raises(ValueError, match="no special token"):
        tok.special("<|im_start|>")
    assert not tok.has_special("<|im_start|>")
    texts = tok.token_texts()
    assert len(texts) == tok.vocab_size and texts[tok.special("<|eot_id|>")] == "<|eot_id|>"


def test_config_ids_that_are_no_token_ids_are_one_line(hf_pair, tmp_path):
    """config.json's bos_token_id (read without a tokenizer_config.json) that is no token id: a line naming the file
    and key (a bos of -1 failed in the first step's embedding, with a traceback; one past the vocabulary is
    train.load_base's line, with the eos ids')."""
    hf, tok = hf_pair
    hf.save(str(tmp_path / "tokenizer.json"))
    for doc, key in (({"bos_token_id": -1}, "bos_token_id"), ({"bos_token_id": "1"}, "bos_token_id"),
                     ({"eos_token_id": [1, -2]}, "eos_token_id")):
        (tmp_path / "config.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=rf"config\.json: key '{key}' is"):
            data.load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": None, "eos_token_id": [tok.vocab_size - 1]}))
    assert data.load_tokenizer(tmp_path).eos_ids == [tok.vocab_size - 1]


@pytest.mark.parametrize("post, config", [
    ("bos $A", {}),                                    # Llama 3: its template writes BOS
    ("$A", {}),                                        # SmolLM2: none, though its config names a bos_token
    ("bytelevel", {}),                                 # a ByteLevel post-processor writes no token
    ("$A", {"add_bos_token": True}),                   # the config's add_bos_token wins where it is given
    ("bos $A", {"add_bos_token": False}),
])
def test_bos_is_what_hf_writes_before_a_text(hf_pair, tmp_path, post, config):
    """encode(bos=True) gives HF's add_special_tokens=True ids: a tokenizer.json's post_processor says whether a BOS
    leads (and a prompt starts with it), unless tokenizer_config.json's add_bos_token says otherwise."""
    from tokenizers import Tokenizer, processors
    hf = Tokenizer.from_str(hf_pair[0].to_str())
    if post == "bytelevel":
        hf.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        single = post.replace("bos", "<|begin_of_text|>")
        bos = ("<|begin_of_text|>", hf.token_to_id("<|begin_of_text|>"))
        hf.post_processor = processors.TemplateProcessing(single=single, pair=f"{single} $B:1", special_tokens=[bos])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|begin_of_text|>",
                                                                "eos_token": "<|end_of_text|>", **config}))
    tok = data.load_tokenizer(tmp_path)
    want_bos = config.get("add_bos_token", post.startswith("bos"))
    for text in FRAGMENTS[:8]:
        want = hf.encode(text).ids
        if config:  # transformers adds (or drops) the BOS by add_bos_token, over the post_processor
            bos_id = hf.token_to_id("<|begin_of_text|>")
            want = [bos_id] * want_bos + [i for i in want if i != bos_id]
        assert tok.encode(text, bos=True) == want, (text, post, config)
    assert data.format_qa(tok, "ctx", "q", "a")["prefix"] == ([tok.special("<|begin_of_text|>")] if want_bos else [])


def test_sentencepiece_matches_spm(tmp_path, texts):
    import sentencepiece as spm
    lines = [t for t in varied_texts(400, seed=2) if t.strip() and "\n" not in t]
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(tmp_path / "sp"), model_type="bpe",
                                   vocab_size=700, byte_fallback=True, num_threads=1, minloglevel=2,
                                   character_coverage=0.99)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    tok = data.load_tokenizer(tmp_path / "sp.model")
    assert tok.kind == "sentencepiece" and tok.vocab_size == sp.get_piece_size()
    assert (tok.bos_id, tok.eos_ids) == (sp.bos_id(), [sp.eos_id()])
    for t in texts:
        assert tok.encode(t) == sp.encode(t), repr(t)
        assert tok.decode(tok.encode(t)) == sp.decode(sp.encode(t))
    # continuation text gets no dummy-prefix space
    assert tok.encode("Question", start=False) != tok.encode("Question")
    assert sp.decode(tok.encode("Hello") + tok.encode(" world", start=False)) == "Hello world"


def test_unsupported_tokenizers(tmp_path):
    from tokenizers import Tokenizer, models
    wp = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match="unsupported tokenizer: found model type 'WordPiece'"):
        data.load_tokenizer(tmp_path)
    (tmp_path / "junk.model").write_bytes(b"\x00\x01garbage")
    with pytest.raises(ValueError, match="junk.model: unsupported tokenizer"):
        data.load_tokenizer(tmp_path / "junk.model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no tokenizer"):
        data.load_tokenizer(tmp_path / "empty")


# -----------------------------------------------------------------------------
# GPT-2-style byte-level BPE: ByteLevel(use_regex) alone (GPT-2), Digits + ByteLevel
# (SmolLM), and vocabularies that lack some single bytes

LACKED = {*range(9), *range(0xC0, 0xD0), 0x9F, 0xA9}  # control bytes, UTF-8 lead bytes of Latin/Greek, ©, é's 2nd
BYTE_PROBES = ["a\x01b\x02\x03c", "\x00\x07\x1f end", "é𝔘ÀÁ ǅ naïve", "Ωmega\x05\x05z", "a  1 22\t3 4.5",
               "x²³ ٣٤ Ⅻ 12ab3", "©2024 — Ünïcödé", "tab\there\r\n\x0bvt"]


def shakespeare(n):
    text = need(ASSETS / "corpora" / "tinyshakespeare_input.txt").read_text(encoding="utf-8")
    return [p for p in text.split("\n\n") if p.strip()][:n]


def train_gpt2_style(kind):
    """kind: gpt2 | digits (Digits(individual) + ByteLevel) | lacking | lacking_unk (a vocab
    without the LACKED bytes; no unk token: HF drops them; with a fused unk token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    unk = kind == "lacking_unk"
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True) if unk else models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = byte_level if kind == "gpt2" else pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level])
    tok.decoder = decoders.ByteLevel()
    corpus = varied_texts(300, seed=1) + tiny.synthetic_corpus(0, 20_000).split("\n")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if kind.startswith("lacking"):
        alphabet = [data.bytes_to_unicode()[b] for b in range(256) if b not in LACKED]
        corpus = [t for t in corpus if not LACKED & set(t.encode())]
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=["<|endoftext|>"] + ["<unk>"] * unk)
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.fixture(scope="module", params=["gpt2", "digits", "lacking", "lacking_unk"])
def gpt2_pair(request, tmp_path_factory):
    hf = train_gpt2_style(request.param)
    d = tmp_path_factory.mktemp(request.param)
    hf.save(str(d / "tokenizer.json"))
    return request.param, hf, data.load_tokenizer(d)


def test_gpt2_style_byte_level_matches_hf(gpt2_pair):
    kind, hf, tok = gpt2_pair
    spec = json.loads(hf.to_str())
    n_bytes = sum(data.bytes_to_unicode()[b] in spec["model"]["vocab"] for b in range(256))
    assert n_bytes == (256 - len(LACKED) if kind.startswith("lacking") else 256)
    texts = shakespeare(300) + varied_texts(100, seed=9) + BYTE_PROBES
    for t in texts:
        ids = tok.encode(t)
        assert ids == hf.encode(t, add_special_tokens=False).ids, repr(t)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False), repr(t)
        if not kind.startswith("lacking"):
            assert tok.decode(ids) == t
    if kind == "lacking":  # dropped, and the neighbours merge as if adjacent
        assert tok.encode("a\u00e9b") == tok.encode("ab") and tok.encode("\x01") == []
    if kind == "lacking_unk":  # é's second byte: one unk; two control bytes in a row: one fused unk
        unk = hf.token_to_id("<unk>")
        assert tok.encode("\x05\x05") == [unk] and unk in tok.encode("né")


def test_unsupported_tokenizer_json_is_one_line(tmp_path):
    """Any tokenizer.json we cannot read exactly is a ValueError naming what was found."""
    cases = {"list": [], "no model": {"decoder": "x"}, "bad sequence": {
        "model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": "x"}},
        "byte_fallback": {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], "byte_fallback": True},
                          "pre_tokenizer": {"type": "ByteLevel"}},
        "prefix space": {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                         "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": True}},
        **{option: {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [], option: value},  # (ignored)
                    "pre_tokenizer": {"type": "ByteLevel"}} for option, value in (
            ("dropout", 0.9), ("end_of_word_suffix", "</w>"), ("continuing_subword_prefix", "##"))},
        "unmade": {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2, "ba": 3}, "merges": ["a b"]},
                   "pre_tokenizer": {"type": "ByteLevel"}}}  # ("ba": HF never makes it, tiktoken did)
    for name, spec in cases.items():
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
        with pytest.raises(ValueError, match="unsupported") as e:
            data.load_tokenizer(tmp_path)
        assert "\n" not in str(e.value), name
    twice = {"model": {"type": "BPE", "vocab": {"a": 0, "<e>": 1}, "merges": []}, "pre_tokenizer": {"type": "ByteLevel"},
             "added_tokens": [{"id": 1, "content": "<e>"}, {"id": 0, "content": "<e>"}]}  # (the last id won)
    (tmp_path / "tokenizer.json").write_text(json.dumps(twice))
    with pytest.raises(ValueError, match="tokenizer.json: added_tokens lists '<e>' more than once"):
        data.load_tokenizer(tmp_path)
    base = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
            "pre_tokenizer": {"type": "ByteLevel"}}
    for change, message in (({"vocab": {"a": 0, "b": 1, "ab": 1}}, "vocab gives id 1 to more than one token"),  # (a
                            ({"merges": ["a"]}, r"merges\[0\] is 'a', expected")):  # panic; "not enough values")
        (tmp_path / "tokenizer.json").write_text(json.dumps(dict(base, model=dict(base["model"], **change))))
        with pytest.raises(ValueError, match=message):
            data.load_tokenizer(tmp_path)
    for lines, message in (([b"YQ== 0", b"YQ== 1"], "tokenizer.model:2: token 'YQ==' is listed twice"),  # (a panic)
                           ([b"YQ== 0", b"Yg== 0"], "its 2 ranks should be 0..1, each once"),
                           ([b"YQ== 0", b"!!!! 1"], "tokenizer.model:2: expected 'base64 rank', got '!!!! 1'"),
                           ([b"YQ== 0", b"Yg== five"], "tokenizer.model:2: expected 'base64 rank'"),
                           ([b"YQ== 0", b"Yg== 1 2"], "tokenizer.model:2: expected 'base64 rank'")):
        (tmp_path / "tokenizer.model").write_bytes(b"\n".join(lines) + b"\n")
        with pytest.raises(ValueError, match=message):
            data.load_tokenizer(tmp_path / "tokenizer.model")


# -----------------------------------------------------------------------------
# the real tokenizer files against llama.cpp's HF-generated test vectors

VOCAB_TESTS = [("llama-spm", "llama2_tokenizer.model"), ("llama-bpe", "llama3_tokenizer.model"),
               ("qwen2", "qwen.tiktoken")]


@pytest.mark.parametrize("name,file", VOCAB_TESTS)
def test_real_tokenizers_match_hf_ids(name, file):
    folder = need(ASSETS / "tokenizers" / "llamacpp_vocab_tests")
    tok = data.load_tokenizer(need(ASSETS / "tokenizers" / file))
    inputs = (folder / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = (folder / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    assert len(inputs) == len(outputs) > 40
    # llama-spm: the ids are HF LlamaTokenizer (legacy) = sentencepiece with its dummy
    # prefix, e.g. " " -> [259] ("▁▁"), "Hello" -> "▁Hello"; qwen2: NFC-normalised text.
    for text, line in zip(inputs, outputs):
        assert tok.encode(text) == [int(x) for x in line.split()], repr(text)
        if name != "llama-spm":
            assert tok.decode(tok.encode(text)) == text
    if name == "llama-bpe":
        assert tok.vocab_size == 128256 and tok.special("<|eot_id|>") == 128009 and tok.bos_id == 128000
        assert data.chat_format(tok) == "llama3"
    if name == "qwen2":
        assert tok.special("<|im_end|>") == 151645 and tok.bos_id is None and data.chat_format(tok) == "chatml"


@pytest.mark.parametrize("name,file", VOCAB_TESTS[1:])
def test_real_vocab_as_tokenizer_json(name, file, tmp_path):
    """The tokenizer.json path at full scale: transformers converts the real ranks file to
    a byte-level BPE tokenizer.json (as HF did for Llama 3 / Qwen2); we load that back."""
    from transformers.convert_slow_tokenizer import TikTokenConverter
    ranks = need(ASSETS / "tokenizers" / file)
    pattern, specials = (data.LLAMA3_PATTERN, data.LLAMA3_SPECIALS) if name == "llama-bpe" else \
        (data.QWEN2_PATTERN, data.TIKTOKEN_FILES[151643][1])
    hf = TikTokenConverter(vocab_file=str(ranks), pattern=pattern).converted()
    hf.add_special_tokens(specials)
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = data.load_tokenizer(tmp_path)
    assert tok.vocab_size == data.load_tokenizer(ranks).vocab_size and tok.specials == data.load_tokenizer(ranks).specials
    folder = ASSETS / "tokenizers" / "llamacpp_vocab_tests"
    inputs = (folder / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outputs = (folder / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").split("\n")
    for text, line in zip(inputs, outputs):
        assert tok.encode(text) == [int(x) for x in line.split()], repr(text)
    for text in varied_texts(300, seed=5):
        assert tok.encode(text, allow_special=True) == hf.encode(text, add_special_tokens=False).ids, repr(text)


def test_stories260k_dir():
    tok = data.load_tokenizer(need(ASSETS / "stories260K-hf"))
    assert tok.kind == "sentencepiece" and tok.vocab_size == 512
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (1, [2], 2)


# -----------------------------------------------------------------------------
# prompt formats

def test_format_qa_plain_and_chat(tmp_path):
    tok = data.load_tokenizer(need(ASSETS / "tokenizers" / "llama3_tokenizer.model"))
    f = data.format_qa(tok, "Anna lives in Oslo.", "Where does Anna live?", "Oslo")
    assert f["bos"] == f["prefix"] == [128000]
    assert tok.decode(f["context"]) == "Anna lives in Oslo."
    assert tok.decode(f["prompt"]) == "\nQuestion: Where does Anna live?\nAnswer:"
    assert f["answer"] == tok.encode(" Oslo") + [128001]
    draws = {tuple(data.format_qa(tok, "c", "q?", "a", rng=random.Random(i))["prompt"]) for i in range(40)}
    assert len(draws) == len(data.QA_TEMPLATES) >= 5
    c = data.format_qa(tok, "Anna lives in Oslo.", "Where does Anna live?", "Oslo", format="auto")
    assert tok.decode(c["prefix"] + c["context"] + c["prompt"] + c["answer"]) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nAnna lives in Oslo.\nQuestion: Where does "
        "Anna live?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nOslo<|eot_id|>")
    sp = data.load_tokenizer(need(ASSETS / "tokenizers" / "llama2_tokenizer.model"))  # dummy-prefix sentencepiece
    f = data.format_qa(sp, "Anna lives in Oslo.\nBob works.", "Where?", "Oslo", chunks=["Anna lives in Oslo.", "Bob works."])
    assert sp.decode(f["prefix"] + f["context"] + f["prompt"] + f["answer"]) == \
        "Anna lives in Oslo.\nBob works.\nQuestion: Where?\nAnswer: Oslo"
    assert f["context"] == sp.encode("Anna lives in Oslo.\nBob works.")  # chunk-wise = whole, here
    q = data.load_tokenizer(need(ASSETS / "tokenizers" / "qwen.tiktoken"))
    c = data.format_qa(q, "ctx", "q?", "ans", format="auto")
    assert q.decode(c["prefix"] + c["context"] + c["prompt"] + c["answer"]) == (
        "<|im_start|>user\nctx\nQuestion: q?<|im_end|>\n<|im_start|>assistant\nans<|im_end|>")


# the chat templates the checkpoints ship (tokenizer_config.json), as jinja
CHAT_TEMPLATES = {
    "chatml": "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
              "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "llama3": "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
              "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
              "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
              "{% endif %}",
    "gemma": "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
             "{% endif %}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
             "{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
             "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
             "{{'<start_of_turn>model\\n'}}{% endif %}",
}


@pytest.mark.parametrize("fmt", list(CHAT_TEMPLATES))
def test_chat_template_picks_the_format(fmt, tmp_path):
    """One tokenizer with every family's turn tokens: the chat_template decides, and
    format_qa(format="auto") writes what the template renders (jinja2 as the oracle)."""
    import jinja2
    hf = train_hf_bpe(data.LLAMA3_PATTERN, specials_first=True, nfc=False, vocab_size=400)
    hf.add_special_tokens(["<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": CHAT_TEMPLATES[fmt]}
    if fmt == "chatml":  # a template list, as some checkpoints ship it
        cfg["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": cfg["chat_template"]}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = data.load_tokenizer(tmp_path)
    assert data.chat_format(tok) == fmt
    f = data.format_qa(tok, "Anna lives in Oslo.", "Where does Anna live?", "Oslo", format="auto")
    text = data.QA_TEMPLATES[0].format(question="Where does Anna live?")
    want = jinja2.Template(CHAT_TEMPLATES[fmt]).render(
        messages=[{"role": "user", "content": "Anna lives in Oslo." + text}, {"role": "assistant", "content": "Oslo"}],
        bos_token="<|begin_of_text|>" if fmt != "chatml" else "", add_generation_prompt=False)
    bos = tok.decode(f["bos"]) if fmt == "chatml" else ""  # ChatML's template writes no bos; format_qa does
    assert bos + want.removesuffix("\n") == tok.decode(f["prefix"] + f["context"] + f["prompt"] + f["answer"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=None)))
    assert data.chat_format(data.load_tokenizer(tmp_path)) is None  # a base model: plain QA prompts
    if fmt == "chatml":  # no "default" among the templates (read as a base model's), a .jinja not UTF-8: one line
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(dict(cfg, chat_template=cfg["chat_template"][:1])))
        with pytest.raises(ValueError, match=r"lists templates \['tool_use'\], none named 'default'"):
            data.load_tokenizer(tmp_path)
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
        (tmp_path / "chat_template.jinja").write_bytes(b"{{ '\xff' }}")
        with pytest.raises(ValueError, match=r"chat_template\.jinja: not UTF-8 text \(byte 4\)"):
            data.load_tokenizer(tmp_path)
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):  # (a line naming no file)
            (tmp_path / "bad").mkdir(exist_ok=True)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                (tmp_path / "bad" / f).write_bytes((tmp_path / f).read_bytes())
            (tmp_path / "bad" / name).write_bytes(b'{"x": "\xff"}')
            with pytest.raises(ValueError, match=rf"bad/{name}: not UTF-8 text$"):
                data.load_tokenizer(tmp_path / "bad")


# -----------------------------------------------------------------------------
# readers: fixtures in the real formats, each with one malformed record

def squad_fixture(path):
    good = {"id": "q1", "question": "Who?", "answers": [{"text": "Ann", "answer_start": 13}]}
    doc = {"version": "v2.0", "data": [{"title": "T", "paragraphs": [{"context": "First one. Ann did it! Yes.", "qas": [
        good, {"id": "q2", "question": "Why?", "answers": [], "is_impossible": True},
        {"id": "q3", "answers": [{"text": "x", "answer_start": 0}]},  # no question
        {"id": "q4", "question": "What?", "answers": [{"text": "Yes", "answer_start": 23}]}]}]}]}
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("dev.json", json.dumps(doc))


def test_read_squad(tmp_path):
    p = tmp_path / "dev.json.zip"
    squad_fixture(p)
    with pytest.raises(ValueError, match=r"dev\.json\.zip: question 3: missing field 'question'"):
        list(data.read_squad(p))
    stats = {}
    recs = list(data.read_squad(p, skip_bad=True, stats=stats))
    assert [r["id"] for r in recs] == ["q1", "q4"]  # q1's "Ann" lies at 11, not its answer_start 13: counted
    assert stats == {"records": 2, "unanswerable": 1, "skipped_bad": 1, "answer_not_at_its_start": 1}
    assert recs[0]["chunks"] == ["First one.", "Ann did it!", "Yes."] and recs[0]["relevant"] == ["Ann did it!"]
    assert recs[1]["relevant"] == ["Yes."] and recs[0]["answers"] == ["Ann"]
    assert len(list(data.read_squad(p, skip_bad=True, keep_unanswerable=True))) == 3
    assert [r["id"] for r in data.read_dataset(p, skip_bad=True)] == ["q1", "q4"]
    text = json.dumps({"data": [{"paragraphs": [{"context": "Ann.", "qas": [  # ("no" skipped it as unanswerable)
        {"question": "Who?", "answers": [{"text": "Ann", "answer_start": 0}], "is_impossible": "no"}]}]}]})
    (tmp_path / "v2.json").write_text(text)
    with pytest.raises(ValueError, match=r"v2\.json: question 1: field 'is_impossible' should be true or false, "
                                         r"got \"no\""):
        list(data.read_squad(tmp_path / "v2.json"))


def test_read_mrqa(tmp_path):
    p = tmp_path / "x.jsonl.gz"
    lines = [{"header": {"dataset": "X"}},
             {"context": "Ann did it.", "qas": [{"qid": "a", "question": "Who?", "answers": ["Ann"]},
                                                {"qid": "b", "question": "What?", "answers": ["it"]}]},
             {"context": "Broken.", "qas": [{"qid": "c", "question": "Who?", "answers": "Ann"}]}]
    with gzip.open(p, "wt") as f:
        f.write("\n".join(map(json.dumps, lines)) + "\n")
    with pytest.raises(ValueError, match=r"x\.jsonl\.gz:3: field 'answers' should be list\[str\]"):
        list(data.read_mrqa(p))
    stats = {}
    recs = list(data.read_dataset(p, skip_bad=True, stats=stats))
    assert [r["id"] for r in recs] == ["a", "b"] and stats["skipped_bad"] == 1 and recs[0]["context"] == "Ann did it."
    with gzip.open(p, "wt") as f:  # a question without answers (it trained on an empty answer)
        f.write(json.dumps({"context": "Ann.", "qas": [{"qid": "d", "question": "Who?", "answers": []}]}) + "\n")
    with pytest.raises(ValueError, match=r"x\.jsonl\.gz:1: field 'answers' is empty"):
        list(data.read_mrqa(p))


def test_read_hotpot(tmp_path):
    para = lambda t: [t, [f"{t} is a place.", f" It is in {t}land."]]  # noqa: E731
    good = {"_id": "h1", "question": "Q?", "answer": "B", "supporting_facts": [["B", 0], ["D", 1]],
            "context": [para(t) for t in "ABCD"]}
    bad = dict(good, _id="h2", supporting_facts=[["Z", 0]])
    p = tmp_path / "hotpot.json"
    p.write_text(json.dumps([good, bad]))
    with pytest.raises(ValueError, match=r"hotpot\.json: record 2: supporting fact titles \['Z'\] not in context"):
        list(data.read_hotpot(p))
    (r,) = data.read_dataset(p, skip_bad=True)
    assert r["chunks"] == r["relevant"] == ["B: B is a place. It is in Bland.", "D: D is a place. It is in Dland."]
    assert r["context"] == "\n".join(r["chunks"]) and r["answers"] == ["B"]
    (r,) = data.read_hotpot(p, distractors=True, skip_bad=True)
    assert len(r["chunks"]) == 4 and len(r["relevant"]) == 2
    no_facts = {k: v for k, v in good.items() if k != "supporting_facts"}
    p.write_text(json.dumps([no_facts, good]))  # (its format was read from the first record alone: "cannot tell")
    with pytest.raises(ValueError, match=r"hotpot\.json: record 1: missing field 'supporting_facts'"):
        data.read_dataset(p)
    assert [r["id"] for r in data.read_dataset(p, skip_bad=True)] == ["h1"]


def test_read_msmarco(tmp_path):
    passages = [{"passage_text": "P one.", "is_selected": 0}, {"passage_text": "P two.", "is_selected": 1}]
    cols = {"query": {"0": "q0?", "1": "q1?", "2": "q2?"}, "query_id": {"0": 10, "1": 11, "2": 12},
            "passages": {"0": passages, "1": passages, "2": [{"text": "no passage_text"}]},
            "answers": {"0": ["two"], "1": ["No Answer Present."], "2": ["x"]}}
    p = tmp_path / "dev_v2.1.json"
    p.write_text(json.dumps(cols))
    with pytest.raises(ValueError, match=r"dev_v2\.1\.json: record 3: missing field 'passage_text'"):
        list(data.read_msmarco(p))
    stats = {}
    (r,) = data.read_dataset(p, skip_bad=True, stats=stats)
    assert (r["id"], r["chunks"], r["relevant"], r["context"]) == ("10", ["P one.", "P two."], ["P two."], "P one.\nP two.")
    assert stats == {"records": 1, "no_answer": 1, "skipped_bad": 1}
    q = tmp_path / "m.jsonl"
    q.write_text(json.dumps({"query": "q?", "passages": passages, "answers": ["two"]}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:2: invalid JSON"):
        list(data.read_dataset(q))
    assert len(list(data.read_dataset(q, skip_bad=True))) == 1


def test_read_jsonl_and_text(tmp_path):
    p = tmp_path / "g.jsonl"
    p.write_text(json.dumps({"context": "A. B.", "question": "q", "answers": ["B"], "relevant": ["A."],
                             "chunks": ["A.", "B."]}) + "\n\n" + json.dumps({"context": "x", "question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"g\.jsonl:3: missing field 'answers'"):
        list(data.read_dataset(p))
    (r,) = data.read_jsonl(p, skip_bad=True)
    assert r["id"].startswith("g.jsonl:1@") and r["chunks"] == ["A.", "B."]
    p.write_text(p.read_text().splitlines()[0] + "\n" + json.dumps({"context": " ", "question": "q", "answers": ["a"]}))
    with pytest.raises(ValueError, match=r"g\.jsonl:2: empty context: nothing to compress"):
        list(data.read_dataset(p))
    assert len(list(data.read_jsonl(p, skip_bad=True))) == 1
    t = tmp_path / "t.txt"
    t.write_text("para one\nstill one\n\n\npara two\n")
    assert list(data.read_text(t)) == ["para one\nstill one", "para two"]
    j = tmp_path / "t.jsonl"
    j.write_text('{"text": "a"}\n{"txt": "b"}\n')
    with pytest.raises(ValueError, match=r"t\.jsonl:2: missing field 'text'"):
        list(data.read_text(j))
    assert list(data.read_text(j, skip_bad=True)) == ["a"]
    j.write_text('{"text": "a"}\n{"text": " \\n"}\n')  # (it trained on an empty text)
    with pytest.raises(ValueError, match=r"t\.jsonl:2: field 'text' is empty"):
        list(data.read_text(j))


def test_a_byte_order_mark_is_dropped(tmp_path):
    """Files a Windows editor saved with a UTF-8 byte-order mark read as without one (JSON was "invalid JSON: Unexpected
    UTF-8 BOM"; a text began with U+FEFF): JSONL, gzipped JSONL, SQuAD JSON and .zip, text."""
    rec = {"id": "q", "context": "Ada was born in London.", "question": "Where?", "answers": ["London"]}
    squad = json.dumps({"data": [{"title": "T", "paragraphs": [{"context": rec["context"], "qas": [
        {"id": "q", "question": "Where?", "answers": [{"text": "London", "answer_start": 16}]}]}]}]})
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + json.dumps(rec).encode())
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(bom + json.dumps(rec).encode()))
    (tmp_path / "s.json").write_bytes(bom + squad.encode())
    with zipfile.ZipFile(tmp_path / "s.zip", "w") as z:
        z.writestr("s.json", bom + squad.encode())
    for name in ("a.jsonl", "a.jsonl.gz", "s.json", "s.zip"):
        (r,) = data.read_dataset(tmp_path / name)
        assert (r["context"], r["question"], r["answers"]) == (rec["context"], "Where?", ["London"]), name
    (tmp_path / "t.txt").write_bytes(bom + b"para one\n\npara two\n")
    assert data.read_text(tmp_path / "t.txt") == ["para one", "para two"]


def test_a_text_stage_reads_text_files_gzipped_or_not_and_a_qa_files_contexts(tmp_path):
    """train.read_items for a text objective (pic ae+lm, sac lm, sentence_gist lm): .txt and {"text"} .jsonl, each also
    .gz (they were read as QA files: "invalid JSON" / "missing field 'context'"), and a QA file of any format (a QA
    .jsonl: was "missing field 'text'") gives its contexts, each once (train.texts_of); a QA .jsonl whose records also
    carry a "text" is QA (its "text"s were read as the texts, and a QA stage refused it)."""
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"one\n\ntwo\n"))
    lines = "".join(json.dumps({"text": t}) + "\n" for t in ("one", "two"))
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    qa = "".join(json.dumps({"context": c, "question": "q", "answers": ["x"]}) + "\n" for c in ("one", "one", "two"))
    (tmp_path / "qa.jsonl").write_text(qa)
    (tmp_path / "titled.jsonl").write_text(qa.replace('{"context"', '{"text": "a title", "context"'))
    cfg = train.TrainConfig()
    for name in ("a.txt", "a.txt.gz", "a.jsonl.gz", "qa.jsonl", "titled.jsonl"):
        assert train.texts_of(train.read_items(str(tmp_path / name), cfg, text=True)) == ["one", "two"], name
    for name in ("qa.jsonl", "titled.jsonl"):
        assert len(train.read_items(str(tmp_path / name), cfg, text=False)) == 3 and not data.holds_text(tmp_path / name)


def test_every_record_gets_an_id_of_its_own(tmp_path):
    """eval.py pairs rows by question id: a missing one is named by its place (the reader's) and the CRC of its
    context and question, a repeated one gets #2, #3, ..., past those the file holds itself. Another dataset's file
    of the same name shares no id-less id with it (compare.py paired them, question 2 with question 2); a copy of
    the file elsewhere shares them all."""
    def squad(question):
        qas = [{"question": question, "answers": [{"text": "A b", "answer_start": 0}],
                **({"id": i} if i is not None else {})} for i in ("a", None, "a", "a#2", None)]
        return json.dumps({"data": [{"title": "t", "paragraphs": [{"context": "A b.", "qas": qas}]}]})
    for d, question in (("one", "q"), ("copy", "q"), ("other", "Who?")):
        (tmp_path / d).mkdir()
        (tmp_path / d / "s.json").write_text(squad(question))
    crc = f"{zlib.crc32(b'A b.' + bytes(1) + b'q'):08x}"
    ids = {d: [r["id"] for r in data.read_dataset(tmp_path / d / "s.json")] for d in ("one", "copy", "other")}
    assert ids["one"] == ids["copy"] == ["a", f"s.json:2@{crc}", "a#3", "a#2", f"s.json:5@{crc}"]
    assert set(ids["one"]) & set(ids["other"]) == {"a", "a#2", "a#3"}  # (the file's own ids pair as they are)
    ids = [r["id"] for r in data.unique_ids([{"id": i} for i in ("a#2", "a", "a", "a", "", "a#3", "4")])]
    assert ids == ["a#2", "a", "a#4", "a#5", "4", "a#3", "4#2"]


def test_a_file_of_another_shape_or_kind_is_one_line(tmp_path):
    """Structure the record checks never see (SQuAD's articles and paragraphs, MRQA's qas), and files that are not
    the zip or gzip their names say: a ValueError naming the file and where."""
    for name, text, message in (
            ("a.json", '{"data": [5]}', "a.json: data[0] should be an object whose 'paragraphs' is a list"),
            ("b.json", '{"data": [{"paragraphs": [{"qas": {}}]}]}', "b.json: data[0].paragraphs[0] should be an "
                                                                   "object whose 'qas' is a list"),
            ("m.jsonl", '{"context": "x", "qas": [5]}', "m.jsonl:1: expected a JSON object, got int"),
            ("s.zip", "not a zip", "s.zip: not a zip file"),
            ("g.jsonl.gz", "not gzip", "g.jsonl.gz: not a gzip file"),
            ("t.txt.gz", "not gzip", "t.txt.gz: not a gzip file"),
            ("p.txt", "plain words", "(pic ae+lm, sac lm, sentence_gist lm: --pretrain_data); a QA stage reads "
                                     "SQuAD, HotpotQA, MS MARCO, MRQA or JSONL")):  # was "invalid JSON"
        (tmp_path / name).write_text(text)
        read = data.read_text if name.startswith("t.") else data.read_dataset
        with pytest.raises(ValueError) as e:
            list(read(tmp_path / name))
        assert str(e.value).endswith(message) and "\n" not in str(e.value), e.value


def test_a_record_no_reader_could_score_is_one_line(tmp_path):
    """Records that parse but cannot be read or scored as their format says: an empty context, question or answer
    (an empty prediction scores EM 100 against it), SQuAD's answer_start outside the context, HotpotQA sentences
    that are not strings or no supporting fact, MS MARCO's is_selected other than 0 / 1, JSONL's relevant
    without chunks. Each: "file: question n: what is wrong" (JSONL: "file:line: ...")."""
    def squad(context="A b. C d.", question="q", text="A b", start=0):
        qa = {"question": question, "answers": [{"text": text, "answer_start": start}]}
        return {"data": [{"paragraphs": [{"context": context, "qas": [qa]}]}]}
    hotpot = {"_id": "h", "question": "q", "answer": "T", "supporting_facts": [["T", 0]], "context": [["T", ["A."]]]}
    marco = {"query": "q", "answers": ["B"], "passages": [{"passage_text": "A.", "is_selected": "0"}]}
    jsonl = {"context": "A b.", "question": "q", "answers": ["b"], "relevant": ["A b."]}
    for name, doc, message in (
            ("c.json", squad(context=""), "c.json: question 1: empty context"),  # was an IndexError
            ("w.json", squad(context="   ", start=2), "w.json: question 1: empty context"),  # (named its answer_start)
            ("q.json", squad(question=" "), "q.json: question 1: empty question"),
            ("a.json", squad(text=""), 'a.json: question 1: an empty answer: [""]'),
            ("s.json", squad(start=99), "s.json: question 1: answer_start [99] should lie in the context's 9 "
                                        "characters"),
            ("n.json", squad(start=-1), "n.json: question 1: answer_start [-1]"),
            ("b.json", squad(start=True), "b.json: question 1: field 'answer_start' should be int, got [true]"),  # (1)
            ("h.json", [{**hotpot, "context": [["T", [1, 2]]]}], "h.json: record 1: context should be [title, "
                                                                 "[sentences]] pairs of strings"),  # was a TypeError
            ("f.json", [{**hotpot, "supporting_facts": []}], "f.json: record 1: supporting_facts is empty"),
            ("e.json", [{**hotpot, "answer": ""}], "e.json: record 1: an empty answer"),
            ("m.jsonl", [marco], "m.jsonl:1: 'is_selected' should be 0 or 1"),  # "0" was selected
            ("r.jsonl", [jsonl], "r.jsonl:1: 'relevant' entries must be chunks (give the context's 'chunks' too)"),
            ("x.jsonl", [{**jsonl, "relevant": None, "answers": [" "]}], "x.jsonl:1: an empty answer")):
        (tmp_path / name).write_text("\n".join(map(json.dumps, doc)) if name.endswith("l") else json.dumps(doc))
        with pytest.raises(ValueError) as e:
            data.read_dataset(tmp_path / name)
        assert str(e.value).startswith(str(tmp_path)) and message in str(e.value), e.value
    (tmp_path / "y.jsonl").write_text(json.dumps({**jsonl, "relevant": None, "answers": ["b", " "]}))
    assert data.read_dataset(tmp_path / "y.jsonl")[0]["answers"] == ["b"]  # a blank alternative beside one: dropped
    # answers SQuAD's scoring empties ("The", "A", "."): an empty prediction scored EM 100 (F1 0). Skipped and counted;
    # beside a real answer kept, as the official script keeps them (3 of SQuAD dev's questions list a ".")
    lines = [{**jsonl, "relevant": None, "answers": answers} for answers in (["The", "A."], [".", "b"])]
    (tmp_path / "z.jsonl").write_text("\n".join(map(json.dumps, lines)))
    stats = {}
    assert [r["answers"] for r in data.read_dataset(tmp_path / "z.jsonl", stats=stats)] == [[".", "b"]]
    assert stats["unscorable"] == 1 and stats["records"] == 1


def test_a_broken_or_odd_file_is_one_line_naming_it(tmp_path):
    """A zip failing its checksum, a gzip failing its CRC, JSON nested past the recursion limit, a JSONL with a
    non-UTF-8 line deep in it (its line, not the decoder chunk's byte), a text file named .md or .TXT (read as text),
    a .JSONL (read as JSON lines), another name (read as JSON: the error says so)."""
    good = json.dumps({"context": "A b.", "question": "q", "answers": ["b"]}) + "\n"
    zipped = tmp_path / "squad.zip"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("squad.json", json.dumps({"data": [{"paragraphs": [{"context": "A b. " * 200, "qas": []}]}]}))
    raw = bytearray(zipped.read_bytes())
    raw[raw.index(b"A b.")] ^= 1  # stored uncompressed: the CRC fails
    zipped.write_bytes(bytes(raw))
    gz = bytearray(gzip.compress(good.encode() * 50))
    gz[-6] ^= 0xFF  # the CRC-32 at the end
    (tmp_path / "crc.jsonl.gz").write_bytes(bytes(gz))
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "latin.jsonl").write_bytes(good.encode() * 3000 + b'{"context": "caf\xe9"}\n')
    (tmp_path / "packed.jsonl").write_bytes(gzip.compress(good.encode()))  # (was "not UTF-8 text (line 1)")
    (tmp_path / "packed.json").write_bytes(zipped.read_bytes())
    cfg = train.TrainConfig()
    for name, message in (("squad.zip", "squad.zip: a cut or corrupt compressed file (Bad CRC-32"),
                          ("crc.jsonl.gz", "crc.jsonl.gz: a cut or corrupt compressed file (CRC check failed"),
                          ("deep.json", "deep.json: JSON nested too deeply to read"),
                          ("latin.jsonl", "latin.jsonl: not UTF-8 text (line 3001)"),
                          ("packed.jsonl", "packed.jsonl: a gzip file: name it packed.jsonl.gz"),
                          ("packed.json", "packed.json: a zip file: name it packed.json.zip")):
        with pytest.raises(ValueError) as e:
            train.read_records(tmp_path / name, cfg)
        assert str(e.value).startswith(str(tmp_path / name)) and message in str(e.value), e.value
    for name in ("notes.md", "NOTES.TXT"):
        (tmp_path / name).write_text("First words.\n\nSecond words.")
        assert data.holds_text(tmp_path / name)
        assert data.read_text(tmp_path / name) == ["First words.", "Second words."]
    (tmp_path / "UP.JSONL").write_text(good * 2)
    (tmp_path / "UP.JSONL.GZ").write_bytes(gzip.compress(good.encode() * 2))
    assert len(data.read_dataset(tmp_path / "UP.JSONL")) == len(train.read_records(tmp_path / "UP.JSONL.GZ", cfg)) == 2
    (tmp_path / "notes").write_text("plain words")
    with pytest.raises(ValueError, match="invalid JSON: .* \\(read as JSON by its name; text is .txt or .md"):
        data.read_dataset(tmp_path / "notes")


def test_what_a_reader_would_misread_is_kept_counted_or_one_line(tmp_path):
    """A numeric id 0 is kept (it read as missing); a misspelt SQuAD key ("Paragraphs", "questions") is one line
    naming where (its articles were dropped in silence), or with skip_bad a skipped one; a zip member zipfile cannot
    read (a password, Deflate64), a bzip2 / xz / zstd file and JSON lines named .json are one line saying what to do;
    a JSONL answer absent from its context and a repeated id are counted (the readers' note)."""
    qa = {"context": "Anna lives in Oslo.", "question": "Where?", "answers": ["Oslo"]}
    (tmp_path / "n.jsonl").write_text("".join(json.dumps({**qa, "id": i}) + "\n" for i in (0, 1, 1)))
    stats = {}
    assert [r["id"] for r in data.read_dataset(tmp_path / "n.jsonl", stats=stats)] == ["0", "1", "1#2"]
    assert stats == {"records": 3, "repeated_ids": 1}
    article = {"paragraphs": [{"context": qa["context"], "qas": [{"id": "q", "question": "Where?",
                                                                   "answers": [{"text": "Oslo", "answer_start": 14}]}]}]}
    for where, doc in (("data[1]", {"data": [article, {"Paragraphs": article["paragraphs"]}]}),
                       ("data[0].paragraphs[1]", {"data": [{"paragraphs": [*article["paragraphs"],
                                                                            {"context": "x", "questions": []}]}]})):
        (tmp_path / "s.json").write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=re.escape(f"s.json: {where} should be an object whose ") + ".*it has none"):
            data.read_dataset(tmp_path / "s.json")
        stats = {}
        assert len(data.read_dataset(tmp_path / "s.json", skip_bad=True, stats=stats)) == 1
        assert stats == {"records": 1, "skipped_bad": 1}
    zipped = tmp_path / "s.zip"
    for flag, offset, message in ((1, 8, "is encrypted"), (9, 10, "compression")):  # general flag bit 0; method 9
        with zipfile.ZipFile(zipped, "w", zipfile.ZIP_STORED) as z:
            z.writestr("s.json", json.dumps({"data": [article]}))
        raw = bytearray(zipped.read_bytes())
        raw[raw.index(b"PK\x01\x02") + offset] = flag  # the central directory's entry, which zipfile reads first
        zipped.write_bytes(bytes(raw))
        with pytest.raises(ValueError, match=f"s.zip: cannot unzip s.json .*{message}"):
            data.read_dataset(zipped)
    for kind, magic in (("bzip2", b"BZh91AY&SY"), ("xz", b"\xfd7zXZ\x00\x00"), ("zstd", b"\x28\xb5\x2f\xfd\x00")):
        (tmp_path / "c.jsonl").write_bytes(magic + b"\xff" * 20)
        with pytest.raises(ValueError, match=f"c.jsonl: a {kind} file; .gz and .zip are read"):
            data.read_dataset(tmp_path / "c.jsonl")
    (tmp_path / "lines.json").write_text(json.dumps(qa) + "\n" + json.dumps(qa) + "\n")
    with pytest.raises(ValueError, match=r"lines.json:2: invalid JSON: Extra data \(JSON lines\? name the file .jsonl"):
        data.read_dataset(tmp_path / "lines.json")
    (tmp_path / "a.jsonl").write_text(json.dumps({**qa, "answers": ["Bergen", "Paris"]}) + "\n" + json.dumps(qa))
    stats = {}
    assert len(data.read_dataset(tmp_path / "a.jsonl", stats=stats)) == 2 and stats["answer_not_in_context"] == 1


def test_real_qa_files():
    squad = need(ASSETS / "qa" / "squad" / "dev-v1.1.json.zip")
    recs = list(data.read_dataset(squad))
    assert len(recs) == 10570
    assert all(r["relevant"][0] in r["chunks"] for r in recs)
    assert sum(len(r["relevant"]) > 1 for r in recs) == 112  # "C. J. Anderson": every sentence the answer spans
    assert all(r["answers"][0] in " ".join(r["relevant"]) for r in recs)  # (before: the first alone, 112 cut)
    assert len(list(data.read_dataset(need(ASSETS / "qa" / "mrqa" / "SQuAD_dev_mrqa_format.jsonl.gz")))) == 10507
    assert len(list(data.read_dataset(ASSETS / "qa" / "mrqa" / "NewsQA_sample.jsonl"))) > 0
    hotpot = list(data.read_dataset(need(ASSETS / "qa" / "hotpotqa" / "hotpot_dev_distractor_v1_first53.json")))
    assert len(hotpot) == 53 and all(len(r["chunks"]) >= 2 for r in hotpot)


# -----------------------------------------------------------------------------
# synthetic benchmark and default tokenizer

def test_synthetic_deterministic_and_disjoint():
    a = tiny.Synthetic(seed=3, split="train").qa_examples(20)
    assert a == tiny.Synthetic(seed=3, split="train").qa_examples(20)
    assert a != tiny.Synthetic(seed=4, split="train").qa_examples(20)
    names = {s: set(tiny.Synthetic(0, s).names) for s in tiny.SPLITS}
    assert all(len(v) > 100 for v in names.values())
    assert not (names["train"] & names["val"] or names["train"] & names["test"] or names["val"] & names["test"])
    every = re.compile(r"\b(" + "|".join(n for v in names.values() for n in v) + r")\b")
    for split in ("val", "test"):
        for ex in tiny.Synthetic(0, split).qa_examples(30):
            people = set(every.findall(ex["context"]))
            assert people and people <= names[split]


def test_synthetic_answers_in_context():
    syn = tiny.Synthetic(seed=0, split="test")
    rng = random.Random(0)
    for _ in range(200):
        ex = syn.example(rng, rng.randint(1, 8), rng.randint(1, 8), same_attrs=rng.random() < 0.5, n_questions=4)
        assert ex["context"] == "\n".join(ex["chunks"]) and ex["relevant"][0] in ex["chunks"]
        assert ex["answers"][0] in ex["relevant"][0] and ex["question"] == ex["qas"][0][0]
        for (q, a), bio in zip(ex["qas"], ex["qa_relevant"]):
            assert a in bio and a in ex["context"]
    assert max(len(v[1]) for v in tiny.ATTRIBUTES.values()) >= 5 and min(len(v[2]) for v in tiny.ATTRIBUTES.values()) >= 2
    assert not any(len(tok) > 2 for v in tiny.ATTRIBUTES.values() for val in v[0] for tok in val.split() if tok.isdigit())


def test_synthetic_answers_not_guessable():
    """The best constant answer per attribute (values are uniform) scores a low token F1."""
    def f1(pred, gold):
        common = sum((Counter(pred.lower().split()) & Counter(gold.lower().split())).values())
        return 0.0 if common == 0 else 2 * common / (len(pred.split()) + len(gold.split()))
    best = {a: max(sum(f1(v, u) for u in values) / len(values) for v in values)
            for a, (values, _, _) in tiny.ATTRIBUTES.items()}
    assert sum(best.values()) / len(best) < 0.10, best
    assert all(len(values) >= 20 for values, _, _ in tiny.ATTRIBUTES.values())


def test_default_tokenizer_deterministic(tmp_path):
    a = tiny.train_default_tokenizer(tmp_path / "a", seed=0, vocab_size=800, n_chars=120_000)
    tiny.train_default_tokenizer(tmp_path / "b" / "tok.model", seed=0, vocab_size=800, n_chars=120_000)
    assert (tmp_path / "a" / "tokenizer.model").read_bytes() == (tmp_path / "b" / "tok.model").read_bytes()
    assert a.vocab_size == 800 and a.bos_id == 1 and a.eos_ids == [2] and a.pad_id == 3
    ex = tiny.Synthetic(seed=1, split="val").example(random.Random(1), 8, 6)
    text = ex["context"] + "\n" + data.QA_TEMPLATES[1].format(question=ex["question"]) + data.ANSWER_CUE
    ids = a.encode(text)
    assert a.decode(ids) == text and 0 not in ids  # round trip, no <unk>
    bio = a.encode(ex["chunks"][0])
    assert 40 <= len(bio) <= 120, len(bio)  # a 6-attribute biography
    assert a.decode(a.encode(" Paris", start=False)) == " Paris"
    ends = [t for t in a.token_texts() if t.rstrip().endswith((".", "?"))]
    assert ends


# -----------------------------------------------------------------------------
# batching

@pytest.fixture(scope="module")
def small_tok(tmp_path_factory):
    return tiny.train_default_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=600, n_chars=60_000)


def test_collate_qa_labels(small_tok):
    tok = small_tok
    recs = tiny.Synthetic(0, "val").qa_examples(6, n_people=(1, 4))
    stats = {}
    b = data.collate_qa(recs, tok, rng=random.Random(0), stats=stats)
    B = len(recs)
    for key in ("context", "qa", "full", "noctx"):
        assert b[key].shape[0] == B and b[key].shape[1] % 64 == 0
        if key + "_labels" in b:
            assert b[key + "_labels"].shape == b[key].shape
    assert stats == {}
    for i, r in enumerate(recs):
        for seq, lab in (("qa", "qa_labels"), ("full", "full_labels"), ("noctx", "noctx_labels")):
            pos = (b[lab][i] != -100).nonzero().flatten()
            assert torch.equal(b[lab][i][pos], b[seq][i][pos + 1])
            assert tok.decode(b[lab][i][pos].tolist()) == " " + r["answers"][0]  # answer then eos (decodes to "")
            assert b[lab][i][pos][-1].item() == tok.eos_ids[0]
        L = b["context_len"][i].item()
        assert tok.decode(b["context"][i, :L].tolist()) == r["context"]
        assert b["full"][i, 1:1 + L].tolist() == b["context"][i, :L].tolist() and b["full"][i, 0] == tok.bos_id
        assert (b["context"][i, L:] == tok.pad_id).all()
        spans = b["chunk_spans"][i]
        assert len(spans) == len(r["chunks"]) and spans[-1][1] == L
        for (s, e), chunk in zip(spans, r["chunks"]):
            assert tok.decode(b["context"][i, s:e].tolist()).lstrip("\n") == chunk
        assert [r["chunks"][j] for j in b["relevant_idx"][i]] == r["relevant"]
        assert b["qa"][i, :b["prompt_len"][i]].tolist() == b["full"][i, 1 + L:1 + L + b["prompt_len"][i]].tolist()
    assert b["ids"] == [r["id"] for r in recs] and b["prefix"] == [tok.bos_id]


def test_collate_qa_truncation_and_padding(small_tok):
    tok = small_tok
    recs = tiny.Synthetic(0, "train").qa_examples(4, n_people=(6, 8), n_attrs=(6, 8))
    stats = {}
    b = data.collate_qa(recs, tok, max_context=50, max_answer=2, pad_multiple=1, stats=stats)
    assert stats["truncated_context"] == 4 and stats["truncated_answer"] >= 1
    assert b["context"].shape[1] == 50 and (b["context_len"] == 50).all()
    assert all(e <= 50 for spans in b["chunk_spans"] for _, e in spans)
    assert (b["answer_len"] <= 2).all() and b["qa"].shape[1] == b["qa_len"].max()


def test_collate_lm(small_tok):
    stats = {}
    b = data.collate_lm(["Anna lives in Oslo.", "Hi"], small_tok, max_len=6, pad_multiple=8, stats=stats)
    cut = len(small_tok.encode("Anna lives in Oslo.", bos=True, eos=True)) - 6
    assert cut > 0 and stats == {"truncated_text": 1, "text_tokens_cut": cut}  # (a text stage said nothing of it)
    assert b["ids"].shape == (2, 8) and b["lengths"].tolist()[0] == 6
    n = b["lengths"][1].item()
    assert b["ids"][1, :n].tolist() == small_tok.encode("Hi", bos=True, eos=True)
    assert b["labels"][1, :n - 1].tolist() == b["ids"][1, 1:n].tolist() and (b["labels"][1, n - 1:] == -100).all()
