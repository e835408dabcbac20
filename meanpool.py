"""Mean-pooling context compression with multi-ratio distillation. Paper: "Simple Context Compression:
Mean-Pooling and Multi-Ratio Training" (../shared/papers/meanpool_multi_ratio.txt), §4, Table 3, Table 6.

    encoder    h = Enc(T)                   base + `encoder` LoRA, full bidirectional attention
    pool       S_k = {(k-1)r+1 .. min(kr, L)},  z_k = mean_{i in S_k} h_i    (eq. 3-4)
    project    z_k <- W z_k                 W in R^{d x d} (§5.1)
    decoder    p(. | z, P, A_<i)            base + `decoder` LoRA; memory embeddings first
    loss       L_KD = sum_i KL(Q_i || P_i)  teacher = base with full context  (eq. 5)
               L_multi = sum_{r in R} L_KD(r)  one encoder pass, one update      (eq. 6)

Choices the paper leaves open, made here:
- h: the final-norm output (HF's last hidden state) of the context alone (after the prefix, or pre-norm, kept no more).
- W starts at s I (SPEC §3.1 says I), s = the embeddings' std / the RMS of the final norm's gain (the encoder's
  outputs: unit RMS times that gain), so z enters at the scale of the embeddings it stands in for (the final-norm
  outputs are ~14x them on SmolLM2, where this start learned faster than I; pic's compression tokens did not, and
  their W keeps I: RESULTS.md).
- Encoder and decoder start from the teacher (§5.1's "same target LLM", read as the finetuned one): `--teacher` is
  merged into the base first (in fp32), so `adapter(None)` is it; without `--teacher`, the base is the teacher.
- Padding is never attended to nor pooled; a partial last window averages its real tokens (C = ceil(L / r)).
- The decoder reads [prefix, z_1 .. z_C, prompt, answer] at 0.., as the teacher reads the context (behind_prefix).
- The loss is per answer token, summed over ratios; `--objective qa`: CE on the answer instead (not the paper's).
- Several ratios: one encoder pass; one decoder pass over their memories, stacked (model.decode_each; not under aids).
- Table 3's ablations: MeanPoolConfig's flags; under `--fixed_encoder` the frozen base still encodes bidirectionally.
  W trains under `--fixed_decoder` and `--fixed_encoder` alike: it has an ablation of its own, (4) `--no_linear`.
- LoRA on all seven projections, no dropout; the KL at temperature 1, over the answer's tokens and its end token.
- Tiny base: tiny.py's aids (slot k holds window S_k).
"""
import random
from dataclasses import dataclass

import torch
import torch.nn as nn

import kernels
from model import behind_prefix, decode_each

# Table 6: "the final hyperparameters used to train all models, including the teacher and compressor models"
TABLE6 = dict(lr=2e-4, min_lr_frac=0.1, warmup_frac=0.05, weight_decay=0.0, grad_clip=1.0, max_iters=48_000,
              batch_size=32, max_context=1024, max_answer=256, lora_r=16, lora_alpha=16)


@dataclass
class MeanPoolConfig:
    lora_r: int = 16              # Table 6
    lora_alpha: int = 16
    no_linear: bool = False       # Table 3 ablation: no projection W
    ratio_sampling: bool = False  # Table 3 ablation: one ratio per example, not all
    fixed_decoder: bool = False   # Table 3 ablation: the decoder stays frozen (no decoder adapter)
    fixed_encoder: bool = False   # Table 3 ablation: the encoder stays frozen (no encoder adapter)
    no_encoder: bool = False      # Table 3 ablation: pool the token embeddings, no encoder


