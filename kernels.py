"""The fast paths: attention dispatch, mask builders and chunked losses (SPEC §2.2, §5).

A method writes its attention pattern once, as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` with
tensor indexing only (no Python ``if`` on values: the dense builder calls it once on broadcast index grids).
``Mask`` makes it a flex ``BlockMask`` (compiled layers on CUDA) or a dense boolean mask for SDPA (eager runs,
generation, and the CPU, which has no flex backward).
The losses take final hidden states and the LM head, never logits: fp32 logits exist one chunk of tokens at a
time, the gradient is computed in the forward and only scaled in the backward. ``naive_ce`` / ``naive_kd``
are the slow twins the tests compare against.

Legend: B batch, H/Hkv heads, Q query tokens, S key tokens, hd head dim, N tokens, d width, V vocab.
"""
import torch
import torch.nn.functional as F

BACKEND = None  # the one override: None = pick by device; "dense" or "flex" forces a backend (tests)
# Flex pads queries and keys to a multiple of BLOCK: one compiled (dynamic=False) graph serves a bucket of
# lengths. A mask_mod's (B, N) tensors are padded so too (bucketed), and its ints go in as 0-d tensors: dynamo
# guards their shapes and values, and would recompile for every new length or int.
BLOCK = 128
GRAPHS = 64  # graphs one compiled function may hold: see compiled()
_compiled_flex = _compiled_block_mask = None  # built once, on the first CUDA call


def bucket(n):
    return -(-n // BLOCK) * BLOCK


def compiled(fn, backend="inductor", dynamic=False, mode=None):
    """torch.compile(fn): one graph per query bucket x key bucket x mask_mod x batch size, more than dynamo's
    default limit of 8 (flex then runs unfused): raised to GRAPHS for these calls only (a scoped config.patch)."""
    fn = torch.compile(fn, dynamic=dynamic, backend=backend, mode=mode)
    return torch._dynamo.config.patch(recompile_limit=GRAPHS)(fn)


class CUDAGraphed:
    """fn(*args) replayed as a CUDA graph, one per shapes of its tensor args (other args are part of the key and
    kept as they are). A new shape's call runs fn on a side stream (the warm-up: compiles, allocates; its result is
    returned) and captures it; later calls copy their tensors into the captured inputs and replay. A replay
    returns the graph's own output tensors, which the next replay overwrites. Off CUDA, fn itself."""

    def __init__(self, fn):
        self.fn, self.graphs = fn, {}

    def __call__(self, *args):
        if not any(torch.is_tensor(t) and t.is_cuda for t in args):
            return self.fn(*args)
        key = tuple((t.shape, t.dtype) if torch.is_tensor(t) else t for t in args)
        if key in self.graphs:
            graph, inputs, out = self.graphs[key]
            for buf, t in zip(inputs, args):
                if torch.is_tensor(t):
                    buf.copy_(t)
            graph.replay()
            return out
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            out = self.fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        inputs, graph = [t.clone() if torch.is_tensor(t) else t for t in args], torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the kernels, runs none
            self.graphs[key] = graph, inputs, self.fn(*inputs)
        return out


def _flex(q, k, v, block_mask, scale=None, score_mod=None):
    """q (B, H, Q, hd), k/v (B, Hkv, S, hd) padded to the block mask's bucketed sizes."""
    from torch.nn.attention.flex_attention import flex_attention  # here: it imports dynamo, ~1 s a CPU process
    global _compiled_flex
    if _compiled_flex is None and q.device.type == "cuda":
        _compiled_flex = compiled(flex_attention)
    fn = _compiled_flex or flex_attention  # CPU: eager, unless a test installs a compiled one
    Q, (Qp, Sp) = q.shape[2], block_mask.seq_lengths
    q = F.pad(q, (0, 0, 0, Qp - Q)).contiguous()  # one layout, one graph: a zero pad keeps the strides
    k, v = (F.pad(t, (0, 0, 0, Sp - t.shape[2])).contiguous() for t in (k, v))
    return fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=True)[:, :, :Q]


# -----------------------------------------------------------------------------
# mask_mods shared by several methods


