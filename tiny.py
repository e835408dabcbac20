"""The embedded default: a tiny base that runs on a CPU, and the aids it needs beyond the papers.
Everything here concerns the tiny base (`tiny_base/`, or any `--method base` run dir) and the synthetic benchmark
(the tiny world's data: here, not in data.py as SPEC §2 has it); nothing here runs on a real checkpoint.

- `tiny_base/` ships with the repo (`python train.py --method base --out_dir tiny_base`); if it is deleted (or
  part-trained), the first run that needs it trains it.
- `Base` (`--method base`): that model's objective and curriculum (SPEC §2.6).
- Aids, the same for every compression method, on the tiny base only (`--no_aids`: none of them, and the papers'
  recipes at the tiny base's scale, train.SCALE):
  1. `compressor_curriculum`: short contexts first, then a ramp to the eval set's mix.
  2. `AttentionDistillation`: the decoder's head 0 learns from the teacher's: where it looks, over the memory slots
     that hold each context token, where the paper's layout fixes them (a method's token_slots); elsewhere
     (compression tokens that read the whole context) what it outputs. sentence_gist's gists also learn the
     last-layer K/V of the answer in their sentence (gist_kv_loss); ATA's compression tokens, to read the answer
     one layer below the last (writer_loss).
  3. `add_questions`: every QA pair of a context after one memory (QUESTIONS).
  4. `add_decoder_adapter`: a LoRA decoder for the methods whose paper freezes it (a real LLM
     reads soft memory frozen, a tiny base trained from scratch does not).
  5. `w_from_identity`: meanpool's W starts at I, as the aids were tuned.
"""
import io
import math
import os
import random
import zlib
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch
import torch.nn.functional as F

import data
from model import ModelConfig, Transformer, apply_rope, read_json

BASE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_base")


# -----------------------------------------------------------------------------
# the synthetic benchmark (SPEC §2.6): biographies of invented people. Values avoid long digit strings (a small
# tokenizer splits them); each attribute has many values, drawn uniformly: no answer is guessable without its context.

FIRST_NAMES = """Ada Alan Alma Amir Anna Arlo Aurora Basil Bianca Boris Carmen Cedric Clara Dario Delia Dmitri Edith
Elias Elsa Emil Farah Felix Flora Gideon Greta Hana Hugo Ilse Ines Ivan Jonas Juno Kai Kira Lars Leona Linus Lucia
Magnus Maren Milo Mira Nadia Nico Nora Olaf Olive Oscar Petra Quinn Rafael Rosa Silas Sofia Tariq Thea Tobias Una Vera
Viktor Wanda Yusuf Zara Zeno""".split()
LAST_NAMES = """Abbott Alvarez Baker Bauer Becker Castillo Chen Dubois Eriksen Fischer Fontaine Garcia Gupta Hansen
Hartmann Ito Jansen Kaur Keller Kowalski Larsen Lindqvist Lopez Marino Moreau Murphy Nakamura Novak Okafor Olsen Patel
Petrov Quinlan Reyes Rossi Russo Sato Schmidt Silva Sokolov Suzuki Tanaka Torres Varga Vogel Walsh Weber Wright
Yamamoto Zielinski Brennan Delgado Holm Ivanova Kim Mendes Nilsen Park Romero Stone Tran Ward Young""".split()
MONTHS = "January February March April May June July August September October November December".split()
CITIES = """Amsterdam Athens Austin Bangkok Barcelona Berlin Bogota Boston Brisbane Cairo Chicago Denver Dublin Geneva
Glasgow Hamburg Havana Helsinki Istanbul Jakarta Kyoto Lagos Lima Lisbon London Lyon Madrid Manila Marseille Melbourne
Miami Milan Montreal Mumbai Munich Nairobi Naples Oslo Ottawa Paris Porto Prague Quito Riga Rome Santiago Seattle
Seoul Seville Sydney Taipei Tallinn Tokyo Toronto Tunis Valencia Vienna Warsaw Zagreb Zurich""".split()
COMPANY = """Acme Bluebird Copperleaf Driftwood Evergreen Foxglove Granite Harbor Ironwood Juniper Kestrel Lighthouse
Maple Northwind Orchid Pinecrest Quartz Redwood Silverline Tidewater Umber Violet Willow Zephyr""".split()
UNIVERSITY = """Ashford Bellmont Carrow Dunmore Elmhurst Fairhaven Glenwood Hollis Kingsley Lakeside Marlow Norwood
Oakridge Preston Ravenscroft Stanmore Thornbury Westbrook""".split()

