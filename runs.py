"""A run: its flags, its method, its checkpoint files (SPEC §2.4-2.5). train.py writes runs
and eval.py reads them (`load_run`); both import this file, neither imports the other."""
import inspect
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, fields

import torch
from safetensors.torch import load_file, save_file

import ata
import data
import meanpool
import pic
import sac
import sentence_gist
import tiny
from model import Transformer


@dataclass
class TrainConfig:
    # --- run
    method: str = "meanpool"   # base | teacher | meanpool | pic | sentence_gist | sac | ata
    objective: str = ""        # "" = the method's first objective; see --help of each method
    ratio: str = "4,8,16"      # one compression ratio, or a set trained together: 4,8,16
    init_from: str = ""        # HF checkpoint dir or one of our run dirs; "" = tiny_base/ (shipped)
    teacher: str = ""          # a --method teacher run dir whose adapter is merged into the base
    data: str = ""             # QA / text file (SQuAD, MRQA, HotpotQA, MS MARCO, JSONL, .txt); "" = synthetic
    eval_data: str = ""        # held-out file for the final evaluation; "" = synthetic test split
    skip_bad: bool = False     # skip (and count) malformed records instead of stopping
    hotpot_distractors: bool = False  # HotpotQA: keep all ten paragraphs as context (for ata)
    prompt: str = "auto"       # QA prompt: auto (the checkpoint's chat_template; none: plain) | plain | chatml | llama3 | gemma
    out_dir: str = ""          # "" = out/<method>
    no_aids: bool = False      # tiny base only: none of tiny.py's aids (curriculum, attention KD, decoder LoRA)
    pretrain: int = 0          # first N steps of the paper's pretraining (pic ae+lm, sac lm, ata rel), then qa from it
    # --- optimisation (0 = the method's default: paper values on real checkpoints, small ones on the tiny base)
    max_iters: int = 0
    batch_size: int = 0
    grad_accum: int = 1        # micro-batches a step: its examples sorted by context length (less padding)
    lr: float = 0.0
    min_lr_frac: float = 0.1   # cosine decays to lr * min_lr_frac
    warmup_frac: float = 0.05
    warmup_iters: int = 0      # linear warmup steps where a paper gives a count; 0 = warmup_frac * max_iters
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_context: int = 1024
    max_answer: int = 64
    # --- logging / eval
    eval_interval: int = 0     # validation loss every N steps (0 = 4 times per run)
    eval_examples: int = 200   # held-out QA examples for the final EM/F1 (0: train only, e.g. a pretraining stage)
    eval_ratio: str = ""       # ratios the evaluation reads ("" = --ratio): a model trained at 5 can be read at 5,15
    # --- system
    device: str = ""           # "" = cuda if available else cpu
    dtype: str = ""            # float32 | bfloat16 ("" = bfloat16 autocast on CUDA, float32 on CPU)
    compile: bool = False      # torch.compile the model and the losses
    grad_ckpt: bool = False    # activation checkpointing per decoder layer: large models fit, ~1/3 more compute
    seed: int = 1337
    resume: bool = False
    quiet: bool = False        # no progress bar

    @property
    def pad_multiple(self):  # batch lengths round up to it: compiled graphs serve many lengths, eager pays for padding
        return 64 if self.compile else 8


# -----------------------------------------------------------------------------
# command line: the dataclass fields are the flags (unknown flag or bad type: one-line error)

USAGE = "python train.py --method NAME [--flag value ...]"


