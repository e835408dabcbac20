"""Issue 23 on CPU: --grad_ckpt changes memory, not numbers; benchmarks/hf_twins.py's HF + peft
reference steps compute the same losses as ours (so its speed ratio is a fair one)."""
import torch

import data
import tiny
import train
from common import ROOT, load_script
from model import Transformer


def build(base_dir, method, objective, grad_ckpt, seed=0):
    cfg = train.TrainConfig(method=method, objective=objective, init_from=base_dir, grad_ckpt=grad_ckpt)
    mcls = train.method_registry()[method].Config
    torch.manual_seed(seed)
    tok, base, m = train.build(cfg, mcls(), "cpu", torch.float32)
    for n, p in m.named_parameters():  # non-zero adapters: the encoder is not the base
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(hash(n) % 1000))
    return tok, base, m


def test_grad_ckpt_same_loss_and_grads(base_dir):
    """meanpool kd (encoder with a custom mask, decoder with embedding memory, teacher
    under no_grad): the loss and every trainable gradient match plain backward."""
    grads, losses = [], []
    for ckpt in (False, True):
        tok, base, m = build(base_dir, "meanpool", "kd", ckpt)
        assert base.grad_ckpt is ckpt
        batch = data.collate_qa(tiny.Synthetic(0, "val").qa_examples(2), tok, pad_multiple=8)
        loss, n, _ = m(batch, [4, 8])
        loss.backward()
        losses.append(loss.item())
        grads.append({k: p.grad.clone() for k, p in m.named_parameters() if p.requires_grad})
    assert losses[0] == losses[1] or abs(losses[0] - losses[1]) < 1e-6 * abs(losses[0])
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-6, rtol=1e-5, msg=k)


def test_grad_ckpt_prefix_kv_model(base_dir):
    """A decoder over K/V memory (sac, ata, sentence_gist) with return_kv: same outputs and grads."""
    model = Transformer.from_pretrained(base_dir)
    model.add_adapter("decoder", 4, 8)
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, kv = model(ids[:, :4], return_kv=True)
    from model import Memory
    memory = Memory(kv=kv, mask=torch.tensor([[True] * 4, [False, True, True, True]]))
    outs = []
    for ckpt in (False, True):
        model.grad_ckpt = ckpt
        model.zero_grad()
        with model.adapter("decoder"):
            h, kvs = model(ids[:, 4:], memory=memory, return_kv=True, output="hidden")
        (h.square().sum() + kvs[-1][0].sum()).backward()
        outs.append((h.detach(), [p.grad.clone() for p in model.parameters() if p.requires_grad]))
    torch.testing.assert_close(outs[1][0], outs[0][0])
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_hf_peft_twins_give_our_losses():
    """benchmarks/hf_twins.py's transformers + peft steps (meanpool kd, pic ae+lm) compute our
    loss on the same weights and batch, and the same gradients on the shared trainable tensors
    (pic at 4,16: our one encoder pass for both ratios against the twin's pass per ratio)."""
    twins = load_script("hf_twins", "benchmarks")
    bench = twins.bench
    tok = data.load_tokenizer(str(ROOT / "tiny_base"))
    for (name, method, objective, _), ratio in ((bench.ROWS[0], "4,8"), (bench.ROWS[1], "4,16")):
        base = bench.random_model("tiny", tok, torch.device("cpu"), torch.float32)
        m, batch, n_tokens = bench.build_row(base, tok, method, objective, ratio, 2, 96)
        assert n_tokens > 2 * 48
        ratios = train.ratios_of(ratio)
        ours, _, _ = m(batch, ratios)
        ours.backward()
        g_ours = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        m.zero_grad()
        theirs = twins.TWINS[name](twins.hf_peft(base), m, batch, ratios, tok)
        theirs.backward()
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5, msg=method)
        for n in ("proj.weight", "converter.0.weight", "mem_embed"):  # ours' own tensors, shared by both
            if n in g_ours:
                torch.testing.assert_close(dict(m.named_parameters())[n].grad, g_ours[n], rtol=1e-3, atol=1e-6, msg=n)



def test_bench_counts_flops_in_a_step_like_the_timed_ones(monkeypatch):
    """bench.py train counts a row's FLOPs in a step that runs as the timed ones do: under
    --grad_ckpt its layers run checkpointed (pic ae+lm at Llama-3.1-8B fits an H200 only so;
    counted without, the row ran out of memory), and the count is the same."""
    import model
    bench = load_script("hf_twins", "benchmarks").bench
    tok = data.load_tokenizer(str(ROOT / "tiny_base"))
    checkpointed, at_close = [], []
    real_checkpointed, real_close = model.checkpointed, bench.FlopCounter.close
    monkeypatch.setattr(model, "checkpointed", lambda *a: checkpointed.append(1) or real_checkpointed(*a))
    monkeypatch.setattr(bench.FlopCounter, "close", lambda self: at_close.append(len(checkpointed)) or real_close(self))
    flops = {}
    for ckpt in (False, True):
        checkpointed.clear(), at_close.clear()
        monkeypatch.setattr(bench.args, "grad_ckpt", ckpt)
        *_, flops[ckpt], _ = bench.train_row("tiny", tok, bench.ROWS[1], 2, 96)
        assert (at_close[0] > 0) is ckpt, at_close  # layers checkpointed before the count closed
    assert flops[True] == flops[False] > 0, flops