ATTRIBUTES = {  # name -> (values, sentence templates, question templates)
    "birthday": (
        [f"{m} {d}" for m in MONTHS for d in range(1, 29)],
        ["{name} was born on {value}.", "{name} celebrates a birthday on {value}.",
         "The birthday of {name} is {value}.", "{name} came into the world on {value}.",
         "On {value}, {name} was born."],
        ["When was {name} born?", "What is the birthday of {name}?", "On what day was {name} born?"]),
    "city": (
        CITIES,
        ["{name} lives in {value}.", "{name} has a home in {value}.", "{name} moved to {value} years ago.",
         "These days {name} resides in {value}.", "The city where {name} lives is {value}."],
        ["Where does {name} live?", "In which city does {name} live?", "What city is home to {name}?"]),
    "employer": (
        [f"{a} {b}" for a in COMPANY for b in ("Labs", "Foods", "Motors", "Bank", "Studios", "Systems", "Airlines")],
        ["{name} works for {value}.", "{name} is employed by {value}.", "{name} has a job at {value}.",
         "The employer of {name} is {value}.", "Every weekday {name} goes to work at {value}."],
        ["Where does {name} work?", "Which company employs {name}?", "Who is the employer of {name}?"]),
    "university": (
        [f"{a} {b}" for a in UNIVERSITY for b in ("University", "College", "Institute", "Academy", "Polytechnic")],
        ["{name} studied at {value}.", "{name} graduated from {value}.", "{name} earned a degree at {value}.",
         "{name} is an alumnus of {value}.", "As a student, {name} attended {value}."],
        ["Where did {name} study?", "Which school did {name} graduate from?", "What university did {name} attend?"]),
    "profession": (
        """accountant actor architect baker biologist carpenter chef chemist dentist designer economist editor
        electrician engineer farmer firefighter florist geologist historian journalist judge lawyer librarian mechanic
        musician nurse optician painter pharmacist photographer physicist pilot plumber poet professor programmer
        sculptor surgeon tailor teacher translator veterinarian writer""".split(),
        ["{name} works as {a_value}.", "By profession, {name} is {a_value}.", "{name} earns a living as {a_value}.",
         "{name} trained to be {a_value}.", "The job of {name} is {a_value}."],
        ["What does {name} do for a living?", "What is the profession of {name}?", "What job does {name} have?"]),
    "hobby": (
        ["archery", "baking bread", "birdwatching", "bouldering", "calligraphy", "chess", "cycling",
         "fencing", "fishing", "gardening", "hiking", "juggling", "kayaking", "knitting", "origami",
         "painting", "pottery", "rowing", "sailing", "salsa dancing", "skiing", "stargazing", "surfing",
         "swimming", "tennis", "woodworking", "yoga", "playing the cello", "writing poems", "solving puzzles"],
        ["In free time, {name} enjoys {value}.", "The favourite hobby of {name} is {value}.",
         "{name} spends most weekends on {value}.", "{name} has a passion for {value}.",
         "{name} took up {value} as a hobby."],
        ["What hobby does {name} enjoy?", "What is the favourite hobby of {name}?", "How does {name} spend free time?"]),
    "colour": (
        """amber beige black blue bronze coral crimson cyan gold green grey indigo ivory lavender lilac magenta maroon
        mint navy olive orange peach pink purple red rust scarlet silver teal turquoise violet white yellow""".split(),
        ["The favourite colour of {name} is {value}.", "{name} loves the colour {value}.",
         "{name} likes {value} more than any other colour.", "{name} always picks {value} clothes.",
         "No colour pleases {name} more than {value}."],
        ["What is the favourite colour of {name}?", "Which colour does {name} like best?"]),
    "pet": (
        """beagle budgie canary cat chameleon chinchilla cockatoo corgi dalmatian donkey ferret gecko goat goldfish
        hamster hedgehog iguana lizard parrot pony poodle rabbit snake spaniel terrier tortoise""".split(),
        ["{name} has a pet {value}.", "{name} owns {a_value}.", "{name} takes care of {a_value}.",
         "At home, {name} keeps {a_value}.", "The pet of {name} is {a_value}."],
        ["What pet does {name} have?", "What animal does {name} own?", "What kind of pet does {name} keep?"]),
}
SPLITS = {"train": range(0, 8), "val": range(8, 9), "test": range(9, 10)}
EVAL_PEOPLE, EVAL_ATTRS = (2, 8), (3, 6)  # the eval sets' mix: people per context, attributes per person


def _render(template, name, value=""):
    article = "an" if value[:1] in "aeiou" else "a"
    return template.format(name=name, value=value, a_value=f"{article} {value}")


class Synthetic:
    """Reading comprehension over biographies of invented people, deterministic from a seed.
    Splits are disjoint by person: every (first, last) name belongs to one split."""

    def __init__(self, seed=0, split="train"):
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
        self.seed, self.split = seed, split
        names = (f"{first} {last}" for first in FIRST_NAMES for last in LAST_NAMES)
        self.names = [n for n in names if zlib.crc32(n.encode()) % 10 in SPLITS[split]]  # a stable hash: 8/1/1

    def example(self, rng, n_people, n_attrs, same_attrs=True, n_questions=1):
        """A context of n_people biographies (one chunk each) and n_questions QA pairs whose
        answers are attribute values as written in the context. same_attrs: every person
        carries the same attributes, so each is a distractor."""
        n_attrs = min(n_attrs, len(ATTRIBUTES))
        shared = rng.sample(list(ATTRIBUTES), n_attrs)
        bios, facts = [], []
        for name in rng.sample(self.names, n_people):
            attrs = shared[:] if same_attrs else rng.sample(list(ATTRIBUTES), n_attrs)
            rng.shuffle(attrs)
            sentences = []
            for a in attrs:
                values, sentence_templates, _ = ATTRIBUTES[a]
                value = rng.choice(values)
                sentences.append(_render(rng.choice(sentence_templates), name, value))
                facts.append((len(bios), name, a, value))
            bios.append(" ".join(sentences))
        asked = rng.sample(facts, min(n_questions, len(facts)))
        qas = [(_render(rng.choice(ATTRIBUTES[a][2]), name), value) for _, name, a, value in asked]
        relevant = [bios[i] for i, _, _, _ in asked]
        return {"id": f"syn-{self.split}-{rng.getrandbits(48):012x}", "context": "\n".join(bios), "chunks": bios,
                "qas": qas, "question": qas[0][0], "answers": [qas[0][1]], "relevant": relevant[:1],
                "qa_relevant": relevant, "qa_people": [name for _, name, _, _ in asked]}

    def qa_examples(self, n, n_people=EVAL_PEOPLE, n_attrs=EVAL_ATTRS, seed_offset=0):
        """n fixed examples (eval sets, or a fixed training set); same arguments, same list."""
        rng = random.Random(f"{self.seed}/{self.split}/{seed_offset}")
        return [dict(self.example(rng, rng.randint(*n_people), rng.randint(*n_attrs), same_attrs=rng.random() < 0.5),
                     id=f"syn-{self.split}-{self.seed}-{seed_offset}-{i}") for i in range(n)]

    def lm_text(self, rng, n_people):
        """Plain biography text (one per line) for LM streams."""
        return self.example(rng, n_people, rng.randint(3, len(ATTRIBUTES)), same_attrs=False)["context"]


