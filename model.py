"""A Llama-family transformer from scratch, with its own LoRA, prefix memory and greedy generation (SPEC §2.1-2.3).

Families: Llama 2/3/3.1/3.2 (rope scaling llama3 or linear), Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (q_norm/k_norm),
Gemma 2 (as HF: scaled embeddings, (1 + weight) norms, four per layer, GELU-tanh, soft-capped scores and logits).
Module names are the HF checkpoint's but for q/k/v and gate/up, one weight each here (qkv_proj, gate_up_proj):
loading concatenates their tensors, saving splits them, and adapters save in PEFT's format per projection.
One ``forward`` serves encoders (custom masks), decoders (a ``Memory`` as prefix embeddings or K/V) and teachers.
Sliding windows count key slots of [memory, tokens] as HF does (padding included), not position ids.
Legend: B batch, T tokens, C memory slots, d width, H/Hkv heads, hd head dim, V vocab.
"""
import functools
import itertools
import json
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

import kernels

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
UNREAD_PEFT = ("use_dora", "use_rslora", "modules_to_save", "layers_to_transform")  # PEFT options LoRALinear lacks
ROPE_KEYS = {"default": (), "linear": ("factor",),  # the numbers each rope type reads (rope_inv_freq)
             "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# HF Gemma2Config's defaults for keys a gemma2 config.json may leave out
GEMMA2_DEFAULTS = dict(head_dim=256, rms_norm_eps=1e-6, tie_word_embeddings=True, query_pre_attn_scalar=256,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=4096,
                       hidden_activation="gelu_pytorch_tanh")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def id_list(ids, where=""):
    """An eos id or list of ids (None: none) as a list; anything else is a ValueError naming `where`."""
    out = [] if ids is None else [ids] if isinstance(ids, int) else ids
    if not (isinstance(out, list) and all(type(i) is int and i >= 0 for i in out)):
        raise ValueError(f"{where}key 'eos_token_id' is {ids!r:.40}, expected a token id or a list of them")
    return list(out)


def known(what, value, supported, where=""):
    if value not in supported:
        raise ValueError(f"{where}unknown {what} {value!r}; supported: {', '.join(supported)}")


def check_not_a_pipe(path):
    if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):  # (reading a FIFO waits forever)
        raise ValueError(f"{path}: not a regular file (a pipe or device: save it to a file)")


def read_json(path):
    """A JSON file; a broken one is a ValueError naming it and the line."""
    check_not_a_pipe(path)
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text") from None
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply to read") from None


def read_tensors(path, device="cpu"):
    """The tensors of one safetensors file; a missing or broken one is a ValueError naming it."""
    check_not_a_pipe(path)
    try:
        return load_file(path, device=str(device))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


