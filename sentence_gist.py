"""Sentence-anchored gist tokens: a KV cache that keeps N_g gists per finished sentence.

Paper: "Sentence-Anchored Gist Compression for Long-Context LLMs"
(../shared/papers/sentence_gist.txt), §3, Tables 1-4; SPEC §3.3.

    vocabulary  V + N_g gist tokens g_1..g_Ng, rows ~ N(mu, Sigma) of the old rows   (§3.1, mean-resizing)
    placement   t t t .  g_1..g_Ng  t t ?  g_1..g_Ng  t t ...   after every token ending in . ! ?  (§3.2)
    mask        token of sentence s: the tokens of s up to itself + the gists of sentences < s  (§3.3, Fig. 1)
                gist j of s: all of s, g_1..g_j of s, the gists of sentences < s; causal overall
    loss        L = -sum_t log P(x_t | x_<t, C) over regular tokens                         (eq. 1)
    memory      K/V of the gists of finished sentences + the tokens of the unfinished one;
                ratio = context tokens / kept slots (eval.py); memory.stats["gist_rc"] = eq. 2

Choices the paper leaves open (or that differ from it), made here:
- The shared base is not resized: the gist rows are this method's own Parameter (N_g, d)
  and the input embeddings are built here (embed_tokens for ids < V, row j for id V + j).
  Gists are inserted by rule and never predicted, so the softmax stays over the original
  V and no LM-head rows are added, tied head or not (the same as gist logits = -inf; the
  paper resizes the head and scores gists in its PG19 perplexity, App. C.3).
- Sigma = covariance of the old rows + 1e-4 * mean variance * I (jitter, so it is PSD).
- Targets: every regular token predicts the next regular token, across the gists (the
  last token of a sentence predicts the first of the next); gists have no target.
- The sequence prefix (BOS, chat header) is an attention sink: kept in the cache and seen
  by every later token. Gists take position ids (positions run over the gisted sequence).
- A hard cap inserts gists after `max_sentence_len` tokens without punctuation (guard).
- Question and answer continue the unfinished sentence with no gists inserted: they see
  the whole cache causally, in `qa` training and in `answer` (base.generate with the
  cache as Memory). No gists are inserted into the generated answer (short answers).
- Stages (§3.5, `--stage`): 1 gist rows only; 2 gist rows + LoRA adapter `gist` (the paper
  finetunes every weight; the base is shared here); 3 as 2 with `lr_schedule = "linear"`
  (to 0) for train.py. Chain them with --init_from: --stage 1, then --stage 2
  --init_from out/stage1, then --stage 3 --init_from out/stage2 (--lr 5e-5, Table 3).
- Objectives: `lm` (the paper's; the default on real checkpoints) and `qa` (CE on the
  answer given the gisted context and the prompt; the default on the tiny base, whose
  eval is QA F1). --ratio does not apply (the ratio is achieved, not asked for): any
  value but 1 is an error.
- `perplexity(method, texts)`: ppl of each text's second half given the full first half
  (plain base) or its compressed cache; the halves split at the sentence end nearest
  the middle, so that cache holds only the sink and gists.
On the tiny base, tiny.py's aids apply (curriculum, attention distillation onto a token's
sentence gists; `qa` only).
Ablation flags: --gists (Tables 1-2), --stage (Tables 4-5), --max_sentence_len.
`python sentence_gist.py` prints the mask of a toy input.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn

import kernels
from model import Memory

PAD, TOKEN, GIST, SINK = -1, 0, 1, 2  # token kinds


@dataclass
class SentenceGistConfig:
    gists: int = 4              # N_g gist tokens after every sentence: 1, 2, 4 or 8 (Tables 1-2)
    max_sentence_len: int = 64  # guard (not in the paper): gists after this many tokens without . ! ?
    stage: int = 2              # 1 gist rows only | 2 gist rows + LoRA | 3 as 2, lr decays linearly to 0
    lora_r: int = 16            # LoRA `gist` on the shared base (the paper finetunes every weight)
    lora_alpha: int = 32        # LoRA scale alpha / r


def mean_resize(weight, n, generator=None):
    """n new rows ~ N(mu, Sigma) of the rows of weight (V, d) (Hewitt 2021) -> (n, d) fp32."""
    w = weight.detach().float()
    mu, cov = w.mean(0), torch.cov(w.T)  # (d,), (d, d)
    cov = cov + 1e-4 * cov.diagonal().mean() * torch.eye(w.shape[1], device=w.device)
    dist = torch.distributions.MultivariateNormal(mu, covariance_matrix=cov)
    z = torch.randn(n, w.shape[1], generator=generator).to(w.device)
    return mu + z @ dist.scale_tril.T


def sentence_ends(tok, V):
    """(V,) bool: the token's text, trailing whitespace stripped, ends in . ! or ? (§3.2)."""
    texts = tok.token_texts()[:V]
    return torch.tensor([t.rstrip().endswith((".", "!", "?")) for t in texts] + [False] * (V - len(texts)))


