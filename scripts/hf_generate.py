"""Answer from a compressed context with transformers' `generate`: a saved Memory bridged to a
`transformers` model loaded from the run's own checkpoint (dev only: transformers and peft are
never imported at run time).

    python eval.py out/pic --context doc.txt --question "Who ...?" --save_memory doc.mem
    python scripts/hf_generate.py out/pic --memory doc.mem --question "Where ...?"

The bridge (`generate_kwargs`), by what the Memory holds:
- embeddings (meanpool, pic, the compression-token baseline): `inputs_embeds` = [memory rows, the
  prompt's embeddings], `position_ids` = the memory rows' (holes skipped) then next_pos + t, the
  `attention_mask` over both: the positions and mask our decoder used.
- K/V (sac, ata): a `DynamicCache` holding every layer's memory K/V (after RoPE, at the positions the
  encoder gave them), `input_ids` = [C placeholders for the cached slots, the prompt], the mask over
  both, the prompt at next_pos + t.
Prompts of different lengths are left-padded between the memory and the prompt, as our `generate`
does. The decoder is the run's decoder checkpoint with its --teacher adapter and the method's decoder
adapter merged through peft. sentence_gist cannot bridge: it answers under its sentence rule, gists
inserted and finished sentences' tokens dropped from the cache while it decodes, which plain
`generate` does not do.
"""
import argparse
import os
import sys
import tempfile
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import data  # noqa: E402
import eval as evaluate  # noqa: E402
import train  # noqa: E402
import tiny  # noqa: E402
from model import Memory  # noqa: E402


def hf_decoder(method, cfg):
    """The transformers model our method decodes with: its checkpoint (pic's --decoder, else the base),
    the run's --teacher adapter and the method's decoder adapter merged in (peft), in fp32, eval mode."""
    import peft
    import transformers
    if hasattr(type(method), "answer_from_memory"):  # a rule of its own: sentence_gist's
        raise SystemExit(f"error: --method {cfg.method} answers under its own rule (sentence_gist: gists inserted and "
                         "finished sentences dropped while decoding); transformers' generate cannot replay it")
    ours = getattr(method, "dec", method.base)
    path = getattr(method.cfg, "decoder", "") or tiny.base_path(cfg.init_from)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    adapters = [os.path.join(cfg.teacher, "teacher")] if cfg.teacher and ours is method.base else []
    with tempfile.TemporaryDirectory() as d:
        if method.dec_adapter:
            ours.save_adapter(method.dec_adapter, d)
            adapters.append(d)
        for adapter in adapters:
            hf = peft.PeftModel.from_pretrained(hf, adapter).merge_and_unload()
    return hf.eval()


def generate_kwargs(memory, prompts, hf):
    """transformers `generate` arguments that read `prompts` (id lists) after `memory` as our decoder does."""
    B, T, C = len(prompts), max(map(len, prompts)), memory.n_slots
    ids = torch.tensor([[0] * (T - len(p)) + list(p) for p in prompts], device=memory.mask.device)  # left-padded
    valid = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=ids.device)
    pos = (valid.cumsum(1) - 1).clamp(min=0) + memory.next_pos[:, None]  # the prompt at next_pos + t
    mask = torch.cat([memory.mask.long(), valid], 1)  # (B, C + T)
    if memory.embeds is not None:
        slots = (memory.mask.long().cumsum(1) - 1).clamp(min=0)  # the rows' positions, holes skipped
        embeds = torch.cat([memory.embeds.float(), hf.get_input_embeddings()(ids)], 1)
        return dict(inputs_embeds=embeds, attention_mask=mask, position_ids=torch.cat([slots, pos], 1))
    import transformers
    cache = transformers.DynamicCache()
    for layer, (k, v) in enumerate(memory.kv):  # (B, Hkv, C, hd) each, after RoPE
        cache.update(k.float(), v.float(), layer)
    placeholders = torch.zeros(B, C, dtype=torch.long, device=ids.device)  # the cached slots' ids are never read
    return dict(input_ids=torch.cat([placeholders, ids], 1), attention_mask=mask, past_key_values=cache,
                position_ids=torch.cat([placeholders, pos], 1))


@torch.no_grad()
def hf_answer(hf, memory, prompts, max_new_tokens, eos_ids):
    """Greedy answers (id lists, eos excluded) and the first step's logits (B, V) from transformers: plain greedy, as
    ours, whatever the checkpoint's generation_config.json asks (Qwen2.5-Instruct's: a repetition penalty)."""
    import transformers
    kw = generate_kwargs(memory, prompts, hf)
    hf.generation_config = transformers.GenerationConfig()  # (generate merges a config given into the model's own)
    out = hf.generate(**kw, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids),
                      pad_token_id=eos_ids[0], return_dict_in_generate=True, output_logits=True)
    new = out.sequences[:, kw["input_ids"].shape[1]:] if "input_ids" in kw else out.sequences
    answers = []
    for row in new.tolist():
        cut = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
        answers.append(row[:cut])
    return answers, out.logits[0]


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a compressor's run dir (train.py's --out_dir)")
    parser.add_argument("--memory", required=True, help="a Memory saved by eval.py --save_memory")
    parser.add_argument("--question", required=True)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.error = lambda message: sys.exit(f"error: {message}")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise SystemExit(f"error: --max_new_tokens {args.max_new_tokens} must be a positive integer")
    if not args.question.strip():
        raise SystemExit("error: --question is empty")
    evaluate.check_question(args.question)
    if not os.path.isfile(args.memory):
        raise SystemExit(f"error: --memory {args.memory!r}: {train.not_a_file(args.memory)}")
    evaluate.check_evaluable(args.run, "", args.max_new_tokens)  # a compressor's run, whole
    memory = Memory.load(args.memory)
    evaluate.check_origin(memory, args.memory, args.run, args.question)
    cfg, mcfg, tok, base, method = train.load_run(args.run)
    decoder = getattr(method, "dec", base)
    evaluate.check_run(args.run, decoder.config, args.max_new_tokens, len(tok.encode(args.question)))
    if why := evaluate.memory_mismatch(memory, getattr(method, "dec", base), method):
        raise SystemExit(f"error: --memory {args.memory} does not fit {args.run}: {why}")
    record = {"id": "q", "context": "", "question": args.question, "answers": [""]}
    batch = next(evaluate.batches_of([record], tok, cfg, 1))
    prompt = batch["qa"][0, :batch["prompt_len"][0]].tolist()
    # quiet: transformers 5.24 deprecates past_key_values= (5.17's only name), peft calls a deprecated name
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*(is_gradient_checkpointing|past_key_values)", FutureWarning)
        answers, _ = hf_answer(hf_decoder(method, cfg), memory, [prompt], args.max_new_tokens,
                               data.stop_ids(tok, cfg.prompt))
    print(f"answer: {evaluate.decode(tok, answers)[0]}")


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}")
