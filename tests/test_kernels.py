"""kernels.py: mask builders against hand-written grids, the attention backends against
each other, and the chunked losses (values and gradients) against their naive twins."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

import kernels

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

N_B, N_T, D, V = 2, 7, 16, 11  # 14 tokens in chunks of 3: five chunks, the last one short



@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(kernels, "CHUNK", 3)


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def labels_with_ignores(seed=0):
    labels = torch.randint(0, V, (N_B, N_T), generator=torch.Generator().manual_seed(seed))
    labels[0, :2] = -100
    labels[1, 5] = -100
    return labels


# -----------------------------------------------------------------------------
# masks and attention


def test_dense_mask_literal_grids():
    key_valid = torch.tensor([[True, False, True, True, True]])
    grid = kernels.dense_mask(kernels.causal_after_prefix(2, key_valid), 1, 3, 5, "cpu")
    assert grid.shape == (1, 1, 3, 5)
    assert grid[0, 0].int().tolist() == [[1, 0, 1, 0, 0],
                                         [1, 0, 1, 1, 0],
                                         [1, 0, 1, 1, 1]]
    doc = torch.tensor([[0, 0, 1, 1, 1]])

    def document(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx])
    assert kernels.dense_mask(document, 1, 5, 5, "cpu")[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                                                                 [1, 1, 0, 0, 0],
                                                                                 [0, 0, 1, 0, 0],
                                                                                 [0, 0, 1, 1, 0],
                                                                                 [0, 0, 1, 1, 1]]
    # 2 prefix keys (the second invalid) before 3 new keys seen bidirectionally (the last is padding)
    m = kernels.with_prefix(kernels.bidirectional(torch.tensor([[True, True, False]])), 2,
                            torch.tensor([[True, False]]))
    assert kernels.dense_mask(m, 1, 3, 5, "cpu")[0, 0].int().tolist() == [[1, 0, 1, 1, 0]] * 3
    # with_prefix of causal: the decoding step after a 2-key cache
    m = kernels.with_prefix(kernels.causal, 2, torch.tensor([[True, True]]))
    assert kernels.dense_mask(m, 1, 2, 4, "cpu")[0, 0].int().tolist() == [[1, 1, 1, 0],
                                                                         [1, 1, 1, 1]]


def test_sliding_window_literal_grids():
    # causal, window 3: the query and the 2 keys before it (HF: kv_idx > q_idx - 3)
    m = kernels.and_masks(kernels.causal, kernels.sliding_window(3))
    assert kernels.dense_mask(m, 1, 5, 5, "cpu")[0, 0].int().tolist() == [[1, 0, 0, 0, 0],
                                                                         [1, 1, 0, 0, 0],
                                                                         [1, 1, 1, 0, 0],
                                                                         [0, 1, 1, 1, 0],
                                                                         [0, 0, 1, 1, 1]]
    # 2 decoding queries behind a 3-key prefix (the first invalid), window 3
    m = kernels.and_masks(kernels.causal_after_prefix(3, torch.tensor([[False, True, True, True, True]])),
                          kernels.sliding_window(3, 3))
    assert kernels.dense_mask(m, 1, 2, 5, "cpu")[0, 0].int().tolist() == [[0, 1, 1, 1, 0],
                                                                         [0, 0, 1, 1, 1]]
    # bidirectional, window 2: symmetric
    m = kernels.and_masks(kernels.bidirectional(torch.ones(1, 4, dtype=torch.bool)), kernels.sliding_window(2))
    assert kernels.dense_mask(m, 1, 4, 4, "cpu")[0, 0].int().tolist() == [[1, 1, 0, 0],
                                                                         [1, 1, 1, 0],
                                                                         [0, 1, 1, 1],
                                                                         [0, 0, 1, 1]]


@pytest.mark.parametrize("cap", [None, 1.5])
@pytest.mark.parametrize("backend", ["dense", "flex"])
def test_attention_backends_match_reference(monkeypatch, backend, cap):
    """GQA attention under a document mask with one fully masked query row, against a
    hand-rolled softmax(QK^T / sqrt(hd)) V with K/V repeated per head; the empty row gives 0.
    With cap: the scores soft-capped (cap * tanh(s / cap)) by a score_mod, at scale 0.3.
    Dense (flex has no CPU backward): the reference's gradients too, finite with the empty row."""
    monkeypatch.setattr(kernels, "BACKEND", backend)
    B, H, Hkv, Q, hd = 2, 4, 2, 20, 8
    q, k, v = rand(B, H, Q, hd, seed=0), rand(B, Hkv, Q, hd, seed=1), rand(B, Hkv, Q, hd, seed=2)
    for t in (q, k, v):
        t.requires_grad_(backend == "dense")
    doc = torch.tensor([[0] * 8 + [1] * 12, [0] * 3 + [1] * 17])
    valid = torch.ones(B, Q, dtype=torch.bool)
    valid[1, 3] = False  # example 1, query 3 starts a document with an invalid key: sees nothing

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (doc[b, q_idx] == doc[b, kv_idx]) & valid[b, kv_idx]
    scale = 0.3 if cap else hd ** -0.5
    out = kernels.attention(q, k, v, kernels.Mask(mask_mod, B, Q, Q, q.device), scale,
                            kernels.softcap(cap) if cap else None)
    dense = kernels.dense_mask(mask_mod, B, Q, Q, "cpu")
    kr, vr = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    scores = q @ kr.transpose(-1, -2) * scale
    scores = (cap * torch.tanh(scores / cap) if cap else scores).masked_fill(~dense, float("-inf"))
    ref = torch.nan_to_num(scores.softmax(-1)) @ vr
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert out[1, :, 3].abs().max() == 0
    if backend == "dense":
        w = rand(*out.shape, seed=3)
        grads = torch.autograd.grad((out * w).sum(), (q, k, v))
        for g, g_ref in zip(grads, torch.autograd.grad((ref * w).sum(), (q, k, v))):
            assert torch.isfinite(g).all()
            torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)
    # mask=None is plain causal
    torch.testing.assert_close(kernels.attention(q, k, v), kernels.attention(
        q, k, v, kernels.Mask(kernels.causal, B, Q, Q, q.device)), atol=1e-5, rtol=1e-5)


