"""Micro-benchmarks, nanoGPT style: burn-in, then timed iterations.

    python bench.py model        # fwd+bwd ms/iter: our Transformer vs transformers' Llama
    python bench.py loss         # time and peak memory: chunked_kd vs naive_kd at vocab 152k
    python bench.py attention    # fwd+bwd ms/iter: Gemma 2's soft-capping attention vs plain SDPA

On CPU the loss benchmark runs each variant in a fresh subprocess and reports the growth
of its peak RSS (ru_maxrss) over the inputs; on CUDA, torch.cuda.max_memory_allocated.
"""
import argparse
import resource
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

import kernels
from model import Transformer

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("what", choices=["model", "loss", "attention"])
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--threads", type=int, default=0, help="CPU threads (0 = torch's default)")
parser.add_argument("--burn_in", type=int, default=2, help="untimed iterations first")
parser.add_argument("--iters", type=int, default=5, help="timed iterations")
# model
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--heads", type=int, default=8)
parser.add_argument("--kv_heads", type=int, default=2)
parser.add_argument("--vocab", type=int, default=8192, help="model benchmark vocab (loss uses --loss_vocab)")
parser.add_argument("--batch", type=int, default=2)
parser.add_argument("--seq", type=int, default=512)
parser.add_argument("--window", type=int, default=128, help="attention benchmark: sliding window")
parser.add_argument("--softcap", type=float, default=50.0, help="attention benchmark: Gemma 2's attn_logit_softcapping")
# loss
parser.add_argument("--loss_vocab", type=int, default=152064, help="Qwen2.5's vocab")
parser.add_argument("--tokens", type=int, default=2048)
parser.add_argument("--dim", type=int, default=256)
parser.add_argument("--only", default="", help="internal: run one loss variant (chunked | naive) and print")
args = parser.parse_args()
device = torch.device(args.device)
if args.threads:
    torch.set_num_threads(args.threads)


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()


def timeit(step, burn_in, iters):
    """Median ms per iteration after burn-in (the median: shared CPU machines are noisy)."""
    for _ in range(burn_in):
        step()
    times = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1000)
    return sorted(times)[len(times) // 2]


# -----------------------------------------------------------------------------
# (a) the model: same weights, same batch, fwd + bwd of next-token CE

def bench_model():
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=4 * args.width,
                                   num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                   num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                                   tie_word_embeddings=False, attn_implementation="sdpa")
    hf = transformers.LlamaForCausalLM(cfg).to(device)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours = Transformer.from_pretrained(d, device=device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    forwards = {"ours": lambda: ours(ids), "hf": lambda: hf(ids).logits}
    with torch.no_grad():
        err = (forwards["ours"]() - forwards["hf"]()).abs().max().item()
    print(f"{args.layers} layers, d={args.width}, heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, "
          f"B={args.batch}, T={args.seq}, {device}, {torch.get_num_threads()} threads; max |logits diff| {err:.1e}")
    ms = {}
    for name in ("hf", "ours", "hf", "ours"):  # interleaved twice: the second round is reported
        model, fwd = (ours if name == "ours" else hf), forwards[name]

        def step():
            logits = fwd()
            F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
            model.zero_grad(set_to_none=True)
        ms[name] = timeit(step, args.burn_in, args.iters)
    for name, t in ms.items():
        print(f"{name:5s} fwd+bwd {t:8.1f} ms/iter")
    print(f"ours / hf: {ms['ours'] / ms['hf']:.3f}")


# -----------------------------------------------------------------------------
# (b) the loss: chunked vs naive KD from hidden states, fwd + bwd (student h and head)

def loss_inputs():
    g = torch.Generator(device=device).manual_seed(0)
    mk = lambda *s: (torch.randn(*s, generator=g, device=device) * 0.05)
    h, w = mk(1, args.tokens, args.dim).requires_grad_(), mk(args.loss_vocab, args.dim).requires_grad_()
    th, tw = mk(1, args.tokens, args.dim), mk(args.loss_vocab, args.dim)
    labels = torch.zeros(1, args.tokens, dtype=torch.long, device=device)
    return h, w, th, tw, labels


def maxrss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def bench_one_loss(variant):
    fn = kernels.chunked_kd if variant == "chunked" else lambda *a: (kernels.naive_kd(*a), None)
    h, w, th, tw, labels = loss_inputs()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else maxrss_mb()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def step():
        loss, _ = fn(h, w, th, tw, labels)
        loss.backward()
        h.grad = w.grad = None
        return loss
    ms = timeit(step, min(args.burn_in, 1), max(min(args.iters, 3), 1))  # seconds per step: keep it short
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device.type == "cuda" else maxrss_mb() - base
    print(f"{variant:8s} fwd+bwd {ms:9.1f} ms/iter   peak memory above inputs {peak:8.0f} MB   loss {step().item():.4f}")


def bench_loss():
    print(f"KD loss: N={args.tokens} tokens, d={args.dim}, vocab {args.loss_vocab}, chunk {kernels.CHUNK}, {device}"
          f" ({'max_memory_allocated' if device.type == 'cuda' else 'peak RSS, one subprocess per variant'})")
    for variant in ("chunked", "naive"):
        if device.type == "cuda":
            bench_one_loss(variant)
        else:
            subprocess.run([sys.executable, __file__, "loss", "--only", variant] + sys.argv[2:], check=True)


# -----------------------------------------------------------------------------
# (c) attention: the soft-capping path (score_mod; on CPU dense scores, on CUDA flex) vs SDPA


def bench_attention():
    g = torch.Generator(device=device).manual_seed(0)
    B, H, Hkv, T, hd = args.batch, args.heads, args.kv_heads, args.seq, args.width // args.heads
    q = torch.randn(B, H, T, hd, generator=g, device=device).requires_grad_()
    k, v = (torch.randn(B, Hkv, T, hd, generator=g, device=device).requires_grad_() for _ in range(2))
    causal = kernels.Mask(kernels.causal, B, T, T, device)
    window = kernels.Mask(kernels.and_masks(kernels.causal, kernels.sliding_window(args.window)), B, T, T, device)
    cap = kernels.softcap(args.softcap)
    variants = {"sdpa is_causal": lambda: kernels.attention(q, k, v),
                "sdpa dense mask": lambda: kernels.attention(q, k, v, causal),
                "softcap": lambda: kernels.attention(q, k, v, causal, None, cap),
                f"softcap + window {args.window}": lambda: kernels.attention(q, k, v, window, None, cap)}
    print(f"attention B={B}, H/Hkv={H}/{Hkv}, T={T}, hd={hd}, softcap {args.softcap}, {device} "
          f"({causal.backend()} masks), {torch.get_num_threads()} threads")
    ms = {}
    for name, fn in variants.items():
        def step():
            fn().sum().backward()
            q.grad = k.grad = v.grad = None
        ms[name] = timeit(step, args.burn_in, args.iters)
        print(f"{name:24s} fwd+bwd {ms[name]:8.2f} ms/iter")
    print(f"softcap / sdpa is_causal: {ms['softcap'] / ms['sdpa is_causal']:.2f}x")


if __name__ == "__main__":
    if args.only:
        bench_one_loss(args.only)
    elif args.what == "model":
        bench_model()
    elif args.what == "attention":
        bench_attention()
    else:
        bench_loss()
