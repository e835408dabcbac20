"""Sentence-anchored gist tokens: a KV cache that keeps N_g gists per finished sentence.

Paper: "Sentence-Anchored Gist Compression for Long-Context LLMs" (../shared/papers/sentence_gist.txt), §3,
Tables 1-5, App. A and C.3; SPEC §3.3.

    vocabulary  V + N_g gist tokens g_1..g_Ng, rows ~ N(mu, 1e-5 Sigma) of the old rows  (§3.1, mean-resizing)
    placement   t t t .  g_1..g_Ng  t t ?  g_1..g_Ng  t t ...   after every token ending in . ! ?  (§3.2)
    mask        token of sentence s: the tokens of s up to itself + the gists of sentences < s  (§3.3, Fig. 1)
                gist j of s: all of s, g_1..g_j of s (ours: §3.3 is silent), the gists of sentences < s
    loss        L = -sum_t log P(x_t | x_<t, C) over the regular tokens x_t (eq. 1 sums over all t: below)
    memory      K/V of the sink and the gists; ratio = context tokens / slots; stats["gist_rc"] = eq. 2
    answering   (and `qa` training) the same rule: gists after every sentence of prompt and answer, whose
                tokens then leave the cache (sink, gists, open sentence stay)

Choices the paper leaves open (or that differ from it), made here:
- The base is shared, not resized: the gist rows are this method's Parameter (N_g, d), id V + j embeds as row j,
  mean-resized as Hewitt (2021), whom §3.1 cites: 1e-5 Sigma; never targets: no LM-head rows (§3.1 adds them).
- A sentence ends at a token ending in . ! ? (or ." .)), judged alone as generation must (3.14, U.S. split).
- Targets (App. C.3): a sentence's final gist predicts the next one's first token, its last token and other gists
  nothing: each regular token once, our reading of Fig. 2's "no Gist Tokens" (perplexity: of a second half here).
- The prefix (BOS, chat header) is an attention sink, kept and seen by all. Gists take position ids. A guard (not
  in the paper) ends a sentence at `max_sentence_len` tokens, and a context's end its last (a question follows).
- Stages (§3.5, `recipe`): 1 the gist rows; 2 and every weight (`--lora_r 0`; `--lora_r R`: a LoRA `gist`); 3 as 2,
  lr to 0; one command runs all three, `--stage N` one; text: --pretrain_data / --data (the paper's: FineWeb-Edu).
- Objectives: `lm` (the paper's), `qa` (the tiny base's, with tiny.py's aids). Ablations: --gists, --stage (T4-5).
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
    stage: int = 2              # 1 gist rows only | 2 gist rows + the base (LoRA or all) | 3 as 2, lr linearly down
    lora_r: int = 16            # LoRA `gist` on the shared base; 0 = every weight trains in stages 2-3 (§3.5)
    lora_alpha: int = 32        # LoRA scale alpha / r


def mean_resize(weight, n, generator=None):
    """n new rows ~ N(mu, 1e-5 Sigma) of weight (V, d) (Hewitt 2021) -> (n, d) fp32; mu alone where Sigma is
    singular (V <= d), as HF's mean_resizing does."""
    w = weight.detach().float()
    mu, cov = w.mean(0), torch.cov(w.T, correction=0)  # (d,), (d, d)
    scale, info = torch.linalg.cholesky_ex(1e-5 * cov)
    z = torch.randn(n, w.shape[1], generator=generator).to(w.device)
    return mu + z @ scale.T if int(info) == 0 else mu.repeat(n, 1)


def insert_gists(ids, is_end, n_gists, max_sentence_len, run=0, close=False):
    """Gists after every sentence end: ids (T,) -> (new_ids, sentence, kind, src), each (T'). Gist j is id V + j
    (V = len(is_end)); sentences count from 0 and own their gists; src: the index in ids of the token whose target
    a position carries (-1: none; a final gist: its sentence's last token's). A sentence also ends at
    max_sentence_len tokens (`run` of them came before ids) and, if close, where ids end."""
    ids = torch.as_tensor(ids, dtype=torch.long).cpu()
    V, last, new, sent, kind, src, s = len(is_end), len(ids) - 1, [], [], [], [], 0
    for i, (t, end) in enumerate(zip(ids.tolist(), is_end[ids].tolist())):
        new.append(t), sent.append(s), kind.append(TOKEN), src.append(i)
        run += 1
        if end or run == max_sentence_len or (close and i == last):
            new, src[-1] = new + list(range(V, V + n_gists)), -1
            sent, kind, src = sent + [s] * n_gists, kind + [GIST] * n_gists, src + [-1] * (n_gists - 1) + [i]
            s, run = s + 1, 0
    return tuple(torch.tensor(x, dtype=torch.long) for x in (new, sent, kind, src))


