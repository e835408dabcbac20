"""One training loop for every method and objective (SPEC §2.4-2.5); eval.py reads the runs it writes.

On a fresh clone (CPU, no downloads; the tiny base ships in tiny_base/):
    python train.py --method meanpool --ratio 4,8,16
On a real checkpoint and SQuAD, one GPU:
    python train.py --method teacher --init_from /ckpt/Qwen3-1.7B --data train-v1.1.json --out_dir out/teacher
    python train.py --method meanpool --init_from /ckpt/Qwen3-1.7B --teacher out/teacher \
        --data train-v1.1.json --eval_data dev-v1.1.json --ratio 4,8,16,32,64,128
Several GPUs (DDP; gloo on CPU):
    torchrun --nproc_per_node=8 train.py --method meanpool --init_from ... --data ...

A run is its method's recipe (`resolve`: the paper's stages and values on a real checkpoint, TINY on the tiny
base; a flag wins), printed at start; each stage trains into its own dir and the next starts from it.
--batch_size is the global batch: a step's loss is the sum of per-token losses over it over its token count, so
2 ranks and 1 give the same update. Data for step s is a pure function of (seed, s), so --resume continues
exactly where a run stopped.
"""
import argparse
import collections
import copy
import fcntl
import filecmp
import glob
import hashlib
import inspect
import itertools
import json
import linecache
import math
import os
import random
import re
import signal
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while torch loads (~2 s): exit 130 as at any later moment, not a traceback
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file
from tqdm import tqdm

import ata
import data
import meanpool
import pic
import sac
import sentence_gist
import tiny
from model import Transformer, compile_layers, read_json, read_tensors


@dataclass
class TrainConfig:
    # --- run
    method: str = "meanpool"   # a name in method_registry(): --help lists them
    objective: str = ""        # "" = every stage of the method's recipe; a name: its stages alone
    ratio: str = "4,8,16"      # one compression ratio, or a set trained together: 4,8,16
    init_from: str = ""        # HF checkpoint dir or one of our run dirs; "" = tiny_base/ (shipped)
    teacher: str = ""          # a --method teacher run dir whose adapter is merged into the base
    data: str = ""             # QA / text file (SQuAD, MRQA, HotpotQA, MS MARCO, JSONL, .txt); "" = synthetic
    eval_data: str = ""        # validation and final evaluation QA; "" = --data's held-out slice, else synthetic
    skip_bad: bool = False     # skip (and count) malformed records instead of stopping
    hotpot_distractors: bool = False  # HotpotQA: keep all ten paragraphs as context (for ata)
    prompt: str = "auto"       # auto (the checkpoint's template, else plain) | plain | chatml | llama3 | gemma | sac
    out_dir: str = ""          # "" = out/<method>
    no_aids: bool = False      # tiny base only: no aids (tiny.py), the papers' recipes at its steps, batch, lr, ratios
    pretrain: int = 0          # steps of the recipe's first stage (pic ae+lm, sac lm, ata rel, gist 1); given 0: none
    pretrain_data: str = ""    # text for the text pretraining stages (pic ae+lm, sac lm, gist lm); "" = --data's
    # --- optimisation (0 = the method's recipe: the paper's values on real checkpoints, TINY on the tiny base)
    max_iters: int = 0         # steps (0: the recipe's); stages share them in the recipe's proportion (not --pretrain)
    batch_size: int = 0        # the global batch (0: the recipe's): examples a step over ranks and micro-batches
    grad_accum: int = 1        # micro-batches a step per rank: its examples sorted by context length (less padding)
    micro_batch: int = 0       # at most N examples a micro-batch per rank: sets each stage's --grad_accum by its batch
    lr: float = 0.0            # the peak learning rate (0: the recipe's)
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
    dtype: str = ""            # float32 | bfloat16 (autocast; a real base's weights bf16 on CUDA); "": bf16 on CUDA
    compile: bool = False      # torch.compile each decoder layer (model.compile_layers; attention: flex)
    cuda_graphs: bool = False  # with --compile on CUDA: the compiled layers replay as CUDA graphs (reduce-overhead)
    grad_ckpt: bool = False    # activation checkpointing per decoder layer: large models fit, ~1/3 more compute
    seed: int = 1337
    resume: bool = False
    quiet: bool = False        # no progress bar

    @property
    def pad_multiple(self):  # batch lengths round up to it: compiled graphs serve many lengths, eager pays for padding
        return 64 if self.compile else 8


STOP = []  # Ctrl-C appends here; the loop saves and exits at the end of the step


def stop_at_the_step_end(*_):
    """Ctrl-C / SIGTERM in the loop: it saves and stops at the end of the step; a second one stops at once (a step
    of a batch too large for the host may not end), the last checkpoint standing."""
    if STOP:
        raise KeyboardInterrupt
    STOP.append(1)


# -----------------------------------------------------------------------------
# the methods: the teacher (the non-compressing one beside tiny.Base) and the registry

@dataclass
class TeacherConfig:
    lora_r: int = 16
    lora_alpha: int = 16


class Teacher(torch.nn.Module):
    """`--method teacher`: `sft` of a real checkpoint with a `teacher` LoRA adapter on full-context QA
    (meanpool_multi_ratio §5.1: finetuned first, then frozen; §A.2: Table 6 holds the hyperparameters "used to train
    all models, including the teacher"). Compressors merge it into the base with --teacher."""
    Config = TeacherConfig
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


# -----------------------------------------------------------------------------
# command line: the fields of a config dataclass are the flags, their comments the help

USAGE = "python train.py --method NAME [--flag value ...]"


def make_parser(configs, positional=None, usage=USAGE):
    """argparse over the fields of `configs`: a flag per field with its type and default, a bool a switch
    (--compile; without bare arguments it takes true / false too: `--hotpot_distractors false` turns off a recipe's
    True), help from the field's comment (where a config subclasses another, in the class that has it); every error
    one line."""
    parser = argparse.ArgumentParser(usage=usage, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    parser.error = lambda message: sys.exit(f"error: {message}")
    for c in configs:
        group = parser.add_argument_group(f"{c.__name__} ({os.path.basename(inspect.getsourcefile(c))})")
        source = [line for k in c.__mro__ if is_dataclass(k) for line in class_lines(k)]
        for f in fields(c):
            note = next((l.partition("#")[2].strip() for l in source if l.strip().startswith(f"{f.name}:")), "")
            kind = dict(type=real if f.type is float else f.type, metavar=f.type.__name__)
            if f.type is bool:  # (after a switch, eval.py's bare run dirs would read as its value)
                kind = dict(action="store_true") if positional else dict(nargs="?", const=True, type=switch,
                                                                          metavar="true|false")
            if f.name == positional:  # bare arguments
                parser.add_argument(positional, nargs="*", help=note)
            else:
                group.add_argument(f"--{f.name}", help=f"{note} (default {f.default!r})", **kind)
    return parser


def class_lines(cls):
    """A class's source lines; a top-level one's (every config here) are its file's from `class NAME` to the next
    unindented line. (inspect.getsource parses the whole module to find a class: 0.13 s of every command for
    train.py; it finds one nested in a function, as a fork's test may define, by its qualified name.)"""
    lines = linecache.getlines(inspect.getsourcefile(cls))
    start = next((i for i, line in enumerate(lines) if re.match(rf"class {cls.__name__}\b", line)), None)
    if start is None or "." in cls.__qualname__:
        return inspect.getsource(cls).splitlines()
    return [lines[start], *itertools.takewhile(lambda line: not line.strip() or line[0].isspace(), lines[start + 1:])]


def switch(text):
    """A switch's value: true or false (1 / 0, yes / no)."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"invalid true / false value: {text!r}")
    return value


def real(text):
    """A float flag's value; a number too small for a float (1e-400) is an error, not the 0 it rounds to (--lr 0:
    the recipe's)."""
    if not is_float(text):
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}")
    value = float(text)
    if value == 0 and any(d in "123456789" for d in text.lower().partition("e")[0]):
        raise argparse.ArgumentTypeError(f"{text!r} is too small for a float (it would read as 0)")
    return value


def is_float(text):
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_args(argv, *configs, positional=None, usage=USAGE):
    """(an instance of each config, the set of keys given) from argv; bare arguments go into `positional` (a tuple:
    a path may hold spaces)."""
    argv, valued = [str(a) for a in argv], {f"--{f.name}" for c in configs for f in fields(c) if f.type is not bool}
    for i in range(len(argv) - 1, 0, -1):  # "--lr -1e-3": argparse takes "-1e-3" (or -inf, -1.) for a flag, not a value
        if argv[i - 1] in valued and argv[i].startswith("-") and is_float(argv[i]):
            argv[i - 1:i + 1] = [f"{argv[i - 1]}={argv[i]}"]
    given = vars(make_parser(configs, positional, usage).parse_intermixed_args(argv))
    if positional in given:
        given[positional] = tuple(given[positional])
    names = [{f.name for f in fields(c)} for c in configs]
    instances = [c(**{k: v for k, v in given.items() if k in keys}) for c, keys in zip(configs, names)]
    return instances, set(given) - {positional}


PATH_FLAGS = ("init_from", "teacher", "data", "eval_data", "pretrain_data", "out_dir", "encoder", "decoder")