def test_dense_bias_is_one_tensor_with_aligned_rows():
    """The additive form SDPA gets: 0 where the mask sees, -inf elsewhere, one tensor for every layer's call (autograd
    keeps one), rows strided by a multiple of 16 keys (the memory-efficient kernel takes it without padding a copy)."""
    mask = kernels.Mask(kernels.causal, 2, 20, 20, "cpu")
    bias = mask.bias(torch.bfloat16)
    assert bias is mask.bias(torch.bfloat16) and bias.dtype == torch.bfloat16 and bias.shape == (2, 1, 20, 20)
    assert bias.stride(-2) % 16 == 0 and bias.stride(0) % 16 == 0
    assert torch.equal(bias == 0, mask.dense()[0]) and torch.isinf(bias[~mask.dense()[0]]).all()


def test_every_causal_block_lists_the_blocks_create_block_mask_needs(monkeypatch):
    """A mask marked every_causal_block (sentence_gist's) gets every block on or below the diagonal as a partial
    block, built without evaluating the mask: a superset of what create_block_mask finds, none above the diagonal,
    and flex over it gives the dense path's attention (CPU flex: forward only), padding rows included."""
    import sentence_gist as sg
    B, H, T, hd = 2, 2, 300, 8  # 3 blocks of 128 after padding; the last 20 positions of example 1 are PAD
    g = torch.Generator().manual_seed(0)
    kind = (torch.rand(B, T, generator=g) < 0.05).long()
    sentence = kind.cumsum(1)
    kind[1, -20:] = sg.PAD
    mask_mod = sg.sentence_mask(sentence, kind)
    block = kernels.Mask(mask_mod, B, T, T, torch.device("cpu")).block()
    assert block.kv_num_blocks[:, 0].tolist() == [[1, 2, 3]] * B and block.full_kv_num_blocks is None
    found = create_block_mask(kernels.padded(mask_mod, T, T, "cpu"), B, None, 384, 384, device="cpu")
    assert (found.kv_num_blocks + found.full_kv_num_blocks <= block.kv_num_blocks).all()
    q, k, v = rand(B, H, T, hd, seed=3), rand(B, H, T, hd, seed=4), rand(B, H, T, hd, seed=5)
    outs = {}
    for backend in ("dense", "flex"):
        monkeypatch.setattr(kernels, "BACKEND", backend)
        outs[backend] = kernels.attention(q, k, v, kernels.Mask(mask_mod, B, T, T, q.device))
    torch.testing.assert_close(outs["flex"], outs["dense"], atol=1e-5, rtol=1e-5)