def tensor_names(path):
    """The tensor names of a safetensors file, from its header alone: read_tensors's error where it is broken."""
    check_not_a_pipe(path)
    try:
        with safe_open(path, "pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None


SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


@dataclass
class ModelConfig:
    """Mirrors the HF ``config.json`` keys; head_dim and n_kv_heads are derived."""
    model_type: str = "llama"
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 0      # 0 = num_attention_heads (no GQA)
    head_dim: int = 0                 # 0 = hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict = None         # {"rope_type": "llama3" | "linear", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False      # Llama's flag: bias on q, k, v, o
    mlp_bias: bool = False
    hidden_act: str = "silu"          # Gemma 2's key is hidden_activation
    sliding_window: int = 0           # 0 = none; the window of the layer_types that slide
    layer_types: list = None          # "full_attention" | "sliding_attention" per layer
    query_pre_attn_scalar: float = 0  # 0 = head_dim: scores scaled by its -1/2 power
    attn_logit_softcapping: float = None   # Gemma 2: cap * tanh(score / cap)
    final_logit_softcapping: float = None  # Gemma 2: cap * tanh(logit / cap)
    bos_token_id: int = None
    eos_token_id: list = field(default_factory=list)

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        self.query_pre_attn_scalar = self.query_pre_attn_scalar or self.head_dim
        known("hidden activation", self.hidden_act, ACTIVATIONS)
        if self.layer_types is None:  # HF's defaults: all layers slide, every other one in Gemma 2
            gemma = self.model_type == "gemma2"
            self.layer_types = ["sliding_attention" if self.sliding_window and (i % 2 == 0 or not gemma)
                                else "full_attention" for i in range(self.num_hidden_layers)]
        self.eos_token_id = id_list(self.eos_token_id)

    @classmethod
    def from_json(cls, path):
        raw = read_json(path)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: not a config object")
        for f in fields(cls):  # the scalar keys we read have their field's type (a JSON int is a float too)
            value, want = raw.get(f.name), {float: (int, float)}.get(f.type, f.type)
            if f.type in (int, float, bool, str) and value is not None and (
                    not isinstance(value, want) or (f.type is not bool and isinstance(value, bool))):
                raise ValueError(f"{path}: key {f.name!r} is {value!r}, expected {f.type.__name__}")
        model_type = raw.get("model_type")
        known("model_type", model_type, SUPPORTED_MODEL_TYPES, f"{path}: ")
        for key in SIZES:
            if key not in raw:
                raise ValueError(f"{path}: missing key {key!r}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}  # transformers v5 | v4
        if not isinstance(rope, dict):
            raise ValueError(f"{path}: key 'rope_parameters' is {rope!r:.40}, expected an object")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        known("rope type", rope_type, SUPPORTED_ROPE_TYPES, f"{path}: ")
        for key in ROPE_KEYS[rope_type]:  # (a KeyError or a TypeError at the first step)
            if not (type(rope.get(key)) in (int, float) and rope[key] > 0):
                raise ValueError(f"{path}: rope {rope_type} key {key!r} is {rope.get(key)!r:.40}, expected a number "
                                 "> 0")
        if model_type == "gemma2":  # HF's Gemma 2 reads hidden_activation only
            raw = dict(GEMMA2_DEFAULTS, **raw)
            raw["hidden_act"] = raw["hidden_activation"]
        known("hidden activation", raw.get("hidden_act", "silu"), ACTIVATIONS, f"{path}: ")
        cfg = {f.name: raw[f.name] for f in fields(cls) if raw.get(f.name) is not None}
        cfg["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        cfg["rope_scaling"] = dict(rope, rope_type=rope_type) if rope_type != "default" else None
        for key in (*SIZES, "max_position_embeddings", "rms_norm_eps", "rope_theta", "head_dim", "num_key_value_heads"):
            # (NaN from the first step, a negative dimension)
            if key in cfg and not (type(cfg[key]) in (int, float) and cfg[key] > 0):
                raise ValueError(f"{path}: key {key!r} is {cfg[key]!r}, expected > 0")
        heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
        if heads % kv_heads or cfg.get("head_dim", cfg["hidden_size"] // heads) % 2:  # (SDPA's or rope's traceback)
            raise ValueError(f"{path}: {heads} heads over {kv_heads} K/V heads of head_dim "
                             f"{cfg.get('head_dim', cfg['hidden_size'] // heads)}: want a whole number of query heads "
                             "per K/V head, an even head_dim")
        kinds = cfg.get("layer_types", ["full_attention"] * cfg["num_hidden_layers"])
        if not (isinstance(kinds, list) and len(kinds) == cfg["num_hidden_layers"] and
                set(kinds) <= {"full_attention", "sliding_attention"}):  # (an IndexError, or "bogus" read as full)
            raise ValueError(f"{path}: key 'layer_types' is {kinds!r:.60}, expected full_attention or "
                             f"sliding_attention for each of the {cfg['num_hidden_layers']} layers")
        id_list(cfg.get("eos_token_id"), f"{path}: ")
        cfg.setdefault("tie_word_embeddings", False)  # HF's default when the key is absent
        if model_type in ("qwen2", "qwen3"):  # a window only with use_sliding_window, from max_window_layers on
            if not raw.get("use_sliding_window"):
                cfg.pop("sliding_window", None)
            elif "layer_types" not in cfg:
                first = raw.get("max_window_layers", 28)
                cfg["layer_types"] = ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(cfg["num_hidden_layers"])]
        if model_type == "mistral":
            cfg.pop("layer_types", None)  # HF's Mistral slides on every layer when it has a window
        if model_type == "llama":  # HF's Llama has no window (a config's sliding_window applied one: other logits)
            cfg.pop("sliding_window", None), cfg.pop("layer_types", None)
        if cfg.get("sliding_window", 1) < 1:  # (a negative one masked every key)
            raise ValueError(f"{path}: key 'sliding_window' is {cfg['sliding_window']}, expected > 0 (or null: none)")
        return cls(**cfg)

    def to_json(self):
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["rope_parameters"] = dict(d.pop("rope_scaling") or {"rope_type": "default"}, rope_theta=self.rope_theta)
        if self.model_type in ("qwen2", "qwen3") and self.sliding_window:
            d["use_sliding_window"] = True
        d["sliding_window"] = self.sliding_window or None
        if self.model_type == "gemma2":
            d["hidden_activation"] = d.pop("hidden_act")
        return d


# -----------------------------------------------------------------------------
# Memory: what every compressor hands the decoder (SPEC §2.3)


@dataclass
class Memory:
    """Embedding memory (prepended to the input embeddings) or K/V memory (prefix K/V); ``next_pos``: the position
    id of whatever follows the memory."""
    embeds: torch.Tensor = None        # (B, C, d)
    kv: list = None                    # [(k, v)] per layer, each (B, Hkv, C, hd)
    mask: torch.Tensor = None          # (B, C) bool
    next_pos: torch.Tensor = None      # (B,) long
    origin: dict = None                # eval.py --save_memory's run, method, base, checkpoint (and ata's question)

    def __post_init__(self):
        if self.mask is None:
            ref = self.embeds if self.embeds is not None else self.kv[0][0].transpose(1, 2)  # (B, C, ...)
            self.mask = torch.ones(ref.shape[:2], dtype=torch.bool, device=ref.device)
        if self.next_pos is None:
            self.next_pos = self.mask.sum(-1).long()

    @property
    def n_slots(self):
        return self.mask.shape[1]

    def slots(self):  # (B,) valid slots per example
        return self.mask.sum(-1)

    def bytes_per_slot(self):
        if self.embeds is not None:
            return self.embeds.shape[-1] * self.embeds.element_size()
        return sum(k.shape[1] * k.shape[3] * k.element_size() * 2 for k, _ in self.kv)

    def nbytes(self):  # (B,) bytes of the valid slots of each example
        return self.slots() * self.bytes_per_slot()

    def tensors(self):
        t = {"mask": self.mask, "next_pos": self.next_pos, "embeds": self.embeds}
        for i, (k, v) in enumerate(self.kv or []):
            t[f"k.{i}"], t[f"v.{i}"] = k, v
        return {name: x for name, x in t.items() if x is not None}

    def save(self, path):
        save_file({k: v.detach().contiguous().cpu() for k, v in self.tensors().items()}, path, metadata=self.origin)

    @classmethod
    def load(cls, path, device="cpu"):
        t = read_tensors(path, device)
        if why := saved_memory_error(t):
            raise ValueError(f"{path}: not a saved Memory: {why}")
        kv = [(t[f"k.{i}"], t[f"v.{i}"]) for i in range(sum(k.startswith("k.") for k in t))] or None
        with safe_open(path, "pt") as f:
            origin = f.metadata()
        return cls(embeds=t.get("embeds"), kv=kv, mask=t["mask"], next_pos=t["next_pos"], origin=origin)

    def to(self, dtype):
        kv = [(k.to(dtype), v.to(dtype)) for k, v in self.kv] if self.kv else None
        return Memory(None if self.embeds is None else self.embeds.to(dtype), kv, self.mask, self.next_pos)

    def rows(self, idx):
        """The memories of examples idx ((B',) long), in that order."""
        kv = [(k[idx], v[idx]) for k, v in self.kv] if self.kv else None
        return Memory(None if self.embeds is None else self.embeds[idx], kv, self.mask[idx], self.next_pos[idx])


def saved_memory_error(t):
    """What makes the tensors of a file no Memory.save wrote ("" when nothing): a file of another kind, edited or
    cut, fails here with one line, not deep in a forward pass."""
    if "mask" not in t or "next_pos" not in t:
        return "no mask / next_pos tensors"
    n = sum(k.startswith("k.") for k in t)
    if (n > 0) == ("embeds" in t) or any(f"{x}.{i}" not in t for x in "kv" for i in range(n)):
        return "it should hold embeds or K/V (k.0, v.0, ... a pair per layer), one of them"
    mask, next_pos = t["mask"], t["next_pos"]
    if mask.dtype != torch.bool or mask.dim() != 2 or next_pos.shape != mask.shape[:1] or next_pos.is_floating_point() \
            or (next_pos < 0).any():
        return f"mask {list(mask.shape)} and next_pos {list(next_pos.shape)} should be (B, C) bool, (B,) integers >= 0"
    memory = [t["embeds"]] if n == 0 else [t[f"{x}.{i}"] for i in range(n) for x in "kv"]  # (B, C, d) / (B, Hkv, C, hd)
    if any(x.dim() != (3 if n == 0 else 4) or x.shape != memory[0].shape or (x.shape[0], x.shape[-2]) != mask.shape
           for x in memory):
        return (f"{'embeds (B, C, d)' if n == 0 else 'K/V (B, Hkv, C, hd), alike in every layer,'} should match its "
                f"mask (B, C) = {tuple(mask.shape)}")
    if not all(x.is_floating_point() and torch.isfinite(x).all() for x in memory):
        return "it holds values that are not finite floating-point numbers"
    if not mask.any(1).all():  # (an answer from no slot at all)
        return "a context's mask keeps no slot"
    return ""


class KVCache:
    """generate's keys and values of every slot its decode reaches, preallocated: per layer (B, Hkv, S, hd), the
    slots' mask (B, S). A step writes its token at `slot` and reads all S slots, those not yet written masked:
    the same shapes every step, which a CUDA graph needs."""

    def __init__(self, kv, mask, pos, extra):
        self.kv = [tuple(F.pad(t, (0, 0, 0, extra)) for t in layer) for layer in kv]
        self.mask = F.pad(mask, (0, extra), value=False)
        self.slot = torch.full((), mask.shape[1], device=mask.device)  # the next token's slot
        self.pos = pos.clone()  # (B,) its position id


def behind_prefix(model, prefix, embeds, mask):
    """Embedding memory (B, C, d) behind the prefix ids (BOS, the attention sink of real checkpoints; a chat
    header), as the teacher reads [prefix, context, prompt]. Prefix slots count as memory. The slots take positions
    P.. in order (holes skipped): placed at their windows' centres (EPL), meanpool and pic kept less of the gain."""
    ids = torch.as_tensor(prefix, dtype=torch.long, device=embeds.device)[None].expand(len(embeds), -1)
    e = model.model.embed_tokens(ids).to(embeds.dtype)  # (B, P, d)
    mask = torch.cat([torch.ones_like(ids, dtype=torch.bool), mask], 1)
    return Memory(embeds=torch.cat([e, embeds], 1), mask=mask)


def behind_prefix_kv(model, prefix, kv, mask):
    """K/V memory (per layer (B, Hkv, C, hd), mask (B, C)) behind the frozen base's K/V of the prefix ids (BOS, a
    chat header), computed causally at positions 0..P-1 with no adapter, as the teacher reads them."""
    ids = torch.as_tensor(prefix, dtype=torch.long, device=mask.device)
    ids = ids.view(1, -1).expand(len(mask), -1) if ids.dim() == 1 else ids  # collate_qa: one shared list
    if ids.shape[1] == 0:
        return kv, mask
    with torch.no_grad(), model.adapter(None):
        _, prefix_kv = model(ids, return_kv=True, output="hidden")  # (B, Hkv, P, hd) per layer
    kv = [(torch.cat([pk.to(k.dtype), k], 2), torch.cat([pv.to(v.dtype), v], 2))
          for (pk, pv), (k, v) in zip(prefix_kv, kv)]
    return kv, torch.cat([torch.ones_like(ids, dtype=torch.bool), mask], 1)


def decode_each(decode, memories, ids, stack):
    """decode(memory, ids) -> (B, T, d) for each embedding memory: lazily, a pass each, or with `stack` one pass
    over all of them along the batch (R*B rows; each memory padded to the longest with masked slots), the same
    math in fewer, larger kernels. Not for sliding windows: they count padded slots (as HF does)."""
    if not stack or len(memories) < 2:
        return (decode(memory, ids) for memory in memories)
    C = max(memory.n_slots for memory in memories)
    memory = Memory(embeds=torch.cat([F.pad(m.embeds, (0, 0, 0, C - m.n_slots)) for m in memories]),
                    mask=torch.cat([F.pad(m.mask, (0, C - m.n_slots), value=False) for m in memories]),
                    next_pos=torch.cat([m.next_pos for m in memories]))
    return decode(memory, ids.repeat(len(memories), 1)).chunk(len(memories))


# -----------------------------------------------------------------------------
# LoRA: W x + (alpha / r) B A x, several named adapters on one base weight
#        x ──► W (frozen) ───────────────┐
#        └──► A (r, in) ──► B (out, r) ──┴─► + ──► y        A kaiming, B zero: a new
#                  scaled by alpha / r                        adapter is the identity
# HF's projections of one input are one weight here (q/k/v, gate/up: gpt-fast's wqkv, w13), and an adapter
# stacks its projections' A along the rank: three GEMMs for the group (W, A, a block-diagonal B), not nine.


class Linear(nn.Linear):
    """nn.Linear without its random init on the meta device (from_pretrained loads every weight after): that init
    runs torch's Python refs, which import dynamo, ~1 s of every process."""

    def reset_parameters(self):
        if not self.weight.is_meta:
            super().reset_parameters()


class LoRALinear(Linear):
    """nn.Linear over HF projections of one input, stacked along the output: ``parts`` {HF name: out features}
    in order (q_proj, k_proj, v_proj; gate_proj, up_proj; or one alone). Adapter `name` covers adapted[name]
    (a subset of the parts): lora_A[name] (P r, in) is their A's stacked, lora_B[name] (their outs, r) their B's."""

    def __init__(self, in_features, parts, bias=False):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)
        ends = itertools.accumulate(self.parts.values())
        self.rows = {p: slice(end - n, end) for (p, n), end in zip(self.parts.items(), ends)}  # each part's outputs
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        self.adapted, self.scaling, self.dropout, self.active = {}, {}, {}, None  # per adapter; the adapter in use

    def add_adapter(self, name, r, alpha, dropout, parts):
        A = torch.empty(len(parts) * r, self.in_features, device=self.weight.device, dtype=torch.float32)
        self.lora_A[name] = nn.Parameter(nn.init.kaiming_uniform_(A, a=math.sqrt(5)))  # fan-in: in, as per part
        self.lora_B[name] = nn.Parameter(torch.zeros(sum(self.parts[p] for p in parts), r, device=A.device))
        self.adapted[name], self.scaling[name], self.dropout[name] = list(parts), alpha / r, dropout

    def remove_adapter(self, name):
        del self.lora_A[name], self.lora_B[name], self.adapted[name], self.scaling[name], self.dropout[name]

    def pieces(self, name):
        """{part: (A (r, in), B (out, r))}: views of adapter `name`, PEFT's tensors per projection."""
        A, B, parts = self.lora_A[name], self.lora_B[name], self.adapted[name]
        return dict(zip(parts, zip(A.split(B.shape[1]), B.split([self.parts[p] for p in parts]))))

    def stacked(self, name):
        """A (P r, in) and the block-diagonal s B (out, P r), the scale folded into the small matrix;
        a part without the adapter has no rows in A and zero rows in B."""
        pieces, B = self.pieces(name), self.lora_B[name]
        blocks = [pieces[p][1] if p in pieces else B.new_zeros(n, 0) for p, n in self.parts.items()]
        B = torch.block_diag(*blocks) if len(blocks) > 1 else B  # o_proj, down_proj: B itself, no copy
        return self.lora_A[name], B * self.scaling[name]

    def forward(self, x, part=None):
        """W x + s B A x under the active adapter, in x's dtype (autocast's); given a part, its outputs only."""
        W, b, rows = self.weight, self.bias, self.rows.get(part, slice(None))
        if part is not None:
            W, b = W[rows], None if b is None else b[rows]
        name = self.active
        if name is None or name not in self.lora_A:
            return F.linear(x, W, b)
        A, B = self.stacked(name)
        B = B if part is None else B[rows]
        if self.merges(name, W, x):
            return F.linear(x, W + B @ A, b)
        y = F.linear(x, W, b)
        x = F.dropout(x, self.dropout[name], self.training)  # one mask for the group (PEFT draws one per projection)
        return y + F.linear(F.linear(x, A.to(x.dtype)), B.to(x.dtype))

    def merges(self, name, W, x):
        """One matmul on W + s B A beats three (W, A, B) when in·out < 9 r(in + out), r the stacked rank (thin
        matmuls run ~3x slower), and tokens >= in; only in fp32 without autocast (bf16 rounds the update away)
        and without dropout."""
        r, (out, inp) = self.lora_A[name].shape[0], W.shape
        return (self.dropout[name] == 0 and inp * out < 9 * r * (inp + out) and x.numel() >= inp * inp
                and x.dtype == W.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type))


def hf_path(path, part):
    """The HF module path of one projection of our module at `path`: (...self_attn.qkv_proj, k_proj) ->
    ...self_attn.k_proj."""
    return f"{path.rpartition('.')[0]}.{part}"


@contextmanager
def active_adapters(mods, names):
    """Sets mods[i].active = names[i] (LoRALinear modules) inside the block, then restores."""
    before = [m.active for m in mods]
    for m, name in zip(mods, names):
        m.active = name
    try:
        yield
    finally:
        for m, name in zip(mods, before):
            m.active = name


# -----------------------------------------------------------------------------
# the transformer


class RMSNorm(nn.Module):
    """Llama: weight * x.to(dtype). Gemma (unit_offset): (x * (1 + weight)).to(dtype), in fp32 as HF."""

    def __init__(self, dim, eps, unit_offset=False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x):
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * x32.to(x.dtype)

    def gain_rms(self):
        """The RMS of the per-channel gain: the RMS of this norm's output where the input's channels are equal."""
        return (1.0 + self.weight.float() if self.unit_offset else self.weight.float()).pow(2).mean().sqrt().item()


class Embedding(nn.Embedding):
    """Token embeddings, times ``scale`` when set (Gemma: sqrt(d), rounded to the weight dtype as in HF)."""

    def __init__(self, n, d, scale=None):
        super().__init__(n, d)
        self.scale = scale

    def reset_parameters(self):  # as Linear's
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, ids):
        x = super().forward(ids)
        return x if self.scale is None else x * torch.tensor(self.scale, dtype=x.dtype)

    def input_std(self):
        """The std of the embeddings as the model reads them: the scale for new learned inputs."""
        return self.weight.float().std().item() * (self.scale or 1.0)


