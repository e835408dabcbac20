"""bench.py train's meanpool kd and pic ae+lm rows beside their transformers + peft twins.

    python benchmarks/hf_twins.py --shapes llama-3.1-8b --iters 3   # any `bench.py train` flag
    python benchmarks/hf_twins.py --tiny                              # CPU, seconds

Each twin is written as the papers' official code is (peft adapters switched per pass, a
4-D mask, pooling by reshape, inputs_embeds, full-vocabulary logits), shares our weights and
gives our loss (tests/test_perf.py), so `ours / HF + peft` compares the same computation.
Dev only: transformers and peft are oracles here, never imported at run time. The twins
run without checkpointing (HF's recomputes under whichever adapter is active then).
"""
import os
import sys
import warnings

import peft
import torch
import torch.nn.functional as F
import transformers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repo; bench beside this
import bench  # noqa: E402
import data  # noqa: E402
import kernels  # noqa: E402
import pic  # noqa: E402
import train  # noqa: E402


def hf_peft(ours):
    """A transformers model sharing `ours`' base weights, with ours' adapters as peft adapters."""
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")  # peft calls a deprecated HF name
    cfg = ours.config.to_json()
    hf_cfg = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    dev, dtype = ours.lm_head.weight.device, ours.lm_head.weight.dtype
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
    state = ours.base_state(cpu=False)  # HF's tensors per projection: views of our fused ones
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    if ours.config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=hf.config).to(dev)  # a buffer: not in the state dict
    model = None
    for name, c in ours.adapter_configs.items():
        lc = peft.LoraConfig(r=c["r"], lora_alpha=c["alpha"], lora_dropout=c["dropout"], target_modules=c["targets"])
        if model is None:
            model = peft.get_peft_model(hf, lc, adapter_name=name)
        else:
            model.add_adapter(name, lc)
        with torch.no_grad():
            for path, (A, B) in ours.adapter_state(name).items():
                mod = model.base_model.model.get_submodule(path)
                mod.lora_A[name].weight.copy_(A)
                mod.lora_B[name].weight.copy_(B)
    return model


def use(model, name):
    """peft's set_adapter freezes the other adapters; both train here, as in ours."""
    model.set_adapter(name)
    for n, p in model.named_parameters():
        if "lora_" in n:
            p.requires_grad_(True)


def hf_decode(lm, prefix, z, slots, e):
    """Logits of the decoder over [prefix, z, e] as inputs_embeds, as model.behind_prefix: z's
    empty slots (slots False) are masked out and take no position."""
    (B, T), dev = e.shape[:2], e.device
    slots = torch.cat([torch.ones(B, prefix.shape[1], dtype=torch.bool, device=dev), slots], 1)
    pos = torch.cat([(slots.long().cumsum(1) - 1).clamp(min=0),
                     slots.sum(1, keepdim=True) + torch.arange(T, device=dev)], 1)
    mask = torch.cat([slots, torch.ones(B, T, dtype=torch.bool, device=dev)], 1).long()
    z = torch.cat([lm.model.embed_tokens(prefix).expand(B, -1, -1).to(z.dtype), z], 1)
    return lm(inputs_embeds=torch.cat([z.to(e.dtype), e], 1), attention_mask=mask, position_ids=pos).logits


