//! Batched, branched (shared prefix), chunked (prompt in pieces) and token-by-token runs must equal the
//! one-by-one one-shot runs **bit for bit**, compared on final-normed hidden states, on the full logits
//! they produce and on the sequence states left behind.
//!
//! Bit-identity is what the design promises, not a tolerance that happens to hold: on the CPU every
//! matmul output, every attention row and every delta-rule token is computed by a fixed sequence of
//! operations that depends only on that row's own inputs (`matmul`, `attention::CausalAttention`,
//! `delta_rule::chunked`, whose state carries the 64-token chunk in progress). So nothing may differ,
//! not even in the last bit, whatever the batch, the branch point or the split into calls.
//!
//! Every scenario runs in f32 (the reference path) and in f64 (`tiny-BF16.gguf` computed in f64, whose
//! ~1e-16 rounding would have exposed any logic error even before the arithmetic was made
//! order-invariant); the mixed batch also runs on the bf16 path.

mod common;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::Tensor;
use common::*;
use prism_model::state::LayerState;
use prism_model::{BatchItem, Precision, Qwen35Model, SequenceState};

fn models() -> [&'static Qwen35Model; 2] {
    [f64_model(), bf16_model()]
}

/// tiny-BF16.gguf on the bf16 path (bf16 matrices and matmul inputs, f32 accumulation).
fn bf16_precision_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load_with("tiny-BF16.gguf", Precision::Bf16))
}

/// One-shot prefill of prompt `i` alone: the hidden states at every position, `[len, d]`, and the final
/// state (cached).
fn one_shot(model: &Qwen35Model, i: usize) -> (Tensor, SequenceState) {
    type Cache = HashMap<(String, usize), (Tensor, SequenceState)>;
    static CACHE: Mutex<Option<Cache>> = Mutex::new(None);
    let key = (format!("{:?}", model.precision()), i);
    if let Some(hit) = CACHE
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return hit.clone();
    }
    let mut state = model.new_state().unwrap();
    let hidden = model
        .forward(&mut [BatchItem::new(&mut state, &prompts()[i])])
        .unwrap()
        .hidden;
    CACHE
        .lock()
        .unwrap()
        .get_or_insert_with(HashMap::new)
        .insert(key, (hidden.clone(), state.clone()));
    (hidden, state)
}

fn one_shot_hidden(model: &Qwen35Model, i: usize) -> Tensor {
    one_shot(model, i).0
}

fn last_row(t: &Tensor) -> Tensor {
    let n = t.dim(0).unwrap();
    t.narrow(0, n - 1, 1).unwrap()
}

/// Asserts that `got` and `want` (hidden states, `[rows, d]`) are bitwise equal, and so are the full
/// logits computed from each (the LM head runs on batches of different sizes here).
fn assert_identical(model: &Qwen35Model, what: &str, got: &Tensor, want: &Tensor) {
    let precision = format!("{:?}", model.precision());
    let (lg, lw) = (model.logits(got).unwrap(), model.logits(want).unwrap());
    let dh = max_abs_diff_tensors(got, want);
    let dl = max_abs_diff_tensors(&lg, &lw);
    eprintln!("[{precision}] {what}: hidden max |Δ| {dh:.3e}, logits max |Δ| {dl:.3e}");
    assert_eq!(got.dims(), want.dims(), "[{precision}] {what}: shapes");
    assert!(
        bits(got) == bits(want),
        "[{precision}] {what}: hidden states differ (max |Δ| {dh:e})"
    );
    assert!(
        bits(&lg) == bits(&lw),
        "[{precision}] {what}: logits differ (max |Δ| {dl:e})"
    );
}

