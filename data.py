"""Data for nanocompress (SPEC §2.6, §2.7):
1. Tokenizers: `load_tokenizer` reads an HF checkpoint dir or a tokenizer file (a byte-level BPE tokenizer.json
   becomes a tiktoken Encoding; tokenizer.model: tiktoken ranks or sentencepiece).
2. Prompt formats: `format_qa` -> token spans `prefix | context | prompt | answer`.
3. Readers: SQuAD, MRQA, HotpotQA, MS MARCO, JSONL, text. Errors in user files are ValueError("file:line: what is
   wrong"), in one JSON file's questions or records ("file: question 3: what is wrong").
4. Batching: `collate_qa`, `collate_lm` -> padded LongTensors."""
import base64
import collections
import gzip
import itertools
import json
import math
import random
import re
import string
import unicodedata
import zipfile
import zlib
from pathlib import Path

import regex  # tiktoken's own dependency: \p{L} classes for the split regexes
import sentencepiece as spm
import tiktoken
import torch

from model import id_list

# 1. Tokenizers
# Pre-tokenizer split regexes: Llama 3 (digits in groups of up to 3), Qwen2 (one digit a piece), GPT-2 (ByteLevel's)
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# SmolLM's Digits(individual_digits) + ByteLevel(use_regex) in one regex: a digit (or run) is a piece of its own,
# so no space joins it and whitespace before it ends a piece.
GPT2_DIGITS = {individual: GPT2_PATTERN.replace(r" ?\p{N}+", r"\p{N}" if individual else r"\p{N}+")
               .replace(r"(?!\S)", r"(?![^\s\p{N}])") for individual in (True, False)}

# Meta's llama3 tokenizer.py: 256 special tokens right after the 128000 ranks.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", *(f"<|reserved_special_token_{i}|>" for i in range(4)),
                   "<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>",
                   *(f"<|reserved_special_token_{i}|>" for i in range(5, 251))]
# A bare ranks file's size says which model it is: n ranks -> (regex, specials numbered from n, bos, eos list, NFC)
TIKTOKEN_FILES = {
    128000: (LLAMA3_PATTERN, LLAMA3_SPECIALS, "<|begin_of_text|>", ["<|end_of_text|>", "<|eot_id|>"], False),
    151643: (QWEN2_PATTERN, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, ["<|endoftext|>"], True),
}
UNSUPPORTED = "supported: byte-level BPE tokenizer.json, tiktoken or sentencepiece tokenizer.model"


def bytes_to_unicode():
    """GPT-2's byte -> printable char table: byte-level BPE vocab files spell bytes with it."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def bpe_merge(ranks, piece):
    """tiktoken's BPE of one piece (bytes): itself if a token, else merge the lowest-ranked pair (leftmost), repeat."""
    if piece in ranks:
        return [ranks[piece]]
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        rank, i = min((ranks.get(a + b, math.inf), i) for i, (a, b) in enumerate(zip(parts, parts[1:])))
        if rank == math.inf:
            break
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


class Tokenizer:
    """One interface over a tiktoken Encoding or a sentencepiece processor. encode() matches special-token strings
    in the text only with allow_special=True (then every added token, as HF does); a tokenizer.json's non-special
    added tokens always match, as in HF. start=False encodes text that continues earlier text (no dummy prefix)."""

    def __init__(self, kind, model, specials, bos_id, eos_ids, pad_id=None, nfc=False, always=(), lacking=None):
        self.kind, self.model = kind, model  # kind: "tiktoken" | "sentencepiece"
        self.specials, self.always = dict(specials), set(always)  # text -> id of special and added tokens; see above
        self.nfc = nfc                # NFC-normalise text first (Qwen)
        self.lacking = lacking        # (split regex, ranks, lacking bytes, unk id, fuse_unk): see _encode_lacking
        self.chat_template = None     # the checkpoint's: its text, "" = it has none (base), None = no config read
        self.bos_id, self.eos_ids, self.pad_id = bos_id, list(eos_ids), pad_id  # pad None: load_tokenizer sets eos
        self.bos_from_file = False    # bos_id is what the tokenizer.json's post_processor writes (None: nothing)
        self.memo = None              # a dict: encode() keeps each text's ids (train.py: records tokenized once)
        if kind == "tiktoken":
            self.vocab_size = model.max_token_value + 1
        else:
            self.vocab_size = max([model.get_piece_size() - 1, *self.specials.values()]) + 1
            self._dummy = model.encode("a", out_type=str)[0].startswith("\u2581")  # add_dummy_prefix?
            self._marker = model.encode("<unk>")

    def encode(self, text, bos=False, eos=False, allow_special=False, start=True):
        key = (text, bos, eos, allow_special, start)
        if self.memo is None:
            return self._encode(*key)
        if key not in self.memo:
            self.memo[key] = self._encode(*key)
        return list(self.memo[key])  # a copy: callers extend what they get

    def _encode(self, text, bos, eos, allow_special, start):
        if self.nfc:
            text = unicodedata.normalize("NFC", text)
        allowed = set(self.specials) if allow_special else self.always
        if self.kind == "tiktoken" and not self.lacking:
            ids = self.model.encode(text, allowed_special=allowed, disallowed_special=())
        else:  # split out the allowed special-token strings (the odd parts), encode the rest
            names = sorted(allowed, key=len, reverse=True)
            parts = re.split("(" + "|".join(map(re.escape, names)) + ")", text) if names else [text]
            ids = []
            for i, part in enumerate(parts):
                if i % 2:
                    ids.append(self.specials[part])
                elif self.lacking:
                    ids += self._encode_lacking(part)
                elif start or i > 0 or not self._dummy:
                    ids += self.model.encode(part)
                else:  # HF's legacy=False trick: encode a marker first, so the text gets no dummy prefix
                    marked, n = self.model.encode("<unk>" + part), len(self._marker)
                    ids += marked[n:] if marked[:n] == self._marker else self.model.encode(part)
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + (self.eos_ids[:1] if eos else [])

    def _encode_lacking(self, text):
        """HF's BPE on a byte-level vocab that lacks some single bytes (trainers keep the bytes they saw): after the
        regex split, a lacking byte becomes the unk token (one per run with fuse_unk), or with no unk is dropped and
        its neighbours merge as if adjacent (BPE::merge_word). tiktoken needs all 256 bytes, so bpe_merge does it."""
        pattern, ranks, lacks, unk, fuse = self.lacking
        ids = []
        for piece in pattern.findall(text):
            run, prev = [], None
            for byte in piece.encode("utf-8"):
                if byte not in lacks:
                    run.append(byte)
                elif unk is not None and not (fuse and prev in lacks):
                    ids += bpe_merge(ranks, bytes(run)) + [unk]
                    run = []
                prev = byte
            ids += bpe_merge(ranks, bytes(run))
        return ids

    def decode(self, ids, skip_special=False):
        """skip_special: without special tokens, as HF's skip_special_tokens (an added token that is not special,
        like <tool_call>, stays): what eval writes as a prediction."""
        ids = [int(i) for i in ids]
        if skip_special:
            special = {i for s, i in self.specials.items() if s not in self.always}
            ids = [i for i in ids if i not in special]
        if self.kind == "tiktoken":
            return self.model.decode(ids)
        # sentencepiece decodes runs of its own pieces; added tokens (ids >= its size) are spliced in
        n = self.model.get_piece_size()
        names = {i: s for s, i in self.specials.items() if i >= n}
        return "".join(self.model.decode(list(run)) if own else "".join(names.get(i, "") for i in run)
                       for own, run in itertools.groupby(ids, lambda i: 0 <= i < n))

    def special(self, name):
        """Id of a special or added token given by its text, e.g. "<|im_start|>"."""
        if name not in self.specials:
            raise ValueError(f"tokenizer has no special token {name!r}")
        return self.specials[name]

    def has_special(self, name):
        return name in self.specials

    def token_texts(self):
        """Decoded text of every id (sentencepiece: '▁' -> ' ', a byte piece < 0x80 -> its char)."""
        names, m = {i: s for s, i in self.specials.items()}, self.model

        def text(i):
            if i in names:
                return names[i]
            if self.kind == "tiktoken":
                return m.decode_single_token_bytes(i).decode("utf-8", "replace")
            if i >= m.get_piece_size():
                return ""
            if m.is_byte(i):  # <0xAB>
                return bytes([int(m.id_to_piece(i)[3:5], 16)]).decode("utf-8", "replace")
            return m.id_to_piece(i).replace("\u2581", " ")
        return [text(i) for i in range(self.vocab_size)]


