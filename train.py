"""One training loop for every method and objective (SPEC §2.4-2.5).

On a fresh clone (CPU, no downloads; the tiny base ships in tiny_base/):
    python train.py --method meanpool --ratio 4,8,16
On a real checkpoint and SQuAD, one GPU:
    python train.py --method teacher --init_from /ckpt/Qwen3-1.7B --data train-v1.1.json --out_dir out/teacher
    python train.py --method meanpool --init_from /ckpt/Qwen3-1.7B --teacher out/teacher \
        --data train-v1.1.json --eval_data dev-v1.1.json --ratio 4,8,16,32,64,128
Several GPUs (DDP; gloo on CPU):
    torchrun --nproc_per_node=8 train.py --method meanpool --init_from ... --data ...

The loss of a step is the sum of per-token losses over the whole global batch divided by
the global token count (all micro-batches, all ranks), so 2 ranks x batch b and 1 rank x
batch 2b give the same update. Data for step s is a pure function of (seed, s), so
--resume continues exactly where a run stopped.
"""
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from tqdm import tqdm

import ata
import data
import meanpool
import pic
import sac
import sentence_gist
import tiny
from model import Transformer, compile_forward


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
    # --- optimisation (0 = the method's default: paper values on real checkpoints, small ones on the tiny base)
    max_iters: int = 0
    batch_size: int = 0
    grad_accum: int = 1
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
    # --- system
    device: str = ""           # "" = cuda if available else cpu
    dtype: str = ""            # float32 | bfloat16 ("" = bfloat16 autocast on CUDA, float32 on CPU)
    compile: bool = False      # torch.compile the model and the losses
    grad_ckpt: bool = False    # activation checkpointing per decoder layer: large models fit, ~1/3 more compute
    seed: int = 1337
    resume: bool = False
    quiet: bool = False        # no progress bar


STOP = []  # Ctrl-C appends here; the loop saves and exits at the end of the step


# -----------------------------------------------------------------------------
# command line: the dataclass fields are the flags


USAGE = "python train.py --method NAME [--flag value ...]"


def parse_args(argv, *configs, positional=None, usage=USAGE):
    """--key=value or --key value over the fields of several dataclasses; bools are
    switches (--compile, --no_linear); bare arguments are joined into the field named
    `positional`. Returns (instances, set of explicit keys)."""
    known = {f.name: (c, f) for c in configs for f in fields(c)}
    values, explicit = {}, set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print_help(configs, usage)
            sys.exit(0)
        if not arg.startswith("--") and positional:
            values[positional] = (values.get(positional, "") + " " + arg).strip()
            i += 1
            continue
        if not arg.startswith("--"):
            raise SystemExit(f"error: unexpected argument {arg!r}; flags look like --method=pic")
        key, _, val = arg[2:].partition("=")
        key = key.replace("-", "_")
        if key not in known:
            raise SystemExit(f"error: unknown flag --{key}; see python train.py --help")
        f = known[key][1]
        if f.type in (bool, "bool") and not _:
            val = "true"
        elif not _:
            i += 1
            if i >= len(argv):
                raise SystemExit(f"error: flag --{key} needs a value")
            val = argv[i]
        values[key] = _convert(key, f, val)
        explicit.add(key)
        i += 1
    out = []
    for c in configs:
        out.append(c(**{k: v for k, v in values.items() if known[k][0] is c}))
    return out, explicit


def _convert(key, f, val):
    typ = {"int": int, "float": float, "bool": bool, "str": str}.get(f.type, f.type)
    if typ is bool:
        if val.lower() not in ("true", "false", "1", "0"):
            raise SystemExit(f"error: --{key} is a switch; got {val!r}")
        return val.lower() in ("true", "1")
    try:
        return typ(val)
    except ValueError:
        raise SystemExit(f"error: --{key} expects {typ.__name__}, got {val!r}")