def synthetic_corpus(seed, n_chars):
    """Text to train the default tokenizer: every name and value, the QA template words,
    then biographies followed by questions and answers, until n_chars."""
    rng, syn = random.Random(seed), Synthetic(seed, "train")
    lines = [" ".join(FIRST_NAMES), " ".join(LAST_NAMES)] + [" ".join(v[0]) for v in ATTRIBUTES.values()]
    lines += [t.format(question="Q") + data.ANSWER_CUE + " A" for t in data.QA_TEMPLATES]
    n = sum(map(len, lines))
    while n < n_chars:
        ex = syn.example(rng, rng.randint(1, 4), rng.randint(1, len(ATTRIBUTES)), same_attrs=False, n_questions=3)
        asked = [f"{rng.choice(data.QA_TEMPLATES).format(question=q)[1:]}{data.ANSWER_CUE} {a}" for q, a in ex["qas"]]
        new = ex["chunks"] + asked
        lines += new
        n += sum(map(len, new))
    return "\n".join(lines)


def train_default_tokenizer(out_path, seed=0, vocab_size=1024, n_chars=400_000):
    """Train the default tokenizer (sentencepiece BPE) on synthetic_corpus into out_path: a .model
    file or a directory (then DIR/tokenizer.model). Deterministic: fixed input order, one thread,
    no sampling. Byte fallback covers any character; no dummy-prefix space and identity
    normalisation, so text round-trips exactly and spans tokenized apart concatenate cleanly."""
    out = Path(out_path)
    out = out if out.suffix == ".model" else out / "tokenizer.model"
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [line for line in synthetic_corpus(seed, n_chars).split("\n") if line]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=buf, model_type="bpe", vocab_size=vocab_size,
        character_coverage=1.0, byte_fallback=True, split_digits=False, num_threads=1, user_defined_symbols=["."],
        add_dummy_prefix=False, normalization_rule_name="identity", remove_extra_whitespaces=False, unk_id=0,
        bos_id=1, eos_id=2, pad_id=3, input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2)
    out.write_bytes(buf.getvalue())
    return data.load_tokenizer(out)


def base_path(init_from):
    """The HF checkpoint dir behind --init_from: itself, or the base of a run dir (a `--method base` run is its own:
    without config.json, or in a loop of run dirs, that dir, which train.check_files then refuses)."""
    path, seen = init_from or BASE_DIR, set()
    while os.path.exists(os.path.join(path, "run.json")) and not os.path.exists(os.path.join(path, "config.json")):
        run, seen = read_json(os.path.join(path, "run.json"))["train"], seen | {path}
        if run["method"] == "base" or (run["init_from"] or BASE_DIR) in seen:
            return path
        path = run["init_from"] or BASE_DIR
    return path


def is_tiny(init_from):
    """True when the base is one of ours (a `--method base` run dir): small-model defaults."""
    path = base_path(init_from)
    return path == BASE_DIR or os.path.exists(os.path.join(path, "run.json"))


def aided(cfg):
    """True when a run gets the aids: its base is tiny and --no_aids is not set."""
    return is_tiny(cfg.init_from) and not cfg.no_aids


def needs_training(init_from):
    """True when a run uses the shipped base and it is gone or short of its steps (Ctrl-C as a run trained it)."""
    if base_path(init_from) != BASE_DIR:
        return False
    if not all(os.path.exists(os.path.join(BASE_DIR, f)) for f in ("model.safetensors", "run.json")):
        return True
    run = read_json(os.path.join(BASE_DIR, "run.json"))
    return run["step"] < run["train"]["max_iters"]


# -----------------------------------------------------------------------------
# head 0's attention, read back from a pass (the base's attention supervision and aid 2)

def keep_attention_inputs(model, layers):
    """{layer: (x, cos, sin, mask, prefix_kv)}: the inputs of each of `layers`' attention in the last forward."""
    kept = {}
    for i in layers:
        model.model.layers[i].self_attn.register_forward_pre_hook(lambda m, args, i=i: kept.__setitem__(i, args))
    return kept


def head_log_attention(attn, inputs, rows, pos, keys_valid=None, n_memory=0):
    """(N, C + T) fp32 log attention probabilities of head 0 of `attn` from the queries (rows, pos)
    onto every key of their sequence, under the causal mask (and keys_valid (B, C + T)). The first
    C keys are memory: the layer's prefix K/V, or the first n_memory rows of x; pos counts the
    tokens after them. inputs: from keep_attention_inputs. SDPA returns no weights: q, k are recomputed.
    Rows repeat, so k is gathered by index_select: on more than one CPU thread the backward of k[rows]
    adds the repeats in no fixed order, and two identical runs would drift apart; index_select's does not."""
    x, cos, sin = (t.float() for t in inputs[:3])  # (B, T, d), (B, 1, T, hd) x 2
    prefix = inputs[4]  # the layer's prefix K/V, or None
    at = pos if prefix is not None else pos + n_memory  # the query's row of x
    q = attn.qkv_proj(x[rows, at], "q_proj")[:, :attn.hd]  # head 0
    k = attn.qkv_proj(x, "k_proj")[..., :attn.hd]  # its kv head
    if hasattr(attn, "q_norm"):
        q, k = attn.q_norm(q), attn.k_norm(k)
    q = apply_rope(q, cos[rows, 0, at], sin[rows, 0, at])  # (N, hd)
    k = apply_rope(k, cos[:, 0], sin[:, 0])  # (B, T, hd)
    if prefix is not None:
        k = torch.cat([prefix[0][:, 0].float(), k], 1)  # (B, C + T, hd), memory keys already rotated
    scores = torch.einsum("nd,ntd->nt", q, k.index_select(0, rows)) * attn.scale
    if attn.score_mod is not None:
        scores = attn.score_mod(scores, None, None, None, None)
    hidden = torch.arange(k.shape[1], device=x.device)[None] > (at + k.shape[1] - x.shape[1])[:, None]
    if keys_valid is not None:
        hidden = hidden | ~keys_valid[rows]
    return scores.masked_fill(hidden, -1e9).log_softmax(-1)