def mean_pool(h, lengths, r):
    """h (B, L, d), lengths (B,), r an int or (B,) ratios -> (z (B, C, d) fp32, mask (B, C)),
    C = max over b of ceil(L_b / r_b); window k of example b averages its real tokens k*r_b .. ."""
    B, L, d = h.shape
    r = torch.as_tensor(r, device=h.device).expand(B)
    window = torch.arange(L, device=h.device)[None] // r[:, None]  # (B, L)
    real = torch.arange(L, device=h.device)[None] < lengths[:, None]  # (B, L)
    C = int(((lengths + r - 1) // r).max())
    window = torch.where(real, window, C)  # padding goes to a dropped extra window
    summand = (h * real[..., None]).float()  # summed in fp32: bf16 adds (CUDA's atomic, unordered) round each time
    sums = torch.zeros(B, C + 1, d, device=h.device).scatter_add_(1, window[..., None].expand(B, L, d), summand)
    counts = torch.zeros(B, C + 1, device=h.device).scatter_add_(1, window, real.float())
    z = sums[:, :C] / counts[:, :C].clamp(min=1)[..., None]
    return z, counts[:, :C] > 0


def window_slots(batch, memory, r):
    """(B, L) the memory slot holding each context token: window S_k's slot P + k, after the P prefix slots
    (r an int or (B,); PIC's memory token m_t and chunk c_t alike)."""
    r = torch.as_tensor(r, device=memory.mask.device).expand(len(memory.mask))
    i = torch.arange(batch["context"].shape[1], device=r.device)
    return (len(batch["prefix"]) + i[None] // r[:, None]).clamp(max=memory.n_slots - 1)


class MeanPool(nn.Module):
    Config = MeanPoolConfig
    objectives = ("kd", "qa")
    memory_kind = "embeds"  # what its Memory holds: prefix embeddings
    token_slots = staticmethod(window_slots)  # the slot holding each context token (tiny.py's aid 2 reads it)

    @staticmethod
    def recipe(mcfg):  # the stages on a real checkpoint (train.resolve; the tiny base: TINY over the last)
        return [dict(objective="kd", cite="Table 6; R of §5.1", paper={**TABLE6, "ratio": "4,8,16,32,64,128"})]

    @staticmethod
    def check_config(cfg, mcfg):
        if mcfg.ratio_sampling and len(cfg.ratio.split(",")) < 2:
            raise SystemExit(f"error: --ratio_sampling draws one of several --ratio values per example; --ratio "
                             f"{cfg.ratio} is one")

    TINY = dict(lr=2e-3, max_iters=700, batch_size=8, ratio="4,8,16", lora_r=64, lora_alpha=64)  # rank 16 kept less
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.run = base, cfg, run
        d = base.config.hidden_size
        self.enc_adapter = None if cfg.fixed_encoder or cfg.no_encoder else "encoder"
        self.dec_adapter = None if cfg.fixed_decoder else "decoder"
        for name in filter(None, (self.enc_adapter, self.dec_adapter)):
            base.add_adapter(name, cfg.lora_r, cfg.lora_alpha)
        self.proj = None if cfg.no_linear else nn.Linear(d, d, bias=False)
        if self.proj is not None:  # W = s I (above); --no_encoder pools the embeddings themselves: s = 1
            s = 1.0 if cfg.no_encoder else base.model.embed_tokens.input_std() / base.model.norm.gain_rms()
            with torch.no_grad():
                self.proj.weight.copy_(s * torch.eye(d))

    def encode(self, batch):
        """Bidirectional encoder over the context (or its token embeddings, --no_encoder): (B, L, d)."""
        ctx, lengths = batch["context"], batch["context_len"]
        if self.cfg.no_encoder:
            return self.base.model.embed_tokens(ctx)
        real = torch.arange(ctx.shape[1], device=ctx.device)[None] < lengths[:, None]
        with self.base.adapter(self.enc_adapter):
            return self.base(ctx, mask=kernels.bidirectional(real), output="hidden")

    def pool(self, h, batch, r):
        z, mask = mean_pool(h, batch["context_len"], r)
        if self.proj is not None:
            z = self.proj(z.to(self.proj.weight.dtype))
        return behind_prefix(self.base, batch["prefix"], z, mask)

    def compress(self, batch, ratio):
        return self.pool(self.encode(batch), batch, ratio)

    def decode_hidden(self, memory, ids):  # [memory, ids] -> (B, T, d)
        with self.base.adapter(self.dec_adapter):
            return self.base(ids, memory=memory, output="hidden")

    def forward(self, batch, ratios):
        """Training loss: (sum over answer tokens and ratios, n answer tokens, metrics)."""
        h = self.encode(batch)  # one encoder pass serves every ratio (eq. 6)
        labels = batch["qa_labels"]
        teacher = teacher_attn = None
        if self.aid is not None:  # one teacher pass for both
            teacher, teacher_attn = self.aid.teacher(batch)
        elif self.run.objective == "kd":
            with torch.no_grad(), self.base.adapter(None):
                teacher = self.base(batch["full"], output="hidden")[batch["full_labels"] != -100]  # (N, d)
        groups = ratios
        if self.cfg.ratio_sampling:  # Table 3: one ratio per example, (B,); no per-ratio metrics
            groups = [torch.tensor([random.choice(ratios) for _ in range(h.shape[0])], device=h.device)]
        total, metrics = 0.0, {}
        memories = [self.pool(h, batch, r) for r in groups]
        stack = self.aid is None and not self.base.config.sliding_window  # the aid reads each ratio's own pass
        for r, memory, hs in zip(groups, memories, decode_each(self.decode_hidden, memories, batch["qa"], stack)):
            if self.run.objective == "kd":
                loss, n = self.base.kd(hs[labels != -100], teacher)
            else:
                loss, n = self.base.ce(hs, labels)
            if not torch.is_tensor(r):
                metrics[f"loss_r{r}"] = loss.item() / max(n, 1)
            if teacher_attn is not None:
                attn_loss = self.aid.memory_loss(teacher_attn, memory, batch, r)
                loss = loss + n * attn_loss
                if not torch.is_tensor(r):
                    metrics[f"attn_r{r}"] = attn_loss.item()
            total = total + loss
        return total, n, metrics


def main():
    """Print which window each token of a toy context falls into."""
    L, r = 11, 4
    z, _ = mean_pool(torch.eye(L)[None], torch.tensor([L]), r)
    print(f"mean pooling, L={L}, r={r}: row k = memory slot z_k, column i = context token i")
    print("\n".join("".join("#" if w > 0 else "." for w in row) for row in z[0]))


if __name__ == "__main__":
    main()