def early_flags(argv):
    """--method, --out_dir and --resume of argv, read before the rest (which flags exist depends on --method)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.error = lambda message: sys.exit(f"error: {message}")
    pre.add_argument("--method", default=TrainConfig.method)
    pre.add_argument("--out_dir", default="")
    pre.add_argument("--resume", nargs="?", const=True, default=False, type=switch)
    return pre.parse_known_args(argv)[0]


def configure(argv):
    """(cfg, mcfg, explicit flags, method class) from argv; --method decides which flags exist."""
    methods, name = method_registry(), early_flags(argv).method
    if name not in methods:
        raise SystemExit(f"error: unknown --method {name!r}; choose from {', '.join(methods)}")
    cls = methods[name]
    own = {f.name for c in (TrainConfig, cls.Config) for f in fields(c)}
    others = {f.name for c in methods.values() for f in fields(c.Config)} - own
    for key in (a[2:].split("=")[0] for a in argv if a.startswith("--")):
        if key in others:
            raise SystemExit(f"error: --{key} does not apply to --method {name}")
    (cfg, mcfg), explicit = parse_args(argv, TrainConfig, cls.Config)
    for flag in sorted(explicit & set(PATH_FLAGS)):  # (--data "$UNSET" trained on the synthetic set)
        config = cfg if hasattr(cfg, flag) else mcfg
        if not getattr(config, flag).strip():
            raise SystemExit(f"error: --{flag} is empty: name a path, or leave the flag out for its default")
        if flag != "out_dir":  # absolute in run.json: a run resumed or read from another folder finds its files
            setattr(config, flag, os.path.abspath(getattr(config, flag)))
    unread = sorted(explicit & {"ratio", "eval_ratio"}) if not hasattr(cls, "compress") else []
    if unread:  # the teacher and the tiny base compress nothing
        raise SystemExit(f"error: --{unread[0]} does not apply to --method {name}: it reads the whole context")
    if not hasattr(cls, "compress") and "eval_examples" in explicit and cfg.eval_examples:  # (nothing would read it)
        raise SystemExit(f"error: --eval_examples: a --method {name} run is not evaluated (eval.py reads the teacher "
                         "with a compressor's run)")
    return cfg, mcfg, explicit, cls


def check_ratio_fits(spec, max_context, flag="ratio", whose=""):
    """A ratio above --max_context (train.py's flag, eval.py's reading of a run) is one line."""
    if max(ratios_of(spec, flag)) > max_context:
        raise SystemExit(f"error: --{flag} {spec!r}: above {whose}--max_context {max_context}, where every context is "
                         "one memory slot")


def ratios_of(spec, flag="ratio"):
    if not re.fullmatch(r" *[0-9]+ *(, *[0-9]+ *)*", str(spec)):  # "4,,8", "4," and "4_0" are errors (int reads 4_0)
        raise SystemExit(f"error: --{flag} {spec!r} must be a positive integer or a comma list like 4,8,16")
    rs = [int(r) for r in str(spec).split(",")]
    if not rs or any(not 0 < r <= 1 << 20 for r in rs):  # (a 64-bit overflow in the pooling above that)
        raise SystemExit(f"error: --{flag} {spec!r}: every ratio must be a positive integer, at most 2^20")
    if len(set(rs)) < len(rs):  # a ratio twice would train (and report) it twice
        raise SystemExit(f"error: --{flag} {spec!r} names a ratio twice")
    return rs


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
    scaled: tuple = ()  # --no_aids on the tiny base: the keys of `paper` that hold TINY's other values (SCALE)

    def steps(self):  # as stage_values reads it: the paper's over the official code's over ours over FALLBACK
        return {**FALLBACK, **self.ours, **self.official, **self.paper}["max_iters"]


# what --no_aids keeps of the tiny recipe: a 1.1M-parameter base on a CPU needs its own steps, batch and lr
SCALE = ("max_iters", "batch_size", "grad_accum", "lr", "warmup_iters", "warmup_frac", "ratio", "eval_ratio")
FALLBACK = dict(max_iters=1000, batch_size=16, lr=1e-4)  # for a recipe that names none of these
RECIPE_KEYS = ("objective", "ratio", "eval_ratio", "max_iters", "batch_size", "grad_accum", "lr", "min_lr_frac",
               "warmup_frac", "warmup_iters", "weight_decay", "grad_clip", "max_context", "max_answer",
               "hotpot_distractors")


def paper_stages(cls, mcfg):
    return [Stage(**stage) for stage in cls.recipe(mcfg)]


def split_steps(total, weights):
    """total steps over stages in proportion to weights (largest remainder), summing to total; each stage gets at
    least 1 (the largest stages give theirs back), so a total below the number of stages sums to that number."""
    shares = [total * w / sum(weights) for w in weights]
    steps = [max(1, int(x)) for x in shares]
    for i in sorted(range(len(shares)), key=lambda i: int(shares[i]) - shares[i])[:max(0, total - sum(steps))]:
        steps[i] += 1
    while sum(steps) > max(total, len(steps)):
        steps[steps.index(max(steps))] -= 1
    return steps


def tiny_stages(cls, mcfg, pretrain=None, stage=None):
    """The tiny base's recipe: TINY's values over the paper's last stage (TINY's objective may change it; sentence_gist
    TINY's stage, or a --stage flag's), and the paper's first stage before it for `pretrain` steps (a --pretrain flag,
    else TINY's: pic ae+lm 100, then qa)."""
    paper, small = paper_stages(cls, mcfg), dict(cls.TINY)
    objective, tiny_pretrain = small.pop("objective", None), small.pop("pretrain", 0)
    pretrain = tiny_pretrain if pretrain is None else pretrain
    if "stage" in small:  # sentence_gist: one of its paper's stages (its lr's end: Table 3's)
        small["stage"] = stage or small["stage"]  # (no such stage: the method's check_config says so)
        last = next((s for s in paper if s.paper.get("stage") == small["stage"]), paper[-1])
    else:
        last = next((s for s in paper if s.objective == objective), paper[-1])
    values = lambda s: {**s.ours, **s.official, **s.paper, **small}  # noqa: E731
    last = Stage(objective or last.objective, "tiny", values(last), name=last.name)
    if not pretrain or len(paper) < 2:
        return [last]
    return [Stage(paper[0].objective, "tiny", {**values(paper[0]), "max_iters": pretrain}), last]


def run_state(run_dir, method=None):
    """The run.json of `run_dir` when it is a run dir (of `method`, when given: an earlier stage of this run's method,
    the run --resume continues), else None."""
    path = os.path.join(run_dir, "run.json")
    if not run_dir or not os.path.exists(path):
        return None
    state = read_json(path)
    return state if method in (None, state["train"]["method"]) else None


def teacher_prompt(teacher):
    """The --prompt a --method teacher run was trained with ("" without one): a run distilling it takes it."""
    path = os.path.join(teacher, "run.json")
    return read_json(path)["train"].get("prompt", "") if teacher and os.path.isfile(path) else ""


def started_command(argv):
    """--resume: the command that started the run in --out_dir, as arguments to put before argv's (argparse: the last
    value wins), and the run.json it comes from; else ([], ""). It comes from the newest run.json of the run's stages
    (a stage not begun takes the command's values: --max_iters, --eval_examples). Left out of it: --out_dir (a run
    dir may move) and the flag of a pair argv gives the other of (--micro_batch sets --grad_accum)."""
    given = early_flags(argv)
    if not given.resume:
        return [], ""
    out_dir = given.out_dir or os.path.join("out", given.method)
    top = os.path.join(out_dir, "run.json")
    found = []
    for path in [top] + glob.glob(os.path.join(out_dir, "*", "run.json")):
        state = read_json(path) if os.path.isfile(path) else {}
        if path == top and isinstance(state, dict) and state.get("last_stage") is False:  # (a stage of the run above)
            raise SystemExit(f"error: --resume: {out_dir} is an earlier stage of the run in "
                             f"{os.path.dirname(os.path.abspath(out_dir))}: resume that one")
        if isinstance(state, dict) and isinstance(state.get("command"), dict) and (
                path == top or state.get("last_stage") is False):  # (not a run of its own nested in the dir)
            found.append((os.path.getmtime(path), path, state["command"]))
    if not found:
        return [], ""
    _, path, command = max(found)
    now = {a[2:].split("=")[0] for a in argv if str(a).startswith("--")}
    skip = {"out_dir"} | {flag for flag, other in PAIRS.items() if other in now}
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in command.items() if k not in skip], path


PAIRS = {"micro_batch": "grad_accum", "grad_accum": "micro_batch", "warmup_iters": "warmup_frac",
         "warmup_frac": "warmup_iters", "pretrain": "objective"}  # a flag, and the one given now that replaces it
# (both set one value; --objective picks the stage to run, --pretrain is a first stage's steps)


def command_of(cfg, mcfg, explicit):
    """The flags a command gave and their values (paths absolute: configure): what run.json keeps for --resume."""
    return {k: getattr(cfg, k, getattr(mcfg, k, None)) for k in sorted(explicit - {"resume"})}


RESUME_SAME = ("objective", "init_from", "no_aids")  # --resume: the command's must be the run's (its recipe follows)
RESUME_KEEPS = ("ratio", "eval_ratio", "teacher", "prompt", "data", "eval_data", "pretrain_data", "hotpot_distractors",
                "skip_bad", "seed", "batch_size", "max_context", "max_answer")  # --resume takes the run's: its data
RESUME_DEFAULTS = ("max_iters", "lr", "min_lr_frac", "warmup_iters", "warmup_frac", "weight_decay", "grad_clip",
                   "eval_interval", "eval_examples")  # --resume takes the run's unless a flag gives another


def as_compared(key, value):
    """A flag's value as --resume compares it: ratios as numbers, paths as real paths ("" --init_from: tiny_base/)."""
    if key in ("ratio", "eval_ratio") and value:
        return ratios_of(value, key)
    value = tiny.BASE_DIR if key == "init_from" and not value else value
    return os.path.realpath(value) if key in PATH_FLAGS and value else value


def inherit_method_config(state, what, mcfg, explicit, skip=()):
    """A run that continues `state` (the run.json of its first stage, or of the run --resume continues) keeps the
    method config that shaped and trained its tensors (a pic memory table of --max_mem rows, an encoder pretrained
    with --mask causal). A flag given with another value is a one-line error, except those in `skip`."""
    for key, val in state["method"].items():
        if key in skip or not hasattr(mcfg, key):
            continue
        if key in explicit and getattr(mcfg, key) != val:
            raise SystemExit(f"error: --{key} {getattr(mcfg, key)!r} conflicts with {what} ({key}={val!r}); "
                             "drop the flag to inherit it")
        setattr(mcfg, key, val)


def resolve(cfg, mcfg, explicit, cls, world=1):
    """The run's stages as [(cfg, mcfg, sources)], sources naming where each value came from, in this order:
    1. a flag given on the command line (it holds in every stage);
    2. on a tiny base (tiny.py's): the method's TINY values (tiny_stages); with --no_aids the paper's stages and
       values, but for what SCALE lists, taken from TINY (steps shared as below);
    3. on a real checkpoint: the paper's stages (cls.recipe): the values its paper states, then ours;
    4. the dataclass defaults.
    Which stages run: recipe_stages. --pretrain N gives the first of several stages N steps; --max_iters N is shared by
    the others (all, without --pretrain N) in their recipe's proportion, each at least one step (stage_values scales
    a warmup given in steps with them). A stage before the last trains into OUT_DIR/<its name>. cfg and mcfg become
    the last stage's (cfg.pretrain: the steps of the stages before it)."""
    check_run_flags(cfg, explicit)
    check_run_dirs(cfg, mcfg)
    taught = teacher_prompt(cfg.teacher)  # the format its adapter learned answers in
    if taught and "prompt" not in explicit:
        cfg.prompt = taught
    stages, source = recipe_stages(cfg, mcfg, explicit, cls)
    recipe_steps = [s.steps() for s in stages]
    steps, fixed = list(recipe_steps), 1 if "pretrain" in explicit and cfg.pretrain else 0
    if fixed:
        steps[0] = cfg.pretrain
    if "max_iters" in explicit:
        steps[fixed:] = split_steps(cfg.max_iters, steps[fixed:])
    out_dir = cfg.out_dir or os.path.join("out", cfg.method)
    resolved, init_from = [], cfg.init_from
    dirs = [os.path.join(out_dir, s.name) for s in stages[:-1]] + [out_dir]
    ran = [run_config(d)[0] if cfg.resume and os.path.exists(os.path.join(d, "run.json")) else None
           for d in dirs]  # --resume: each stage's run so far (run_config: an edited run.json is one line)
    begun = [i for i, r in enumerate(ran) if r and r.method == cfg.method]
    n_stages = len(stages)
    if begun and begun[-1] > 0:  # --resume: the stages before the last one begun stand as they are (another split
        j, init_from = begun[-1], dirs[begun[-1] - 1]  # of --max_iters retrained them under the later one's weights)
        if os.path.basename(os.path.normpath(ran[j].init_from)) != stages[j - 1].name:  # (--pretrain 0, then 1; a
            # relative init_from is the run's start folder's: the name alone)
            raise SystemExit(f"error: --resume: {dirs[j]} was trained with no {stages[j - 1].name} stage before it, "
                             "which this command adds" + (": leave --pretrain out" if "pretrain" in explicit else ""))
        if not ran[j - 1]:  # (else the first stage would train anew, then this one fail)
            raise SystemExit(f"error: --resume: {dirs[j]} began from {init_from}, which holds no checkpoint now")
        first = ran[0].init_from if ran[0] else None
        if "init_from" in explicit and first is not None and as_compared("init_from", cfg.init_from) != \
                as_compared("init_from", first):  # (the first stage's base, which the stages after it stand on)
            raise SystemExit(f"error: --init_from {cfg.init_from!r} conflicts with the run --resume continues, "
                             f"{dirs[0]} (init_from={first!r})")
        stages, steps, recipe_steps, fixed = stages[j:], steps[j:], recipe_steps[j:], 0
    for i, (stage, n, n_recipe) in enumerate(zip(stages, steps, recipe_steps)):
        c, m, sources = stage_values(cfg, mcfg, explicit, stage, source, n, n_recipe)
        if fixed and i == 0:
            sources["max_iters"] = "flag (--pretrain)"
        elif "max_iters" in explicit:
            sources["max_iters"] = "flag (--max_iters, shared by the stages)" if n_stages > 1 else "flag"
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
        first = run_state(c.init_from, c.method) if i == 0 else None  # (a later stage's is trained here, anew)
        if first:  # a second stage: its own flags (cls.STAGE_FLAGS: gist's --stage) may differ
            inherit_method_config(first, f"the first stage {c.init_from}", m, explicit, getattr(cls, "STAGE_FLAGS", ()))
        if c.resume:
            inherit_resumed(c, m, explicit, sources, own_start=c.init_from in dirs)
        set_micro_batches(c, cfg.micro_batch, explicit, world, sources)
        resolved.append((c, m, sources))
        init_from = c.out_dir
    if cfg.resume and not any(c.resume for c, _, _ in resolved):
        below = sorted(glob.glob(os.path.join(out_dir, "*", "run.json")))  # a first stage's, say
        raise SystemExit(f"error: --resume but {out_dir} has no checkpoint" + (
            f" ({os.path.dirname(below[0])} has: give the flags its run was started with)" if below else ""))
    for target, value in zip((cfg, mcfg), resolved[-1][:2]):
        target.__dict__.update(value.__dict__)
    cfg.pretrain = sum(c.max_iters for c, _, _ in resolved[:-1])  # the steps before the last stage
    return resolved