def attention_inputs(base, ids, layer):
    """What keep_attention_inputs keeps of `layer` in base(ids) (causal, no memory), without running
    `layer` or the ones after it: (x (B, T, d) after its input norm, cos, sin, mask None, prefix None)."""
    x = base.model.embed_tokens(ids)
    cos, sin = (t.to(x.dtype) for t in base.rope(torch.arange(ids.shape[1], device=ids.device).expand_as(ids)))
    for block in base.model.layers[:layer]:
        x, _ = block(x, cos, sin, [None, None], None)
    return base.model.layers[layer].input_layernorm(x), cos, sin, None, None


def attention_nll(attn, inputs, rows, pos, target, keys_valid=None):
    """Mean -log of the attention mass head 0 of `attn` puts from the queries (rows, pos) on target
    (N, S) bool; inputs, keys_valid as model.head_log_attention."""
    logp = head_log_attention(attn, inputs, rows, pos, keys_valid)
    return -logp.masked_fill(~target, -1e9).logsumexp(-1).mean()


def starts_of(seq, sub):
    """Every i where the list sub occurs in the list seq."""
    return [i for i in range(len(seq) - len(sub) + 1) if sub and seq[i:i + len(sub)] == sub]


# -----------------------------------------------------------------------------
# the tiny base: `--method base`

@dataclass
class BaseConfig:
    context_weight: float = 0.3   # loss weight of non-answer tokens (SPEC §2.6: the base learns QA faster)
    attn_weight: float = 1.0      # weight of the two attention-supervision losses (0 = off; see Base)
    qa_per_context: int = 4       # question-answer pairs appended to each training context
    d_model: int = 128            # tiny base width (from scratch only)
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 2048        # default sentencepiece BPE size (answers of 1-2 tokens)


class Base(torch.nn.Module):
    """`--method base`: the tiny Llama-config model trained from scratch on synthetic contexts followed by
    question-answer pairs (SPEC §2.6): CE on every token, answers weighted 1 and the rest ``context_weight``. Plus
    attention supervision (``attn_weight``; ours, as CE alone finds the circuit that picks the asked person only
    after >10^5 examples): -log of the attention mass head 0 puts on collate_base's keys, binding in layer 0 and
    pointing in the last two layers (the lower copy is one ATA's compression tokens, whose last-layer K/V precede the
    last layer, can learn to make: AttentionDistillation.writer_loss). 3,000 steps: fewer left its teacher short."""
    Config = BaseConfig
    objectives = ("lm",)
    TINY = dict(max_iters=3000, batch_size=16, lr=3e-3, weight_decay=0.1)

    @staticmethod
    def recipe(mcfg):  # no paper: TINY is its whole recipe (SPEC §2.6)
        return [dict(objective="lm", cite="SPEC §2.6", paper={})]

    @staticmethod
    def curriculum(frac):
        """At fraction frac of the run: (min, max) people, (min, max) attributes, examples per batch
        slot, ramp in [0, 1] (while < 1, everyone shares the same attributes: each is a distractor).
        The short stages draw 4 examples a slot: the name match is learned in examples, not steps."""
        if frac < 0.15:
            return (1, 1), (1, 1), 4, 0.0  # the copy: one person, one sentence
        if frac < 0.55:
            return (2, 2), (1, 1), 4, 0.0  # the name match: two people, one shared attribute
        ramp = min(1.0, (frac - 0.55) / 0.2)  # to 2-8 people, 1-6 attributes at 75 %
        return (2, 2 + round(6 * ramp)), (1, 1 + round(5 * ramp)), 1, ramp

    @staticmethod
    def check_config(cfg, bc):
        if min(bc.d_model, bc.n_layers, bc.n_heads, bc.qa_per_context) < 1 or bc.d_model % (2 * bc.n_heads) or \
                bc.n_layers * bc.d_model ** 2 > 1 << 26:  # (10^8 wide ran out of memory after the old base had gone)
            raise SystemExit(f"error: --d_model {bc.d_model}, --n_layers {bc.n_layers}, --n_heads {bc.n_heads}, "
                             f"--qa_per_context {bc.qa_per_context}: each >= 1, d_model a multiple of 2 x n_heads (RoPE"
                             " rotates head-size pairs), n_layers x d_model^2 at most 2^26 (trained from scratch here)")
        for flag, ok, want in (  # sentencepiece: 326 pieces are bytes, specials and characters; the corpus has ~3,700
                ("vocab_size", 512 <= bc.vocab_size <= 3500, "lie in [512, 3500] (pieces the synthetic corpus holds)"),
                ("context_weight", 0 <= bc.context_weight <= 1, "lie in [0, 1]"),
                ("attn_weight", 0 <= bc.attn_weight < math.inf, "be a number >= 0")):
            if not ok:
                raise SystemExit(f"error: --{flag} {getattr(bc, flag)} must {want}")

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.last = base, cfg, base.config.num_hidden_layers - 1
        supervised = (0, self.last - 1, self.last) if cfg.attn_weight > 0 else ()
        self.layer_inputs = keep_attention_inputs(base, supervised)

    def head_nll(self, layer, rows, pos, target):
        """attention_nll of head 0 of `layer` in the last forward."""
        return attention_nll(self.base.model.layers[layer].self_attn, self.layer_inputs[layer], rows, pos, target)

    def forward(self, batch, ratios):
        h = self.base(batch["ids"], output="hidden")
        loss, _ = self.base.ce(h, batch["labels"], batch["weights"])
        n = batch["weights"][batch["labels"] != -100].sum()
        if self.cfg.attn_weight > 0 and len(batch["bind_rows"]) and len(batch["point_rows"]):
            point = batch["point_rows"], batch["point_pos"], batch["point_keys"]
            aux = self.head_nll(0, batch["bind_rows"], batch["bind_pos"], batch["bind_keys"]) + \
                self.head_nll(self.last - 1, *point) + self.head_nll(self.last, *point)
            loss = loss + self.cfg.attn_weight * n * aux  # the caller divides by n
        return loss, n, {}


