"""ATACompressor: a selective encoder over <PA>-chunked context + question, an adaptive
allocation controller, and the K/V of k compression tokens as the frozen LLM's memory.

Paper: "ATACompressor: Adaptive Task-Aware Compression for Efficient Long-Context
Processing in LLM" (../shared/papers/ata_compressor.txt), §3, §A, Tables 2, 4-6, Fig. 10.

    encoder input  <QUESTION> q </QUESTION> <CONTEXT> <PA> C_1 </PA> ... </CONTEXT> <INST> ... </INST>
                   then k_max learned compression tokens c_1..c_kmax          (Fig. 10, eq. 2-3)
    encoder        base + `encoder` LoRA, causal; memory KV = K/V of c_1..c_k, all layers
    probe          L^_rel = zeta(H): attention pooling over the input's final hidden states,
                   the last input token as the query, then an MLP            (eq. 4)
    policy         k = eta(L^_rel) = clamp(ceil(L^_rel / r), 1, k_max)       (eq. 5)
    rel            L = -sum_j log P(w_j | KV, [BOS], w_<j) + lam * Huber_delta(L^_rel, L_rel)  (eq. 8-10)
    qa             L = -sum_j log P(a_j | KV, q, a_<j)   (+ lam * Huber, see below)   (eq. 11)

The target LLM (decoder) is the frozen base. The encoder is causal, so it runs all k_max
compression tokens and the memory keeps the first k through its validity mask, identical
to appending k (tests/test_ata.py checks K/V and decoder logits).

Choices the paper leaves open, made here:
- Chunks are the records' "chunks" (HotpotQA paragraphs, MS MARCO passages, SQuAD
  sentences, synthetic biographies) inside the max_context-truncated context; a chunk cut
  there is the decoded text of its kept tokens. Tags are plain text (no new vocabulary),
  chunks joined by spaces (as in Fig. 7-9); BOS starts the encoder input.
- C_rel, the reconstruction target, is the gold relevant chunks' plain text joined by
  spaces (no <PA> tags, as in Table 7's regenerations), then EOS; L_rel is its token count.
  [BOS] is the tokenizer's BOS (its EOS when it has none, e.g. Qwen).
- Positions: the encoder input is left-padded, prompt at 0..n-1, c_j at n+j-1; the decoder
  continues at next_pos = n + k, where an encoder that appended only k tokens would stop.
  The decoder reads [prefix, KV, q, a]: the prefix (BOS, a chat header) is the frozen base's K/V at 0..P-1, as
  every method keeps it before its memory (eq. 11 writes none); `rel` reads [KV, [BOS], C_rel] (eq. 8).
- Probe: q = W h_last, attention over the input tokens' final hidden states (not the
  compression tokens: k is known before c_1 exists, §3.2), MLP([h_last, pooled]) -> L_rel
  in units of LEN_UNIT tokens (the MLP's output starts at order 1; L_rel is in the hundreds).
  Gradients of lam * Huber reach the encoder too (joint training, eq. 8).
- Training uses the gold L_rel for k (the encoder trains independently of the probe, §3.4);
  inference uses the probe. Eq. 5 has no ceil or floor: k is rounded up and at least 1.
- r is drawn "for each training batch" (§C): one per step from --rel_ratios (`rel`, Table 4)
  or --ratio (`qa`, Table 5: 10), a pure function of (seed, step), so ranks, micro-batches
  and --resume agree; eval --ratio sets r without retraining (§3.4).
- HotpotQA keeps its distractor paragraphs (the recipe sets --hotpot_distractors; Fig. 7); a
  training batch of a --data file whose every chunk is relevant warns (selective would be
  --no_selective); the synthetic default's short contexts early in its curriculum do not.
- Objectives: `qa` (default; eq. 11 plus lam * Huber, so one command trains encoder and
  probe), `rel` (pretraining, eq. 8), `qa+rel` (both from one encoder pass: a one-stage
  stand-in for the paper's rel -> qa).
- On the tiny base, tiny.py's aids apply (curriculum; a LoRA decoder; attention distillation in
  its output form, as compression tokens that read the whole prompt hold no fixed chunk, plus its
  writer loss: c_j learn to read the answer one layer below the last). The frozen decoder answers
  from the answer tokens' K/V alone, which without the writer loss c_j do not learn to hold. There a `rel`
  stage before `qa` stalled `qa`, so the tiny default is `qa` alone.
- Ablations (Table 2): --no_aac (k = --fixed_k always, the row's 6.00), --no_selective
  (C_rel = the whole context, 500xCompressor-like; L_rel follows it).
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
LEN_UNIT = 64.0  # the probe's MLP predicts L_rel / LEN_UNIT


@dataclass
class ATAConfig:
    k_max: int = 8                  # maximum number of compression tokens (Table 4)
    lora_r: int = 64                # encoder LoRA on all linear layers (Table 4)
    lora_alpha: int = 32            # LoRA scale alpha / r (Table 4)
    lora_dropout: float = 0.2       # LoRA dropout (Table 4)
    huber_lambda: float = 1e-4      # lam in eq. 8
    huber_delta: float = 10.0       # delta in eq. 10
    rel_ratios: str = "1,5,10,20,50"  # policy ratios r drawn per training batch in `rel` (Table 4)
    no_aac: bool = False            # Table 2 ablation: k = fixed_k always, no probe
    fixed_k: int = 6                # k under --no_aac (Table 2 "w/o AAC": 6.00)
    no_selective: bool = False      # Table 2 ablation: reconstruct the whole context
    prefix: bool = True             # qa: the prefix's K/V (BOS, chat header) before the memory, as every method's


def encoder_prompt(question, chunks):
    """The selective encoder's input text (Fig. 10) with every chunk inside <PA> tags."""
    context = " ".join(f"<PA> {c} </PA>" for c in chunks)
    return f"<QUESTION> {question} </QUESTION> <CONTEXT> {context} </CONTEXT> <INST> {INST} </INST>"