def named(fn, name):  # mask_mods carry a readable name (compile logs, composed names)
    fn.__name__ = name
    return fn


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def causal_after_prefix(prefix_len, key_valid):
    """Queries (the last Q of S keys) see valid keys (key_valid (B, S)): all prefix_len first, the rest causally."""
    P = torch.full((), prefix_len, device=key_valid.device)  # not an int: see BLOCK
    key_valid = bucketed(key_valid)

    def mask_mod(b, h, q_idx, kv_idx):
        return key_valid[b, kv_idx] & (kv_idx <= q_idx + P)
    return named(mask_mod, f"causal_after_prefix_{prefix_len}")


def bidirectional(key_valid):
    """Every token sees every valid token (padding is never seen)."""
    key_valid = bucketed(key_valid)

    def mask_mod(b, h, q_idx, kv_idx):
        return key_valid[b, kv_idx] & (q_idx >= 0)
    return named(mask_mod, "bidirectional")


def with_prefix(mask_mod, prefix_len, prefix_valid):
    """mask_mod shifted behind a prefix of prefix_len keys, seen where prefix_valid (B, P) is True (decoding)."""
    last = torch.full((), prefix_len - 1, device=prefix_valid.device)  # not an int: see BLOCK
    prefix_valid = bucketed(prefix_valid)

    def shifted(b, h, q_idx, kv_idx):
        kv_new = (kv_idx - last - 1).clamp(min=0)
        return torch.where(kv_idx <= last, prefix_valid[b, torch.minimum(kv_idx, last)], mask_mod(b, h, q_idx, kv_new))
    return named(shifted, f"prefix_{prefix_len}_{getattr(mask_mod, '__name__', 'mask')}")


def sliding_window(window, prefix_len=0):
    """Keys fewer than `window` slots (padding and memory included, as HF counts) from the query, the queries
    being the last Q of S = prefix_len + Q keys (an int or 0-d tensor). With causal: HF's kv_idx > q_idx - window."""
    def mask_mod(b, h, q_idx, kv_idx):
        dist = q_idx + prefix_len - kv_idx
        return (dist < window) & (dist > -window)
    return named(mask_mod, f"sliding_window_{window}")


def and_masks(*mask_mods):
    """A key is seen where every mask_mod sees it."""
    def mask_mod(b, h, q_idx, kv_idx):
        out = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out
    return named(mask_mod, "_and_".join(getattr(m, "__name__", "mask") for m in mask_mods))


def softcap(cap):
    """score_mod: Gemma 2's attention logit soft-capping (as HF: after the 1/sqrt scaling, before the mask)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return soft_cap(score, cap)
    return named(score_mod, f"softcap_{cap}")


def soft_cap(logits, cap):
    """cap * tanh(logits / cap) (Gemma 2); cap None/0: unchanged."""
    return cap * torch.tanh(logits / cap) if cap else logits


def bucketed(t):
    """A tensor a mask_mod indexes by position, (B, N) -> (B, bucket(N)), zero (False) after N: shaped per bucket
    like q/k/v (see BLOCK). Nothing reads the padding: padded() clamps the indices, dense_mask stays below N."""
    return F.pad(t, (0, bucket(t.shape[1]) - t.shape[1]))


def padded(mask_mod, Q, S, device):
    """mask_mod over Q and S padded to buckets: padding keys are never seen; padding queries (their rows
    are dropped) and keys read clamped, in-range indices."""
    q_last, s_last = torch.full((), Q - 1, device=device), torch.full((), S - 1, device=device)

    def mask_mod_padded(b, h, q_idx, kv_idx):
        return (kv_idx <= s_last) & mask_mod(b, h, torch.minimum(q_idx, q_last), torch.minimum(kv_idx, s_last))
    return named(mask_mod_padded, getattr(mask_mod, "__name__", "mask"))


# -----------------------------------------------------------------------------
# Mask: one mask_mod, several backends


def dense_mask(mask_mod, B, Q, S, device):
    """Evaluate mask_mod on broadcast index grids -> bool (B, 1, Q, S)."""
    b = torch.arange(B, device=device).view(B, 1, 1)
    q_idx = torch.arange(Q, device=device).view(1, Q, 1)
    kv_idx = torch.arange(S, device=device).view(1, 1, S)
    h = torch.zeros(1, 1, 1, dtype=torch.long, device=device)
    return mask_mod(b, h, q_idx, kv_idx).expand(B, Q, S).unsqueeze(1)


def draw(mask_mod, Q, S=None):
    """The mask of example 0 as text: a row per query, '#' where it sees a key (the methods' main())."""
    rows = dense_mask(mask_mod, 1, Q, S or Q, "cpu")[0, 0].tolist()
    return "\n".join("".join("#" if x else "." for x in row) for row in rows)


def every_causal_block(mask_mod):
    """Marks a mask_mod that sees no key after its query and some key in nearly every block on or below the
    diagonal (sentence_gist's: gist columns everywhere). Mask.block then lists those blocks as partial instead of
    evaluating mask_mod over B x Q x S to find them (create_block_mask): flex could skip only the blocks above."""
    mask_mod.every_causal_block = True
    return mask_mod


def causal_blocks(mask_mod, B, n, device):
    """BlockMask of n x n blocks: block (i, j) partial (mask_mod decides inside) where j <= i, absent above."""
    from torch.nn.attention.flex_attention import BlockMask
    rows = torch.arange(n, device=device, dtype=torch.int32)
    kv_num_blocks = (rows + 1).expand(B, 1, n).contiguous()  # (B, 1, n)
    kv_indices = rows.expand(B, 1, n, n).contiguous()  # (B, 1, n, n): row i reads blocks 0..i
    return BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(n * BLOCK, n * BLOCK))