def load_tokenizer(path):
    """Tokenizer from an HF checkpoint dir (a byte-level BPE tokenizer.json wins, else tokenizer.model), a
    tokenizer.json or a tokenizer.model file; bos/eos/pad from the HF config files next to it."""
    path = Path(path)
    tj, tm = path / "tokenizer.json", path / "tokenizer.model"
    if not path.exists():
        raise ValueError(f"{path}: tokenizer file not found")
    if path.is_dir() and not (tj.exists() or tm.exists()):
        raise ValueError(f"{path}: no tokenizer.json or tokenizer.model in this directory")
    try:
        json_wins = tj.exists() and (not tm.exists() or _is_byte_level(_checkpoint_json(tj)))
        file = path if not path.is_dir() else tj if json_wins else tm
        tok = _from_tokenizer_json(file) if file.suffix == ".json" else _from_model_file(file)
    except (KeyError, TypeError, AttributeError, IndexError) as e:  # a JSON file of another shape
        raise ValueError(f"{path}: unsupported tokenizer: unexpected file structure ({type(e).__name__}: "
                         f"{e}); {UNSUPPORTED}") from None
    _apply_checkpoint_config(tok, file.parent)
    return tok


def _is_byte_level(spec):
    steps = [spec.get("pre_tokenizer") or {}, spec.get("decoder") or {}]
    steps += steps[0].get("pretokenizers", []) + steps[1].get("decoders", [])
    return (spec.get("model") or {}).get("type") == "BPE" and any(s.get("type") == "ByteLevel" for s in steps)