def print_help(configs, usage=USAGE):
    import inspect
    print(f"usage: {usage}\n")
    for c in configs:
        print(f"{c.__name__} ({os.path.basename(inspect.getsourcefile(c))}):")
        src = inspect.getsource(c).splitlines()
        for f in fields(c):
            line = next((l for l in src if l.strip().startswith(f"{f.name}:")), "")
            note = line.split("#", 1)[1].strip() if "#" in line else ""
            print(f"  --{f.name:<18} {str(f.default)!r:<14} {note}")


def ratios_of(spec):
    try:
        rs = [int(r) for r in str(spec).split(",") if r.strip()]
    except ValueError:
        raise SystemExit(f"error: --ratio {spec!r} must be an integer or a comma list like 4,8,16")
    if not rs or any(r <= 0 for r in rs):
        raise SystemExit(f"error: --ratio {spec!r}: every ratio must be a positive integer")
    return rs


# -----------------------------------------------------------------------------
# base and teacher: the two non-compressing "methods"


@dataclass
class TeacherConfig:
    lora_r: int = 16
    lora_alpha: int = 16


class Teacher(torch.nn.Module):
    """`--method teacher`: `sft` of a real checkpoint with a `teacher` LoRA adapter on
    full-context QA (meanpool_multi_ratio §5.1: the teacher is finetuned first, then
    frozen). Compressors merge it into the base with --teacher."""
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
    """(tokenizer, base Transformer) for cfg.init_from (an HF dir or a run dir)."""
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
        base.merge_adapter("teacher")  # the teacher is the frozen base from here on
    return tok, base


def build(cfg, mcfg, device, dtype):
    cls = method_registry()[cfg.method]
    tok, base = load_base(cfg, device, dtype)
    for p in base.parameters():
        p.requires_grad_(cfg.method == "base")
    method = cls(base, mcfg, tok, cfg)
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
    """The train config of the run dir `init_from` when it is an earlier stage of the same
    method (e.g. pic ae+lm before qa), else None."""
    path = os.path.join(init_from, "run.json") if init_from else ""
    if not path or not os.path.exists(path):
        return None
    first = json.load(open(path))["train"]
    return first if first["method"] == method else None


def inherit_first_stage(cfg, mcfg, explicit, cls):
    """A second stage (--init_from an earlier run of the same method) runs under the first
    stage's method config: its tensors were shaped and trained under it (a pic memory table
    of --max_mem rows, an encoder pretrained with --mask causal). A flag given with another
    value is a one-line error, except the stage's own (cls.STAGE_FLAGS: gist's --stage)."""
    if not first_stage(cfg.init_from, cfg.method):
        return
    for key, val in json.load(open(os.path.join(cfg.init_from, "run.json")))["method"].items():
        if key in getattr(cls, "STAGE_FLAGS", ()) or not hasattr(mcfg, key):
            continue
        if key in explicit and getattr(mcfg, key) != val:
            raise SystemExit(f"error: --{key} {getattr(mcfg, key)!r} conflicts with the first stage "
                             f"{cfg.init_from} ({key}={val!r}); drop the flag to inherit it")
        setattr(mcfg, key, val)


def apply_defaults(cfg, mcfg, explicit, cls):
    """0 = method default. On the tiny base the method's TINY values; on real checkpoints
    the paper's (its Config fields)."""
    small = dict(getattr(cls, "TINY", {})) if tiny.is_tiny(cfg.init_from) or cfg.method == "base" else {}
    paper = {**getattr(cls, "PAPER", {}), **getattr(cls, "STAGES", {}).get(getattr(mcfg, "stage", None), {})}
    for key, val in {**paper, **small}.items():
        if key in explicit:
            continue
        target = cfg if hasattr(cfg, key) else mcfg
        setattr(target, key, val)
    cfg.max_iters = cfg.max_iters or 1000
    cfg.batch_size = cfg.batch_size or 16
    cfg.lr = cfg.lr or 1e-4
    cfg.out_dir = cfg.out_dir or os.path.join("out", cfg.method)
    if not cfg.objective:
        cfg.objective = cls.default_objective(mcfg) if hasattr(cls, "default_objective") else cls.objectives[0]
    if cfg.objective not in cls.objectives:
        raise SystemExit(f"error: --objective {cfg.objective!r} does not apply to --method {cfg.method}; "
                         f"choose from {', '.join(cls.objectives)}")


