"""Benchmarks, nanoGPT style: burn-in, then timed iterations between synchronize calls.

    python benchmarks/bench.py loss         # time and peak memory: chunked_kd vs naive_kd at vocab 152k
    python benchmarks/bench.py train        # one optimizer step of every method at real shapes
    python benchmarks/bench.py attention    # flex + BlockMask vs SDPA + dense mask, fwd+bwd, 4K and 8K (CUDA)
    python benchmarks/bench.py ttft         # time to first token: saved 16x Memory vs the full 8K context
    python benchmarks/bench.py batching     # host time to batch a step of SQuAD-train-size records (../shared/assets)
    (train and ttft take --tiny: a tiny shape that runs on CPU in seconds; train's --context, --train_batch still win)
    python benchmarks/hf_twins.py   # train's meanpool kd and pic ae+lm rows vs transformers + peft

Peak memory is torch.cuda.max_memory_allocated; on CPU the loss benchmark runs each variant in
a fresh subprocess and reports the growth of its peak RSS over the inputs. Real shapes (SHAPES) are
random-init models with the checkpoints' config.json values: speed and memory depend on shapes only.
"""
import argparse
import os
from contextlib import contextmanager
import random
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import data  # noqa: E402
import kernels  # noqa: E402
import meanpool  # noqa: E402
import model  # noqa: E402
import pic  # noqa: E402
import train  # noqa: E402
from model import Memory, ModelConfig, Transformer, compile_layers  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.error = lambda message: sys.exit(f"error: {message}")  # one line, as every script's
parser.add_argument("what", choices=["loss", "train", "attention", "ttft", "batching"])
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
parser.add_argument("--burn_in", type=int, default=2, help="untimed iterations first")
parser.add_argument("--iters", type=int, default=5, help="timed iterations")
parser.add_argument("--loss_vocab", type=int, default=152064, help="loss: vocabulary size (Qwen2.5's)")
parser.add_argument("--tokens", type=int, default=2048, help="loss: rows of hidden states")
parser.add_argument("--dim", type=int, default=256, help="loss: their width")
parser.add_argument("--only", default="", choices=("", "chunked", "naive"), help="loss, internal: one variant")
parser.add_argument("--tiny", action="store_true", help="train, ttft: the tiny shape and short contexts (CPU, seconds)")
parser.add_argument("--shapes", default="llama-3.2-1b,qwen3-1.7b,llama-3.1-8b", help="train, ttft: keys of SHAPES")
parser.add_argument("--context", type=int, default=1024, help="train: context tokens per example")
parser.add_argument("--train_batch", type=int, default=8, help="train: examples per step")
parser.add_argument("--methods", default="", help="train: comma list of rows to run (default all)")
parser.add_argument("--grad_ckpt", action="store_true", help="train: activation checkpointing per layer (ours; not the HF rows)")
parser.add_argument("--compile", action="store_true", help="train, ttft: model.compile_layers, as train.py --compile")
parser.add_argument("--cuda_graphs", action="store_true", help="train: with --compile, as train.py --cuda_graphs")
parser.add_argument("--profile", action="store_true", help="train: after each row, its kernels by device time")
parser.add_argument("--attn_batch", type=int, default=1, help="attention: sequences per call")
parser.add_argument("--lengths", default="4096,8192", help="attention: about how many tokens a sequence has")


READS = {"loss": {"loss_vocab", "tokens", "dim", "only", "burn_in"}, "attention": {"attn_batch", "lengths", "burn_in"},
         "train": {"tiny", "shapes", "context", "train_batch", "methods", "grad_ckpt", "compile", "cuda_graphs",
                   "profile"}, "ttft": {"tiny", "shapes", "compile", "burn_in"}, "batching": set()}  # and every one:
EVERY = {"device", "threads", "iters"}