def insert_gists(ids, is_end, n_gists, max_sentence_len):
    """Gists after every sentence end: ids (T,) -> (new_ids, sentence, kind, src), each (T',).
    Gist j is id V + j (V = len(is_end)); sentences count from 0 and own their gists; kind
    is TOKEN or GIST; src is each token's index in ids (-1 for gists). A sentence also ends
    after max_sentence_len tokens without punctuation (the guard)."""
    ids = torch.as_tensor(ids, dtype=torch.long).cpu()
    V, new, sent, kind, src = len(is_end), [], [], [], []
    s = run = 0
    for i, (t, end) in enumerate(zip(ids.tolist(), is_end[ids].tolist())):
        new.append(t), sent.append(s), kind.append(TOKEN), src.append(i)
        run += 1
        if end or run == max_sentence_len:
            new += range(V, V + n_gists)
            sent, kind, src = sent + [s] * n_gists, kind + [GIST] * n_gists, src + [-1] * n_gists
            s, run = s + 1, 0
    return tuple(torch.tensor(x, dtype=torch.long) for x in (new, sent, kind, src))


def sentence_mask(sentence, kind):
    """mask_mod over (B, T) sentence ids and kinds (§3.3): causal, and a key is seen when it
    is in the query's sentence or is a gist or the sink; padding (PAD) is never seen."""
    def mask_mod(b, h, q_idx, kv_idx):
        causal = kv_idx <= q_idx
        same_sentence = sentence[b, q_idx] == sentence[b, kv_idx]
        kept = kind[b, kv_idx] > 0  # gists of earlier sentences (and g_1..g_j of its own), the sink
        return (kind[b, kv_idx] != PAD) & causal & (same_sentence | kept)
    mask_mod.__name__ = "sentence_mask"
    return mask_mod