/// Every tensor of two sequence states is bitwise equal (K/V caches, conv windows, delta-rule memory at
/// the chunk start and the rows of the chunk in progress), and so are the counters.
fn assert_states_identical(what: &str, a: &SequenceState, b: &SequenceState) {
    assert_eq!(a.n_tokens(), b.n_tokens(), "{what}: token counts");
    assert_eq!(a.next_position(), b.next_position(), "{what}: positions");
    for (l, (x, y)) in a.layers().iter().zip(b.layers()).enumerate() {
        let pairs: Vec<(&Tensor, &Tensor)> = match (x, y) {
            (LayerState::DeltaNet(x), LayerState::DeltaNet(y)) => {
                assert_eq!(x.rule.pending, y.rule.pending, "{what}: layer {l} pending");
                vec![
                    (&x.conv, &y.conv),
                    (&x.rule.chunk_start, &y.rule.chunk_start),
                    (&x.rule.pending_k, &y.rule.pending_k),
                    (&x.rule.pending_u, &y.rule.pending_u),
                    (&x.rule.pending_gamma, &y.rule.pending_gamma),
                ]
            }
            (LayerState::Attention(x), LayerState::Attention(y)) => {
                match (&x.k, &y.k, &x.v, &y.v) {
                    (Some(xk), Some(yk), Some(xv), Some(yv)) => vec![(xk, yk), (xv, yv)],
                    _ => panic!("{what}: layer {l} has an empty cache"),
                }
            }
            _ => panic!("{what}: layer {l} kinds differ"),
        };
        for (p, q) in pairs {
            assert!(bits(p) == bits(q), "{what}: layer {l} state differs");
        }
    }
}

#[test]
fn f32_rounding_floor() {
    // The f32 one-shot against the f64 truth, and transformers' fp32 logits against the same truth: the
    // size of rounding differences on this model (bit-identity above is not a matter of tolerance).
    let reference = read_json("ref_transformers.json");
    let (mut ours, mut theirs) = (0f64, 0f64);
    for i in [0, 1, 11] {
        let l64 = f64_model()
            .logits(&last_row(&one_shot_hidden(f64_model(), i)))
            .unwrap();
        let l32 = bf16_model()
            .logits(&last_row(&one_shot_hidden(bf16_model(), i)))
            .unwrap();
        ours = ours.max(max_abs_diff_tensors(&l32, &l64));
        let hf = floats(&reference["prompts"][i]["logits"]);
        let hf = Tensor::from_vec(hf, (1, l64.dim(1).unwrap()), l64.device()).unwrap();
        theirs = theirs.max(max_abs_diff_tensors(&hf, &l64));
    }
    eprintln!(
        "last-position logits vs f64 truth: ours (f32) {ours:.3e}, transformers fp32 {theirs:.3e}"
    );
    assert!(
        ours < 1e-4 && theirs < 1e-3,
        "ours {ours}, transformers {theirs}"
    );
}

#[test]
fn mixed_length_batch_equals_one_by_one() {
    // f32: all 12 prompts; f64 and bf16: four of different lengths.
    let all: Vec<usize> = (0..prompts().len()).collect();
    let runs = [
        (f64_model(), vec![1, 0, 2, 11]),
        (bf16_model(), all),
        (bf16_precision_model(), vec![1, 0, 2, 11]),
    ];
    for (model, members) in runs {
        let refs: Vec<&[u32]> = members.iter().map(|&i| prompts()[i].as_slice()).collect();
        let batched = model.last_hidden(&refs).unwrap();
        let mut alone = Vec::new();
        for &i in &members {
            let mut state = model.new_state().unwrap();
            alone.push(model.prefill(&mut state, &prompts()[i]).unwrap());
        }
        let alone = Tensor::cat(&alone, 0).unwrap();
        let what = format!("{} prompts batched vs one by one", members.len());
        assert_identical(model, &what, &batched, &alone);
    }
}