# -----------------------------------------------------------------------------
# data: batches for step s are a pure function of (seed, s, rank)


class Batches:
    """Micro-batches for every objective. Synthetic by default (a fresh sample per step,
    with the base's curriculum), or records of --data shuffled per epoch."""

    def __init__(self, cfg, tok, method, rank=0, world=1):
        self.cfg, self.tok, self.method, self.rank, self.world = cfg, tok, method, rank, world
        self.text = cfg.objective in ("lm", "ae+lm") and cfg.method != "base"
        self.records = None
        if cfg.data:
            stats = {}
            if self.text and cfg.data.endswith((".txt", ".text", ".jsonl")):  # text or {"text"} lines
                self.records = list(data.read_text(cfg.data))
            else:
                self.records = list(read_records(cfg.data, cfg, stats))
                if self.text:
                    self.records = [r["context"] for r in self.records]
            if stats.get("skipped_bad") or stats.get("unanswerable"):
                print(f"{cfg.data}: {stats}")
            if not self.records:
                raise SystemExit(f"error: --data {cfg.data!r} holds no usable records ({stats})")
        self.synth = data.Synthetic(seed=cfg.seed, split="train")
        self.questions = tiny.QUESTIONS.get(type(method).__name__, 1) if tiny.aided(cfg) else 1
        self.stats = {}

    def raw(self, step, n):
        """n raw items (QA records or texts) of the global batch of this step."""
        rng = random.Random(self.cfg.seed * 1_000_003 + step)
        if self.records is not None:
            epoch_len = len(self.records)
            out = []
            for i in range(step * n, step * n + n):
                epoch, j = divmod(i, epoch_len)
                perm = list(range(epoch_len))
                random.Random(self.cfg.seed + epoch).shuffle(perm)
                out.append(self.records[perm[j]])
            return out
        kind = "text" if self.text else "base" if self.cfg.method == "base" else "qa"
        qas = self.method.cfg.qa_per_context if kind == "base" else self.questions
        return tiny.synthetic_items(self.synth, rng, n, step / max(1, self.cfg.max_iters), kind, qas,
                                    aids=not self.cfg.no_aids)

    def __call__(self, step):
        """This rank's micro-batches of step `step`: a list of grad_accum collated dicts."""
        cfg = self.cfg
        accum = cfg.grad_accum
        items = self.raw(step, cfg.batch_size * self.world * accum)
        per_rank = len(items) // (self.world * accum)  # more than batch_size early in the base's curriculum
        # prompt templates drawn per global item, so ranks x batch does not change the data
        rng = random.Random(cfg.seed * 7919 + step)
        if not self.text:
            items = [dict(it, template=rng.randrange(len(data.QA_TEMPLATES))) for it in items]
        out = []
        for a in range(accum):
            lo = (a * self.world + self.rank) * per_rank
            out.append(dict(self.collate(items[lo:lo + per_rank]), step=step))  # step: for per-step draws (ata's r)
        return out

    def collate(self, items):
        cfg = self.cfg
        if cfg.method == "base":
            return tiny.collate_base(items, self.tok, self.method.cfg.context_weight)
        pad = 64 if cfg.compile else 8  # compiled graphs are reused across lengths; eager pays for padding
        if self.text:
            halves = getattr(self.method, "compresses_half_text", False)  # so the compressed half reaches max_context
            return data.collate_lm(items, self.tok, cfg.max_context * (2 if halves else 1), pad_multiple=pad)
        batch = data.collate_qa(items, self.tok, max_context=cfg.max_context, max_answer=cfg.max_answer,
                                stats=self.stats, pad_multiple=pad, format=cfg.prompt)
        if self.questions > 1:
            batch = tiny.add_questions(batch, items, self.tok)
        prepare = getattr(self.method, "prepare", None)
        return prepare(batch) if prepare else batch


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


def trainable_state(method):
    return {n: p for n, p in method.named_parameters() if p.requires_grad}