def every_mask(S, B=2):
    """[(name, mask_mod, Q)] of every method's flex masks over S keys, padding in example 1: closures of length S."""
    import ata
    import pic
    import sac
    import sentence_gist as sg
    valid = torch.arange(S)[None].expand(B, S) < torch.tensor([[S], [S - 9]])
    P, L = 5, S * 16 // 17
    z, _ = pic.layout(torch.tensor([L, L - 9]), L, [16])
    kind = (torch.arange(S) % 10 == 9).long()[None].expand(B, S)
    return [("bidirectional", kernels.bidirectional(valid), S), ("sac causal", sac.sac_encoder_mask(valid, True), S),
            ("causal_after_prefix", kernels.causal_after_prefix(P, valid), S - P),
            ("with_prefix", kernels.with_prefix(kernels.causal, P, valid[:, :P]), S - P),
            ("ata", ata.encoder_mask(valid), S), ("sentence_gist", sg.sentence_mask(kind.cumsum(1), kind), S),
            *((f"pic {k}", pic.MASKS[k](z), z["valid"].shape[1]) for k in pic.MASKS)]


def test_one_compiled_flex_graph_serves_every_length_of_a_bucket(monkeypatch):
    """A mask's closure tensors are shaped per bucket (kernels.bucketed), like the padded q/k/v, so compiled flex
    (dynamic=False, dynamo's shape guards) compiles each mask once for every length of a 128-token bucket, not once
    per length: a real run's batches have as many lengths as batches. The graphs are counted, not compiled."""
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention
    B, H, hd = 2, 2, 8
    monkeypatch.setattr(kernels, "BACKEND", "flex")
    for i, (name, _, _) in enumerate(every_mask(200)):
        counter = CompileCounter()
        monkeypatch.setattr(kernels, "_compiled_flex", kernels.compiled(flex_attention, backend=counter))
        for S in (200, 208, 251):  # one bucket: 256 keys
            _, mask_mod, Q = every_mask(S)[i]
            q, k, v = rand(B, H, Q, hd, seed=1), rand(B, H, S, hd, seed=2), rand(B, H, S, hd, seed=3)
            kernels.attention(q, k, v, kernels.Mask(mask_mod, B, Q, S, q.device))
        assert counter.frame_count == 1, f"{name}: {counter.frame_count} graphs for one bucket"
    torch._dynamo.reset()


# -----------------------------------------------------------------------------
# chunked losses == naive twins, values and gradients


def grads(loss_fn, *tensors):
    ts = [t.detach().clone().requires_grad_(rg) for t, rg in tensors]
    loss = loss_fn(*ts)
    (0.5 * loss).backward()  # not 1: the backward must scale by the upstream gradient
    return loss.detach(), [None if t.grad is None else 2 * t.grad for t in ts]