def check_run_flags(cfg, explicit):
    """The run-wide flags resolve reads, one line each; a 0 that means "the recipe's" counts as not given."""
    for flag in ("max_iters", "batch_size", "lr", "pretrain"):  # 0 = the recipe's (--pretrain 0: no first stage)
        value = getattr(cfg, flag)
        if not 0 <= value < math.inf:  # (NaN fails; a 400-digit integer, which isfinite cannot take, passes)
            zero = "0: no first stage" if flag == "pretrain" else "0: the recipe's"
            raise SystemExit(f"error: --{flag} {value} must be a finite number >= 0 ({zero})")
        if flag == "lr" and value > torch.finfo(torch.float32).max / 10:  # (AdamW's first step: lr / (1 - beta1))
            raise SystemExit(f"error: --lr {value}: above 3.4e37, where AdamW's first step overflows float32")
        if flag in ("max_iters", "pretrain") and value > 1 << 40:
            raise SystemExit(f"error: --{flag} {value}: at most 2^40 steps")
        if flag != "pretrain" and value == 0:
            explicit.discard(flag)
    if not cfg.objective:  # as if not given: every stage
        explicit.discard("objective")
    if cfg.grad_accum < 1:
        raise SystemExit(f"error: --grad_accum {cfg.grad_accum} must be a positive integer")
    unread = sorted(f for f in explicit & {"init_from", "teacher", "data", "eval_data", "pretrain_data", "max_context",
                                           "max_answer", "prompt"} if getattr(cfg, f) != getattr(TrainConfig, f))
    if cfg.method == "base" and unread:  # (the base reads none of them)
        raise SystemExit(f"error: --{unread[0]} does not apply to --method base: it trains a tiny base from scratch on "
                         "tiny.py's synthetic set (--resume continues one)")
    if cfg.micro_batch < 0:
        raise SystemExit(f"error: --micro_batch {cfg.micro_batch} must be >= 0 (0: --grad_accum's micro-batches)")
    if cfg.micro_batch and "grad_accum" in explicit:
        raise SystemExit(f"error: --micro_batch {cfg.micro_batch} sets --grad_accum: give one of them")
    if {"warmup_iters", "warmup_frac"} <= explicit:  # (--warmup_iters won)
        raise SystemExit("error: --warmup_iters and --warmup_frac both set the warmup: give one of them")
    files = [f for f in (cfg.data, cfg.eval_data, cfg.pretrain_data) if f]
    for flag in sorted(explicit & {"hotpot_distractors", "skip_bad"}):
        if not files:
            raise SystemExit(f"error: --{flag} applies to reading a --data file; the synthetic set is read without it")
    if "hotpot_distractors" in explicit and cfg.hotpot_distractors and all(map(os.path.isfile, files)) and \
            not any(map(data.is_json_list, files)):  # (a missing file: check_files says so)
        raise SystemExit("error: --hotpot_distractors keeps HotpotQA's distractor paragraphs, and no --data, "
                         "--eval_data or --pretrain_data file is HotpotQA (a JSON list)")


def check_run_dirs(cfg, mcfg):
    """A run.json in a dir the command names must be one train.py wrote, read before any of it is (an edited or
    foreign one was a KeyError): one line naming the flag."""
    dirs = {"out_dir": cfg.out_dir or os.path.join("out", cfg.method), "init_from": cfg.init_from,
            "teacher": cfg.teacher, "encoder": getattr(mcfg, "encoder", ""), "decoder": getattr(mcfg, "decoder", "")}
    for flag, path in dirs.items():
        if path and os.path.isfile(os.path.join(path, "run.json")):
            try:
                run_config(path)
            except (ValueError, SystemExit) as e:
                raise SystemExit(f"error: --{flag} {path}: {str(e).removeprefix('error: ')}") from None


def recipe_stages(cfg, mcfg, explicit, cls):
    """(the stages that run, where their values come from: "tiny" or "paper"): the tiny base's TINY recipe, else the
    paper's (--no_aids on the tiny base: at TINY's scale); after an --init_from earlier stage, those after it;
    --objective: the stages with that objective (or the last, with it); sentence_gist's --stage: that one;
    --pretrain 0: all but the first of several (--pretrain N > 0 needs several)."""
    small = tiny.is_tiny(cfg.init_from) or cfg.method == "base"
    if small and not cfg.no_aids:
        stages = tiny_stages(cls, mcfg, cfg.pretrain if "pretrain" in explicit else None,
                             getattr(mcfg, "stage", None) if "stage" in explicit else None)
        source = "tiny"
    else:
        stages, source = paper_stages(cls, mcfg), "paper"
        if small:  # --no_aids: the paper's recipe at the tiny base's scale
            scaled = tiny_stages(cls, mcfg)
            scale = {k: v for k, v in scaled[-1].paper.items() if k in SCALE and k != "max_iters"}
            steps = split_steps(sum(s.steps() for s in scaled), [s.steps() for s in stages])  # (pic's qa: ours)
            stages = [replace(s, paper={**s.paper, **scale, "max_iters": n},
                              scaled=tuple(k for k, v in {**scale, "max_iters": n}.items() if s.paper.get(k) != v))
                      for s, n in zip(stages, steps)]
    done = run_state(cfg.init_from, cfg.method)  # --init_from an earlier stage's run dir: the stages after it
    if done:  # that stage: its objective and (sentence_gist's three are all `lm`) its --stage; the last: it again
        ran = [s.objective == done["train"]["objective"] and s.paper.get("stage", 0) == done["method"].get("stage", 0)
               for s in stages]
        at = ran.index(True) if any(ran) else -1
        stages = stages[at + 1:] or stages[-1:]  # the stages after it; after the last: it again
    first, last = stages[0].objective, stages[-1].objective
    if {"objective", "pretrain"} <= explicit and cfg.pretrain == 0 and first == cfg.objective != last:
        raise SystemExit(f"error: --pretrain 0 drops the {cfg.objective} stage that --objective {cfg.objective} runs: "
                         "give one of them")
    if "objective" in explicit:  # its stages (sentence_gist: all three), else the last one with this objective
        stages = [s for s in stages if s.objective == cfg.objective] or [replace(stages[-1], objective=cfg.objective)]
    if "stage" in explicit:  # sentence_gist: one of its paper's stages
        stages = [s for s in stages if s.paper.get("stage") == mcfg.stage] or stages[-1:]
    if "pretrain" in explicit:
        if cfg.pretrain and len(stages) < 2:
            raise SystemExit(f"error: --pretrain runs a pretraining stage before the last; this --method {cfg.method} "
                             f"run has one stage ({stages[-1].objective})")
        stages = stages[1:] if cfg.pretrain == 0 and len(stages) > 1 else stages
    return stages, source


def stage_values(cfg, mcfg, explicit, stage, source, n, n_recipe):
    """(cfg, mcfg, sources) of one stage of n steps (its recipe's: n_recipe): the flags', else the stage's values
    (the paper's over the official code's over ours over FALLBACK), else the defaults."""
    c, m, sources = copy.deepcopy(cfg), copy.deepcopy(mcfg), {}
    stage_source = source if source == "tiny" else f"paper ({stage.cite})"
    for values, origin in ((FALLBACK, "default"), (stage.ours, "ours"), (stage.official, "official code"),
                           (stage.paper, stage_source)):
        for key, val in values.items():
            if key not in explicit and (hasattr(c, key) or hasattr(m, key)):
                setattr(c if hasattr(c, key) else m, key, val)
                sources[key] = origin
    sources.update({key: "tiny (--no_aids: the tiny base's scale)" for key in stage.scaled})
    sources.update({key: "flag" for key in explicit})
    c.objective, c.max_iters = stage.objective, n
    if c.warmup_iters and "warmup_iters" not in explicit and n != n_recipe:  # a count keeps its share of the stage
        c.warmup_iters = max(1, round(c.warmup_iters * n / n_recipe))
        sources["warmup_iters"] = f"{sources.get('warmup_iters', 'default')}, x {n}/{n_recipe} steps"
    if "warmup_iters" in explicit and c.warmup_iters > n:  # (a stage's lr then never reaches --lr)
        print(f"note: --warmup_iters {c.warmup_iters} outlasts the {n} steps of the {stage.objective} stage: "
              f"its lr peaks at {n / c.warmup_iters:.2g} of --lr", file=sys.stderr)
    sources["objective"] = "flag" if "objective" in explicit else stage_source
    assert c.max_iters >= 1 and c.batch_size >= 1 and c.lr > 0, f"{stage.cite}: a recipe's steps, batch and lr are > 0"
    return c, m, sources


