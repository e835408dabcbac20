"""Each paper's headline claims as data, and a verdict for each from the suite's results.

    python scripts/claims.py out/suite/results.json        # the claims table (markdown)
    python scripts/claims.py out/suite/results.json out/suite-s1/results.json ...  # one per seed

A suite run is one training seed (SEED=1 OUT=out/suite-s1 RESULTS=out/suite-s1/RESULTS.md
bash scripts/reproduce.sh): its intervals cover the questions, not the training draw. Given
several, the table has a column per seed ("seed N", from the runs' run.json), each with its
verdicts, and a last column over them: "every seed agrees" (disagrees, cannot tell), or the
count of each verdict (a tiny-base row can move by a third of the teacher's gain between
seeds, so a one-seed verdict is a draw).

A claim says "row A beats row B" (or "A matches B") with the paper's own numbers for A
and B. Rows are named "RUN@RATIO": RUN is a run dir name of scripts/reproduce.sh, RATIO
the requested ratio ("RUN" alone when the run has one row); B may be a number instead (a
threshold). The verdict comes from our numbers:

  F1 claims (per question, eval.paired_diff_ci: A - B on the questions both rows answered,
  paired-bootstrap 95% interval [lo, hi]):
    ">"  A beats B:  agrees when lo > 0, disagrees when hi < 0, else cannot tell.
    "~"  A matches B within `margin` F1 points (the paper's "multi-ratio costs little"):
         agrees when -margin <= lo and hi <= margin (the whole interval inside the band),
         disagrees when lo > margin or hi < -margin (the whole interval outside it), else
         cannot tell. Also cannot tell when neither row beats the no-context row (lo > 0
         against it): two compressors that learned nothing "match" vacuously. The default
         margin, 5 F1: per-question F1 differences (-100 to 100) have a standard deviation
         of about 50 in RESULTS.md's rows (100 at most), so at 400 questions the interval's
         half-width is about 5; a tighter band could rarely agree at this size.
  Either: cannot tell when the rows share fewer than MIN_SHARED (30) questions, whatever the interval.
  Scalar claims (a number the row reports without per-question values: achieved "ratio", "gist_rc",
  "ppl_compressed", "probe_abs_err"): no interval, so the verdict reads the point values
  and says "(no CI)":
    ">" / "<"  A's value above / below B's;
    "~"  A / B within `margin` of the paper's A / B (e.g. the ratio halving per doubling).
    A perplexity claim where neither row's cache beats no first half (its ppl_none) cannot tell:
    it would order two failures.
  A claim whose rows the results lack, or whose two rows share no question, gets "no data".

Given one results file, a second table follows (`controls`): the teacher and every method row against its run's
no-context row in F1, and against itself reading another context's memory in eval.py's teacher-forced answer NLL.
"""
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import eval as evaluate  # noqa: E402
from model import read_json  # noqa: E402


@dataclass
class Claim:
    source: str             # paper and table
    text: str               # the claim in words
    a: str                  # row A: "RUN@RATIO" or "RUN"
    b: str                  # row B, or a number (a threshold)
    paper_a: float          # the paper's number for A (None: a curve, no number in the text)
    paper_b: float
    kind: str = ">"         # ">" | "<" | "~" (see the docstring)
    metric: str = "f1"      # "f1" (paired CI) or a scalar row key: ratio | gist_rc | ppl_compressed | probe_abs_err
    margin: float = 5.0     # "~": F1 points (f1), or the allowed error of A / B (scalars)


MIN_SHARED = 30  # questions two rows must share for an F1 verdict: the percentile interval covers 93 % of the time
# at 30, 86 % at 10, 63 % at 4 (paired F1 differences, simulated), not the 95 % it names

