"""Evaluation (SPEC §4): EM / F1, teacher-normalised F1, achieved compression ratio,
memory size and answering time, for one or many run dirs; and a one-shot mode.

    python eval.py out/meanpool                       # one run, its ratios, + teacher rows
    python eval.py out/meanpool out/pic --ratio 4,16  # one table over several runs
    python eval.py out/pic --context doc.txt --question "Who ...?" --save_memory doc.mem
    python eval.py out/pic --memory doc.mem --question "Where ...?"

Rows: the teacher with full context, the teacher with no context, then method@ratio.
Teacher-normalised F1 = (F1 - F1_noctx) / (F1_teacher - F1_noctx) (meanpool_multi_ratio
§5.1). Results go to <run>/metrics.json; with several runs, --out writes the combined
JSON (and a PNG of F1 vs ratio when matplotlib is installed).
"""
import collections
import glob
import json
import os
import re
import string
import sys
import time
from dataclasses import dataclass

import torch

import data
import train
from model import Memory


@dataclass
class EvalConfig:
    runs: str = ""             # run dirs (positional arguments, globs allowed)
    ratio: str = ""            # "" = the ratios the run was trained with
    split: str = "test"        # synthetic split (when the run trained on synthetic data)
    eval_data: str = ""        # QA file; "" = the run's --eval_data, else synthetic
    n: int = 0                 # examples (0 = the run's eval_examples)
    batch_size: int = 16
    max_new_tokens: int = 32
    recompute: bool = False    # ignore cached <run>/metrics.json
    out: str = ""              # combined JSON (+ .png) for several runs
    device: str = ""
    # --- one-shot mode
    context: str = ""          # a text file to compress
    question: str = ""
    memory: str = ""           # answer from a saved compressed context
    save_memory: str = ""      # save the compressed context of --context


# -----------------------------------------------------------------------------
# SQuAD v1.1 metrics