#[test]
fn batch_of_sequences_at_different_stages_equals_one_by_one() {
    // Sequence 0 continues prompt 0 after 50 tokens, 1 decodes the last token of prompt 2, 2 starts
    // prompt 1 from scratch, 3 continues prompt 3 after 64 tokens: all in one batch.
    let p = prompts();
    let starts = [(0usize, 50usize), (2, p[2].len() - 1), (1, 0), (3, 64)];
    for model in models() {
        let mut states: Vec<SequenceState> = starts
            .iter()
            .map(|&(i, k)| {
                let mut s = model.new_state().unwrap();
                if k > 0 {
                    model.prefill(&mut s, &p[i][..k]).unwrap();
                }
                s
            })
            .collect();
        let mut items: Vec<BatchItem<'_>> = states
            .iter_mut()
            .zip(&starts)
            .map(|(s, &(i, k))| BatchItem::new(s, &p[i][k..]))
            .collect();
        let out = model.forward(&mut items).unwrap();
        for (j, &(i, k)) in starts.iter().enumerate() {
            let want = one_shot_hidden(model, i)
                .narrow(0, k, p[i].len() - k)
                .unwrap();
            let what = format!("prompt {i} from token {k} in a mixed batch vs one shot");
            assert_identical(model, &what, &out.sequence_hidden(j).unwrap(), &want);
            assert_states_identical(&what, &states[j], &one_shot(model, i).1);
        }
    }
}

#[test]
fn shared_prefix_batches_equal_one_by_one() {
    let fixture = read_json("prompts.json");
    for batch in fixture["batches"].as_array().unwrap() {
        let members: Vec<usize> = ids(&batch["prompts"]).iter().map(|&i| i as usize).collect();
        let common = batch["common_prefix_tokens"].as_u64().unwrap() as usize;
        let prompts: Vec<&[u32]> = members.iter().map(|&i| prompts()[i].as_slice()).collect();
        for p in &prompts {
            assert_eq!(&p[..common], &prompts[0][..common]);
        }
        // The read-out shares the whole common prefix (every prompt is longer than it).
        assert_eq!(prism_model::shared_prefix_len(&prompts), common);
        assert!(
            common % 64 != 0,
            "the fixture's branch points are not chunk aligned"
        );
        for model in models() {
            // f64 (slower) on batch B only.
            if model.precision() == Precision::F64 && batch["name"] != "B" {
                continue;
            }
            let want: Vec<Tensor> = members
                .iter()
                .map(|&i| last_row(&one_shot_hidden(model, i)))
                .collect();
            let want = Tensor::cat(&want, 0).unwrap();
            // The read-out path (exact common prefix), and a branch at the 64-aligned point below it.
            let read_out = model.last_hidden_shared_prefix(&prompts).unwrap();
            let aligned = common / 64 * 64;
            let suffixes: Vec<&[u32]> = prompts.iter().map(|p| &p[aligned..]).collect();
            let at_aligned = model
                .forward_branched(&prompts[0][..aligned], &suffixes)
                .unwrap();
            for (what, got) in [
                (format!("exact prefix {common}"), &read_out),
                (format!("aligned prefix {aligned}"), &at_aligned),
            ] {
                let name = format!("batch {} ({what}) vs one by one", batch["name"]);
                assert_identical(model, &name, got, &want);
            }
        }
    }
}

#[test]
fn any_branch_point_equals_one_by_one() {
    // Prompt 3 (376 tokens) branched at points on and off the chunk boundaries, two siblings each
    // (f64, slower, at two of them).
    let p = &prompts()[3];
    let points: [&[usize]; 2] = [&[65, 200], &[1, 63, 64, 65, 127, 200, 375]];
    for (model, points) in models().into_iter().zip(points) {
        let want = last_row(&one_shot_hidden(model, 3));
        for &at in points {
            let got = model
                .forward_branched(&p[..at], &[&p[at..], &p[at..]])
                .unwrap();
            let what = format!("prompt 3 branched after {at} tokens");
            assert_identical(model, &what, &got.narrow(0, 0, 1).unwrap(), &want);
            assert_identical(model, &what, &got.narrow(0, 1, 1).unwrap(), &want);
        }
    }
}

#[test]
fn last_position_rows_are_the_full_logits_at_those_rows() {
    let model = bf16_model();
    let members: Vec<&[u32]> = [4usize, 5, 6, 7]
        .iter()
        .map(|&i| prompts()[i].as_slice())
        .collect();
    let rows = [3u32, 0, 4128, 3673];
    let got = model.last_position_rows(&members, &rows).unwrap();
    let full = to_vec2(
        &model
            .logits(&model.last_hidden_shared_prefix(&members).unwrap())
            .unwrap(),
    );
    for (g, f) in got.iter().zip(&full) {
        let want: Vec<u32> = rows.iter().map(|&r| f[r as usize].to_bits()).collect();
        let g: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
        assert_eq!(g, want);
    }
}