MP, PIC, GIST = "meanpool_multi_ratio", "pic_blockwise_causal", "sentence_gist"
SAC, ATA = "sac_semantic_anchor", "ata_compressor"
CLAIMS = [
    # meanpool_multi_ratio Table 1: Qwen3-8B, multi-ratio training (as ours), avg F1 of 6 QA sets
    Claim(f"{MP} T1", "mean pooling > bidirectional compression tokens, 4x", "meanpool@4", "ctok-bidir@4", 70.55, 69.57),
    Claim(f"{MP} T1", "mean pooling > bidirectional compression tokens, 16x", "meanpool@16", "ctok-bidir@16", 64.67, 63.01),
    Claim(f"{MP} T1", "mean pooling > causal compression tokens, 4x", "meanpool@4", "ctok-causal@4", 70.55, 65.90),
    Claim(f"{MP} T1", "mean pooling > causal compression tokens, 16x", "meanpool@16", "ctok-causal@16", 64.67, 58.41),
    Claim(f"{MP} T1", "bidirectional > causal compression tokens, 4x", "ctok-bidir@4", "ctok-causal@4", 69.57, 65.90),
    Claim(f"{MP} T1", "bidirectional > causal compression tokens, 16x", "ctok-bidir@16", "ctok-causal@16", 63.01, 58.41),
    Claim(f"{MP} T1", "multi-ratio ~ single-ratio mean pooling, 4x", "meanpool@4", "meanpool-single4@4", 70.55, 71.66, "~"),
    Claim(f"{MP} T1", "multi-ratio ~ single-ratio mean pooling, 16x", "meanpool@16", "meanpool-single16@16", 64.67, 63.85,
          "~"),
    # meanpool_multi_ratio Table 3: Gemma2-2B ablations (mean change over 4x-128x: -0.7, -1.4)
    Claim(f"{MP} T3", "the linear layer helps a little, 4x", "meanpool@4", "meanpool-no_linear@4", 68.1, 67.7),
    Claim(f"{MP} T3", "the linear layer helps a little, 16x", "meanpool@16", "meanpool-no_linear@16", 61.0, 60.0),
    Claim(f"{MP} T3", "all ratios per example > one sampled ratio, 4x", "meanpool@4", "meanpool-sampling@4", 68.1, 67.1),
    Claim(f"{MP} T3", "all ratios per example > one sampled ratio, 16x", "meanpool@16", "meanpool-sampling@16", 61.0, 59.3),
    # pic Table 4: 16x, Qwen2.5-0.5B compressor, frozen Llama-3-8B, avg F1 of 4 RAG QA sets
    Claim(f"{PIC} T4", "block-wise causal > full causal memory mask, 16x", "pic-blockwise@16", "pic-causal@16", 52.01, 48.80),
    Claim(f"{PIC} Fig. 6", "ae+lm pretraining before qa helps, 16x", "pic-blockwise-ae+lm@16", "pic-blockwise@16",
          None, None),
    # sentence_gist, Llama-3.2-3B. T4 stage 3: the mean accuracy of ARC, HS, MMLU, WG (each column agrees; T2's
    # HELMET longqa does not order N_g) and PG19 perplexity, whose tokens include the gists (App. C.3; ours: the
    # regular tokens of each evaluation context's second half, after its first). The real suite trains N_g 2 and 4.
    # Not a claim: T7's R_c halving per doubling of N_g, which eq. 2's R_c = tokens / (N_g x sentences) does by itself.
    Claim(f"{GIST} T4", "more gists, higher quality: N_g 8 > 1", "gist-8", "gist-1", 56.02, 52.65),
    Claim(f"{GIST} T4", "more gists, higher quality: N_g 4 > 2", "gist-4", "gist-2", 55.97, 55.04),
    Claim(f"{GIST} T4", "more gists, lower perplexity: N_g 8 < 1", "gist-8", "gist-1", 7.17, 12.83, "<", "ppl_compressed"),
    Claim(f"{GIST} T4", "more gists, lower perplexity: N_g 4 < 2", "gist-4", "gist-2", 9.24, 11.29, "<", "ppl_compressed"),
    # sac Tables 3-4: 5x, Llama-3.2-1B, avg F1 of the in-domain sets (TriviaQA, HotpotQA)
    Claim(f"{SAC} T3", "SAC > w/o bidirectional mask", "sac-r5", "sac-causal-r5", 66.24, 63.62),
    Claim(f"{SAC} T3", "SAC > w/o anchor embedding", "sac-r5", "sac-no_emb-r5", 66.24, 64.58),
    Claim(f"{SAC} T3", "w/o anchor embedding > w/o bidirectional mask", "sac-no_emb-r5", "sac-causal-r5", 64.58, 63.62),
    Claim(f"{SAC} T4", "middle (uniform) anchors > random anchors", "sac-r5", "sac-random-r5", 66.24, 59.04),
    # ata Table 2: MS MARCO, LLaMA-2-7B; Table 6: the probe's MAE in tokens (4.52 HotpotQA, 7.63 MS MARCO, 13.99 SQuAD)
    Claim(f"{ATA} T2", "ATA > w/o adaptive allocation (AAC)", "ata", "ata-no_aac", 50.06, 47.52),
    Claim(f"{ATA} T2", "ATA > w/o selective reconstruction", "ata", "ata-no_selective", 50.06, 40.83),
    Claim(f"{ATA} T2", "w/o AAC > w/o selective reconstruction", "ata-no_aac", "ata-no_selective", 47.52, 40.83),
    Claim(f"{ATA} T2", "ATA compresses more than w/o AAC", "ata", "ata-no_aac", 27.36, 19.06, ">", "ratio"),
    Claim(f"{ATA} T6", "the probe's MAE in tokens < the paper's worst (SQuAD; HotpotQA 4.52, MS MARCO 7.63)", "ata",
          "13.99", 13.99, 13.99, "<", "probe_abs_err"),
]