def _from_tokenizer_json(path):
    spec = _checkpoint_json(path)
    model = spec.get("model") or {}
    if not _is_byte_level(spec):
        kind = model.get("type", "?") + (" (not byte-level)" if model.get("type") == "BPE" else "")
        raise ValueError(f"{path}: unsupported tokenizer: found model type {kind!r}; {UNSUPPORTED}")
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = {t["content"]: t for t in spec.get("added_tokens", [])}
    if len(added) < len(spec.get("added_tokens", [])):  # (the last one's id won: a wrong EOS)
        twice = collections.Counter(t["content"] for t in spec["added_tokens"]).most_common(1)[0][0]
        raise ValueError(f"{path}: added_tokens lists {twice!r} more than once")
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):  # (ignored: other ids than HF's)
        if model.get(key):
            raise ValueError(f"{path}: unsupported tokenizer: found BPE {key} {model[key]!r}; {UNSUPPORTED}")
    if len(set(model["vocab"].values())) < len(model["vocab"]):  # (a panic in tiktoken)
        twice = collections.Counter(model["vocab"].values()).most_common(1)[0][0]
        raise ValueError(f"{path}: vocab gives id {twice} to more than one token")
    vocab = {p: i for p, i in model["vocab"].items() if p not in added}  # tiktoken keeps special tokens apart
    if bad := next((p for p in vocab if any(c not in byte_of for c in p)), None):
        raise ValueError(f"{path}: vocab entry {bad!r} is not byte-level; {UNSUPPORTED}")
    ranks = {bytes(byte_of[c] for c in piece): i for piece, i in vocab.items()}
    lacks = {b for b in range(256) if bytes([b]) not in ranks}
    if lacks and model.get("byte_fallback"):
        raise ValueError(f"{path}: unsupported tokenizer: found byte_fallback on a byte-level vocab that lacks "
                         f"{len(lacks)} of the 256 single bytes; {UNSUPPORTED}")
    # tiktoken merges by the rank of the merged token; that is HF's merge order when the merged tokens' ids never
    # decrease along the merges list (true for `tokenizers` trainers' files and Llama 3 / Qwen2, from tiktoken).
    last, merged = -1, set()
    for n, m in enumerate(model.get("merges", [])):
        pair = m.split(" ") if isinstance(m, str) else m
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise ValueError(f"{path}: merges[{n}] is {m!r:.40}, expected \"a b\" or [a, b]")
        a, b = pair
        merged.add(a + b)
        i = model["vocab"].get(a + b, -1)
        if i < last:  # equal: converted tiktoken files list every pair that makes a token
            raise ValueError(f"{path}: merge {a!r} {b!r} is out of vocab-id order; tiktoken ranks would differ")
        last = i
    unmade = [p for p in vocab if len(p) > 1 and p not in merged]  # HF reaches a token by merges only, tiktoken
    if unmade and not model.get("ignore_merges"):  # also whole (as HF with ignore_merges): they would differ
        raise ValueError(f"{path}: vocab token {unmade[0]!r} is made by no merge (and ignore_merges is false); "
                         f"{UNSUPPORTED}")
    pattern, nfc = _pretokenizer(path, spec)
    specials = {s: t["id"] for s, t in added.items()}
    always = {s for s, t in added.items() if not t.get("special")}
    enc = tiktoken.Encoding(name=str(path), pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
    processor = spec.get("post_processor")  # what HF writes around a text; None: the config's bos_token decides
    before = _written_before_text(processor) if processor else None
    bos = next((specials[s] for s in ("<|begin_of_text|>", "<s>", "<bos>") if s in specials), None)
    if before is not None:  # the post_processor says which BOS HF writes, if any
        bos = specials[before[0]] if before else None
    eos = [specials[s] for s in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>") if s in specials][:1]
    unk, lacking = model["vocab"].get(model.get("unk_token")), None
    if lacks:
        try:
            lacking = (regex.compile(pattern), ranks, lacks, unk, bool(model.get("fuse_unk")))
        except regex.error as e:
            raise ValueError(f"{path}: unsupported pre_tokenizer regex {pattern!r} ({e})") from None
    tok = Tokenizer("tiktoken", enc, specials, bos, eos, nfc=nfc, always=always, lacking=lacking)
    tok.bos_from_file = before is not None
    return tok


def _written_before_text(processor):
    """The special tokens a tokenizer.json post_processor writes before a text, as HF's add_special_tokens=True
    (SmolLM2's writes none, though its config names <|im_start|> the bos_token; Llama 3's writes its BOS)."""
    if processor["type"] == "Sequence":
        return [t for p in processor["processors"] for t in _written_before_text(p)]
    if processor["type"] == "TemplateProcessing":
        single = processor["single"]
        text_at = next((i for i, piece in enumerate(single) if "Sequence" in piece), len(single))
        return [piece["SpecialToken"]["id"] for piece in single[:text_at] if "SpecialToken" in piece]
    if processor["type"] in ("RobertaProcessing", "BertProcessing"):
        return [processor["cls"][0]]
    return []  # ByteLevel: offsets only


def _pretokenizer(path, spec):
    """(split regex, nfc) of a tokenizer.json: Split(Regex) + ByteLevel, ByteLevel (GPT-2), Digits + ByteLevel."""
    norm = spec.get("normalizer")
    norms = (norm or {}).get("normalizers", [norm] if norm else [])
    if any(n.get("type") != "NFC" for n in norms):
        raise ValueError(f"{path}: unsupported normalizer {norm}; only NFC or none")
    pre = spec.get("pre_tokenizer") or {}
    pattern = digits = None
    for step in pre.get("pretokenizers", [pre]):
        kind, gpt2, first = step.get("type"), step.get("use_regex", True), pattern is None and digits is None
        if kind == "Split" and first and step.get("behavior") == "Isolated" and not step.get("invert"):
            split = step["pattern"].get("Regex") or re.escape(step["pattern"].get("String", ""))
            pattern = rf"(?:{split})|(?:(?!(?:{split}))[\s\S])+"  # HF keeps the text between matches as pieces
        elif kind == "Digits" and first:
            digits = bool(step.get("individual_digits"))
        elif kind == "ByteLevel" and not step.get("add_prefix_space") and not (gpt2 and pattern):
            pattern = (GPT2_PATTERN if digits is None else GPT2_DIGITS[digits]) if gpt2 else pattern
        else:
            raise ValueError(f"{path}: unsupported pre_tokenizer step {json.dumps(step)[:200]}")
    if pattern is None:
        raise ValueError(f"{path}: no split regex in the pre_tokenizer")
    return pattern, bool(norms)


def _tiktoken_ranks(path):
    """{token bytes: rank} of a tiktoken file: a line "base64 rank" a token, the ranks 0..n-1 each once (a rank twice
    was a panic in tiktoken; a token of no bytes, or a rank past the others, a wrong token decoded)."""
    ranks = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                b64, rank = line.split()
                piece, rank = base64.b64decode(b64, validate=True), int(rank)
            except ValueError:  # (binascii.Error is one)
                got = line[:60].decode("latin-1").strip()
                raise ValueError(f"{path}:{n}: expected 'base64 rank', got {got!r}") from None
            if not piece or piece in ranks:
                raise ValueError(f"{path}:{n}: token {b64.decode()!r} is {'empty' if not piece else 'listed twice'}")
            ranks[piece] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: its {len(ranks)} ranks should be 0..{len(ranks) - 1}, each once")
    return ranks


def _from_model_file(path):
    if re.fullmatch(rb"[A-Za-z0-9+/]+=* \d+", path.read_bytes()[:100].split(b"\n")[0]):  # tiktoken: "b64 rank"
        ranks = _tiktoken_ranks(path)
        if len(ranks) not in TIKTOKEN_FILES:
            raise ValueError(f"{path}: a tiktoken file with {len(ranks)} ranks; "
                             f"known sizes: 128000 (Llama 3), 151643 (Qwen)")
        pattern, names, bos, eos, nfc = TIKTOKEN_FILES[len(ranks)]
        specials = {s: len(ranks) + i for i, s in enumerate(names)}
        enc = tiktoken.Encoding(name=path.name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        return Tokenizer("tiktoken", enc, specials, specials.get(bos), [specials[s] for s in eos], nfc=nfc)
    sp = spm.SentencePieceProcessor()
    try:
        sp.load(str(path))
    except (RuntimeError, OSError):
        raise ValueError(f"{path}: unsupported tokenizer: found an unknown file format; {UNSUPPORTED}") from None
    specials = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    bos, eos, pad = (i if i >= 0 else None for i in (sp.bos_id(), sp.eos_id(), sp.pad_id()))
    return Tokenizer("sentencepiece", sp, specials, bos, [] if eos is None else [eos], pad)


def _apply_checkpoint_config(tok, folder):
    """bos / eos / pad ids and the chat template from the HF config files next to the tokenizer."""
    names = ("tokenizer_config.json", "generation_config.json", "config.json")
    tcfg, gcfg, cfg = (_checkpoint_json(folder / name) if (folder / name).exists() else {} for name in names)
    for name, doc in zip(names, (tcfg, gcfg, cfg)):
        if not isinstance(doc, dict):
            raise ValueError(f"{folder / name}: a JSON {type(doc).__name__}, expected an object of keys")

    def token_id(key):  # tokenizer_config.json's bos_token etc.: a token text or {"content": text}
        text = tcfg[key].get("content") if isinstance(tcfg[key], dict) else tcfg[key]
        if not isinstance(text, str):
            raise ValueError(f"{folder / 'tokenizer_config.json'}: key {key!r} is {tcfg[key]!r:.40}, expected a token "
                             "text or {\"content\": text}")
        if text in tok.specials:
            return tok.specials[text]
        if tok.kind == "sentencepiece" and tok.model.piece_to_id(text) != tok.model.unk_id():
            return tok.model.piece_to_id(text)
        raise ValueError(f"{folder / 'tokenizer_config.json'}: {key} {text!r} is not a token of this tokenizer")

    if tok.kind == "sentencepiece" and (folder / "tokenizer.json").exists():
        for t in _checkpoint_json(folder / "tokenizer.json").get("added_tokens", []):  # e.g. an added <pad>
            tok.specials.setdefault(t["content"], t["id"])
        tok.vocab_size = max(tok.vocab_size, max(tok.specials.values()) + 1)
    if tcfg:
        template = tcfg.get("chat_template") or ""
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            if "default" not in named:  # (transformers refuses it; it read as a base model's: plain prompts)
                raise ValueError(f"{folder / 'tokenizer_config.json'}: key 'chat_template' lists templates "
                                 f"{sorted(map(str, named))}, none named 'default'")
            template = named["default"]
        if not isinstance(template, str):
            raise ValueError(f"{folder / 'tokenizer_config.json'}: key 'chat_template' is {template!r:.40}, "
                             "expected a Jinja text")
        jinja = folder / "chat_template.jinja"  # where transformers >= 4.43 saves it
        try:
            tok.chat_template = jinja.read_text(encoding="utf-8") if jinja.exists() else template
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja}: not UTF-8 text (byte {e.start})") from None
        if "add_bos_token" in tcfg or not tok.bos_from_file:  # else the tokenizer.json's post_processor decides
            bos = token_id("bos_token") if tcfg.get("bos_token") else None
            tok.bos_id = None if tcfg.get("add_bos_token") is False else bos
    elif "bos_token_id" in cfg and not tok.bos_from_file:
        tok.bos_id = cfg["bos_token_id"]
        if tok.bos_id is not None and not (type(tok.bos_id) is int and tok.bos_id >= 0):  # (as id_list's eos; one
            raise ValueError(f"{folder / 'config.json'}: key 'bos_token_id' is {tok.bos_id!r:.40}, expected a token "
                             "id (or null)")  # past the vocab: train.load_base's line for every id)
    eos = [token_id("eos_token")] if tcfg.get("eos_token") else []
    for name, v in (("generation_config.json", gcfg.get("eos_token_id")), ("config.json", cfg.get("eos_token_id"))):
        eos += id_list(v, f"{folder / name}: ")
    tok.eos_ids = list(dict.fromkeys(eos)) or tok.eos_ids
    if tcfg.get("pad_token"):
        tok.pad_id = token_id("pad_token")
    if tok.pad_id is None:
        tok.pad_id = tok.eos_ids[0] if tok.eos_ids else 0


def own_tokenizer(path, tok, vocab_size):
    """The tokenizer of the checkpoint at path (vocab_size) when it is not `tok`, else None."""
    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer.model")):
        if vocab_size != tok.vocab_size:
            raise ValueError(f"{path} has vocab_size {vocab_size}, the base {tok.vocab_size}, and no "
                             f"tokenizer of its own (tokenizer.json or tokenizer.model)")
        return None
    own, probe = load_tokenizer(path), "Ada Lovelace, born 1815 in London: a poet's daughter."
    return None if own.vocab_size == tok.vocab_size and own.encode(probe) == tok.encode(probe) else own


# 2. Prompt formats
# Plain extractive-QA wordings in the spirit of meanpool_multi_ratio A.1 ("<C>\n Extract the answer from the text
# above. \n Question: <Q>\n Answer: <A>"). Each follows the context; ANSWER_CUE ends the prompt in the plain format.
QA_TEMPLATES = [
    "\nQuestion: {question}",
    "\nExtract the answer from the text above.\nQuestion: {question}",
    "\nAnswer the question using the text above.\nQuestion: {question}",
    "\nRead the passage above and answer briefly.\nQuestion: {question}",
    "\nBased only on the text above, reply with a short answer.\nQuestion: {question}",
    "\nFind the answer in the context.\nQuestion: {question}",
]
ANSWER_CUE = "\nAnswer:"
# chat format -> (turn start, turn end): the special tokens its template writes
CHAT_FORMATS = {"llama3": ("<|start_header_id|>", "<|eot_id|>"), "chatml": ("<|im_start|>", "<|im_end|>"),
                "gemma": ("<start_of_turn>", "<end_of_turn>")}


def chat_format(tok):
    """"llama3", "chatml", "gemma" or None (plain): the one whose turn tokens the chat_template writes; None for a base
    model (no template in tokenizer_config.json); with no config or an unknown template, the one the tokenizer has."""
    if tok.chat_template == "":
        return None
    template = tok.chat_template or ""
    written = [name for name, (start, end) in CHAT_FORMATS.items() if start in template and end in template]
    known = [name for name, (start, end) in CHAT_FORMATS.items() if tok.has_special(start) and tok.has_special(end)]
    return (written + known + [None])[0]


def chunk_ends(context, chunks):
    """Character offset where each chunk ends; chunks must occur in the context in order."""
    ends, pos = [], 0
    for chunk in chunks:
        at = context.find(chunk, pos)
        if at < 0:
            raise ValueError(f"chunk {chunk[:40]!r} is not in the context (after the previous chunk)")
        pos = at + len(chunk)
        ends.append(pos)
    return ends


def keep_chunks(record, keep):
    """The record with only its chunks numbered in `keep`: its context their text, each after the separator that came
    before it in the context (the first kept one after the context's lead), then the context's tail."""
    context, chunks = record["context"], record["chunks"]
    ends = chunk_ends(context, chunks)
    starts = [end - len(c) for end, c in zip(ends, chunks)]
    before = [context[:starts[0]]] + [context[ends[i - 1]:starts[i]] for i in range(1, len(chunks))]
    kept = sorted(keep)
    text = before[0] + "".join((before[i] if j else "") + chunks[i] for j, i in enumerate(kept)) + context[ends[-1]:]
    return dict(record, context=text, chunks=[chunks[i] for i in kept])


def fit_chunks(records, tok, limit, size, chunk_size):
    """(the records with size(record) <= limit, each first losing its chunks that are not relevant, in an order seeded
    by its id, while it is longer; how many of them lost one). Not last first: that left a gold chunk last in most
    trimmed inputs, unlike the inputs evaluation reads. A record's context counts too: collate_qa cuts it at `limit`
    tokens. chunk_size(chunk): about what dropping the chunk saves (then size checks). No relevant chunk marked: none
    drops."""
    kept, trimmed, context_len = [], 0, {}  # a context's tokens, once for all its questions (SQuAD: about 5)

    def measure(r):
        if r["context"] not in context_len:
            context_len[r["context"]] = len(tok.encode(r["context"]))
        return max(size(r), context_len[r["context"]])
    for rec in records:
        whole, gold, n, chunks = rec, rec.get("relevant"), measure(rec), rec.get("chunks") or []
        spare = [i for i, c in enumerate(chunks) if gold and c not in gold]
        random.Random(rec.get("id", "")).shuffle(spare)  # (a str seed: the same order in every process)
        keep = set(range(len(chunks)))
        while n > limit and spare:
            i = spare.pop()
            keep.discard(i)
            n -= chunk_size(whole["chunks"][i])
            if n <= limit or not spare:  # the estimate checked whole (tokens may merge across a join)
                rec = keep_chunks(whole, keep)
                n = measure(rec)
        if n <= limit:
            kept.append(rec)
            trimmed += rec is not whole
    return kept, trimmed


def encode_chunks(tok, context, chunks=None, start=True):
    """Tokens of `context` and the (start, end) token span of each chunk (no chunks: one). Each chunk is tokenized
    with the text before it (its separator, e.g. "\\n"): the spans are exact and tile the context up to the last."""
    ends = chunk_ends(context, chunks or [context])
    ids, spans, pos = [], [], 0
    for end in ends + [len(context)]:  # the text after the last chunk is in no span
        first = len(ids)
        ids += tok.encode(context[pos:end], start=start and pos == 0)
        spans.append((first, len(ids)))
        pos = end
    return ids, spans[:len(ends)]


def prompt_format(tok, format):
    """The format a --prompt value reads in: "auto" is the checkpoint's chat format (chat_format), else plain."""
    return (chat_format(tok) or "plain") if format == "auto" else format


def answer_end(tok, format="auto"):
    """[the id that ends an answer] in `format` (format_qa's): a chat format's turn end, else the first eos id."""
    fmt = prompt_format(tok, format)
    if fmt in CHAT_FORMATS:
        return [tok.special(CHAT_FORMATS[fmt][1])]
    if not tok.eos_ids:
        raise ValueError("tokenizer has no eos token; answers need one")
    return tok.eos_ids[:1]


def stop_ids(tok, format="auto"):
    """The ids a greedy answer stops at: its end in `format` (answer_end) and every eos id. A base checkpoint that
    ships a chat template (Qwen2.5, Llama 3.1) lists only its end-of-text as eos, and answers trained to end with the
    turn end would run on past it."""
    return list(dict.fromkeys(answer_end(tok, format) + tok.eos_ids))


def format_qa(tok, context, question, answer, template=None, rng=None, chunks=None, format="plain"):
    """Token spans {bos, prefix, context, prompt, answer, chunk_spans} of one QA example; a model reads prefix +
    context + prompt + answer. prefix: bos ([] or [bos_id]) and, in chat formats, the user-turn header; prompt ends
    with the answer cue ("\\nAnswer:" or the assistant header), answer with answer_end (chat: the turn end).
    template: an index into QA_TEMPLATES or a string with {question}; None: drawn with rng, else 0. format: "plain",
    "llama3", "chatml", "gemma" (no system turn), "auto" (chat_format(tok) or plain), or "sac", the official SAC
    code's: no prefix; BOS "### Context:\n" context "\n### Question:\n" q "\n### Answer:\n" (no template) answer eos.
    Choices: no system turn where a template writes a default one (Qwen2.5, SmolLM2, Llama 3.1's date): every memory
    keeps the prefix, and the teacher learns the layout. The parts are encoded apart (a compressor reads the context's
    own tokens), so a token across a boundary (Llama 3's and Qwen's ".\n") splits, for teacher and compressor alike."""
    if template is None:
        template = rng.randrange(len(QA_TEMPLATES)) if rng is not None else 0
    text = (QA_TEMPLATES[template] if isinstance(template, int) else template).format(question=question)
    fmt = prompt_format(tok, format)
    if fmt not in ("plain", "sac", *CHAT_FORMATS):
        raise ValueError(f"unknown prompt format {format!r}; choose from plain, llama3, chatml, gemma, sac, auto")
    bos, end = ([tok.bos_id] if tok.bos_id is not None else []), answer_end(tok, fmt)
    enc = lambda s: tok.encode(s, start=False)  # noqa: E731
    lead = []  # tokens before the context (sac)
    if fmt == "sac":
        prefix, lead = [], bos + enc("### Context:\n")
        prompt = enc(f"\n### Question:\n{question}\n### Answer:\n")
    elif fmt == "plain":
        prefix, prompt = bos, enc(text + ANSWER_CUE)
        answer = " " + answer if answer else ""
    elif fmt == "llama3":
        def head(role):
            return [tok.special("<|start_header_id|>")] + enc(role) + [tok.special("<|end_header_id|>")] + enc("\n\n")
        prefix, prompt = bos + head("user"), enc(text) + end + head("assistant")
    else:  # chatml, gemma: <start>user\n ... <end>\n<start>assistant\n (Gemma: model\n)
        start = [tok.special(CHAT_FORMATS[fmt][0])]
        reply = "assistant\n" if fmt == "chatml" else "model\n"
        if "<think>" in (tok.chat_template or ""):  # Qwen3: its template's answer without thinking (an empty block)
            reply += "<think>\n\n</think>\n\n"
        prefix, prompt = bos + start + enc("user\n"), enc(text) + end + enc("\n") + start + enc(reply)
    ctx, spans = encode_chunks(tok, context, chunks, start=not (lead or prefix[len(bos):]))
    return {"bos": bos, "prefix": prefix, "context": lead + ctx, "prompt": prompt, "answer": enc(answer) + end,
            "chunk_spans": [(s + len(lead), e + len(lead)) for s, e in spans]}


# 3. Readers: iterators of {"id", "context", "question", "answers", "relevant", "chunks"}. chunks: the context's
# natural units (sentences, paragraphs, passages) in order, or None; relevant: those holding the answer, or None.
# skip_bad: count malformed records instead of raising; stats: "records", "skipped_bad", "unanswerable", "no_answer",
# "unscorable" (every answer only articles and punctuation: skipped), "answer_not_at_its_start" (SQuAD: an answer's
# text not at its answer_start; the official files have none),
# "answer_not_in_context" (generic JSONL: none of a question's answers in its context), "repeated_ids".
NO_PUNCTUATION = str.maketrans("", "", string.punctuation)  # (official SQuAD: its set of characters)


def normalize_answer(s):
    """Lower text and remove punctuation, articles and extra whitespace (official SQuAD; eval.py's metrics)."""
    s = s.lower().translate(NO_PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def _record(id, context, question, answers, relevant=None, chunks=None):
    if not context.strip():
        raise ValueError("empty context: nothing to compress")
    if not question.strip():
        raise ValueError("empty question")
    if answers and not any(a.strip() for a in answers):  # (an empty prediction would score EM 100 against it)
        raise ValueError(f"an empty answer: {json.dumps(answers)[:60]}")
    for key, text in (("context", context), ("question", question), *(("answers", a) for a in answers)):
        _utf8(key, text)
    return {"id": "" if id is None else str(id), "context": context, "question": question,
            "answers": [a for a in answers if a.strip()], "relevant": relevant, "chunks": chunks}


def _utf8(key, text):
    """text, checked to be text a tokenizer takes: JSON's "\ud800" alone (a lone UTF-16 surrogate) is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"field {key!r}: {text[e.start]!r} at character {e.start} is a lone UTF-16 surrogate, "
                         "not text") from None
    return text


def _field(rec, key, kind, what=None):
    """rec[key], checked to be of type kind (and its items of type what: list[str])."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    if key not in rec:
        raise ValueError(f"missing field {key!r}")
    v = rec[key]
    if not isinstance(v, kind) or (what and not all(isinstance(x, what) for x in v)):
        want = kind.__name__ + (f"[{what.__name__}]" if what else "")
        raise ValueError(f"field {key!r} should be {want}, got {json.dumps(v)[:60]}")
    return v


def _count(stats, key, n=1):
    if stats is not None:
        stats[key] = stats.get(key, 0) + n


def _parsed(path, items, parse, skip_bad, stats, unit=""):
    """Records from parse(raw) for each (n, raw) item (items=None: the JSON lines of a JSONL(.gz) file); its
    ValueError becomes "path:line: what is wrong", or "path: question 3: ..." where the items are the units of one
    JSON file (unit: "question", "record"); skip_bad: counts it. Records without an id get "file:n@CRC", the CRC of
    their context and question."""
    for line, raw in _jsonl(path) if items is None else items:
        try:
            records = parse(json.loads(raw) if items is None else raw)
        except ValueError as e:
            if not skip_bad:
                why = f"invalid JSON: {e.msg}" if isinstance(e, json.JSONDecodeError) else e
                raise ValueError(f"{path}: {unit} {line}: {why}" if unit else f"{path}:{line}: {why}") from None
            _count(stats, "skipped_bad")
            continue
        for k, r in enumerate(records):
            if isinstance(r, dict) and r["answers"] and not any(map(normalize_answer, r["answers"])):
                _count(stats, "unscorable")  # "The", "A", ".": SQuAD's scoring empties them, so an empty prediction
                continue  # would match (beside a real answer they stay, as in the official script: SQuAD dev has 3)
            if isinstance(r, dict) and not r["id"]:  # (the text's CRC: another file's dev.jsonl:3 never pairs with it)
                text_crc = zlib.crc32(f"{r['context']}\0{r['question']}".encode())
                r["id"] = f"{Path(path).name}:{line}" + (f":{k}" if len(records) > 1 else "") + f"@{text_crc:08x}"
            _count(stats, "records")
            yield r


def _open_text(path):
    """UTF-8 text, gzipped or not; a byte-order mark (Windows editors write one) is dropped."""
    if not str(path).lower().endswith(".gz"):
        return open(path, encoding="utf-8-sig")
    with open(path, "rb") as f:
        if f.read(2) != b"\x1f\x8b":
            raise ValueError(f"{path}: not a gzip file")
    return gzip.open(path, "rt", encoding="utf-8-sig")


def is_json_list(path):
    """Whether a JSON file's text starts with "[": of the formats read here, HotpotQA's alone (what --hotpot_distractors
    reads; an unreadable file is False, its reader says why)."""
    if file_kind(path) != "json":
        return False
    try:
        with _open_text(path) as f:
            return f.read(4096).lstrip()[:1] == "["
    except (OSError, ValueError, EOFError):  # (UnicodeDecodeError, a fake .gz)
        return False


FILE_KINDS = {".txt": "text", ".text": "text", ".md": "text", ".jsonl": "jsonl", ".ndjson": "jsonl", ".zip": "zip"}


def file_kind(path):
    """How a data file is read, by its name (case aside, a .gz dropped): "text" (.txt, .text, .md), "jsonl" (.jsonl,
    .ndjson), "zip", else "json"."""
    return FILE_KINDS.get(Path(Path(path).name.lower().removesuffix(".gz")).suffix, "json")


def holds_text(path):
    """Whether a file holds texts, not questions: .txt / .text / .md, or JSONL whose first record has a "text" and no
    "context" (a QA record may carry a "text" too)."""
    kind = file_kind(path)
    return kind == "text" or kind == "jsonl" and "text" in (keys := first_record(path)) and "context" not in keys


def _load_json(path):
    """A JSON file, or the one .json member of a .zip."""
    path = Path(path)
    try:
        if file_kind(path) != "zip":
            with _open_text(path) as f:
                return json.load(f)
        if not zipfile.is_zipfile(path):  # (is_zipfile is False for a file that is not there)
            raise ValueError(f"{path}: {'not a zip file' if path.exists() else 'no such file'}")
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith(".json") and not n.startswith("__MACOSX/")]  # (Finder's)
            if len(names) != 1:
                raise ValueError(f"{path}: expected one .json file in the zip, found {names}")
            try:
                raw = z.read(names[0])
            except (RuntimeError, NotImplementedError) as e:  # (a password, a compression zipfile lacks: Deflate64)
                raise ValueError(f"{path}: cannot unzip {names[0]} ({e})") from None
            return json.loads(raw.decode("utf-8-sig"))
    except json.JSONDecodeError as e:
        named = path.name.lower().removesuffix(".gz").endswith((".json", ".zip"))
        hint = (" (JSON lines? name the file .jsonl)" if e.msg == "Extra data" else "" if named else
                " (read as JSON by its name; text is .txt or .md, JSON lines .jsonl)")
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}{hint}") from None


def _checkpoint_json(path):
    """A checkpoint's JSON file (tokenizer.json, its configs): one that is not UTF-8 is a ValueError naming it."""
    try:
        return _load_json(path)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None


def _jsonl(path):
    """(line number, text) of each non-empty line of a JSONL(.gz) file."""
    with _open_text(path) as f:
        yield from ((n, line) for n, line in enumerate(f, 1) if line.strip())


def read_squad(path, skip_bad=False, keep_unanswerable=False, stats=None, doc=None):
    """SQuAD v1.1 / v2.0 JSON (or a .zip of it), a record per question; chunks = sentences, relevant = those the first
    answer overlaps. v2 unanswerable questions: counted and skipped, or kept with answers=[]. Errors name the question
    (1-based, in file order). doc: the file's JSON where the caller has read it (read_dataset)."""
    doc = _load_json(path) if doc is None else doc
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list):
        raise ValueError(f"{path}:1: not a SQuAD file (no top-level 'data' list)")
    def listed(obj, key, where):  # obj[key]: a list; a missing one (a misspelt "Paragraphs") is an error or skip_bad's
        if isinstance(obj, dict) and key not in obj and skip_bad:
            _count(stats, "skipped_bad")
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get(key), list):
            keys = f" (it has none; its keys: {', '.join(sorted(obj)[:8])})" if isinstance(obj, dict) and key not in \
                obj else ""
            raise ValueError(f"{path}: {where} should be an object whose {key!r} is a list{keys}")
        return obj[key]
    items = [(para, qa) for a, article in enumerate(doc["data"])
             for p, para in enumerate(listed(article, "paragraphs", f"data[{a}]"))
             for qa in listed(para, "qas", f"data[{a}].paragraphs[{p}]")]
    sentences = {}  # context -> (chunks, their ends): split once for all of a paragraph's questions

    def parse(item):
        para, qa = item
        context, question = _field(para, "context", str), _field(qa, "question", str)
        answers = _field(qa, "answers", list)
        if not context.strip():  # (before its answers: "answer_start [36] should lie in the context's 3 characters")
            raise ValueError("empty context: nothing to compress")
        if qa.get("is_impossible", False) not in (True, False):  # ("no" was truthy: an answered question skipped)
            got = json.dumps(qa["is_impossible"])
            raise ValueError(f"field 'is_impossible' should be true or false, got {got:.60}")
        if qa.get("is_impossible") or not answers:
            _count(stats, "unanswerable")
            if not keep_unanswerable:
                return []
        texts, starts = [_field(a, "text", str) for a in answers], [_field(a, "answer_start", int) for a in answers]
        if not all(type(s) is int for s in starts):  # (bool is an int)
            raise ValueError(f"field 'answer_start' should be int, got {json.dumps(starts)[:60]}")
        if not all(0 <= s < max(len(context), 1) for s in starts):
            raise ValueError(f"answer_start {starts} should lie in the context's {len(context)} characters")
        if context not in sentences:
            chunks = [s for s in re.split(r"(?<=[.!?])\s+", context) if s] or [context]  # after . ! ? and whitespace
            sentences[context] = chunks, chunk_ends(context, chunks)
        chunks, ends = sentences[context]
        relevant = None
        if starts:  # the sentences the first answer overlaps ("C. J. Anderson" spans three)
            stop = starts[0] + len(texts[0])
            relevant = [c for c, e in zip(chunks, ends) if e > starts[0] and e - len(c) < stop] or chunks[-1:]
        record = _record(qa.get("id"), context, question, texts, relevant, chunks)
        if any(context[s:s + len(t)] != t for s, t in zip(starts, texts)):  # (relevant reads the start)
            _count(stats, "answer_not_at_its_start")
        return [record]
    return _parsed(path, enumerate(items, 1), parse, skip_bad, stats, "question")


