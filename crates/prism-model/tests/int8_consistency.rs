//! The integer path keeps the product's promise bit for bit (issue #5 acceptance): a request's logits
//! are identical alone, batched with 1–7 other requests of other lengths, split across a shared prefix,
//! and run in pieces — for int8 (tiny-Q8_0.gguf) and w4a8 (tiny-Q4_K_M.gguf).

mod common;
mod quantized;

use candle_core::Tensor;
use common::{bits, forward_in_pieces, prompts};
use prism_model::{BatchItem, Qwen35Model};
use quantized::{int8_model, letter_ids, w4a8_model};

fn models() -> [(&'static str, &'static Qwen35Model); 2] {
    [("int8", int8_model()), ("w4a8", w4a8_model())]
}

/// The target request: 90 tokens of prompt 3.
fn target() -> Vec<u32> {
    prompts()[3][..90].to_vec()
}

/// Seven other requests of other lengths (pieces of other prompts).
fn others() -> Vec<Vec<u32>> {
    [
        (0, 13),
        (1, 29),
        (2, 47),
        (4, 64),
        (5, 65),
        (6, 71),
        (8, 97),
    ]
    .iter()
    .map(|&(p, len)| prompts()[p][..len].to_vec())
    .collect()
}

/// Last-position full logits of each prompt run as one batch from fresh states.
fn batch_logits(model: &Qwen35Model, batch: &[&[u32]]) -> Tensor {
    let hidden = model.last_hidden(batch).unwrap();
    model.logits(&hidden).unwrap()
}

#[test]
fn a_request_reads_the_same_alone_and_batched_with_1_to_7_others() {
    for (name, model) in models() {
        let t = target();
        let alone = bits(&batch_logits(model, &[&t]));
        let others = others();
        for k in 1..=7 {
            // The target sits at a different place in each batch.
            let mut batch: Vec<&[u32]> = others[..k].iter().map(|p| p.as_slice()).collect();
            let at = k % (batch.len() + 1);
            batch.insert(at, &t);
            let logits = batch_logits(model, &batch);
            assert_eq!(
                bits(&logits.narrow(0, at, 1).unwrap()),
                alone,
                "{name}: batched with {k} others (at {at})"
            );
        }
        // The read-out rows equal those columns of the full logits.
        let letters = letter_ids();
        let rows = model.last_position_rows(&[&t], &letters).unwrap();
        let full = batch_logits(model, &[&t]).to_vec2::<f32>().unwrap();
        for (j, &id) in letters.iter().enumerate() {
            assert_eq!(
                rows[0][j].to_bits(),
                full[0][id as usize].to_bits(),
                "{name}: letter {j}"
            );
        }
    }
}

#[test]
fn a_shared_prefix_branch_reads_the_same_as_running_alone() {
    let letters = letter_ids();
    for (name, model) in models() {
        // Three requests sharing 150 tokens of prompt 3, each with its own tail (other lengths).
        let base = &prompts()[3];
        let tails: [&[u32]; 3] = [
            &prompts()[4][200..230],
            &prompts()[5][10..11],
            &prompts()[6][40..117],
        ];
        let requests: Vec<Vec<u32>> = tails.iter().map(|t| [&base[..150], t].concat()).collect();
        let refs: Vec<&[u32]> = requests.iter().map(|r| r.as_slice()).collect();
        let shared = model.last_position_rows(&refs, &letters).unwrap();
        for (i, r) in refs.iter().enumerate() {
            let alone = model.last_position_rows(&[r], &letters).unwrap();
            let to_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                to_bits(&shared[i]),
                to_bits(&alone[0]),
                "{name}: request {i}"
            );
        }
    }
}

#[test]
fn a_request_run_in_pieces_reads_the_same_as_in_one_call() {
    for (name, model) in models() {
        let p = &prompts()[3][..260];
        let mut state = model.new_state().unwrap();
        let one_shot = model
            .forward(&mut [BatchItem::new(&mut state, p)])
            .unwrap()
            .hidden;
        let (pieces, _) = forward_in_pieces(model, p, &[1, 7, 63, 64, 65, 1, 2, 57]);
        assert_eq!(
            bits(&pieces),
            bits(&one_shot),
            "{name}: every position's hidden state"
        );
        assert_eq!(
            bits(&model.logits(&pieces.narrow(0, 259, 1).unwrap()).unwrap()),
            bits(&model.logits(&one_shot.narrow(0, 259, 1).unwrap()).unwrap()),
            "{name}: last logits"
        );
    }
}

/// Every tensor a continuation reads from `state`, as bits: per DeltaNet layer its conv window, its
/// memory and its first `pending` pending rows (rows past them belong to whoever claimed them); per
/// attention layer its keys, values and scales; then the token count and next position.
fn state_bits(state: &prism_model::SequenceState) -> Vec<(String, candle_core::DType, Vec<u64>)> {
    use prism_model::state::LayerState;
    let mut out = Vec::new();
    let mut push = |what: String, t: &Tensor| {
        let (dtype, b) = bits(t);
        out.push((what, dtype, b));
    };
    for (l, layer) in state.layers().iter().enumerate() {
        match layer {
            LayerState::DeltaNet(d) => {
                let r = &d.rule;
                push(format!("layer {l} conv"), &d.conv);
                push(format!("layer {l} memory"), &r.chunk_start);
                push(
                    format!("layer {l} pending k ({})", r.pending),
                    &r.pending_k.narrow(1, 0, r.pending).unwrap(),
                );
                push(
                    format!("layer {l} pending u"),
                    &r.pending_u.narrow(1, 0, r.pending).unwrap(),
                );
                push(
                    format!("layer {l} pending Γ"),
                    &r.pending_gamma.narrow(1, 0, r.pending).unwrap(),
                );
            }
            LayerState::Attention(kv) => {
                for (name, t) in [
                    ("k", &kv.k),
                    ("v", &kv.v),
                    ("k scale", &kv.k_scale),
                    ("v scale", &kv.v_scale),
                ] {
                    if let Some(t) = t {
                        push(format!("layer {l} {name} ({} rows)", kv.len()), t);
                    }
                }
            }
        }
    }
    let counts = Tensor::new(
        &[state.n_tokens() as f64, f64::from(state.next_position())],
        &candle_core::Device::Cpu,
    )
    .unwrap();
    push("tokens and next position".into(), &counts);
    out
}