def set_micro_batches(c, micro_batch, explicit, world, sources):
    """A stage's --grad_accum: --micro_batch's (the fewest micro-batches of at most that many examples that divide
    the batch), else the flag's, else the recipe's lowered until it divides the global batch."""
    if micro_batch:
        c.grad_accum = -(-c.batch_size // (world * micro_batch))
        while c.batch_size % (world * c.grad_accum) and c.grad_accum < c.batch_size:
            c.grad_accum += 1
        sources["grad_accum"] = f"flag (--micro_batch {micro_batch})"
    while "grad_accum" not in explicit and c.grad_accum > 1 and c.batch_size % (world * c.grad_accum):
        c.grad_accum -= 1  # a recipe's micro-batches divide the global batch (--batch_size 2 of gist's 4)
    if c.batch_size % (world * c.grad_accum):
        raise SystemExit(f"error: --batch_size {c.batch_size} (the global batch) must be a multiple of "
                         f"{world} ranks x --grad_accum {c.grad_accum}")


def inherit_resumed(c, m, explicit, sources, own_start=False):
    """--resume: the stage takes the run.json of the run it continues (what shaped its tensors, its data and its loss;
    a flag given with another value is one line) and its schedule, where no flag gives another."""
    state = run_state(c.out_dir, c.method)  # its run.json, when a run of this method
    if not state:
        raise SystemExit(f"error: --resume: {c.out_dir} is not a --method {c.method} run")
    inherit_method_config(state, f"the run --resume continues, {c.out_dir}", m, explicit)
    for key in RESUME_DEFAULTS:
        if key in state["train"] and not sources.get(key, "").startswith("flag"):
            setattr(c, key, state["train"][key])
            sources[key] = "the run --resume continues"
    if c.max_iters < state["step"]:  # (not "nothing to train": the flag asks for fewer steps than were run)
        share = " (this stage's share of --max_iters)" if "shared" in sources.get("max_iters", "") else ""
        raise SystemExit(f"error: --max_iters {c.max_iters}{share}: the run --resume continues, {c.out_dir}, is at "
                         f"step {state['step']} already")
    for key in RESUME_SAME + RESUME_KEEPS:
        if key == "init_from" and own_start:  # an earlier stage of this run: its dir, however --out_dir is spelled
            continue
        now, saved = getattr(c, key), state["train"].get(key, getattr(c, key))
        if as_compared(key, now) == as_compared(key, saved):
            setattr(c, key, saved)  # (its spelling: "" stays the shipped base wherever the repo moves)
            continue
        if key in explicit and key in PATH_FLAGS and saved and not os.path.exists(saved):  # moved: where it is now
            continue
        stage = os.path.basename(os.path.normpath(saved)) if key == "init_from" and saved else ""
        if stage and os.path.isfile(os.path.join(c.out_dir, stage, "run.json")):  # its earlier stage (a copy's too)
            raise SystemExit(f"error: --resume: {c.out_dir} was trained after its {stage} stage, which this command "
                             f"leaves out (--pretrain 0, --objective or --stage): drop that flag, or give --init_from "
                             f"{saved}")
        if key in explicit:
            raise SystemExit(f"error: --{key} {now!r} conflicts with the run --resume continues, {c.out_dir} "
                             f"({key}={saved!r}); drop the flag to inherit it")
        if key in RESUME_SAME:  # (the stages and their values were resolved from it)
            raise SystemExit(f"error: --resume: {c.out_dir} was trained with {key}={saved!r}, this command "
                             f"gives {now!r}: give --{key} as the run's")
        setattr(c, key, saved)
        sources[key] = "the run --resume continues"


def recipe_table(resolved):
    """The block a run prints at start and keeps in run.json: every recipe value of every stage, with its source."""
    keys = [*RECIPE_KEYS, *(f.name for f in fields(resolved[0][1]))]
    stages = [{"objective": c.objective, "out_dir": c.out_dir, "init_from": c.init_from,
               "values": {k: [getattr(c if hasattr(c, k) else m, k), src.get(k, "default")] for k in keys}}
              for c, m, src in resolved]
    lines = [f"recipe of --method {resolved[0][0].method}: {len(stages)} stage(s) (flag > recipe > default)"]
    for i, st in enumerate(stages, 1):
        lines.append(f"  stage {i}: {st['objective']} -> {st['out_dir']}")
        lines += [f"    {k:<22} {str(v) if v != '' else '(empty)':<20} {src}" for k, (v, src) in st["values"].items()]
    return stages, "\n".join(lines)


# -----------------------------------------------------------------------------
# checks: every input of a resolved run, one line each, before any work

def check_inputs(stages, cls):
    """A resolved run's values (check_stage), files (check_files) and run dirs (check_out_dirs), and what its
    stages read of them, before any work; returns the notes the checks make, for after every check (an error is
    the only line)."""
    for c, m, sources in stages:
        check_stage(c, m, cls)
        for flag, needs in getattr(cls, "SWITCHED", {}).items():  # a flag that only acts under another switch
            if sources.get(flag) == "flag" and not getattr(m, needs):
                raise SystemExit(f"error: --{flag} {getattr(m, flag)} applies under --{needs}")
        for flag in ("ratio", "eval_ratio"):  # (a recipe's R = 4..128 may pass a short context)
            if sources.get(flag) == "flag" and getattr(c, flag):
                check_ratio_fits(getattr(c, flag), c.max_context, flag)
    notes = check_files(*stages[0][:2]) + check_out_dirs(stages)
    (cfg, _, _), (last, _, _) = stages[0], stages[-1]
    if cfg.pretrain_data and not any(text_objective(c) for c, _, _ in stages):
        raise SystemExit(f"error: --pretrain_data is read by a text stage (pic ae+lm, sac or sentence_gist lm); this "
                         f"--method {cfg.method} run has none")
    flag = "eval_data" if last.eval_data else "data"  # what the final evaluation asks: eval.eval_records
    if hasattr(cls, "compress") and last.eval_examples and getattr(last, flag) and data.holds_text(getattr(last, flag)):
        raise SystemExit(f"error: --{flag} {getattr(last, flag)} is text: the final evaluation asks questions; name a "
                         "QA file with --eval_data, or --eval_examples 0")
    return notes


def check_stage(cfg, mcfg, cls):
    """A resolved stage's values: one-line errors before any work."""
    ratios_of(cfg.ratio)  # a bad --ratio before any method's own checks
    if cfg.eval_ratio:
        ratios_of(cfg.eval_ratio, "eval_ratio")
    for flag in ("max_context", "max_answer"):  # (steps, batch and lr: check_run_flags, then the recipe's)
        if getattr(cfg, flag) < 1:
            raise SystemExit(f"error: --{flag} {getattr(cfg, flag)} must be a positive integer")
    if cfg.batch_size > 1 << 20:  # (a step materialises its global batch: a typo's 10^20 filled the host's memory)
        raise SystemExit(f"error: --batch_size {cfg.batch_size}: at most 2^20 examples a step")
    for flag in ("min_lr_frac", "warmup_frac", "weight_decay", "grad_clip"):
        value = getattr(cfg, flag)
        if not math.isfinite(value) or value < 0:
            raise SystemExit(f"error: --{flag} {value!r} must be a finite number >= 0")
        if flag in ("min_lr_frac", "warmup_frac") and value > 1:
            raise SystemExit(f"error: --{flag} {value!r} is a fraction (of the peak lr, of the steps): 0 to 1")
    if cfg.lr * cfg.weight_decay >= 1:  # (1e10 went on to a nan loss at step 2, past the first checkpoint)
        raise SystemExit(f"error: --weight_decay {cfg.weight_decay!r} at --lr {cfg.lr!r}: AdamW scales the weights "
                         "by 1 - lr x weight_decay each step, which must stay above 0")
    if cfg.warmup_iters < 0 or cfg.eval_interval < 0 or cfg.eval_examples < 0:
        raise SystemExit("error: --warmup_iters, --eval_interval and --eval_examples must be >= 0")
    if cfg.eval_examples > 1 << 20:  # (as eval.py's --n: the synthetic benchmark would build every one first)
        raise SystemExit(f"error: --eval_examples {cfg.eval_examples} must lie in 0..2^20")
    if not -(1 << 63) <= cfg.seed < 1 << 63:  # (torch's generator takes 64 bits)
        raise SystemExit(f"error: --seed {cfg.seed} must lie in -2^63..2^63-1")
    formats = ("auto", "plain", "sac", *data.CHAT_FORMATS)
    if cfg.prompt not in formats:
        raise SystemExit(f"error: --prompt {cfg.prompt!r}; choose from {', '.join(formats)}")
    if cfg.dtype not in ("", "float32", "bfloat16"):
        raise SystemExit(f"error: --dtype {cfg.dtype!r}; choose float32 or bfloat16")
    cuda = pick_device(cfg.device).type == "cuda"
    if cfg.cuda_graphs and cfg.grad_accum > 1:  # a micro-batch's backward reuses the last one's .grad buffers
        raise SystemExit(f"error: --cuda_graphs with {cfg.grad_accum} micro-batches a step: CUDA-graph trees overwrite "
                         "the gradients one holds with the next's (pytorch/pytorch#169545); use one a step "
                         "(--grad_accum 1, --micro_batch at least the batch)")
    if cfg.cuda_graphs and not (cfg.compile and cuda and not cfg.grad_ckpt):
        raise SystemExit("error: --cuda_graphs replays --compile's layers as CUDA graphs: it needs --compile and "
                         "a CUDA device, and not --grad_ckpt (a recompute runs outside the graphs)")
    check_method_config(cfg, mcfg, cls)


def check_method_config(cfg, mcfg, cls):
    """The method's values (a stage's, or an edited run.json's: run_config): one-line errors."""
    lowest = 0 if getattr(cls, "full_finetuning", False) else 1  # pic and sentence_gist: --lora_r 0 trains weights
    if getattr(mcfg, "lora_r", lowest) < lowest:
        raise SystemExit(f"error: --lora_r {mcfg.lora_r} must be >= {lowest}"
                         + (" (0: full finetuning, no LoRA)" if lowest == 0 else " (the adapters' rank)"))
    if getattr(mcfg, "lora_r", 0) > 1 << 16:  # (far above any paper's 16-128; a typo's 10^11 asked for 150 TB)
        raise SystemExit(f"error: --lora_r {mcfg.lora_r}: at most 65536")
    if not 0 < getattr(mcfg, "lora_alpha", 1) <= 1 << 16:  # (the papers' 16-128; 10^41 overflowed to a nan loss)
        raise SystemExit(f"error: --lora_alpha {mcfg.lora_alpha} must lie in (0, 65536] (the adapters scale by "
                         "alpha / r)")
    if hasattr(cls, "check_config"):
        cls.check_config(cfg, mcfg)


def check_files(cfg, mcfg):
    """The files a run names, looked at before any work: one line naming the flag and file that is wrong. Their
    contents are checked where they are read (data before the model, the model before the first step). Returns
    its notes."""
    notes = []
    for flag in ("data", "eval_data", "pretrain_data"):
        path = getattr(cfg, flag)
        if path and not os.path.isfile(path):
            raise SystemExit(f"error: --{flag} {path!r}: {not_a_file(path)}")
    if cfg.data and cfg.eval_data and same_file(cfg.data, cfg.eval_data):
        notes.append(f"note: --eval_data {cfg.eval_data} is --data's file: validation and the final evaluation read "
                     "the questions training reads")
    for flag, path in (("init_from", tiny.base_path(cfg.init_from)), ("encoder", getattr(mcfg, "encoder", "")),
                       ("decoder", getattr(mcfg, "decoder", ""))):
        if path and not os.path.isfile(os.path.join(path, "config.json")) and not tiny.needs_training(path):
            raise SystemExit(f"error: --{flag} {path!r} is not an HF checkpoint dir (no config.json)")
    config = os.path.join(tiny.base_path(cfg.init_from), "config.json")  # (sac's "any length" is 2^20)
    doc = read_json(config) if os.path.isfile(config) else {}  # (a broken one: its line when the model loads)
    positions = doc.get("max_position_embeddings") if isinstance(doc, dict) else None
    if isinstance(positions, int) and cfg.max_context + cfg.max_answer > positions and cfg.max_context < 1 << 20:
        notes.append(f"note: --max_context {cfg.max_context} and --max_answer {cfg.max_answer} reach past the "
                     f"{positions} positions {config} was trained at (max_position_embeddings)")
    base = tiny.base_path(cfg.init_from)  # (its tokenizer read once, for the prompt checks below; pic's ae+lm would
    tok = None if tiny.needs_training(cfg.init_from) else data.load_tokenizer(base)  # train before QA failed)
    if tok is not None and cfg.prompt in ("auto", *data.CHAT_FORMATS):
        fmt = data.prompt_format(tok, cfg.prompt)  # (auto: the chat template's turns, which the model loaded first)
        if not all(map(tok.has_special, turn := data.CHAT_FORMATS.get(fmt, ()))):
            raise SystemExit(f"error: --prompt {cfg.prompt}" + (f" (its chat template's {fmt})" if fmt != cfg.prompt
                             else "") + f": the tokenizer of {base} has no "
                             f"{' and '.join(turn)} tokens")
    other = (run_state(cfg.init_from) or {"train": {"method": "base"}})["train"]["method"]
    if other == "teacher" != cfg.method:
        raise SystemExit(f"error: --init_from {cfg.init_from!r} is a --method teacher run: pass it as --teacher "
                         "(its adapter is merged into the base)")
    if other not in (cfg.method, "base", "teacher"):  # a run of another method: its weights would be dropped
        raise SystemExit(f"error: --init_from {cfg.init_from!r} is a --method {other} run; a --method {cfg.method} "
                         f"run starts from a checkpoint dir or an earlier {cfg.method} stage")
    if cfg.teacher and getattr(mcfg, "decoder", ""):  # (load_base merges it into --init_from's base)
        raise SystemExit("error: --teacher with --decoder: the teacher's adapter merges into --init_from's base, which "
                         "only encodes here, and --decoder's model answers as it loads; drop --teacher")
    if cfg.teacher and not os.path.isfile(os.path.join(cfg.teacher, "teacher", "adapter_config.json")):
        raise SystemExit(f"error: --teacher {cfg.teacher!r} has no teacher/adapter_config.json")
    if cfg.teacher and (state := run_state(cfg.teacher)):  # its adapter merges into this run's base: the same one
        theirs, ours = (os.path.realpath(tiny.base_path(p)) for p in (state["train"]["init_from"], cfg.init_from))
        if theirs != ours and os.path.isdir(theirs):  # (gone: moved, or on another machine; not checked)
            raise SystemExit(f"error: --teacher {cfg.teacher} was trained on the base {theirs}; this run's is {ours}")
    taught = teacher_prompt(cfg.teacher)
    if taught and taught != cfg.prompt and tok is not None:
        if data.prompt_format(tok, taught) != data.prompt_format(tok, cfg.prompt):
            raise SystemExit(f"error: --prompt {cfg.prompt}: --teacher {cfg.teacher} was trained on --prompt {taught} "
                             "prompts (drop the flag to take its format)")
    return notes


def check_out_dirs(stages):
    """No stage writes into (or below) a checkpoint the run reads: --init_from (by default the shipped tiny base),
    --teacher, --encoder, --decoder (a --method base run writes a base: its own dir is the one it makes); nor
    replaces a run of another method (one of its own starts anew there). Returns its notes."""
    notes = []
    (cfg, mcfg, _), out_dirs = stages[0], [os.path.realpath(c.out_dir) for c, _, _ in stages]
    reads = {} if cfg.method == "base" else {"init_from": cfg.init_from or tiny.BASE_DIR, "teacher": cfg.teacher,
                                             **{flag: getattr(mcfg, flag, "") for flag in ("encoder", "decoder")}}
    for flag, path in reads.items():
        read = os.path.realpath(path) if path else None
        if read and any(out == read or out.startswith(read + os.sep) for out in out_dirs):
            raise SystemExit(f"error: --out_dir {stages[-1][0].out_dir!r}: the run would write into the --{flag} "
                             f"it reads ({path}); give the run its own dir")
    for c, _, _ in stages:
        there = run_state(c.out_dir)
        if there and there["train"]["method"] != c.method:  # (--resume of it: resolve said so)
            raise SystemExit(f"error: --out_dir {c.out_dir!r} holds a --method {there['train']['method']} run (step "
                             f"{there['step']}); give this run another dir")
        others = [] if there else [f for f in ("metrics.json", "log.jsonl") if os.path.isfile(os.path.join(
            c.out_dir, f)) and not (f == "log.jsonl" and logs_step_one(os.path.join(c.out_dir, f)))]
        if others:  # (eval.py writes a metrics.json in a run dir; a run stopped before its first checkpoint, a log)
            raise SystemExit(f"error: --out_dir {c.out_dir!r} holds a {others[0]} and no run.json: not a train.py run "
                             "dir (a run replaces its files); give this run another dir")
        if there and not c.resume:
            notes.append(f"note: {c.out_dir} holds a --method {c.method} run (step {there['step']}); this one starts "
                         "anew and replaces it (--resume continues it)")
    return notes


def logs_step_one(log):
    """Whether a log.jsonl's first line is a train.py run's step 1 record."""
    try:
        with open(log) as f:
            return json.loads(f.readline()).get("step") == 1
    except (ValueError, AttributeError, OSError):  # (not UTF-8, not JSON, not an object; unreadable)
        return False


def check_writable(path, flag, folder=True):
    """One line, before any work, when `path` (a folder to use or make; folder=False: a file to write) cannot be."""
    if not str(path).strip():
        raise SystemExit(f"error: {flag} is empty: name a {'folder' if folder else 'file'}")
    if not folder:
        if os.path.isdir(path):
            raise SystemExit(f"error: {flag} {path!r} is a folder; name a file")
        name, run_dir = os.path.basename(path), os.path.dirname(os.path.abspath(path))
        if os.path.isfile(os.path.join(run_dir, "run.json")) and (
                name in ("run.json", "metrics.json", "log.jsonl") or name.endswith(".safetensors")):
            raise SystemExit(f"error: {flag} {path!r} is a file of the run {run_dir}; name another")
    there = os.path.abspath(path if folder else os.path.dirname(os.path.abspath(path)))
    while not os.path.exists(there):  # the nearest folder that exists: the rest is made in it
        if os.path.islink(there):  # (makedirs would fail on it, after the model is built)
            raise SystemExit(f"error: {flag} {path!r}: {there} is a link to {os.readlink(there)}, which does not exist")
        there = os.path.dirname(there)
    if not os.path.isdir(there):
        raise SystemExit(f"error: {flag} {path!r}: {there} is a file, not a folder")
    try:  # (os.access: root may write anywhere, but not into /proc)
        tempfile.TemporaryFile(dir=there).close()
    except OSError:
        raise SystemExit(f"error: {flag} {path!r}: {there} is not writable") from None


def not_a_file(path):
    return ("a folder, not a file" if os.path.isdir(path) else "not a regular file (a pipe or device: save it to a "
            "file)" if os.path.exists(path) else "no such file")


def same_file(a, b):
    """Two paths to one file, or two files of the same bytes."""
    return os.path.samefile(a, b) or os.path.getsize(a) == os.path.getsize(b) and filecmp.cmp(a, b, shallow=False)


# -----------------------------------------------------------------------------
# building a run: tokenizer, base model, method

def load_base(cfg, device, dtype):
    """(tokenizer, base Transformer) for cfg.init_from (an HF dir or a run dir), with the
    --teacher adapter merged in: the teacher is the frozen base from here on."""
    path = tiny.base_path(cfg.init_from)
    if not os.path.exists(os.path.join(path, "config.json")):
        raise SystemExit(f"error: --init_from {path!r} is not an HF checkpoint dir (no config.json)")
    tok = data.load_tokenizer(path)
    adapter = os.path.join(cfg.teacher, "teacher") if cfg.teacher else ""
    if adapter and not os.path.exists(os.path.join(adapter, "adapter_config.json")):
        raise SystemExit(f"error: --teacher {cfg.teacher!r} has no teacher/adapter_config.json")
    base = Transformer.from_pretrained(path, dtype=torch.float32 if adapter else dtype, device=device)
    top = max(i for i in (tok.vocab_size - 1, tok.bos_id, tok.pad_id, *tok.eos_ids) if i is not None)
    if top >= base.config.vocab_size:  # (an IndexError in the first step)
        raise SystemExit(f"error: --init_from {path}: token id {top} (of its tokenizer, or a bos / eos / pad id of its "
                         f"config files) is past config.json's vocab_size {base.config.vocab_size}")
    if adapter:  # merged in fp32, then rounded once: into a bf16 base, W would round twice (4x the KL to it)
        base.load_adapter(adapter, "teacher")
        base.merge_adapter("teacher")
        base.to(dtype)
    return tok, base


def build(cfg, mcfg, device, dtype):
    tok, base = load_base(cfg, device, dtype)
    base.requires_grad_(cfg.method == "base")
    method = method_registry()[cfg.method](base, mcfg, tok, cfg)
    if tiny.aided(cfg):
        tiny.add_decoder_adapter(method)
        tiny.w_from_identity(method)
    method = method.to(device)
    for p in method.parameters():  # fp32 master weights where a bf16 base trains (sentence_gist --lora_r 0): a bf16
        if p.requires_grad:        # weight drops every update below its precision, ~1e-4 of |w| at these lrs
            p.data = p.data.float()
    for m in method.modules():  # the base and any separate encoder / decoder (pic)
        if isinstance(m, Transformer):
            m.grad_ckpt = cfg.grad_ckpt
    if cfg.method != "base" and run_state(cfg.init_from, cfg.method):
        load_checkpoint(cfg.init_from, method, partial=True)  # a later stage starts from the first (pic, ata, gist)
    return tok, base, method


def run_config(run_dir):
    """(cfg, mcfg, method class) of a run, read from its run.json alone: no weights load."""
    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path):
        raise SystemExit(f"error: {run_dir!r} is not a run dir (no run.json)")
    state = read_json(path)
    if not (isinstance(state, dict) and all(isinstance(state.get(k), dict) for k in ("train", "method"))
            and "method" in state["train"]):
        raise ValueError(f"{path}: not a run.json written by train.py (needs train.method and method)")
    methods, name = method_registry(), state["train"]["method"]
    if name not in methods:
        raise SystemExit(f"error: {run_dir}: unknown method {name!r}; known: {', '.join(methods)}")
    for key, config in (("train", TrainConfig), ("method", methods[name].Config)):
        unknown = sorted(state[key].keys() - {f.name for f in fields(config)})
        if unknown:  # a run of an older version (ata's prefix is --no_prefix now)
            raise SystemExit(f"error: {path}: {key} keys {unknown} are not {config.__name__} fields; retrain the run")
        for f in fields(config):  # each value of its field's kind (an edited run.json)
            value, kind = state[key].get(f.name, f.default), type(f.default)
            if type(value) is not kind and not (kind is float and type(value) is int):
                raise SystemExit(f"error: {path}: {key}.{f.name} is {value!r:.40}, expected {kind.__name__}")
    cfg = TrainConfig(**state["train"])
    for key in ("max_context", "max_answer"):  # (and the ratios the run reads: what eval.py reads of an edited one)
        if getattr(cfg, key) < 1:
            raise SystemExit(f"error: {path}: train.{key} is {getattr(cfg, key)}, expected >= 1")
    for key in ("ratio", "eval_ratio") if hasattr(methods[name], "compress") else ():
        try:
            ratios_of(getattr(cfg, key) or cfg.ratio, key)
        except SystemExit as e:
            raise SystemExit(f"error: {path}: train.{key}: {str(e).partition(': ')[2]}") from None
    mcfg = methods[name].Config(**state["method"])
    try:
        check_method_config(cfg, mcfg, methods[name])
    except SystemExit as e:
        raise SystemExit(f"error: {path}: {str(e).removeprefix('error: ')}") from None
    if name == "base":
        cfg.init_from = run_dir
    return cfg, mcfg, methods[name]


