"""One training loop for every method and objective (SPEC §2.4-2.5).

On a fresh clone (CPU, no downloads; the tiny base ships in tiny_base/):
    python train.py --method meanpool --ratio 4,8,16
On a real checkpoint and SQuAD, one GPU:
    python train.py --method teacher --init_from /ckpt/Qwen3-1.7B --data train-v1.1.json --out_dir out/teacher
    python train.py --method meanpool --init_from /ckpt/Qwen3-1.7B --teacher out/teacher \
        --data train-v1.1.json --eval_data dev-v1.1.json --ratio 4,8,16,32,64,128
Several GPUs (DDP; gloo on CPU):
    torchrun --nproc_per_node=8 train.py --method meanpool --init_from ... --data ...

A run is its method's recipe (runs.resolve: the paper's stages and values on a real checkpoint,
TINY on the tiny base; a flag wins), printed at start; each stage trains into its own dir and the
next starts from it. --batch_size is the global batch: a step's loss is the sum of per-token
losses over it over its token count, so 2 ranks and 1 give the same update. Data for step s is a
pure function of (seed, s), so --resume continues exactly where a run stopped.
"""
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import fields

import torch
import torch.distributed as dist
from tqdm import tqdm

import data
import tiny
from model import compile_layers
import runs
from runs import (TrainConfig, build, check_inputs, load_checkpoint, method_config, method_registry, parse_args,
                  print_help, ratios_of, read_records, recipe_table, resolve, save_checkpoint, to_device)


STOP = []  # Ctrl-C appends here; the loop saves and exits at the end of the step


# -----------------------------------------------------------------------------
# data: batches for step s are a pure function of (seed, s, rank)

def text_objective(cfg):
    return cfg.objective in ("lm", "ae+lm") and cfg.method != "base"


def read_items(path, cfg, text):
    """Training items of a file: QA records, or for a text objective texts (a .txt / {"text"} .jsonl file, else the
    contexts of a QA file). A file with none is a one-line error."""
    stats = {}
    if text and path.endswith((".txt", ".text", ".jsonl")):
        try:
            items = list(data.read_text(path))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    else:
        records = list(read_records(path, cfg, stats))
        items = list(dict.fromkeys(r["context"] for r in records)) if text else records  # each context once
    if stats.get("skipped_bad") or stats.get("unanswerable"):
        print(f"{path}: {stats}")
    if not items:
        raise SystemExit(f"error: {path!r} holds no usable records ({stats})")
    return items