def find_row(results, name, floor=False):
    """The row "RUN@RATIO" (or "RUN" with one row, or "teacher" / "no-context") of an
    eval.py --out list; None when absent. floor: its run's no-context row instead."""
    run, _, ratio = name.partition("@")
    for res in results:
        if run in ("teacher", "no-context"):
            return res["teacher" if run == "teacher" else "no_context"]
        if os.path.basename(os.path.normpath(res["run"])) != run:
            continue
        if floor:
            return res["no_context"]
        rows = [r for r in res["rows"] if not ratio or str(r.get("ratio_requested")) == ratio]
        if not ratio and len(rows) != 1:
            raise SystemExit(f"error: run {res['run']} has {len(rows)} rows and a claim names it alone ({name}): "
                             "evaluate it at one ratio")
        return rows[0] if rows else None
    return None


def value_of(side, results, metric):
    """A row's scalar (or a threshold given as a number); None when absent."""
    try:
        return float(side)
    except ValueError:
        row = find_row(results, side)
        return row.get(metric) if row else None


def judge(claim, results):
    """{"a", "b": our numbers, "diff", "ci" (F1 claims), "verdict"} of one claim."""
    if claim.metric != "f1":
        a, b = value_of(claim.a, results, claim.metric), value_of(claim.b, results, claim.metric)
        if a is None or b is None:
            return {"a": a, "b": b, "verdict": "no data"}
        if claim.metric == "ppl_compressed":  # (a number as a side has no floor: never vacuous)
            floors = [(find_row(results, side) or {}).get("ppl_none") for side in (claim.a, claim.b)]
            if None not in floors and a >= floors[0] and b >= floors[1]:
                return {"a": a, "b": b, "verdict": "cannot tell (no CI)"}
        if claim.kind == "~":
            ok = abs(a / b - claim.paper_a / claim.paper_b) <= claim.margin
        else:
            ok = a > b if claim.kind == ">" else a < b
        return {"a": a, "b": b, "verdict": ("agrees" if ok else "disagrees") + " (no CI)"}
    ra, rb = find_row(results, claim.a), find_row(results, claim.b)
    if ra is None or rb is None or "scores" not in ra or "scores" not in rb:
        return {"a": ra and ra["f1"], "b": rb and rb["f1"], "verdict": "no data"}
    c = paired(ra["scores"]["f1"], rb["scores"]["f1"])
    if c is None:
        return {"a": ra["f1"], "b": rb["f1"], "verdict": "no data"}
    out = {**c, "verdict": verdict(claim, *c["ci"]) if c["n"] >= MIN_SHARED else "cannot tell"}
    floors = [find_row(results, name, floor=True) for name in (claim.a, claim.b)]  # each run's own (a PRIOR's too)
    to_floor = [paired(r["scores"]["f1"], f["scores"]["f1"]) for r, f in zip((ra, rb), floors) if f and "scores" in f]
    above = [d["ci"][0] > 0 for d in to_floor if d]
    if claim.kind == "~" and len(above) == 2 and not any(above):
        out["verdict"] = "cannot tell"  # both at the no-context level: a vacuous match
    return out