def check_moved(run_dir, cfg):
    """A base or teacher the run names that is gone since it trained (moved): one line naming run.json's key."""
    for key in ("init_from", "teacher"):
        if getattr(cfg, key) and not os.path.exists(getattr(cfg, key)):
            raise SystemExit(f"error: {run_dir}: its run.json's train.{key} {getattr(cfg, key)!r} is gone (moved? "
                             "write its new path there, or give it as a flag to --resume)")


def load_run(run_dir, device="cpu", dtype=torch.float32):
    """(cfg, mcfg, tok, base, method) of a finished run, ready for eval."""
    cfg, mcfg, _ = run_config(run_dir)
    check_moved(run_dir, cfg)
    tok, base, method = build(cfg, mcfg, device, dtype)
    if cfg.method != "base":
        load_checkpoint(run_dir, method)
    method.eval()
    return cfg, mcfg, tok, base, method


# -----------------------------------------------------------------------------
# checkpoints: safetensors + JSON, written atomically (temp file, fsync, rename)

def atomic_write(path, write):
    """write(tmp), then rename tmp to path: a failure (a full disk) leaves what path held; OSError naming path."""
    tmp = path + ".tmp"
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except (OSError, SafetensorError) as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise OSError(f"{path}: could not write it ({e})") from None
    os.replace(tmp, path)