def stage_data(cfg):
    """(training items, validation items, a line saying what validation reads) of a stage, read before any work:
    --data (a text objective: --pretrain_data, else --data's contexts); validation on --eval_data, else on a
    held-out slice of the training file (2 %, at most 256 items) that training never sees. None: synthetic."""
    text = text_objective(cfg)
    path = (cfg.pretrain_data or cfg.data) if text else cfg.data
    if not path:
        return None, None, "validation: the synthetic benchmark's val split"
    items = read_items(path, cfg, text)
    if cfg.eval_data:
        return items, read_items(cfg.eval_data, cfg, text), f"validation: {cfg.eval_data}"
    if len(items) < 2:
        return items, items, f"validation: {path} (one record: the training record itself)"
    held = set(random.Random(cfg.seed).sample(range(len(items)), min(256, max(1, len(items) // 50))))
    train_items = [it for i, it in enumerate(items) if i not in held]
    return train_items, [items[i] for i in sorted(held)], f"validation: {len(held)} items of {path} held out of training"


class Batches:
    """Micro-batches for every objective: records of a file, each epoch one permutation of them (seed + epoch),
    or synthetic ones (a fresh sample per step, with the base's curriculum; split "val" for validation)."""

    def __init__(self, cfg, tok, method, records=None, rank=0, world=1, split="train"):
        self.cfg, self.tok, self.method, self.rank, self.world = cfg, tok, method, rank, world
        self.text, self.records, self.order = text_objective(cfg), records, (None, None)
        self.synth = tiny.Synthetic(seed=cfg.seed, split=split)
        synthetic = records is None  # aid 3 needs the synthetic items' extra QA pairs
        self.questions = tiny.QUESTIONS.get(type(method).__name__, 1) if tiny.aided(cfg) and synthetic else 1
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
            return data.collate_lm(items, self.tok, cfg.max_context * (2 if halves else 1), cfg.pad_multiple)
        batch = data.collate_qa(items, self.tok, max_context=cfg.max_context, max_answer=cfg.max_answer,
                                stats=self.stats, pad_multiple=cfg.pad_multiple, format=cfg.prompt)
        if self.questions > 1:
            batch = tiny.add_questions(batch, items, self.tok)
        prepare = getattr(self.method, "prepare", None)
        return prepare(batch) if prepare else batch


# -----------------------------------------------------------------------------
# the loop

def lr_at(step, cfg, schedule="cosine"):
    """Linear warmup, then cosine decay to lr * min_lr_frac (or, schedule "linear", linearly to 0)."""
    warmup = cfg.warmup_iters or max(1, int(cfg.warmup_frac * cfg.max_iters))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, cfg.max_iters - warmup))
    if schedule == "linear":
        return cfg.lr * (1 - t)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def configure(argv):
    """(cfg, mcfg, explicit flags, method class) from argv; --method decides which flags exist."""
    methods = method_registry()
    name = TrainConfig.method
    for i, a in enumerate(argv):
        if a.split("=")[0] == "--method":
            if "=" not in a and i + 1 == len(argv):
                raise SystemExit("error: flag --method needs a value")
            name = a.split("=", 1)[1] if "=" in a else argv[i + 1]
    if name not in methods:
        raise SystemExit(f"error: unknown --method {name!r}; choose from {', '.join(methods)}")
    cls = methods[name]
    own = {f.name for c in (TrainConfig, method_config(cls)) for f in fields(c)}
    others = {f.name for c in methods.values() for f in fields(method_config(c))} - own
    for key in (a[2:].split("=")[0].replace("-", "_") for a in argv if a.startswith("--")):
        if key in others:
            raise SystemExit(f"error: --{key} does not apply to --method {name}")
    (cfg, mcfg), explicit = parse_args(argv, TrainConfig, method_config(cls))
    return cfg, mcfg, explicit, cls


def check_stage(cfg, mcfg, cls):
    """A resolved stage's values: one-line errors before any work."""
    ratios_of(cfg.ratio)  # a bad --ratio before any method's own checks
    if cfg.eval_ratio:
        ratios_of(cfg.eval_ratio, "eval_ratio")
    for flag in ("max_iters", "batch_size", "grad_accum", "max_context", "max_answer"):
        if getattr(cfg, flag) < 1:
            raise SystemExit(f"error: --{flag} {getattr(cfg, flag)} must be a positive integer")
    for flag in ("lr", "min_lr_frac", "warmup_frac", "weight_decay", "grad_clip"):
        value = getattr(cfg, flag)
        if not math.isfinite(value) or value < 0 or (flag == "lr" and value == 0):
            raise SystemExit(f"error: --{flag} {value!r} must be a finite number {'> 0' if flag == 'lr' else '>= 0'}")
    if cfg.warmup_iters < 0 or cfg.eval_interval < 0 or cfg.eval_examples < 0:
        raise SystemExit("error: --warmup_iters, --eval_interval and --eval_examples must be >= 0")
    if cfg.prompt not in ("auto", "plain", "sac", *data.CHAT_FORMATS):
        raise SystemExit(f"error: --prompt {cfg.prompt!r}; choose from auto, plain, sac, {', '.join(data.CHAT_FORMATS)}")
    if hasattr(cls, "check_config"):
        cls.check_config(cfg, mcfg)
    if cfg.dtype not in ("", "float32", "bfloat16"):
        raise SystemExit(f"error: --dtype {cfg.dtype!r}; choose float32 or bfloat16")


def init_distributed(cfg):
    """(ddp, rank, world, device) from the torchrun environment: NCCL on CUDA, gloo on CPU."""
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if int(os.environ.get("RANK", -1)) == -1:
        return False, 0, 1, torch.device(device)
    if not dist.is_initialized():  # one group per process: --pretrain's two stages share it
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    return True, dist.get_rank(), dist.get_world_size(), torch.device(device)


def prepare_base(cfg, mcfg, master, ddp):
    """`--method base` starts from a fresh tiny model in its own run dir; any other run
    whose base is the shipped tiny_base/ trains it first when it has been deleted."""
    if cfg.method == "base" and tiny.is_tiny(cfg.init_from):
        if master:
            tiny.init_base(cfg.out_dir, mcfg, cfg.seed)
        cfg.init_from = cfg.out_dir
    elif ddp and tiny.needs_training(cfg.init_from):
        raise SystemExit(f"error: no {tiny.BASE_DIR}: train it first without torchrun (python train.py --method base)")
    elif master and tiny.needs_training(cfg.init_from):
        print(f"no {tiny.BASE_DIR}: training the tiny base first (~75 min on 2 CPU cores)")
        main(["--method", "base", "--out_dir", tiny.BASE_DIR, "--seed", str(cfg.seed), "--device", cfg.device,
              "--dtype", cfg.dtype] + (["--quiet"] if cfg.quiet else []))
    if ddp:
        dist.barrier()


def train_step(model, micro, params, opt, ratios, device, autocast, ddp, world, cfg):
    """One optimizer step over this rank's micro-batches; returns (loss per token, metrics,
    tokens seen). Gradients are sums over tokens, scaled by the global token count (DDP
    already averaged over ranks); one all_reduce carries loss, count and rank 0's Ctrl-C."""
    total, count, metrics, tokens = 0.0, 0.0, {}, 0
    for i, mb in enumerate(micro):
        mb = to_device(mb, device)
        sync = nullcontext() if (not ddp or i == len(micro) - 1) else model.no_sync()
        with sync, autocast:
            loss, n, m = model(mb, ratios)
        loss.backward()
        total, count = total + loss.item(), count + float(n)
        tokens += sum(v.numel() for v in mb.values() if torch.is_tensor(v) and v.dim() == 2 and v.dtype == torch.long)
        metrics.update(m)
    counts = torch.tensor([total, count, len(STOP)], device=device, dtype=torch.float64)
    if ddp:
        dist.all_reduce(counts)
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
    return counts[0].item() / max(counts[1].item(), 1.0), metrics, tokens


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


def main(argv):
    """Every stage of the run's recipe, in order (runs.resolve); returns the last stage's run dir, or None after
    --help or an interrupted stage."""
    if "-h" in argv or "--help" in argv:
        return print_help([TrainConfig] + [method_config(c) for c in method_registry().values()])
    # 1) flags, the recipe, every input checked before any work
    cfg, mcfg, explicit, cls = configure(argv)
    stages = resolve(cfg, mcfg, explicit, cls, world=int(os.environ.get("WORLD_SIZE", 1)))
    for c, m, _ in stages:
        check_stage(c, m, cls)
    check_inputs(*stages[0][:2])
    items = [stage_data(c) for c, _, _ in stages]
    ddp, rank, world, device = init_distributed(cfg)
    recipe, text = recipe_table(stages)
    if rank == 0:
        print(text)
    # 2) the stages: each starts from the one before
    for (c, m, _), stage_items in zip(stages, items):
        out = train(c, m, explicit, cls, recipe, stage_items, ddp, rank, world, device)
        if STOP:
            return None
    return out


def train(cfg, mcfg, explicit, cls, recipe, items, ddp, rank, world, device):
    """One stage: build its method, train it for cfg.max_iters steps into cfg.out_dir; returns cfg.out_dir."""
    master = rank == 0
    dtype = cfg.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
    prepare_base(cfg, mcfg, master, ddp)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    # 1) the method (real checkpoints stay bf16 on CUDA), its optimizer, the resumed state
    bf16_weights = device.type == "cuda" and not tiny.is_tiny(cfg.init_from) and cfg.method != "base"
    tok, base, method = build(cfg, mcfg, device, torch.bfloat16 if bf16_weights else torch.float32)
    if tiny.aided(cfg) and tiny.distills_attention(method):
        method.aid = tiny.AttentionDistillation(method, tiny.ATTN_KD, cfg.max_iters)
    if cfg.method == "base":
        cfg.init_from = ""  # the run dir itself is the checkpoint; keep run.json portable
    params = [p for p in method.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]  # decay on matrices only
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))
    step = load_checkpoint(cfg.out_dir, method, opt) if cfg.resume else 0
    log = os.path.join(cfg.out_dir, "log.jsonl")
    if master and cfg.resume:
        print(f"resuming {cfg.out_dir} from step {step}")
        if os.path.exists(log):  # the log continues where the checkpoint was taken: no step twice
            kept = [line for line in open(log) if json.loads(line)["step"] <= step]
            runs.atomic_write(log, lambda p: open(p, "w").writelines(kept))
    # 2) compile, DDP wrap, data (tokenized once: the tokenizer keeps each text's ids)
    if cfg.compile:
        compile_layers(base)
    ddp_ids = [device] if device.type == "cuda" else None
    model = torch.nn.parallel.DistributedDataParallel(method, device_ids=ddp_ids) if ddp else method
    records, val_records, val_text = items
    tok.memo = {} if records is not None else None
    batches = Batches(cfg, tok, method, records, rank, world)
    val = Batches(cfg, tok, method, val_records, rank, world, split="val")
    if master:
        os.makedirs(cfg.out_dir, exist_ok=True)
        print(f"{cfg.method} ({cfg.objective}) ratios {ratios_of(cfg.ratio)}: {sum(p.numel() for p in params):,} "
              f"trainable parameters, {cfg.max_iters} steps x {cfg.batch_size} examples ({world} ranks x "
              f"{cfg.grad_accum} micro-batches), {device} {dtype} -> {cfg.out_dir}; {val_text}")
    # 3) the loop: a step, its log line, a validation loss and a checkpoint every eval_every steps
    ratios = ratios_of(cfg.ratio)
    eval_every = cfg.eval_interval or max(1, cfg.max_iters // 4)
    STOP.clear()
    old_handler = signal.signal(signal.SIGINT, lambda *a: STOP.append(1))
    bar = tqdm(total=cfg.max_iters, initial=step, disable=not master or cfg.quiet, desc=cfg.method, dynamic_ncols=True)
    t0, tokens = time.time(), 0
    method.train()
    while step < cfg.max_iters and not STOP:
        lr = lr_at(step, cfg, getattr(method, "lr_schedule", "cosine"))
        for g in opt.param_groups:
            g["lr"] = lr
        loss, metrics, n = train_step(model, batches(step), params, opt, ratios, device, autocast, ddp, world, cfg)
        step, tokens = step + 1, tokens + n
        if not master:
            continue
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens * world / (time.time() - t0):.0f}")
        record = {"step": step, "loss": loss, "lr": lr, **{k: float(v) for k, v in metrics.items()}}
        checkpoint = step % eval_every == 0 or step == cfg.max_iters
        if checkpoint:
            record["val_loss"] = validation_loss(method, val, device, autocast, ratios)
            bar.write(f"step {step}: loss {loss:.4f} val {record['val_loss']:.4f}")
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
        if checkpoint:
            save_checkpoint(cfg.out_dir, method, opt, step, cfg, mcfg, explicit, recipe)
    # 4) an interrupted run saves where it stopped
    bar.close()
    if master and STOP:
        save_checkpoint(cfg.out_dir, method, opt, step, cfg, mcfg, explicit, recipe)
        print(f"interrupted: saved step {step} to {cfg.out_dir}; continue with --resume")
    signal.signal(signal.SIGINT, old_handler)
    if ddp:  # DDP's reducer holds the group: free it before __main__ destroys the group (gloo can abort at exit)
        del model
        dist.barrier()
    if master and batches.stats:
        print(f"truncated while training (--max_context / --max_answer): {batches.stats}")
    if master and not STOP and cfg.method != "base" and cfg.eval_examples:
        print(f"trained {cfg.out_dir}; evaluate with: python eval.py {cfg.out_dir}")
    return cfg.out_dir


if __name__ == "__main__":
    try:
        out = main(sys.argv[1:])
    except (ValueError, OSError) as e:  # user errors raised by the readers; a file that cannot be read or written
        raise SystemExit(f"error: {e}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if out and os.environ.get("RANK", "0") == "0":  # main returns None after --help
        run_cfg = json.load(open(os.path.join(out, "run.json")))["train"]
        if run_cfg["method"] not in ("base", "teacher") and run_cfg["eval_examples"] > 0:
            import eval as evaluate
            evaluate.main([out])