def configure(argv):
    """The module's settings from the command line argv: args, device, cuda. A flag the benchmark does not read is one
    line (`train --only naive` ran the loss benchmark; `ttft --context 5` ran at its own lengths)."""
    global args, device, cuda, given
    args = parser.parse_args(argv)
    given = {a[2:].split("=")[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith("--")}
    if unread := sorted(given - READS[args.what] - EVERY):
        reads = ", --".join(sorted(READS[args.what] | EVERY))
        parser.error(f"--{unread[0]} does not apply to `{args.what}`; it reads --{reads}")
    if args.tiny and "shapes" in given:  # (--tiny ran the tiny shape alone)
        parser.error("--tiny and --shapes both name the shapes: give one")
    device = train.pick_device(args.device)
    cuda = device.type == "cuda"
    if args.cuda_graphs and not (args.compile and cuda and not args.grad_ckpt):
        parser.error("--cuda_graphs needs --compile and --device cuda, and not --grad_ckpt")


def set_threads():
    """--threads, else one for tiny tensors on CPU (more only spin-wait): a script's choice, never an import's."""
    if args.threads or (args.tiny and device.type == "cpu"):
        torch.set_num_threads(args.threads or 1)


configure(None if __name__ == "__main__" else ["train", "--tiny"])  # imported by tests and scripts: defaults
TINY_BASE = os.path.join(ROOT, "tiny_base")


def timeit(step, burn_in, iters):
    """Median seconds per step() after burn_in untimed calls (the median: shared machines are noisy)."""
    for _ in range(burn_in):
        step()
    sync = torch.cuda.synchronize if cuda else lambda: None
    times = []
    for _ in range(max(1, iters)):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def peak_memory_mb():
    """max_memory_allocated on CUDA; elsewhere this process's peak RSS (Linux: ru_maxrss in KiB)."""
    if cuda:
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_memory():
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# -----------------------------------------------------------------------------
# loss: chunked vs naive KD from hidden states, fwd + bwd (student h and head)

def bench_one_loss(variant):
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g, device=device) * 0.05)  # noqa: E731
    h, w = mk(1, args.tokens, args.dim).requires_grad_(), mk(args.loss_vocab, args.dim).requires_grad_()
    th, tw = mk(1, args.tokens, args.dim), mk(args.loss_vocab, args.dim)
    labels = torch.zeros(1, args.tokens, dtype=torch.long, device=device)
    fn = kernels.chunked_kd if variant == "chunked" else lambda *a: (kernels.naive_kd(*a), None)
    reset_memory()
    base = peak_memory_mb()

    def step():
        loss, _ = fn(h, w, th, tw, labels)
        loss.backward()
        h.grad = w.grad = None
        return loss
    ms = timeit(step, min(args.burn_in, 1), min(args.iters, 3)) * 1000  # seconds per step: keep it short
    print(f"{variant:8s} fwd+bwd {ms:9.1f} ms/iter   peak memory above inputs {peak_memory_mb() - base:8.0f} MB"
          f"   loss {step().item():.4f}")


def bench_loss():
    print(f"KD loss: N={args.tokens} tokens, d={args.dim}, vocab {args.loss_vocab}, chunk {kernels.CHUNK}, {device}"
          f" ({'max_memory_allocated' if cuda else 'peak RSS, one subprocess per variant'})")
    for variant in ("chunked", "naive"):
        if cuda:
            bench_one_loss(variant)
        else:
            if subprocess.run([sys.executable, __file__, "loss", "--only", variant] + sys.argv[2:]).returncode:
                sys.exit(1)  # (its one line is above; a CalledProcessError's traceback came after it)


# -----------------------------------------------------------------------------
# real shapes: the checkpoints' config.json values, random init (speed depends on shapes)

LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SHAPES = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=32.0),
                         max_position_embeddings=131072, tie_word_embeddings=True),
    "qwen3-1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=40960, tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE, factor=8.0),
                         max_position_embeddings=131072, tie_word_embeddings=False),
    "tiny": dict(model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=True),
}
# dense bf16 tensor-core peak, FLOP/s (vendor datasheets); MFU is n/a elsewhere (CPU)
PEAK_BF16 = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}