def policy(L_hat, r, k_max):
    """eq. 5: k = clamp(ceil(L^_rel / r), 1, k_max), per example (B,) long."""
    return torch.clamp(torch.ceil(L_hat.float() / r), 1, k_max).long()


def huber(pred, target, delta):
    """eq. 10 summed: 0.5 x^2 where |x| <= delta, else delta (|x| - delta / 2)."""
    return F.huber_loss(pred.float(), target.float(), delta=delta, reduction="sum")


def encoder_mask(valid):
    """Causal over [prompt, c_1..c_kmax]; valid (B, T) marks real tokens (left padding)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & valid[b, kv_idx]
    mask_mod.__name__ = "ata_encoder"
    return mask_mod


def draw_ratio(choices, seed, step, salt):
    """The policy ratio r of training step `step`, one for the whole batch: a pure function
    of (seed, step) (str seeds hash with SHA-512, independent of PYTHONHASHSEED)."""
    return random.Random(f"ata/{salt}/{seed}/{step}").choice(choices)


class Probe(nn.Module):
    """zeta: attention pooling (query = the last input token) + MLP -> L^_rel (B,)."""

    def __init__(self, d, hidden):
        super().__init__()
        self.query = nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(2 * d, hidden), nn.GELU(), nn.Linear(hidden, 1))

    def forward(self, h, valid):
        h = h.float()  # (B, T, d) final hidden states of the input tokens, left-padded
        last = h[:, -1]  # (B, d): the last input token sits in the last column
        scores = (h @ self.query(last)[:, :, None]).squeeze(-1) / math.sqrt(h.shape[-1])  # (B, T)
        attn = scores.masked_fill(~valid, float("-inf")).softmax(-1)
        pooled = (attn[:, :, None] * h).sum(1)  # (B, d)
        return self.mlp(torch.cat([last, pooled], -1)).squeeze(-1) * LEN_UNIT


class ATA(nn.Module):
    Config = ATAConfig
    objectives = ("qa", "rel", "qa+rel")
    memory_kind = "kv"  # what its Memory holds: per-layer K/V
    TINY = dict(lr=2e-3, max_iters=500, warmup_iters=5, batch_size=16, grad_accum=2, lora_r=16, lora_alpha=32,
                lora_dropout=0.0, max_context=1024, prefix=False)  # its BOS sink before the memory stalled qa

    @staticmethod
    def recipe(mcfg):
        """§3.5: rel pretraining 3 epochs, then qa 1 epoch (Tables 4-5), of the 280k training examples at the overall
        batch 16: 52,500 and 17,500 steps. Constant lr after 300 warmup steps; HotpotQA keeps its distractors (§4.1.4)."""
        both = dict(lr=1e-5, min_lr_frac=1.0, warmup_iters=300, weight_decay=0.2, batch_size=16, max_context=600,
                    ratio="10", hotpot_distractors=True, lora_r=64, lora_alpha=32, lora_dropout=0.2)
        return [dict(objective="rel", cite="§3.5, Table 4", paper={**both, "max_iters": 52_500}),
                dict(objective="qa", cite="§3.5, Table 5", paper={**both, "max_iters": 17_500})]
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base
    dec_adapter = None  # the decoder is the frozen base (a LoRA on the tiny base: tiny.add_decoder_adapter)

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.tok, self.run = base, cfg, tok, run
        d = base.config.hidden_size
        base.add_adapter("encoder", cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout)
        std = base.model.embed_tokens.input_std()
        self.comp = nn.Parameter(torch.randn(cfg.k_max, d) * std)  # (k_max, d) compression tokens
        self.probe = Probe(d, min(4 * d, 1024))
        self.rel_ratios = [int(r) for r in cfg.rel_ratios.split(",")]

    @staticmethod
    def check_config(run, cfg):
        if cfg.k_max < 1:
            raise SystemExit(f"error: --k_max {cfg.k_max}: need at least one compression token")
        if not all(r.strip().isdigit() and int(r) > 0 for r in cfg.rel_ratios.split(",")):
            raise SystemExit(f"error: --rel_ratios {cfg.rel_ratios!r}: a comma list of positive integers, like 1,5,10")
        if cfg.no_aac and not 1 <= cfg.fixed_k <= cfg.k_max:
            raise SystemExit(f"error: --fixed_k {cfg.fixed_k} (--no_aac) must lie in 1..--k_max {cfg.k_max}")

    # --- collate time: encoder prompt, reconstruction target, gold length -----------

    def kept_chunks(self, batch, b):
        """Chunk texts of example b inside the (possibly truncated) context."""
        rec, spans = batch["records"][b], batch["chunk_spans"][b]
        texts = list((rec.get("chunks") or [rec["context"]])[:len(spans)])
        if spans and batch["context_len"][b] >= self.run.max_context:  # the last one may be cut
            s, e = spans[-1]
            texts[-1] = self.tok.decode(batch["context"][b, s:e].tolist()).strip()
        return texts

    def prepare(self, batch):
        """Adds enc_ids (B, T) left-padded encoder prompts, enc_len (B,), rel_ids/rel_labels
        (B, R) = [BOS] C_rel [EOS] with next-token labels, rel_len (B,) = L_rel."""
        tok = self.tok
        start = [tok.bos_id if tok.bos_id is not None else tok.eos_ids[0]]
        enc, rel, labels, rel_len, all_relevant = [], [], [], [], True
        for b, question in enumerate(batch["questions"]):
            chunks = self.kept_chunks(batch, b)
            all_relevant &= len(batch["relevant_idx"][b]) == len(chunks)
            enc.append(batch["bos"] + tok.encode(encoder_prompt(question, chunks)))
            idx = range(len(chunks)) if self.cfg.no_selective else batch["relevant_idx"][b]
            target = tok.encode(" ".join(chunks[i] for i in idx))[:self.run.max_context] + tok.eos_ids[:1]
            rel.append(start + target)
            labels.append(target + [-100])
            rel_len.append(len(target) - 1)
        if all_relevant and self.training and not self.cfg.no_selective and self.run.data:  # gold-only HotpotQA?
            warnings.warn("ata: every chunk of this training batch is relevant, so selective reconstruction is "
                          "--no_selective; for HotpotQA use --hotpot_distractors")
        pad = self.run.pad_multiple
        batch["enc_ids"] = data.pad_rows(enc, tok.pad_id, pad, left=True)
        batch["enc_len"] = torch.tensor([len(e) for e in enc])
        batch["rel_ids"], batch["rel_labels"] = data.pad_rows(rel, tok.pad_id, pad), data.pad_rows(labels, -100, pad)
        batch["rel_len"] = torch.tensor(rel_len)
        return batch

    # --- encoder, controller, memory ------------------------------------------------

    def encode(self, batch, n=None):
        """Causal encoder over [prompt, c_1..c_n]: (final hidden states of the prompt
        (B, T, d), per-layer (k, v) of the n compression tokens, each (B, Hkv, n, hd))."""
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

    def length(self, batch, h):
        """Probe estimate L^_rel (B,) from the prompt's final hidden states."""
        T = batch["enc_ids"].shape[1]
        return self.probe(h, torch.arange(T, device=h.device)[None] >= T - batch["enc_len"][:, None])

    def memory(self, kv, k, enc_len, prefix=()):
        """Keep the first k (B,) compression tokens (K/V cut to max k, the rest masked) behind the prefix's K/V (BOS,
        a chat header: what every method keeps before its memory); next_pos enc_len + k."""
        C = int(k.max())
        mask = torch.arange(C, device=k.device)[None] < k[:, None]  # (B, C)
        kv, mask = behind_prefix_kv(self.base, prefix, [(kk[:, :, :C], vv[:, :, :C]) for kk, vv in kv], mask)
        return Memory(kv=kv, mask=mask, next_pos=enc_len + k)

    def policy_k(self, L, r):
        if self.cfg.no_aac:
            return torch.full_like(L, self.cfg.fixed_k, dtype=torch.long)
        return policy(L, r, self.cfg.k_max)

    def forward(self, batch, ratios):
        """Training loss: (CE sum over target tokens + lam * Huber sum, n tokens, metrics)."""
        teacher_head = self.aid.teacher(batch)[1] if self.aid is not None and "qa" in self.run.objective else None
        h, kv = self.encode(batch)
        L_hat, L = self.length(batch, h), batch["rel_len"]
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
            memory = self.memory(kv, k, batch["enc_len"], batch["prefix"] if obj == "qa" and self.cfg.prefix else ())
            with self.base.adapter(self.dec_adapter):
                h_dec = self.base(batch[ids], memory=memory, output="hidden")  # (B, T, d)
            loss, m = self.base.ce(h_dec, batch[f"{obj}_labels"])
            if teacher_head is not None and obj == "qa":
                loss = loss + m * self.aid.memory_loss(teacher_head, memory, batch, r)
            total, n = total + loss, n + m
            metrics.update({f"{obj}_ce": loss.item() / max(m, 1), f"k_{obj}": k.float().mean().item()})
        return total, n, metrics

    # --- inference: the probe sets k ---------------------------------------------------

    @torch.no_grad()
    def compress(self, batch, ratio):
        h, kv = self.encode(batch)
        L_hat = self.length(batch, h)
        k = self.policy_k(L_hat, ratio)
        memory = self.memory(kv, k, batch["enc_len"], batch["prefix"] if self.cfg.prefix else ())
        memory.stats = {"k": k.float().tolist(), "probe_abs_err": (L_hat - batch["rel_len"]).abs().tolist()}
        return memory


