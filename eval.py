"""Evaluation (SPEC §4): EM / F1, teacher-normalised F1, achieved compression ratio, memory size
and answering time, for one or many run dirs; and a one-shot mode.

    python eval.py out/meanpool                       # one run, its ratios, + teacher rows
    python eval.py out/meanpool out/pic --ratio 4,16  # one table over several runs
    python eval.py out/part1/results.json out/gist-4  # an earlier --out's runs join the table as they are
    python eval.py out/pic --context doc.txt --question "Who ...?" --save_memory doc.mem
    python eval.py out/pic --memory doc.mem --question "Where ...?"

Rows: the teacher with full context, the teacher with no context, then method@ratio, each with
per-question scores and 95% bootstrap intervals of EM, F1 and, in the JSON, the answer's teacher-forced NLL
(`nll`; `nll_other`: after the memory of another question's context, the control that tells whether a memory
carries its own). Teacher-normalised F1 = (F1 - F1_noctx) / (F1_teacher - F1_noctx) (meanpool_multi_ratio §5.1);
the JSON's em_norm is the same of EM.
Results go to <run>/metrics.json (a row per ratio read); --out writes the combined JSON (and a PNG of F1 vs ratio
with matplotlib).
"""
import collections
import glob
import hashlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

if __name__ == "__main__":  # Ctrl-C while torch loads (~2 s): exit 130 as at any later moment, not a traceback
    signal.signal(signal.SIGINT, lambda *_: os._exit(130))

import numpy as np
import torch

import data
import train
import tiny
from model import Memory, ModelConfig, read_json, tensor_names


@dataclass
class EvalConfig:
    runs: tuple = ()           # run dirs (positional arguments; a glob: its folders), or an earlier --out JSON
    ratio: str = ""            # "" = the run's --eval_ratio, else the ratios it was trained with
    split: str = "test"        # synthetic split (when the run trained on synthetic data)
    eval_data: str = ""        # QA file; "" = the run's --eval_data, else synthetic
    n: int = 0                 # examples (0 = the run's eval_examples)
    batch_size: int = 16
    max_new_tokens: int = 32
    recompute: bool = False    # ignore cached <run>/metrics.json and sibling runs' teacher rows
    out: str = ""              # combined JSON (+ .png) for several runs
    device: str = ""
    # --- one-shot mode
    context: str = ""          # a text file to compress
    question: str = ""         # "" (not given) = "What is this text about?"
    memory: str = ""           # answer from a saved compressed context
    save_memory: str = ""      # save the compressed context of --context

    @property
    def one_shot(self):  # answer one question (--context, --memory, --question) instead of evaluating runs
        return bool(self.context or self.memory or self.question)


# -----------------------------------------------------------------------------
# SQuAD v1.1 metrics and bootstrap intervals

normalize_answer = data.normalize_answer  # official SQuAD's (data.py: readers skip a question it leaves no answer)


def f1_score(prediction, gold):
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    same = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_metrics(predictions, answers, ids=None):
    """predictions: strings; answers: lists of gold strings -> {"em", "f1"} in percent, max over the golds of a
    question. With question ids, also 95% bootstrap intervals "em_ci", "f1_ci" and "scores": {"em": {id: em}, ...}."""
    if not predictions:
        return {"em": 0.0, "f1": 0.0}
    em = [100 * max(float(normalize_answer(p) == normalize_answer(g)) for g in golds)
          for p, golds in zip(predictions, answers)]
    f1 = [100 * max(f1_score(p, g) for g in golds) for p, golds in zip(predictions, answers)]
    out = {"em": sum(em) / len(em), "f1": sum(f1) / len(f1)}
    if ids is not None:
        out.update(em_ci=bootstrap_ci(em), f1_ci=bootstrap_ci(f1),
                   scores={"em": dict(zip(ids, em)), "f1": dict(zip(ids, f1))})
    return out


def bootstrap_ci(values, n=2000, seed=0):
    """95% percentile interval [lo, hi] of the mean of values, resampling them n times."""
    v = np.asarray(values, dtype=np.float64)
    idx = np.random.default_rng(seed).integers(0, len(v), size=(n, len(v)))
    return [float(x) for x in np.percentile(v[idx].mean(1), [2.5, 97.5])]


def paired_diff_ci(scores_a, scores_b, n=2000, seed=0):
    """Scores {question id: value} of two rows -> their means "a", "b" over the "n" ids both have,
    "diff" = a - b and its paired-bootstrap 95% interval "ci". ValueError when they share none, or where a value is
    not finite (a diverged run's NLL)."""
    ids = sorted(scores_a.keys() & scores_b.keys())
    if not ids:
        raise ValueError(f"the two rows share no question ids ({len(scores_a)} and {len(scores_b)} questions)")
    a, b = (np.array([s[i] for i in ids], dtype=np.float64) for s in (scores_a, scores_b))
    if bad := int((~np.isfinite(a - b)).sum()):
        raise ValueError(f"{bad} of the {len(ids)} shared questions have a value that is not finite (a diverged run)")
    return {"a": float(a.mean()), "b": float(b.mean()), "diff": float((a - b).mean()),
            "ci": bootstrap_ci(a - b, n, seed), "n": len(ids)}


# -----------------------------------------------------------------------------
# evaluating a run

def eval_records(cfg, ecfg):
    """The questions a run is read on: --eval_data, the run's --eval_data, else the questions of its --data that
    training held out with their contexts (train.held_out), else synthetic."""
    n = ecfg.n or cfg.eval_examples
    path = ecfg.eval_data or cfg.eval_data or cfg.data
    if ecfg.eval_data and cfg.data and os.path.isfile(cfg.data) and train.same_file(ecfg.eval_data, cfg.data):
        print(f"note: --eval_data {ecfg.eval_data} is the file the run trained on", file=sys.stderr)
    if path:
        records = train.read_records(path, cfg)
        held = records if ecfg.eval_data or cfg.eval_data else train.held_out(records, cfg.seed)[1]
        if held is not records:  # (a file of one context holds none out)
            records, path = held, f"the held-out questions of {path}"
        if n > len(records):  # every question is read, and the rows' n says how many
            flag = f"--n {n}" if ecfg.n else f"the run's --eval_examples {n}"
            print(f"note: {flag}: {path} holds {len(records)} questions; evaluating them all", file=sys.stderr)
        return records[:n]
    return tiny.Synthetic(seed=cfg.seed, split=ecfg.split).qa_examples(n)