def save_checkpoint(out_dir, method, opt, step, cfg, mcfg, flags=()):
    """ckpt-<step>.safetensors (trainable tensors) and optim-<step>.safetensors (AdamW
    state, torch RNG), then run.json naming them: its rename is the commit point, so a
    kill at any moment leaves the previous checkpoint whole. Older files go after."""
    os.makedirs(out_dir, exist_ok=True)
    named = trainable_state(method)
    names = {id(p): n for n, p in named.items()}
    opt_tensors, groups = {"rng::torch": torch.get_rng_state()}, []
    for g in opt.param_groups:
        groups.append({k: v for k, v in g.items() if k != "params"} | {"params": [names[id(p)] for p in g["params"]]})
        for p in g["params"]:
            for k, v in opt.state.get(p, {}).items():
                opt_tensors[f"{names[id(p)]}::{k}"] = v.detach().contiguous().cpu()
    files = {"ckpt": f"ckpt-{step:07d}.safetensors", "optim": f"optim-{step:07d}.safetensors"}
    params = {n: p.detach().contiguous().cpu() for n, p in named.items()}
    atomic_write(os.path.join(out_dir, files["ckpt"]), lambda p: save_file(params, p))
    atomic_write(os.path.join(out_dir, files["optim"]), lambda p: save_file(opt_tensors, p))
    if cfg.method == "base":  # the base run dir is also an HF checkpoint dir
        atomic_write(os.path.join(out_dir, "model.safetensors"), lambda p: save_hf_weights(method.base, p))
    if cfg.method == "teacher":  # PEFT format, for --teacher and for peft users
        method.base.save_adapter("teacher", os.path.join(out_dir, "teacher"))
    state = {"step": step, "files": files, "train": asdict(cfg), "method": asdict(mcfg), "flags": sorted(flags),
             "param_groups": groups,
             "python_rng": list(random.getstate()[1])}
    atomic_write(os.path.join(out_dir, "run.json"), lambda p: json.dump(state, open(p, "w"), indent=1))
    for f in os.listdir(out_dir):
        if f.startswith(("ckpt-", "optim-")) and f not in files.values():
            os.remove(os.path.join(out_dir, f))


def save_hf_weights(model, path):
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if "lora_" not in k}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, path, metadata={"format": "pt"})


def load_checkpoint(out_dir, method, opt=None):
    """Trainable tensors (and optimizer state, RNG) of a run dir; returns the step."""
    state = json.load(open(os.path.join(out_dir, "run.json")))
    params = trainable_state(method) if opt is not None else dict(method.named_parameters())
    tensors = load_file(os.path.join(out_dir, state["files"]["ckpt"]))
    unknown = [k for k in tensors if k not in params]
    if unknown:
        raise SystemExit(f"error: {out_dir}: checkpoint tensors {unknown[:5]} do not match this method's parameters")
    with torch.no_grad():
        for k, v in tensors.items():
            params[k].copy_(v)
    if opt is not None:
        for g, saved in zip(opt.param_groups, state["param_groups"]):
            g.update({k: v for k, v in saved.items() if k != "params"})
        for key, v in load_file(os.path.join(out_dir, state["files"]["optim"])).items():
            name, _, slot = key.partition("::")
            if name == "rng":
                torch.set_rng_state(v)
            else:
                opt.state[params[name]][slot] = v.to(params[name].device)
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


# -----------------------------------------------------------------------------
# the loop