def parse_args(argv, *configs, positional=None, usage=USAGE):
    """--key=value or --key value over the fields of several dataclasses; bools are switches (--compile);
    bare arguments are joined into the field named `positional`. Returns (instances, set of explicit keys)."""
    known = {f.name: (c, f.type) for c in configs for f in fields(c)}
    values, explicit, args = {}, set(), list(argv)
    while args:
        arg = args.pop(0)
        if arg in ("-h", "--help"):
            print_help(configs, usage)
            sys.exit(0)
        if not arg.startswith("--"):
            if not positional:
                raise SystemExit(f"error: unexpected argument {arg!r}; flags look like --method=pic")
            values[positional] = (values.get(positional, "") + " " + arg).strip()
            continue
        key, eq, val = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in known:
            raise SystemExit(f"error: unknown flag --{key}; see python train.py --help")
        typ = known[key][1]
        if not eq and not args and typ is not bool:
            raise SystemExit(f"error: flag --{key} needs a value")
        if not eq:  # --flag value, or a bare switch
            val = "true" if typ is bool else args.pop(0)
        if typ is bool and val.lower() not in ("true", "false", "1", "0"):
            raise SystemExit(f"error: --{key} is a switch; got {val!r}")
        try:
            values[key] = val.lower() in ("true", "1") if typ is bool else typ(val)
        except ValueError:
            raise SystemExit(f"error: --{key} expects {typ.__name__}, got {val!r}")
        explicit.add(key)
    return [c(**{k: v for k, v in values.items() if known[k][0] is c}) for c in configs], explicit


def print_help(configs, usage=USAGE):
    """Every field of `configs` as a flag, with its default and its source comment."""
    print(f"usage: {usage}\n")
    for c in configs:
        print(f"{c.__name__} ({os.path.basename(inspect.getsourcefile(c))}):")
        src = inspect.getsource(c).splitlines()
        for f in fields(c):
            note = next((l.partition("#")[2].strip() for l in src if l.strip().startswith(f"{f.name}:")), "")
            print(f"  --{f.name:<18} {str(f.default)!r:<14} {note}")


def ratios_of(spec, flag="ratio"):
    try:
        rs = [int(r) for r in str(spec).split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"error: --{flag} {spec!r} must be an integer or a comma list like 4,8,16")
    if not rs or any(r <= 0 for r in rs):
        raise SystemExit(f"error: --{flag} {spec!r}: every ratio must be a positive integer")
    return rs


# -----------------------------------------------------------------------------
# the teacher (the non-compressing method beside tiny.Base), and the method registry

@dataclass
class TeacherConfig:
    lora_r: int = 16
    lora_alpha: int = 16


class Teacher(torch.nn.Module):
    """`--method teacher`: `sft` of a real checkpoint with a `teacher` LoRA adapter on full-context QA
    (meanpool_multi_ratio §5.1: finetuned first, then frozen). Compressors merge it into the base with --teacher."""
    objectives = ("sft",)
    TINY = dict(max_iters=200, batch_size=16, lr=1e-3)

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base = base
        base.add_adapter("teacher", cfg.lora_r, cfg.lora_alpha)

    def forward(self, batch, ratios):
        with self.base.adapter("teacher"):
            h = self.base(batch["full"], output="hidden")
        loss, n = self.base.ce(h, batch["full_labels"])
        return loss, n, {}


def method_registry():
    """The one map from --method names to classes (SPEC §2.4)."""
    return {"base": tiny.Base, "teacher": Teacher, "meanpool": meanpool.MeanPool, "pic": pic.PIC,
            "sentence_gist": sentence_gist.SentenceGist, "sac": sac.SAC, "ata": ata.ATA}


def method_config(cls):
    return {tiny.Base: tiny.BaseConfig, Teacher: TeacherConfig}.get(cls, getattr(cls, "Config", None))


# -----------------------------------------------------------------------------
# building a run: tokenizer, base model, method

def load_base(cfg, device, dtype):
    """(tokenizer, base Transformer) for cfg.init_from (an HF dir or a run dir), with the
    --teacher adapter merged in: the teacher is the frozen base from here on."""
    path = tiny.base_path(cfg.init_from)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(f"error: --init_from {path!r} is not an HF checkpoint dir (no config.json)")
    tok = data.load_tokenizer(path)
    base = Transformer.from_pretrained(path, dtype=dtype, device=device)
    if cfg.teacher:
        adapter = os.path.join(cfg.teacher, "teacher")
        if not os.path.exists(os.path.join(adapter, "adapter_config.json")):
            raise SystemExit(f"error: --teacher {cfg.teacher!r} has no teacher/adapter_config.json")
        base.load_adapter(adapter, "teacher")
        base.merge_adapter("teacher")
    return tok, base