def save_checkpoint(out_dir, method, opt, step, cfg, mcfg, flags, recipe, command, last_stage, kept):
    """ckpt-<step>.safetensors (trainable tensors), optim-<step>.safetensors (AdamW state, torch's RNGs), then run.json
    naming them: its rename is the commit point, so a kill leaves the previous one whole. Older files go after,
    with a metrics.json (eval.py's cache) from an earlier run in the same dir. kept: more run.json keys (the
    stage's data_hash, teacher_stamp)."""
    os.makedirs(out_dir, exist_ok=True)
    params = {n: p.detach().contiguous().cpu() for n, p in method.named_parameters() if p.requires_grad}
    opt_state = opt.state_dict()  # its param_groups and state name the parameters 0, 1, ... in group order
    optim = {f"{i}::{k}": v.detach().contiguous().cpu() for i, s in opt_state["state"].items() for k, v in s.items()}
    optim["rng::torch"] = torch.get_rng_state()
    device = next(method.parameters()).device
    if device.type == "cuda":  # LoRA dropout there draws from the device's generator (DDP: rank 0's, for every rank)
        optim["rng::cuda"] = torch.cuda.get_rng_state(device)
    files = {"ckpt": f"ckpt-{step:07d}.safetensors", "optim": f"optim-{step:07d}.safetensors"}
    atomic_write(os.path.join(out_dir, files["ckpt"]), lambda p: save_file(params, p))
    atomic_write(os.path.join(out_dir, files["optim"]), lambda p: save_file(optim, p))
    if cfg.method == "base":  # the base run dir is also an HF checkpoint dir
        hf = method.base.base_state()
        atomic_write(os.path.join(out_dir, "model.safetensors"), lambda p: save_file(hf, p, metadata={"format": "pt"}))
    if cfg.method == "teacher":  # PEFT format, for --teacher and for peft users
        method.base.save_adapter("teacher", os.path.join(out_dir, "teacher"))
    before = run_state(out_dir) if cfg.resume else None  # a resumed run keeps the flags its rows name
    flags = set(flags) | set(before.get("flags", []) if before else ())
    state = {"step": step, "files": files, "train": asdict(cfg), "method": asdict(mcfg), "flags": sorted(flags),
             "recipe": recipe, "param_groups": opt_state["param_groups"], "python_rng": list(random.getstate()[1]),
             **kept, "command": command, "last_stage": last_stage}
    atomic_write(os.path.join(out_dir, "run.json"), lambda p: json.dump(state, open(p, "w"), indent=1))
    for f in os.listdir(out_dir):  # and eval.py's metrics.json, which scored the checkpoint before this one
        if (f.startswith(("ckpt-", "optim-")) and f not in files.values()) or f == "metrics.json":
            os.remove(os.path.join(out_dir, f))


def data_hash(items):
    """A hash of a stage's items as read (stage_data's training and validation items; None: synthetic): run.json keeps
    it, and --resume refuses data files that hold other records now (exact resume reads the same ones)."""
    records, val, _ = items
    if records is None and val is None:
        return None
    digest = hashlib.sha256()
    for item in [*(records or ()), None, *(val or ())]:
        digest.update(json.dumps(item, sort_keys=True).encode())
    return digest.hexdigest()[:16]


def teacher_stamp(teacher):
    """The --teacher adapter's bytes as they are now (a hash): a run keeps the one it distilled, and eval.py reads it
    only on that one (a teacher trained again in its dir changes the base the run decodes on)."""
    path = os.path.join(teacher, "teacher", "adapter_model.safetensors")
    if not teacher or not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()[:16]


def log_upto(log, step):
    """The lines of log.jsonl up to `step`'s record, where --resume goes on; a line that is no step's record (a
    write cut short) is one line naming it."""
    kept = []
    for i, line in enumerate(open(log), 1):
        try:
            kept += [line] if json.loads(line)["step"] <= step else []
        except (ValueError, KeyError, TypeError):
            raise SystemExit(f"error: {log}:{i}: not a step's record; delete that line and resume again") from None
    return kept


def checkpoint_of(run_dir):
    """(run.json, the path of the checkpoint it names) of a run dir; one naming the file for a run.json train.py did not
    write or a checkpoint that is gone."""
    state = read_json(os.path.join(run_dir, "run.json"))
    files = state.get("files") if isinstance(state, dict) else None
    if not (isinstance(files, dict) and isinstance(files.get("ckpt"), str) and type(state.get("step")) is int):
        raise ValueError(f"{run_dir}/run.json: not a run.json written by train.py (needs step, files.ckpt)")
    if not os.path.isfile(os.path.join(run_dir, files["ckpt"])):
        raise ValueError(f"{run_dir}: its checkpoint {files['ckpt']} is missing")
    return state, os.path.join(run_dir, files["ckpt"])


def load_checkpoint(out_dir, method, opt=None, partial=False):
    """Trainable tensors (and optimizer state, RNG) of a run dir; returns the step. partial: the run is an earlier
    stage, which may train fewer (sentence_gist's stage 1, the gist rows alone)."""
    state, ckpt = checkpoint_of(out_dir)
    params = {n: p for n, p in method.named_parameters() if p.requires_grad or opt is None}  # --resume: trainable only
    tensors = read_tensors(ckpt)
    unknown = [k for k, v in tensors.items() if k not in params or v.shape != params[k].shape]
    if unknown:
        raise SystemExit(f"error: {out_dir}: checkpoint tensors {unknown[:5]} do not match this method's parameters "
                         "(names or shapes)")
    missing = [n for n, p in method.named_parameters() if p.requires_grad and n not in tensors]
    if missing and not partial:  # (--resume would load the optimizer's state onto the wrong tensors; eval would read
        # the missing ones at their initial values)
        raise SystemExit(f"error: {out_dir}: its checkpoint lacks this method's trainable {missing[:5]}: a run of "
                         "other flags")
    with torch.no_grad():
        for k, v in tensors.items():
            params[k].copy_(v)
    if opt is not None:
        optim = {}
        for key, v in read_tensors(os.path.join(out_dir, state["files"]["optim"])).items():
            i, _, slot = key.partition("::")
            optim.setdefault(i, {})[slot] = v
        rng = optim.pop("rng")
        torch.set_rng_state(rng["torch"])
        device = next(method.parameters()).device
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
        if not all(i.isdigit() for i in optim):  # older runs keyed it by parameter name
            raise SystemExit(f"error: {out_dir}: optimizer state in an older format; --resume needs a newer checkpoint")
        opt.load_state_dict({"state": {int(i): s for i, s in optim.items()}, "param_groups": state["param_groups"]})
        random.setstate((3, tuple(state["python_rng"]), None))
    return state["step"]


# -----------------------------------------------------------------------------
# data: batches for step s are a pure function of (seed, s, rank)

def text_objective(cfg):
    return cfg.objective in ("lm", "ae+lm") and cfg.method != "base"


def read_records(path, cfg, text=False):
    """The records of a QA file (text: the texts of a text file) as a list; those the readers skip (unanswerable in
    SQuAD v2, malformed under --skip_bad, MS MARCO's no answer) a note; none at all a one-line error."""
    stats = {}
    items = (data.read_text(path, skip_bad=cfg.skip_bad, stats=stats) if text else
             data.read_dataset(path, distractors=cfg.hotpot_distractors, skip_bad=cfg.skip_bad, stats=stats))
    if not items:  # (one line: the counts are in it)
        raise SystemExit(f"error: {path!r} holds no {'text' if text else 'usable records'}"
                         + (f" ({stats})" if stats else ""))
    if stats.keys() - {"records"}:
        print(f"note: {path}: {stats}", file=sys.stderr)
    return items


def read_items(path, cfg, text):
    """The items of a file: QA records, or for a text objective the texts of a text file (.txt, {"text"} .jsonl,
    gzipped or not: data.holds_text); a QA file's records there train on their contexts (texts_of). A file with
    none is a one-line error."""
    return read_records(path, cfg, text=text and data.holds_text(path))


def context_of(item):
    """A QA record's context; a text is its own."""
    return item["context"] if isinstance(item, dict) else item


def texts_of(items):
    """A text stage's items: the contexts of QA records, each once; texts as they are."""
    return list(dict.fromkeys(map(context_of, items))) if items and isinstance(items[0], dict) else items


def stage_data(cfg):
    """(training items, validation items, a line saying what validation reads) of a stage, read before any work:
    --data (a text objective: --pretrain_data, else --data's contexts); validation on --eval_data (also when training
    is synthetic), else on a held-out slice of the training file (held_out) that training never sees, its contexts
    included. None: synthetic."""
    text = text_objective(cfg)
    path = (cfg.pretrain_data or cfg.data) if text else cfg.data
    items = read_items(path, cfg, text) if path else None
    if cfg.eval_data:
        val, line = read_items(cfg.eval_data, cfg, text), f"validation: {cfg.eval_data}"
        seen = {it["context"] for it in items or () if isinstance(it, dict)}
        shared = sum(isinstance(it, dict) and it["context"] in seen for it in val)
        if shared and not same_file(path, cfg.eval_data):  # (the same file: check_files says so)
            print(f"note: {shared} of the {len(val)} --eval_data questions have a context of {path}, which training "
                  "reads", file=sys.stderr)
    elif not path:
        return None, None, "validation: the synthetic benchmark's val split"
    else:
        items, val = held_out(items, cfg.seed)
        line = (f"validation: {path} (one context: the training items themselves)" if items is val else
                f"validation: {len(val)} items of {path} held out of training, with their contexts")
    if not text:
        return items, val, line
    texts = texts_of(items)
    passes = cfg.max_iters * cfg.batch_size / len(texts or [1])
    if texts is not items and passes > 1:  # (the papers pretrain on a corpus: PIC ~3B FineWeb tokens, SAC 2B)
        print(f"note: {cfg.method} {cfg.objective} trains on the {len(texts):,} contexts of {path}, {passes:.0f} times "
              f"each ({cfg.max_iters:,} steps x {cfg.batch_size}); a text corpus: --pretrain_data", file=sys.stderr)
    return texts, texts_of(val), line


def held_out(items, seed):
    """(training items, held-out items) of a file: contexts drawn with seed until their items make 2 % of the file's
    (at least one, about 256 at most), every question of a held-out context held out with it: no held-out question's
    context is trained on, in a QA stage or a text stage on the file's contexts (SQuAD asks ~5 of a paragraph).
    Without --eval_data they validate the run, and its final evaluation reads the held-out questions of --data
    (eval.eval_records). A file of one context: (items, items), nothing to hold out."""
    sizes = collections.Counter(map(context_of, items))
    want, held, n = min(256, max(1, len(items) // 50)), set(), 0
    for context in random.Random(seed).sample(list(sizes), len(sizes))[:-1]:  # (one context at least trains)
        if n >= want:
            break
        held.add(context)
        n += sizes[context]
    if not held:
        return items, items
    is_held = [context_of(it) in held for it in items]
    return [it for it, h in zip(items, is_held) if not h], [it for it, h in zip(items, is_held) if h]


class Batches:
    """Micro-batches for every objective: records of a file, each epoch one permutation of them (seed + epoch),
    or synthetic ones (a fresh sample per step, with the base's curriculum; split "val" for validation)."""

    def __init__(self, cfg, tok, method, records=None, rank=0, world=1, split="train"):
        self.cfg, self.tok, self.method, self.rank, self.world = cfg, tok, method, rank, world
        self.text, self.records, self.order = text_objective(cfg), records, (None, None)
        self.synth = tiny.Synthetic(seed=cfg.seed, split=split)
        synthetic = records is None  # aid 3 needs the synthetic items' extra QA pairs
        self.questions = tiny.questions(method) if tiny.aided(cfg) and synthetic else 1
        self.stats = {}

    def permutation(self, epoch):
        """The records' order in epoch e: one shuffle an epoch (seed + e), kept while the epoch lasts."""
        if self.order[0] != epoch:
            perm = list(range(len(self.records)))
            random.Random(self.cfg.seed + epoch).shuffle(perm)
            self.order = (epoch, perm)
        return self.order[1]

    def raw(self, step, n):
        """n raw items (QA records or texts) of the global batch of this step."""
        if self.records is not None:
            out = []
            for i in range(step * n, step * n + n):
                epoch, j = divmod(i, len(self.records))
                out.append(self.records[self.permutation(epoch)[j]])
            return out
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        kind = "text" if self.text else "base" if self.cfg.method == "base" else "qa"
        qas = self.method.cfg.qa_per_context if kind == "base" else self.questions
        return tiny.synthetic_items(self.synth, rng, n, step / max(1, self.cfg.max_iters), kind, qas,
                                    aids=tiny.aided(self.cfg))

    def __call__(self, step):
        """This rank's micro-batches of step `step`: a list of grad_accum collated dicts."""
        cfg, accum = self.cfg, self.cfg.grad_accum
        items = self.raw(step, cfg.batch_size)  # the global batch (more items early in the base's curriculum)
        per_rank = len(items) // (self.world * accum)
        rng = random.Random(cfg.seed * 7919 + step)  # templates drawn per global item: ranks x batch keeps the data
        if not self.text:
            items = [dict(it, template=rng.randrange(len(data.QA_TEMPLATES))) for it in items]
        starts = [(a * self.world + self.rank) * per_rank for a in range(accum)]
        mine = sorted((it for lo in starts for it in items[lo:lo + per_rank]),  # less padding, the same step
                      key=lambda it: len(it["context"] if isinstance(it, dict) else it))
        return [dict(self.collate(mine[lo:lo + per_rank]), step=step)  # step: ata's per-step r
                for lo in range(0, len(mine), per_rank)]

    def collate(self, items):
        cfg = self.cfg
        if cfg.method == "base":
            return tiny.collate_base(items, self.tok, self.method.cfg.context_weight)
        if self.text:
            halves = getattr(self.method, "compresses_half_text", False)  # so the compressed half reaches max_context
            return data.collate_lm(items, self.tok, cfg.max_context * (2 if halves else 1), cfg.pad_multiple,
                                   self.stats)
        batch = data.collate_qa(items, self.tok, max_context=cfg.max_context, max_answer=cfg.max_answer,
                                stats=self.stats, pad_multiple=cfg.pad_multiple, format=cfg.prompt)
        if self.questions > 1:
            batch = tiny.add_questions(batch, items, self.tok)
        prepare = getattr(self.method, "prepare", None)
        return prepare(batch) if prepare else batch


def to_device(batch, device):
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


# -----------------------------------------------------------------------------
# the loop

def lr_at(step, cfg, schedule="cosine"):
    """Linear warmup, then cosine (or, schedule "linear", linear) decay to lr * min_lr_frac."""
    warmup = cfg.warmup_iters or max(1, int(cfg.warmup_frac * cfg.max_iters))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, cfg.max_iters - warmup))
    decay = 1 - t if schedule == "linear" else 0.5 * (1 + math.cos(math.pi * t))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * decay)


