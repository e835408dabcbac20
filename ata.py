"""ATACompressor: a selective encoder over <PA>-chunked context + question, an adaptive allocation controller,
and the K/V of k compression tokens as the frozen LLM's memory. Paper: "ATACompressor: Adaptive Task-Aware
Compression for Efficient Long-Context Processing in LLM" (../shared/papers/ata_compressor.txt), §3, §A,
Tables 2, 4-6, Fig. 10.

    encoder input  <QUESTION> q </QUESTION> <CONTEXT> <PA> C_1 </PA> ... </CONTEXT> <INST> ... </INST>
                   then k_max compression tokens c_1..c_kmax (learned, appended: ours)  (Fig. 10, eq. 2-3)
    encoder        base + `encoder` LoRA, causal; memory KV = K/V of c_1..c_k, all layers
    probe          L^_rel = zeta(H): attention pooling of the input's final states (query: its last), an MLP  (eq. 4)
    policy         k = eta(L^_rel) = clamp(ceil(L^_rel / r), 1, k_max)       (eq. 5: min(L^_rel / r, k_max))
    rel            L = -sum_j log P(w_j | KV, [BOS], w_<j) + lam * Huber_delta(L^_rel, L_rel)  (eq. 8-10)
    qa             L = -sum_j log P(a_j | KV, q, a_<j)   (+ the probe's lam * Huber, see below)   (eq. 11)

Choices the paper leaves open, made here:
- Chunks: the records' "chunks", space-joined, tags as text (Fig. 7-9); HotpotQA's: data.read_hotpot's "Title:
  sentences" (Fig. 7: no titles) and its distractors (recipe: --hotpot_distractors; Fig. 7: 2 gold of 8; a --data
  batch of only gold chunks warns). Training keeps encoder inputs within --max_context (§4.1.4: 600, drops others);
  ours: a longer one first loses chunks not relevant, seeded (ten HotpotQA paragraphs rarely fit); eval cuts.
- C_rel: the gold chunks space-joined, no <PA> tags (Table 7's regenerations; Figs. 7-9 show tags), then EOS; L_rel:
  its length. c_j start at the embeddings' scale; the probe's MLP is min(4d, 1024) wide, its output in 64 tokens.
- [BOS] (eq. 9): the tokenizer's BOS, its EOS when it has none (Qwen); a BOS also starts the encoder input.
- Probe: q = W h_last attends over the input tokens only (k is needed before c_1 exists, §3.2); MLP([h_last, pooled]).
- In `rel` and `qa+rel`, lam * Huber's gradients reach the encoder too (w/o AAC: no controller, none): §3.5 trains
  both on one loss (eq. 8, §A.1); §3.4's "operate independently" read as the design (k from the probe, r as is).
- In `qa` the encoder trains on eq. 11's CE alone (and the tiny base's aids): its last layer's o / MLP adapters feed
  only the probe and stay as `rel` left them; the probe, which eq. 11 leaves out, keeps fitting the encoder's states,
  detached: k at inference reads the finetuned encoder, and a `qa` run alone (the tiny base's) has a probe.
- k: the gold L_rel's in training (§3.4: the encoder's memory does not wait on the probe), the probe's at inference.
- The causal encoder runs all k_max tokens and the memory masks all but the first k: the same as appending k (tested).
- Positions: left-padded prompt at 0..n-1, c_j at n+j-1; the decoder goes on at n + k, as if only k were appended.
- `qa` reads [prefix K/V, KV, q, a] (eq. 11: no prefix): the frozen base's K/V of BOS / a chat header, as every method.
- r: one per training batch (§C) from --rel_ratios (`rel`, Table 4) or --ratio (`qa`, Table 5: 10), by draw_ratio.
- AdamW's betas and clip (Tables 4-5 name AdamW alone): train.py's 0.9, 0.95 and 1.0; bf16, not their fp16.
- Tiny base: tiny.py's aids, attention distillation in output form (c_j hold no fixed chunk) and the writer loss.
- Ablations (Table 2): --no_aac (k = --fixed_k, 6: Table 2's "w/o AAC" row; SPEC §3.5's k_max is --fixed_k 8),
  --no_selective (C_rel = the whole context, 500xCompressor-like; L_rel follows it; the encoder's prompt is unchanged).
"""
import math
import random
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import data
import kernels
from model import Memory, behind_prefix_kv