def sentence_mask(sentence, kind):
    """mask_mod over (B, T) sentence ids and kinds (§3.3): causal; a key is seen when it is in the query's
    sentence or is a gist (of earlier sentences, or g_1..g_j of its own) or the sink; padding (PAD) never."""
    sentence, kind = kernels.bucketed(sentence), kernels.bucketed(kind)

    def mask_mod(b, h, q_idx, kv_idx):
        seen = (sentence[b, q_idx] == sentence[b, kv_idx]) | (kind[b, kv_idx] > 0)
        return (kind[b, kv_idx] != PAD) & (kv_idx <= q_idx) & seen
    mask_mod.__name__ = "sentence_mask"
    return kernels.every_causal_block(mask_mod)  # gists in every block: flex skips only the blocks above


def layout(rows, is_end, n_gists, max_sentence_len, labels=None, device="cpu", multiple=64, runs=None):
    """rows: per example (prefix, body, tail) id lists. prefix = sink (sentence 0); body gets gists (sentences 1..),
    its end ending a sentence; tail (prompt + answer) gets gists, may end unfinished, its first sentence has runs[b]
    tokens before it (in a cache). labels: targets of prefix + body + tail, moved as insert_gists says. -> (B, T)
    ids, sentence, kind (PAD on padding), labels; (B,) length, open (the last sentence if unfinished, else next)."""
    full = lambda n, v: torch.full((n,), v, dtype=torch.long)  # noqa: E731
    cols, opens = {k: [] for k in ("ids", "sentence", "kind", "labels")}, []
    for b, (prefix, body, tail) in enumerate(rows):
        P, N = len(prefix), len(body)
        ids, sent, kind, src = insert_gists(body, is_end, n_gists, max_sentence_len, close=True)
        t_ids, t_sent, t_kind, t_src = insert_gists(tail, is_end, n_gists, max_sentence_len, runs[b] if runs else 0)
        src = torch.cat([torch.arange(P), torch.where(src >= 0, src + P, -1),
                         torch.where(t_src >= 0, t_src + P + N, -1)])
        lab = torch.as_tensor(labels[b]).cpu() if labels is not None else full(P + N + len(tail), -100)
        cols["ids"].append(torch.cat([torch.as_tensor(prefix, dtype=torch.long).cpu(), ids, t_ids]))
        cols["sentence"].append(torch.cat([full(P, 0), sent + 1, t_sent + (int(sent[-1]) + 2 if N else 1)]))
        cols["kind"].append(torch.cat([full(P, SINK), kind, t_kind]))
        cols["labels"].append(torch.where(src >= 0, lab[src.clamp(min=0)], -100))
        opens.append(int(cols["sentence"][-1][-1]) + int(cols["kind"][-1][-1] != TOKEN))
    lengths = [len(x) for x in cols["ids"]]
    T, pad = -(-max(lengths) // multiple) * multiple, {"ids": 0, "sentence": -1, "kind": PAD, "labels": -100}
    out = {k: torch.stack([torch.cat([x, full(T - len(x), pad[k])]) for x in v]).to(device) for k, v in cols.items()}
    return dict(out, length=torch.tensor(lengths, device=device), open=torch.tensor(opens, device=device),
                is_gist=out["kind"] == GIST, is_token=out["kind"] == TOKEN)


def keep_slots(kv, keep, *more):
    """The slots where keep (B, S) holds, in order, left-aligned: per-layer (k, v), each (B, Hkv, S, hd) ->
    (B, Hkv, C, hd), C the most kept in a row; keep and more (B, S) -> (B, C)."""
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)[:, :int(keep.sum(1).max())]  # (B, C)
    at = lambda x: x.gather(2, order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))  # noqa: E731
    return ([(at(k), at(v)) for k, v in kv], *(t.gather(1, order) for t in (keep, *more)))