def test_bench_names_an_unknown_row_before_any_work(monkeypatch):
    """--methods with a name that is no row or method: one line listing the rows (it used to time nothing)."""
    import pytest
    bench = load_script("hf_twins", "benchmarks").bench
    monkeypatch.setattr(bench.args, "methods", "meanpool kd,pik")
    with pytest.raises(SystemExit) as e:
        bench.selected_rows()
    assert str(e.value).startswith("error: --methods pik: no such row or method; the rows: meanpool kd, ")
    monkeypatch.setattr(bench.args, "methods", "sac,ata qa")  # a method's rows, a row by name
    assert [r[0] for r in bench.selected_rows()] == ["sac qa", "ata qa"]
    import meanpool
    import sentence_gist
    import train
    registry = train.method_registry()  # a method just added gets a row of its own (it had to be listed in ROWS)
    monkeypatch.setattr(train, "method_registry", lambda: {**registry, "lastk": type("LastK", (meanpool.MeanPool,), {})})
    monkeypatch.setattr(bench.args, "methods", "lastk")
    assert bench.selected_rows() == [("lastk kd", "lastk", "kd", "4,8,16,32,64,128")]  # its recipe's stage
    monkeypatch.setattr(bench.args, "methods", "")
    rows = [r[0] for r in bench.selected_rows()]  # (after every row of ROWS; a fork's own methods may sit between)
    assert rows[-1] == "lastk kd" and rows.index("tokens kd per ratio") < len(rows) - 1
    gist = type("Gistx", (sentence_gist.SentenceGist,), {})
    monkeypatch.setattr(train, "method_registry", lambda: {**registry, "gistx": gist})
    assert bench.selected_rows()[-1] == ("gistx lm", "gistx", "lm", "1")  # its recipe's ratio (4,8,16 failed)
    gist.recipe = staticmethod(lambda mcfg: [dict(objective="lm", cite="ours", paper={})])  # no ratio: refused
    with pytest.raises(SystemExit) as e:
        bench.selected_rows()
    assert str(e.value).startswith("error: bench row 'gistx lm' (ROWS has none for --method gistx): --ratio 4,8,16 "
                                   "does not apply") and str(e.value).endswith("; add one to ROWS")


def test_bench_flags_are_one_line_before_any_work():
    """A count below its least, an unknown shape, a length that is not a number, a device this machine lacks: one
    line naming the flag (they were tracebacks, or timed zero iterations)."""
    import pytest
    bench = load_script("hf_twins", "benchmarks").bench
    try:
        for argv, message in ((["train", "--iters", "0"], "--iters 0 must lie in 1..1048576"),
                              (["loss", "--threads", str(10 ** 11)], f"--threads {10 ** 11} must lie in 0..4096"),
                              (["train", "--context", str(10 ** 11)], f"--context {10 ** 11} must lie in 1..1048576"),
                              (["train", "--shapes", "llama-3.1-8b,bogus"], "--shapes bogus: no such shape"),
                              (["attention", "--lengths", "4k"], "--lengths '4k': a comma list"),
                              (["attention", "--lengths", "²"], "--lengths '²': a comma list"),  # (int('²') failed)
                              (["loss", "--device", "tpu"], "--device 'tpu' is not a device"),
                              (["loss", "--only", "bogus"], "--only: invalid choice: 'bogus'"),  # (it timed a loss)
                              (["train", "--cuda_graphs"], "--cuda_graphs needs --compile"),  # (argparse's usage)
                              (["train", "--only", "naive"], "--only does not apply to `train`"),  # (it ran `loss`)
                              (["ttft", "--tiny", "--context", "5"], "--context does not apply to `ttft`"),  # (unread)
                              (["train", "--tiny", "--shapes", "llama-3.1-8b"], "--tiny and --shapes both name")):
            with pytest.raises(SystemExit) as e:
                bench.configure(argv)
                bench.check_args()
            assert str(e.value).startswith("error: ") and message in str(e.value), argv
        bench.configure(["train", "--tiny", "--train_batch", "4", "--context", "64"])  # (--tiny ran B = 2 x 256)
        assert bench.train_shapes() == (["tiny"], 4, 64)
        bench.configure(["train", "--tiny"])
        assert bench.train_shapes() == (["tiny"], 2, 256)
    finally:
        bench.configure(["train", "--tiny"])  # the import's settings back