def build(cfg, mcfg, device, dtype):
    tok, base = load_base(cfg, device, dtype)
    base.requires_grad_(cfg.method == "base")
    method = method_registry()[cfg.method](base, mcfg, tok, cfg)
    if tiny.aided(cfg):
        tiny.add_decoder_adapter(method)
    method = method.to(device)
    for m in method.modules():  # the base and any separate encoder / decoder (pic)
        if isinstance(m, Transformer):
            m.grad_ckpt = cfg.grad_ckpt
    if cfg.method != "base" and first_stage(cfg.init_from, cfg.method):
        load_checkpoint(cfg.init_from, method)  # a second stage starts from the first (pic, ata, sentence_gist)
    return tok, base, method


def first_stage(init_from, method):
    """run.json of the run dir `init_from` when it is an earlier stage of the same method, else None."""
    path = os.path.join(init_from, "run.json")
    if not init_from or not os.path.exists(path):
        return None
    state = json.load(open(path))
    return state if state["train"]["method"] == method else None


def inherit_first_stage(cfg, mcfg, explicit, cls):
    """A second stage runs under the first stage's method config, which shaped and trained its tensors (a
    pic memory table of --max_mem rows, an encoder pretrained with --mask causal). A flag given with another
    value is a one-line error, except the stage's own (cls.STAGE_FLAGS: gist's --stage)."""
    first = first_stage(cfg.init_from, cfg.method)
    for key, val in (first["method"] if first else {}).items():
        if key in getattr(cls, "STAGE_FLAGS", ()) or not hasattr(mcfg, key):
            continue
        if key in explicit and getattr(mcfg, key) != val:
            raise SystemExit(f"error: --{key} {getattr(mcfg, key)!r} conflicts with the first stage "
                             f"{cfg.init_from} ({key}={val!r}); drop the flag to inherit it")
        setattr(mcfg, key, val)


def apply_defaults(cfg, mcfg, explicit, cls):
    """0 = method default: on the tiny base the method's TINY values, on real checkpoints the
    paper's (PAPER, and STAGES[--stage] where a method has stages)."""
    small = getattr(cls, "TINY", {}) if tiny.is_tiny(cfg.init_from) or cfg.method == "base" else {}
    paper = {**getattr(cls, "PAPER", {}), **getattr(cls, "STAGES", {}).get(getattr(mcfg, "stage", None), {})}
    for key, val in {**paper, **small}.items():
        if key not in explicit:
            setattr(cfg if hasattr(cfg, key) else mcfg, key, val)
    if "ratio" in explicit and "eval_ratio" not in explicit:
        cfg.eval_ratio = ""  # a method's reading ratios go with its default --ratio
    cfg.max_iters = cfg.max_iters or 1000
    cfg.batch_size = cfg.batch_size or 16
    cfg.lr = cfg.lr or 1e-4
    cfg.out_dir = cfg.out_dir or os.path.join("out", cfg.method)
    if not cfg.objective:
        cfg.objective = cls.default_objective(mcfg) if hasattr(cls, "default_objective") else cls.objectives[0]
    if cfg.objective not in cls.objectives:
        raise SystemExit(f"error: --objective {cfg.objective!r} does not apply to --method {cfg.method}; "
                         f"choose from {', '.join(cls.objectives)}")
    if cfg.pretrain and (cfg.objective != "qa" or not hasattr(cls, "pretraining")):
        if "pretrain" in explicit:
            raise SystemExit(f"error: --pretrain runs a pretraining stage before qa; --method {cfg.method} "
                             f"--objective {cfg.objective} has none")
        cfg.pretrain = 0  # a TINY pretrain precedes qa only (pic --mem single distils, as meanpool §5.1's tokens)


def read_records(path, cfg, stats=None):
    return data.read_dataset(path, distractors=cfg.hotpot_distractors, skip_bad=cfg.skip_bad, stats=stats)


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


# -----------------------------------------------------------------------------
# checkpoints: safetensors + JSON, written atomically (temp file, fsync, rename)

