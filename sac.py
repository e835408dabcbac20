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

Choices, each marked paper, official code (the authors' public repository, where the paper is silent) or ours:
- Anchors (paper): chunk t of a sub-context of n tokens with k = |S| = max(1, floor(n / r)) anchors is
  [t*n // k, (t+1)*n // k), its middle s + (e - s) // 2. On a full 510-token sub-context at r = 5, 15, 51 this
  is the official code's h, h + r, ... (h = (r - 1) // 2); on a partial one the official code takes those too,
  ceil((n - h) / r) of them (23 tokens at r = 5: 2, 7, 12, 17, 22), the paper's |S| four middles: 2, 8, 14, 20.
- Anchor embedding: eq. 1's one e_A, zero at start (paper; `--anchor_emb one`), or the official code's table,
  row k added to the k-th anchor of every sub-context, N(0, 0.02) at start (`--anchor_emb table`).
- Encoder LoRA targets: the official code's q_proj and v_proj on a real checkpoint (the paper gives only r 128,
  alpha 256); all seven projections on the tiny base (ours; `--lora_targets all`).
- Context length: the official code compresses any length; a real checkpoint's --max_context is 2^20 (ours: the
  whole context), the tiny base's 1024; train.py says how many tokens a cut dropped.
- Decoder entry (ours): the sequence prefix (BOS, a chat header; `batch["prefix"]`) leads every sub-context in
  the encoder, and the memory's P prefix slots hold the frozen base's own causal K/V of it, so with r = 1, a
  causal encoder and no adapter, SAC is the teacher; then our QA prompt at P + L. The official code's form is
  `--prompt sac`: BOS only as context token 0 after which "### Context:\n", no prefix slots, a learned [LM] at
  position L, then "### Question:" / "### Answer:" text (data.format_qa). The achieved ratio is
  L / (P + |S|); `memory.stats["anchor_ratio"]` is L / |S|.
- Pretraining (paper): L_LM alone (§3.2, Table 5); the official config averages AE and LM.
- Positions: prefix 0..P-1, token i of sub-context j at P + 510*j + i in the encoder, so the
  concatenated memory reads as one subsampled cache; the decoder continues at P + L.
- The encoder LoRA skips the last layer's q, o and MLP (ours): they cannot reach the memory (K/V).
- e_A starts at zero (and LoRA B at zero), so training starts from the base's own cache.
- `lm` on `collate_lm` batches: the text after the prefix is cut in half (Appendix A); the
  decoder reads the second half and predicts each next token from the memory of the first;
  texts are cut at 2 x max_context. No `ae+lm` (Table 5).
- Several ratios in `--ratio`: one encoder pass per ratio (anchors differ), losses summed.
- Recipe (§4.1, Table 6; `recipe`): `lm` pretraining at lr 1e-4, then `qa` at 5e-5, each 20k steps of batch 16,
  constant lr after 300 warmup steps; LoRA r 128, alpha 256; AdamW (0.9, 0.95), wd 0.1, clip 2.0. One model
  per ratio (§4.1: r in {5, 15, 51}): the recipe trains r = 5; pass `--ratio 15` or `--ratio 51` for the others.