INST = "Please identify and extract the <PA> sections that can answer the question (which may not be unique)"
LEN_UNIT = 64.0  # the probe's MLP predicts L_rel / LEN_UNIT: its output starts at order 1, L_rel is in the hundreds


@dataclass
class ATAConfig:
    k_max: int = 8                  # maximum number of compression tokens (Table 4)
    lora_r: int = 64                # encoder LoRA on all linear layers (Table 4)
    lora_alpha: int = 32            # LoRA scale alpha / r (Table 4)
    lora_dropout: float = 0.2       # LoRA dropout (Table 4)
    huber_lambda: float = 1e-4      # lam in eq. 8
    huber_delta: float = 10.0       # delta in eq. 10
    rel_ratios: str = "1,5,10,20,50"  # policy ratios r drawn per training batch in `rel` (Table 4)
    no_aac: bool = False            # Table 2 ablation: k = fixed_k always; no probe term (the probe is not read)
    fixed_k: int = 6                # k under --no_aac (Table 2 "w/o AAC": 6.00)
    no_selective: bool = False      # Table 2 ablation: reconstruct the whole context
    no_prefix: bool = False         # qa: no prefix K/V (BOS, chat header) before the memory (the tiny base's)


def encoder_prompt(question, chunks):
    """The selective encoder's input text (Fig. 10) with every chunk inside <PA> tags."""
    context = " ".join(f"<PA> {c} </PA>" for c in chunks)
    return f"<QUESTION> {question} </QUESTION> <CONTEXT> {context} </CONTEXT> <INST> {INST} </INST>"


def policy(L_hat, r, k_max):
    """eq. 5 is min(L^_rel / r, k_max), a real number: here rounded up and at least 1 (a memory of 0 tokens holds
    nothing; §5.2 suggests a minimum): k = clamp(ceil(L^_rel / r), 1, k_max), per example (B,) long."""
    return torch.clamp(torch.ceil(L_hat.float() / r), 1, k_max).long()


def huber(pred, target, delta):
    """eq. 10 summed: 0.5 x^2 where |x| <= delta, else delta (|x| - delta / 2)."""
    return F.huber_loss(pred.float(), target.float(), delta=delta, reduction="sum")


def encoder_mask(valid):
    """Causal over [prompt, c_1..c_kmax]; valid (B, T) marks real tokens (left padding)."""
    valid = kernels.bucketed(valid)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & valid[b, kv_idx]
    mask_mod.__name__ = "ata_encoder"
    return mask_mod


def draw_ratio(choices, seed, step, salt):
    """The policy ratio r of training step `step`, one for the whole batch: a pure function of (seed, step), so ranks,
    micro-batches and --resume agree (str seeds hash with SHA-512, independent of PYTHONHASHSEED)."""
    return random.Random(f"ata/{salt}/{seed}/{step}").choice(choices)


class Probe(nn.Module):
    """zeta: attention pooling (query = the last input token) + MLP -> L^_rel (B,)."""

    def __init__(self, d, hidden):
        super().__init__()
        self.query = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(2 * d, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, h, valid):
        """h (B, T, d) final hidden states of the input tokens, left-padded; fp32 under autocast too: bf16 would round
        L^_rel to 2 tokens from 256."""
        with torch.autocast(h.device.type, enabled=False):
            h = h.float()
            last = h[:, -1]  # (B, d): the last input token sits in the last column
            scores = (h @ self.query(last)[:, :, None]).squeeze(-1) / math.sqrt(h.shape[-1])  # (B, T)
            attn = scores.masked_fill(~valid, float("-inf")).softmax(-1)
            pooled = (attn[:, :, None] * h).sum(1)  # (B, d)
            return self.mlp(torch.cat([last, pooled], -1)).squeeze(-1) * LEN_UNIT