#[test]
fn branching_with_an_empty_suffix_returns_the_prefix_state() {
    let p = &prompts()[1];
    for model in models() {
        let got = model.forward_branched(&p[..20], &[&p[20..], &[]]).unwrap();
        let want = one_shot_hidden(model, 1);
        assert_identical(
            model,
            "branch with empty suffix",
            &got.narrow(0, 1, 1).unwrap(),
            &want.narrow(0, 19, 1).unwrap(),
        );
        assert_identical(
            model,
            "branch with full suffix",
            &got.narrow(0, 0, 1).unwrap(),
            &last_row(&want),
        );
    }
}

#[test]
fn prompt_in_pieces_equals_one_shot() {
    // Prompt 3 (376 tokens) in pieces that start and end on and off the 64-token chunk boundaries.
    let p = &prompts()[3];
    let mut sizes = vec![1usize, 7, 63, 64, 65, 1, 2, 100];
    sizes.push(p.len() - sizes.iter().sum::<usize>());
    for model in models() {
        let (pieces, mut state) = forward_in_pieces(model, p, &sizes);
        assert_identical(
            model,
            "prompt 3 in 9 pieces vs one shot (all positions)",
            &pieces,
            &one_shot_hidden(model, 3),
        );
        let (_, mut fresh) = one_shot(model, 3);
        assert_states_identical("state after pieces vs after one shot", &state, &fresh);
        // The states must continue identically too.
        let next = [p[5]];
        let a = model.prefill(&mut state, &next).unwrap();
        let b = model.prefill(&mut fresh, &next).unwrap();
        assert_identical(
            model,
            "one more token after pieces vs after one shot",
            &a,
            &b,
        );
    }
}

#[test]
fn token_by_token_decode_equals_one_shot_prefill() {
    // Prompt 0 (119 tokens) one token at a time: the decode path is the prefill path, row by row.
    let p = &prompts()[0];
    for model in models() {
        let mut state = model.new_state().unwrap();
        let rows: Vec<Tensor> = p
            .iter()
            .map(|&t| model.prefill(&mut state, &[t]).unwrap())
            .collect();
        let stepped = Tensor::cat(&rows, 0).unwrap();
        assert_identical(
            model,
            "prompt 0 token by token vs one shot (all positions)",
            &stepped,
            &one_shot_hidden(model, 0),
        );
        assert_states_identical(
            "state after token-by-token vs after one shot",
            &state,
            &one_shot(model, 0).1,
        );
    }
}

#[test]
fn branches_do_not_see_each_other() {
    // Two continuations of one cloned state: the first one's tokens must not leak into the second.
    let p = &prompts()[1];
    for model in models() {
        let mut base = model.new_state().unwrap();
        model.prefill(&mut base, &p[..30]).unwrap();
        let mut a = base.clone();
        let mut b = base.clone();
        model.prefill(&mut a, &[11, 12, 13]).unwrap();
        let hb = model.prefill(&mut b, &p[30..]).unwrap();
        assert_eq!(base.n_tokens(), 30);
        assert_eq!(a.n_tokens(), 33);
        assert_identical(
            model,
            "continuation after a sibling branch ran",
            &hb,
            &last_row(&one_shot_hidden(model, 1)),
        );
        assert_states_identical("sibling branch", &b, &one_shot(model, 1).1);
    }
}

/// The attention layers' K/V rooms of a state (native storage).
fn rooms(state: &SequenceState) -> Vec<std::sync::Arc<prism_model::state::KvRoom>> {
    state
        .layers()
        .iter()
        .filter_map(|l| match l {
            LayerState::Attention(kv) => Some(kv.room.clone().expect("a native cache has a room")),
            _ => None,
        })
        .collect()
}