@pytest.mark.parametrize("freeze_head", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_chunked_ce_matches_naive(small_chunks, freeze_head, weighted):
    h, w = rand(N_B, N_T, D, seed=0), rand(V, D, seed=1, scale=0.5)
    labels = labels_with_ignores()
    weights = rand(N_B, N_T, seed=2).abs() if weighted else None
    n = int((labels != -100).sum())
    assert n == 11 and kernels.chunked_ce(h, w, labels, weights)[1] == n
    got, (gh, gw) = grads(lambda h, w: kernels.chunked_ce(h, w, labels, weights)[0], (h, True), (w, not freeze_head))
    ref, (rh, rw) = grads(lambda h, w: kernels.naive_ce(h, w, labels, weights), (h, True), (w, not freeze_head))
    # the oracle's oracle: plain cross entropy
    plain = F.cross_entropy((h @ w.T).flatten(0, 1), labels.flatten(), reduction="none")
    plain = (plain * (1 if weights is None else weights.flatten())).sum()
    torch.testing.assert_close(ref, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-5)
    assert gh[0, :2].abs().max() == 0  # ignored positions get no gradient
    if freeze_head:
        assert gw is None
    else:
        torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)


def test_chunked_ce_weights_respected(small_chunks):
    h, w = rand(N_B, N_T, D, seed=0), rand(V, D, seed=1)
    labels = labels_with_ignores()
    weights = torch.ones(N_B, N_T)
    weights[1] = 0.0
    only0 = labels.clone()
    only0[1] = -100
    torch.testing.assert_close(kernels.chunked_ce(h, w, labels, weights)[0], kernels.chunked_ce(h, w, only0)[0])
    torch.testing.assert_close(kernels.chunked_ce(h, w, labels, 2 * torch.ones(N_B, N_T))[0],
                               2 * kernels.chunked_ce(h, w, labels)[0])


@pytest.mark.parametrize("freeze_head", [False, True])
def test_chunked_kd_matches_naive(small_chunks, freeze_head):
    h, w = rand(N_B, N_T, D, seed=0), rand(V, D, seed=1, scale=0.5)
    th, tw = rand(N_B, N_T, 24, seed=3), rand(V, 24, seed=4, scale=0.5)  # a wider teacher
    labels = labels_with_ignores()
    got, (gh, gw) = grads(lambda h, w: kernels.chunked_kd(h, w, th, tw, labels)[0], (h, True), (w, not freeze_head))
    ref, (rh, rw) = grads(lambda h, w: kernels.naive_kd(h, w, th, tw, labels), (h, True), (w, not freeze_head))
    plain = F.kl_div(torch.log_softmax(h @ w.T, -1), torch.log_softmax(th @ tw.T, -1), log_target=True,
                     reduction="none").sum(-1)
    torch.testing.assert_close(ref, (plain * (labels != -100)).sum(), atol=1e-5, rtol=1e-5)
    assert ref > 1.0
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-5)
    if freeze_head:
        assert gw is None
    else:
        torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)