def read_mrqa(path, skip_bad=False, stats=None):
    """MRQA shared-task JSONL(.gz): an optional {"header"} line, then {"context", "qas"} per line."""
    def parse(obj):
        if isinstance(obj, dict) and "header" in obj:
            return []
        context, records = _field(obj, "context", str), []
        for qa in _field(obj, "qas", list):
            question, answers = _field(qa, "question", str), _field(qa, "answers", list, str)
            if not answers:
                raise ValueError("field 'answers' is empty")  # (MRQA's own files answer every question)
            records.append(_record(qa.get("qid") or qa.get("id"), context, question, answers))
        return records
    return _parsed(path, None, parse, skip_bad, stats)


def read_hotpot(path, distractors=False, skip_bad=False, stats=None, doc=None):
    """HotpotQA JSON list. chunks = "Title: sentences" paragraphs, the gold ones (titles in supporting_facts) or all
    ten with distractors=True; relevant = the gold paragraphs. Errors name the record (1-based)."""
    recs = _load_json(path) if doc is None else doc
    if not isinstance(recs, list):
        raise ValueError(f"{path}:1: not a HotpotQA file (expected a JSON list)")

    def parse(rec):
        facts, context = _field(rec, "supporting_facts", list), _field(rec, "context", list)
        answer, question = _field(rec, "answer", str), _field(rec, "question", str)
        if not all(isinstance(f, list) and f and isinstance(f[0], str) for f in facts):
            raise ValueError("supporting_facts should be [title, sentence index] pairs")
        if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], list)
                   and all(isinstance(x, str) for x in p[1]) for p in context):
            raise ValueError("context should be [title, [sentences]] pairs of strings")
        if not facts:
            raise ValueError("supporting_facts is empty: no gold paragraph")
        gold, titles = {f[0] for f in facts}, {t for t, _ in context}
        if not gold <= titles:
            raise ValueError(f"supporting fact titles {sorted(gold - titles)} not in context")
        paras = [(t, f"{t}: {''.join(s)}") for t, s in context]
        relevant = [p for t, p in paras if t in gold]
        chunks = [p for _, p in paras] if distractors else relevant
        return [_record(rec.get("_id"), "\n".join(chunks), question, [answer], relevant, chunks)]
    return _parsed(path, enumerate(recs, 1), parse, skip_bad, stats, "record")


