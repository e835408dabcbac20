"""Semantic-Anchor Compression (SAC): anchor tokens of the context itself carry the memory.

Paper: "Autoencoding-Free Context Compression for LLMs via Contextual Semantic Anchors"
(../shared/papers/sac_semantic_anchor.txt), §3.2, §4.1, Tables 3-6, App. A.

    sub-contexts  C = C_0 C_1 ...   510 tokens each (last one partial), compressed separately
    anchors       |S_j| = floor(L_j / r) per sub-context (§4.1); max(1, .) here: a short one keeps one
                  "middle": split C_j into |S_j| chunks, take each chunk's middle token
    embeddings    e_i = Emb(c_i) + 1[c_i in S] * e_A                        (eq. 1)
    encoder       M~ = LLM(E | theta_LoRA)   base + `encoder` LoRA, bidirectional attention
    memory        per-layer K/V of the anchor tokens only, at their original positions P + 510*j + i (ours)
    decoder       the frozen base continues after the memory, at P + L:
                  L_LM = -log P(C' | M~)      (pretraining, `--objective lm`, §3.1)
                  L_QA = -log P(A | M~, Q)    (finetuning, `--objective qa`, the default)

Choices, each marked paper, official code (the authors' public repository, where the paper is silent) or ours:
- Anchors (paper): the middles of |S| equal chunks: the official code's h, h + r, ... (h = (r - 1) // 2) on a full
  sub-context at odd r, not on a partial one (23 tokens at r = 5: 2, 8, 14, 20; the official code: 2, 7, 12, 17, 22).
- Anchor embedding: `--anchor_emb one`, eq. 1's e_A (paper); `table`, row k to every sub-context's anchor k (official).
- Encoder LoRA: `--lora_targets` q_proj,v_proj on a real checkpoint (official; the paper gives only r 128, alpha 256),
  all seven on the tiny base (ours); none on the last layer's q, o and MLP (ours): they cannot reach the K/V memory.
  No LoRA dropout (the paper names none).
- Start (ours): e_A and LoRA B are zero (the table is N(0, 0.02)): the base's K/V of the anchors, read bidirectionally.
- Prefix (ours; BOS, a chat header): it leads every sub-context in the encoder; the memory's first P slots are the
  frozen base's causal K/V of it, so r = 1, a causal encoder and no adapter give the teacher on a context of one
  sub-context (L <= 510: a later one does not see those before it). Ratio L / (P + |S|).
- `--prompt sac`, the official form (data.format_qa): no prefix slots, a learned [LM] at position L before the Q.
- Context length: any (official code): a real checkpoint's --max_context is 2^20 (ours), the tiny base's 1024.
- `lm`: L_LM alone (paper, §3.2, Table 5; the official config averages AE and LM) on texts of at most 2,040 tokens
  (App. A: SlimPajama, 510 to 2,040; here --pretrain_data, else the QA contexts, shorter ones kept, longer ones cut),
  each cut in half (App. A's halves, read as ICAE's: C, then C'). C'_1 is the decoder's first input (ours: a K/V
  memory has no position to predict it from), its targets the tokens after it.
- Recipe (§4.1, Table 6; `recipe`): `lm`, then `qa`, at r = 5; `--ratio 15` or `--ratio 51` for the paper's others.
- Scores: eval.py's SQuAD EM / F1 for every method (SPEC §4); Tables 1-2 report ROUGE-1 F1, without SQuAD's article
  and punctuation normalisation ("the Eiffel Tower" against "Eiffel Tower": F1 1.0, ROUGE-1 0.8).
- Tiny base: `qa` alone (no `lm` stage; `--pretrain N` runs it), tiny.py's aids (curriculum, `qa` attention
  distillation onto the nearest anchor, several QA pairs per context, a LoRA decoder); the r = 5 model is also read
  at 15 (`--eval_ratio 5,15`): it beats one trained at 15.
Ablations: `--causal` (Table 3 "w/o mask"), `--no_anchor_embedding` ("w/o anchor"), `--anchors random` (Table 4
"Random"). Not here: Table 4's LLMLingua-2 anchors, Table 5's AE-only and AE+LM pretraining, the paper's baselines
(500xCompressor, ICAE, EPL; cf. pic.py `--mem single --mem_pos centre`).
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

import kernels
from model import LORA_TARGETS, Memory, behind_prefix_kv


@dataclass
class SACConfig:
    sub_len: int = 510                 # sub-context length, each compressed separately (§4.1)
    anchors: str = "middle"            # middle | random: anchor selection (Table 4)
    causal: bool = False               # Table 3 "w/o mask": causal encoder instead of bidirectional
    no_anchor_embedding: bool = False  # Table 3 "w/o anchor": no e_A (eq. 1)
    lora_r: int = 128                  # encoder LoRA (§4.1)
    lora_alpha: int = 256
    lora_targets: str = "all"          # all: the seven projections (ours) | q_proj,v_proj (official code) | a list
    anchor_emb: str = "one"            # one: eq. 1's e_A (paper) | table: row k to a sub-context's anchor k (official)


def middle_anchors(n, k):
    """k sorted anchors of n tokens: chunks [t*n//k, (t+1)*n//k); the middle of [s, e) is s + (e - s) // 2."""
    t = torch.arange(k)
    s, e = t * n // k, (t + 1) * n // k
    return s + (e - s) // 2


def random_anchors(n, k):
    return torch.randperm(n)[:k].sort().values


ANCHORS = {"middle": middle_anchors, "random": random_anchors}


def anchor_positions(L, r, sub_len=510, select=middle_anchors):
    """Context indices of L tokens' anchors: sub-context j, tokens [sub_len*j, sub_len*(j+1)), gets max(1, n_j // r)."""
    sizes = [(s, min(sub_len, L - s)) for s in range(0, L, sub_len)]  # (start, n) per sub-context
    out = [s + select(n, max(1, n // r)) for s, n in sizes]
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def sac_encoder_mask(key_valid, causal):
    """A sub-context's token sees its every real token (§3.2), or those before it (`--causal`)."""
    mask = kernels.bidirectional(key_valid)
    return kernels.and_masks(mask, kernels.causal) if causal else mask


def anchor_slots(batch, memory, r):
    """(B, L) the memory slot holding each context token: its nearest anchor (after the prefix's P slots)."""
    P, i = torch.as_tensor(batch["prefix"]).shape[-1], torch.arange(batch["context"].shape[1])
    return torch.stack([P + (i.to(g.device)[:, None] - g[None]).abs().argmin(1) for g in memory.anchors])


class SAC(nn.Module):
    Config = SACConfig
    objectives = ("qa", "lm")
    memory_kind = "kv"  # what its Memory holds: per-layer K/V
    compresses_half_text = True  # lm compresses the first half: train.py reads 2 x max_context tokens
    TINY = dict(lr=1e-3, max_iters=800, warmup_iters=4, batch_size=16, grad_accum=2, lora_r=64, lora_alpha=128,
                eval_ratio="5,15", lora_targets="all", max_context=1024)
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base
    dec_adapter = None  # the decoder is the frozen base (a LoRA on the tiny base: tiny.add_decoder_adapter)
    frozen_decoder = True
    token_slots = staticmethod(anchor_slots)  # the slot holding each context token (tiny.py's aid 2 reads it)

    @staticmethod
    def recipe(mcfg):  # §4.1, Table 6: L_LM pretraining (§3.2), then QA, each 20k steps; constant lr after warmup
        both = dict(ratio="5", max_iters=20_000, batch_size=16, warmup_iters=300, min_lr_frac=1.0, weight_decay=0.1,
                    grad_clip=2.0, lora_r=128, lora_alpha=256, sub_len=510)
        official, ours = dict(lora_targets="q_proj,v_proj"), dict(max_context=1 << 20)  # the whole context
        texts = dict(max_context=1020)  # App. A: texts of up to 2,040 tokens, C their first half
        return [dict(objective=objective, cite=cite, paper={**both, "lr": lr, **more}, official=official, ours=ours)
                for objective, cite, lr, more in (("lm", "§3.2, §4.1, Table 6, App. A", 1e-4, texts),
                                                  ("qa", "§4.1, Table 6", 5e-5, {}))]

    @staticmethod
    def check_config(cfg, mcfg):
        if mcfg.anchors not in ANCHORS:
            raise SystemExit(f"error: --anchors {mcfg.anchors!r}; choose from {', '.join(ANCHORS)}")
        longest = max(cfg.max_context, SACConfig.sub_len)  # (a longer one: the whole context)
        if not 1 <= mcfg.sub_len <= longest:
            raise SystemExit(f"error: --sub_len {mcfg.sub_len} must lie in 1..{longest} tokens (--max_context)")
        if mcfg.anchor_emb not in ("one", "table"):
            raise SystemExit(f"error: --anchor_emb {mcfg.anchor_emb!r}; choose one (eq. 1) or table (official code)")
        if mcfg.no_anchor_embedding and mcfg.anchor_emb != "one":
            raise SystemExit("error: --anchor_emb table and --no_anchor_embedding: the ablation has no anchor rows")
        targets = mcfg.lora_targets.split(",")
        if mcfg.lora_targets != "all" and not (set(targets) <= set(LORA_TARGETS) and len(set(targets)) == len(targets)):
            raise SystemExit(f"error: --lora_targets {mcfg.lora_targets!r}: all, or a comma list of "
                             f"{', '.join(LORA_TARGETS)}, each once")

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.run = base, cfg, run
        self.pad_id = tok.pad_id if tok.pad_id is not None else 0
        self.n_prefix = int(tok.bos_id is not None and run.prompt != "sac")  # collate_lm rows start with [bos]
        targets = LORA_TARGETS if cfg.lora_targets == "all" else tuple(cfg.lora_targets.split(","))
        # the memory is K/V: the last layer's q, o and MLP never reach it (no dead parameters; DDP needs none)
        last = f"model.layers.{base.config.num_hidden_layers - 1}."
        unread = {last + p for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                     "mlp.down_proj")}
        base.add_adapter("encoder", cfg.lora_r, cfg.lora_alpha, targets=targets, skip=unread)
        d, r_min = base.config.hidden_size, min(int(r) for r in f"{run.ratio},{run.eval_ratio}".strip(",").split(","))
        self.anchor_emb = None if cfg.no_anchor_embedding else nn.Parameter(  # e_A (d,), or a row per anchor slot
            torch.zeros(d) if cfg.anchor_emb == "one" else torch.randn(max(1, cfg.sub_len // r_min), d) * 0.02)
        std = base.model.embed_tokens.input_std()  # --prompt sac: the official decoder's learned [LM] before Q
        self.lm_token = nn.Parameter(torch.randn(1, 1, d) * std) if run.prompt == "sac" else None

    def compress(self, batch, ratio):
        """Memory: the frozen base's K/V of the prefix, then the anchors' from the encoder: (B, Hkv, P + A, hd)."""
        ctx, lengths, prefix, dev = batch["context"], batch["context_len"], batch["prefix"], batch["context"].device
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
        anchors = [anchor_positions(n, ratio, W, ANCHORS[self.cfg.anchors]).to(dev) for n in lengths.tolist()]
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
            if per_sub > len(self.anchor_emb):  # sized at the run's smallest ratio
                raise ValueError(f"--anchor_emb table holds {len(self.anchor_emb)} rows, a sub-context's anchors at "
                                 f"the run's smallest ratio; ratio {ratio} needs {per_sub}")
            rows = torch.cat([torch.arange(len(g), device=dev) - g // W * per_sub for g in anchors])
            add = torch.zeros(len(ids) * T, e.shape[-1], dtype=e.dtype, device=dev)
            add[torch.cat(anchor_at)] = self.anchor_emb.to(e.dtype).index_select(0, rows)
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
        memory.stats = {"anchor_ratio": [n / max(c, 1) for n, c in zip(lengths.tolist(), counts)]}  # L / |S|
        memory.anchors = anchors
        return memory

    def split_lm(self, batch):
        """collate_lm batch -> {prefix, context: the text's first half, qa: its second, qa_labels}, right-padded."""
        ids, labels, n = batch["ids"], batch["labels"], batch["lengths"]
        P, T, ar = self.n_prefix, ids.shape[1], torch.arange(ids.shape[1], device=ids.device)
        m = (n - P) // 2  # context tokens
        Lc, Td = max(1, int(m.max())), max(1, int((n - P - m).max()))
        ctx = ids.gather(1, (P + ar[:Lc]).clamp(max=T - 1).expand(len(ids), -1))
        dec_idx = (P + m[:, None] + ar[:Td]).clamp(max=T - 1)  # (B, Td)
        dec_valid = ar[:Td] < (n - P - m)[:, None]
        return {"prefix": ids[:, :P], "context": ctx.masked_fill(ar[:Lc] >= m[:, None], self.pad_id), "context_len": m,
                "qa": ids.gather(1, dec_idx).masked_fill(~dec_valid, self.pad_id),
                "qa_labels": labels.gather(1, dec_idx).masked_fill(~dec_valid, -100)}

    def decode_hidden(self, memory, batch):
        with self.base.adapter(self.dec_adapter):
            return self.base(batch["qa"], memory=memory, output="hidden")  # (B, T, d)

    def forward(self, batch, ratios):
        """Training loss: (sum over target tokens and ratios, one encoder pass each, n target tokens, metrics)."""
        if self.run.objective == "lm":
            batch = self.split_lm(batch)
        teacher_attn = self.aid.teacher(batch)[1] if self.aid is not None and "full" in batch else None
        total, metrics = 0.0, {}
        for r in ratios:
            memory = self.compress(batch, r)
            loss, n = self.base.ce(self.decode_hidden(memory, batch), batch["qa_labels"])
            if teacher_attn is not None:
                loss = loss + n * self.aid.memory_loss(teacher_attn, memory, batch, r)
            total = total + loss
            metrics[f"loss_r{r}"] = loss.item() / max(n, 1)
        return total, n, metrics


def main():
    """Print the anchor layout ('#' anchor, kept as K/V; '.' dropped; '|' sub-context border) and the encoder masks."""
    L, r, sub, P = 22, 4, 12, 1
    g = anchor_positions(L, r, sub).tolist()
    row = "".join("#" if i in g else "." for i in range(L))
    print(f"SAC layout, L={L}, r={r}, sub_len={sub}:", "|".join(row[j:j + sub] for j in range(0, L, sub)), g)
    valid = torch.arange(P + sub)[None] < P + L - sub
    for causal in (False, True):
        print(f"\nencoder mask, --causal {causal}, last sub-context: 1 BOS + {L - sub} tokens + {2 * sub - L} padding")
        print(kernels.draw(sac_encoder_mask(valid, causal), P + sub))


if __name__ == "__main__":
    main()
