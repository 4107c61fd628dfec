//! `prism eval`'s metrics against scikit-learn's own output on fixed probability sets
//! (`tests/fixtures/eval/sklearn_metrics.json`, written by `tools/make_eval_fixture.py`): Brier score
//! (`brier_score_loss`), log loss (`log_loss`), the reliability bins (`calibration_curve`, uniform) and the
//! ECE computed from them, for 2, 3, 4 and 7 options, values on bin edges, 0 and 1, and ties.

use prism_decision::eval::metrics::{calibration, ece, Metrics, Scored};
use prism_decision::QuestionType;
use serde_json::Value;

fn close(what: &str, ours: f64, theirs: f64) {
    let tolerance = 1e-12 * theirs.abs().max(1.0);
    assert!(
        (ours - theirs).abs() <= tolerance,
        "{what}: ours {ours:e}, scikit-learn {theirs:e}"
    );
}

#[test]
fn metrics_equal_scikit_learn() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/fixtures/eval/sklearn_metrics.json"
    );
    let data: Value = serde_json::from_slice(&std::fs::read(path).expect("fixture")).expect("json");
    let cases = data["cases"].as_array().expect("cases");
    assert!(cases.len() >= 6);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let options = case["options"].as_u64().expect("options") as usize;
        // Two options stand for a noul (option 0 = true), more for a choice.
        let kind = if options == 2 {
            QuestionType::Noul
        } else {
            QuestionType::Choice
        };
        let scored: Vec<Scored> = case["probabilities"]
            .as_array()
            .expect("probabilities")
            .iter()
            .zip(case["labels"].as_array().expect("labels"))
            .map(|(row, label)| Scored {
                kind,
                probabilities: row
                    .as_array()
                    .expect("row")
                    .iter()
                    .map(|p| p.as_f64().expect("p"))
                    .collect(),
                label: label.as_u64().expect("label") as usize,
            })
            .collect();
        let refs: Vec<&Scored> = scored.iter().collect();
        for curve in case["calibration"].as_array().expect("calibration") {
            let bins = curve["bins"].as_u64().expect("bins") as usize;
            let metrics = Metrics::of(&refs, scored.len(), bins);
            for (key, ours) in [
                ("brier", metrics.brier),
                ("log_loss", metrics.log_loss),
                ("accuracy", metrics.accuracy),
            ] {
                close(
                    &format!("{name}: {key}"),
                    ours.expect(key),
                    case[key].as_f64().expect(key),
                );
            }
            let pairs: Vec<(f64, bool)> = scored
                .iter()
                .map(|s| (s.confidence(), s.correct()))
                .collect();
            let ours: Vec<_> = calibration(&pairs, bins)
                .into_iter()
                .filter(|b| b.count > 0)
                .collect();
            let list = |key: &str| -> Vec<f64> {
                curve[key]
                    .as_array()
                    .expect(key)
                    .iter()
                    .map(|v| v.as_f64().expect(key))
                    .collect()
            };
            let (prob_true, prob_pred, counts) =
                (list("prob_true"), list("prob_pred"), list("counts"));
            assert_eq!(
                ours.len(),
                prob_true.len(),
                "{name}, {bins} bins: non-empty bins"
            );
            for (i, bin) in ours.iter().enumerate() {
                assert_eq!(
                    bin.count as f64, counts[i],
                    "{name}, {bins} bins: count of bin {i}"
                );
                close(
                    &format!("{name}, {bins} bins: prob_true[{i}]"),
                    bin.accuracy.expect("acc"),
                    prob_true[i],
                );
                close(
                    &format!("{name}, {bins} bins: prob_pred[{i}]"),
                    bin.confidence.expect("conf"),
                    prob_pred[i],
                );
            }
            // The metrics' ECE and `ece()` over the same bins both equal scikit-learn's.
            for (what, ours) in [
                ("ece", metrics.ece),
                ("ece()", ece(&calibration(&pairs, bins))),
            ] {
                close(
                    &format!("{name}, {bins} bins: {what}"),
                    ours.expect("ece"),
                    curve["ece"].as_f64().expect("ece"),
                );
            }
        }
    }
}