def read_msmarco(path, skip_bad=False, stats=None, doc=None):
    """MS MARCO v2.1: the official columnar JSON ({"query": {"0": ...}, "passages": ...}; errors name the 1-based
    record) or JSONL records {"query", "passages": [{"passage_text", "is_selected"}], "answers"}. chunks =
    passages, relevant = the selected ones; records answered "No Answer Present." are skipped and counted."""
    items = None  # JSONL
    if file_kind(path) != "jsonl":
        cols = _load_json(path) if doc is None else doc
        if not isinstance(cols, dict) or not isinstance(cols.get("query"), dict):
            raise ValueError(f"{path}:1: not an MS MARCO file (no 'query' column)")
        rows = ({c: v[k] for c, v in cols.items() if isinstance(v, dict) and k in v} for k in cols["query"])
        items = enumerate(rows, 1)

    def parse(rec):
        question, answers = _field(rec, "query", str), _field(rec, "answers", list, str)
        passages = _field(rec, "passages", list)
        chunks = [_field(p, "passage_text", str) for p in passages]
        if not answers or answers == ["No Answer Present."]:
            _count(stats, "no_answer")
            return []
        if any(p.get("is_selected", 0) not in (0, 1) for p in passages):
            raise ValueError("'is_selected' should be 0 or 1")
        relevant = [c for c, p in zip(chunks, passages) if p.get("is_selected") == 1]
        return [_record(rec.get("query_id"), "\n".join(chunks), question, answers, relevant, chunks)]
    return _parsed(path, items, parse, skip_bad, stats, "record" if items else "")


