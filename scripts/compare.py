"""Two eval.py results files, question by question: the paired F1 difference of rows with its 95% interval.

    python scripts/compare.py out/meanpool/metrics.json out/pic/metrics.json [--row_a @16 --row_b @16]
    python scripts/compare.py out/meanpool/metrics.json out/meanpool/metrics.json --row_b no-context --metric nll

Rows pair up by requested ratio (or the one row each of --row_a / --row_b picks: a name or part of one,
"@16", "teacher"; "" = the method rows). A verdict per pair: "A > B" when the interval is above 0, "B > A"
when below, else "cannot tell". --metric em or nll (the teacher-forced answer NLL, lower is better: its verdict
names the better side, "A better (lower NLL)") instead of F1.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import eval as evaluate  # noqa: E402
from model import read_json  # noqa: E402


def rows_of(path):
    """{name: row} of a metrics.json or a combined --out JSON; a method row is named "method@ratio"."""
    if not path.strip():  # (an unset shell variable: it read the folder "")
        raise SystemExit("error: a results JSON named '': name a metrics.json or an eval.py --out JSON")
    try:
        results = read_json(path)
        rows = {}
        for res in results if isinstance(results, list) and results else [results]:
            if why := evaluate.result_error(res):
                raise SystemExit(f"error: {path} is not an eval.py results JSON: {why}")
            for r in [res["teacher"], res["no_context"]] + res["rows"]:
                name = r["method"] + (f"@{r['ratio_requested']}" if "ratio_requested" in r else "")
                if rows.setdefault(name, r).get("scores") != r.get("scores"):  # two runs' rows of one name
                    raise SystemExit(f"error: {path}: two different rows named {name!r}: compare the runs' own "
                                     f"metrics.json files")
        return rows
    except OSError as e:
        raise SystemExit(f"error: cannot read {path} ({e.strerror})")
    except ValueError as e:  # (read_json's: not JSON; the shape is result_error's)
        raise SystemExit(f"error: {path} is not an eval.py results JSON ({e})")


def picks(row, name):
    """Whether --row_a / --row_b `row` names the row `name`: a ratio ("@16") is its end, so @1 is not @16; else a
    part of it ("teacher", "pic")."""
    return name.endswith(row) if row.startswith("@") else row in name


def compare(path_a, path_b, row_a="", row_b="", metric="f1"):
    """One line per pair of rows: both values on the shared questions, A - B with its paired 95% CI, a verdict.
    A row without ratio (teacher, no-context) picked alone pairs with every row of the other side."""
    a, b = rows_of(path_a), rows_of(path_b)
    na, nb = ([n for n in rows if (picks(row, n) if row else "ratio_requested" in rows[n])]
              for rows, row in ((a, row_a), (b, row_b)))
    pairs = [(x, y) for x in na for y in nb
             if len(na) == len(nb) == 1 or a[x].get("ratio_requested") == b[y].get("ratio_requested")
             or (len(nb) == 1 and "ratio_requested" not in b[y]) or (len(na) == 1 and "ratio_requested" not in a[x])]
    if not pairs:
        raise SystemExit(f"error: no rows to pair; pick them with --row_a/--row_b from "
                         f"A: {', '.join(a)}; B: {', '.join(b)}")
    lines, label, d = [], metric.upper(), 2 if metric == "nll" else 1
    for x, y in pairs:
        for path, name, row in ((path_a, x, a[x]), (path_b, y, b[y])):
            if "scores" not in row:
                raise SystemExit(f"error: {path}: row {name!r} has no per-question scores; rerun eval.py --recompute")
        if metric not in a[x]["scores"] or metric not in b[y]["scores"]:
            lines.append(f"A {x} vs B {y}: {label} not in both rows (an older eval.py wrote them: --recompute)")
            continue
        try:
            c = evaluate.paired_diff_ci(a[x]["scores"][metric], b[y]["scores"][metric])
        except ValueError as e:  # (evaluated on other questions)
            raise SystemExit(f"error: A {x} vs B {y}: {e}") from None
        lo, hi = c["ci"]
        verdict = "A > B" if lo > 0 else "B > A" if hi < 0 else "cannot tell"
        if metric == "nll" and verdict != "cannot tell":  # lower is better
            verdict = "B better (lower NLL)" if lo > 0 else "A better (lower NLL)"
        lines.append(f"A {x} {label} {c['a']:.{d}f} vs B {y} {label} {c['b']:.{d}f} on {c['n']} questions: "
                     f"A - B {c['diff']:+.{d}f} [{lo:+.{d}f}, {hi:+.{d}f}] -> {verdict}")
    print("\n".join(lines))
    return lines


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", help="results JSON A (a metrics.json or eval.py --out)")
    parser.add_argument("b", help="results JSON B")
    parser.add_argument("--row_a", default="", help='rows of A: a name or part of one ("@16", "teacher")')
    parser.add_argument("--row_b", default="", help="the same for B")
    parser.add_argument("--metric", default="f1", choices=("f1", "em", "nll"),
                        help="per-question values to pair: F1, EM, or the answer NLL (lower is better)")
    parser.error = lambda message: sys.exit(f"error: {message}")
    args = parser.parse_args(argv)
    return compare(args.a, args.b, args.row_a, args.row_b, args.metric)


if __name__ == "__main__":
    main(sys.argv[1:])
