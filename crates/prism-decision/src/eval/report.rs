//! `prism eval`'s output files: `results.json`, `report.md` and `reliability.png`.
//!
//! The reliability diagram is drawn without text (no font is needed on any machine; the numbers are in
//! `report.md`): a 640 × 480 PNG on white. The plot area is x 40..600, y 20..400 (confidence 0..1 left to
//! right, accuracy 0..1 bottom to top), framed in gray with light grid lines every 0.1 and the gray
//! diagonal of perfect calibration. Each non-empty bin has a blue bar (`BAR`) from the bottom to its
//! accuracy, inset one pixel on each side, and a red tick (`CONFIDENCE`) at its mean confidence over the
//! right third of the bar. Below, in y 420..460, an orange bar (`COUNT`) per bin, its height the bin's
//! share of the largest bin's count. The tests decode the PNG and check those pixels.

use std::fmt::Write as _;
use std::path::Path;

use super::{Bin, EvalResults, ItemStatus, Metrics};
use anyhow::{Context, Result};
use plotters::prelude::*;

pub const WIDTH: u32 = 640;
pub const HEIGHT: u32 = 480;
pub const PLOT: (i32, i32, i32, i32) = (40, 20, 600, 400);
pub const STRIP: (i32, i32) = (420, 460);
pub const BAR: RGBColor = RGBColor(31, 119, 180);
pub const CONFIDENCE: RGBColor = RGBColor(214, 39, 40);
pub const COUNT: RGBColor = RGBColor(255, 127, 14);
const FRAME: RGBColor = RGBColor(128, 128, 128);
const GRID: RGBColor = RGBColor(232, 232, 232);
const DIAGONAL: RGBColor = RGBColor(170, 170, 170);

pub fn write_all(out: &Path, results: &EvalResults) -> Result<()> {
    let json = serde_json::to_vec_pretty(results).context("serializing results.json")?;
    let path = out.join("results.json");
    std::fs::write(&path, [json.as_slice(), b"\n"].concat())
        .with_context(|| format!("writing {}", path.display()))?;
    let path = out.join("report.md");
    std::fs::write(&path, report(results))
        .with_context(|| format!("writing {}", path.display()))?;
    let path = out.join("reliability.png");
    reliability_png(&path, &results.summary.reliability)
        .with_context(|| format!("drawing {}", path.display()))?;
    Ok(())
}

/// Draws the reliability diagram of `bins` (geometry in the module's doc).
pub fn reliability_png(path: &Path, bins: &[Bin]) -> Result<()> {
    let root = BitMapBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    let draw = |r: Result<(), DrawingAreaErrorKind<_>>| r.map_err(|e| anyhow::anyhow!("{e:?}"));
    draw(root.fill(&WHITE))?;
    let (left, top, right, bottom) = PLOT;
    let (w, h) = ((right - left) as f64, (bottom - top) as f64);
    let x = |v: f64| left + (v * w).round() as i32;
    let y = |v: f64| bottom - (v * h).round() as i32;
    for i in 1..10 {
        let v = i as f64 / 10.0;
        draw(root.draw(&PathElement::new(vec![(x(v), top), (x(v), bottom)], GRID)))?;
        draw(root.draw(&PathElement::new(vec![(left, y(v)), (right, y(v))], GRID)))?;
    }
    draw(root.draw(&PathElement::new(
        vec![(x(0.0), y(0.0)), (x(1.0), y(1.0))],
        DIAGONAL.stroke_width(2),
    )))?;
    let n = bins.len().max(1) as f64;
    let most = bins.iter().map(|b| b.count).max().unwrap_or(0).max(1) as f64;
    for (i, bin) in bins.iter().enumerate() {
        let (x0, x1) = (x(i as f64 / n) + 1, x((i + 1) as f64 / n) - 1);
        if bin.count == 0 || x1 <= x0 {
            continue;
        }
        if let Some(accuracy) = bin.accuracy {
            if y(accuracy) < bottom {
                draw(root.draw(&Rectangle::new(
                    [(x0, y(accuracy)), (x1, bottom)],
                    BAR.filled(),
                )))?;
            }
        }
        if let Some(confidence) = bin.confidence {
            let tick = x1 - (x1 - x0) / 3;
            let c = y(confidence).clamp(top + 1, bottom - 1);
            draw(root.draw(&Rectangle::new(
                [(tick, c - 1), (x1, c + 1)],
                CONFIDENCE.filled(),
            )))?;
        }
        let (strip_top, strip_bottom) = STRIP;
        let height = ((bin.count as f64 / most) * (strip_bottom - strip_top) as f64).round() as i32;
        if height > 0 {
            draw(root.draw(&Rectangle::new(
                [(x0, strip_bottom - height), (x1, strip_bottom)],
                COUNT.filled(),
            )))?;
        }
    }
    draw(root.draw(&Rectangle::new([(left, top), (right, bottom)], FRAME)))?;
    let (strip_top, strip_bottom) = STRIP;
    draw(root.draw(&PathElement::new(
        vec![(left, strip_bottom), (right, strip_bottom)],
        FRAME,
    )))?;
    let _ = strip_top;
    root.present().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    Ok(())
}

fn f(value: Option<f64>) -> String {
    value.map_or_else(|| "–".to_string(), |v| format!("{v:.4}"))
}

fn metrics_row(name: &str, m: &Metrics) -> String {
    format!(
        "| {name} | {} | {} | {} | {} | {} | {} | {} |\n",
        m.items,
        m.questions,
        f(m.accuracy),
        f(m.ece),
        f(m.brier),
        f(m.log_loss),
        f(m.score_mae)
    )
}

fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// `report.md`.
pub fn report(results: &EvalResults) -> String {
    let s = &results.summary;
    let mut md = String::new();
    let _ = writeln!(md, "# prism eval: {}\n", results.suite);
    if !s.complete {
        let _ = writeln!(
            md,
            "**PARTIAL REPORT: the run was interrupted. {} of {} items were run; {} were not, and the numbers \
             below are over the items that were.**\n",
            results.items.len(),
            s.suite_items,
            s.not_run
        );
    }
    let run = &results.run;
    let field = |k: &str| -> String {
        match &run[k] {
            serde_json::Value::Null => "–".to_string(),
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    };
    let _ = writeln!(
        md,
        "Model **{}**, {} ({}), precision {}, {} requests in flight; {:.1} s, {:.2} items/s.\n",
        field("model"),
        field("mode"),
        if run["mode"] == "http" {
            field("url")
        } else {
            field("device")
        },
        field("precision"),
        field("concurrency"),
        run["seconds"].as_f64().unwrap_or(0.0),
        run["items_per_second"].as_f64().unwrap_or(0.0),
    );
    if run["demo"] == true {
        let _ = writeln!(
            md,
            "> The bundled demo model has random weights: its answers are meaningless. The pipeline is real.\n"
        );
    }
    let _ = writeln!(
        md,
        "{} items in the suite: {} answered, {} refused, {} failed, {} not run. {} labelled questions \
         ({} unlabelled ones answered but not scored).\n",
        s.suite_items, s.items, s.refused, s.failed, s.not_run, s.questions, s.unlabelled_questions
    );
    let _ = writeln!(md, "## Metrics\n");
    let _ = writeln!(
        md,
        "A decision is correct when the most likely option is the label (a noul: P(true) ≥ 0.5 for true). \
         ECE over {} equal-width bins of the decision's probability; Brier score as scikit-learn's \
         `brier_score_loss` (halved for two options); log loss clipped at machine epsilon; score MAE: \
         |expected level − label| over score questions.\n",
        s.bins
    );
    md.push_str("| set | items | questions | accuracy | ECE | Brier | log loss | score MAE |\n");
    md.push_str("|---|---|---|---|---|---|---|---|\n");
    let overall = Metrics {
        items: s.items,
        questions: s.questions,
        correct: s.correct,
        accuracy: s.accuracy,
        ece: s.ece,
        brier: s.brier,
        log_loss: s.log_loss,
        score_mae: s.score_mae,
    };
    md.push_str(&metrics_row("**all**", &overall));
    for (kind, m) in &s.by_type {
        md.push_str(&metrics_row(&format!("type `{kind}`"), m));
    }
    for (tag, m) in &s.by_tag {
        md.push_str(&metrics_row(&format!("tag `{}`", cell(tag)), m));
    }
    let _ = writeln!(md, "\n## Reliability\n");
    let _ = writeln!(
        md,
        "![reliability diagram](reliability.png)\n\nBlue bars: each bin's accuracy; red ticks: its mean \
         confidence; gray diagonal: perfect calibration; orange strip: questions per bin.\n"
    );
    md.push_str("| bin | questions | mean confidence | accuracy |\n|---|---|---|---|\n");
    for b in &s.reliability {
        let _ = writeln!(
            md,
            "| {:.2}–{:.2} | {} | {} | {} |",
            b.lo,
            b.hi,
            b.count,
            f(b.confidence),
            f(b.accuracy)
        );
    }
    if let Some(c) = &results.compare {
        let _ = writeln!(md, "\n## Against {}\n", c.other);
        let _ = writeln!(
            md,
            "{} questions answered in both: {} decisions agree ({}); |Δp| over every option (a noul's \
             P(true)): mean {}, max {}{}. {} here only, {} there only, {} with different options.\n",
            c.questions,
            c.agreeing,
            f(c.agreement),
            f(c.mean_abs_dp),
            f(c.max_abs_dp),
            c.max_abs_dp_at
                .as_ref()
                .map_or(String::new(), |(id, q, o)| format!(" (item `{}`, `{}`, option `{}`)", cell(id), cell(q), cell(o))),
            c.only_here,
            c.only_other,
            c.mismatched
        );
        if c.flipped.is_empty() {
            md.push_str("No decision flipped.\n");
        } else {
            md.push_str("| item | question | here | there | label |\n|---|---|---|---|---|\n");
            for flip in c.flipped.iter().take(200) {
                let _ = writeln!(
                    md,
                    "| {} | {} | {} ({:.4}) | {} ({:.4}) | {} |",
                    cell(&flip.id),
                    cell(&flip.question),
                    cell(&flip.decision),
                    flip.p,
                    cell(&flip.other_decision),
                    flip.other_p,
                    flip.label.as_deref().map_or("–".to_string(), cell)
                );
            }
            if c.flipped.len() > 200 {
                let _ = writeln!(md, "\n({} more in results.json)", c.flipped.len() - 200);
            }
        }
    }
    let unanswered: Vec<_> = results
        .items
        .iter()
        .filter(|i| i.status != ItemStatus::Answered)
        .collect();
    if !unanswered.is_empty() {
        let _ = writeln!(md, "\n## Refused or failed\n");
        md.push_str("| item | line | status | error |\n|---|---|---|---|\n");
        for item in unanswered {
            let _ = writeln!(
                md,
                "| {} | {} | {:?} | {} |",
                cell(&item.id),
                item.line,
                item.status,
                cell(item.error.as_deref().unwrap_or(""))
            );
        }
    }
    if !results.skipped_lines.is_empty() {
        let _ = writeln!(md, "\n## Bad lines passed over (--skip-bad)\n");
        for line in &results.skipped_lines {
            let _ = writeln!(md, "- {}", cell(line));
        }
    }
    md
}