class SentenceGist(nn.Module):
    Config = SentenceGistConfig
    objectives = ("lm", "qa")
    memory_kind = "kv"  # what its Memory holds: per-layer K/V
    STAGE_FLAGS = ("stage",)  # what a later stage may change
    full_finetuning = True  # --lora_r 0: every weight trains in stages 2-3 (§3.5)
    token_slots = None  # a gisted token is held by its sentence's gists: tiny.py's aid reads the layout instead
    TINY = dict(objective="qa", stage=2, gists=2, lr=4e-3, max_iters=700, batch_size=16, grad_accum=4, grad_clip=1.0,
                warmup_frac=0.1, max_context=1024, lora_r=16)

    @staticmethod
    def recipe(mcfg):  # Table 3, App. A (wd 0.1): `lm` on 4,096 text tokens (before gists); ratio "1": check_config
        table3 = ((1, 1000, 64, 1e-4, 0.5, 100, 1.0), (2, 9000, 128, 1e-4, 0.5, 1000, 2.0),  # stage, steps, batch,
                  (3, 2000, 512, 5e-5, 0.0, 100, 2.0))  # peak lr, end lr / peak, warmup steps, clip
        return [dict(objective="lm", cite="Table 3, App. A", name=f"stage{stage}", paper=dict(
            weight_decay=0.1, ratio="1", max_context=4096, lora_r=0, stage=stage, max_iters=steps, batch_size=batch,
            lr=lr, min_lr_frac=end, warmup_frac=warmup / steps, grad_clip=clip))
            for stage, steps, batch, lr, end, warmup, clip in table3]
    aid = None  # tiny.AttentionDistillation, set by train.py on the tiny base

    def __init__(self, base, cfg, tok, run):
        super().__init__()
        self.base, self.cfg, self.tok, self.run, self.V = base, cfg, tok, run, base.config.vocab_size
        ends = [t.rstrip().rstrip("\"')]”’»").endswith((".", "!", "?")) for t in tok.token_texts()[:self.V]]
        self.is_end = torch.tensor(ends + [False] * (self.V - len(ends)))  # (V,): ends in . ! ? (§3.2), or ." .) ?"
        g = torch.Generator().manual_seed(run.seed)  # same rows on every DDP rank
        self.gist = nn.Parameter(mean_resize(base.model.embed_tokens.weight, cfg.gists, g))  # (N_g, d)
        self.trains_base = cfg.lora_r == 0  # §3.5: stage 2 "unfreeze all parameters", 3 as 2 (eval.py: teacher apart)
        self.dec_adapter = None if self.trains_base else "gist"  # the one adapter: it reads (and writes) gists
        if self.dec_adapter:
            base.add_adapter("gist", cfg.lora_r, cfg.lora_alpha)
        for name, p in base.named_parameters():  # stage 1: the gist rows alone; then the adapter, or every weight
            p.requires_grad_(cfg.stage >= 2 and (self.trains_base or ".lora_" in name))
        self.lr_schedule = "linear" if cfg.stage == 3 else "cosine"  # for train.py: stage 3 decays linearly

    @staticmethod
    def check_config(cfg, mcfg):
        if mcfg.gists not in (1, 2, 4, 8):
            raise SystemExit(f"error: --gists {mcfg.gists}: choose 1, 2, 4 or 8 (the paper's N_g)")
        if mcfg.stage not in (1, 2, 3):
            raise SystemExit(f"error: --stage {mcfg.stage}: choose 1 (gist rows), 2 (+ the base) or 3 (cool-down)")
        if mcfg.max_sentence_len < 1:
            raise SystemExit(f"error: --max_sentence_len {mcfg.max_sentence_len} must be >= 1")
        for flag, ratio in (("ratio", cfg.ratio), ("eval_ratio", cfg.eval_ratio or "1")):
            if {int(r) for r in ratio.split(",")} != {1}:  # ("01" is 1)
                raise SystemExit(f"error: --{flag} {ratio} does not apply to --method sentence_gist: its ratio "
                                 "is achieved (context tokens / kept slots); choose --gists 1, 2, 4 or 8")

    def layout(self, rows, labels=None, multiple=None, runs=None):
        return layout(rows, self.is_end, self.cfg.gists, self.cfg.max_sentence_len, labels, self.gist.device,
                      multiple or self.run.pad_multiple, runs)

    def embed(self, ids):
        """(B, T) ids, gist j = V + j -> (B, T, d); F.embedding, not gist[ids]: tiny.head_log_attention."""
        is_gist, gist_ids = ids >= self.V, (ids - self.V).clamp(0, self.cfg.gists - 1)
        e = self.base.model.embed_tokens(ids.masked_fill(is_gist, 0))  # (B, T, d)
        scale = self.base.model.embed_tokens.scale or 1.0  # rows live in weight space, as the vocabulary's (Gemma)
        g = nn.functional.embedding(gist_ids, (self.gist * scale).to(e.dtype))  # (B, T, d); always in the graph (DDP)
        return torch.where(is_gist[..., None], g, e)

    def hidden(self, L, memory=None, return_kv=False):
        """Final hidden states of a layout under the sentence mask (after a memory if given)."""
        with self.base.adapter(self.dec_adapter):
            return self.base(embeds=self.embed(L["ids"]), mask=sentence_mask(L["sentence"], L["kind"]),
                             memory=memory, return_kv=return_kv, output="hidden")

    def prefix(self):
        return [self.tok.bos_id] if self.tok.bos_id is not None else []

    def forward(self, batch, ratios):
        """(sum of CE, n targets, metrics): `lm` every regular token of collate_lm text (eq. 1); `qa` the answer."""
        if self.run.objective == "lm":
            P = len(self.prefix())  # collate_lm starts every row with bos
            rows = [(r[:P], r[P:n], []) for r, n in zip(batch["ids"].tolist(), batch["lengths"].tolist())]
            labels = [lab[:n] for lab, n in zip(batch["labels"], batch["lengths"].tolist())]
        else:
            ctx = [c[:n].tolist() for c, n in zip(batch["context"], batch["context_len"])]
            rows = [(batch["prefix"], c, qa[:n].tolist()) for c, qa, n in zip(ctx, batch["qa"], batch["qa_len"])]
            labels = [[-100] * (len(batch["prefix"]) + len(c)) + lab[:n].tolist()
                      for c, lab, n in zip(ctx, batch["qa_labels"], batch["qa_len"])]
        L = self.layout(rows, labels)
        loss, n = self.base.ce(self.hidden(L), L["labels"])
        if self.aid is not None and "full" in batch:  # tiny.py's aid: the teacher's attention over the layout
            loss = loss + n * self.aid.layout_loss(self.aid.teacher(batch)[1], L, batch)
        gists_per_token = (L["kind"] == GIST).sum().item() / max(1, (L["kind"] == TOKEN).sum().item())
        return loss, n, {"gists_per_token": gists_per_token}

    def keep(self, L, kv):
        """Memory of a prefilled layout whose last sentence is finished: the sink and the gists (eq. 2: gist_rc)."""
        kv, mask = keep_slots(kv, L["kind"] > 0)
        memory = Memory(kv=kv, mask=mask, next_pos=L["length"])
        memory.stats = {"gist_rc": ((L["kind"] == TOKEN).sum(1) / (L["kind"] == GIST).sum(1).clamp(min=1)).tolist()}
        return memory

    def compress(self, batch, ratio=None):
        """Prefill prefix + context under the sentence mask; keep the sink and the gists."""
        L = self.layout([(batch["prefix"], c[:n].tolist(), []) for c, n in zip(batch["context"], batch["context_len"])])
        return self.keep(L, self.hidden(L, return_kv=True)[1])

    def extend(self, cache, is_open, id_lists):
        """Feed each row's ids, gisted, after the cache, continuing its open sentence (slots is_open (B, C)) ->
        ((B, V) logits of each row's last position, the cache less the ended sentences' tokens, its is_open)."""
        L = self.layout([([], [], x) for x in id_lists], multiple=1, runs=is_open.sum(1).tolist())
        if (is_open.any(1) & ((L["kind"] == TOKEN) & (L["sentence"] > 1)).any(1)).any():  # all cached slots are seen
            raise ValueError("extend: ids that end the cache's open sentence and begin another: feed them in two calls")
        h, kv = self.hidden(L, memory=cache, return_kv=True)
        ended = ((L["kind"] == GIST) & (L["sentence"] == 1)).any(1, keepdim=True)  # (B, 1) the cache's open sentence
        new_open = (L["kind"] == TOKEN) & (L["sentence"] == L["open"][:, None])
        keep = torch.cat([cache.mask & ~(is_open & ended), (L["kind"] == GIST) | new_open], 1)
        kv, mask, is_open = keep_slots(kv, keep, torch.cat([is_open & ~ended, new_open], 1))
        logits = self.base.logits(h[torch.arange(len(h), device=h.device), L["length"] - 1])  # (B, V)
        return logits, Memory(kv=kv, mask=mask, next_pos=cache.next_pos + L["length"]), is_open

    @torch.no_grad()
    def answer_from_memory(self, memory, prompts, max_new_tokens, stop):
        """Greedy answers (each before a `stop` id) under the answering rule (ours; §3.3 gives the mask): the prompt,
        then each answer token, extends the cache (= one pass over the gisted prompt and answer, sentence mask)."""
        eos, out, done = set(stop), [[] for _ in prompts], [False] * len(prompts)
        logits, cache, is_open = self.extend(memory, torch.zeros_like(memory.mask), prompts)
        for i in range(max_new_tokens):
            tok = logits.argmax(-1).tolist()  # (B,)
            done = [d or t in eos for d, t in zip(done, tok)]
            out = [o if d else o + [t] for o, d, t in zip(out, done, tok)]
            if all(done) or i + 1 == max_new_tokens:
                break
            logits, cache, is_open = self.extend(cache, is_open, [[t] for t in tok])
        return out

    def teacher_forced(self, memory, qa, labels):  # eval.py's answer NLL (App. C.1 scores answers by perplexity)
        L = self.layout([([], [], x) for x in qa], labels, multiple=1, runs=[0] * len(qa))
        return self.hidden(L, memory=memory), L["labels"]

    def heldout_metrics(self, texts, base):  # eval.py's extra columns: perplexity from the cache, and from `base`
        return {f"ppl_{k}": v for k, v in perplexity(self, texts, base).items() if k != "tokens"}