def lr_at(step, cfg, schedule="cosine"):
    """1) linear warmup, 2) cosine decay to lr * min_lr_frac, or linear decay to 0 for a
    method whose `lr_schedule` is "linear" (sentence_gist's stage-3 cool-down)."""
    warmup = cfg.warmup_iters or max(1, int(cfg.warmup_frac * cfg.max_iters))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = (step - warmup) / max(1, cfg.max_iters - warmup)
    if schedule == "linear":
        return cfg.lr * (1 - min(1.0, t))
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def main(argv):
    methods = method_registry()
    # two passes: --method decides which method config's flags exist
    method_name = next((a.split("=", 1)[1] if "=" in a else argv[i + 1]
                        for i, a in enumerate(argv) if a.split("=")[0] == "--method"), TrainConfig.method)
    if method_name not in methods:
        raise SystemExit(f"error: unknown --method {method_name!r}; choose from {', '.join(methods)}")
    cls = methods[method_name]
    mcls = method_config(cls)
    if "-h" in argv or "--help" in argv:
        print_help([TrainConfig] + [method_config(c) for c in methods.values()])
        return
    own = {f.name for c in (TrainConfig, mcls) for f in fields(c)}
    for arg in argv:
        key = arg[2:].split("=")[0].replace("-", "_") if arg.startswith("--") else None
        if key and key not in own and any(key in {f.name for f in fields(method_config(c))} for c in methods.values()):
            raise SystemExit(f"error: --{key} does not apply to --method {method_name}")
    (cfg, mcfg), explicit = parse_args(argv, TrainConfig, mcls)
    apply_defaults(cfg, mcfg, explicit, cls)
    inherit_first_stage(cfg, mcfg, explicit, cls)
    ratios = ratios_of(cfg.ratio)
    if cfg.prompt not in ("auto", "plain", *data.CHAT_FORMATS):
        raise SystemExit(f"error: --prompt {cfg.prompt!r}; choose from auto, plain, {', '.join(data.CHAT_FORMATS)}")
    check = getattr(cls, "check_config", None)
    if check:
        check(cfg, mcfg)

    # DDP from the torchrun environment
    ddp = int(os.environ.get("RANK", -1)) != -1
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if ddp:
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
            torch.cuda.set_device(device)
    else:
        rank, world = 0, 1
    master = rank == 0
    device = torch.device(device)
    dtype = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"error: --dtype {dtype!r}; choose float32 or bfloat16")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()

    if cfg.method == "base" and tiny.is_tiny(cfg.init_from):
        if master:
            tiny.init_base(cfg.out_dir, mcfg, cfg.seed)
        if ddp:
            dist.barrier()
        cfg.init_from = cfg.out_dir
    elif master and tiny.needs_training(cfg.init_from):
        print(f"no {tiny.BASE_DIR}: training the tiny base first (~45 min at 11k tokens/s on 2 cores)")
        main(["--method", "base", "--out_dir", tiny.BASE_DIR, "--seed", str(cfg.seed), "--device", cfg.device,
              "--dtype", cfg.dtype] + (["--quiet"] if cfg.quiet else []))
    if ddp:
        dist.barrier()
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    weights_dtype = torch.bfloat16 if (device.type == "cuda" and not tiny.is_tiny(cfg.init_from) and cfg.method != "base") else torch.float32
    tok, base, method = build(cfg, mcfg, device, weights_dtype)
    if type(method).__name__ in tiny.SLOTS and tiny.aided(cfg):
        method.aid = tiny.AttentionDistillation(method, tiny.ATTN_KD)
    if cfg.method == "base":
        cfg.init_from = ""  # the run dir itself is the checkpoint; keep run.json portable
    params = [p for p in method.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    step = 0
    if cfg.resume:
        if not os.path.exists(os.path.join(cfg.out_dir, "run.json")):
            raise SystemExit(f"error: --resume but {cfg.out_dir} has no checkpoint")
        step = load_checkpoint(cfg.out_dir, method, opt)
        if master:
            print(f"resuming {cfg.out_dir} from step {step}")
    model = method
    if cfg.compile:
        base.forward = compile_forward(base)  # K/V memory bucketed: one graph per length bucket
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(method, device_ids=[device] if device.type == "cuda" else None)
    batches = Batches(cfg, tok, method, rank, world)
    log_path = os.path.join(cfg.out_dir, "log.jsonl")
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        n_train = sum(p.numel() for p in params)
        print(f"{cfg.method} ({cfg.objective}) ratios {ratios}: {n_train:,} trainable parameters, "
              f"{cfg.max_iters} steps x {cfg.batch_size * cfg.grad_accum * world} examples, {device} {dtype}")
    eval_every = cfg.eval_interval or max(1, cfg.max_iters // 4)
    val = Batches(cfg, tok, method, rank, world)
    STOP.clear()
    old_handler = signal.signal(signal.SIGINT, lambda *a: STOP.append(1))
    bar = tqdm(total=cfg.max_iters, initial=step, disable=not master or cfg.quiet, desc=cfg.method, dynamic_ncols=True)
    t0, tokens = time.time(), 0
    method.train()
    while step < cfg.max_iters and not STOP:
        lr = lr_at(step, cfg, getattr(method, "lr_schedule", "cosine"))
        for g in opt.param_groups:
            g["lr"] = lr
        # 1) forward/backward every micro-batch; gradients are sums over tokens
        total, count, metrics = 0.0, 0.0, {}
        micro = batches(step)
        for i, mb in enumerate(micro):
            mb = to_device(mb, device)
            sync = nullcontext() if (not ddp or i == len(micro) - 1) else model.no_sync()
            with sync, autocast:
                loss, n, m = model(mb, ratios)
            loss.backward()
            total += loss.item()
            count += float(n)
            tokens += sum(v.numel() for k, v in mb.items() if torch.is_tensor(v) and v.dim() == 2 and v.dtype == torch.long)
            metrics.update(m)
        # 2) normalise by the global token count (DDP already averaged over ranks)
        counts = torch.tensor([total, count, len(STOP)], device=device, dtype=torch.float64)
        if ddp:
            dist.all_reduce(counts)  # one collective: loss, token count, and rank 0's Ctrl-C
            if counts[2] > 0 and not STOP:
                STOP.append(1)
        scale = world / max(counts[1].item(), 1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        loss_val = counts[0].item() / max(counts[1].item(), 1.0)
        if master:
            bar.update(1)
            bar.set_postfix(loss=f"{loss_val:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens * world / (time.time() - t0):.0f}")
            record = {"step": step, "loss": loss_val, "lr": lr, **{k: float(v) for k, v in metrics.items()}}
            if step % eval_every == 0 or step == cfg.max_iters:
                record["val_loss"] = validation_loss(method, val, device, autocast, ratios)
                bar.write(f"step {step}: loss {loss_val:.4f} val {record['val_loss']:.4f}")
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
            if step % eval_every == 0 or step == cfg.max_iters:
                save_checkpoint(cfg.out_dir, method, opt, step, cfg, mcfg, explicit)
    bar.close()
    if master and STOP:
        save_checkpoint(cfg.out_dir, method, opt, step, cfg, mcfg, explicit)
        print(f"interrupted: saved step {step} to {cfg.out_dir}; continue with --resume")
    signal.signal(signal.SIGINT, old_handler)
    if ddp:
        dist.barrier()
        dist.destroy_process_group()
    if master and batches.stats:
        print(f"truncated while training (--max_context / --max_answer): {batches.stats}")
    if master and not STOP and cfg.method not in ("base",):
        print(f"trained {cfg.out_dir}; evaluate with: python eval.py {cfg.out_dir}")
    return cfg.out_dir


@torch.no_grad()
def validation_loss(method, batches, device, autocast, ratios, n_steps=2):
    """Mean loss on a few fixed held-out micro-batches (steps far beyond training)."""
    method.eval()
    total = count = 0.0
    for s in range(n_steps):
        for mb in batches(10_000_000 + s):
            with autocast:
                loss, n, _ = method(to_device(mb, device), ratios)
            total, count = total + loss.item(), count + float(n)
    method.train()
    return total / max(count, 1.0)


if __name__ == "__main__":
    try:
        out = main(sys.argv[1:])
    except ValueError as e:  # user errors raised by data.py / model.py readers
        raise SystemExit(f"error: {e}")
    if out and os.environ.get("RANK", "0") == "0" and "--help" not in sys.argv and "-h" not in sys.argv:
        run_cfg = json.load(open(os.path.join(out, "run.json")))["train"]
        if run_cfg["method"] not in ("base", "teacher") and run_cfg["eval_examples"] > 0:
            import eval as evaluate
            evaluate.main([out])