def layout(rows, is_end, n_gists, max_sentence_len, labels=None, device="cpu", multiple=64):
    """rows: per example (prefix, body, tail) id lists. prefix = sink (sentence 0); body gets
    gists (sentences 1..); tail continues the open sentence with no gists. labels: per
    example targets of prefix + body + tail, moved with their tokens (-100 on gists).
    Returns (B, T) ids, sentence, kind (PAD on padding), labels; (B,) length and open (the
    sentence a continuation joins)."""
    cols, lengths, opens = {k: [] for k in ("ids", "sentence", "kind", "labels")}, [], []
    full = lambda n, v: torch.full((n,), v, dtype=torch.long)  # noqa: E731
    for b, (prefix, body, tail) in enumerate(rows):
        ids, sent, kind, src = insert_gists(body, is_end, n_gists, max_sentence_len)
        P, N, n_tail = len(prefix), len(body), len(tail)
        open_ = int(sent[-1]) + 1 + int(kind[-1] == GIST) if len(ids) else 1
        src = torch.cat([torch.arange(P), torch.where(src >= 0, src + P, -1), torch.arange(P + N, P + N + n_tail)])
        cols["ids"].append(torch.cat([torch.as_tensor(prefix, dtype=torch.long).cpu(), ids,
                                      torch.as_tensor(tail, dtype=torch.long).cpu()]))
        cols["sentence"].append(torch.cat([full(P, 0), sent + 1, full(n_tail, open_)]))
        cols["kind"].append(torch.cat([full(P, SINK), kind, full(n_tail, TOKEN)]))
        lab = torch.as_tensor(labels[b] if labels is not None else full(P + N + n_tail, -100)).cpu()
        cols["labels"].append(torch.where(src >= 0, lab[src.clamp(min=0)], -100))
        lengths.append(len(src)), opens.append(open_)
    T = -(-max(lengths) // multiple) * multiple
    pad = {"ids": 0, "sentence": -1, "kind": PAD, "labels": -100}
    out = {k: torch.stack([torch.cat([x, full(T - len(x), pad[k])]) for x in v]).to(device) for k, v in cols.items()}
    return dict(out, length=torch.tensor(lengths, device=device), open=torch.tensor(opens, device=device))


class SentenceGist(nn.Module):
    Config = SentenceGistConfig
    objectives = ("lm", "qa")
    # Table 3 / App. A (stage 1-2 values; stage 3: --lr 5e-5 --grad_clip 2). ratio "1": see check_config
    PAPER = dict(lr=1e-4, min_lr_frac=0.5, warmup_frac=0.1, weight_decay=0.1, grad_clip=1.0, ratio="1")
    TINY = dict(objective="qa", lr=2e-3, max_iters=300, batch_size=16)
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.tok, self.run = base, cfg, tok, run
        self.V = base.config.vocab_size
        self.is_end = sentence_ends(tok, self.V)  # (V,) bool on the CPU, where insert_gists runs
        g = torch.Generator().manual_seed(run.seed)  # same rows on every DDP rank
        self.gist = nn.Parameter(mean_resize(base.model.embed_tokens.weight, cfg.gists, g))  # (N_g, d)
        base.add_adapter("gist", cfg.lora_r, cfg.lora_alpha)
        for n, p in base.named_parameters():
            if n.endswith("lora_A.gist") or n.endswith("lora_B.gist"):
                p.requires_grad_(cfg.stage >= 2)
        self.lr_schedule = "linear" if cfg.stage == 3 else "cosine"  # for train.py: stage 3 decays to 0

    @staticmethod
    def check_config(cfg, mcfg):
        if mcfg.gists not in (1, 2, 4, 8):
            raise SystemExit(f"error: --gists {mcfg.gists}: choose 1, 2, 4 or 8 (the paper's N_g)")
        if mcfg.stage not in (1, 2, 3):
            raise SystemExit(f"error: --stage {mcfg.stage}: choose 1 (gist rows), 2 (+ LoRA) or 3 (cool-down)")
        if mcfg.max_sentence_len < 1:
            raise SystemExit(f"error: --max_sentence_len {mcfg.max_sentence_len} must be >= 1")
        if cfg.ratio != "1":
            raise SystemExit(f"error: --ratio {cfg.ratio} does not apply to --method sentence_gist: its ratio "
                             "is achieved (context tokens / kept slots); choose --gists 1, 2, 4 or 8")

    # --- layout, embeddings, one forward -------------------------------------

    def layout(self, rows, labels=None):
        return layout(rows, self.is_end, self.cfg.gists, self.cfg.max_sentence_len, labels, self.gist.device)

    def embed(self, ids):
        """(B, T) ids, gist j = V + j -> (B, T, d) input embeddings; the base is not resized."""
        is_gist = ids >= self.V
        e = self.base.model.embed_tokens(ids.masked_fill(is_gist, 0))  # (B, T, d)
        g = self.gist.to(e.dtype)[(ids - self.V).clamp(0, self.cfg.gists - 1)]  # (B, T, d); always in the graph (DDP)
        return torch.where(is_gist[..., None], g, e)

    def hidden(self, L, memory=None, return_kv=False):
        """Final hidden states of a layout under the sentence mask (after a memory if given)."""
        with self.base.adapter("gist"):
            return self.base(embeds=self.embed(L["ids"]), mask=sentence_mask(L["sentence"], L["kind"]),
                             memory=memory, return_kv=return_kv, output="hidden")

    def prefix(self):
        return [self.tok.bos_id] if self.tok.bos_id is not None else []

    def forward(self, batch, ratios):
        """Training loss: (sum of CE over targets, n targets, metrics). `lm`: collate_lm text,
        every regular token predicts the next one (eq. 1); `qa`: the answer tokens."""
        if self.run.objective == "lm":
            P = len(self.prefix())  # collate_lm starts every row with bos
            rows = [(r[:P], r[P:n], []) for r, n in zip(batch["ids"].tolist(), batch["lengths"].tolist())]
            labels = [lab[:n] for lab, n in zip(batch["labels"], batch["lengths"].tolist())]
        else:
            rows, labels = [], []
            for b in range(len(batch["qa"])):
                ctx, n_qa = batch["context"][b, :batch["context_len"][b]].tolist(), int(batch["qa_len"][b])
                rows.append((batch["prefix"], ctx, batch["qa"][b, :n_qa].tolist()))
                labels.append([-100] * (len(batch["prefix"]) + len(ctx)) + batch["qa_labels"][b, :n_qa].tolist())
        teacher_attn = self.aid.teacher(batch)[1] if self.aid is not None and "full" in batch else None
        L = self.layout(rows, labels)
        loss, n = kernels.chunked_ce(self.hidden(L), self.base.lm_head.weight, L["labels"])
        if teacher_attn is not None:
            loss = loss + n * self.aid.layout_loss(teacher_attn, L, batch)
        return loss, n, {"gists_per_token": (L["kind"] == GIST).sum().item() / max(1, (L["kind"] == TOKEN).sum().item())}

    # --- compressed cache ----------------------------------------------------

    def keep(self, L, kv):
        """Memory of the kept slots of a prefilled layout: the sink, the gists, and the tokens
        of the open (unfinished) sentence, in order, at their positions."""
        keep = (L["kind"] > 0) | ((L["kind"] == TOKEN) & (L["sentence"] == L["open"][:, None]))  # (B, T)
        C = int(keep.sum(1).max())
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :C]  # (B, C) kept positions first
        kv = [tuple(x.gather(2, order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])) for x in pair)
              for pair in kv]  # each (B, Hkv, C, hd)
        memory = Memory(kv=kv, mask=keep.gather(1, order), next_pos=L["length"])
        n_tok, n_gist = ((L["kind"] == TOKEN).sum(1), (L["kind"] == GIST).sum(1))
        memory.stats = {"gist_rc": (n_tok.float() / n_gist.clamp(min=1)).tolist()}  # paper eq. 2
        return memory

    def compress(self, batch, ratio=None):
        """Prefill prefix + context under the sentence mask and keep the cache's slots."""
        rows = [(batch["prefix"], batch["context"][b, :batch["context_len"][b]].tolist(), [])
                for b in range(len(batch["context"]))]
        L = self.layout(rows)
        _, kv = self.hidden(L, return_kv=True)
        return self.keep(L, kv)

    @torch.no_grad()
    def answer_from_memory(self, memory, prompts, max_new_tokens):
        with self.base.adapter("gist"):
            return self.base.generate(prompts, max_new_tokens, memory=memory)

    def heldout_metrics(self, texts):
        """eval.py's extra columns for this method: perplexity with the compressed cache."""
        ppl = perplexity(self, texts)
        return {"ppl_full": ppl["full"], "ppl_compressed": ppl["compressed"], "ppl_ratio": ppl["ratio"]}