def random_model(shape, tok, dev=None, dtype=None):
    """A frozen random-init Transformer of SHAPES[shape], weights N(0, 0.02), built on the
    device in bf16 on CUDA and fp32 elsewhere, as train.py loads real checkpoints."""
    dev = dev or device
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg = ModelConfig(**SHAPES[shape], bos_token_id=tok.bos_id, eos_token_id=list(tok.eos_ids))
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no fp32 copy of an 8B model first
    try:
        with torch.device(dev):
            model = Transformer(cfg)
    finally:
        torch.set_default_dtype(default)
    model.requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
    return model


# -----------------------------------------------------------------------------
# train: one optimizer step of each method's main objective

ROWS = [  # (row, method and its flags, objective, ratios): the methods' main objectives at their papers' ratios
    ("meanpool kd", "meanpool", "kd", "4,8,16"),
    ("pic ae+lm", "pic", "ae+lm", "16"),
    ("pic qa", "pic", "qa", "16"),
    ("sac qa", "sac", "qa", "5"),
    ("ata qa", "ata", "qa", "10"),
    ("sentence_gist lm", "sentence_gist", "lm", "1"),
    ("tokens kd", "pic --mem single --mask bidir", "kd", "4,8,16"),  # meanpool §5.1's compression tokens
    ("meanpool kd per ratio", "meanpool", "kd", "4,8,16"),  # a decoder pass per ratio, not model.decode_each's one
    ("tokens kd per ratio", "pic --mem single --mask bidir", "kd", "4,8,16"),
]


@contextmanager
def decode_per_ratio(on):
    """Rows named "per ratio": the methods' decoder runs once per ratio, as before the ratios were stacked."""
    if on:
        meanpool.decode_each = pic.decode_each = lambda decode, memories, ids, stack: model.decode_each(
            decode, memories, ids, False)
    try:
        yield
    finally:
        meanpool.decode_each = pic.decode_each = model.decode_each


def build_row(base, tok, method, objective, ratio, batch_size, context):
    """(method module, one collated batch on the device, context tokens in it), built as
    train.py builds them, from synthetic biographies long enough to fill `context` tokens.
    method: a --method name, then any of its flags ("pic --mem single")."""
    method, *flags = method.split()
    cls = train.method_registry()[method]
    run = train.TrainConfig(method=method, objective=objective, ratio=ratio, max_context=context,
                           batch_size=batch_size, no_aids=True, seed=0)
    (mcfg,), _ = train.parse_args(flags, cls.Config)
    if hasattr(cls, "check_config"):
        cls.check_config(run, mcfg)
    torch.manual_seed(0)
    dev = base.lm_head.weight.device
    m = cls(base, mcfg, tok, run).to(dev)
    for n, p in m.named_parameters():  # non-zero adapters, as after some training
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    batches, rng = train.Batches(run, tok, m), random.Random(0)
    people = context // 25 + 4  # ~40 tokens per biography with the tiny tokenizer; collate cuts at `context`
    items = [batches.synth.lm_text(rng, people) if batches.text else batches.synth.example(rng, people, 6)
             for _ in range(batch_size)]
    batch = dict(train.to_device(batches.collate(items), dev), step=0)
    return m, batch, int((batch["lengths"] if batches.text else batch["context_len"]).sum())