class Mask:
    """An attention pattern for queries (B, Q) over keys (B, S), built lazily per backend, shared by all layers."""

    def __init__(self, mask_mod, B, Q, S, device):
        self.mask_mod, self.B, self.Q, self.S, self.device = mask_mod, B, Q, S, device
        self._dense = self._block = None
        self._bias = {}

    def dense(self):
        """(bool (B, 1, Q, S), bool (B, 1, Q, 1): the query rows that see no key), built once. Those rows see
        every key here and their output is zeroed (attention): no kernel meets a row without keys (NaN)."""
        if self._dense is None:
            dense = dense_mask(self.mask_mod, self.B, self.Q, self.S, self.device)
            blind = ~dense.any(-1, keepdim=True)
            self._dense = dense | blind, blind
        return self._dense

    def bias(self, dtype):
        """The dense mask as SDPA's additive bias (0 / -inf) in the scores' dtype, built once per dtype. Every layer
        passes this one tensor, so autograd keeps one (a bool mask is converted, and kept, by each call). Rows are
        allocated to a multiple of 16 keys and sliced back: the memory-efficient kernel's alignment, with no copy."""
        if dtype not in self._bias:
            dense, _ = self.dense()
            S16 = -(-self.S // 16) * 16
            rows = torch.full((self.B, 1, self.Q, S16), float("-inf"), dtype=dtype, device=self.device)
            self._bias[dtype] = rows[..., :self.S].masked_fill_(dense, 0.0)
        return self._bias[dtype]

    def block(self):
        """BlockMask over (bucket(Q), bucket(S)): compiled on CUDA (never materialises B*Q*S), eager on CPU."""
        from torch.nn.attention.flex_attention import create_block_mask
        global _compiled_block_mask
        if self._block is None:
            if _compiled_block_mask is None and self.device.type == "cuda":
                _compiled_block_mask = compiled(create_block_mask)
            build = _compiled_block_mask or create_block_mask  # CPU: eager, unless a test installs a compiled one
            mask_mod = padded(self.mask_mod, self.Q, self.S, self.device)
            if getattr(self.mask_mod, "every_causal_block", False) and self.Q == self.S:
                self._block = causal_blocks(mask_mod, self.B, bucket(self.Q) // BLOCK, self.device)
            else:
                self._block = build(mask_mod, self.B, None, bucket(self.Q), bucket(self.S), device=self.device)
        return self._block


def attention(q, k, v, mask=None, scale=None, score_mod=None, flex=False):
    """q (B, H, Q, hd), k/v (B, Hkv, S, hd) -> (B, H, Q, hd). mask None = causal with Q == S. scale: of q.k
    (None = 1/sqrt(hd)); score_mod: applied to the scaled scores (softcap).
    flex: a CUDA call of >= 128 queries takes FlexAttention (compiled layers, train.py --compile). Flex compiles
    a kernel and a block mask per length bucket, mask and batch size, seconds each: a long compiled run pays that
    back; an eager run or generation takes SDPA with the dense mask and compiles nothing."""
    if mask is None and score_mod is None:
        return sdpa(q, k, v, is_causal=True, scale=scale)
    if mask is None:
        mask = Mask(causal, q.shape[0], q.shape[2], k.shape[2], q.device)
    if BACKEND == "flex" or (not BACKEND and flex and mask.device.type == "cuda" and mask.Q >= 128):
        return _flex(q, k, v, mask.block(), scale, score_mod)
    dense, blind = mask.dense()
    if score_mod is not None:
        out = scored_attention(q, k, v, dense, scale, score_mod)
    else:
        out = sdpa(q, k, v, attn_mask=mask.bias(q.dtype), scale=scale)
    return out.masked_fill(blind, 0.0)  # a query row that sees no key (padding) gives 0, as flex does


def sdpa(q, k, v, attn_mask=None, **kw):
    """SDPA with GQA. CUDA runs GQA only in flash (bf16 / fp16 or autocast, no mask) or math (fp32 scores): from
    128 queries, K/V repeated go memory-efficient; a decode step's few queries stay in math, not copying the cache
    per layer."""
    gqa = q.shape[1] != k.shape[1]
    half = q.dtype in (torch.float16, torch.bfloat16) or q.is_cuda and torch.is_autocast_enabled("cuda")
    flash = attn_mask is None and half
    if gqa and q.is_cuda and q.shape[2] >= 128 and not flash:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        gqa = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=gqa, **kw)


def scored_attention(q, k, v, dense, scale, score_mod):
    """Dense attention with a score_mod as HF's eager attention: scores in the input dtype, softmax in fp32.
    dense (B, 1, Q, S) bool. GQA by grouping the queries."""
    B, H, Q, hd = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    scale = hd ** -0.5 if scale is None else scale
    s = q.reshape(B, Hkv, H // Hkv * Q, hd) @ k.transpose(-1, -2) * scale  # (B, Hkv, G * Q, S)
    idx = [torch.arange(n, device=q.device) for n in (B, H, Q, S)]
    b, h, q_idx, kv_idx = idx[0][:, None, None, None], idx[1][:, None, None], idx[2][:, None], idx[3]
    s = score_mod(s.view(B, H, Q, S), b, h, q_idx, kv_idx)
    s = s.masked_fill(~dense, torch.finfo(s.dtype).min)  # finite: a row with no key stays NaN-free
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return (p.view(B, Hkv, -1, S) @ v).view(B, H, Q, hd)


# -----------------------------------------------------------------------------
# chunked losses straight from hidden states (SPEC §5)

CHUNK = 512  # tokens per chunk: 512 x 152k fp32 logits = 310 MB; at most 3 such buffers alive (KD)


class _ChunkedLoss(torch.autograd.Function):
    """Sum over tokens of a per-token loss of logits = h @ w.T, with d loss / d (h, w), chunk by chunk. ``kind``
    "ce" (target ids) or "kd" (teacher hidden states + head). ``cap``: Gemma 2's final logit cap, on both."""

    @staticmethod
    def forward(ctx, h, w, weights, kind, target, teacher_h, teacher_w, cap):
        # fp32 even inside autocast. With all inputs 16-bit, TF32 gives the logits exactly (a bf16 value is a
        # TF32 value, the sum is fp32) and the gradients, rounded to bf16 at the end, lose nothing visible.
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = all(
            x.dtype in (torch.bfloat16, torch.float16) for x in (h, w, teacher_h, teacher_w) if x is not None)
        try:
            with torch.autocast(h.device.type, enabled=False):
                return _ChunkedLoss._run(ctx, h, w, weights, kind, target, teacher_h, teacher_w, cap)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32

    @staticmethod
    def _run(ctx, h, w, weights, kind, target, teacher_h, teacher_w, cap):
        h32, w32 = h.float(), w.float()
        tw32 = w32 if teacher_w is w else None if teacher_w is None else teacher_w.float()  # shared: one fp32 head
        grad_h = torch.zeros_like(h32)
        grad_w = torch.zeros_like(w32) if ctx.needs_input_grad[1] else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for s in range(0, h.shape[0], CHUNK):
            hc, wt = h32[s:s + CHUNK], weights[s:s + CHUNK].float()
            z, tanh = hc @ w32.T, None  # (n, V) logits
            if cap:  # soft-capped: cap * tanh(z / cap); tanh kept for the chain rule
                tanh = z.div_(cap).tanh_()
                z = tanh * cap
            logp = torch.log_softmax(z, dim=-1)
            del z
            if kind == "ce":
                tc = target[s:s + CHUNK]
                loss = -logp.gather(1, tc[:, None]).squeeze(1)
                grad_logits = logp.exp_()  # in place, as below: few (n, V) buffers alive at once
                grad_logits[torch.arange(len(tc), device=h.device), tc] -= 1.0
            else:  # KL(teacher || student) = sum p_t (log p_t - log p_s)
                logq = soft_cap(teacher_h[s:s + CHUNK].float() @ tw32.T, cap).log_softmax(-1)
                p_t = logq.exp()
                loss = logq.sub_(logp).mul_(p_t).sum(-1)
                grad_logits = logp.exp_().sub_(p_t)
                del logq, p_t
            total += (loss * wt).sum()
            grad_logits *= wt[:, None]
            if tanh is not None:  # d cap * tanh(z / cap) / dz = 1 - tanh^2
                grad_logits *= tanh.square_().neg_().add_(1)
            del tanh
            grad_h[s:s + CHUNK] = grad_logits @ w32
            if grad_w is not None:
                grad_w += grad_logits.T @ hc
            del logp, grad_logits  # free now, not when the next chunk rebinds the names
        ctx.save_for_backward(grad_h, grad_w)
        ctx.dtypes = h.dtype, w.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = (grad_h * grad_out).to(ctx.dtypes[0])
        gw = None if grad_w is None else (grad_w * grad_out).to(ctx.dtypes[1])
        return gh, gw, None, None, None, None, None, None


def _select(h, labels, weights):
    """Flatten (B, T, d) hidden states and keep the positions with a label != -100."""
    keep = labels.reshape(-1) != -100
    h = h.reshape(-1, h.shape[-1])[keep]
    w = torch.ones(h.shape[0], device=h.device) if weights is None else weights.reshape(-1)[keep]
    return h, labels.reshape(-1)[keep], w, keep


def chunked_ce(h, w_head, labels, weights=None, softcap=None):
    """Summed next-token CE: h (B, T, d) final hidden states, w_head (V, d), labels (B, T) target ids or -100,
    optional per-token weights (B, T). softcap: Gemma 2's final_logit_softcapping. Returns (sum, n_tokens)."""
    h, target, w, _ = _select(h, labels, weights)
    return _ChunkedLoss.apply(h, w_head, w, "ce", target, None, None, softcap), target.numel()


def chunked_kd(h, w_head, teacher_h, teacher_w, labels=None, softcap=None):
    """Summed KL(teacher || student) (meanpool eq. 5). With labels (B, T): h, teacher_h (B, T, d|d_t) aligned,
    the positions with labels != -100 count; without: the selected rows (N, d|d_t). Returns (sum, n_tokens)."""
    if labels is not None:
        h, _, _, keep = _select(h, labels, None)
        teacher_h = teacher_h.reshape(-1, teacher_h.shape[-1])[keep]
    w = torch.ones(h.shape[0], device=h.device)
    return _ChunkedLoss.apply(h, w_head, w, "kd", None, teacher_h.detach(), teacher_w.detach(), softcap), h.shape[0]


def naive_ce(h, w_head, labels, weights=None, softcap=None):
    logits = soft_cap(h.float() @ w_head.float().T, softcap)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="none")
    if weights is not None:
        loss = loss * weights.flatten()
    return loss.sum()


def naive_kd(h, w_head, teacher_h, teacher_w, labels, softcap=None):
    logp = torch.log_softmax(soft_cap(h.float() @ w_head.float().T, softcap), -1)
    logq = torch.log_softmax(soft_cap(teacher_h.float() @ teacher_w.float().T, softcap), -1)
    kl = (logq.exp() * (logq - logp)).sum(-1)
    return (kl * (labels != -100)).sum()