def hf_meanpool_kd(model, m, batch, ratios, tok):
    """Summed KL(teacher || student) over answer tokens and ratios, as meanpool.MeanPool."""
    lm = model.base_model.model  # ForCausalLM with LoRA layers
    ctx, lengths, qa = batch["context"], batch["context_len"], batch["qa"]
    B, L = ctx.shape
    real = torch.arange(L, device=ctx.device)[None] < lengths[:, None]  # (B, L)
    use(model, "encoder")
    h = lm.model(input_ids=ctx, attention_mask=real[:, None, None, :].expand(B, 1, L, L)).last_hidden_state
    with torch.no_grad(), model.disable_adapter():
        teacher = lm(input_ids=batch["full"]).logits[batch["full_labels"] != -100]  # (N, V)
    logq = teacher.float().log_softmax(-1)
    use(model, "decoder")
    emb = lm.model.embed_tokens(qa)
    prefix = torch.tensor(batch["prefix"], device=qa.device)[None]  # (1, P)
    total = 0.0
    for r in ratios:
        C = -(-int(lengths.max()) // r)
        hp = F.pad(h * real[..., None], (0, 0, 0, C * r - L))[:, :C * r].reshape(B, C, r, -1).sum(2)
        cnt = F.pad(real.float(), (0, C * r - L))[:, :C * r].reshape(B, C, r).sum(2)  # (B, C)
        z = hp / cnt.clamp(min=1)[..., None]
        if m.proj is not None:
            z = m.proj(z.to(m.proj.weight.dtype))
        logits = hf_decode(lm, prefix, z, cnt > 0, emb)
        logp = logits[:, prefix.shape[1] + C:][batch["qa_labels"] != -100].float().log_softmax(-1)
        total = total + (logq.exp() * (logq - logp)).sum()
    return total


def hf_pic_ae(model, m, batch, ratios, tok):
    """Eq. 6-8 as pic.PIC.ae_lm: sum over examples of 0.5 TC + 0.5 TR."""
    lm = model.base_model.model
    ids, lengths = batch["ids"], batch["lengths"].tolist()
    dev, off = ids.device, int(tok.bos_id is not None)
    texts = [ids[b, off:n].tolist() for b, n in enumerate(lengths)]
    ks = [max(1, len(x) // 2) for x in texts]
    rows = lambda cut, value=tok.pad_id: data.pad_rows([cut(x, k) for x, k in zip(texts, ks)], value, 1).to(dev)  # noqa: E731
    context, clen = rows(lambda x, k: x[:k]), torch.tensor(ks, device=dev)
    tr_in, tr_lab = rows(lambda x, k: x[:k - 1]), rows(lambda x, k: x[:k], -100)
    tc_in, tc_lab = rows(lambda x, k: x[k - 1:-1]), rows(lambda x, k: x[k:], -100)
    B, L = context.shape
    total = 0.0
    for r in ratios:
        lay, (N,) = pic.layout(clen, L, [r])
        emb = lm.model.embed_tokens(context)
        x = torch.cat([emb, m.mem_embed[:N].to(emb.dtype)[None].expand(B, N, -1)], 1)
        mask = kernels.dense_mask(pic.blockwise(lay), B, L + N, L + N, dev)  # (B, 1, L+N, L+N)
        use(model, "encoder")
        h = lm.model(inputs_embeds=x, attention_mask=mask, position_ids=lay["pos"]).last_hidden_state[:, L:]
        z, mem = m.converter(h.to(m.converter[0].weight.dtype)), lay["valid"][:, L:]
        with model.disable_adapter():
            def ce(ids_, labels, extra=None):  # frozen decoder over [BOS, z, extra, ids_]: CE mean per example, summed
                e = lm.model.embed_tokens(ids_)
                e = torch.cat([extra.to(e.dtype), e], 1) if extra is not None else e
                start = off + z.shape[1]
                logits = hf_decode(lm, ids[:1, :off], z, mem, e)[:, start:start + labels.shape[1]]
                loss = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
                return (loss.sum(1) / (labels != -100).sum(1).clamp(min=1)).sum()
            tr = ce(tr_in, tr_lab, m.ae[None, None].expand(B, 1, -1))
            tc = ce(tc_in, tc_lab)
        total = total + pic.LAMBDA * tc + (1 - pic.LAMBDA) * tr
    return total


TWINS = {"meanpool kd": hf_meanpool_kd, "pic ae+lm": hf_pic_ae}


def main():
    if {"-h", "--help"} & set(sys.argv[1:]):  # (bench.py's parser printed bench.py's help)
        return print(f"{__doc__.strip()}\n\nFlags: those of `python benchmarks/bench.py train --help`.")
    bench.configure(["train"] + sys.argv[1:])
    bench.check_args()
    bench.set_threads()
    tok = data.load_tokenizer(bench.TINY_BASE)
    shapes, B, context = bench.train_shapes()
    for shape in shapes:
        print(f"{shape}:")
        for row in (r for r in bench.selected_rows() if r[0] in TWINS):
            try:
                twin_pair(shape, tok, row, B, context)
            except torch.cuda.OutOfMemoryError:
                print(bench.out_of_memory(row[0], B))
            bench.reset_memory()


def twin_pair(shape, tok, row, B, context):
    """Our row (bench.train_row), then its twin's on the same weights and batch, then the ratio."""
    base, m, batch, secs, flops, n_tokens = bench.train_row(shape, tok, row, B, context)
    model = hf_peft(base)
    n = int((batch["qa_labels"] != -100).sum()) if row[1] == "meanpool" else B  # ours' counts
    params = [p for k, p in model.named_parameters() if "lora_" in k] + \
        [p for k, p in m.named_parameters() if p.requires_grad and "lora_" not in k]  # peft's adapters, our others
    ratios = train.ratios_of(row[3])
    step = bench.optimizer_step(params, lambda: TWINS[row[0]](model, m, batch, ratios, tok) / n)
    secs_hf = bench.time_row(f"{row[0]} (HF + peft)", step, n_tokens, flops)
    print(f"  {'':22s} ours / HF + peft: {secs_hf / secs:.2f}x the speed")


if __name__ == "__main__":
    main()