def read_jsonl(path, skip_bad=False, stats=None):
    """Generic JSONL(.gz): {"context", "question", "answers": [str], "relevant"?: [str], "chunks"?: [str] (in the
    context, in order), "id"?}."""
    def parse(rec):
        context, question = _field(rec, "context", str), _field(rec, "question", str)
        answers = _field(rec, "answers", list, str)
        if not answers:
            raise ValueError("field 'answers' is empty")
        relevant, chunks = (_field(rec, k, list, str) if rec.get(k) is not None else None
                            for k in ("relevant", "chunks"))
        chunk_ends(context, chunks or [])
        if relevant and not set(relevant) <= set(chunks or []):
            raise ValueError("'relevant' entries must be chunks (give the context's 'chunks' too)")
        if not any(a in context for a in answers):  # (a note: an abstractive set may mean it; a span reader not)
            _count(stats, "answer_not_in_context")
        return [_record(rec.get("id"), context, question, answers, relevant, chunks)]
    return _parsed(path, None, parse, skip_bad, stats)


def read_text(path, skip_bad=False, stats=None):
    """Strings for LM training: a text file's paragraphs (split at blank lines), or a JSONL(.gz) file's "text"s."""
    if file_kind(path) == "jsonl":
        def text(rec):
            if not _field(rec, "text", str).strip():  # (an empty text trained on nothing but its BOS and EOS)
                raise ValueError("field 'text' is empty")
            return [_utf8("text", rec["text"])]
        return _whole(path, lambda: _parsed(path, None, text, skip_bad, stats))
    return _whole(path, lambda: _paragraphs(path))