def batches_of(records, tok, cfg, size, prepare=None, stats=None):
    for i in range(0, len(records), size):
        b = data.collate_qa(records[i:i + size], tok, max_context=cfg.max_context, max_answer=cfg.max_answer,
                            pad_multiple=1, format=cfg.prompt, stats=stats)
        yield prepare(b) if prepare else b


@torch.no_grad()
def answer_from_memory(method, memory, prompts, max_new_tokens, stop):
    """Greedy answers (id lists, each ending before a `stop` id: data.stop_ids) to prompts after a Memory: the
    method's own rule where it has one (sentence_gist gists the prompt), else its decoder (the base, or pic's
    --decoder) under its decoder adapter."""
    if hasattr(method, "answer_from_memory"):
        return method.answer_from_memory(memory, prompts, max_new_tokens, stop)
    decoder = getattr(method, "dec", method.base)
    with decoder.adapter(method.dec_adapter):
        return decoder.generate(prompts, max_new_tokens, memory=memory, eos_ids=stop)


@torch.no_grad()
def answer(method, batch, ratio, max_new_tokens, stop, memory=None):
    """Greedy answers (id lists) from `memory`, else from the batch's context compressed; and the Memory."""
    memory = method.compress(batch, ratio) if memory is None else memory
    prompts = [batch["qa"][b, :batch["prompt_len"][b]].tolist() for b in range(len(batch["qa"]))]
    return answer_from_memory(method, memory, prompts, max_new_tokens, stop), memory


def decode(tok, outs):
    return [tok.decode(o, skip_special=True).strip() for o in outs]


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t


def kv_bytes_per_token(model):
    """The K/V cache bytes a token of context costs `model`, every layer (a sliding window's layers would keep less):
    what the teacher row holds for a context, against a Memory's bytes (SPEC §4)."""
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * model.lm_head.weight.element_size()


@torch.no_grad()
def answer_nll(decoder, h, labels):
    """Per row of final hidden states h (B, T, d), the mean NLL (nats) under decoder's head of its labelled tokens
    (labels (B, T), -100 elsewhere: the reference answer, EOS included, as training reads it)."""
    row, pos = (labels != -100).nonzero(as_tuple=True)  # the answer tokens: (N,) each
    nll = h.new_zeros(len(h), dtype=torch.float32)
    for i in range(0, len(row), 1024):  # (1024, V) logits at a time
        r, t = row[i:i + 1024], pos[i:i + 1024]
        logits = decoder.logits(h[r, t]).float()
        nll.index_add_(0, r, torch.nn.functional.cross_entropy(logits, labels[r, t], reduction="none"))
    return (nll / torch.bincount(row, minlength=len(h)).clamp(min=1)).tolist()


@torch.no_grad()
def teacher_forced(method, memory, batch, other=False):
    """{question id: its answer NLL} after `memory`, read as the method answers. other: after the memory of the next
    question in the batch with another context (the questions of a paragraph sit together), the control that tells
    whether a memory carries its own context; a question with none gets no value. F1 reads the greedy answer alone;
    this reads how much the memory tells about the answer, so a row that moved too little to change its answers
    still shows."""
    ids, rows = batch["ids"], list(range(len(batch["ids"])))
    if other:
        ctx, B = [r["context"] for r in batch["records"]], len(ids)
        partner = {j: next((k % B for k in range(j + 1, j + B) if ctx[k % B] != ctx[j]), None) for j in rows}
        rows = [j for j in rows if partner[j] is not None]
        if not rows:
            return {}
        memory = memory.rows(torch.tensor([partner[j] for j in rows], device=batch["qa"].device))
    qa, labels, lengths = (batch[k][rows] for k in ("qa", "qa_labels", "qa_len"))
    if hasattr(method, "teacher_forced"):  # its own answering rule (sentence_gist)
        decoder = method.base
        h, labels = method.teacher_forced(memory, [x[:n] for x, n in zip(qa, lengths)],
                                          [x[:n] for x, n in zip(labels, lengths)])
    else:
        decoder = getattr(method, "dec", method.base)  # as answer_from_memory's
        with decoder.adapter(method.dec_adapter):
            h = decoder(qa, memory=memory, output="hidden")  # (B, T, d)
    return dict(zip([ids[j] for j in rows], answer_nll(decoder, h, labels)))


def scored(preds, records, secs, **nlls):
    """The row's metrics; each of `nlls` ({question id: NLL}, e.g. nll=...) also as its mean, its 95% interval
    ("nll_ci") and per question (scores["nll"])."""
    ids = [r["id"] for r in records]
    row = {**qa_metrics(preds, [r["answers"] for r in records], ids), "examples_per_s": len(preds) / secs,
           "n": len(preds)}
    for key, values in nlls.items():
        if values:
            row.update({key: sum(values.values()) / len(values), f"{key}_ci": bootstrap_ci(list(values.values()))})
            row["scores"][key] = values
    return row


@torch.no_grad()
def teacher_rows(base, tok, records, cfg, ecfg, device):
    """The base with full context and with no context (SPEC §4); the teacher's ttft_ms (a batch's first tokens after
    reading its contexts, the median batch) and context_bytes (a context's K/V, the mean) to set a Memory against."""
    rows, stop = {}, data.stop_ids(tok, cfg.prompt)
    for name, key in (("teacher", "full"), ("no-context", "noctx")):
        preds, secs, nll, ttft, context = [], 0.0, {}, [], []
        for b in batches_of(records, tok, cfg, ecfg.batch_size):
            first = (b[f"{key}_labels"] != -100).float().argmax(1)  # the last prompt token predicts the answer
            prompts = [b[key][i, :first[i] + 1].tolist() for i in range(len(first))]
            with base.adapter(None):
                outs, dt = timed(lambda: base.generate(prompts, ecfg.max_new_tokens, eos_ids=stop))
                if key == "full":  # the first tokens after reading every context, and the contexts' K/V
                    ttft.append(timed(lambda: base.generate(prompts, 1))[1])
                    context += (first + 1 - b["prompt_len"]).tolist()  # prefix + context tokens
                h = base(b[key].to(device), output="hidden")
                nll.update(zip(b["ids"], answer_nll(base, h, b[f"{key}_labels"].to(device))))
            preds, secs = preds + decode(tok, outs), secs + dt
        rows[name] = {"method": name, "ratio": 1.0 if key == "full" else None, **scored(preds, records, secs, nll=nll)}
        if ttft:
            rows[name].update(ttft_ms=1000 * float(np.median(ttft)),
                              context_bytes=kv_bytes_per_token(base) * sum(context) / len(context))
    return rows


