"""A run: its flags, its method, its checkpoint files (SPEC §2.4-2.5). train.py writes runs
and eval.py reads them (`load_run`); both import this file, neither imports the other."""
import copy
import inspect
import json
import os
import random
import sys
from dataclasses import asdict, dataclass, field, fields, replace

import torch
from safetensors.torch import save_file

import ata
import data
import meanpool
import pic
import sac
import sentence_gist
import tiny
from model import Transformer, read_json, read_tensors


@dataclass
class TrainConfig:
    # --- run
    method: str = "meanpool"   # base | teacher | meanpool | pic | sentence_gist | sac | ata
    objective: str = ""        # "" = every stage of the method's recipe; a name: its stages alone
    ratio: str = "4,8,16"      # one compression ratio, or a set trained together: 4,8,16
    init_from: str = ""        # HF checkpoint dir or one of our run dirs; "" = tiny_base/ (shipped)
    teacher: str = ""          # a --method teacher run dir whose adapter is merged into the base
    data: str = ""             # QA / text file (SQuAD, MRQA, HotpotQA, MS MARCO, JSONL, .txt); "" = synthetic
    eval_data: str = ""        # held-out file for validation and the final evaluation; "" = synthetic test split
    skip_bad: bool = False     # skip (and count) malformed records instead of stopping
    hotpot_distractors: bool = False  # HotpotQA: keep all ten paragraphs as context (for ata)
    prompt: str = "auto"       # QA prompt: auto (the checkpoint's chat_template; none: plain) | plain | chatml | llama3 | gemma | sac
    out_dir: str = ""          # "" = out/<method>
    no_aids: bool = False      # tiny base only: no aids (tiny.py), the papers' recipes at its steps, batch, lr, ratios
    pretrain: int = 0          # steps of the recipe's first stage (pic ae+lm, sac lm, ata rel, gist 1); 0 skips it; unset: the recipe's
    pretrain_data: str = ""    # text for the text pretraining stages (pic ae+lm, sac lm, gist lm); "" = the contexts of --data
    # --- optimisation (0 = the method's default: paper values on real checkpoints, small ones on the tiny base)
    max_iters: int = 0         # steps; with several stages, shared by them in the recipe's proportion (--pretrain aside)
    batch_size: int = 0        # the global batch: examples a step over all ranks and --grad_accum micro-batches
    grad_accum: int = 1        # micro-batches a step per rank: its examples sorted by context length (less padding)
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
        rs = [int(r) for r in str(spec).split(",")]  # "4,,8" and "4," are errors, not 4,8 and 4
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
    (meanpool_multi_ratio §5.1: finetuned first, then frozen; Table 6 trains "all the models ... including the
    teacher"). Compressors merge it into the base with --teacher."""
    objectives = ("sft",)
    TINY = dict(max_iters=200, batch_size=16, lr=1e-3)

    @staticmethod
    def recipe(mcfg):
        return [dict(objective="sft", cite="meanpool_multi_ratio Table 6", paper=meanpool.TABLE6)]

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


def check_inputs(cfg, mcfg):
    """The files a run names, looked at before any work: one line naming the flag and file that is wrong. Their
    contents are checked where they are read (data before the model, the model before the first step)."""
    for flag in ("data", "eval_data", "pretrain_data"):
        path = getattr(cfg, flag)
        if path and not os.path.isfile(path):
            raise SystemExit(f"error: --{flag} {path!r}: no such file")
    for flag, path in (("init_from", tiny.base_path(cfg.init_from)), ("encoder", getattr(mcfg, "encoder", "")),
                       ("decoder", getattr(mcfg, "decoder", ""))):
        if path and not os.path.isfile(os.path.join(path, "config.json")) and not tiny.needs_training(path):
            raise SystemExit(f"error: --{flag} {path!r} is not an HF checkpoint dir (no config.json)")
    if cfg.teacher and not os.path.isfile(os.path.join(cfg.teacher, "teacher", "adapter_config.json")):
        raise SystemExit(f"error: --teacher {cfg.teacher!r} has no teacher/adapter_config.json")


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
    state = read_json(path)
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


# -----------------------------------------------------------------------------
# the recipe: each paper's stages and values, resolved once (flag > recipe > dataclass default)

@dataclass
class Stage:
    """One training stage of a method's recipe: its objective, the values its paper gives (cite: where) and
    the values we chose where the paper is silent (`ours`; the method's docstring says why)."""
    objective: str
    cite: str
    paper: dict
    ours: dict = field(default_factory=dict)
    official: dict = field(default_factory=dict)  # from the authors' code, where the paper is silent
    name: str = "pretrain"  # its run dir under --out_dir when a later stage follows


# what --no_aids keeps of the tiny recipe: a 1.1M-parameter base on a CPU needs its own steps, batch and lr
SCALE = ("max_iters", "batch_size", "grad_accum", "lr", "warmup_iters", "warmup_frac", "ratio", "eval_ratio")
FALLBACK = dict(max_iters=1000, batch_size=16, lr=1e-4)  # a recipe that names none of these (none does today)
RECIPE_KEYS = ("objective", "ratio", "eval_ratio", "max_iters", "batch_size", "grad_accum", "lr", "min_lr_frac",
               "warmup_frac", "warmup_iters", "weight_decay", "grad_clip", "max_context", "max_answer", "hotpot_distractors")


def paper_stages(cls, mcfg):
    return [Stage(**stage) for stage in cls.recipe(mcfg)]


def split_steps(total, weights):
    """total steps over stages in proportion to weights, each at least 1, summing to total (largest remainder)."""
    shares = [total * w / sum(weights) for w in weights]
    steps = [max(1, int(x)) for x in shares]
    for i in sorted(range(len(shares)), key=lambda i: int(shares[i]) - shares[i])[:max(0, total - sum(steps))]:
        steps[i] += 1
    return steps


def tiny_stages(cls, mcfg, pretrain=None):
    """The tiny base's recipe: TINY's values over the paper's last stage (TINY's objective may change it), and the
    paper's first stage before it for `pretrain` steps (a --pretrain flag, else TINY's: pic ae+lm 100, then qa)."""
    paper, small = paper_stages(cls, mcfg), dict(cls.TINY)
    objective, tiny_pretrain = small.pop("objective", None), small.pop("pretrain", 0)
    pretrain = tiny_pretrain if pretrain is None else pretrain
    if "stage" in small:  # sentence_gist: one of its paper's stages
        last = next(s for s in paper if s.paper.get("stage") == small["stage"])
    else:
        last = next((s for s in paper if s.objective == objective), paper[-1])
    last = Stage(objective or last.objective, "tiny", {**last.ours, **last.official, **last.paper, **small}, name=last.name)
    if not pretrain or len(paper) < 2:
        return [last]
    first = paper[0]
    return [Stage(first.objective, "tiny", {**first.ours, **first.official, **first.paper, **small, "max_iters": pretrain}),
            last]


def resolve(cfg, mcfg, explicit, cls, world=1):
    """The run's stages as [(cfg, mcfg, sources)], sources naming where each value came from, in this order:
    1. a flag given on the command line (it holds in every stage);
    2. on a tiny base (tiny.py's): the method's TINY values (tiny_stages); with --no_aids the paper's stages and
       values, but for what SCALE lists, taken from TINY (steps shared as below);
    3. on a real checkpoint: the paper's stages (cls.recipe): the values its paper states, then ours;
    4. the dataclass defaults.
    Which stages run: --objective those with that objective (or the last, with it), sentence_gist's --stage that
    one; --pretrain N runs the first of several for N steps (0: not at all); --max_iters N is shared by the other
    stages in their recipe's proportion (each at least one step). --batch_size is the global batch: ranks x --grad_accum micro-batches. A stage
    before the last trains into OUT_DIR/<its name>, and the next starts from it; --init_from such a dir runs the
    stages after it. cfg and mcfg become the last stage's (cfg.pretrain: the steps of the stages before it)."""
    small = tiny.is_tiny(cfg.init_from) or cfg.method == "base"
    if small and not cfg.no_aids:
        stages, source = tiny_stages(cls, mcfg, cfg.pretrain if "pretrain" in explicit else None), "tiny"
    else:
        stages, source = paper_stages(cls, mcfg), "paper"
        if small:  # --no_aids: the paper's recipe at the tiny base's scale
            scaled = tiny_stages(cls, mcfg)
            scale = {k: v for k, v in scaled[-1].paper.items() if k in SCALE and k != "max_iters"}
            steps = split_steps(sum(s.paper.get("max_iters", 1) for s in scaled),
                                [s.paper.get("max_iters", 1) for s in stages])
            stages = [replace(s, paper={**s.paper, **scale, "max_iters": n}) for s, n in zip(stages, steps)]
    done = first_stage(cfg.init_from, cfg.method)  # --init_from an earlier stage's run dir: the stages after it
    if done and any(s.objective == done["train"]["objective"] for s in stages[:-1]):
        stages = stages[[s.objective for s in stages].index(done["train"]["objective"]) + 1:]
    if "objective" in explicit:  # its stages (sentence_gist: all three), else the last one with this objective
        stages = [s for s in stages if s.objective == cfg.objective] or \
            [replace(stages[-1], objective=cfg.objective)]
    if "stage" in explicit:  # sentence_gist: one of its paper's stages
        stages = [s for s in stages if s.paper.get("stage") == mcfg.stage] or stages[-1:]
    if "pretrain" in explicit:
        if cfg.pretrain and len(stages) < 2:
            raise SystemExit(f"error: --pretrain runs a pretraining stage before the last; --method {cfg.method} "
                             f"--objective {stages[-1].objective} has none")
        stages = stages[1:] if cfg.pretrain == 0 and len(stages) > 1 else stages
    steps = [s.paper.get("max_iters", s.ours.get("max_iters", FALLBACK["max_iters"])) for s in stages]
    fixed = 1 if "pretrain" in explicit and cfg.pretrain else 0
    if fixed:
        steps[0] = cfg.pretrain
    if "max_iters" in explicit:
        steps[fixed:] = split_steps(cfg.max_iters, steps[fixed:])
    out_dir = cfg.out_dir or os.path.join("out", cfg.method)
    resolved, init_from = [], cfg.init_from
    for i, (stage, n) in enumerate(zip(stages, steps)):
        c, m, sources = copy.deepcopy(cfg), copy.deepcopy(mcfg), {}
        stage_source = source if source == "tiny" else f"paper ({stage.cite})"
        for values, origin in ((FALLBACK, "default"), (stage.ours, "ours"), (stage.official, "official code"),
                               (stage.paper, stage_source)):
            for key, val in values.items():
                if key not in explicit and (hasattr(c, key) or hasattr(m, key)):
                    setattr(c if hasattr(c, key) else m, key, val)
                    sources[key] = origin
        sources.update({key: "flag" for key in explicit})
        c.objective, c.max_iters = stage.objective, n
        sources["objective"] = "flag" if "objective" in explicit else stage_source
        if fixed and i == 0:
            sources["max_iters"] = "flag (--pretrain)"
        elif "max_iters" in explicit:
            sources["max_iters"] = "flag (--max_iters, shared by the stages)" if len(stages) > 1 else "flag"
        if "ratio" in explicit and "eval_ratio" not in explicit:
            c.eval_ratio = ""  # a method's reading ratios go with its default --ratio
        c.pretrain, c.init_from = 0, init_from
        if i < len(stages) - 1:
            c.eval_examples = 0  # the last stage is the one evaluated
        c.out_dir = out_dir if i == len(stages) - 1 else os.path.join(out_dir, stage.name)
        c.resume = cfg.resume and os.path.exists(os.path.join(c.out_dir, "run.json"))
        if c.objective not in cls.objectives:
            raise SystemExit(f"error: --objective {c.objective!r} does not apply to --method {cfg.method}; "
                             f"choose from {', '.join(cls.objectives)}")
        while "grad_accum" not in explicit and c.grad_accum > 1 and c.batch_size % (world * c.grad_accum):
            c.grad_accum -= 1  # a recipe's micro-batches divide the global batch (--batch_size 2 of gist's 4)
        if c.batch_size % (world * c.grad_accum):
            raise SystemExit(f"error: --batch_size {c.batch_size} (the global batch) must be a multiple of "
                             f"{world} ranks x --grad_accum {c.grad_accum}")
        inherit_first_stage(c, m, explicit, cls)
        resolved.append((c, m, sources))
        init_from = c.out_dir
    if cfg.resume and not any(c.resume for c, _, _ in resolved):
        raise SystemExit(f"error: --resume but {out_dir} has no checkpoint")
    for target, value in zip((cfg, mcfg), resolved[-1][:2]):
        target.__dict__.update(value.__dict__)
    cfg.pretrain = sum(c.max_iters for c, _, _ in resolved[:-1])  # the steps before the last stage
    return resolved


def recipe_table(resolved):
    """The block a run prints at start and keeps in run.json: every recipe value of every stage, with its source."""
    keys = [*RECIPE_KEYS, *(f.name for f in fields(resolved[0][1]))]
    stages = [{"objective": c.objective, "out_dir": c.out_dir, "init_from": c.init_from,
               "values": {k: [getattr(c if hasattr(c, k) else m, k), src.get(k, "default")] for k in keys}}
              for c, m, src in resolved]
    lines = [f"recipe of --method {resolved[0][0].method}: {len(stages)} stage(s) (flag > recipe > default)"]
    for i, st in enumerate(stages, 1):
        lines.append(f"  stage {i}: {st['objective']} -> {st['out_dir']}")
        lines += [f"    {k:<22} {str(v):<20} {src}" for k, (v, src) in st["values"].items()]
    return stages, "\n".join(lines)


def read_records(path, cfg, stats=None):
    """The records of a QA file (one that is not UTF-8 text: one line naming it)."""
    try:
        yield from data.read_dataset(path, distractors=cfg.hotpot_distractors, skip_bad=cfg.skip_bad, stats=stats)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None


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


def save_checkpoint(out_dir, method, opt, step, cfg, mcfg, flags=(), recipe=None):
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
             "recipe": recipe,
             "param_groups": opt_state["param_groups"], "python_rng": list(random.getstate()[1])}
    atomic_write(os.path.join(out_dir, "run.json"), lambda p: json.dump(state, open(p, "w"), indent=1))
    for f in os.listdir(out_dir):  # and eval.py's metrics.json, which scored the checkpoint before this one
        if (f.startswith(("ckpt-", "optim-")) and f not in files.values()) or f == "metrics.json":
            os.remove(os.path.join(out_dir, f))


def load_checkpoint(out_dir, method, opt=None):
    """Trainable tensors (and optimizer state, RNG) of a run dir; returns the step."""
    state = read_json(os.path.join(out_dir, "run.json"))
    if not isinstance(state, dict) or not {"step", "files"} <= state.keys():
        raise ValueError(f"{out_dir}/run.json: not a run.json written by train.py (needs step, files)")
    params = {n: p for n, p in method.named_parameters() if p.requires_grad or opt is None}  # --resume: trainable only
    tensors = read_tensors(os.path.join(out_dir, state["files"]["ckpt"]))
    unknown = [k for k in tensors if k not in params]
    if unknown:
        raise SystemExit(f"error: {out_dir}: checkpoint tensors {unknown[:5]} do not match this method's parameters")
    with torch.no_grad():
        for k, v in tensors.items():
            params[k].copy_(v)
    if opt is not None:
        optim = {}
        for key, v in read_tensors(os.path.join(out_dir, state["files"]["optim"])).items():
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
    state = read_json(path)
    if not isinstance(state, dict) or not {"train", "method"} <= state.keys() or "method" not in state["train"]:
        raise ValueError(f"{path}: not a run.json written by train.py (needs train.method and method)")
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