def paired(scores_a, scores_b):
    """eval.paired_diff_ci of two rows' scores, or None where they share no question (read on other questions) or
    a value is not finite (a diverged run's NLL)."""
    try:
        return evaluate.paired_diff_ci(scores_a, scores_b)
    except ValueError:
        return None


def side_of_zero(lo, hi):
    """Where a 95% interval of A - B lies: "above" 0, "below" 0, or "cannot tell"."""
    return "above" if lo > 0 else "below" if hi < 0 else "cannot tell"


def verdict(claim, lo, hi):
    """The rule of the docstring on a 95% interval [lo, hi] of A - B."""
    if claim.kind == "~":
        m = claim.margin
        return "agrees" if -m <= lo and hi <= m else "disagrees" if lo > m or hi < -m else "cannot tell"
    assert claim.kind == ">", f"F1 claims are '>' or '~', not {claim.kind!r}"
    return {"above": "agrees", "below": "disagrees"}.get(side_of_zero(lo, hi), "cannot tell")


def fmt(x, digits=1):
    return "-" if x is None else f"{x:.{digits}f}"


def sides(c):
    """ "A > B" as the table names it, with the metric when it is not F1."""
    return f"{c.a} {c.kind} {c.b}" + ("" if c.metric == "f1" else f" ({c.metric})")


def values_text(c, j):
    """Our "A / B" values of a judged claim (F1 to 1 decimal, scalars to 2)."""
    digits = 1 if c.metric == "f1" else 2
    return f"{fmt(j['a'], digits)} / {fmt(j['b'], digits)}"


def ci_text(j, default="-"):
    """A judged claim's "A - B [lo, hi]", or default when it has no interval."""
    return f"{j['diff']:+.1f} [{j['ci'][0]:+.1f}, {j['ci'][1]:+.1f}]" if "ci" in j else default