@torch.no_grad()
def method_rows(method, tok, records, cfg, ecfg, ratios, device):
    """A row per ratio, with the achieved ratio (context tokens / memory slots; per example in scores["ratio"]), the
    memory's size and the method's own memory.stats, each a mean over examples; how many contexts were cut; ttft_ms,
    a batch's first tokens answered from its cached Memory (the median batch)."""
    rows, stop = [], data.stop_ids(tok, cfg.prompt)
    for r in ratios:
        preds, secs, stats, nll, nll_other, cut, ttft = [], 0.0, collections.defaultdict(list), {}, {}, {}, []
        for b in batches_of(records, tok, cfg, ecfg.batch_size, getattr(method, "prepare", None), cut):
            b = train.to_device(b, device)
            (outs, memory), dt = timed(lambda: answer(method, b, r, ecfg.max_new_tokens, stop))
            ttft.append(timed(lambda: answer(method, b, r, 1, stop, memory))[1])  # from the cached Memory
            preds, secs = preds + decode(tok, outs), secs + dt
            nll.update(teacher_forced(method, memory, b))
            nll_other.update(teacher_forced(method, memory, b, other=True))
            stats["ratio"] += (b["context_len"].float() / memory.slots().float().clamp(min=1)).tolist()
            stats["memory_bytes"] += memory.nbytes().tolist()
            for k, v in getattr(memory, "stats", {}).items():
                stats[k] += list(v)
        examples = [{"pred": p, "gold": rec["answers"]} for p, rec in zip(preds[:5], records)]
        row = {"method": cfg.method, "ratio_requested": r, **scored(preds, records, secs, nll=nll, nll_other=nll_other),
               **{k: sum(v) / len(v) for k, v in stats.items()}, "examples": examples,
               "truncated_context": cut.get("truncated_context", 0), "ttft_ms": 1000 * float(np.median(ttft))}
        row["scores"]["ratio"] = dict(zip([rec["id"] for rec in records], stats["ratio"]))  # per example (SPEC §4)
        rows.append(row)
    return rows


def teacher_key(cfg, ecfg, records, device, decoder=""):
    """A hash of what the teacher and no-context rows depend on: the base's weight files (path, size, mtime), or
    pic's --decoder's, the merged teacher's, the prompt and length settings, the questions."""
    files = glob.glob(os.path.join(decoder or tiny.base_path(cfg.init_from), "*.safetensors"))
    files += glob.glob(os.path.join(cfg.teacher, "teacher", "*.safetensors")) if cfg.teacher else []
    state = [f"{os.path.abspath(f)}:{os.path.getsize(f)}:{os.path.getmtime(f)}" for f in sorted(files)]
    setup = [cfg.prompt, cfg.max_context, cfg.max_answer, ecfg.batch_size, ecfg.max_new_tokens, str(device)]
    return hashlib.sha1(json.dumps([state, setup, records], sort_keys=True, default=str).encode()).hexdigest()


def sibling_teacher_rows(run_dir, key):
    """The teacher and no-context rows of a run beside run_dir evaluated under the same key,
    or None: the runs of one suite share them, so each is computed once (not per run)."""
    for path in glob.glob(os.path.join(os.path.dirname(os.path.abspath(run_dir)), "*", "metrics.json")):
        try:
            res = read_json(path)
        except (OSError, ValueError):
            continue
        if isinstance(res, dict) and res.get("teacher_key") == key and not result_error(res):  # (--out's list)
            return {"teacher": res["teacher"], "no-context": res["no_context"]}


def run_label(run_dir, mcfg):
    """Method name plus the flags given on its command line (the trained ratios, the objective, those of what it
    trains on: --no_aids, --prompt, --hotpot_distractors; the method's own) and the first stage's objective for a
    second stage, else a --pretrain given (pic's qa alone, whose default chains ae+lm first), and an objective other
    than the method's main one (its first): "pic (ratio=16, mask=causal)", "ata (after rel)", "pic (pretrain=0)",
    "pic (objective=ae+lm)" (a first stage read as it is: out/pic/pretrain)."""
    state = read_json(os.path.join(run_dir, "run.json"))
    given, method, objective = state.get("flags", []), state["train"]["method"], state["train"].get("objective")
    flags = [f"ratio={state['train']['ratio']}"] if "ratio" in given else []
    if objective and (objective != train.method_registry()[method].objectives[0] or "objective" in given):
        flags.append(f"objective={objective}")
    flags += [f"{k}={state['train'][k]}" for k in ("no_aids", "prompt", "hotpot_distractors") if k in given]
    flags += [f"{k}={getattr(mcfg, k)}" for k in given if hasattr(mcfg, k)]
    first = train.run_state(state["train"]["init_from"], method)
    if first:
        flags.append(f"after {first['train']['objective']}")
    elif "pretrain" in given:
        flags.append(f"pretrain={state['train']['pretrain']}")
    return method + (f" ({', '.join(flags)})" if flags else "")


NUMBER = (int, float)


def is_number(v, finite=True):
    return isinstance(v, NUMBER) and not isinstance(v, bool) and (not finite or -math.inf < v < math.inf)  # (NaN: no)


def key_error(obj, where, kinds):
    """"" when the dict obj has each key of kinds {key: type}, of that type (NUMBER: a finite one); else which not."""
    for key, kind in kinds.items():
        if key not in obj:
            return f"missing key {where + key!r}"
        if not (is_number(obj[key]) if kind == NUMBER else isinstance(obj[key], kind)):
            expected = "a finite number" if kind == NUMBER else kind.__name__
            return f"key {where + key!r} is {obj[key]!r:.40}, expected {expected}"
    return ""