@torch.no_grad()
def perplexity(method, texts):
    """Perplexity of each text's second half, given (a) "full": the whole first half, plain
    base (no adapter, no gists) and (b) "compressed": the cache of the first half (sink and
    gists only: the cut is the sentence end nearest the middle), the second half gisted
    under the sentence mask. Both score the same tokens; "ratio" = first-half tokens / slots."""
    base, tok, ce = method.base, method.tok, torch.nn.functional.cross_entropy
    dev = method.gist.device
    nll, count, ratios = {"full": 0.0, "compressed": 0.0}, 0, []
    for text in texts:
        prefix, body = method.prefix(), tok.encode(text)
        _, _, kind, src = insert_gists(body, method.is_end, method.cfg.gists, method.cfg.max_sentence_len)
        ends = [int(src[i]) + 1 for i in range(len(kind) - 1) if kind[i] == TOKEN and kind[i + 1] == GIST]
        ends = [e for e in ends if e < len(body)]
        if not ends:
            continue  # one sentence: no second half
        cut = min(ends, key=lambda e: abs(e - len(body) / 2))
        ids = torch.tensor([prefix + body], device=dev)  # (1, P + N)
        P, target = len(prefix), ids[0, len(prefix) + cut:]
        with base.adapter(None):
            logits = base(ids)[0, P + cut - 1:-1]
        nll["full"] += ce(logits.float(), target, reduction="sum").item()
        L1 = method.layout([(prefix, body[:cut], [])])
        h1, kv = method.hidden(L1, return_kv=True)
        memory = method.keep(L1, kv)
        last = int((L1["kind"][0] == TOKEN).nonzero()[-1])  # the first half's last token predicts body[cut]
        L2 = method.layout([([], body[cut:], [])], [body[cut + 1:] + [-100]])
        h2 = method.hidden(L2, memory=memory)
        h = torch.cat([h1[0, last:last + 1], h2[0][L2["labels"][0] != -100]])
        nll["compressed"] += ce(base.lm_head(h).float(), target, reduction="sum").item()
        count += len(target)
        ratios.append((P + cut) / memory.slots().item())
    out = {k: torch.tensor(v / max(count, 1)).exp().item() for k, v in nll.items()}
    return dict(out, ratio=sum(ratios) / max(len(ratios), 1), tokens=count)


def main():
    """Print the sentence mask for a toy input (N_g = 2, a sink, one unfinished sentence)."""
    words = ["<s>", "The", "sun", "shone", ".", "Birds", "sang", "!", "It", "was"]
    is_end = torch.tensor([w in ".!" for w in words])
    L = layout([([0], list(range(1, len(words))), [])], is_end, 2, 64, multiple=1)
    names = [words[i] if i < len(words) else f"g{i - len(words) + 1}" for i in L["ids"][0].tolist()]
    grid = kernels.dense_mask(sentence_mask(L["sentence"], L["kind"]), 1, len(names), len(names), "cpu")[0, 0]
    print("sentence mask, N_g = 2: row = query, column = key; kept in the cache: *")
    keep = ((L["kind"] > 0) | (L["sentence"] == L["open"][:, None]))[0]
    for name, row in zip(names, grid.tolist()):
        print(f"{name:>6} " + "".join("#" if x else "." for x in row))
    print("       " + "".join("*" if k else " " for k in keep.tolist()))


if __name__ == "__main__":
    main()