def normalize_answer(s):
    """Lower text and remove punctuation, articles and extra whitespace (official SQuAD)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1_score(prediction, gold):
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def qa_metrics(predictions, answers):
    """predictions: list of strings; answers: list of lists of gold strings ->
    {"em", "f1"} in percent, max over gold answers per question."""
    if not predictions:
        return {"em": 0.0, "f1": 0.0}
    em = f1 = 0.0
    for pred, golds in zip(predictions, answers):
        em += max(float(normalize_answer(pred) == normalize_answer(g)) for g in golds)
        f1 += max(f1_score(pred, g) for g in golds)
    return {"em": 100 * em / len(predictions), "f1": 100 * f1 / len(predictions)}


# -----------------------------------------------------------------------------
# evaluating a run


def eval_records(cfg, ecfg):
    n = ecfg.n or cfg.eval_examples
    path = ecfg.eval_data or cfg.eval_data
    if path:
        return list(train.read_records(path, cfg))[:n]
    return data.Synthetic(seed=cfg.seed, split=ecfg.split).qa_examples(n)


def batches_of(records, tok, cfg, size, prepare=None):
    for i in range(0, len(records), size):
        b = data.collate_qa(records[i:i + size], tok, max_context=cfg.max_context, max_answer=cfg.max_answer,
                            pad_multiple=1)
        yield prepare(b) if prepare else b


@torch.no_grad()
def answer(method, batch, ratio, max_new_tokens):
    """Greedy answers from a method's compressed context: (list of id lists, Memory).
    Each method says how its decoder reads a Memory in `answer_from_memory`."""
    memory = method.compress(batch, ratio)
    prompts = [batch["qa"][b, :batch["prompt_len"][b]].tolist() for b in range(len(batch["qa"]))]
    return method.answer_from_memory(memory, prompts, max_new_tokens), memory


def decode(tok, outs):
    return [tok.decode(o).strip() for o in outs]


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.time()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.time() - t


@torch.no_grad()
def teacher_rows(base, tok, records, cfg, ecfg, device):
    """The base with full context and with no context (SPEC §4)."""
    rows = {}
    for name, key in (("teacher", "full"), ("no-context", "noctx")):
        preds, golds, secs = [], [], 0.0
        for b in batches_of(records, tok, cfg, ecfg.batch_size):
            lab = b[f"{key}_labels"]
            first = (lab != -100).float().argmax(1)  # the last prompt token predicts the first answer token
            prompts = [b[key][i, :first[i] + 1].tolist() for i in range(len(first))]
            with base.adapter(None):
                outs, dt = timed(lambda: base.generate([p for p in prompts], ecfg.max_new_tokens))
            preds += decode(tok, outs)
            golds += b["answers"]
            secs += dt
        rows[name] = {"method": name, "ratio": 1.0 if key == "full" else None, **qa_metrics(preds, golds),
                      "examples_per_s": len(preds) / secs, "n": len(preds)}
    return rows


@torch.no_grad()
def method_rows(method, tok, records, cfg, ecfg, ratios, device):
    rows = []
    for r in ratios:
        preds, golds, achieved, nbytes, secs = [], [], [], [], 0.0
        extra = collections.defaultdict(list)
        for b in batches_of(records, tok, cfg, ecfg.batch_size, getattr(method, "prepare", None)):
            b = train.to_device(b, device)
            (outs, memory), dt = timed(lambda: answer(method, b, r, ecfg.max_new_tokens))
            preds += decode(tok, outs)
            golds += b["answers"]
            slots = memory.slots().float().clamp(min=1)
            achieved += (b["context_len"].float() / slots).tolist()
            nbytes += memory.nbytes().tolist()
            for k, v in getattr(memory, "stats", {}).items():
                extra[k] += list(v)
            secs += dt
        row = {"method": cfg.method if not getattr(cfg, "tag", "") else cfg.tag, "ratio_requested": r,
               "ratio": sum(achieved) / len(achieved), **qa_metrics(preds, golds),
               "memory_bytes": sum(nbytes) / len(nbytes), "examples_per_s": len(preds) / secs, "n": len(preds),
               "examples": [{"pred": p, "gold": g} for p, g in list(zip(preds, golds))[:5]]}
        row.update({k: sum(v) / len(v) for k, v in extra.items()})
        rows.append(row)
    return rows


def normalised(rows, teacher, noctx):
    gap = teacher["f1"] - noctx["f1"]
    for row in rows:
        row["f1_norm"] = (row["f1"] - noctx["f1"]) / gap if gap > 0 else float("nan")
    return rows


def run_label(run_dir, mcfg):
    """Method name plus the flags given on its command line: the trained ratios and the
    method's own, and the first stage's objective for a second stage (e.g.
    "pic (ratio=16, mask=causal)", "ata (after rel)")."""
    state = json.load(open(os.path.join(run_dir, "run.json")))
    train_ratio = [f"ratio={state['train']['ratio']}"] if "ratio" in state.get("flags", []) else []
    flags = train_ratio + [f"{k}={getattr(mcfg, k)}" for k in state.get("flags", []) if hasattr(mcfg, k)]
    first = train.first_stage(state["train"]["init_from"], state["train"]["method"])
    if first:
        flags.append(f"after {first['objective']}")
    return state["train"]["method"] + (f" ({', '.join(flags)})" if flags else "")


def evaluate_run(run_dir, ecfg):
    cached = os.path.join(run_dir, "metrics.json")
    if os.path.exists(cached) and not ecfg.recompute and not ecfg.ratio:
        try:
            return json.load(open(cached))
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {cached}: corrupt metrics file ({e}); rerun with --recompute")
    device = torch.device(ecfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg, mcfg, tok, base, method = train.load_run(run_dir, device)
    if not hasattr(method, "answer_from_memory"):
        raise SystemExit(f"error: {run_dir} is a --method {cfg.method} run; eval.py evaluates compressor runs")
    ratios = train.ratios_of(ecfg.ratio or cfg.ratio)
    records = eval_records(cfg, ecfg)
    if not records:
        raise SystemExit(f"error: {run_dir}: no evaluation examples (--n / --eval_examples must be > 0)")
    t = teacher_rows(base, tok, records, cfg, ecfg, device)
    rows = method_rows(method, tok, records, cfg, ecfg, ratios, device)
    label = run_label(run_dir, mcfg)
    heldout = getattr(method, "heldout_metrics", None)  # e.g. sentence_gist: perplexity (SPEC §4)
    extra = heldout([r["context"] for r in records]) if heldout else {}
    for row in rows:
        row["method"], row["run"] = label, run_dir
        row.update(extra)
    result = {"run": run_dir, "teacher": t["teacher"], "no_context": t["no-context"],
              "rows": normalised(rows, t["teacher"], t["no-context"])}
    with open(cached + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(cached + ".tmp", cached)
    return result


EXTRA = {"k": "mean k {:.2f}", "probe_abs_err": "probe MAE {:.1f}", "gist_rc": "gist r_c {:.1f}",
         "ppl_compressed": "ppl {:.2f}", "ppl_full": "(full {:.2f})"}  # method-specific columns


def extra_text(row):
    return ", ".join(fmt.format(row[k]) for k, fmt in EXTRA.items() if k in row) or "-"


def table(results):
    """One markdown table: teacher and no-context rows (from the first run), then one row
    per run x ratio."""
    head = "| method | ratio | EM | F1 | F1/teacher | memory bytes | examples/s | method-specific |"
    lines = [head, "|" + "---|" * 8]
    first = results[0]
    rows = [first["teacher"], first["no_context"]] + [r for res in results for r in res["rows"]]
    for r in rows:
        ratio = f"{r['ratio']:.1f}x" if r.get("ratio") else "-"
        norm = f"{r['f1_norm']:.2f}" if "f1_norm" in r else "-"
        mem = f"{r['memory_bytes']:.0f}" if "memory_bytes" in r else "-"
        lines.append(f"| {r['method']} | {ratio} | {r['em']:.1f} | {r['f1']:.1f} | {norm} | {mem} | "
                     f"{r['examples_per_s']:.1f} | {extra_text(r)} |")
    return "\n".join(lines)


def plot(results, path):
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
def one_shot(ecfg):
    run = ecfg.runs.split()[0]
    device = torch.device(ecfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg, mcfg, tok, base, method = train.load_run(run, device)
    ratio = train.ratios_of(ecfg.ratio or cfg.ratio)[0]
    question = ecfg.question or "What is this text about?"
    context = open(ecfg.context).read() if ecfg.context else ""
    record = {"id": "one-shot", "context": context, "question": question, "answers": [""]}
    batch = train.to_device(next(batches_of([record], tok, cfg, 1, getattr(method, "prepare", None))), device)
    t0 = time.time()
    if ecfg.memory:
        memory = Memory.load(ecfg.memory, device)
        prompt = [batch["qa"][0, :batch["prompt_len"][0]].tolist()]
        outs = method.answer_from_memory(memory, prompt, ecfg.max_new_tokens)
    else:
        if not ecfg.context:
            raise SystemExit("error: one-shot mode needs --context FILE or --memory FILE")
        if batch["context_len"][0] > cfg.max_context:
            raise SystemExit(f"error: --context {ecfg.context} is longer than --max_context {cfg.max_context}")
        outs, memory = answer(method, batch, ratio, ecfg.max_new_tokens)
    dt = time.time() - t0
    if ecfg.save_memory:
        memory.save(ecfg.save_memory)
    print(f"answer: {decode(tok, outs)[0]}")
    print(f"memory: {int(memory.slots()[0])} slots, {int(memory.nbytes()[0])} bytes; {dt * 1000:.0f} ms")
    if ecfg.save_memory:
        print(f"saved the compressed context to {ecfg.save_memory}")


def main(argv):
    (ecfg,), _ = train.parse_args(argv, EvalConfig, positional="runs",
                                  usage="python eval.py RUN_DIR [RUN_DIR ...] [--flag value ...]")
    runs = [p for spec in ecfg.runs.split() for p in (sorted(glob.glob(spec)) or [spec])]
    if not runs:
        raise SystemExit("error: name at least one run dir: python eval.py out/meanpool")
    ecfg.runs = " ".join(runs)
    if ecfg.context or ecfg.memory or ecfg.question:
        return one_shot(ecfg)
    results = [evaluate_run(r, ecfg) for r in runs]
    print(table(results))
    if ecfg.out:
        with open(ecfg.out, "w") as f:
            json.dump(results, f, indent=1)
        png = plot(results, os.path.splitext(ecfg.out)[0] + ".png")
        print(f"wrote {ecfg.out}" + (f" and {png}" if png else ""))
    return results


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ValueError as e:
        raise SystemExit(f"error: {e}")