def result_error(res):
    """What makes one run's result (a metrics.json, an item of an --out list) unfit for the table, the plot and
    scripts/claims.py; "" when nothing."""
    if not isinstance(res, dict):
        return f"{res!r:.40} is not a run's result (an object)"
    if why := key_error(res, "", {"run": str, "teacher": dict, "no_context": dict, "rows": list}):
        return why
    if not res["rows"]:
        return "key 'rows' is empty"
    if not isinstance(res.get("asked", {}), dict):  # (a traceback where the cache is matched)
        return f"key 'asked' is {res['asked']!r:.40}, expected dict"
    rows = [("teacher", res["teacher"]), ("no_context", res["no_context"])]
    for where, row in rows + [(f"rows[{i}]", r) for i, r in enumerate(res["rows"])]:
        if not isinstance(row, dict):
            return f"key {where!r} is {row!r:.40}, expected dict"
        kinds = {"method": str, "em": NUMBER, "f1": NUMBER, "examples_per_s": NUMBER}
        shown = {k: NUMBER for k in ("memory_bytes", "context_bytes", "ttft_ms", *EXTRA) if k in row}  # the table's
        if why := key_error(row, f"{where}.", kinds | shown | ({"ratio": NUMBER} if where.startswith("rows") else {})):
            return why
        if where.startswith("rows") and not (row["ratio"] > 0 and type(row.get("ratio_requested", 1)) is int):
            return (f"key '{where}.ratio' is {row['ratio']!r:.40} (requested {row.get('ratio_requested')!r:.40}), "
                    "expected > 0 (requested: an integer)")
        for key in ("f1_norm", "em_norm"):  # nan where the teacher gains nothing
            if key in row and not is_number(row[key], finite=False):
                return f"key '{where}.{key}' is {row[key]!r:.40}, expected a number"
        for key in ("em_ci", "f1_ci"):
            if key in row and not (isinstance(row[key], list) and len(row[key]) == 2 and all(map(is_number, row[key]))):
                return f"key '{where}.{key}' is {row[key]!r:.40}, expected [low, high]"
        scores = row.get("scores", {"em": {}, "f1": {}})  # {"em": {id: score}, "f1": ..., "nll": ...}: claims, compare
        if not (isinstance(scores, dict) and {"em", "f1"} <= scores.keys() and all(  # (a diverged run's NLL: nan)
                isinstance(by_id, dict) and all(is_number(v, finite=k in ("em", "f1")) for v in by_id.values())
                for k, by_id in scores.items())):
            return f"key '{where}.scores' is not {{\"em\": {{id: number}}, \"f1\": {{id: number}}, ...}}"
    return ""


def asked(run_dir, ecfg):
    """What a run's rows answer: its checkpoint file, which questions (their file as it is now: one rewritten in place
    asks others) and how many, the ratios read, the answer length (the flags, else the run's own), the batch size (the
    NLL control's other memories come from the batch). A cached metrics.json serves only the same (another ratio adds
    its rows: rows_at)."""
    state = read_json(os.path.join(run_dir, "run.json"))
    run = state.get("train", {}) if isinstance(state, dict) else {}  # (a broken run.json: load_run says so)
    eval_data = ecfg.eval_data or run.get("eval_data", "")
    ckpt = (state.get("files") or {}).get("ckpt") if isinstance(state, dict) else None  # (a run's next one: no mix)
    questions = eval_data or run.get("data", "")
    stamp = os.stat(questions) if questions and os.path.isfile(questions) else None
    return {"ckpt": ckpt, "n": ecfg.n or run.get("eval_examples", 0), "eval_data": eval_data,
            "split": ecfg.split, "ratio": ecfg.ratio or run.get("eval_ratio") or run.get("ratio", ""),
            "max_new_tokens": ecfg.max_new_tokens, "batch_size": ecfg.batch_size,
            **({"held_out_of": run["data"]} if not eval_data and run.get("data") else {}),  # eval_records
            **({"file": f"{stamp.st_size} bytes @{stamp.st_mtime_ns}"} if stamp else {})}


def cached_result(run_dir, ecfg):
    """<run>/metrics.json where it answers what is asked now, else None (to be computed); read before any work."""
    if not os.path.isfile(os.path.join(run_dir, "run.json")):
        raise SystemExit(f"error: {run_dir!r} is not a run dir (no run.json)")
    cached = os.path.join(run_dir, "metrics.json")
    if os.path.exists(cached) and not os.path.isfile(cached):  # (the scores were written there after the work)
        raise SystemExit(f"error: {cached}: {train.not_a_file(cached)}; eval.py writes the run's scores there")
    if ecfg.recompute or not os.path.exists(cached):
        return None
    try:
        res = read_json(cached)
    except ValueError as e:
        raise SystemExit(f"error: {cached}: corrupt metrics file ({e}); rerun with --recompute")
    if why := result_error(res):
        raise SystemExit(f"error: {cached}: corrupt metrics file ({why}); rerun with --recompute")
    served = rows_at(res, asked(run_dir, ecfg))
    if served is not None:  # (a run dir moved or copied since: its rows are this one's)
        served = {**served, "run": run_dir, "rows": [{**row, "run": run_dir} if "run" in row else row
                                                      for row in served["rows"]]}
    return served


def changed_but_ratio(a, b):
    """The keys (the ratio aside) where two `asked` differ, sorted."""
    return sorted(k for k in (a.keys() | b.keys()) - {"ratio"} if a.get(k) != b.get(k))


def rows_at(res, want):
    """A cached result's rows at the ratios `want` asks (its other settings the same), or None if one is missing.
    metrics.json keeps a row per ratio ever read of its checkpoint (a new checkpoint deletes it): reading a run at
    another --ratio adds rows, it does not drop the run's own."""
    if not want["ratio"] or changed_but_ratio(res.get("asked") or {}, want):
        return res if res.get("asked") == want else None
    by_ratio = {row.get("ratio_requested"): row for row in res["rows"]}
    ratios = train.ratios_of(want["ratio"])
    return {**res, "asked": want, "rows": [by_ratio[r] for r in ratios]} if set(ratios) <= by_ratio.keys() else None


def check_evaluable(run_dir, ratio, max_new_tokens):
    """From its run.json and its checkpoint's header, before any run loads: a compressor's run, and --ratio within
    its --max_context and its method's own rules (check_config reads it as the run's --eval_ratio: pic's memory
    table, sentence_gist's achieved ratio)."""
    cfg, mcfg, cls = train.run_config(run_dir)
    if not hasattr(cls, "compress"):
        raise SystemExit(f"error: {run_dir} is a --method {cfg.method} run; eval.py evaluates compressor runs")
    train.check_moved(run_dir, cfg)
    state, ckpt = train.checkpoint_of(run_dir)
    tensor_names(ckpt)  # a cut one: before any run is evaluated (its header alone)
    note_unfinished(run_dir, state)
    decoder = getattr(mcfg, "decoder", "") or tiny.base_path(cfg.init_from)
    if os.path.isfile(os.path.join(decoder, "config.json")):  # (the tiny base, deleted: trained again at load)
        check_run(run_dir, ModelConfig.from_json(os.path.join(decoder, "config.json")), max_new_tokens)
    stamp = train.teacher_stamp(cfg.teacher)
    if state.get("teacher_stamp", stamp) != stamp:  # (a run of an earlier version has none)
        raise SystemExit(f"error: {run_dir}: its --teacher {cfg.teacher} was trained again since this run distilled it "
                         f"({state['teacher_stamp']}, now {stamp}): the run would decode on another base")
    if not ratio:
        return
    train.check_ratio_fits(ratio, cfg.max_context, whose=f"{run_dir}'s ")
    try:
        if hasattr(cls, "check_config"):
            cls.check_config(replace(cfg, eval_ratio=ratio), mcfg)
    except SystemExit as e:
        raise SystemExit(f"error: --ratio {ratio} on {run_dir} (as its --eval_ratio): "
                         f"{str(e).removeprefix('error: ')}") from None