def init_base(out_dir, bc, seed, resume=False):
    """Tokenizer and a random-init model in out_dir for `--method base` from scratch; a dir trained before gets
    a new model of bc's shape (its tokenizer kept where bc.vocab_size matches it), except under --resume."""
    os.makedirs(out_dir, exist_ok=True)
    tok_path = os.path.join(out_dir, "tokenizer.model")
    tok = data.load_tokenizer(tok_path) if os.path.exists(tok_path) else None
    if tok is None or (not resume and tok.vocab_size != bc.vocab_size):
        tok = train_default_tokenizer(tok_path, seed=0, vocab_size=bc.vocab_size)
    if resume and os.path.exists(os.path.join(out_dir, "model.safetensors")):
        return tok
    mc = ModelConfig(vocab_size=tok.vocab_size, hidden_size=bc.d_model, intermediate_size=3 * bc.d_model,
                     num_hidden_layers=bc.n_layers, num_attention_heads=bc.n_heads, rope_theta=10000.0,
                     max_position_embeddings=2048, tie_word_embeddings=True,
                     bos_token_id=tok.bos_id, eos_token_id=list(tok.eos_ids))
    torch.manual_seed(seed)
    model = Transformer(mc)
    for n, p in model.named_parameters():  # GPT-2 style init
        if p.dim() == 2:
            deep = n.endswith(("o_proj.weight", "down_proj.weight"))
            torch.nn.init.normal_(p, std=0.02 / (math.sqrt(2 * mc.num_hidden_layers) if deep else 1))
    model.save_pretrained(out_dir)
    return tok


