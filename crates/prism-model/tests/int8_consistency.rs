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