def note_unfinished(run_dir, state):
    """A note when the run's checkpoint (state: its run.json) is short of its --max_iters: still training or stopped."""
    step, steps = state.get("step"), (state.get("train") or {}).get("max_iters")
    if type(step) is int and type(steps) is int and step < steps:
        print(f"note: {run_dir} is at step {step} of its {steps} (still training, or stopped: --resume continues "
              "it)", file=sys.stderr)


def check_run(run_dir, config, max_new_tokens, asked=0):
    """--max_new_tokens (and a one-shot --question of `asked` tokens) against the positions of run_dir's decoder
    (config: its ModelConfig), before it answers: one line."""
    positions = config.max_position_embeddings
    if max_new_tokens > positions:
        raise SystemExit(f"error: --max_new_tokens {max_new_tokens}: above the {positions} positions of {run_dir}'s "
                         "decoder")
    if asked and asked + max_new_tokens > positions // 2:  # (a garbage answer past the positions: the context's first)
        raise SystemExit(f"error: --question is {asked} tokens: with --max_new_tokens {max_new_tokens}, more than "
                         f"half of {run_dir}'s decoder's {positions} positions")


def evaluate_run(run_dir, ecfg, device, records):
    """Compute and write <run>/metrics.json. records: eval_records's, read before any model loads (main)."""
    cached, want = os.path.join(run_dir, "metrics.json"), asked(run_dir, ecfg)  # (before its weights load)
    try:
        old = (read_json(cached) or {}).get("asked") if os.path.isfile(cached) and not ecfg.recompute else None
    except (ValueError, OSError, AttributeError):  # (cached_result read it: a corrupt one stopped it there)
        old = None
    changed = changed_but_ratio(old, want) if isinstance(old, dict) else []  # (another ratio adds its rows)
    if changed:
        print(f"note: {cached} holds rows read with another {', '.join(changed)}: this evaluation replaces them",
              file=sys.stderr)
    cfg, mcfg, tok, base, method = train.load_run(run_dir, device)
    key = teacher_key(cfg, ecfg, records, device, getattr(mcfg, "decoder", ""))
    shared = None if ecfg.recompute else sibling_teacher_rows(run_dir, key)
    heldout = getattr(method, "heldout_metrics", None)  # e.g. sentence_gist: perplexity (SPEC §4), against the base
    if getattr(method, "trains_base", False) and (heldout or not shared):  # its weights are the method's now
        base = train.load_base(cfg, device, torch.float32)[1]  # (gist --lora_r 0): the base as it was loaded
    t = shared or teacher_rows(getattr(method, "dec", base), tok, records, cfg, ecfg, device)  # the model that answers
    teacher, noctx = t["teacher"], t["no-context"]
    ratios = train.ratios_of(ecfg.ratio or cfg.eval_ratio or cfg.ratio)
    rows = method_rows(method, tok, records, cfg, ecfg, ratios, device)
    label = run_label(run_dir, mcfg)
    if rows[0]["truncated_context"]:  # every row reads them so, the teacher's too: its answer may lie past the cut
        print(f"note: {run_dir}: {rows[0]['truncated_context']} of {len(records)} held-out contexts cut to its "
              f"--max_context {cfg.max_context}", file=sys.stderr)
    extra = heldout(list(dict.fromkeys(r["context"] for r in records)), base) if heldout else {}  # each text once
    for row in rows:
        row.update(method=label, run=run_dir, **extra, **teacher_normalised(row, teacher, noctx))
    result = {"run": run_dir, "asked": want, "teacher_key": key, "teacher": teacher, "no_context": noctx, "rows": rows}
    try:
        now = asked(run_dir, ecfg)["ckpt"]
    except (ValueError, OSError):  # (a new run in the dir removed run.json at its first step)
        now = None
    if now != want["ckpt"]:  # (they were kept as the newer checkpoint's, and served)
        print(f"note: {run_dir} saved another checkpoint while it was evaluated: its rows (of either one) are not "
              "kept in its metrics.json", file=sys.stderr)
        return result
    saved = result if ecfg.recompute else with_other_ratios(cached, result)  # (--recompute: every cached row goes)
    try:
        train.atomic_write(cached, lambda p: Path(p).write_text(json.dumps(saved, indent=1)))
    except OSError as e:  # (a run dir read-only to this user: its rows are still printed and in --out)
        print(f"note: {e}; its rows are in the table (and --out, if given)", file=sys.stderr)
    return result


def with_other_ratios(path, result):
    """result and the rows of other ratios that path (the run's metrics.json) holds for the same questions, settings
    and teacher: what metrics.json saves (rows_at serves them)."""
    try:
        old = read_json(path) if os.path.exists(path) else None
    except (ValueError, OSError):  # (a corrupt or unreadable file: --recompute replaces it)
        return result
    if not (old and not result_error(old) and result["asked"]["ratio"] and old.get("teacher_key") ==
            result["teacher_key"] and not changed_but_ratio(old.get("asked") or {}, result["asked"])):
        return result
    new = {row["ratio_requested"] for row in result["rows"]}
    rows = sorted([row for row in old["rows"] if type(row.get("ratio_requested")) is int and
                   row["ratio_requested"] not in new] + result["rows"], key=lambda row: row["ratio_requested"])
    return {**result, "rows": rows, "asked": {**result["asked"], "ratio": ",".join(str(row["ratio_requested"])
                                                                                  for row in rows)}}


def teacher_normalised(row, teacher, noctx):
    """{f1_norm, em_norm}: the share of the teacher's gain over no context that a row keeps (nan: no gain to share)."""
    return {f"{m}_norm": (row[m] - noctx[m]) / (teacher[m] - noctx[m]) if teacher[m] > noctx[m] else math.nan
            for m in ("f1", "em")}


def earlier_results(path):
    """The runs of an earlier --out JSON (a suite's first part, scripts/real_suite.sh PRIOR; scripts/claims.py's and
    results_md.py's input), as they are."""
    if not path.strip():  # (an unset shell variable: it read the folder "")
        raise SystemExit("error: a results JSON named '': name an eval.py --out JSON")
    try:
        results = read_json(path)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: {path}: cannot read it as an eval.py --out JSON ({e})")
    if not isinstance(results, list) or not results:
        what = f"{results!r:.40}" if not isinstance(results, dict) else "a run's run.json (name its dir)" if \
            "train" in results else "one run's metrics.json (name its dir)" if "rows" in results else "a JSON object"
        raise SystemExit(f"error: {path}: not an eval.py --out JSON, a list of runs: {what}")
    for i, res in enumerate(results):
        if why := result_error(res):
            raise SystemExit(f"error: {path}: not an eval.py --out JSON: run {i}: {why}")
    return results