@torch.no_grad()
def perplexity(method, texts, base=None):
    """Perplexity of each text's second half (cut at the sentence end nearest the middle) given (a) "full": the first
    half read by `base` (eval.py's: as loaded; default the method's), no adapter, no gists; (b) "none": no first half
    (`base` reads the prefix, or an end of text; ours: the floor a cache must beat); (c) "compressed": its cache, the
    second half gisted, a sentence's first token scored from its gist (App. C.3). "ratio": tokens / slots."""
    base, ce, dev = method.base if base is None else base, torch.nn.functional.cross_entropy, method.gist.device
    nll, count, ratios = {"full": 0.0, "none": 0.0, "compressed": 0.0}, 0, []
    for text in texts:
        prefix, body = method.prefix(), method.tok.encode(text)
        _, _, kind, src = insert_gists(body, method.is_end, method.cfg.gists, method.cfg.max_sentence_len)
        ends = [s + 1 for k, s in zip(kind.tolist(), src.tolist()) if k == GIST and 0 <= s < len(body) - 1]
        if not ends:
            continue  # one sentence: no second half
        cut, P = min(ends, key=lambda e: abs(e - len(body) / 2)), len(prefix)
        ids, target = torch.tensor([prefix + body], device=dev), torch.tensor(body[cut:], device=dev)  # (1, P + N)
        alone = torch.tensor([(prefix or method.tok.eos_ids[:1]) + body[cut:]], device=dev)
        with base.adapter(None):
            nll["full"] += ce(base(ids)[0, P + cut - 1:-1].float(), target, reduction="sum").item()
            nll["none"] += ce(base(alone)[0, -len(target) - 1:-1].float(), target, reduction="sum").item()
        L1 = method.layout([(prefix, body[:cut], [])])
        L2 = method.layout([([], [], body[cut:])], [body[cut + 1:] + [-100]])
        h1, kv = method.hidden(L1, return_kv=True)
        memory = method.keep(L1, kv)
        h2 = method.hidden(L2, memory=memory)[0][L2["labels"][0] != -100]
        h = torch.cat([h1[0, L1["length"][0] - 1, None], h2])  # the first half's final gist, then the second half
        nll["compressed"] += ce(method.base.logits(h).float(), target, reduction="sum").item()
        count, ratios = count + len(target), ratios + [(P + cut) / memory.slots().item()]
    out = {k: torch.tensor(v / max(count, 1)).exp().item() for k, v in nll.items()}
    return dict(out, ratio=sum(ratios) / max(len(ratios), 1), tokens=count) if count else {"tokens": 0}  # (not ppl 1)


def main():
    """Print the sentence mask for a toy input (N_g = 2, a sink, one unfinished sentence)."""
    words = ["<s>", "The", "sun", "shone", ".", "Birds", "sang", "!", "It", "was", "g1", "g2"]  # gist j: id 10 + j
    L = layout([([0], list(range(1, 8)), [8, 9])], torch.tensor([w in ".!" for w in words[:10]]), 2, 64, multiple=1)
    grid = kernels.draw(sentence_mask(L["sentence"], L["kind"]), int(L["length"][0])).splitlines()
    print("sentence mask, N_g = 2: row = query, column = key; in the cache while answering: *")
    print("\n".join(f"{words[i]:>6} {row}" for i, row in zip(L["ids"][0].tolist(), grid)))
    print("       " + "".join("*" if k else " " for k in ((L["kind"] > 0) | (L["sentence"] == L["open"][:, None]))[0]))


if __name__ == "__main__":
    main()
