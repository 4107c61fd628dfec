#!/usr/bin/env python3
"""Writes tests/fixtures/eval/sklearn_metrics.json: fixed probability sets and what scikit-learn computes
for them, the reference `prism eval`'s metrics are tested against (prism-decision/tests/eval_sklearn.rs).

    python3 -m venv /tmp/evalvenv && /tmp/evalvenv/bin/pip install scikit-learn
    /tmp/evalvenv/bin/python tools/make_eval_fixture.py > tests/fixtures/eval/sklearn_metrics.json

Each case holds the probabilities (one row per question, the options in order), the label index of each
row, and scikit-learn's `brier_score_loss` (its default `scale_by_half="auto"`: halved for two options),
`log_loss` (with `labels` = every option) and `calibration_curve` (strategy "uniform") of the top-label
confidence (the probability of the most likely option, the first on a tie) against "the most likely
option is the label", for several bin counts, with the bin counts (`np.bincount` of the same bin ids) and
the expected calibration error computed from them: sum over non-empty bins of count / n * |prob_true -
prob_pred|.
"""

import json
import sys

import numpy as np
import sklearn
from sklearn.calibration import calibration_curve
from sklearn.metrics import brier_score_loss, log_loss


def dirichlet_rows(rng, n, k, alpha):
    rows = rng.dirichlet([alpha] * k, size=n)
    return rows / rows.sum(axis=1, keepdims=True)


def case(name, probs, labels, bin_counts=(5, 10, 15)):
    probs = np.asarray(probs, dtype=np.float64)
    labels = np.asarray(labels, dtype=np.int64)
    n, k = probs.shape
    out = {
        "name": name,
        "options": int(k),
        "probabilities": probs.tolist(),
        "labels": labels.tolist(),
    }
    if k == 2:
        # Binary as sklearn takes it: the positive class is option 0 (a noul's "true").
        y = (labels == 0).astype(np.int64)
        out["brier"] = float(brier_score_loss(y, probs[:, 0]))
        out["log_loss"] = float(log_loss(y, probs[:, 0], labels=[0, 1]))
    else:
        out["brier"] = float(brier_score_loss(labels, probs, labels=list(range(k))))
        out["log_loss"] = float(log_loss(labels, probs, labels=list(range(k))))
    pred = probs.argmax(axis=1)  # first maximum on a tie, as the read-out
    if k == 2:
        pred = np.where(probs[:, 0] >= 0.5, 0, 1)  # a noul is true at p >= 0.5
    conf = probs[np.arange(n), pred]
    hit = (pred == labels).astype(np.float64)
    out["accuracy"] = float(hit.mean())
    curves = []
    for bins in bin_counts:
        prob_true, prob_pred = calibration_curve(hit, conf, n_bins=bins, strategy="uniform")
        edges = np.linspace(0.0, 1.0, bins + 1)
        ids = np.searchsorted(edges[1:-1], conf)
        total = np.bincount(ids, minlength=bins)
        counts = total[total != 0]
        ece = float(np.sum(counts / n * np.abs(prob_true - prob_pred)))
        curves.append(
            {
                "bins": bins,
                "prob_true": prob_true.tolist(),
                "prob_pred": prob_pred.tolist(),
                "counts": counts.tolist(),
                "ece": ece,
            }
        )
    out["calibration"] = curves
    return out


def main():
    rng = np.random.default_rng(20261223)
    cases = []
    # Binary (noul-like): probabilities from a Beta, labels drawn near-calibrated.
    p = rng.beta(0.7, 0.7, size=200)
    y = (rng.random(200) < p).astype(np.int64)
    cases.append(case("binary_200", np.stack([p, 1 - p], axis=1), 1 - y))
    # Edges: bin edges exactly, 0 and 1 (log loss clipping), ties at 0.5.
    edge = np.array([0.0, 1.0, 0.5, 0.5, 0.1, 0.2, 0.3, 0.7, 0.9, 0.6, 0.4, 1e-20, 1 - 1e-17, 0.8])
    ye = np.array([1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 0, 0, 1])
    cases.append(case("binary_edges", np.stack([edge, 1 - edge], axis=1), ye))
    # Multiclass (choice / score-like): 3, 4 and 7 options.
    for k, n, alpha in [(3, 150, 0.5), (4, 120, 1.0), (7, 90, 0.3)]:
        rows = dirichlet_rows(rng, n, k, alpha)
        labels = np.array([rng.choice(k, p=r) for r in rows])
        cases.append(case(f"multiclass_{k}_{n}", rows, labels))
    # A one-hot row and a uniform row.
    cases.append(
        case(
            "multiclass_extremes",
            [[1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1 / 3, 1 / 3, 1 / 3], [0.25, 0.5, 0.25], [0.5, 0.25, 0.25]],
            [0, 0, 2, 1, 2],
        )
    )
    json.dump({"sklearn": sklearn.__version__, "numpy": np.__version__, "cases": cases}, sys.stdout, indent=1)
    sys.stdout.write("\n")


main()