# -----------------------------------------------------------------------------
# the table, the plot

EXTRA = {"k": "mean k {:.2f}", "probe_abs_err": "probe MAE {:.1f}", "gist_rc": "gist r_c {:.1f}",
         "ppl_compressed": "ppl {:.2f}", "ppl_full": "(full {:.2f})", "ppl_none": "(none {:.2f})"}  # method-specific


def extra_text(row):
    return ", ".join(fmt.format(row[k]) for k, fmt in EXTRA.items() if k in row) or "-"


def with_ci(row, key):
    ci = row.get(key + "_ci")
    return f"{row[key]:.1f}" + (f" [{ci[0]:.1f}, {ci[1]:.1f}]" if ci else "")


def table(results):
    """One markdown table: a row per run x ratio, under the teacher and no-context rows it is measured against,
    shown again where a run's differ from those above (other questions or another base: its F1/teacher is its own)."""
    head = "| method | ratio | EM | F1 | F1/teacher | memory bytes | TTFT ms | examples/s | method-specific |"
    lines, rows, shown, runs = [head, "|" + "---|" * 9], [], None, {}
    for res in results:
        controls = [res["teacher"], res["no_context"]]
        if [c.get("scores") for c in controls] != shown:
            rows, shown = rows + [(c, None) for c in controls], [c.get("scores") for c in controls]
        rows += [(r, res["run"]) for r in res["rows"]]
        for r in res["rows"]:  # (smollm2.py's zero-shot result has none)
            runs.setdefault(r["method"], set()).add(res["run"])
    for r, run in rows:  # two runs of one label (another --lr, --seed, ...): each named by its run dir
        name = r["method"] + (f" [{run}]" if run and len(runs[r["method"]]) > 1 else "")
        ratio = f"{r['ratio']:.1f}x" if r.get("ratio") else "-"
        norm = f"{r['f1_norm']:.2f}" if math.isfinite(r.get("f1_norm", math.nan)) else "-"  # nan: no teacher gain
        mem = r.get("memory_bytes", r.get("context_bytes"))  # the teacher's: its full context's K/V
        cells = [f"{mem:.0f}" if mem is not None else "-", f"{r['ttft_ms']:.1f}" if "ttft_ms" in r else "-"]
        lines.append(f"| {name} | {ratio} | {with_ci(r, 'em')} | {with_ci(r, 'f1')} | {norm} | "
                     f"{' | '.join(cells)} | {r['examples_per_s']:.1f} | {extra_text(r)} |")
    return "\n".join(lines)


def plot(results, path):
    """F1 vs achieved ratio, a colour per method and a marker per run; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(11, 5))
    methods = sorted({res["rows"][0]["method"].split(" ")[0] for res in results})
    seen = {}  # one colour per method, a new marker for each of its runs
    for res in sorted(results, key=lambda res: res["rows"][0]["method"]):
        label = res["rows"][0]["method"]
        method = label.split(" ")[0]
        k = seen[method] = seen.get(method, -1) + 1
        pts = sorted((r["ratio"], r["f1"]) for r in res["rows"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=f"C{methods.index(method) % 10}",
                marker="os^vDP*Xph"[k % 10], ls=("-", "--", ":", "-.")[k % 4], label=label)
    ax.axhline(results[0]["teacher"]["f1"], color="k", ls="--", lw=1, label="teacher (full context)")
    ax.axhline(results[0]["no_context"]["f1"], color="gray", ls=":", lw=1, label="no context")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("compression ratio (context tokens / memory slots)")
    ax.set_ylabel("F1")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


# -----------------------------------------------------------------------------
# one-shot: answer a question about a text file

@torch.no_grad()
def memory_mismatch(memory, decoder, method):
    """What makes a saved Memory unreadable by this run's decoder ("" when nothing): its kind, layers, widths."""
    cfg, kind = decoder.config, "K/V" if memory.kv else "embeddings"
    wants = {"kv": "K/V", "embeds": "embeddings"}[method.memory_kind]
    if kind != wants:
        return f"it holds {kind}; this run's method answers from {wants}"
    if len(memory.mask) != 1:  # (--save_memory writes one)
        return f"it holds {len(memory.mask)} contexts; one is answered from"
    if memory.kv and (len(memory.kv), *memory.kv[0][0].shape[1::2]) != (cfg.num_hidden_layers, cfg.num_key_value_heads,
                                                                        cfg.head_dim):
        k = memory.kv[0][0]
        return (f"its K/V is {len(memory.kv)} layers x {k.shape[1]} heads x {k.shape[3]}; the decoder has "
                f"{cfg.num_hidden_layers} x {cfg.num_key_value_heads} x {cfg.head_dim}")
    if memory.embeds is not None and memory.embeds.shape[-1] != cfg.hidden_size:
        return f"its embeddings are {memory.embeds.shape[-1]} wide; the decoder's are {cfg.hidden_size}"
    if int(memory.next_pos.max()) >= cfg.max_position_embeddings:  # (a garbage answer)
        return f"its next position {int(memory.next_pos.max())} is past the decoder's {cfg.max_position_embeddings}"
    return ""


def base_of(cfg):
    """The real path of a run's HF base checkpoint: what a saved Memory records and is checked against."""
    return os.path.realpath(tiny.base_path(cfg.init_from))


def check_question(question):
    """A one-shot --question (eval.py's, hf_generate.py's) is UTF-8 text: a byte argv could not decode arrives as a
    lone surrogate, which no tokenizer takes."""
    if question.encode("utf-8", "replace").decode() != question:
        raise SystemExit("error: --question is not UTF-8 text")