def table(results, claims=CLAIMS):
    """Markdown: one line per claim with the paper's numbers, ours, A - B [95% CI] and the
    verdict; then the count of each verdict."""
    lines = ["| source | claim | A vs B | paper A / B | ours A / B | A - B [95% CI] | verdict |",
             "|" + "---|" * 7]
    counts = {}
    for c in claims:
        j = judge(c, results)
        paper = f"{fmt(c.paper_a, 2)} / {fmt(c.paper_b, 2)}" if c.paper_a is not None else "curve, no number"
        lines.append(f"| {c.source} | {c.text} | {sides(c)} | {paper} | {values_text(c, j)} | {ci_text(j)} | "
                     f"**{j['verdict']}** |")
        counts[j["verdict"]] = counts.get(j["verdict"], 0) + 1
    lines.append("")
    lines.append(f"{len(claims)} claims: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


CONTROLS = ("Each row against its controls, paired over the questions (answer NLL: teacher-forced, nats per answer "
            "token)")


def controls(results):
    """Markdown: the teacher and each method row ("RUN@RATIO", "RUN" when its run has one row) against two
    controls, paired over the questions: F1 against its run's no-context row (a memory that helps is above), and
    eval.py's teacher-forced answer NLL against the same row's after another context's memory (below: the
    memory carries its own context, not only an answer format the decoder learned)."""
    lines = ["| row | F1 - no context [95% CI] | verdict | answer NLL - after another's memory [95% CI] | verdict |",
             "|" + "---|" * 5]
    named = [("teacher", results[0]["teacher"], results[0]["no_context"])]
    for res in results:
        run = os.path.basename(os.path.normpath(res["run"]))
        named += [(run if len(res["rows"]) == 1 else f"{run}@{r.get('ratio_requested')}", r, res["no_context"])
                  for r in res["rows"]]
    for name, row, floor in named:
        cells = []
        for (a, key_a), (b, key_b), digits in (((row, "f1"), (floor, "f1"), 1), ((row, "nll"), (row, "nll_other"), 2)):
            c = paired(a["scores"][key_a], b["scores"][key_b]) if key_a in a.get("scores", {}) and \
                key_b in b.get("scores", {}) else None
            if c is None:
                cells += ["-", "no data"]
                continue
            lo, hi = c["ci"]
            cells += [f"{c['diff']:+.{digits}f} [{lo:+.{digits}f}, {hi:+.{digits}f}]",
                      side_of_zero(lo, hi) if c["n"] >= MIN_SHARED else "cannot tell"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def over_seeds(verdicts):
    """(verdict, group) of a claim over seeds: "every seed agrees / disagrees / cannot tell", else the count
    of each verdict, grouped as mixed, no data on some seed, or no data."""
    verdicts = [v.replace(" (no CI)", "") for v in verdicts]
    kinds = set(verdicts)
    if len(kinds) == 1 and kinds <= {"agrees", "disagrees", "cannot tell"}:
        return f"every seed {verdicts[0]}", f"every seed {verdicts[0]}"
    order = ("agrees", "cannot tell", "disagrees", "no data")
    counts = ", ".join(f"{verdicts.count(k)} {k}" for k in order if k in kinds)
    return counts, "mixed" if "no data" not in kinds else "no data" if kinds == {"no data"} else "no data on some seed"


def seeds_table(runs, claims=CLAIMS):
    """Markdown over several suite runs {name: results}: per claim, A - B [95% CI] and the
    verdict of each run, then the verdict over them (over_seeds); then the count of each."""
    lines = ["| source | claim | A vs B | " + " | ".join(runs) + " | over seeds |", "|" + "---|" * (len(runs) + 4)]
    counts = {}
    for c in claims:
        cells, verdicts = [], []
        for results in runs.values():
            j = judge(c, results)
            cells.append(f"{ci_text(j, values_text(c, j))} {j['verdict']}")
            verdicts.append(j["verdict"])
        total, group = over_seeds(verdicts)
        lines.append(f"| {c.source} | {c.text} | {sides(c)} | " + " | ".join(cells) + f" | **{total}** |")
        counts[group] = counts.get(group, 0) + 1
    lines.append("")
    lines.append(f"{len(claims)} claims over {len(runs)} seeds: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    return "\n".join(lines)


def train_configs(results):
    """Each run's training config (its run.json's "train"; {} when the run dir is gone)."""
    configs = []
    for res in results:
        path = os.path.join(res["run"], "run.json")
        state = read_json(path) if os.path.exists(path) else {"train": {}}
        if not isinstance(state, dict) or not isinstance(state.get("train"), dict):
            raise SystemExit(f"error: {path}: not a run.json written by train.py (needs train)")
        configs.append(state["train"])
    return configs


def suite_name(path, results):
    """A suite's column: "seed N" when all its runs trained at seed N, else its out dir's name."""
    seeds = {cfg.get("seed") for cfg in train_configs(results)}
    if len(seeds) == 1 and None not in seeds:
        return f"seed {seeds.pop()}"
    return os.path.basename(os.path.dirname(os.path.abspath(path)))


def main(argv):
    if argv and argv[0] in ("-h", "--help"):
        return print("\n\n".join(__doc__.split("\n\n")[:2]))  # the title and usage
    flags = [a for a in argv if a.startswith("-")]
    if not argv or flags:
        raise SystemExit(f"error: {f'unknown flag {flags[0]}; ' if flags else ''}usage: python scripts/claims.py "
                         "RESULTS.json [RESULTS.json ...]  (eval.py --out of scripts/reproduce.sh; several: one per "
                         "seed)")
    if len(argv) == 1:
        results = evaluate.earlier_results(argv[0])
        return print(table(results) + f"\n\n{CONTROLS}:\n\n" + controls(results))
    twice = [p for i, p in enumerate(argv) if os.path.realpath(p) in map(os.path.realpath, argv[:i])]
    if twice:  # (one seed counted twice)
        raise SystemExit(f"error: {twice[0]} is named twice; name each seed's results once")
    runs = [evaluate.earlier_results(p) for p in argv]
    names = [suite_name(p, res) for p, res in zip(argv, runs)]
    same = [(argv[j], p) for i, p in enumerate(argv) for j in range(i) if runs[i] == runs[j]]
    if same:  # (a copy of one seed's file counted as a second seed)
        raise SystemExit(f"error: {same[0][1]} holds the same results as {same[0][0]}: name each seed's results once")
    if len(set(names)) < len(names):
        names = argv
    print(seeds_table(dict(zip(names, runs))))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ValueError, OSError) as e:  # a run.json that cannot be read
        raise SystemExit(f"error: {e}")