// Starts as `branches_do_not_see_each_other` does (branches of a 30-token state of prompt 1, checked
// against one shot): kept inline, as each test spells out the branches it makes and what it checks.
#[test]
fn kv_rooms_grow_in_place_and_branches_copy_their_prefix() {
    // The first continuation of a state writes its keys and values into the state's room (no copy);
    // a second continuation of the same state, and the state itself continued afterwards, find those
    // positions claimed and copy their prefix into rooms of their own. Every one of them equals the
    // same tokens computed in one call.
    let p = &prompts()[1];
    for model in models() {
        let mut base = model.new_state().unwrap();
        model.prefill(&mut base, &p[..30]).unwrap();
        let (mut a, mut b, mut c) = (base.clone(), base.clone(), base.clone());
        model.prefill(&mut a, &p[30..]).unwrap();
        let shared = rooms(&base);
        assert!(!shared.is_empty());
        for (x, y) in rooms(&a).iter().zip(&shared) {
            assert!(
                std::sync::Arc::ptr_eq(x, y),
                "the first branch grows in place"
            );
            assert!(y.rows() >= p.len(), "the room has room: {} rows", y.rows());
        }
        let hb = model.prefill(&mut b, &p[30..]).unwrap();
        for (x, y) in rooms(&b).iter().zip(&shared) {
            assert!(!std::sync::Arc::ptr_eq(x, y), "a second branch copies");
        }
        assert_identical(
            model,
            "second branch",
            &hb,
            &last_row(&one_shot_hidden(model, 1)),
        );
        assert_states_identical("first branch", &a, &one_shot(model, 1).1);
        assert_states_identical("second branch", &b, &one_shot(model, 1).1);
        // The base continued after both: copies too, and sees none of their rows.
        let hc = model.prefill(&mut c, &p[30..]).unwrap();
        assert_identical(
            model,
            "the base continued",
            &hc,
            &last_row(&one_shot_hidden(model, 1)),
        );
        // Token by token from the second branch: steps after the first grow its own room in place.
        let before = rooms(&b);
        let mut d = b.clone();
        drop(b);
        for &t in &[7u32, 8, 9] {
            model.prefill(&mut d, &[t]).unwrap();
        }
        for (x, y) in rooms(&d).iter().zip(&before) {
            assert!(std::sync::Arc::ptr_eq(x, y), "decode steps grow in place");
        }
        let mut whole = model.new_state().unwrap();
        let mut tokens = p.clone();
        tokens.extend([7u32, 8, 9]);
        model.prefill(&mut whole, &tokens).unwrap();
        assert_states_identical("decode steps in a room", &d, &whole);
    }
}

#[test]
fn thread_count_does_not_change_results() {
    // The test binaries run rayon with one thread; the kernels split work differently on more threads
    // (by blocks of outputs and by heads), which must not change a bit.
    let model = bf16_model();
    for threads in [2, 3] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let (hidden, state) = pool.install(|| {
            let mut state = model.new_state().unwrap();
            let out = model
                .forward(&mut [BatchItem::new(&mut state, &prompts()[3])])
                .unwrap();
            (out.hidden, state)
        });
        let what = format!("prompt 3 on {threads} threads vs on one");
        assert_identical(model, &what, &hidden, &one_shot_hidden(model, 3));
        assert_states_identical(&what, &state, &one_shot(model, 3).1);
    }
}