def pick_device(name):
    """The torch.device `name` ("": cuda where there is one, else cpu); one line for one this machine lacks."""
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError:
        raise SystemExit(f"error: --device {name!r} is not a device; use cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return torch.device("cpu")  # cpu:N too (safetensors reads "cpu" only)
    if device.type != "cuda" or (device.index or 0) >= torch.cuda.device_count():
        raise SystemExit(f"error: --device {name!r}: use cpu or cuda[:N]; this machine has {torch.cuda.device_count()} "
                         "CUDA device(s)")
    return device


def init_distributed(cfg):
    """(ddp, rank, world, device) from the torchrun environment: NCCL on CUDA, gloo on CPU."""
    device = str(pick_device(cfg.device))
    if int(os.environ.get("RANK", -1)) == -1:
        return False, 0, 1, torch.device(device)
    if not dist.is_initialized():  # one group per process (train.main called again in it)
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    return True, dist.get_rank(), dist.get_world_size(), torch.device(device)


def drop_commit_points(run_dirs):
    """A run dir whose run is being replaced: its run.json (the checkpoint it names) and eval.py's metrics.json go."""
    for d, old in itertools.product(run_dirs, ("run.json", "metrics.json")):
        Path(d, old).unlink(missing_ok=True)


def prepare_base(cfg, mcfg, master, ddp):
    """`--method base` starts from a fresh tiny model in its own run dir; any other run
    whose base is the shipped tiny_base/ trains it first when it has been deleted."""
    if cfg.method == "base" and tiny.is_tiny(cfg.init_from):
        if master:
            if not cfg.resume:  # a base trained there: its model is replaced now, before step 1 (init_base)
                drop_commit_points([cfg.out_dir])
            tiny.init_base(cfg.out_dir, mcfg, cfg.seed, cfg.resume)
        cfg.init_from = cfg.out_dir
    elif ddp and tiny.needs_training(cfg.init_from):
        raise SystemExit(f"error: {tiny.BASE_DIR} is missing or part-trained: run once without torchrun, which "
                         "trains it first")
    elif master and tiny.needs_training(cfg.init_from):
        stopped = all(os.path.exists(os.path.join(tiny.BASE_DIR, f)) for f in ("run.json", "model.safetensors"))
        print((f"{tiny.BASE_DIR} is part-trained: continuing it first" if stopped else
               f"no {tiny.BASE_DIR}: training the tiny base first") + " (~75 min on 2 CPU cores in all)")
        if not main(["--method", "base", "--out_dir", tiny.BASE_DIR, "--seed", str(cfg.seed), "--device", cfg.device,
                     "--dtype", cfg.dtype] + (["--quiet"] if cfg.quiet else []) + (["--resume"] if stopped else [])):
            print(f"interrupted while training {tiny.BASE_DIR}: this run did not start; the same command again "
                  "continues the base", file=sys.stderr)
            raise SystemExit(130)  # as any interrupted run: not on a part-trained base
    if ddp:
        dist.barrier()


class AdamW:
    """torch.optim.AdamW's update (decoupled weight decay on bias-corrected Adam moments), in foreach kernels,
    with its state_dict layout (an optimizer file of either reads into both). Its own class because torch.optim
    imports torch._dynamo: ~1.5 s at the start of every training process, and the test suites start many."""

    def __init__(self, groups, lr, betas, eps=1e-8):
        self.param_groups = [{**g, "lr": lr, "betas": betas, "eps": eps} for g in groups]
        self.state = {}  # parameter -> {"step": count, "exp_avg": m, "exp_avg_sq": v}

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            params = [p for p in g["params"] if p.grad is not None]
            for p in params:
                if p not in self.state:
                    self.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                     "exp_avg_sq": torch.zeros_like(p)}
            if not params:
                continue
            states, grads = [self.state[p] for p in params], [p.grad for p in params]
            m, v = [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]
            (beta1, beta2), lr = g["betas"], g["lr"]
            torch._foreach_add_([s["step"] for s in states], 1)
            if g["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * g["weight_decay"])
            torch._foreach_lerp_(m, grads, 1 - beta1)  # m <- beta1 m + (1 - beta1) g
            torch._foreach_mul_(v, beta2)
            torch._foreach_addcmul_(v, grads, grads, 1 - beta2)  # v <- beta2 v + (1 - beta2) g^2
            t = torch.stack([s["step"] for s in states]).tolist()  # one op, not one .item() per parameter
            denom = torch._foreach_sqrt(v)  # sqrt(v / (1 - beta2^t)) + eps
            torch._foreach_div_(denom, [(1 - beta2 ** n) ** 0.5 for n in t])
            torch._foreach_add_(denom, g["eps"])
            torch._foreach_addcdiv_(params, m, denom, [-lr / (1 - beta1 ** n) for n in t])  # m / (1 - beta1^t)

    def zero_grad(self):  # (set_to_none, as torch's default)
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    def state_dict(self):
        """{"state": {i: slots}, "param_groups": [{..., "params": [i, ...]}]}, parameters numbered in group order."""
        index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return {"state": {index[p]: s for p, s in self.state.items()},
                "param_groups": [{**g, "params": [index[p] for p in g["params"]]} for g in self.param_groups]}

    def load_state_dict(self, state):
        """The moments and step counts; the hyperparameters stay this command's (--resume gives the run's, or a flag's:
        its --weight_decay applies), where torch's copies the saved ones."""
        params = [p for g in self.param_groups for p in g["params"]]
        self.state = {params[i]: {k: x.clone() if k == "step" else x.to(params[i], copy=True) for k, x in s.items()}
                      for i, s in state["state"].items()}


def diverged(loss, which, step, saved, out_dir):
    """One line, and the run stops, when a loss is nan or inf: the weights that gave it are not saved."""
    if not math.isfinite(loss):
        kept = f"keeps step {saved}" if saved else "holds no checkpoint of this run"
        raise SystemExit(f"error: step {step}: the {which} loss is {loss}; stopped ({out_dir} {kept}). A lower --lr "
                         "(or --grad_clip) may keep it finite")


def train_step(model, micro, params, opt, ratios, device, autocast, ddp, world, cfg):
    """One optimizer step over this rank's micro-batches; returns (loss per token, metrics: this rank's means weighted
    by each micro-batch's targets, the input tokens its passes read (padding included, labels not), whether a rank got
    Ctrl-C). Gradients are sums over tokens, scaled by the global token count (DDP already averaged over ranks); one
    all_reduce carries loss, count and every rank's Ctrl-C."""
    total, count, metrics, tokens = 0.0, 0.0, {}, 0
    for i, mb in enumerate(micro):
        mb = to_device(mb, device)
        if cfg.cuda_graphs:  # a new forward: the graphs may overwrite the last one's outputs
            torch.compiler.cudagraph_mark_step_begin()
        sync = nullcontext() if (not ddp or i == len(micro) - 1) else model.no_sync()
        with sync, autocast:
            loss, n, m = model(mb, ratios)
        loss.backward()
        total, count = total + loss.item(), count + float(n)
        tokens += sum(v.numel() for k, v in mb.items() if torch.is_tensor(v) and v.dim() == 2 and v.dtype == torch.long
                      and not k.endswith("labels"))
        for k, v in m.items():  # (summed, n-weighted: the step's mean over its micro-batches, not the last one's)
            metrics[k] = metrics.get(k, 0.0) + float(v) * float(n)
    metrics = {k: v / max(count, 1.0) for k, v in metrics.items()}
    counts = torch.tensor([total, count, len(STOP)], device=device, dtype=torch.float64)
    if ddp:
        dist.all_reduce(counts)
    torch._foreach_mul_([p.grad for p in params if p.grad is not None], world / max(counts[1].item(), 1.0))
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    opt.zero_grad()
    return counts[0].item() / max(counts[1].item(), 1.0), metrics, tokens, counts[2].item() > 0


def stop_together(ddp, device):
    """Whether a rank got Ctrl-C / SIGTERM (one may, as `kill -INT` on rank 0's process): after it every rank's STOP
    says so (a rank that left its loop alone left the others waiting in their next all_reduce)."""
    if ddp:
        flag = torch.tensor([float(len(STOP))], device=device)
        dist.all_reduce(flag)
        if flag.item() > 0 and not STOP:
            STOP.append(1)
    return bool(STOP)


@torch.no_grad()
def validation_loss(method, batches, device, autocast, ratios):
    """Mean loss on two fixed held-out steps' micro-batches (steps far beyond training)."""
    method.eval()
    total = count = 0.0
    for s in range(2):
        for mb in batches(10_000_000 + s):
            with autocast:
                loss, n, _ = method(to_device(mb, device), ratios)
            total, count = total + loss.item(), count + float(n)
    method.train()
    return total / max(count, 1.0)


@contextmanager
def one_line_errors(advice):
    """A script's user errors as one line (exit 1): a reader's ValueError, a file that cannot be read or written, the
    host's or the GPU's allocator refusing (a run too large for this machine: `advice` says what to lower)."""
    try:
        yield
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    except RuntimeError as e:
        if not (isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e)):
            raise
        raise SystemExit(f"error: out of memory ({(str(e).splitlines() or [''])[0][:200]}): {advice}") from None
    except MemoryError:  # (Python's own: building a huge batch of examples)
        raise SystemExit(f"error: out of memory (the host's): {advice}") from None