/// A snapshot inside an item (the engine's evidence state from one pass over evidence and question)
/// is bit for bit the state that the evidence computed alone leaves — inside the conv window's reach,
/// on a chunk boundary and inside a chunk, from a fresh state and from one 37 tokens in, batched with
/// another item before it and with a branch after it — and continuing it reads the same logits; the
/// item's own rows and end state are those of a call without the snapshot.
#[test]
fn a_snapshot_inside_an_item_is_the_state_its_prefix_leaves_alone() {
    let letters = letter_ids();
    for (name, model) in models() {
        let p3 = &prompts()[3];
        let other = &prompts()[5][..41];
        let question = &prompts()[6][40..57];
        for (past, tokens, point) in [
            (0, 150, 2),
            (0, 150, 64),
            (0, 150, 101),
            (37, 120, 27),
            (37, 120, 90),
        ] {
            let what = format!("{name}: {past} tokens in, a snapshot after {point} of {tokens}");
            let start = |model: &Qwen35Model| {
                let mut state = model.new_state().unwrap();
                if past > 0 {
                    model
                        .forward(&mut [BatchItem::new(&mut state, &p3[..past])])
                        .unwrap();
                }
                state
            };
            let seq = &p3[past..past + tokens];
            // The reference: the prefix alone, then the rest from its state.
            let mut alone = start(model);
            let first = model
                .forward(&mut [BatchItem::new(&mut alone, &seq[..point])])
                .unwrap()
                .hidden;
            let evidence = alone.clone();
            let second = model
                .forward(&mut [BatchItem::new(&mut alone, &seq[point..])])
                .unwrap()
                .hidden;
            let whole_rows = Tensor::cat(&[&first, &second], 0).unwrap();

            // One call: another item first, the item with its snapshot, a branch continuing it.
            let (mut s_other, mut s_item, mut s_branch) = (
                model.new_state().unwrap(),
                start(model),
                model.new_state().unwrap(),
            );
            let mut item = BatchItem::new(&mut s_item, seq);
            item.snapshot = Some(point);
            let mut branch = BatchItem::new(&mut s_branch, question);
            branch.parent = Some(1);
            let out = model
                .forward(&mut [BatchItem::new(&mut s_other, other), item, branch])
                .unwrap();
            let seg = out.segments[1];
            assert_eq!(
                bits(&out.hidden.narrow(0, seg.start, seg.len).unwrap()),
                bits(&whole_rows),
                "{what}: the item's rows"
            );
            assert!(out.snapshots[0].is_none() && out.snapshots[2].is_none());
            let snapshot = out.snapshots[1].clone().expect("the item's snapshot");
            for (got, want) in state_bits(&snapshot).iter().zip(state_bits(&evidence)) {
                assert_eq!(got.0, want.0, "{what}");
                assert!(got == &want, "{what}: {} differs", got.0);
            }
            assert_eq!(state_bits(&snapshot).len(), state_bits(&evidence).len());
            assert!(
                state_bits(&s_item) == state_bits(&alone),
                "{what}: the item's end state"
            );
            // The branch continued the item's end, not its snapshot.
            let mut after = alone.clone();
            let want_branch = model
                .forward(&mut [BatchItem::new(&mut after, question)])
                .unwrap()
                .hidden;
            let b = out.segments[2];
            assert_eq!(
                bits(&out.hidden.narrow(0, b.start, b.len).unwrap()),
                bits(&want_branch),
                "{what}: the branch after the item"
            );
            // A follow-up from the snapshot reads what one from the evidence alone reads.
            let read = |mut state: prism_model::SequenceState| {
                let hidden = model
                    .forward(&mut [BatchItem::new(&mut state, question)])
                    .unwrap()
                    .hidden;
                let last = hidden.narrow(0, question.len() - 1, 1).unwrap();
                bits(&model.logits_for_rows(&last, &letters).unwrap())
            };
            assert_eq!(read(snapshot), read(evidence), "{what}: a follow-up");
        }
    }
}

#[test]
fn a_snapshot_must_fall_inside_an_item_without_a_parent() {
    let model = int8_model();
    let p = &prompts()[3][..20];
    for point in [0, 20, 21] {
        let mut state = model.new_state().unwrap();
        let mut item = BatchItem::new(&mut state, p);
        item.snapshot = Some(point);
        let err = model.forward(&mut [item]).unwrap_err().to_string();
        assert!(err.contains("snapshot"), "{point}: {err}");
    }
    let (mut a, mut b) = (model.new_state().unwrap(), model.new_state().unwrap());
    let mut branch = BatchItem::new(&mut b, &p[..5]);
    branch.parent = Some(0);
    branch.snapshot = Some(2);
    let err = model
        .forward(&mut [BatchItem::new(&mut a, p), branch])
        .unwrap_err()
        .to_string();
    assert!(err.contains("of a branch"), "{err}");
}