/// Branches computed in the same pass as their prefix (`BatchItem::parent`): a prefix, two branches of
/// it, an unrelated prompt in between and a branch of a branch give the hidden states and final states
/// of running each full sequence alone, bit for bit.
#[test]
fn branches_in_the_same_pass_equal_one_by_one() {
    for model in models() {
        let (p1, p2) = (&prompts()[1], &prompts()[2]);
        // Prompt 1 split as prefix | middle | tail; prompt 2 and 3 unrelated.
        let (a, rest) = p1.split_at(p1.len() / 2);
        let (b, c) = rest.split_at(rest.len() / 3);
        let mut states: Vec<SequenceState> = (0..5).map(|_| model.new_state().unwrap()).collect();
        let [s0, s1, s2, s3, s4] = &mut states[..] else {
            unreachable!()
        };
        let mut items = vec![
            BatchItem::new(s0, a),
            BatchItem::new(s1, p2),
            BatchItem::new(s2, b),
            BatchItem::new(s3, rest),
            BatchItem::new(s4, c),
        ];
        items[2].parent = Some(0); // a ++ b
        items[3].parent = Some(0); // a ++ rest = prompt 1
        items[4].parent = Some(2); // a ++ b ++ c = prompt 1, through a branch of a branch
        let out = model.forward(&mut items).unwrap();
        drop(items);
        let full = one_shot(model, 1);
        let alone2 = one_shot(model, 2);
        let seq = |i: usize| out.sequence_hidden(i).unwrap();
        let at = |start: usize, len: usize| full.0.narrow(0, start, len).unwrap();
        assert_identical(model, "prefix item", &seq(0), &at(0, a.len()));
        assert_identical(model, "unrelated item between branches", &seq(1), &alone2.0);
        assert_identical(model, "branch a|b", &seq(2), &at(a.len(), b.len()));
        assert_identical(model, "branch a|rest", &seq(3), &at(a.len(), rest.len()));
        assert_identical(
            model,
            "branch of a branch a|b|c",
            &seq(4),
            &at(a.len() + b.len(), c.len()),
        );
        assert_states_identical("branch a|rest state", &states[3], &full.1);
        assert_states_identical("branch a|b|c state", &states[4], &full.1);
    }
}

/// Items whose state is not kept (`BatchItem::keep_state = false`, the engine's read-out branches) give
/// the same hidden states bit for bit, also when they are the parent of a later branch, and their states
/// are left as they were.
#[test]
fn items_without_kept_state_compute_the_same_and_leave_their_state() {
    for model in models() {
        let p1 = &prompts()[1];
        let (a, rest) = p1.split_at(p1.len() / 2);
        let (b, c) = rest.split_at(rest.len() / 3);
        let mut states: Vec<SequenceState> = (0..4).map(|_| model.new_state().unwrap()).collect();
        let [s0, s1, s2, s3] = &mut states[..] else {
            unreachable!()
        };
        let mut items = vec![
            BatchItem::new(s0, a),
            BatchItem::new(s1, rest),
            BatchItem::new(s2, b),
            BatchItem::new(s3, c),
        ];
        items[1].parent = Some(0);
        items[1].keep_state = false;
        items[2].parent = Some(0);
        items[2].keep_state = false; // and the parent of item 3
        items[3].parent = Some(2);
        let out = model.forward(&mut items).unwrap();
        drop(items);
        let full = one_shot(model, 1);
        let seq = |i: usize| out.sequence_hidden(i).unwrap();
        let at = |start: usize, len: usize| full.0.narrow(0, start, len).unwrap();
        assert_identical(model, "prefix", &seq(0), &at(0, a.len()));
        assert_identical(
            model,
            "branch a|rest, state dropped",
            &seq(1),
            &at(a.len(), rest.len()),
        );
        assert_identical(
            model,
            "branch a|b, state dropped",
            &seq(2),
            &at(a.len(), b.len()),
        );
        assert_identical(
            model,
            "branch of a dropped branch a|b|c",
            &seq(3),
            &at(a.len() + b.len(), c.len()),
        );
        assert_states_identical("a|b|c state", &states[3], &full.1);
        for dropped in &states[1..3] {
            assert_eq!(dropped.n_tokens(), 0, "a dropped state is left as it was");
            assert!(dropped.layers().iter().all(|layer| match layer {
                LayerState::Attention(cache) => cache.is_empty(),
                LayerState::DeltaNet(d) => d.rule.pending == 0,
            }));
        }
    }
}

#[test]
fn a_branch_must_follow_its_parent() {
    let model = bf16_model();
    let p = &prompts()[0];
    let mut s0 = model.new_state().unwrap();
    let mut s1 = model.new_state().unwrap();
    let mut items = vec![BatchItem::new(&mut s0, p), BatchItem::new(&mut s1, p)];
    items[0].parent = Some(1);
    let err = model.forward(&mut items).unwrap_err().to_string();
    assert!(err.contains("not earlier in the batch"), "{err}");
    items[0].parent = Some(0);
    let err = model.forward(&mut items).unwrap_err().to_string();
    assert!(err.contains("not earlier in the batch"), "{err}");
}