def check_origin(memory, path, run_dir, question):
    """The run that saved a Memory (--save_memory records it) against the one answering from it, before it loads:
    another method's or another base's is one line, as another question where the encoder read it (ata); another run
    of both, or a checkpoint of the run trained since, a note; a file saved without a record is not checked."""
    cfg = train.run_config(run_dir)[0]
    saved_by, name, base = memory.origin or {}, cfg.method, base_of(cfg)
    if saved_by.get("question", question) != question:
        raise SystemExit(f"error: --memory {path} was compressed for the question {saved_by['question']!r}: a "
                         f"--method {name} encoder reads the question; compress the --context again for another")
    if saved_by.get("method", name) != name:
        raise SystemExit(f"error: --memory {path} was saved by a --method {saved_by['method']} run "
                         f"({saved_by.get('run')}); {run_dir} is a --method {name} run")
    if saved_by.get("base", base) != base:  # (its answers were garbage, after a note)
        raise SystemExit(f"error: --memory {path} was saved by a run on the base {saved_by['base']}; {run_dir} "
                         f"decodes with {base}")
    if saved_by.get("run", os.path.abspath(run_dir)) != os.path.abspath(run_dir):
        print(f"note: --memory {path} was saved by {saved_by['run']}; answering with {run_dir}", file=sys.stderr)
    elif saved_by.get("checkpoint") not in (None, checkpoint_stamp(run_dir)):
        print(f"note: --memory {path} was saved by an earlier checkpoint of {run_dir} (trained since)", file=sys.stderr)


def checkpoint_stamp(run_dir):
    """Which checkpoint of a run dir answers: its file name and when it was written (a run trained anew in the dir
    writes the same name later)."""
    ckpt = train.checkpoint_of(run_dir)[1]
    return f"{os.path.basename(ckpt)}@{os.stat(ckpt).st_mtime_ns}"


def one_shot(ecfg, run_dir, device):
    if not ecfg.context and not ecfg.memory:
        raise SystemExit("error: one-shot mode needs --context FILE or --memory FILE")
    for flag in ("context", "memory"):
        if getattr(ecfg, flag) and not os.path.isfile(getattr(ecfg, flag)):
            raise SystemExit(f"error: --{flag} {getattr(ecfg, flag)!r}: {train.not_a_file(getattr(ecfg, flag))}")
    try:
        context = Path(ecfg.context).read_text(encoding="utf-8-sig").strip() if ecfg.context else ""  # (a file's
        # last newline: training's contexts end at their text, and "\n\nQuestion:" was a layout no run trained on)
    except UnicodeDecodeError:
        raise SystemExit(f"error: --context {ecfg.context}: not UTF-8 text") from None
    if ecfg.context and not context.strip():
        raise SystemExit(f"error: --context {ecfg.context}: empty, nothing to compress")
    check_evaluable(run_dir, ecfg.ratio, ecfg.max_new_tokens)
    memory = Memory.load(ecfg.memory, device) if ecfg.memory else None
    if memory is not None:
        check_origin(memory, ecfg.memory, run_dir, ecfg.question or QUESTION)
    cfg, mcfg, tok, base, method = train.load_run(run_dir, device)
    record = {"id": "one-shot", "context": context, "question": ecfg.question or QUESTION, "answers": [""]}
    check_run(run_dir, getattr(method, "dec", base).config, ecfg.max_new_tokens, len(tok.encode(record["question"])))
    cut = {}
    batch = train.to_device(next(batches_of([record], tok, cfg, 1, getattr(method, "prepare", None), cut)), device)
    if cut:  # collate_qa kept the first max_context tokens, as in training and in evaluating runs
        print(f"note: --context {ecfg.context} is {cfg.max_context + cut['context_tokens_cut']} tokens; the answer "
              f"reads its first {cfg.max_context} (the run's --max_context)", file=sys.stderr)
    if memory is not None and (why := memory_mismatch(memory, getattr(method, "dec", base), method)):
        raise SystemExit(f"error: --memory {ecfg.memory} does not fit {run_dir}: {why}")
    ratio = train.ratios_of(ecfg.ratio or cfg.eval_ratio or cfg.ratio)[0]  # (evaluate_run's order; its first)
    stop = data.stop_ids(tok, cfg.prompt)
    (outs, memory), dt = timed(lambda: answer(method, batch, ratio, ecfg.max_new_tokens, stop, memory))
    print(f"answer: {decode(tok, outs)[0]}")
    shown = "" if ecfg.memory else f" at ratio {ratio}"
    print(f"memory{shown}: {int(memory.slots()[0])} slots, {int(memory.nbytes()[0])} bytes; {dt * 1000:.0f} ms")
    if ecfg.save_memory:
        os.makedirs(os.path.dirname(os.path.abspath(ecfg.save_memory)), exist_ok=True)
        memory.origin = {"run": os.path.abspath(run_dir), "method": cfg.method, "base": base_of(cfg),
                         "checkpoint": checkpoint_stamp(run_dir),
                         **({"question": record["question"]} if getattr(method, "reads_question", False) else {})}
        train.atomic_write(ecfg.save_memory, memory.save)
        print(f"saved the compressed context to {ecfg.save_memory}")


QUESTION = "What is this text about?"  # one-shot mode's, when --question is not given
ONE_SHOT_ONLY, RUNS_ONLY = {"save_memory"}, {"n", "eval_data", "split", "recompute", "out", "batch_size"}


def check_flags(ecfg, given):
    """eval.py's own flags (given: those on the command line), before any work: one line naming the flag."""
    wrong = sorted(given & (RUNS_ONLY if ecfg.one_shot else ONE_SHOT_ONLY))
    if wrong:
        modes = ("evaluating runs", "one-shot mode (--context, --memory, --question)")
        raise SystemExit(f"error: --{wrong[0]} applies to {modes[not ecfg.one_shot]}, not to {modes[ecfg.one_shot]}")
    for flag in sorted(given & {"question", "context", "memory", "out", "save_memory", "eval_data", "ratio"}):  # (an
        # unset shell variable, say: --out "" wrote nothing, --eval_data "" and --ratio "" read the run's own)
        if not getattr(ecfg, flag).strip():
            raise SystemExit(f"error: --{flag} is empty" + (" (leave it out to ask what the text is about)"
                                                               if flag == "question" else ""))
    check_question(ecfg.question)
    if ecfg.context and ecfg.memory:
        raise SystemExit("error: --context and --memory: give one (--memory answers from a saved compressed context)")
    for flag in ("ratio", "save_memory"):
        if ecfg.memory and getattr(ecfg, flag):
            raise SystemExit(f"error: --{flag} applies to compressing a --context; --memory {ecfg.memory} is "
                             "compressed and saved already")
    if ecfg.one_shot and "," in ecfg.ratio:
        raise SystemExit(f"error: --ratio {ecfg.ratio!r}: one-shot mode answers at one ratio")
    for flag in ("batch_size", "max_new_tokens"):
        if getattr(ecfg, flag) < 1:
            raise SystemExit(f"error: --{flag} {getattr(ecfg, flag)} must be a positive integer")
    if not 0 <= ecfg.n <= 1 << 20:  # (the synthetic benchmark would build every one first)
        raise SystemExit(f"error: --n {ecfg.n} must lie in 0..2^20 (0: the run's --eval_examples)")
    if ecfg.ratio:
        train.ratios_of(ecfg.ratio)
    if ecfg.split not in tiny.SPLITS:
        raise SystemExit(f"error: --split {ecfg.split!r}; choose from {', '.join(tiny.SPLITS)}")
    if ecfg.eval_data and not os.path.isfile(ecfg.eval_data):
        raise SystemExit(f"error: --eval_data {ecfg.eval_data!r}: {train.not_a_file(ecfg.eval_data)}")
    for flag in ("out", "save_memory"):
        if getattr(ecfg, flag):
            train.check_writable(getattr(ecfg, flag), f"--{flag}", folder=False)
    if ecfg.save_memory and ecfg.context and os.path.realpath(ecfg.save_memory) == os.path.realpath(ecfg.context):
        raise SystemExit(f"error: --save_memory {ecfg.save_memory!r} is the --context file; name another")
    if ecfg.out and not ecfg.out.endswith(".json"):
        raise SystemExit(f"error: --out {ecfg.out!r}: name a .json file (its plot goes beside it as .png)")
    if ecfg.out and os.path.isfile(ecfg.out):  # replaced whole: only an earlier one (not a dataset, say)
        try:
            earlier_results(ecfg.out)
        except SystemExit:
            raise SystemExit(f"error: --out {ecfg.out!r} is not an eval.py --out JSON; name another") from None
    if ecfg.save_memory and os.path.isfile(ecfg.save_memory):  # likewise: only a saved Memory
        try:
            saved = {"mask", "next_pos"} <= set(tensor_names(ecfg.save_memory))
        except ValueError:
            saved = False
        if not saved:
            raise SystemExit(f"error: --save_memory {ecfg.save_memory!r} is not a saved Memory; name another")