def collate_base(examples, tok, context_weight):
    """[BOS] context, then (prompt, answer) for every qa pair (the example's "template" words the
    first, the others rotate): next-token labels, answer tokens weighted 1, the rest context_weight.
    With "qa_people" (synthetic records), also Base's attention targets: bind_* (queries: each answer
    cue and the asked value in the context; keys: the asked person's last name in their biography or
    the question) and point_* (queries: the answer cue and each answer token; keys: the next answer
    token in the asked person's biography)."""
    seqs, weights, bind, point = [], [], [], []
    for b, ex in enumerate(examples):
        ids, w = [], []
        for i, (q, a) in enumerate(ex["qas"]):
            template = (ex["template"] + i) % len(data.QA_TEMPLATES)
            parts = data.format_qa(tok, ex["context"], q, a, template=template, chunks=ex.get("chunks"))
            if i == 0:
                ids += parts["bos"] + parts["context"]
                w += [context_weight] * (len(parts["bos"]) + len(parts["context"]))
                spans = [(s + len(parts["bos"]), e + len(parts["bos"])) for s, e in parts["chunk_spans"]]
            ids += parts["prompt"]
            cue = len(ids) - 1  # predicts the first answer token
            ids += parts["answer"]
            w += [context_weight] * len(parts["prompt"]) + [1.0] * len(parts["answer"])
            if "qa_people" in ex:
                lo, hi = spans[ex["chunks"].index(ex["qa_relevant"][i])]
                last = tok.encode(" " + ex["qa_people"][i].split()[-1], start=False)[0]
                names = [j for j in range(lo, hi) if ids[j] == last]
                values = [j for j in range(lo, hi) if ids[j] == parts["answer"][0]]
                asked = names + [j for j in range(cue - len(parts["prompt"]), cue) if ids[j] == last]
                bind += [(b, cue, asked)] + [(b, v, [j for j in names if j < v]) for v in values]
                point += [(b, cue + t, [v + t for v in values if ids[v + t] == token])
                          for t, token in enumerate(parts["answer"])]
        seqs.append(ids)
        weights.append(w)
    T = -(-max(len(s) for s in seqs) // 64) * 64
    batch = {"ids": data.pad_rows(seqs, tok.pad_id, T),  # (B, T): rounding up to a multiple of T is T
             "labels": data.pad_rows([s[1:] for s in seqs], -100, T),
             "weights": torch.tensor([w[1:] + [0.0] * (T + 1 - len(w)) for w in weights])}
    for name, queries in (("bind", bind), ("point", point)):
        queries = [qk for qk in queries if qk[2]]  # a value before its name has no key
        batch[f"{name}_rows"] = torch.tensor([qk[0] for qk in queries], dtype=torch.long)
        batch[f"{name}_pos"] = torch.tensor([qk[1] for qk in queries], dtype=torch.long)
        batch[f"{name}_keys"] = keys = torch.zeros(len(queries), T, dtype=torch.bool)
        for r, (_, _, js) in enumerate(queries):
            keys[r, js] = True
    return batch


# -----------------------------------------------------------------------------
# the compressors' synthetic batches: curriculum (aid 1), several questions (aid 3)

SHORT_STAGE = 0.3  # the compressors' curriculum keeps contexts short for this fraction of the run
SLOT_STAGE = 0.1  # aid 2 takes its per-slot form for this fraction of the run where a layout fixes the slots


def compressor_curriculum(frac):
    """Aid 1, as Base.curriculum: short contexts first (1-2 people, 1-3 attributes, 2 per slot, to
    SHORT_STAGE), where reading a value back out of memory is learned; then a ramp to the eval
    set's mix (half with distractor attributes) at 70 %."""
    if frac < SHORT_STAGE:
        return (1, 2), (1, 3), 2, 0.0
    ramp = min(1.0, (frac - SHORT_STAGE) / 0.4)
    if ramp == 1.0:
        return EVAL_PEOPLE, EVAL_ATTRS, 1, 1.0
    return (1, 2 + round(6 * ramp)), (1, 3 + round(3 * ramp)), 1, ramp


def synthetic_items(synth, rng, n, frac, kind, qa_per_context=1, aids=True):
    """n items of a step at fraction frac of the run: texts (kind "text"), the base's QA
    contexts (kind "base") or the compressors' (kind "qa", curriculum unless not aids)."""
    if kind == "text":
        return [synth.lm_text(rng, rng.randint(2, 8)) for _ in range(n)]
    if kind == "base":
        people, attrs, per_slot, ramp = Base.curriculum(frac)
    else:  # without aids, the curriculum's end (the eval set's mix) throughout
        people, attrs, per_slot, ramp = compressor_curriculum(frac if aids else 1.0)
    return [synth.example(rng, rng.randint(*people), rng.randint(*attrs), n_questions=qa_per_context,
                          same_attrs=ramp < 1 or rng.random() < 0.5) for _ in range(n * per_slot)]


QUESTIONS = 4  # QA pairs per context for the compressors that do not read the question (all but ATA)


def questions(method):
    """Aid 3's QA pairs per context for `method`: QUESTIONS for a compressor blind to the question, else 1."""
    return QUESTIONS if hasattr(method, "compress") and not getattr(method, "reads_question", False) else 1


def add_questions(batch, items, tok):
    """Aid 3: every QA pair of an item after the first is appended to its `qa` and `full` rows, as
    the base was trained (collate_base), so one encoder pass over a context teaches several answers."""
    for key in ("qa", "full"):
        rows, labels = [], []
        for b, ex in enumerate(items):
            n = int(batch[key + "_len"][b])
            ids, lab = batch[key][b, :n].tolist(), batch[key + "_labels"][b, :n].tolist()
            for i, (q, a) in enumerate(ex["qas"][1:], 1):
                parts = data.format_qa(tok, "", q, a, template=(ex["template"] + i) % len(data.QA_TEMPLATES))
                ids += parts["prompt"] + parts["answer"]
                lab += data._answer_labels(len(parts["prompt"]), parts["answer"])
            rows.append(ids)
            labels.append(lab)
        batch[key], batch[key + "_labels"] = data.pad_rows(rows, tok.pad_id, 8), data.pad_rows(labels, -100, 8)
        batch[key + "_len"] = torch.tensor([len(r) for r in rows])
    return batch


# -----------------------------------------------------------------------------
# aid 2: attention distillation

ATTN_KD = 1.0  # weight of the attention-distillation term
GIST_KV = 3.0  # weight of sentence_gist's K/V target (gist_kv_loss)


def next_gists(L):
    """sentence_gist layout L: ((B, T) the position of the first gist at or after each position (T:
    none), (B, T) the positions of its regular tokens in order: the context's first)."""
    is_gist, T = L["is_gist"], L["kind"].shape[1]
    next_gist = torch.where(is_gist, torch.arange(T, device=is_gist.device), T).flip(1).cummin(1).values.flip(1)
    return next_gist, torch.argsort((~L["is_token"]).to(torch.int8), dim=1, stable=True)


def gist_keys(L, context_len, width, n_gists):
    """sentence_gist: (B, width, N_g) the keys of layout L holding each context token: its
    sentence's gists (they follow its last token), or itself while its sentence is open."""
    T = L["kind"].shape[1]
    next_gist, order = next_gists(L)
    pos = order[:, :width]  # (B, width) the context tokens
    g = next_gist.gather(1, pos)[..., None]  # (B, width, 1)
    keys = torch.where(g < T, g + torch.arange(n_gists, device=g.device), pos[..., None])
    return keys.masked_fill((torch.arange(width, device=g.device) >= context_len[:, None])[..., None], -1)


def distills_attention(method):
    """Aid 2 applies to every compression method (not to the teacher or the base)."""
    return hasattr(method, "compress")


class AttentionDistillation:
    """Aid 2 (ours, not in any paper): the tiny base's head 0 of its last layer points each answer
    position at the context token to copy next (Base). Where the layout fixes the slots, that
    attention mass, summed over the context tokens each memory slot holds (method.token_slots), is the target
    of the decoder's head 0 over the slots in the run's first SLOT_STAGE; after it, and throughout
    where no slot map holds (token_slots None), the teacher head's output o = sum_j p_j v_j is:
        L += ATTN_KD * n * CE(teacher mass per slot, decoder attention over slots)
        L += ATTN_KD * n * mean_N |o - o_teacher|^2 / mean_N |o_teacher|^2
    with n the method's token count, so the term is per answer token like KD/CE. Without it the
    decoder sits on the answer prior for thousands of examples; supervising the writers' attention,
    or giving slots the answer's K/V, did not help (but sentence_gist's gists need it: gist_kv_loss).
    Per slot, then the output form, kept more of the teacher's gain than per slot throughout (pic at 4x:
    0.76-0.88, not 0.68-0.76, on 5 paired seeds) and than the output form from step 0, which stalled a seed."""

    def __init__(self, method, weight, max_iters=0):
        self.base = getattr(method, "dec", method.base)  # the decoder: pic's --decoder, else the shared base
        self.weight, self.slots = weight, getattr(method, "token_slots", None)
        self.slot_steps = round(SLOT_STAGE * max_iters) if self.slots is not None else 0
        self.adapter = method.dec_adapter  # the student's head 0 is read under the adapter it decodes with
        self.n_gists, self.tok = getattr(method.cfg, "gists", 0), getattr(method, "tok", None)
        self.last = self.base.config.num_hidden_layers - 1
        self.inputs = keep_attention_inputs(self.base, [self.last - 1, self.last])  # L-2: ATA's writer_loss
        self.hidden = method.run.objective == "kd"  # its teacher distils logits: teacher() returns them too

    @torch.no_grad()
    def teacher(self, batch):
        """The frozen base on batch["full"]: (its hidden states at the answer-predicting positions (N, d)
        under a kd objective (self.hidden), else None, (head 0's attention from them onto the context
        tokens (N, L), its output (N, hd), its inputs (B, S, d))). Else the pass stops at that attention."""
        rows, pos = (batch["full_labels"] != -100).nonzero(as_tuple=True)
        with self.base.adapter(None):
            if self.hidden:
                h, inputs = self.base(batch["full"], output="hidden")[rows, pos], self.inputs[self.last]
            else:  # the last layer's MLP and all but head 0 would be a quarter of the tiny base's pass
                h, inputs = None, attention_inputs(self.base, batch["full"], self.last)
            p = head_log_attention(self.base.model.layers[self.last].self_attn, inputs, rows, pos).exp()
            out = self.head_output(p, rows, inputs)
        start, L = len(batch["prefix"]), batch["context"].shape[1]
        p = F.pad(p[:, start:start + L], (0, max(0, start + L - p.shape[1])))
        in_context = torch.arange(L, device=p.device)[None] < batch["context_len"][rows, None]
        return h, (p * in_context, out, inputs[0])  # the prompt follows a short context in `full`: not memory

    def head_output(self, p, rows, inputs):
        """(N, hd) head 0's output sum_j p_j v_j from its attention p (N, C + T); inputs as keep_attention_inputs."""
        attn = self.base.model.layers[self.last].self_attn
        v = attn.qkv_proj(inputs[0].float(), "v_proj")[..., :attn.hd]  # (B, T, hd): head 0's kv head
        if inputs[4] is not None:  # K/V memory: its values come first
            v = torch.cat([inputs[4][1][:, 0].float(), v], 1)
        return torch.einsum("ns,nsd->nd", p, v.index_select(0, rows))  # not v[rows]: see head_log_attention

    def loss(self, teacher_attn, keys, rows, pos, keys_valid, n_memory=0):
        """ATTN_KD * CE(teacher mass per key, the student's head 0), mean over the queries (rows, pos)
        of the student pass just run. keys (B, L) or (B, L, G) long: the student key(s) holding each
        context token (mass split evenly over G; -1 = none); keys_valid (B, S), n_memory as head_log_attention."""
        S = keys_valid.shape[1]
        k = keys[rows] if keys.dim() == 3 else keys[rows][..., None]  # (N, L, G)
        mass = (teacher_attn / k.shape[-1])[..., None].expand_as(k)
        target = mass.new_zeros(len(rows), S + 1).scatter_add_(1, k.where(k >= 0, S).flatten(1), mass.flatten(1))
        target = target[:, :S] / target[:, :S].sum(-1, keepdim=True).clamp(min=1e-9)
        return self.weight * -(target * self.student_log_attention(rows, pos, keys_valid, n_memory)).sum(-1).mean()

    def student_log_attention(self, rows, pos, keys_valid, n_memory):
        """head_log_attention of the student pass just run, under the adapter it decoded with."""
        with self.base.adapter(self.adapter):
            return head_log_attention(self.base.model.layers[self.last].self_attn, self.inputs[self.last],
                                      rows, pos, keys_valid, n_memory)

    def memory_loss(self, teacher_head, memory, batch, r):
        """Aid 2 for a decoder that read [memory, qa] at ratio r; teacher_head from `teacher`."""
        qa_labels = batch["qa_labels"]
        rows, pos = (qa_labels != -100).nonzero(as_tuple=True)
        keys_valid = torch.cat([memory.mask, torch.ones_like(qa_labels, dtype=torch.bool)], 1)  # (B, C + T)
        teacher_attn, teacher_out = teacher_head[:2]
        if batch.get("step", 0) < self.slot_steps:  # a batch built by hand counts as step 0
            return self.loss(teacher_attn, self.slots(batch, memory, r), rows, pos, keys_valid, memory.n_slots)
        with self.base.adapter(self.adapter):
            p = self.student_log_attention(rows, pos, keys_valid, memory.n_slots).exp()
            out = self.head_output(p, rows, self.inputs[self.last])
        return self.weight * ((out - teacher_out).pow(2).sum(-1).mean() / teacher_out.pow(2).sum(-1).mean())

    def writer_loss(self, batch):
        """ATA's encoder pass just run: ATTN_KD * the mean over compression tokens c_j of -log the mass
        head 0 of layer L-2 puts from c_j on the answer's tokens in the encoder prompt, where Base
        points too; c_j's last-layer K/V (computed before the last layer's copy) then carry the answer.
        Without it ATA kept 0.01 of the teacher's gain. Prompts without the answer's tokens are skipped."""
        ids, layer = batch["enc_ids"], self.last - 1
        (B, T), S = ids.shape, self.inputs[layer][0].shape[1]  # S = T + k_max
        keys = torch.zeros(B, S, dtype=torch.bool, device=ids.device)
        for b in range(B):
            answer = [t for t in batch["qa_labels"][b].tolist() if t != -100 and t not in self.tok.eos_ids]
            for i in starts_of(ids[b].tolist(), answer):
                keys[b, i:i + len(answer)] = True
        found = keys.any(1).nonzero(as_tuple=True)[0]
        if not len(found):
            return 0.0
        rows, pos = found.repeat_interleave(S - T), torch.arange(T, S, device=ids.device).repeat(len(found))
        keys_valid = torch.arange(S, device=ids.device)[None] >= T - batch["enc_len"][:, None]
        keys_valid[:, T:] = True  # (B, S): the left-padded prompt, then c_1..c_kmax
        with self.base.adapter("encoder"):
            nll = attention_nll(self.base.model.layers[layer].self_attn, self.inputs[layer], rows, pos, keys[rows],
                                keys_valid)
        return self.weight * nll

    def layout_loss(self, teacher_head, L, batch):
        """`loss` for sentence_gist's pass over layout L: an answer sees the sink, the gists, its open sentence."""
        teacher_attn = teacher_head[0]
        rows, pos = (L["labels"] != -100).nonzero(as_tuple=True)
        seen = (L["kind"] > 0) | (L["is_token"] & (L["sentence"] == L["open"][:, None]))
        keys = gist_keys(L, batch["context_len"], batch["context"].shape[1], self.n_gists)
        return self.loss(teacher_attn, keys, rows, pos, seen) + self.gist_kv_loss(teacher_head[2], L, batch)

    def gist_kv_loss(self, x_teacher, L, batch):
        """sentence_gist: the gists that close each asked answer's sentence learn the last-layer K and V
        (before RoPE) the teacher gives the answer's tokens (gist_answer_pairs), which the frozen base
        answers from: GIST_KV * |kv - kv_teacher|^2 / |kv_teacher|^2, mean over those gists."""
        rows, gists, targets = gist_answer_pairs(L, batch, self.tok, self.n_gists)
        if not rows:
            return 0.0
        x = self.inputs[self.last][0]  # (B, T, d)
        flat = torch.tensor(rows, device=x.device) * x.shape[1] + torch.tensor(gists, device=x.device)
        x = x.flatten(0, 1).index_select(0, flat).float()  # pairs repeat (head_log_attention says why)
        attn = self.base.model.layers[self.last].self_attn
        with self.base.adapter(self.adapter):
            kv = torch.cat([attn.qkv_proj(x, "k_proj"), attn.qkv_proj(x, "v_proj")], -1)
        with torch.no_grad(), self.base.adapter(None):
            x_t = x_teacher[rows, targets].float()
            kv_teacher = torch.cat([attn.qkv_proj(x_t, "k_proj"), attn.qkv_proj(x_t, "v_proj")], -1)
        return GIST_KV * (kv - kv_teacher).pow(2).sum(-1).mean() / kv_teacher.pow(2).sum(-1).mean()


def gist_answer_pairs(L, batch, tok, n_gists):
    """For every QA pair of every record (aid 3's, else its first): the N_g gists of layout L that
    close the sentence holding the answer's first occurrence in the context, each paired with an
    answer token in batch["full"] (gist j: token min(j, len - 1)). -> (rows, gist positions,
    token positions), lists of equal length."""
    next_gist, order = next_gists(L)
    T, P, rows, gists, targets = L["kind"].shape[1], len(batch["prefix"]), [], [], []
    for b, rec in enumerate(batch["records"]):
        ctx = batch["context"][b, :batch["context_len"][b]].tolist()
        for _, answer in rec.get("qas") or [(rec["question"], a) for a in rec["answers"][:1]]:
            ans = tok.encode(" " + answer, start=False)
            s = next(iter(starts_of(ctx, ans)), None)
            g = T if s is None else int(next_gist[b, order[b, s + len(ans) - 1]])
            if g < T:
                rows += [b] * n_gists
                gists += [g + j for j in range(n_gists)]
                targets += [P + s + min(j, len(ans) - 1) for j in range(n_gists)]
    return rows, gists, targets


# -----------------------------------------------------------------------------
# aid 4: a trainable decoder for the methods whose paper freezes it

def add_decoder_adapter(method):
    """Aid 4: a LoRA adapter `decoder` (the method's own rank and alpha) on the frozen decoder."""
    if getattr(method, "frozen_decoder", False) and method.dec_adapter is None:
        decoder = getattr(method, "dec", method.base)  # pic may hold a separate decoder
        decoder.add_adapter("decoder", method.cfg.lora_r or 16, method.cfg.lora_alpha)
        method.dec_adapter = "decoder"


def w_from_identity(method):
    """Aid 5: meanpool's W starts at I, the encoder's scale, not at the embeddings' (the real path's s I:
    meanpool.py); a method's `proj` that does not start as s I (s != 0) keeps its start."""
    w = getattr(getattr(method, "proj", None), "weight", None)
    if w is not None and w.shape[0] == w.shape[1] and w[0, 0] and torch.equal(w, w[0, 0] * torch.eye(len(w)).to(w)):
        torch.nn.init.eye_(w)