class FlopCounter:
    """Model FLOPs of a step, counted analytically from the shapes each layer saw.

    A decoder layer called on Q queries over S keys (prefix K/V included):
        linear     2 * Q * P_layer        P_layer: q, k, v, o, gate, up, down weights (LoRA ignored)
        attention  4 * Q * S * H * hd     QK^T and PV over every key (masked or not)
    A pass that is backpropagated costs more: linears x2 (the gradient of the input; the
    frozen base's weight gradients are never computed), attention x3 (dQ, dK, dV, dP).
    No-grad passes (the teacher) count their forward. A chunked loss over N rows of width
    d and vocab V: 2 * N * d * V per matmul: the logits, the gradient of h, the teacher's
    logits (kd), the gradient of the head (when it trains). Recomputation (--grad_ckpt) is
    not counted. MFU = FLOPs / (seconds per step x the GPU's dense bf16 peak).
    """

    def __init__(self, model):
        self.flops, self.hooks = 0, []
        self.attn = 4 * model.config.num_attention_heads * model.config.head_dim
        for layer in model.model.layers:
            p_layer = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
            self.hooks.append(layer.register_forward_hook(lambda mod, inp, out, p=p_layer: self.layer(inp, out, p)))
        self.real_run = kernels._ChunkedLoss._run

        def counted(ctx, h, w, weights, kind, *rest):  # rest: target, teacher_h, teacher_w, softcap
            matmuls = 2 + (kind == "kd") + bool(ctx.needs_input_grad[1])
            self.flops += 2 * h.shape[0] * h.shape[1] * w.shape[0] * matmuls
            return self.real_run(ctx, h, w, weights, kind, *rest)
        kernels._ChunkedLoss._run = staticmethod(counted)

    def layer(self, inp, out, p_layer):
        (B, Q), prefix = inp[0].shape[:2], inp[4]
        S = Q + (prefix[0].shape[2] if prefix is not None else 0)
        grad = out[0].requires_grad
        self.flops += B * Q * (2 * p_layer * (2 if grad else 1) + self.attn * S * (3 if grad else 1))

    def close(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []
        kernels._ChunkedLoss._run = staticmethod(self.real_run)


def optimizer_step(params, compute_loss):
    """One AdamW step of compute_loss() (under bf16 autocast on CUDA) as a function."""
    opt = torch.optim.AdamW(params, lr=1e-5)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = compute_loss()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def time_row(name, step, n_tokens, flops):
    """Times step() after one untimed call and prints the row; returns seconds per step."""
    reset_memory()
    secs = timeit(step, 1, args.iters)
    peak = next((v for k, v in PEAK_BF16.items() if cuda and k in torch.cuda.get_device_name()), None)
    mfu = f"{flops / secs / peak:6.1%}" if peak else "   n/a"
    mem = f"{peak_memory_mb():8.0f} MB" if cuda else "     n/a"
    print(f"  {name:22s} {secs * 1000:9.1f} ms/step {n_tokens / secs:10.0f} ctx tok/s  "
          f"{flops / 1e9:9.1f} GFLOP  MFU {mfu}  peak {mem}")
    return secs


def train_shapes():
    """(shapes, B, context) of `train`, its header printed."""
    context = 256 if args.tiny and "context" not in given else args.context  # (--tiny: short, unless given)
    B = 2 if args.tiny and "train_batch" not in given else args.train_batch
    hardware = torch.cuda.get_device_name() if cuda else f"{torch.get_num_threads()} threads"
    flags = "".join(f", --{f}" for f in ("grad_ckpt", "compile", "cuda_graphs") if getattr(args, f))
    print(f"train: one AdamW step, B={B} x {context}-token contexts, {device} ({hardware}), "
          f"{'bf16 weights + autocast' if cuda else 'fp32'}{flags}; median"
          f" of {args.iters} after 1 untimed; peak = max_memory_allocated{'' if cuda else ' (n/a on CPU)'}")
    return ["tiny"] if args.tiny else args.shapes.split(","), B, context


def check_args():
    """The flags' values before any work: one line naming the flag."""
    for flag, least in (("iters", 1), ("burn_in", 0), ("threads", 0), ("loss_vocab", 1), ("tokens", 1), ("dim", 1),
                        ("context", 1), ("train_batch", 1), ("attn_batch", 1)):
        most = 4096 if flag == "threads" else 1 << 20  # (a typo's 10^11 reached torch or the sampler as a traceback)
        if not least <= getattr(args, flag) <= most:
            sys.exit(f"error: --{flag} {getattr(args, flag)} must lie in {least}..{most}")
    if unknown := sorted(set(args.shapes.split(",")) - SHAPES.keys()):
        sys.exit(f"error: --shapes {','.join(unknown)}: no such shape; choose from {', '.join(SHAPES)}")
    if not all(n.isascii() and n.isdigit() and 0 < int(n) <= 1 << 20 for n in args.lengths.split(",")):  # (not ²)
        sys.exit(f"error: --lengths {args.lengths!r}: a comma list of positive token counts")
    selected_rows()


def added_row(name, cls):
    """The row of a registered compressor that ROWS lacks (a method just added): its recipe's last stage, at the
    stage's ratio (else --ratio's default), checked by the method before any work."""
    stage = cls.recipe(cls.Config())[-1]
    ratio = {**stage.get("ours", {}), **stage.get("paper", {})}.get("ratio", train.TrainConfig.ratio)
    row = (f"{name} {stage['objective']}", name, stage["objective"], ratio)
    try:
        if hasattr(cls, "check_config"):
            cls.check_config(train.TrainConfig(method=name, objective=row[2], ratio=ratio), cls.Config())
    except SystemExit as e:
        why = str(e.code).removeprefix("error: ")
        sys.exit(f"error: bench row {row[0]!r} (ROWS has none for --method {name}): {why}; add one to ROWS")
    return row


def selected_rows():
    """The ROWS that --methods names (by row or method), all without it, and added_row's."""
    listed = {r[1].split()[0] for r in ROWS}
    rows = ROWS + [added_row(m, cls) for m, cls in train.method_registry().items()
                   if hasattr(cls, "compress") and m not in listed]
    names = {name for r in rows for name in (r[0], r[1].split()[0])}
    unknown = set(args.methods.split(",")) - names if args.methods else set()
    if unknown:
        sys.exit(f"error: --methods {', '.join(sorted(unknown))}: no such row or method; the rows: "
                 f"{', '.join(r[0] for r in rows)}")
    return [r for r in rows if not args.methods or {r[0], r[1].split()[0]} & set(args.methods.split(","))]


def bench_train():
    tok = data.load_tokenizer(TINY_BASE)
    shapes, B, context = train_shapes()
    for shape in shapes:
        print(f"{shape}:")
        for row in selected_rows():
            try:
                train_row(shape, tok, row, B, context)
            except torch.cuda.OutOfMemoryError:
                print(out_of_memory(row[0], B))
            reset_memory()
            torch._dynamo.reset()  # each row compiles its own flex graphs, as one run does: six methods' mask_mods
            # and K/V layouts in one process pass dynamo's recompile limit, and flex then runs unfused


def out_of_memory(name, B):
    return f"  {name:22s} out of GPU memory at B={B}: try --grad_ckpt or a smaller --train_batch"


def train_row(shape, tok, row, B, context):
    """Times our step of one row at one shape and prints it -> (base, method module, batch,
    seconds per step, FLOPs per step, context tokens per step)."""
    name, method, objective, ratio = row
    with decode_per_ratio(name.endswith("per ratio")):  # the decoder pass(es) this row times
        base = random_model(shape, tok)
        m, batch, n_tokens = build_row(base, tok, method, objective, ratio, B, context)
        ratios = train.ratios_of(ratio)

        base.grad_ckpt = args.grad_ckpt
        counter = FlopCounter(base)

        def ours():
            if args.cuda_graphs:
                torch.compiler.cudagraph_mark_step_begin()
            loss, n, _ = m(batch, ratios)
            counter.close()  # the forward's shapes give every FLOP; the backward's recompute (--grad_ckpt) is not counted
            return loss / max(float(n), 1.0)
        step = optimizer_step([p for p in m.parameters() if p.requires_grad], ours)
        try:
            step()  # the counted step: the same memory as the timed ones (a step without --grad_ckpt may not fit)
        finally:
            counter.close()
        if args.compile:  # after the counted step, whose hooks would go into the graphs
            compile_layers(base, cuda_graphs=args.cuda_graphs)
        secs = time_row(name, step, n_tokens, counter.flops)
        if args.profile:
            profile(step)
        return base, m, batch, secs, counter.flops, n_tokens


def profile(step):
    """Prints the 15 ops that took the most device time (CPU time on a CPU) in one step()."""
    with torch.profiler.profile() as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60))


