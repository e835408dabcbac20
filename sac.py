"""Semantic-Anchor Compression (SAC): anchor tokens of the context itself carry the memory.

Paper: "Semantic-Anchor Compression" (../shared/papers/sac_semantic_anchor.txt), §3.2,
§4.1, Tables 3-6, Appendix A.

    sub-contexts  C = C_0 C_1 ...   510 tokens each (last one partial), compressed separately
    anchors       |S_j| = max(1, floor(L_j / r)) per sub-context            (§4.1)
                  "middle": split C_j into |S_j| chunks, take each chunk's middle token
    embeddings    e_i = Emb(c_i) + 1[c_i in S] * e_A                        (eq. 1)
    encoder       M~ = LLM(E | theta_LoRA)   base + `encoder` LoRA, bidirectional attention
    memory        per-layer K/V of the anchor tokens only, at their original positions
                  (after the frozen base's K/V of the BOS prefix, see below)
    decoder       the frozen base continues after the memory:
                  L_LM = -log P(C' | M~)      (pretraining, `--objective lm`, §3.1)
                  L_QA = -log P(A | M~, Q)    (finetuning, `--objective qa`, the default)

Choices the paper leaves open, made here:
- Chunks of a sub-context of n tokens split into k = |S| parts: chunk t = [s, e) with
  s = t*n // k, e = (t+1)*n // k (sizes differ by at most one); its middle is s + (e - s) // 2
  (the right one of two middles). A sub-context shorter than r still gets one anchor.
- The sequence prefix (BOS; `batch["prefix"]`) leads every sub-context in the encoder (its
  attention sink), but the memory's P prefix slots hold the frozen base's own causal K/V of
  the prefix, a constant that a plain decoder has too, not a learned summary slot (the
  paper's memory is anchors only). They are counted in the achieved ratio L / (P + |S|);
  `memory.stats["anchor_ratio"]` is L / |S|. The frozen decoder thus sees BOS where it
  always did: with r = 1, a causal encoder and no adapter, SAC is the teacher.
- Positions: prefix 0..P-1, token i of sub-context j at P + 510*j + i in the encoder, so the
  concatenated memory reads as one subsampled cache; the decoder continues at P + L. Inside
  sub-context j > 0 the encoder thus sees a position gap between the prefix and its tokens.
- The encoder LoRA covers every linear layer but the last layer's q, o and MLP, which
  cannot reach the memory (it is the K/V of every layer, not a final hidden state).
- e_A starts at zero (and LoRA B at zero), so training starts from the base's own cache.
- `lm` on `collate_lm` batches: the text after the prefix is cut in half (Appendix A: "split
  into two halves"; the AE half is the compressed one); the decoder reads the second half
  and predicts each next token (its first token is input only); texts are cut at 2 x
  max_context so the compressed half reaches max_context. No `ae+lm` (Table 5): skipped.
  On the tiny base, qa after 300 lm steps scores F1 6.2 at 4.9x (20 from scratch): a synthetic
  text's second half rarely needs its first, so the decoder learns to ignore the memory.
- Several ratios in `--ratio`: one encoder pass per ratio (anchors differ), losses summed.
- Hyperparameters (Table 6): LoRA r 128, alpha 256; AdamW (0.9, 0.95), wd 0.1, clip 2.0,
  batch 16, 20k steps, constant lr after 300 warmup steps: 5e-5 finetuning (PAPER default,
  objective qa); for pretraining pass `--objective lm --lr 1e-4`. One model per ratio
  (§4.1: r in {5, 15, 51}): PAPER trains r = 5; pass `--ratio 15` or `--ratio 51` for the others.
On the tiny base, tiny.py's aids apply (curriculum, attention distillation with a token
held by its nearest anchor, `qa` only; several QA pairs per context; a LoRA decoder).
Ablations: `--causal` (Table 3 "w/o mask"), `--no_anchor_embedding` ("w/o anchor"),
`--anchors random` (Table 4 "Random").
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

import kernels
from model import Memory


@dataclass
class SACConfig:
    sub_len: int = 510                 # sub-context length, each compressed separately (§4.1)
    anchors: str = "middle"            # middle | random: anchor selection (Table 4)
    causal: bool = False               # Table 3 "w/o mask": causal encoder instead of bidirectional
    no_anchor_embedding: bool = False  # Table 3 "w/o anchor": no e_A (eq. 1)
    lora_r: int = 128                  # encoder LoRA (§4.1)
    lora_alpha: int = 256


# -----------------------------------------------------------------------------
# anchor selection: (n tokens of a sub-context, k anchors) -> k sorted indices in [0, n)


def middle_anchors(n, k):
    """k chunks [t*n//k, (t+1)*n//k); the middle of [s, e) is s + (e - s) // 2."""
    t = torch.arange(k)
    s, e = t * n // k, (t + 1) * n // k
    return s + (e - s) // 2


def random_anchors(n, k):
    return torch.randperm(n)[:k].sort().values


ANCHORS = {"middle": middle_anchors, "random": random_anchors}


def anchor_positions(L, r, sub_len=510, select=middle_anchors):
    """Context indices of the anchors of a context of L tokens: sub-context j holds tokens
    [sub_len*j, sub_len*(j+1)) and gets max(1, floor(n_j / r)) anchors."""
    out = [sub_len * j + select(n, max(1, n // r)) for j, n in
           ((j, min(sub_len, L - sub_len * j)) for j in range(-(-L // sub_len)))]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


# -----------------------------------------------------------------------------
# the encoder's attention (one sub-context per row)


def sac_encoder_mask(key_valid, causal):
    """Every token of a sub-context sees every real token of it (bidirectional, §3.2), or
    only the ones before it (`--causal`); padding is never seen."""
    def mask_mod(b, h, q_idx, kv_idx):
        sees = key_valid[b, kv_idx] & (q_idx >= 0)
        return sees & (kv_idx <= q_idx) if causal else sees
    mask_mod.__name__ = "sac_causal" if causal else "sac_bidirectional"
    return mask_mod


class SAC(nn.Module):
    Config = SACConfig
    objectives = ("qa", "lm")
    compresses_half_text = True  # lm compresses the first half: train.py reads 2 x max_context tokens
    PAPER = dict(ratio="5", lr=5e-5, weight_decay=0.1, grad_clip=2.0, batch_size=16, max_iters=20000,
                 warmup_iters=300, min_lr_frac=1.0)
    TINY = dict(lr=1e-3, max_iters=800, warmup_iters=4, batch_size=16, lora_r=64, lora_alpha=128)
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base
    dec_adapter = None  # the decoder is the frozen base (a LoRA on the tiny base: tiny.add_decoder_adapter)

    @staticmethod
    def check_config(cfg, mcfg):
        if mcfg.anchors not in ANCHORS:
            raise SystemExit(f"error: --anchors {mcfg.anchors!r}; choose from {', '.join(ANCHORS)}")
        if mcfg.sub_len < 1:
            raise SystemExit(f"error: --sub_len {mcfg.sub_len} must be a positive number of tokens")

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.run = base, cfg, run
        self.pad_id = tok.pad_id if tok.pad_id is not None else 0
        self.n_prefix = int(tok.bos_id is not None)  # collate_lm rows start with [bos]
        base.add_adapter("encoder", cfg.lora_r, cfg.lora_alpha)
        last = base.model.layers[-1]  # the memory is K/V: the last layer's q, o and MLP never reach it
        for mod in (last.self_attn.q_proj, last.self_attn.o_proj, *last.mlp.children()):
            del mod.lora_A["encoder"], mod.lora_B["encoder"]  # (no dead parameters; DDP needs none)
        self.anchor_emb = None if cfg.no_anchor_embedding else nn.Parameter(torch.zeros(base.config.hidden_size))

    def compress(self, batch, ratio):
        """Memory: the frozen base's K/V of the prefix, then the anchors' K/V from the encoder:
        (B, Hkv, C, hd) per layer, C = P + max anchors."""
        ctx, lengths, dev = batch["context"], batch["context_len"], batch["context"].device
        prefix = batch["prefix"]
        if not torch.is_tensor(prefix):  # collate_qa: one shared list
            prefix = torch.tensor(prefix, dtype=torch.long, device=dev).view(1, -1).expand(len(ctx), -1)
        B, P, sub = len(ctx), prefix.shape[1], self.cfg.sub_len
        L = int(lengths.max())
        W = max(1, min(sub, L))  # sub-context width: sub_len, or the whole context when shorter
        J = -(-max(L, 1) // W)
        ctx = nn.functional.pad(ctx[:, :L], (0, J * W - L), value=self.pad_id)
        n_tok = (lengths[:, None] - W * torch.arange(J, device=dev)).clamp(0, W)  # (B, J)
        keep = n_tok > 0
        keep[:, 0] = True  # an empty context keeps one (padding) row: the encoder batch is never empty
        b_of, j_of = keep.nonzero(as_tuple=True)  # (N,) one encoder row per sub-context
        row_of = keep.flatten().long().cumsum(0).view(B, J) - 1  # (B, J) -> row
        ids = torch.cat([prefix[b_of], ctx.view(B, J, W)[b_of, j_of]], 1)  # (N, P + W)
        T = P + W
        ar = torch.arange(T, device=dev)
        valid = ar[None] < P + n_tok[b_of, j_of][:, None]  # (N, P + W)
        pos = torch.where(ar < P, ar, ar + W * j_of[:, None])  # (N, P + W): P + W*j + i
        # anchor slots as flat indices into the (N * T) encoder tokens
        select, anchor_at, anchors = ANCHORS[self.cfg.anchors], [], []
        for b, n in enumerate(lengths.tolist()):
            g = anchor_positions(n, ratio, W, select).to(dev)  # context indices
            anchors.append(g)
            anchor_at.append(row_of[b, g // W] * T + P + g % W)
        A = max(len(a) for a in anchor_at)
        flat = torch.zeros(B, A, dtype=torch.long, device=dev)
        mask = torch.zeros(B, P + A, dtype=torch.bool, device=dev)
        mask[:, :P] = True
        for b, a in enumerate(anchor_at):
            flat[b, :len(a)], mask[b, P:P + len(a)] = a, True
        is_anchor = torch.zeros(len(ids) * T, dtype=torch.bool, device=dev)
        is_anchor[torch.cat(anchor_at)] = True
        e = self.base.model.embed_tokens(ids)  # (N, T, d)
        if self.anchor_emb is not None:  # eq. 1
            e = e + is_anchor.view(-1, T, 1) * self.anchor_emb.to(e.dtype)
        with self.base.adapter("encoder"):
            _, kv = self.base(embeds=e, pos=pos, mask=sac_encoder_mask(valid, self.cfg.causal), return_kv=True,
                              output="hidden")
        if P:  # the prefix slots: the frozen base, causal, positions 0..P-1 (a constant, as in any decoder)
            with torch.no_grad(), self.base.adapter(None):
                _, prefix_kv = self.base(prefix, return_kv=True, output="hidden")  # (B, Hkv, P, hd) per layer
        mem = []
        for i, (k, v) in enumerate(kv):  # (N, Hkv, T, hd) -> (N*T, Hkv, hd) -> (B, A, Hkv, hd) -> (B, Hkv, A, hd)
            k, v = (x.transpose(1, 2).flatten(0, 1)[flat].transpose(1, 2) for x in (k, v))
            if P:
                k, v = torch.cat([prefix_kv[i][0], k], 2), torch.cat([prefix_kv[i][1], v], 2)
            mem.append((k, v))
        memory = Memory(kv=mem, mask=mask, next_pos=P + lengths)
        memory.stats = {"anchor_ratio": [n / max(len(a), 1) for n, a in zip(lengths.tolist(), anchor_at)]}
        memory.anchors = anchors  # context indices, per example
        return memory

    def split_lm(self, batch):
        """collate_lm batch -> {prefix, context (first half of the text), qa (second half),
        qa_labels (its next tokens)}, all (B, .) and right-padded."""
        ids, labels, n = batch["ids"], batch["labels"], batch["lengths"]
        P, T, ar = self.n_prefix, ids.shape[1], torch.arange(ids.shape[1], device=ids.device)
        m = (n - P) // 2  # context tokens
        Lc, Td = max(1, int(m.max())), max(1, int((n - P - m).max()))
        ctx = ids.gather(1, (P + ar[:Lc]).clamp(max=T - 1).expand(len(ids), -1))
        dec_idx = (P + m[:, None] + ar[:Td]).clamp(max=T - 1)  # (B, Td)
        dec_valid = ar[:Td] < (n - P - m)[:, None]
        return {"prefix": ids[:, :P], "context": ctx.masked_fill(ar[:Lc] >= m[:, None], self.pad_id),
                "context_len": m, "qa": ids.gather(1, dec_idx).masked_fill(~dec_valid, self.pad_id),
                "qa_labels": labels.gather(1, dec_idx).masked_fill(~dec_valid, -100)}

    def decode_hidden(self, memory, batch):
        with self.base.adapter(self.dec_adapter):
            return self.base(batch["qa"], memory=memory, output="hidden")  # (B, T, d)

    def forward(self, batch, ratios):
        """Training loss: (sum over target tokens and ratios, n target tokens, metrics)."""
        if self.run.objective == "lm":
            batch = self.split_lm(batch)
        teacher_attn = self.aid.teacher(batch)[1] if self.aid is not None and "full" in batch else None
        total, metrics = 0.0, {}
        for r in ratios:
            memory = self.compress(batch, r)
            h = self.decode_hidden(memory, batch)
            loss, n = self.base.ce(h, batch["qa_labels"])
            if teacher_attn is not None:
                loss = loss + n * self.aid.memory_loss(teacher_attn, memory, batch, r)
            total = total + loss
            metrics[f"loss_r{r}"] = loss.item() / max(n, 1)
        return total, n, metrics

    @torch.no_grad()
    def answer_from_memory(self, memory, prompts, max_new_tokens):
        with self.base.adapter(self.dec_adapter):
            return self.base.generate(prompts, max_new_tokens, memory=memory)


def main():
    """Print the anchor layout and the encoder masks for a toy context."""
    L, r, sub, P = 22, 4, 12, 1
    g = anchor_positions(L, r, sub)
    print(f"SAC layout: L={L}, r={r}, sub_len={sub}; '#' = anchor (kept as K/V), '.' = dropped, "
          "'|' = sub-context border")
    row = "".join("#" if i in g.tolist() else "." for i in range(L))
    print("|".join(row[j:j + sub] for j in range(0, L, sub)), f"  anchors {g.tolist()}")
    print(f"\nencoder attention over one sub-context: 1 BOS + {L - sub} tokens + {2 * sub - L} padding")
    valid = torch.arange(P + sub)[None] < P + L - sub
    for causal in (False, True):
        print("causal (--causal):" if causal else "bidirectional (default):")
        print(kernels.draw(sac_encoder_mask(valid, causal), P + sub))


if __name__ == "__main__":
    main()