def rope_inv_freq(cfg, device):
    """Inverse frequencies (hd/2,), with llama3 or linear scaling as HF computes them."""
    hd = cfg.head_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=device) / hd)
    scaling = cfg.rope_scaling or {}
    if scaling.get("rope_type") == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif scaling.get("rope_type") == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / lo, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_len / lo) & (wavelen >= old_len / hi)
        inv_freq = torch.where(is_medium, smoothed, inv_freq)
    return inv_freq


def apply_rope(x, cos, sin):
    """x (B, H, T, hd); cos/sin (B, 1, T, hd). Rotate-half convention (HF)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, H, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_bias = cfg.attention_bias or cfg.model_type == "qwen2"
        self.qkv_proj = LoRALinear(d, dict(q_proj=H * hd, k_proj=Hkv * hd, v_proj=Hkv * hd), bias=qkv_bias)
        self.o_proj = LoRALinear(H * hd, dict(o_proj=d), bias=cfg.attention_bias)
        if cfg.model_type == "qwen3":
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        self.H, self.Hkv, self.hd = H, Hkv, hd
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.score_mod = kernels.softcap(cfg.attn_logit_softcapping) if cfg.attn_logit_softcapping else None
        self.attend = kernels.attention  # compile_layers: the same, kept out of the compiled graph

    def forward(self, x, cos, sin, mask, prefix_kv):
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(list(self.qkv_proj.parts.values()), dim=-1)
        q, k = q.view(B, T, self.H, self.hd), k.view(B, T, self.Hkv, self.hd)
        v = v.view(B, T, self.Hkv, self.hd).transpose(1, 2)  # (B, Hkv, T, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)  # (B, H, T, hd)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, T, hd)
        if prefix_kv is not None and len(prefix_kv) == 3:  # a KVCache layer: write at its slot, read all slots
            *cache, slot = prefix_kv
            k, v = (buf.index_copy_(2, slot.view(1), t) for buf, t in zip(cache, (k, v)))
        elif prefix_kv is not None:  # (B, Hkv, P + T, hd)
            k, v = (torch.cat([p.to(t.dtype), t], dim=2) for p, t in zip(prefix_kv, (k, v)))
        y = self.attend(q, k, v, mask, self.scale, self.score_mod)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_up_proj = LoRALinear(d, dict(gate_proj=f, up_proj=f), bias=bias)
        self.down_proj = LoRALinear(f, dict(down_proj=d), bias=bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    """Llama: x + attn(norm(x)), then x + mlp(post_attention_layernorm(x)). Gemma 2 (four norms):
    x + post_attention_layernorm(attn(norm(x))), then x + post_ff_norm(mlp(pre_ff_norm(x)))."""

    def __init__(self, cfg, layer):
        super().__init__()
        gemma, d, eps = cfg.model_type == "gemma2", cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(d, eps, gemma)
        self.post_attention_layernorm = RMSNorm(d, eps, gemma)
        if gemma:
            self.pre_feedforward_layernorm = RMSNorm(d, eps, gemma)
            self.post_feedforward_layernorm = RMSNorm(d, eps, gemma)
        # into layer_masks' [full, sliding]: an int, as torch 2.11's dynamo fails on a bool index (the layer runs eager)
        self.mask_index = int(bool(cfg.sliding_window) and cfg.layer_types[layer] == "sliding_attention")

    def forward(self, x, cos, sin, masks, prefix_kv):
        a, kv = self.self_attn(self.input_layernorm(x), cos, sin, masks[self.mask_index], prefix_kv)
        if not hasattr(self, "pre_feedforward_layernorm"):
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), kv
        x = x + self.post_attention_layernorm(a)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x))), kv


def checkpointed(layer, *args):
    """layer(*args) with activation checkpointing. The recompute runs in the backward,
    outside any ``with model.adapter(...)``: it re-activates the adapters active now."""
    lora = [m for m in layer.modules() if isinstance(m, LoRALinear)]
    active = [m.active for m in lora]

    def run(*args):
        with active_adapters(lora, active):
            return layer(*args)
    return checkpoint(run, *args, use_reentrant=False)


class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        gemma = cfg.model_type == "gemma2"
        self.model = nn.Module()  # the checkpoint's "model." prefix
        self.model.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, cfg.hidden_size ** 0.5 if gemma else None)
        self.model.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, gemma)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.adapter_configs, self._inv_freq, self.prefill_graphs = {}, None, {}
        self.graphed_layers = False  # compile_layers(cuda_graphs=True): the layers replay CUDA graphs of their own
        self.grad_ckpt = False  # recompute each layer in the backward (train.py --grad_ckpt): memory for compute

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device="cpu"):
        """An HF checkpoint dir: config.json + model.safetensors or a sharded index (nothing is unpickled);
        generation stops at generation_config.json's eos ids when it has them."""
        cfg = ModelConfig.from_json(os.path.join(path, "config.json"))
        gen = os.path.join(path, "generation_config.json")
        eos = read_json(gen).get("eos_token_id") if os.path.exists(gen) else None
        cfg.eos_token_id = cfg.eos_token_id if eos is None else id_list(eos, f"{gen}: ")
        with torch.device("meta"):
            model = cls(cfg)
        try:
            model.load_base_weights(read_safetensors(path, device), dtype=dtype)
        except ValueError as e:  # (it named no file)
            raise ValueError(f"{path}: {e}") from None
        return model.to(device)

    def load_base_weights(self, state, dtype=None):
        """Key-for-key copy of HF's tensors, q/k/v and gate/up concatenated, with one-line errors for
        missing/unexpected/mis-shaped tensors."""
        own = self.base_state(cpu=False)  # a tied lm_head.weight is not own: skipped
        state = {k: v for k, v in state.items()
                 if (k in own or k != "lm_head.weight") and not k.endswith("rotary_emb.inv_freq")}
        problems = {"missing": [k for k in own if k not in state], "unexpected": [k for k in state if k not in own],
                    "mis-shaped": [f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own
                                   if k in state and state[k].shape != own[k].shape]}
        for what, keys in problems.items():
            if keys:
                more = f" (+{len(keys) - 5} more)" if len(keys) > 5 else ""
                raise ValueError(f"checkpoint has {len(keys)} {what} tensors: {', '.join(keys[:5])}{more}")
        for key, hf in self.fused_keys():
            state[key] = torch.cat([state.pop(k) for k, _ in hf])
        super().load_state_dict({k: v.to(dtype) if dtype and v.is_floating_point() else v
                                 for k, v in state.items()}, strict=False, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        return self

    def base_state(self, cpu=True):
        """The HF checkpoint's tensors (no adapters; a tied head once, as embed_tokens), on the CPU unless cpu=False."""
        tied = "lm_head.weight" if self.config.tie_word_embeddings else None
        fused, state = dict(self.fused_keys()), {}
        for k, v in self.state_dict().items():
            if "lora_" not in k and k != tied:
                state.update({hf: v[rows] for hf, rows in fused[k]} if k in fused else {k: v})
        return {k: v.detach().contiguous().cpu() for k, v in state.items()} if cpu else state

    def fused_keys(self):
        """(our key, [(HF key, rows)]) of every fused weight and bias: q/k/v's and gate/up's, per layer."""
        for path, m in self.lora_modules().items():
            for kind in ("weight", "bias") if len(m.parts) > 1 else ():
                if getattr(m, kind) is not None:
                    yield f"{path}.{kind}", [(f"{hf_path(path, p)}.{kind}", rows) for p, rows in m.rows.items()]

    def save_pretrained(self, path):
        """HF layout (config.json + model.safetensors), base weights only."""
        os.makedirs(path, exist_ok=True)
        save_file(self.base_state(), os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        Path(path, "config.json").write_text(json.dumps(self.config.to_json(), indent=2))

    def rope(self, pos):
        if self._inv_freq is None or self._inv_freq.device != pos.device:
            self._inv_freq = rope_inv_freq(self.config, pos.device)
        freqs = pos[..., None].float() * self._inv_freq  # (B, T, hd/2)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # (B, 1, T, hd)
        return emb.cos(), emb.sin()

    def forward(self, input_ids=None, embeds=None, pos=None, mask=None, memory=None,
                valid=None, return_kv=False, output="logits"):
        """input_ids (B, T) and/or embeds (B, T0, d): the sequence is [embeds, tokens]. pos (B, T): its position
        ids (default: after the memory, or from 0). mask: a mask_mod over this forward's keys (None = causal).
        memory: a ``Memory`` (embeddings are prepended; K/V is a prefix every query sees where memory.mask).
        valid (B, T) marks real tokens (left padding). Returns logits (B, T, V) or, with output="hidden", final
        hidden states of the sequence (memory excluded); with return_kv also each layer's (k, v) of all keys."""
        x = None if input_ids is None else self.model.embed_tokens(input_ids)
        if embeds is not None:
            x = embeds if x is None else torch.cat([embeds, x], dim=1)
        B, T, _ = x.shape
        if pos is None:
            pos = torch.arange(T, device=x.device).expand(B, T) + (0 if memory is None else memory.next_pos[:, None])
        prefix = None if memory is None else memory.kv  # K/V memory; None for embedding memory
        n_mem = 0
        if memory is not None:
            valid = torch.cat([memory.mask, x.new_ones(B, T, dtype=torch.bool) if valid is None else valid], dim=1)
            if memory.embeds is not None:
                n_mem = memory.embeds.shape[1]
                x = torch.cat([memory.embeds.to(x.dtype), x], dim=1)
                pos = torch.cat([(memory.mask.long().cumsum(1) - 1).clamp(min=0), pos], dim=1)  # holes skipped
        P = prefix[0][0].shape[2] if prefix else 0  # the keys are [prefix K/V, x]
        Q, S = x.shape[1], P + x.shape[1]
        assert mask is None or n_mem == 0, "custom masks with embedding memory: prepend the embeds yourself"
        if mask is not None and prefix is not None:
            mask = kernels.with_prefix(mask, P, valid[:, :P])
        elif mask is None and valid is not None:
            mask = kernels.causal_after_prefix(P, valid)
        masks = self.layer_masks(mask, B, Q, S, torch.full((), P, device=x.device))
        cos, sin = (t.to(x.dtype) for t in self.rope(pos))
        kvs = []
        for i, layer in enumerate(self.model.layers):
            args = (x, cos, sin, masks, prefix[i] if prefix else None)
            x, kv = checkpointed(layer, *args) if self.grad_ckpt and torch.is_grad_enabled() else layer(*args)
            if return_kv:
                kvs.append(kv)
        h = self.model.norm(x[:, n_mem:])
        out = h if output == "hidden" else self.logits(h)
        return (out, kvs) if return_kv else out

    def layer_masks(self, mask, B, Q, S, first):
        """[full layers' Mask, sliding layers' Mask] of mask_mod `mask` (None: causal, SDPA's own) for queries at key
        slots first, first + 1, ... (a 0-d tensor): the window counts slots back from each query's."""
        masks = [None if mask is None else kernels.Mask(mask, B, Q, S, first.device)] * 2
        if self.config.sliding_window:
            window = kernels.sliding_window(self.config.sliding_window, first)
            masks[1] = kernels.Mask(kernels.and_masks(mask or kernels.causal, window), B, Q, S, first.device)
        return masks

    def logits(self, h):
        """(..., V) logits of final hidden states; Gemma 2 soft-caps them after lm_head (as HF and the losses)."""
        return kernels.soft_cap(self.lm_head(h), self.config.final_logit_softcapping)

    def ce(self, h, labels, weights=None):
        """kernels.chunked_ce through this model's head and final logit cap: (sum, n tokens)."""
        return kernels.chunked_ce(h, self.lm_head.weight, labels, weights, self.config.final_logit_softcapping)

    def kd(self, h, teacher_h):
        """kernels.chunked_kd of rows h (N, d) against teacher_h (N, d), this base's head for both: (sum, n tokens)."""
        w = self.lm_head.weight
        return kernels.chunked_kd(h, w, teacher_h, w, softcap=self.config.final_logit_softcapping)

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens, memory=None, eos_ids=None, cuda_graphs=False):
        """Greedy decoding with a preallocated KV cache. prompts: (B, T) ids or id lists (left-padded here); memory:
        an optional ``Memory``. Stops at ``eos_ids`` (default: the checkpoint's). Returns id lists (EOS excluded).
        cuda_graphs (CUDA; weights in their dtype, no autocast, whose weight cache a graph would keep): the prefill
        replays a graph captured at the first call of its shapes, adapters, mode and attention backend, and each call
        captures its decode step once, so the host launches a graph instead of every kernel. The prefill graphs read
        weights and adapters where they were at capture: clear ``self.prefill_graphs`` after adding or removing one."""
        if torch.is_tensor(prompts):
            prompts = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
        eos = set(self.config.eos_token_id if eos_ids is None else eos_ids)
        device = self.lm_head.weight.device
        B, T = len(prompts), max(len(p) for p in prompts)
        ids = torch.tensor([[0] * (T - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
        valid = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts], device=device)  # left-padded
        pos = (valid.cumsum(1) - 1).clamp(min=0) + (0 if memory is None else memory.next_pos[:, None])
        plain = memory is None and bool(valid.all())  # no padding, no memory: plain causal
        mem = () if memory is None else (memory.mask, memory.next_pos,
                                         *([memory.embeds] if memory.kv is None else itertools.chain(*memory.kv)))
        prefill, step = self.prefill, self.decode_step
        if cuda_graphs:
            if torch.is_autocast_enabled(device.type):
                raise ValueError("generate(cuda_graphs=True) under autocast: cast the model to its dtype instead")
            if self.graphed_layers:
                raise ValueError("generate(cuda_graphs=True) after compile_layers(cuda_graphs=True): a graph capture "
                                 "cannot hold the layers' own; compile them without cuda_graphs")
            key = tuple(m.active for m in self.lora_modules().values()), self.training, kernels.BACKEND
            prefill = self.prefill_graphs.setdefault(key, kernels.CUDAGraphed(self.prefill))
            step = kernels.CUDAGraphed(self.decode_step)
        last, kv = prefill(ids, pos, None if plain else valid, *mem)
        cache = KVCache(kv, valid if memory is None else torch.cat([memory.mask, valid], 1), pos[:, -1] + 1,
                        max_new_tokens - 1)
        tok, out, done = last.argmax(-1), [[] for _ in range(B)], [False] * B
        for i in range(max_new_tokens):
            for b, t in enumerate(tok.tolist()):
                done[b] = done[b] or t in eos
                if not done[b]:
                    out[b].append(t)
            if all(done) or i == max_new_tokens - 1:  # no forward for a token never returned
                break
            tok = step(tok, cache)
        return out

    def prefill(self, ids, pos, valid, mask=None, next_pos=None, *memory):
        """generate's first forward, over tensors only (a graph's inputs): memory is (embeds,) or each layer's k, v.
        Returns the last logits (B, V) and every layer's (k, v)."""
        if memory:
            kv = list(zip(memory[::2], memory[1::2])) if len(memory) > 1 else None
            memory = Memory(embeds=None if kv else memory[0], kv=kv, mask=mask, next_pos=next_pos)
        h, kv = self(ids, pos=pos, memory=memory or None, valid=valid, return_kv=True, output="hidden")
        return self.logits(h[:, -1]), kv

    def decode_step(self, tok, cache):
        """One token a row (B,) at cache.slot, in fixed shapes: writes its K/V into the cache, advances the slot,
        returns the next tokens (B,)."""
        cache.mask.index_fill_(1, cache.slot.view(1), True)
        x = self.model.embed_tokens(tok[:, None])  # (B, 1, d)
        B, S = cache.mask.shape
        masks = self.layer_masks(kernels.bidirectional(cache.mask), B, 1, S, cache.slot)
        cos, sin = (t.to(x.dtype) for t in self.rope(cache.pos[:, None]))
        for layer, (k, v) in zip(self.model.layers, cache.kv):
            x, _ = layer(x, cos, sin, masks, (k, v, cache.slot))
        cache.slot += 1
        cache.pos += 1
        return self.logits(self.model.norm(x))[:, -1].argmax(-1)

    def lora_modules(self):
        return {n: m for n, m in self.named_modules() if isinstance(m, LoRALinear)}

    def add_adapter(self, name, r, alpha, dropout=0.0, targets=LORA_TARGETS, skip=()):
        """A named LoRA adapter on every HF projection named in targets (q_proj, ...), but those whose path
        (model.layers.3.self_attn.q_proj) is in skip."""
        adapted = set()
        for path, m in self.lora_modules().items():
            parts = [p for p in m.parts if p in targets and hf_path(path, p) not in skip]
            if parts:
                m.add_adapter(name, r, alpha, dropout, parts)
                adapted.update(parts)
        if not adapted:
            raise ValueError(f"no module matches LoRA targets {targets}")
        targets = sorted(adapted)
        self.adapter_configs[name] = dict(r=r, alpha=alpha, dropout=dropout, targets=targets)

    @contextmanager
    def adapter(self, name):
        """``with model.adapter("encoder"):`` runs with that adapter active; None = the base."""
        if name is not None and name not in self.adapter_configs:
            raise ValueError(f"unknown adapter {name!r}; have {sorted(self.adapter_configs)}")
        mods = list(self.lora_modules().values())
        with active_adapters(mods, [name] * len(mods)):
            yield self

    def adapter_state(self, name):
        """{HF module path: (A (r, in), B (out, r))} of one adapter: views into its stacked tensors."""
        return {hf_path(path, p): AB for path, m in self.lora_modules().items() if name in m.lora_A
                for p, AB in m.pieces(name).items()}

    def save_adapter(self, name, path):
        """PEFT format: adapter_config.json + adapter_model.safetensors."""
        os.makedirs(path, exist_ok=True)
        tensors = {f"base_model.model.{n}.lora_{ab}.weight": t.detach().contiguous()
                   for n, pair in self.adapter_state(name).items() for ab, t in zip("AB", pair)}
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
        c = self.adapter_configs[name]
        peft_cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": c["r"], "lora_alpha": c["alpha"],
                    "lora_dropout": c["dropout"], "target_modules": c["targets"], "bias": "none",
                    "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": None}
        Path(path, "adapter_config.json").write_text(json.dumps(peft_cfg, indent=2))

    def load_adapter(self, path, name):
        config = os.path.join(path, "adapter_config.json")
        c = read_json(config)
        for key in ("r", "lora_alpha", "target_modules"):
            if key not in c:
                raise ValueError(f"{config}: missing key {key!r} "
                                 "(a PEFT LoRA adapter has r, lora_alpha, target_modules)")
        for key, ok, want in (("r", type(c["r"]) is int and c["r"] > 0, "an integer > 0"),  # (a ZeroDivisionError)
                              ("lora_alpha", type(c["lora_alpha"]) in (int, float) and 0 < c["lora_alpha"] <= 1 << 16,
                               "in (0, 65536], as --lora_alpha"),  # (1e6 trained on a teacher scaled 62,500 times)
                              ("target_modules", isinstance(c["target_modules"], list), "a list of module names"),
                              ("bias", c.get("bias", "none") == "none", '"none"'),
                              *((k, not c.get(k), "unset: this LoRA has none") for k in UNREAD_PEFT)):  # (ignored)
            if not ok:
                raise ValueError(f"{config}: key {key!r} is {c[key]!r:.40}, expected {want}")
        self.add_adapter(name, c["r"], c["lora_alpha"], c.get("lora_dropout", 0.0), tuple(c["target_modules"]))
        views = self.adapter_state(name)
        loaded = set()  # (module, "A" | "B")
        for key, t in read_tensors(os.path.join(path, "adapter_model.safetensors")).items():
            module, ab = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
            if module not in views or ab[0] not in "AB":
                raise ValueError(f"{path}: adapter tensor {key} matches no module of this model")
            view = views[module]["AB".index(ab[0])]
            if view.shape != t.shape:
                raise ValueError(f"{path}: adapter tensor {key} is {tuple(t.shape)}, this model's "
                                 f"{tuple(view.shape)}: an adapter of another base")
            if not (t.is_floating_point() and torch.isfinite(t).all()):  # (a NaN loss blamed on --lr)
                raise ValueError(f"{path}: adapter tensor {key} holds values that are not finite floating-point "
                                 "numbers")
            with torch.no_grad():
                view.copy_(t)
            loaded.add((module, ab[0]))
        missing = [f"{m}.lora_{ab}" for m in views for ab in "AB" if (m, ab) not in loaded]
        if missing:  # (an empty file trained against the plain base)
            raise ValueError(f"{path}: adapter_model.safetensors lacks {len(missing)} of the tensors its config names: "
                             f"{', '.join(missing[:3])}")
        return self

    @torch.no_grad()
    def merge_adapter(self, name):
        """Fold W + (alpha/r) B A into W (export); the adapter is removed."""
        for m in self.lora_modules().values():
            if name in m.lora_A:
                A, B = m.stacked(name)
                m.weight += (B @ A).to(m.weight.dtype)
                m.remove_adapter(name)
        self.adapter_configs.pop(name)


def compile_layers(model, backend="inductor", cuda_graphs=False):
    """Regional torch.compile (train.py --compile): each decoder layer runs compiled but for its attention
    (kernels.attention with flex: the dispatch stays eager, flex compiles on its own). The layers share graphs: a
    few, not a model per length bucket.
    cuda_graphs: mode="reduce-overhead", each graph replayed as a CUDA graph per shape (torch's cudagraph trees)."""
    mode, model.graphed_layers = "reduce-overhead" if cuda_graphs else None, cuda_graphs
    for layer in model.model.layers:  # dynamic=None: static shapes first, dynamic after a recompile
        layer.self_attn.attend = torch.compiler.disable(functools.partial(kernels.attention, flex=True))
        layer.forward = kernels.compiled(layer.forward, backend, dynamic=None, mode=mode)


def read_safetensors(path, device="cpu"):
    """All tensors of an HF checkpoint dir: model.safetensors or the sharded index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(os.path.join(path, "model.safetensors")):
        files, weight_map = ["model.safetensors"], {}
    elif os.path.exists(index):
        weight_map = read_json(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise ValueError(f"{index}: key 'weight_map' should map each tensor's name to its shard file")
        files = sorted(set(weight_map.values()))
        if outside := [f for f in files if os.path.dirname(os.path.normpath(f)) or f.startswith("..")]:
            raise ValueError(f"{index}: shard file {outside[0]} is not in the checkpoint's dir")  # (it was read)
    else:
        raise ValueError(f"{path}: no model.safetensors or model.safetensors.index.json "
                         "(only safetensors checkpoints are read)")
    for f in files:
        if not os.path.exists(os.path.join(path, f)):
            raise ValueError(f"{index}: shard file {f} is missing")
    state = {}
    for f in files:
        for k, t in read_tensors(os.path.join(path, f), device).items():
            if weight_map.get(k, f) != f:  # (a copy in another shard won, whatever the map said)
                raise ValueError(f"{index}: tensor {k} is in {f}, its weight_map names {weight_map.get(k)}")
            state[k] = t
    return state