class ATA(nn.Module):
    Config = ATAConfig
    objectives = ("qa", "rel", "qa+rel")  # qa+rel: both losses in each step
    SWITCHED = {"fixed_k": "no_aac"}  # a flag read only under a switch (else the probe picks k): given alone, one line
    memory_kind = "kv"  # what its Memory holds: per-layer K/V
    # the tiny base: `qa` alone, no_prefix (a `rel` stage first, or its BOS sink before the memory, stalled qa)
    TINY = dict(lr=2e-3, max_iters=500, warmup_iters=5, batch_size=16, grad_accum=2, lora_r=16, lora_alpha=32,
                lora_dropout=0.0, max_context=1024, no_prefix=True)
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base
    dec_adapter = None  # the decoder is the frozen base (a LoRA on the tiny base: tiny.add_decoder_adapter)
    frozen_decoder = True
    reads_question = True  # its encoder reads the question (the selective prompt)
    token_slots = None  # compression tokens that read the whole context hold no fixed context token

    @staticmethod
    def recipe(mcfg):
        """§3.5: rel 3 epochs, then qa 1 epoch (Tables 4-5) of §4.1.4's 280k at batch 16, as steps; constant lr."""
        both = dict(lr=1e-5, min_lr_frac=1.0, warmup_iters=300, weight_decay=0.2, batch_size=16, max_context=600,
                    ratio="10", hotpot_distractors=True, lora_r=64, lora_alpha=32, lora_dropout=0.2, k_max=8,
                    huber_lambda=1e-4, huber_delta=10.0, rel_ratios="1,5,10,20,50")  # (delta: App. C; qa draws no r)
        return [dict(objective="rel", cite="§3.5, Table 4", paper={**both, "max_iters": 52_500}),
                dict(objective="qa", cite="§3.5, Table 5", paper={**both, "max_iters": 17_500})]

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.tok, self.run = base, cfg, tok, run
        d = base.config.hidden_size
        base.add_adapter("encoder", cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        # eq. 11 (qa) and w/o AAC have no probe term: the last layer's o / MLP adapters shape only the probe's input (no
        # K/V) and get no gradient; frozen (DDP wants one for every trainable tensor), they stay as `rel` left them
        if "rel" not in run.objective.split("+") or cfg.no_aac:
            last = base.model.layers[-1]
            for lora in (last.self_attn.o_proj, last.mlp.gate_up_proj, last.mlp.down_proj):
                for p in (lora.lora_A["encoder"], lora.lora_B["encoder"]):
                    p.requires_grad_(False)
        std = base.model.embed_tokens.input_std()
        self.comp = nn.Parameter(torch.randn(cfg.k_max, d) * std)  # (k_max, d) compression tokens
        self.probe = Probe(d, min(4 * d, 1024))
        self.rel_ratios = [int(r) for r in cfg.rel_ratios.split(",")]
        self.ratios_text = f"k = --fixed_k {cfg.fixed_k}" if cfg.no_aac else ", ".join(  # train.py's start line
            f"{obj} ratios {dict(qa=run.ratio, rel=cfg.rel_ratios)[obj]}" for obj in run.objective.split("+"))

    @staticmethod
    def check_config(run, cfg):
        if not 1 <= cfg.k_max <= run.max_context:
            raise SystemExit(f"error: --k_max {cfg.k_max}: 1 to --max_context {run.max_context} compression tokens")
        rs = [int(r) if r.strip().isascii() and r.strip().isdigit() else 0 for r in cfg.rel_ratios.split(",")]
        if not all(0 < r <= 1 << 20 for r in rs) or len(set(rs)) < len(rs):
            raise SystemExit(f"error: --rel_ratios {cfg.rel_ratios!r}: distinct integers in 1..2^20, like 1,5,10")
        if not 0 <= cfg.lora_dropout < 1:
            raise SystemExit(f"error: --lora_dropout {cfg.lora_dropout} must lie in [0, 1)")
        if not (0 < cfg.huber_delta < math.inf and 0 <= cfg.huber_lambda < math.inf):
            raise SystemExit(f"error: --huber_delta {cfg.huber_delta} must be a finite number > 0 and --huber_lambda "
                             f"{cfg.huber_lambda} one >= 0 (eq. 8-10)")
        if cfg.no_aac and len({int(r) for r in f"{run.ratio},{run.eval_ratio or run.ratio}".split(",")}) > 1:
            raise SystemExit(f"error: --no_aac gives every context --fixed_k {cfg.fixed_k} tokens at any ratio: one "
                             f"ratio to train and read at, not --ratio {run.ratio!r} --eval_ratio {run.eval_ratio!r}")
        if cfg.no_aac and not 1 <= cfg.fixed_k <= cfg.k_max:
            raise SystemExit(f"error: --fixed_k {cfg.fixed_k} (--no_aac) must lie in 1..--k_max {cfg.k_max}")

    def training_records(self, records):
        """(the training records whose encoder input fits --max_context once their chunks that are not relevant go,
        in a seeded order; a note): §4.1.4's filter. Training only: every method is read on the same questions."""
        tok, limit = self.tok, self.run.max_context
        kept, trimmed = data.fit_chunks(records, tok, limit, lambda r: (tok.bos_id is not None) + len(tok.encode(
            encoder_prompt(r["question"], r.get("chunks") or [r["context"]]))),
            lambda chunk: len(tok.encode(f" <PA> {chunk} </PA>", start=False)))
        return kept, (f"ata: {len(kept):,} of {len(records):,} training records fit --max_context {limit} tokens "
                      f"(§4.1.4), {trimmed:,} after dropping chunks that are not relevant")

    def prepare(self, batch):
        """At collate time, adds enc_ids (B, T) left-padded encoder prompts, enc_len (B,), rel_ids / rel_labels
        (B, R) = [BOS] C_rel [EOS] with next-token labels, rel_len (B,) = L_rel."""
        tok = self.tok
        start = [tok.bos_id if tok.bos_id is not None else tok.eos_ids[0]]
        enc, rel, labels, rel_len, all_relevant, no_gold = [], [], [], [], True, 0
        for b, question in enumerate(batch["questions"]):
            rec, spans = batch["records"][b], batch["chunk_spans"][b]
            chunks = list((rec.get("chunks") or [rec["context"]])[:len(spans)])  # those inside the context
            if spans and batch["context_len"][b] >= self.run.max_context:  # the last one may be cut
                s, e = spans[-1]
                chunks[-1] = tok.decode(batch["context"][b, s:e].tolist()).strip()
            all_relevant &= len(batch["relevant_idx"][b]) == len(chunks)
            no_gold += rec.get("relevant") is not None and not batch["relevant_idx"][b]  # (none: every chunk is)
            enc.append(batch["bos"] + tok.encode(encoder_prompt(question, chunks)))
            idx = range(len(chunks)) if self.cfg.no_selective else batch["relevant_idx"][b]
            target = tok.encode(" ".join(chunks[i] for i in idx))[:self.run.max_context] + tok.eos_ids[:1]
            rel.append(start + target)
            labels.append(target + [-100])
            rel_len.append(len(target) - 1)
        if all_relevant and self.training and not self.cfg.no_selective and self.run.data:  # not the synthetic default
            warnings.warn("ata: every chunk of this training batch is relevant, so selective reconstruction is "
                          "--no_selective (HotpotQA: --hotpot_distractors, and a --max_context with room for some)")
        if no_gold and self.training and not self.cfg.no_selective:
            warnings.warn(f"ata: {no_gold} example(s) of this training batch keep no relevant chunk: C_rel is empty")
        pad = self.run.pad_multiple
        batch["enc_ids"] = data.pad_rows(enc, tok.pad_id, pad, left=True)
        batch["enc_len"] = torch.tensor([len(e) for e in enc])
        batch["rel_ids"], batch["rel_labels"] = data.pad_rows(rel, tok.pad_id, pad), data.pad_rows(labels, -100, pad)
        batch["rel_len"] = torch.tensor(rel_len)
        return batch

    def encode(self, batch, n=None):
        """Causal pass over [prompt, c_1..c_n] -> (prompt states (B, T, d), per layer (k, v) of c_j (B, Hkv, n, hd))."""
        ids, enc_len = batch["enc_ids"], batch["enc_len"]
        n = self.cfg.k_max if n is None else n
        B, T = ids.shape
        e = self.base.model.embed_tokens(ids)  # (B, T, d)
        x = torch.cat([e, self.comp[:n].to(e.dtype).expand(B, n, -1)], 1)  # (B, T + n, d)
        valid = torch.cat([torch.arange(T, device=ids.device)[None] >= T - enc_len[:, None],
                           torch.ones(B, n, dtype=torch.bool, device=ids.device)], 1)  # (B, T + n)
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)  # prompt 0..len-1, c_j at len + j - 1
        with self.base.adapter("encoder"):
            h, kv = self.base(embeds=x, pos=pos, mask=encoder_mask(valid), return_kv=True, output="hidden")
        return h[:, :T], [(k[:, :, T:], v[:, :, T:]) for k, v in kv]

    def length(self, batch, h):  # the probe's L^_rel (B,) from the prompt's final hidden states
        T = batch["enc_ids"].shape[1]
        return self.probe(h, torch.arange(T, device=h.device)[None] >= T - batch["enc_len"][:, None])

    def memory(self, kv, k, enc_len, prefix=()):
        """The first k (B,) compression tokens (K/V cut to max k, the rest masked) behind the prefix's K/V."""
        C = int(k.max())
        mask = torch.arange(C, device=k.device)[None] < k[:, None]  # (B, C)
        kv, mask = behind_prefix_kv(self.base, prefix, [(kk[:, :, :C], vv[:, :, :C]) for kk, vv in kv], mask)
        return Memory(kv=kv, mask=mask, next_pos=enc_len + k)

    def policy_k(self, L, r):  # --no_aac: fixed_k for every example
        return torch.full_like(L, self.cfg.fixed_k, dtype=int) if self.cfg.no_aac else policy(L, r, self.cfg.k_max)

    def forward(self, batch, ratios):
        """Training loss: (CE sum over target tokens + lam * Huber sum, n tokens, metrics)."""
        teacher_head = self.aid.teacher(batch)[1] if self.aid is not None and "qa" in self.run.objective else None
        h, kv = self.encode(batch)
        aac = "rel" in self.run.objective.split("+") and not self.cfg.no_aac  # (eq. 11, w/o AAC: no probe term)
        L_hat, L = self.length(batch, h if aac else h.detach()), batch["rel_len"]  # (detached: the probe still learns)
        probe = huber(L_hat, L, self.cfg.huber_delta)
        total, n, metrics = self.cfg.huber_lambda * probe, 0, {"probe_mae": (L_hat - L).abs().mean().item()}
        if teacher_head is not None:  # tiny.py's aid 2 on the encoder pass just run, per answer token
            total = total + (batch["qa_labels"] != -100).sum() * self.aid.writer_loss(batch)
        step = batch.get("step", 0)  # train.Batches sets it; a batch built by hand counts as step 0
        for obj, ids, choices in (("rel", "rel_ids", self.rel_ratios), ("qa", "qa", ratios)):
            if obj not in self.run.objective.split("+"):
                continue
            metrics[f"r_{obj}"] = r = draw_ratio(choices, self.run.seed, step, obj)
            k = self.policy_k(L, r)
            prefix = batch["prefix"] if obj == "qa" and not self.cfg.no_prefix else ()
            memory = self.memory(kv, k, batch["enc_len"], prefix)
            with self.base.adapter(self.dec_adapter):
                h_dec = self.base(batch[ids], memory=memory, output="hidden")  # (B, T, d)
            loss, m = self.base.ce(h_dec, batch[f"{obj}_labels"])
            if teacher_head is not None and obj == "qa":
                loss = loss + m * self.aid.memory_loss(teacher_head, memory, batch, r)
            total, n = total + loss, n + m
            metrics.update({f"{obj}_ce": loss.item() / max(m, 1), f"k_{obj}": k.float().mean().item()})
        return total, n, metrics

    @torch.no_grad()
    def compress(self, batch, ratio):  # the probe sets k; eval's --ratio sets r without retraining (§3.4)
        h, kv = self.encode(batch)
        L_hat = self.length(batch, h)
        k = self.policy_k(L_hat, ratio)
        memory = self.memory(kv, k, batch["enc_len"], batch["prefix"] if not self.cfg.no_prefix else ())
        memory.stats = {"k": k.float().tolist(), "probe_abs_err": (L_hat - batch["rel_len"]).abs().tolist()}
        return memory


def main():
    """Print a toy encoder prompt and the encoder's mask (_ left padding, t prompt tokens, c compression tokens)."""
    print(encoder_prompt("Where does Ada Lovelace live?", ["Ada Lovelace lives in Paris.", "Ben Okafor is in Oslo."]))
    kinds = "__tttttcccc"
    grid = kernels.draw(encoder_mask(torch.tensor([[kind != "_" for kind in kinds]])), len(kinds)).splitlines()
    print("\n".join(kind + " " + row for kind, row in zip(kinds, grid)))


if __name__ == "__main__":
    main()