def test_chunked_losses_softcap(small_chunks):
    """Final logit soft-capping (Gemma 2): chunked == naive == plain CE / KL of capped logits."""
    h, w = rand(N_B, N_T, D, seed=0), rand(V, D, seed=1, scale=2.0)  # logits well past the cap
    th, tw = rand(N_B, N_T, D, seed=3), rand(V, D, seed=4, scale=2.0)
    labels, cap = labels_with_ignores(), 3.0
    capped = lambda h, w: cap * torch.tanh(h @ w.T / cap)  # noqa: E731
    plain = F.cross_entropy(capped(h, w).flatten(0, 1), labels.flatten(), reduction="sum")
    torch.testing.assert_close(kernels.naive_ce(h, w, labels, softcap=cap), plain, atol=1e-4, rtol=1e-5)
    assert (plain - kernels.naive_ce(h, w, labels)).abs() > 1.0  # the cap matters here
    for fn, naive in ((lambda h, w: kernels.chunked_ce(h, w, labels, softcap=cap)[0],
                       lambda h, w: kernels.naive_ce(h, w, labels, softcap=cap)),
                      (lambda h, w: kernels.chunked_kd(h, w, th, tw, labels, softcap=cap)[0],
                       lambda h, w: kernels.naive_kd(h, w, th, tw, labels, softcap=cap))):
        got, (gh, gw) = grads(fn, (h, True), (w, True))
        ref, (rh, rw) = grads(naive, (h, True), (w, True))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(gh, rh, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(gw, rw, atol=1e-5, rtol=1e-5)


def test_chunked_kd_zero_when_student_is_teacher(small_chunks):
    h, w = rand(N_B, N_T, D, seed=0), rand(V, D, seed=1)
    labels = labels_with_ignores()
    loss, (gh, gw) = grads(lambda h, w: kernels.chunked_kd(h, w, h.detach(), w.detach(), labels)[0], (h, True), (w, True))
    assert abs(loss.item()) < 1e-5
    assert gh.abs().max() < 1e-6 and gw.abs().max() < 1e-6


def test_chunked_losses_bf16(small_chunks):
    h, w = rand(N_B, N_T, D, seed=0), rand(V, D, seed=1, scale=0.5)
    th, tw = rand(N_B, N_T, D, seed=3), rand(V, D, seed=4, scale=0.5)
    labels = labels_with_ignores()
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    ce = kernels.chunked_ce(hb, wb, labels)[0]
    ce.backward()
    assert ce.dtype == torch.float32 and hb.grad.dtype == wb.grad.dtype == torch.bfloat16
    _, (rh, rw) = grads(lambda h, w: kernels.naive_ce(h, w, labels), (h, True), (w, True))
    torch.testing.assert_close(ce, kernels.naive_ce(h, w, labels), atol=0.05, rtol=0.02)
    torch.testing.assert_close(hb.grad.float(), rh, atol=0.02, rtol=0.05)
    torch.testing.assert_close(wb.grad.float(), rw, atol=0.02, rtol=0.05)
    kd = kernels.chunked_kd(hb, wb, th.bfloat16(), tw.bfloat16(), labels)[0]
    torch.testing.assert_close(kd, kernels.naive_kd(h, w, th, tw, labels), atol=0.05, rtol=0.02)


def test_losses_stay_fp32_under_autocast():
    """The chunked losses compute logits and gradients in fp32 even inside bf16 autocast
    (issue: `h.float() @ w.float().T` ran in bf16 there)."""
    torch.manual_seed(0)
    h, w = torch.randn(24, 32, requires_grad=True), torch.randn(50, 32, requires_grad=True)
    t, labels = torch.randn(24, 32), torch.randint(0, 50, (24,))
    naive_ce = F.cross_entropy(h @ w.T, labels, reduction="sum")
    naive_kd = F.kl_div(torch.log_softmax(h @ w.T, -1), torch.log_softmax(t @ w.T, -1), log_target=True, reduction="sum")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, _ = kernels.chunked_ce(h[None], w, labels[None])
        kd, _ = kernels.chunked_kd(h, w, t, w)
    assert torch.allclose(ce, naive_ce, rtol=1e-5) and torch.allclose(kd, naive_kd, rtol=1e-5)
    g, = torch.autograd.grad(ce, h)
    g_naive, = torch.autograd.grad(naive_ce, h)
    assert torch.allclose(g, g_naive, rtol=1e-4, atol=1e-5)


def test_chunked_losses_use_tf32_only_for_16_bit_inputs(monkeypatch):
    """TF32 (CUDA matmuls) inside the loss when h, w and the teacher are all bf16, where it is
    exact for the logits; plain fp32 when any input is fp32; the caller's setting restored."""
    seen, run = [], kernels._ChunkedLoss._run
    monkeypatch.setattr(kernels._ChunkedLoss, "_run",
                        staticmethod(lambda *a: seen.append(torch.backends.cuda.matmul.allow_tf32) or run(*a)))
    h, w, labels = rand(N_B, N_T, D, seed=0), rand(V, D, seed=1), labels_with_ignores()
    before = torch.backends.cuda.matmul.allow_tf32
    kernels.chunked_ce(h.bfloat16(), w.bfloat16(), labels)
    kernels.chunked_kd(h.bfloat16(), w.bfloat16(), h.bfloat16(), w.bfloat16(), labels)
    kernels.chunked_ce(h, w, labels)
    kernels.chunked_kd(h.bfloat16(), w.bfloat16(), h, w, labels)  # an fp32 teacher: fp32 throughout
    assert seen == [True, True, False, False] and torch.backends.cuda.matmul.allow_tf32 == before