def atomic_write(path, write):
    tmp = path + ".tmp"
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(out_dir, method, opt, step, cfg, mcfg, flags=()):
    """ckpt-<step>.safetensors (trainable tensors), optim-<step>.safetensors (AdamW state, torch RNG), then run.json
    naming them: its rename is the commit point, so a kill leaves the previous one whole. Older files go after,
    with a metrics.json (eval.py's cache) from an earlier run in the same dir."""
    os.makedirs(out_dir, exist_ok=True)
    params = {n: p.detach().contiguous().cpu() for n, p in method.named_parameters() if p.requires_grad}
    opt_state = opt.state_dict()  # its param_groups and state name the parameters 0, 1, ... in group order
    optim = {f"{i}::{k}": v.detach().contiguous().cpu() for i, s in opt_state["state"].items() for k, v in s.items()}
    optim["rng::torch"] = torch.get_rng_state()
    files = {"ckpt": f"ckpt-{step:07d}.safetensors", "optim": f"optim-{step:07d}.safetensors"}
    atomic_write(os.path.join(out_dir, files["ckpt"]), lambda p: save_file(params, p))
    atomic_write(os.path.join(out_dir, files["optim"]), lambda p: save_file(optim, p))
    if cfg.method == "base":  # the base run dir is also an HF checkpoint dir
        hf = method.base.base_state()
        atomic_write(os.path.join(out_dir, "model.safetensors"), lambda p: save_file(hf, p, metadata={"format": "pt"}))
    if cfg.method == "teacher":  # PEFT format, for --teacher and for peft users
        method.base.save_adapter("teacher", os.path.join(out_dir, "teacher"))
    state = {"step": step, "files": files, "train": asdict(cfg), "method": asdict(mcfg), "flags": sorted(flags),
             "param_groups": opt_state["param_groups"], "python_rng": list(random.getstate()[1])}
    atomic_write(os.path.join(out_dir, "run.json"), lambda p: json.dump(state, open(p, "w"), indent=1))
    for f in os.listdir(out_dir):  # and eval.py's metrics.json, which scored the checkpoint before this one
        if (f.startswith(("ckpt-", "optim-")) and f not in files.values()) or f == "metrics.json":
            os.remove(os.path.join(out_dir, f))


def load_checkpoint(out_dir, method, opt=None):
    """Trainable tensors (and optimizer state, RNG) of a run dir; returns the step."""
    state = json.load(open(os.path.join(out_dir, "run.json")))
    params = {n: p for n, p in method.named_parameters() if p.requires_grad or opt is None}  # --resume: trainable only
    tensors = load_file(os.path.join(out_dir, state["files"]["ckpt"]))
    unknown = [k for k in tensors if k not in params]
    if unknown:
        raise SystemExit(f"error: {out_dir}: checkpoint tensors {unknown[:5]} do not match this method's parameters")
    with torch.no_grad():
        for k, v in tensors.items():
            params[k].copy_(v)
    if opt is not None:
        optim = {}
        for key, v in load_file(os.path.join(out_dir, state["files"]["optim"])).items():
            i, _, slot = key.partition("::")
            optim.setdefault(i, {})[slot] = v
        torch.set_rng_state(optim.pop("rng")["torch"])
        if not all(i.isdigit() for i in optim):  # older runs keyed it by parameter name
            raise SystemExit(f"error: {out_dir}: optimizer state in an older format; --resume needs a newer checkpoint")
        opt.load_state_dict({"state": {int(i): s for i, s in optim.items()}, "param_groups": state["param_groups"]})
        random.setstate((3, tuple(state["python_rng"]), None))
    return state["step"]


def load_run(run_dir, device="cpu", dtype=torch.float32):
    """(cfg, mcfg, tok, base, method) of a finished run, ready for eval."""
    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path):
        raise SystemExit(f"error: {run_dir!r} is not a run dir (no run.json)")
    try:
        state = json.load(open(path))
    except json.JSONDecodeError as e:
        raise SystemExit(f"error: {path}: corrupt run.json ({e})")
    methods = method_registry()
    name = state["train"]["method"]
    if name not in methods:
        raise SystemExit(f"error: {run_dir}: unknown method {name!r}; known: {', '.join(methods)}")
    cfg = TrainConfig(**state["train"])
    mcfg = method_config(methods[name])(**state["method"])
    if name == "base":
        cfg.init_from = run_dir
    tok, base, method = build(cfg, mcfg, device, dtype)
    if name != "base":
        load_checkpoint(run_dir, method)
    method.eval()
    return cfg, mcfg, tok, base, method