On the tiny base, tiny.py's aids apply (curriculum, attention distillation with a token
held by its nearest anchor, `qa` only; several QA pairs per context; a LoRA decoder), and the
r = 5 model is also read at r = 15 (`--eval_ratio 5,15`), which keeps more of the teacher's gain
there than 800 steps trained at r = 15 do.
Ablations: `--causal` (Table 3 "w/o mask"), `--no_anchor_embedding` ("w/o anchor"),
`--anchors random` (Table 4 "Random"). The baselines SAC is compared with (official 500xCompressor / ICAE /
EPL: appended tokens' K/V with EPL positions kept in decoding) are not here; pic.py's `--mem single
--mem_pos centre` is an embedding memory with EPL-like positions in the encoder only, not the official EPL.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

import kernels
from model import LORA_TARGETS, Memory, behind_prefix_kv

WHOLE = 1 << 20  # --max_context of real checkpoints: the whole context, as 510-token sub-contexts (official code)


@dataclass
class SACConfig:
    sub_len: int = 510                 # sub-context length, each compressed separately (§4.1)
    anchors: str = "middle"            # middle | random: anchor selection (Table 4)
    causal: bool = False               # Table 3 "w/o mask": causal encoder instead of bidirectional
    no_anchor_embedding: bool = False  # Table 3 "w/o anchor": no e_A (eq. 1)
    lora_r: int = 128                  # encoder LoRA (§4.1)
    lora_alpha: int = 256
    lora_targets: str = "all"          # all: the seven projections (ours) | q_proj,v_proj (official code) | a list
    anchor_emb: str = "one"            # one: eq. 1's single e_A (paper) | table: row k to a sub-context's anchor k (official)


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
    sizes = [(s, min(sub_len, L - s)) for s in range(0, L, sub_len)]  # (start, n) per sub-context
    out = [s + select(n, max(1, n // r)) for s, n in sizes]
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
    memory_kind = "kv"  # what its Memory holds: per-layer K/V
    compresses_half_text = True  # lm compresses the first half: train.py reads 2 x max_context tokens
    TINY = dict(lr=1e-3, max_iters=800, warmup_iters=4, batch_size=16, grad_accum=2, lora_r=64, lora_alpha=128,
                eval_ratio="5,15", lora_targets="all", max_context=1024)

    @staticmethod
    def recipe(mcfg):  # §4.1, Table 6: L_LM pretraining (§3.2), then QA, each 20k steps; constant lr after warmup
        both = dict(ratio="5", max_iters=20_000, batch_size=16, warmup_iters=300, min_lr_frac=1.0, weight_decay=0.1,
                    grad_clip=2.0, lora_r=128, lora_alpha=256)
        official, ours = dict(lora_targets="q_proj,v_proj"), dict(max_context=WHOLE)
        return [dict(objective="lm", cite="§3.2, §4.1, Table 6", paper={**both, "lr": 1e-4}, official=official, ours=ours),
                dict(objective="qa", cite="§4.1, Table 6", paper={**both, "lr": 5e-5}, official=official, ours=ours)]
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base
    dec_adapter = None  # the decoder is the frozen base (a LoRA on the tiny base: tiny.add_decoder_adapter)

    @staticmethod
    def check_config(cfg, mcfg):
        if mcfg.anchors not in ANCHORS:
            raise SystemExit(f"error: --anchors {mcfg.anchors!r}; choose from {', '.join(ANCHORS)}")
        if mcfg.sub_len < 1:
            raise SystemExit(f"error: --sub_len {mcfg.sub_len} must be a positive number of tokens")
        if mcfg.anchor_emb not in ("one", "table"):
            raise SystemExit(f"error: --anchor_emb {mcfg.anchor_emb!r}; choose one (eq. 1) or table (official code)")
        if mcfg.lora_targets != "all" and not set(mcfg.lora_targets.split(",")) <= set(LORA_TARGETS):
            raise SystemExit(f"error: --lora_targets {mcfg.lora_targets!r}: all, or a comma list of {', '.join(LORA_TARGETS)}")

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.run = base, cfg, run
        self.pad_id = tok.pad_id if tok.pad_id is not None else 0
        self.n_prefix = int(tok.bos_id is not None and run.prompt != "sac")  # collate_lm rows start with [bos]
        targets = LORA_TARGETS if cfg.lora_targets == "all" else tuple(cfg.lora_targets.split(","))
        base.add_adapter("encoder", cfg.lora_r, cfg.lora_alpha, targets=targets)
        last = base.model.layers[-1]  # the memory is K/V: the last layer's q, o and MLP never reach it
        for mod in (last.self_attn.q_proj, last.self_attn.o_proj, *last.mlp.children()):
            if "encoder" in mod.lora_A:  # (no dead parameters; DDP needs none)
                del mod.lora_A["encoder"], mod.lora_B["encoder"]
        d, r_min = base.config.hidden_size, min(int(r) for r in f"{run.ratio},{run.eval_ratio}".strip(",").split(","))
        self.anchor_emb = None if cfg.no_anchor_embedding else nn.Parameter(  # e_A (d,), or a row per anchor slot
            torch.zeros(d) if cfg.anchor_emb == "one" else torch.randn(max(1, cfg.sub_len // r_min), d) * 0.02)
        std = base.model.embed_tokens.input_std()  # --prompt sac: the official decoder's learned [LM] before Q
        self.lm_token = nn.Parameter(torch.randn(1, 1, d) * std) if run.prompt == "sac" else None

    def compress(self, batch, ratio):
        """Memory: the frozen base's K/V of the prefix, then the anchors' K/V from the encoder:
        (B, Hkv, C, hd) per layer, C = P + max anchors."""
        ctx, lengths, dev = batch["context"], batch["context_len"], batch["context"].device
        prefix = batch["prefix"]
        if not torch.is_tensor(prefix):  # collate_qa: one shared list
            prefix = torch.tensor(prefix, dtype=torch.long, device=dev).view(1, -1).expand(len(ctx), -1)
        B, P, L = len(ctx), prefix.shape[1], int(lengths.max())
        W = max(1, min(self.cfg.sub_len, L))  # sub-context width: sub_len, or the whole context when shorter
        J, T = -(-max(L, 1) // W), P + W
        ctx = nn.functional.pad(ctx[:, :L], (0, J * W - L), value=self.pad_id)
        n_tok = (lengths[:, None] - W * torch.arange(J, device=dev)).clamp(0, W)  # (B, J)
        keep = n_tok > 0
        keep[:, 0] = True  # an empty context keeps one (padding) row: the encoder batch is never empty
        b_of, j_of = keep.nonzero(as_tuple=True)  # (N,) one encoder row per sub-context
        row_of = keep.flatten().long().cumsum(0).view(B, J) - 1  # (B, J) -> row
        ids = torch.cat([prefix[b_of], ctx.view(B, J, W)[b_of, j_of]], 1)  # (N, T)
        ar = torch.arange(T, device=dev)
        valid = ar[None] < P + n_tok[b_of, j_of][:, None]  # (N, T)
        pos = torch.where(ar < P, ar, ar + W * j_of[:, None])  # (N, T): P + W*j + i
        select = ANCHORS[self.cfg.anchors]
        anchors = [anchor_positions(n, ratio, W, select).to(dev) for n in lengths.tolist()]  # context indices
        anchor_at = [row_of[b, g // W] * T + P + g % W for b, g in enumerate(anchors)]  # into the N * T tokens
        flat = nn.utils.rnn.pad_sequence(anchor_at, batch_first=True)  # (B, A), zero-padded
        counts = [len(g) for g in anchors]
        is_kept = torch.arange(flat.shape[1], device=dev)[None] < torch.tensor(counts, device=dev)[:, None]
        e = self.base.model.embed_tokens(ids)  # (N, T, d)
        if self.anchor_emb is not None and self.anchor_emb.dim() == 1:  # eq. 1: one e_A
            is_anchor = torch.zeros(len(ids) * T, dtype=torch.bool, device=dev)
            is_anchor[torch.cat(anchor_at)] = True
            e = e + is_anchor.view(-1, T, 1) * self.anchor_emb.to(e.dtype)
        elif self.anchor_emb is not None:  # the official code's table: row k to the k-th anchor of its sub-context
            per_sub = max(1, W // ratio)  # a full sub-context's anchors (only the last one may hold fewer)
            rows = torch.cat([torch.arange(len(g), device=dev) - g // W * per_sub for g in anchors])
            add = torch.zeros(len(ids) * T, e.shape[-1], dtype=e.dtype, device=dev)
            add[torch.cat(anchor_at)] = self.anchor_emb.to(e.dtype).index_select(0, rows.clamp(max=len(self.anchor_emb) - 1))
            e = e + add.view(len(ids), T, -1)
        with self.base.adapter("encoder"):
            _, kv = self.base(embeds=e, pos=pos, mask=sac_encoder_mask(valid, self.cfg.causal), return_kv=True,
                              output="hidden")
        # (N, Hkv, T, hd) -> (N*T, Hkv, hd) -> (B, A, Hkv, hd) -> (B, Hkv, A, hd)
        pick = lambda x: x.transpose(1, 2).flatten(0, 1)[flat].transpose(1, 2)  # noqa: E731
        mem, mask = behind_prefix_kv(self.base, prefix, [(pick(k), pick(v)) for k, v in kv], is_kept)  # (B, P + A)
        memory = Memory(kv=mem, mask=mask, next_pos=P + lengths)
        if self.lm_token is not None:  # --prompt sac: the decoder reads [LM] at position L first (official code)
            with self.base.adapter(self.dec_adapter):
                _, mem = self.base(embeds=self.lm_token.to(e.dtype).expand(B, 1, -1), memory=memory, return_kv=True,
                                   output="hidden")
            memory = Memory(kv=mem, mask=nn.functional.pad(mask, (0, 1), value=True), next_pos=memory.next_pos + 1)
        memory.stats = {"anchor_ratio": [n / max(c, 1) for n, c in zip(lengths.tolist(), counts)]}
        memory.anchors = anchors
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