# -----------------------------------------------------------------------------
# attention: flex + BlockMask vs SDPA + dense mask, fwd + bwd; create_block_mask cost

def attention_masks(T, dev):
    """[(name, mask_mod, tokens)] of about T tokens: PIC's block-wise mask (r = 16: L context + L/16
    memory tokens) and sentence_gist's sentence mask (4 gists after every 20-token sentence)."""
    import pic
    import sentence_gist
    L = T * 16 // 17
    z, _ = pic.layout(torch.tensor([L], device=dev), L, [16])
    is_end = torch.zeros(64, dtype=torch.bool)
    is_end[5] = True  # token 5 ends a sentence
    body = [5 if i % 20 == 19 else 10 + i % 50 for i in range(T * 20 // 24 - 1)]
    lay = sentence_gist.layout([([1], body, [])], is_end, 4, 64, device=dev, multiple=1)
    return [("pic blockwise", pic.blockwise(z), z["valid"].shape[1]),
            ("sentence_gist", sentence_gist.sentence_mask(lay["sentence"], lay["kind"]), lay["ids"].shape[1])]


def bench_attention():
    H, Hkv, hd = 16, 8, 128  # Qwen3-1.7B's attention
    B = args.attn_batch  # the rows share one mask (broadcast over the batch)
    for T in map(int, args.lengths.split(",")):
        for name, mask_mod, Tm in attention_masks(T, device):
            new_block = lambda: kernels.Mask(mask_mod, 1, Tm, Tm, device).block()  # noqa: E731
            first_s, block_s = timeit(new_block, 0, 1), timeit(new_block, 0, 3)  # the first compiles (CUDA)
            mask = kernels.Mask(mask_mod, 1, Tm, Tm, device)
            empty, dense_s = mask.block().sparsity(), timeit(mask.dense, 0, 1)  # sparsity: % of blocks skipped
            print(f"{name:14s} B={B} T={Tm:5d} {device}: block mask {block_s * 1000:8.1f} ms/batch "
                  f"(first call {first_s * 1000:.0f} ms), dense mask {dense_s * 1000:.1f} ms, "
                  f"{empty:.0f}% of 128x128 blocks empty")
            if not cuda:
                print(f"{'':14s} flex vs SDPA fwd+bwd: skipped (CUDA only: torch {torch.__version__} has no flex backward on CPU)")
                continue
            g = torch.Generator(device=device).manual_seed(0)
            q, k, v = (torch.randn(B, h, Tm, hd, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
                       for h in (H, Hkv, Hkv))

            def step():
                kernels.attention(q, k, v, mask).sum().backward()
                q.grad = k.grad = v.grad = None
            ms = {}
            for backend in ("flex", "dense"):
                kernels.BACKEND = backend
                reset_memory()
                ms[backend] = timeit(step, args.burn_in, args.iters) * 1000
                print(f"{'':14s} {backend:5s} fwd+bwd {ms[backend]:8.2f} ms   peak {peak_memory_mb():8.0f} MB")
            kernels.BACKEND = None
            print(f"{'':14s} flex / SDPA speed: {ms['dense'] / ms['flex']:.2f}x")


# -----------------------------------------------------------------------------
# ttft: answering from a saved Memory vs reading the whole context

def bench_ttft():
    tok = data.load_tokenizer(TINY_BASE)
    L, P, r = (1024 if args.tiny else 8192), 32, 16
    ideal = (L + P) / (L / r + P)
    print(f"ttft: prefill + first token, context L={L}, prompt P={P}, Memory at {r}x (C={L // r} slots) loaded "
          f"from a safetensors file, {device}; ideal speed-up (L+P)/(L/r+P) = {ideal:.2f}")
    for shape in ["tiny"] if args.tiny else args.shapes.split(","):
        base = random_model(shape, tok)
        if args.compile:
            compile_layers(base)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(10, tok.vocab_size, (1, L + P), generator=g).to(device)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "memory.safetensors")
            Memory(embeds=torch.randn(1, L // r, base.config.hidden_size, generator=g) * 0.02).save(path)
            dtype = base.lm_head.weight.dtype
            for graphs in (False, True) if device.type == "cuda" else (False,):  # graphs: the first call captures
                memory_s = timeit(lambda: base.generate(ids[:, L:], 1, memory=Memory.load(path, device).to(dtype),
                                                        cuda_graphs=graphs), args.burn_in, args.iters)
                full_s = timeit(lambda: base.generate(ids, 1, cuda_graphs=graphs), args.burn_in, args.iters)
                print(f"  {shape:14s} {'CUDA graphs' if graphs else 'eager':11s} full context {full_s * 1000:9.1f} ms"
                      f"   from Memory {memory_s * 1000:8.1f} ms   speed-up {full_s / memory_s:5.2f}x (ideal {ideal:.2f}x)")
        del base


def bench_batching():
    """train.Batches on SQuAD v1.1 dev's records repeated to 95k (train-v1.1 has 87,599) with Llama 3's
    tokenizer, the papers' global batch 32: host ms a step on its first visits (tokenizing) and after, and
    the per-item shuffle of the sampler before (one permutation of the records per item drawn)."""
    assets = os.path.join(ROOT, "..", "shared", "assets")
    for path in ("qa/squad/dev-v1.1.json.zip", "tokenizers/llama3_tokenizer.model"):
        if not os.path.isfile(os.path.join(assets, path)):
            sys.exit(f"error: batching reads {os.path.join(assets, path)}, which is not there")
    records = list(data.read_dataset(os.path.join(assets, "qa", "squad", "dev-v1.1.json.zip")))
    records = [dict(r, id=f"{r['id']}-{i}") for i in range(9) for r in records]
    tok = data.load_tokenizer(os.path.join(assets, "tokenizers", "llama3_tokenizer.model"))
    tok.memo = {}
    cfg = train.TrainConfig(method="meanpool", objective="kd", init_from="/real", batch_size=32, max_context=1024,
                           max_answer=256, prompt="plain")
    batches, epoch2 = train.Batches(cfg, tok, None, records), len(records) // 32 + 1
    for name, steps in (("first visits", range(args.iters * 10)),  # then the same records again: from the memo
                        ("again (epoch 2)", range(epoch2, epoch2 + args.iters * 10))):
        t = time.perf_counter()
        for s in steps:
            batches(s)
        print(f"  {name:16s} {(time.perf_counter() - t) / len(steps) * 1000:7.1f} ms a step of 32")
    t = time.perf_counter()
    for i in range(32):  # before: a fresh permutation of every record for each item
        perm = list(range(len(records)))
        random.Random(cfg.seed).shuffle(perm)
    print(f"  {'before: sampler':16s} {(time.perf_counter() - t) * 1000:7.1f} ms a step of 32 (shuffles alone)")


if __name__ == "__main__":
    check_args()
    set_threads()
    benches = {"loss": bench_loss, "train": bench_train, "attention": bench_attention, "ttft": bench_ttft,
               "batching": bench_batching}
    with train.one_line_errors("lower --loss_vocab, --tokens, --train_batch, --context or --attn_batch"):
        bench_one_loss(args.only) if args.only else benches[args.what]()