def main():
    """Print the encoder prompt for a toy example and the encoder -> memory -> decoder layout."""
    print(encoder_prompt("Where does Ada Lovelace live?", ["Ada Lovelace lives in Paris.",
          "Ben Okafor works for Acme Labs.", "Ada Lovelace studied at Carrow College."]))
    pad, n, kmax, k, dec = 2, 6, 4, 2, 3
    valid = torch.arange(pad + n + kmax)[None] >= pad
    kinds = "_" * pad + "t" * n + "c" * kmax
    print(f"\nencoder (causal; _ left padding, t prompt tokens, c compression tokens, k_max={kmax}):\n  {kinds}")
    grid = kernels.draw(encoder_mask(valid), pad + n + kmax).splitlines()
    print("\n".join(kind + " " + row for kind, row in zip(kinds, grid)))
    key_valid = torch.cat([torch.arange(kmax)[None] < k, torch.ones(1, dec, dtype=torch.bool)], 1)
    print(f"\ndecoder (frozen base) over the memory, policy k={k}: m K/V of c_1..c_{kmax}, d decoder tokens")
    print("  " + "m" * kmax + "d" * dec)
    grid = kernels.draw(kernels.causal_after_prefix(kmax, key_valid), dec, kmax + dec).splitlines()
    print("\n".join("d " + row for row in grid))


if __name__ == "__main__":
    main()