def main(argv):
    """Every stage of the run's recipe, in order (resolve); returns the last stage's run dir, or None after
    --help or an interrupted stage."""
    if "-h" in argv or "--help" in argv:  # the flags of --method (meanpool unless given)
        cls = configure([a for a in argv if a not in ("-h", "--help")])[3]
        print(f"methods: {', '.join(method_registry())}; each has its own flags (--method NAME --help)\n"
              "defaults: a flag not given takes the method's paper recipe on a real checkpoint, its tiny settings on "
              "the tiny base, else the default below; a run prints each value it uses and where it came from\n")
        return make_parser([TrainConfig, cls.Config]).print_help()
    # 1) flags, the recipe, every input checked before any work
    started, source = started_command(argv)  # --resume: the run's command, then this one's flags (the last wins)
    try:
        cfg, mcfg, explicit, cls = configure(started + list(argv))
    except SystemExit as e:  # (a flag of an older version in the command, say)
        raise SystemExit(f"{e.code} (with the command {source} keeps for --resume)" if source else e.code) from None
    command = command_of(cfg, mcfg, explicit)
    stages = resolve(cfg, mcfg, explicit, cls, world=int(os.environ.get("WORLD_SIZE", 1)))
    # one run at a time in a run's dirs (two at once mixed their logs and files): rank 0 holds them from here
    with locked([c.out_dir for c, _, _ in stages]) if os.environ.get("RANK", "0") == "0" else nullcontext():
        notes = check_inputs(stages, cls)
        items = [stage_data(c) for c, _, _ in stages]
        hashes = [data_hash(stage_items) for stage_items in items]
        for (c, _, _), digest in zip(stages, hashes):
            kept = (run_state(c.out_dir) or {}).get("data_hash") if c.resume else None
            if kept and kept != digest:  # (the same paths, other records: step s would read other data)
                raise SystemExit(f"error: --resume: {c.out_dir} trained on other records than its data files hold "
                                 "now (rewritten since?); restore them, or start anew without --resume")
        for note in notes:  # (after every input is checked and read: an error is the only line)
            print(note, file=sys.stderr)
        ddp, rank, world, device = init_distributed(cfg)
        recipe, text = recipe_table(stages)
        if rank == 0:
            print(text)
        # 2) the stages, each from the one before
        for i, ((c, m, _), stage_items) in enumerate(zip(stages, items)):
            later = [s[0].out_dir for s in stages[i + 1:]]
            out = train(c, m, explicit, cls, recipe, stage_items, ddp, rank, world, device, command, later,
                        hashes[i])
            if STOP:
                return None
    return out


@contextmanager
def locked(out_dirs):
    """Exclusive flocks on a run's dirs (its stages') while the block runs; a dir another run holds: one line. The
    folders made here go again if nothing was written in them (a run that stopped before it wrote leaves none)."""
    made, fds = [], []
    try:
        for out_dir in out_dirs:
            check_writable(out_dir, "--out_dir")
            there = os.path.abspath(out_dir)
            while not os.path.exists(there):
                made, there = made + [there], os.path.dirname(there)
            os.makedirs(out_dir, exist_ok=True)
            fds.append(os.open(out_dir, os.O_RDONLY))
            try:
                fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise SystemExit(f"error: {out_dir}: another train.py run is writing into it; wait for it, or name "
                                 "another --out_dir") from None
            except OSError as e:  # (NFS, Lustre without -o flock)
                print(f"note: {out_dir}: no lock on this filesystem ({e.strerror}): run one train.py at a time in it",
                      file=sys.stderr)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # (its lock goes with it)
        for folder in sorted(made, key=len, reverse=True):  # (the deepest first)
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)


def run_dtypes(cfg, device):
    """(autocast dtype name, the base's weight dtype): --dtype, by default bfloat16 on CUDA and float32 elsewhere; a
    real checkpoint's frozen weights stay bf16 under bf16 on CUDA (fp32 copies would double their memory), the
    trained parameters fp32 (build)."""
    dtype = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    bf16 = dtype == "bfloat16" and device.type == "cuda" and not tiny.is_tiny(cfg.init_from) and cfg.method != "base"
    return dtype, torch.bfloat16 if bf16 else torch.float32


def train(cfg, mcfg, explicit, cls, recipe, items, ddp, rank, world, device, command, later, data_hash):
    """One stage: build its method, train it for cfg.max_iters steps into cfg.out_dir; returns cfg.out_dir. command:
    the command's flags and values (run.json keeps them for --resume); later: the dirs of the stages after it;
    data_hash: its items' (run.json keeps it for --resume)."""
    master = rank == 0
    dtype, weights = run_dtypes(cfg, device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    prepare_base(cfg, mcfg, master, ddp)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    # 1) the method, its optimizer, the resumed state
    tok, base, method = build(cfg, mcfg, device, weights)
    if tiny.aided(cfg) and tiny.distills_attention(method):
        method.aid = tiny.AttentionDistillation(method, tiny.ATTN_KD, cfg.max_iters)
    if cfg.method == "base":
        cfg.init_from = ""  # the run dir itself is the checkpoint; keep run.json portable
    params = [p for p in method.parameters() if p.requires_grad]
    if not params:
        raise SystemExit(f"error: --method {cfg.method} ({cfg.objective}) with these flags trains no parameter")
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # decay on matrices only
    opt = AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    step = load_checkpoint(cfg.out_dir, method, opt) if cfg.resume else 0
    log = os.path.join(cfg.out_dir, "log.jsonl")
    if master and cfg.resume:
        print(f"resuming {cfg.out_dir} from step {step}" + (f": --max_iters {cfg.max_iters}, nothing to train"
                                                           if step >= cfg.max_iters else ""))
        if os.path.exists(log):  # the log continues where the checkpoint was taken: no step twice
            kept = log_upto(log, step)
            atomic_write(log, lambda p: open(p, "w").writelines(kept))
    # 2) compile, DDP wrap, data (tokenized once: the tokenizer keeps each text's ids)
    if cfg.compile:
        compile_layers(base, cuda_graphs=cfg.cuda_graphs)
    ddp_ids = [device] if device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(method, device_ids=ddp_ids) if ddp else method
    records, val_records, val_text = items
    if records is not None and hasattr(method, "training_records"):  # ata: the paper's length filter
        records, note = method.training_records(records)
        if not records:
            raise SystemExit(f"error: {note}")
        if master:
            print(note)
    tok.memo = {} if records is not None else None
    batches = Batches(cfg, tok, method, records, rank, world)
    val = Batches(cfg, tok, method, val_records, rank, world, split="val")
    ratios = ratios_of(cfg.ratio)
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        shown = f" {getattr(method, 'ratios_text', f'ratios {ratios}')}" if hasattr(method, "compress") else ""
        fmt = data.prompt_format(tok, cfg.prompt)
        print(f"{cfg.method} ({cfg.objective}){shown}: {sum(p.numel() for p in params):,} "
              f"trainable parameters, {cfg.max_iters} steps x {cfg.batch_size} examples ({world} ranks x "
              f"{cfg.grad_accum} micro-batches), {device} {dtype}, {fmt} prompts -> {cfg.out_dir}; {val_text}")
        if tok.chat_template and fmt == "plain" and cfg.prompt == "auto":  # (Mistral's [INST], say)
            print(f"note: the chat template of {tiny.base_path(cfg.init_from)} is none of "
                  f"{', '.join(data.CHAT_FORMATS)}: --prompt auto reads plain prompts", file=sys.stderr)
        if fmt in data.CHAT_FORMATS:  # (a frozen head: no adapter lifts an untrained row)
            rows, end = base.lm_head.weight.detach().norm(dim=1).float(), data.answer_end(tok, fmt)[0]  # (V,), id
            if rows[end] < 0.1 * rows.median():
                print(f"note: {tok.decode([end])}, which ends answers in {fmt} prompts, has an output row near zero in "
                      f"{tiny.base_path(cfg.init_from)} (untrained, as in a base model's chat tokens): answers may not "
                      "end; --prompt plain ends them with the eos", file=sys.stderr)
        if cfg.objective == "kd" and not cfg.teacher and not tiny.is_tiny(cfg.init_from):
            print(f"note: no --teacher: {cfg.init_from} as it is teaches (meanpool §5.1 distils from a LoRA-finetuned "
                  "teacher: a --method teacher run first)", file=sys.stderr)
    # 3) the loop: a step, its log line, a validation loss and a checkpoint every eval_every steps; Ctrl-C (SIGINT)
    # or SIGTERM stops it at the end of a step, which it saves
    saved = step
    kept = {k: v for k, v in (("data_hash", data_hash), ("teacher_stamp", teacher_stamp(cfg.teacher))) if v}  # (once)
    eval_every = cfg.eval_interval or max(1, math.ceil(cfg.max_iters / 4))
    bar = tqdm(total=cfg.max_iters, initial=step, disable=not master or cfg.quiet, desc=cfg.method, dynamic_ncols=True)
    t0, tokens = time.time(), 0
    method.train()
    STOP.clear()
    handlers = {sig: signal.signal(sig, stop_at_the_step_end) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stopping = False  # DDP: a signal every rank knows of (the last step's all_reduce); alone: one here
        while step < cfg.max_iters and not (stopping if ddp else STOP):
            lr = lr_at(step, cfg, getattr(method, "lr_schedule", "cosine"))
            for g in opt.param_groups:
                g["lr"] = lr
            loss, metrics, n, stopping = train_step(model, batches(step), params, opt, ratios, device, autocast, ddp,
                                                    world, cfg)
            step, tokens = step + 1, tokens + n
            diverged(loss, "training", step, saved, cfg.out_dir)
            checkpoint = step % eval_every == 0 or step == cfg.max_iters
            if checkpoint:  # (every rank: one that stopped alone would leave the others waiting)
                val_loss = validation_loss(method, val, device, autocast, ratios)
                diverged(val_loss, "validation", step, saved, cfg.out_dir)  # (its weights are not saved)
            if not master:
                continue
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens * world / (time.time() - t0):.0f}")
            record = {"step": step, "loss": loss, "lr": lr, **{k: float(v) for k, v in metrics.items()}}
            if checkpoint:
                record["val_loss"] = val_loss
                bar.write(f"step {step}: loss {loss:.4f} val {val_loss:.4f}")
            if step == 1:  # a new run in a used dir starts its own log; the old run's commit points go, this
                # stage's and its later stages' (trained from the old one: --resume would have kept their weights)
                drop_commit_points([cfg.out_dir, *later])
            with open(log, "w" if step == 1 else "a") as f:  # (resumed: step > 1)
                f.write(json.dumps(record) + "\n")
            if checkpoint:
                save_checkpoint(cfg.out_dir, method, opt, step, cfg, mcfg, explicit, recipe, command, not later, kept)
                saved = step
        stopped = stop_together(ddp, device)  # (a signal after the last all_reduce, on some ranks)
        if master and stopped and step < cfg.max_iters:
            save_checkpoint(cfg.out_dir, method, opt, step, cfg, mcfg, explicit, recipe, command, not later, kept)
            print(f"interrupted: saved step {step} to {cfg.out_dir}; continue with --resume")
        elif master and stopped:  # a signal in its last step: the stage is whole, and the run stops here
            print(f"interrupted: {cfg.out_dir} finished its {step} steps; the run stops here")
    finally:
        bar.close()
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if ddp:  # a next stage (--pretrain) reads what rank 0 saved
        dist.barrier()
    if master and batches.stats:
        print(f"truncated while training (--max_context / --max_answer): {batches.stats}")
    return cfg.out_dir


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # (torch is loaded: Ctrl-C is KeyboardInterrupt again)
    try:
        with one_line_errors("lower --batch_size or --micro_batch, --max_context, or a size flag"):
            out = main(sys.argv[1:])
    except KeyboardInterrupt:  # Ctrl-C outside a training step (the loop takes the first there and saves)
        print("interrupted: the checkpoints already written stand", file=sys.stderr)
        sys.exit(130)
    except SystemExit as e:  # under torchrun every rank finds the same error: rank 0 says it
        if isinstance(e.code, str) and os.environ.get("RANK", "0") != "0":
            raise SystemExit(1) from None
        raise
    finally:
        ddp = dist.is_initialized()
        if ddp:
            dist.destroy_process_group()
    if out and os.environ.get("RANK", "0") == "0":  # main returns None after --help and when interrupted
        run_cfg = json.load(open(os.path.join(out, "run.json")))["train"]
        if run_cfg["method"] not in ("base", "teacher") and run_cfg["eval_examples"] > 0:
            sys.stdout.flush()  # train.py does not import eval.py: the evaluation replaces this process
            os.execv(sys.executable, [sys.executable, os.path.join(os.path.dirname(__file__), "eval.py"), out])
    code = 130 if STOP else 0  # interrupted (saved, not finished): a script's `train.py && next` stops there
    if ddp:  # a rank skips Python's shutdown: DDP keeps the gloo group's threads alive past destroy_process_group
        # (torch 2.13), and one that frees a tensor while the interpreter shuts down aborts the rank (SIGABRT)
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