def questions_of(run_dir, ecfg, given):
    """The questions a run to be evaluated is read on (eval_records), after checking the run (check_evaluable) and the
    file they come from: each problem one line, before any run loads."""
    check_evaluable(run_dir, ecfg.ratio, ecfg.max_new_tokens)
    what = asked(run_dir, ecfg)
    flag, path = ("--eval_data", what["eval_data"]) if what["eval_data"] else ("--data", what.get("held_out_of"))
    if path and not os.path.isfile(path):
        raise SystemExit(f"error: {run_dir}'s {flag} {path!r}: {train.not_a_file(path)} (name one with --eval_data)")
    if path and "split" in given:  # (a file has no synthetic split)
        whose = "--eval_data" if ecfg.eval_data else f"its {flag}"  # (the command's, or the run's own)
        raise SystemExit(f"error: --split picks synthetic questions; {run_dir} is read on {whose} {path}")
    records = eval_records(train.run_config(run_dir)[0], ecfg)
    if not records:
        raise SystemExit(f"error: {run_dir}: no evaluation examples (--n / --eval_examples must be > 0)")
    return records


def main(argv):
    (ecfg,), given = train.parse_args(argv, EvalConfig, positional="runs",
                                       usage="python eval.py RUN_DIR [RUN_DIR ...] [--flag value ...]")
    check_flags(ecfg, given)
    run_dirs = [p for spec in ecfg.runs  # a glob's folders: out/suite/* holds each run's .log beside it
                for p in ([p for p in sorted(glob.glob(spec)) if os.path.isdir(p)] or [spec])]
    if not run_dirs:
        raise SystemExit("error: name at least one run dir: python eval.py out/meanpool")
    if unmatched := [p for p in run_dirs if any(c in p for c in "*?[") and not os.path.exists(p)]:
        raise SystemExit(f"error: {unmatched[0]!r} matches no run dir")  # (the shell left the pattern as it is)
    device = train.pick_device(ecfg.device)
    if ecfg.one_shot:
        if len(run_dirs) > 1:
            raise SystemExit(f"error: one-shot mode answers from one run dir; {len(run_dirs)} given: "
                             f"{' '.join(run_dirs)}")
        return one_shot(ecfg, run_dirs[0], device)
    run_dirs = list({os.path.realpath(p): p for p in run_dirs}.values())  # a run named twice is read once
    # every results file read, every run dir seen and its questions read, before any run is evaluated
    read = {r: earlier_results(r) if r.endswith(".json") else cached_result(r, ecfg) for r in run_dirs}
    named = {}  # run -> where it is named: a dir, or an earlier --out JSON's rows (the table listed it twice)
    for r in run_dirs:
        for run in [res["run"] for res in read[r]] if r.endswith(".json") else [r]:
            if (first := named.setdefault(os.path.realpath(run), r)) != r:
                raise SystemExit(f"error: the run {run} is named twice, by {first} and by {r}: name it once")
    unread = sorted(given - {"runs", "out"})
    if unread and all(r.endswith(".json") for r in run_dirs):  # (no run is evaluated, so none reads them)
        raise SystemExit(f"error: --{unread[0]} evaluates run dirs; {run_dirs[0]} is an earlier --out JSON, read as "
                         "it is")
    records = {}
    for r in run_dirs:
        if read[r] is None:  # to be evaluated
            records[r] = questions_of(r, ecfg, given)
        elif not r.endswith(".json"):  # its cached metrics.json
            note_unfinished(r, read_json(os.path.join(r, "run.json")))
    results, evaluated = [], []
    for r in run_dirs:
        evaluated += [] if r.endswith(".json") else [read[r] or evaluate_run(r, ecfg, device, records[r])]
        results += read[r] if r.endswith(".json") else evaluated[-1:]
    print(table(results))
    if ecfg.out:  # its runs by their absolute paths: claims.py and results_md.py read their run.json from anywhere
        written = [{**res, "run": os.path.abspath(res["run"])} if any(res is e for e in evaluated) else res
                   for res in results]
        os.makedirs(os.path.dirname(os.path.abspath(ecfg.out)), exist_ok=True)
        train.atomic_write(ecfg.out, lambda p: Path(p).write_text(json.dumps(written, indent=1)))
        png = plot(results, os.path.splitext(ecfg.out)[0] + ".png")
        print(f"wrote {ecfg.out}" + (f" and {png}" if png else " (no .png: matplotlib is not installed)"))
    return results


if __name__ == "__main__":
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C, and SIGTERM (a scheduler's, `timeout`'s) as Ctrl-C
        signal.signal(sig, signal.default_int_handler)
    try:
        with train.one_line_errors("lower --batch_size"):
            main(sys.argv[1:])
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: each run's metrics.json is written whole when it is done
        print("interrupted: the runs evaluated before it keep their metrics.json", file=sys.stderr)
        sys.exit(130)
