"""Memory-token compression with a block-wise causal mask (PIC), and the two classic compression-token masks it
is compared with. Paper: "Cognitive Chunking for Soft Prompts: Accelerating Compressor Learning via Block-wise
Causal Masking" (../shared/papers/pic_blockwise_causal.txt), §3, Tables 2 and 4; the bidirectional variant is
meanpool_multi_ratio §5.1.

    sequence   Z = [c_1 .. c_N, m_1 .. m_N],  N = ceil(L / r) (paper: r | L)                           (eq. 4)
    mask       blockwise (PIC, eq. 5): context and memory causal (t' <= t); memory t -> context only in chunk c_t
               causal (PCC / ICAE, Table 4 "Full Causal Mask"): m_t -> all context, m_<=t
               bidir (meanpool §5.1): m_t -> all context and every memory token
    memory     H = Converter(Enc(Z)[m_1 .. m_N]): final hidden states, an MLP into the frozen decoder's embeddings
    pretrain   L = lam L_TC + (1 - lam) L_TR,  lam = 0.5                                           (eq. 6-8)
               TR: decoder reads [H, <AE>, x_1 .. x_{k-1}] and predicts x_1 .. x_k  (<AE>: a learned vector)
               TC: decoder reads [H, x_k .. x_{L-1}] and predicts x_{k+1} .. x_L
    finetune   qa: CE on the answer given [H, prompt]; kd: KL to the decoder reading the full context (meanpool's)

Choices the paper leaves open, made here:
- Layout: memory after the *padded* context, padding keys masked, so an example's memory is the same in any batch.
- Encoder positions: memory t at L_b + t (`--mem_pos after`: eq. 4's order) or chunk t's centre min(t r + (r - 1) // 2,
  L_b - 1) (`centre`: EPL's idea, not its code; the tiny base's token default, where appended tokens did not learn).
- Memory tokens: a learned table (`--max_mem` rows) at the embeddings' scale; `--mem single` is meanpool §5.1's
  token baseline whole (one token repeated, a `decoder` LoRA, W (from I) as converter, `kd`; `--mask causal|bidir`).
- Converter: Linear(d_enc, d_dec), GELU, Linear(d_dec, d_dec); the decoder reads [prefix, memory, prompt] as meanpool.
- Encoder: the paper's is another model, fully finetuned (Qwen2.5-0.5B before a frozen Llama-3-8B, §4.1.2); here the
  base + an `encoder` LoRA (one checkpoint, no second optimizer state). The paper's: `--encoder DIR --lora_r 0`.
- ae+lm: --pretrain_data's texts (else the QA contexts; §4.1.1: FineWeb, ~3B tokens in 11.52M: ~260 a text) of up to
  2 x max_context (no BOS, as a QA context) split at k = len // 2: x_1 .. x_k is QA-long; TR rebuilds it from the H
  TC reads (eq. 6's X).
- Eq. 6-7 are per-example means, so a batch sums eq. 8 over examples and counts them (exact under DDP, accumulation).
- Several ratios (--ratio 4,16): one encoder pass (layout), losses summed; kd's teacher: the decoder, full context.
- Two stages (§4.1.2, §4.2.1; `recipe`): ae+lm into OUT_DIR/pretrain, then qa from it; ae+lm at batch 16, where the
  paper states none but its 90k steps over one epoch of 11.52M texts imply 128 (8x a step's compute; 1/8 the data);
  qa at lr 1e-4, batch 16, one pass of SQuAD's 86,821 (§3.4.2 defers to PCC, which states none of them).
- Unstated values: train.py's (cosine to 0.1 lr, 5 % warmup, no decay, clip 1, betas 0.9/0.95), LoRA 16/16, 1024 tokens.
- Tiny base: tiny.py's aids (KD per slot first where the slots are fixed; then output).
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

import data
import kernels
from meanpool import TABLE6, window_slots
from model import Transformer, behind_prefix, decode_each

LAMBDA = 0.5  # eq. 8


@dataclass
class PICConfig:
    mask: str = "blockwise"   # blockwise (PIC eq. 5) | causal (PCC, Table 4 ablation) | bidir (meanpool §5.1)
    mem: str = "table"        # table: a learned embedding per memory slot | single: one learned token repeated
    mem_pos: str = ""         # after: memory t at position L_b + t | centre: chunk t's centre (EPL); "" = by --mem
    max_mem: int = 256        # rows of the memory table: ceil(max_context / ratio) must fit
    lora_r: int = 16          # encoder LoRA rank; 0 = full finetuning (the paper's; needs a separate --encoder)
    lora_alpha: int = 16      # encoder LoRA scale alpha / r
    encoder: str = ""         # HF checkpoint dir of the encoder; "" = the shared base (with the LoRA adapter)
    decoder: str = ""         # HF checkpoint dir of the frozen decoder; "" = the shared base


def blockwise(z):
    """PIC eq. 5: causal everywhere (rules 1, 2), and memory t reads only chunk t (rule 3)."""
    group, lo, hi, valid = (kernels.bucketed(z[k]) for k in ("group", "lo", "hi", "valid"))

    def mask_mod(b, h, q_idx, kv_idx):
        in_chunk = (lo[b, q_idx] <= kv_idx) & (kv_idx < hi[b, q_idx])
        return valid[b, kv_idx] & (kv_idx <= q_idx) & ((group[b, q_idx] == group[b, kv_idx]) | in_chunk)
    mask_mod.__name__ = "pic_blockwise"
    return mask_mod


def causal(z):
    """PCC / ICAE: memory t reads the whole context and memory <= t."""
    group, valid = kernels.bucketed(z["group"]), kernels.bucketed(z["valid"])

    def mask_mod(b, h, q_idx, kv_idx):
        return valid[b, kv_idx] & (kv_idx <= q_idx) & ((group[b, q_idx] == group[b, kv_idx]) | (group[b, kv_idx] == 0))
    mask_mod.__name__ = "pic_causal"
    return mask_mod


def bidir(z):
    """meanpool §5.1: causal context; memory reads the whole context and all memory."""
    group, valid = kernels.bucketed(z["group"]), kernels.bucketed(z["valid"])

    def mask_mod(b, h, q_idx, kv_idx):
        mem_pair = (group[b, q_idx] > 0) & (group[b, q_idx] == group[b, kv_idx])
        return valid[b, kv_idx] & (((kv_idx <= q_idx) & (group[b, kv_idx] == 0)) | mem_pair)
    mask_mod.__name__ = "pic_bidir"
    return mask_mod


MASKS = {"blockwise": blockwise, "causal": causal, "bidir": bidir}


def layout(lengths, L, ratios, centre=False):
    """Z = [context padded to L, memory of ratios[0], of ratios[1], ..] -> (z: (B, L + sum N_g) tensors for the masks:
    group (0 the context, g + 1 the g-th ratio's memory), chunk lo .. hi - 1, valid, pos (position ids); widths
    N_g = max_b ceil(L_b / r)). One pass equals a pass per ratio: no context reads memory, no group another."""
    B, dev = lengths.shape[0], lengths.device
    i = torch.arange(L, device=dev)[None].expand(B, L)
    cols, widths = [(0 * i, 0 * i, 0 * i, i < lengths[:, None], i)], []  # context: group 0, no chunk
    for g, r in enumerate(ratios):
        n_mem = (lengths[:, None] + r - 1) // r  # (B, 1)
        t = torch.arange(max(int(n_mem.max()), 1), device=dev)[None].expand(B, -1)
        pos = torch.minimum(t * r + (r - 1) // 2, lengths[:, None] - 1) if centre else lengths[:, None] + t
        cols.append((torch.full_like(t, g + 1), t * r, ((t + 1) * r).clamp(max=L), t < n_mem, pos))
        widths.append(t.shape[1])
    return dict(zip(("group", "lo", "hi", "valid", "pos"), (torch.cat(c, 1) for c in zip(*cols)))), widths


class PIC(nn.Module):
    Config = PICConfig
    objectives = ("qa", "ae+lm", "kd")
    memory_kind = "embeds"  # what its Memory holds: prefix embeddings
    frozen_decoder = True  # the paper's decoder is frozen (the tiny base adds a LoRA: tiny.add_decoder_adapter)

    @staticmethod
    def recipe(mcfg):
        if mcfg.mem == "single":
            paper = {**TABLE6, "ratio": "4,8,16,32,64,128", "mem_pos": "after"}
            return [dict(objective="kd", cite="meanpool Table 6, §5.1", paper=paper)]
        pretrain = dict(lr=1e-4, max_iters=90_000, ratio="16")
        qa_ours = dict(lr=1e-4, max_iters=5427, batch_size=16)  # SQuAD's 86,821 once (the docstring's "Two stages")
        return [dict(objective="ae+lm", cite="§4.1.2, Fig. 7; Table 4", paper=pretrain, ours=dict(batch_size=16)),
                dict(objective="qa", cite="§4.2.1; Table 4", paper=dict(ratio="16"), ours=qa_ours)]

    # the tiny base: ae+lm, then qa at ratio 4 read at 4 and 16 (other training ratios kept less)
    TINY = dict(lr=2e-3, pretrain=100, max_iters=1100, batch_size=8, grad_accum=2, ratio="4", eval_ratio="4,16",
                mem_pos="")
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base
    full_finetuning = True  # --lora_r 0 with --encoder: the paper's fully finetuned encoder
    compresses_half_text = True  # ae+lm compresses half a text: train.py reads 2 x max_context tokens

    @staticmethod
    def check_config(cfg, mcfg):
        for flag, choices in (("mask", [*MASKS]), ("mem", ["table", "single"]), ("mem_pos", ["", "after", "centre"])):
            value = getattr(mcfg, flag)
            if value not in choices:
                raise SystemExit(f"error: --{flag} {value!r}; choose from {', '.join(filter(None, choices))}")
        if mcfg.mem == "single" and mcfg.mask == "blockwise":
            raise SystemExit("error: --mem single is meanpool §5.1's compression tokens: add --mask causal (the "
                             "conventional mask) or --mask bidir (§5.1's), not PIC's blockwise")
        if mcfg.lora_r == 0 and mcfg.mem == "single":  # (its decoder's adapter takes the same rank)
            raise SystemExit("error: --lora_r 0 with --mem single: meanpool §5.1's baseline trains rank --lora_r "
                             "adapters (Table 6: 16) in its encoder and decoder")
        if mcfg.lora_r == 0 and not mcfg.encoder:
            raise SystemExit("error: --lora_r 0 (full finetuning) needs a separate --encoder checkpoint: "
                             "the frozen decoder shares the base weights")
        if not 1 <= mcfg.max_mem <= 1 << 20:  # (10^12 rows was an out-of-memory error naming --batch_size)
            raise SystemExit(f"error: --max_mem {mcfg.max_mem} must lie in 1..2^20 (rows of the memory table)")
        for flag, ratios in (("ratio", cfg.ratio), ("eval_ratio", cfg.eval_ratio)):  # trained at, read at
            n = math.ceil(cfg.max_context / min(int(r) for r in ratios.split(","))) if ratios else 0
            if mcfg.mem == "table" and n > mcfg.max_mem:
                raise SystemExit(f"error: --max_context {cfg.max_context} at --{flag} {ratios} needs {n} memory "
                                 f"tokens > --max_mem {mcfg.max_mem}; raise --max_mem or use --mem single")

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.tok, self.run = base, cfg, tok, run
        self.centre = (cfg.mem_pos or ("centre" if cfg.mem == "single" else "after")) == "centre"  # memory ids
        # the slot holding each context token (tiny.py's aid 2): m_t holds c_t where the mask or the positions fix it
        self.token_slots = window_slots if cfg.mask == "blockwise" or self.centre else None
        dtype = base.lm_head.weight.dtype
        self.enc_model = self.dec_model = self.enc_tok = None  # separate checkpoints; the encoder's own tokenizer
        if cfg.encoder:
            self.enc_model = self.load(cfg.encoder, torch.float32 if cfg.lora_r == 0 else dtype, cfg.lora_r == 0)
            self.enc_tok = data.own_tokenizer(cfg.encoder, tok, self.enc_model.config.vocab_size)
        if cfg.decoder:
            self.dec_model = self.load(cfg.decoder, dtype, False)
            if data.own_tokenizer(cfg.decoder, tok, self.dec_model.config.vocab_size):
                raise SystemExit(f"error: --decoder {cfg.decoder} must share the base's tokenizer")
        enc, dec = self.enc, self.dec
        self.enc_adapter = "encoder" if cfg.lora_r > 0 else None
        if self.enc_adapter:
            enc.add_adapter("encoder", cfg.lora_r, cfg.lora_alpha)
        d_enc, d_dec = enc.config.hidden_size, dec.config.hidden_size
        need = run.max_context + math.ceil(run.max_context / min(int(r) for r in str(run.ratio).split(",")))
        if need > enc.config.max_position_embeddings:
            raise SystemExit(f"error: --max_context {run.max_context} plus its memory tokens needs {need} positions; "
                             f"the encoder has max_position_embeddings {enc.config.max_position_embeddings}")
        std_enc, std_dec = enc.model.embed_tokens.input_std(), dec.model.embed_tokens.input_std()
        self.mem_embed = nn.Parameter(torch.randn(1 if cfg.mem == "single" else cfg.max_mem, d_enc) * std_enc)
        self.dec_adapter = "decoder" if cfg.mem == "single" else None  # meanpool §5.1's baseline trains its decoder
        if self.dec_adapter:
            dec.add_adapter("decoder", cfg.lora_r, cfg.lora_alpha)
            self.converter = nn.Sequential(nn.Linear(d_enc, d_dec, bias=False))  # meanpool's W
            if d_enc == d_dec:
                nn.init.eye_(self.converter[0].weight)
        else:
            self.converter = nn.Sequential(nn.Linear(d_enc, d_dec), nn.GELU(), nn.Linear(d_dec, d_dec))
        self.ae = nn.Parameter(torch.randn(d_dec) * std_dec, requires_grad=run.objective == "ae+lm")  # <AE>, learned

    def load(self, path, dtype, trainable):
        model = Transformer.from_pretrained(path, dtype=dtype)
        for n, p in model.named_parameters():  # full finetuning trains all but an unused untied head
            p.requires_grad_(trainable and (n != "lm_head.weight" or model.config.tie_word_embeddings))
        return model.to(self.base.lm_head.weight.device)

    enc = property(lambda self: self.base if self.enc_model is None else self.enc_model)
    dec = property(lambda self: self.base if self.dec_model is None else self.dec_model)

    def encode(self, context, lengths, ratios):
        """One pass over Z = [context, each ratio's memory] -> per ratio (final states (B, N_g, d_enc), valid)."""
        B, L = context.shape
        z, widths = layout(lengths, L, ratios, self.centre)
        if int(z["pos"].max()) >= self.enc.config.max_position_embeddings:
            raise ValueError(f"context of {int(lengths.max())} tokens plus {max(widths)} memory tokens exceeds the "
                             f"encoder's max_position_embeddings {self.enc.config.max_position_embeddings}")
        x = self.enc.model.embed_tokens(context)  # (B, L, d_enc)
        rows = torch.cat([torch.arange(N, device=x.device) for N in widths]) * (self.cfg.mem == "table")
        m = self.mem_embed.index_select(0, rows).to(x.dtype)  # rows repeat (tiny.head_log_attention says why)
        m = m[None].expand(B, len(rows), -1)  # (B, N, d_enc)
        with self.enc.adapter(self.enc_adapter):
            h = self.enc(embeds=torch.cat([x, m], 1), pos=z["pos"], mask=MASKS[self.cfg.mask](z), output="hidden")
        return list(zip(h[:, L:].split(widths, 1), z["valid"][:, L:].split(widths, 1)))

    def encoder_context(self, batch):
        """(ids (B, L), lengths (B,)) of the context in the encoder's vocabulary (a separate --encoder's own)."""
        if self.enc_tok is None:
            return batch["context"], batch["context_len"]
        texts = [self.tok.decode(c[:n].tolist()) for c, n in zip(batch["context"], batch["context_len"])]
        rows = [self.enc_tok.encode(t)[:self.run.max_context] or [self.enc_tok.pad_id] for t in texts]
        dev = batch["context"].device
        return data.pad_rows(rows, self.enc_tok.pad_id, 1).to(dev), torch.tensor([len(r) for r in rows], device=dev)

    def compress(self, batch, ratio):
        return self.memories(batch, [ratio])[0]

    def memories(self, batch, ratios):  # a Memory per ratio, from one encoder pass
        return [behind_prefix(self.dec, batch["prefix"], self.converter(h.to(self.converter[0].weight.dtype)), valid)
                for h, valid in self.encode(*self.encoder_context(batch), ratios)]  # (B, N_g, d_dec) each

    def decode_hidden(self, memory, ids, embeds=None):  # [memory, embeds, ids] -> (B, T, d_dec)
        with self.dec.adapter(self.dec_adapter):
            return self.dec(ids, embeds=embeds, memory=memory, output="hidden")

    def forward(self, batch, ratios):
        """Training loss: (sum, count, metrics); see the docstring for what is counted."""
        if self.run.objective == "ae+lm":
            return self.ae_lm(batch, ratios)
        labels = batch["qa_labels"]
        teacher = teacher_attn = None
        if self.aid is not None:  # one teacher pass for both
            teacher, teacher_attn = self.aid.teacher(batch)
        elif self.run.objective == "kd":
            with torch.no_grad(), self.dec.adapter(None):
                teacher = self.dec(batch["full"], output="hidden")[batch["full_labels"] != -100]  # (n, d_dec)
        total, metrics = 0.0, {}
        memories = self.memories(batch, ratios)
        stack = self.aid is None and not self.dec.config.sliding_window  # the aid reads each ratio's own pass
        for r, memory, hs in zip(ratios, memories, decode_each(self.decode_hidden, memories, batch["qa"], stack)):
            if self.run.objective == "kd":
                loss, n = self.dec.kd(hs[labels != -100], teacher)
            else:
                loss, n = self.dec.ce(hs, labels)
            if teacher_attn is not None:
                loss = loss + n * self.aid.memory_loss(teacher_attn, memory, batch, r)
            total = total + loss
            metrics[f"loss_r{r}"] = loss.item() / max(n, 1)
        return total, n, metrics

    def ae_lm(self, batch, ratios):
        """Eq. 6-8 on a collate_lm batch: sum over examples of lam TC + (1 - lam) TR."""
        ids, lengths = batch["ids"], batch["lengths"].tolist()
        off = int(self.tok.bos_id is not None)  # collate_lm starts with BOS when there is one
        texts = [ids[b, off:n].tolist() for b, n in enumerate(lengths)]
        ks = [max(1, len(x) // 2) for x in texts]  # x_1 .. x_k is compressed
        dev = ids.device
        def rows(cut, value=self.tok.pad_id):  # (B, T): one slice of every text, right-padded
            return data.pad_rows([cut(x, k) for x, k in zip(texts, ks)], value, 1).to(dev)
        def per_example(labels, counts):  # eq. 6-7 are means per example: weight 1 / count
            return (1.0 / torch.tensor(counts, device=dev).clamp(min=1))[:, None].expand(labels.shape)
        ctx = {"context": rows(lambda x, k: x[:k]), "context_len": torch.tensor(ks, device=dev),
               "prefix": ids[0, :off].tolist()}
        tr_in, tr_lab = rows(lambda x, k: x[:k - 1]), rows(lambda x, k: x[:k], -100)  # [<AE>, x_<k] -> x_1..x_k
        tc_in, tc_lab = rows(lambda x, k: x[k - 1:-1]), rows(lambda x, k: x[k:], -100)  # x_k..x_{L-1} -> x_{k+1}..x_L
        tr_w, tc_w = per_example(tr_lab, ks), per_example(tc_lab, [len(x) - k for x, k in zip(texts, ks)])
        ae = self.ae.to(self.dec.lm_head.weight.dtype)[None, None].expand(len(texts), 1, -1)  # (B, 1, d_dec)
        total, metrics = 0.0, {}
        for r, memory in zip(ratios, self.memories(ctx, ratios)):
            h_tr = self.decode_hidden(memory, tr_in, embeds=ae)[:, :tr_lab.shape[1]]  # (B, 1 + T_tr, d_dec)
            tr, _ = self.dec.ce(h_tr, tr_lab, tr_w)  # sum over examples of eq. 6
            tc, _ = self.dec.ce(self.decode_hidden(memory, tc_in), tc_lab, tc_w)  # eq. 7
            total = total + LAMBDA * tc + (1 - LAMBDA) * tr  # eq. 8
            metrics.update({f"tr_r{r}": tr.item() / len(texts), f"tc_r{r}": tc.item() / len(texts)})
        return total, len(texts), metrics


def main():
    """Print the three masks over Z = [2 chunks of 3 context tokens, m_1, m_2]: rows are queries, columns keys."""
    z, _ = layout(torch.tensor([6]), 6, [3])
    for name, mask_mod in MASKS.items():
        print(f"--mask {name}:\n{kernels.draw(mask_mod(z), 8)}\n")


if __name__ == "__main__":
    main()