def _paragraphs(path):
    with _open_text(path) as f:
        yield from (p.strip("\n") for p in re.split(r"\n\s*\n", f.read()) if p.strip())


def _whole(path, read):
    """list(read()) of a user's file: one that is not UTF-8, a cut or corrupt .gz / .zip, or JSON nested past
    Python's recursion limit is a ValueError naming it."""
    try:
        return list(read())
    except UnicodeDecodeError as e:
        with open(path, "rb") as f:
            magic = f.read(4)
        for kind, start, suffix in (("gzip", b"\x1f\x8b", ".gz"), ("zip", b"PK\x03\x04", ".zip")):
            if magic.startswith(start) and not str(path).lower().endswith(suffix):  # (read by its name)
                raise ValueError(f"{path}: a {kind} file: name it {Path(path).name}{suffix}") from None
        for kind, start in (("bzip2", b"BZh"), ("xz", b"\xfd7zX"), ("zstd", b"\x28\xb5\x2f\xfd")):
            if magic.startswith(start):
                raise ValueError(f"{path}: a {kind} file; .gz and .zip are read: decompress it (or gzip it)") from None
        where = f"byte {e.start}" if file_kind(path) == "zip" else f"line {_first_non_utf8_line(path)}"
        raise ValueError(f"{path}: not UTF-8 text ({where})") from None
    except (EOFError, zlib.error, gzip.BadGzipFile, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: a cut or corrupt compressed file ({e})") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None


def _first_non_utf8_line(path):
    """The number of the first line of a file (gzipped or not) that is not UTF-8 (a decoder counts from its chunk)."""
    with (gzip.open if str(path).lower().endswith(".gz") else open)(path, "rb") as f:
        for n, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return n


def first_record(path):
    """The first line of a JSONL(.gz) file as a dict; {} when it is not one (its reader says why, with the line)."""
    try:
        first = json.loads(next(_jsonl(path), (1, "{}"))[1])
    except (ValueError, EOFError, zlib.error, OSError, RecursionError):  # its reader says what is wrong with the file
        return {}
    return first if isinstance(first, dict) else {}


def read_dataset(path, distractors=False, **kw):
    """The file's reader: .zip / JSON with "data": SQuAD; JSON list with "supporting_facts": HotpotQA; JSON(L) with
    "passages": MS MARCO; JSONL with "header" or "qas" first: MRQA; other JSONL: generic. kw: skip_bad, stats.
    Every record gets an id of its own (unique_ids)."""
    return unique_ids(_whole(path, lambda: _read_any(Path(path), distractors, **kw)), kw.get("stats"))


def _read_any(path, distractors, **kw):
    kind = file_kind(path)
    if kind == "text":
        raise ValueError(f"{path}: plain text, read by the text stages only (pic ae+lm, sac lm, sentence_gist lm: "
                         "--pretrain_data); a QA stage reads SQuAD, HotpotQA, MS MARCO, MRQA or JSONL")
    if kind == "zip":
        return read_squad(path, **kw)
    if kind == "jsonl":
        keys = set(first_record(path))
        if holds_text(path):
            raise ValueError(f"{path}: JSONL of {{\"text\"}} lines, read by the text stages only (--pretrain_data); "
                             "a QA stage reads SQuAD, HotpotQA, MS MARCO, MRQA or JSONL of questions")
        reader = read_mrqa if keys & {"header", "qas"} else read_msmarco if "passages" in keys else read_jsonl
        return reader(path, **kw)
    doc = _load_json(path)
    if isinstance(doc, dict) and "data" in doc:
        return read_squad(path, doc=doc, **kw)
    if isinstance(doc, list) and any(isinstance(r, dict) and "supporting_facts" in r for r in doc[:100]):
        # (not the first record alone: one that lacks the field is its reader's numbered error, or --skip_bad's)
        return read_hotpot(path, distractors=distractors, doc=doc, **kw)
    if isinstance(doc, dict) and "passages" in doc:
        return read_msmarco(path, doc=doc, **kw)
    raise ValueError(f"{path}: cannot tell the dataset format; expected SQuAD, HotpotQA, MS MARCO, MRQA or JSONL")


def unique_ids(records, stats=None):
    """Every record an id of its own (eval.py pairs rows question by question): a repeated one gets "#2", "#3", ...
    and is counted (the readers name a missing one by its place in the file; else its index here)."""
    records = list(records)
    for i, r in enumerate(records):
        r["id"] = r["id"] or str(i)
    taken, seen, count = {r["id"] for r in records}, set(), collections.Counter()  # (a file may hold "a#2" itself)
    for r in records:
        if r["id"] in seen:
            base = r["id"]
            count[base] = max(count[base], 1) + 1
            while f"{base}#{count[base]}" in taken:
                count[base] += 1
            r["id"] = f"{base}#{count[base]}"
            taken.add(r["id"])
            _count(stats, "repeated_ids")
        seen.add(r["id"])
    return records


# 4. Batching
def pad_rows(rows, value, multiple, left=False):
    """(B, T) LongTensor of right-padded rows (left-padded if left), T rounded up to a multiple."""
    T = -(-max([1, *map(len, rows)]) // multiple) * multiple
    out = torch.full((len(rows), T), value, dtype=torch.long)
    for i, r in enumerate(rows):
        start = T - len(r) if left else 0
        out[i, start:start + len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _answer_labels(n_before, answer):
    """Next-token targets: position t predicts token t+1 where t+1 is an answer token."""
    labels = [-100] * (n_before + len(answer))
    labels[n_before - 1:n_before - 1 + len(answer)] = answer
    return labels


def collate_qa(records, tok, max_context=1024, max_answer=64, rng=None, pad_multiple=64, stats=None, format="plain"):
    """Tensors for a batch of QA records (spans as in format_qa, which gets format, rng and a record's "template").
    context (B, L); qa (B, T) = prompt + answer; full (B, S) = prefix + context + prompt + answer; noctx = prefix +
    prompt + answer (the no-context baseline); each with `_len` (B,) and, but context, `_labels`: -100 except where
    the next token is an answer token. prompt_len, answer_len (B,). Pads: tok.pad_id, lengths rounded up to
    pad_multiple. Kept: the first max_context context and max_answer answer tokens (stats "truncated_context",
    "truncated_answer"). chunk_spans: per example each chunk's (start, end) in `context`; relevant_idx: the relevant
    chunks (all without "relevant"); prefix, bos: the shared sequence start; answers, questions, ids, records: raw."""
    rows = {k: [] for k in ("context", "qa", "qa_labels", "full", "full_labels", "noctx", "noctx_labels")}
    spans_all, rel_all, prefix = [], [], []
    for r in records:
        answer = r["answers"][0] if r["answers"] else ""  # unanswerable (kept on request): just eos
        f = format_qa(tok, r["context"], r["question"], answer, r.get("template"), rng, r.get("chunks"), format)
        ctx, spans, prefix, prompt, ans = f["context"], f["chunk_spans"], f["prefix"], f["prompt"], f["answer"]
        if len(ctx) > max_context:
            _count(stats, "context_tokens_cut", len(ctx) - max_context)
            ctx, spans = ctx[:max_context], [(s, min(e, max_context)) for s, e in spans if s < max_context]
            _count(stats, "truncated_context")
        if len(ans) > max_answer:
            ans = ans[:max_answer]
            _count(stats, "truncated_answer")
        rel, chunks = r.get("relevant"), r.get("chunks") or [r["context"]]
        rel_all.append([i for i, c in enumerate(chunks[:len(spans)]) if rel is None or c in rel])
        spans_all.append(spans)
        rows["context"].append(ctx)
        for k, before in (("qa", []), ("full", prefix + ctx), ("noctx", prefix or f["bos"])):  # (sac: BOS in ctx)
            rows[k].append(before + prompt + ans)
            rows[k + "_labels"].append(_answer_labels(len(before) + len(prompt), ans))
    batch = {k: pad_rows(v, -100 if k.endswith("_labels") else tok.pad_id, pad_multiple) for k, v in rows.items()}
    batch.update({k + "_len": torch.tensor([len(x) for x in rows[k]], dtype=torch.long)
                  for k in ("context", "qa", "full", "noctx")})
    answer_len = (batch["qa_labels"] != -100).sum(1)  # qa = prompt + answer, the labelled tokens
    batch.update(prompt_len=batch["qa_len"] - answer_len, answer_len=answer_len, chunk_spans=spans_all,
                 relevant_idx=rel_all, prefix=prefix, bos=[tok.bos_id] if tok.bos_id is not None else [],
                 answers=[r["answers"] for r in records], questions=[r["question"] for r in records],
                 ids=[r["id"] for r in records], records=list(records))
    return batch


def collate_lm(texts, tok, max_len, pad_multiple=64, stats=None):
    """ids (B, T) = [bos] + text + [eos] cut to max_len (stats: counted); labels (B, T): next tokens, -100 at the end;
    lengths (B,)."""
    rows = [tok.encode(t, bos=True, eos=True) for t in texts]
    for r in rows:
        if len(r) > max_len:
            _count(stats, "truncated_text")
            _count(stats, "text_tokens_cut", len(r) - max_len)
    rows = [r[:max_len] for r in rows]
    labels = [r[1:] + [-100] for r in rows]
    return {"ids": pad_rows(rows, tok.pad_id, pad_multiple), "labels": pad_rows(labels, -100, pad_multiple),
            "lengths": torch.tensor([len(r) for r in rows], dtype=torch.long)}
