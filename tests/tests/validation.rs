//! The validation loss (`train.eval_every`): held-out data, forward only. A learner reads
//! it as the model's loss on data it never trained on, so it must (1) leave training
//! exactly as it was, (2) be the same number on every layout of the same global batch,
//! and (3) come from data the training never reads.

use distlab_common::{Dataset, ExperimentSpec, Sharding};
use distlab_tests::*;

/// 12 steps, a validation loss after every 4th.
fn spec(name: &str) -> ExperimentSpec {
    let mut spec = quick_spec(name, 12);
    spec.train.eval_every = 4;
    spec
}

fn val_losses(points: &[distlab_common::MetricPoint]) -> Vec<(u64, f64)> {
    points.iter().filter_map(|p| p.val_loss.map(|v| (p.step, v))).collect()
}

#[test]
fn evaluating_leaves_training_unchanged() {
    let _one = one_at_a_time();
    // FSDP with prefetch and a pipeline: the gathers and the sends an evaluation makes
    // must leave no trace in the next step.
    for (name, dp, pp, sharding) in [("fsdp", 2, 1, Sharding::Fsdp), ("pipeline", 1, 2, Sharding::None)] {
        let mut every = spec(name);
        (every.parallel.dp, every.parallel.pp, every.parallel.sharding) = (dp, pp, sharding);
        every.parallel.prefetch = sharding == Sharding::Fsdp;
        every.train.micro_batches = 2;
        every.train.eval_every = 1;
        let mut never = every.clone();
        never.train.eval_every = 0;
        let (with, without) = (run_steps(&every), run_steps(&never));
        let bits = |points: &[distlab_common::MetricPoint]| {
            points.iter().map(|p| (p.loss.to_bits(), p.grad_norm.to_bits())).collect::<Vec<_>>()
        };
        assert_eq!(bits(&with), bits(&without), "{name}: evaluating changed the training");
        assert_eq!(val_losses(&with).len(), 12, "{name}: a validation loss after every step");
        assert!(val_losses(&without).is_empty());
    }
}

#[test]
fn every_layout_measures_the_same_validation_loss() {
    let _one = one_at_a_time();
    // One rank with 4 micro-batches of 4 against the same global batch of 16 split every way.
    let mut one = spec("one rank");
    (one.train.micro_batch, one.train.micro_batches) = (4, 4);
    let reference = run_steps(&one);
    let want = val_losses(&reference);
    assert_eq!(want.iter().map(|v| v.0).collect::<Vec<_>>(), [3, 7, 11], "after steps 4, 8 and 12");
    let mut layouts = Vec::new();
    let mut dp = one.clone();
    (dp.parallel.dp, dp.train.micro_batches) = (2, 2);
    layouts.push(("dp=2", dp.clone()));
    dp.parallel.sharding = Sharding::Zero1;
    layouts.push(("dp=2 zero1", dp.clone()));
    let mut tp = one.clone();
    tp.parallel.tp = 2;
    layouts.push(("tp=2", tp));
    let mut pp = one.clone();
    pp.parallel.pp = 2;
    layouts.push(("pp=2 1f1b", pp));
    let mut mesh = one.clone();
    (mesh.parallel.dp, mesh.parallel.tp, mesh.parallel.pp, mesh.train.micro_batches) = (2, 2, 2, 2);
    mesh.parallel.sharding = Sharding::Fsdp;
    layouts.push(("dp=2 x tp=2 x pp=2 fsdp", mesh));
    for (name, layout) in layouts {
        let got = val_losses(&run_steps(&layout));
        assert_eq!(got.len(), want.len(), "{name}");
        for ((step, a), (_, b)) in want.iter().zip(&got) {
            let rel = (a - b).abs() / a;
            assert!(rel < 1e-5, "{name} after step {step}: {b} vs one rank's {a} ({rel:e})");
        }
    }
    // It falls as the model learns, and stays above the chain's entropy rate (the best any
    // model can do on held-out sequences), which the run's summary reports.
    assert!(want.last().unwrap().1 < want[0].1, "{want:?}");
    assert!(want.iter().all(|v| v.1 > 2.0), "{want:?}");
}

/// The validation loss after the last step is the trained model's loss on the held-out
/// sequences, computed apart: the exported weights, loaded on their own, on the sequences
/// the dataset holds out (not some other batch, not the model before its last update).
#[test]
fn the_last_validation_loss_is_the_trained_model_s_loss_on_held_out_data() {
    let _one = one_at_a_time();
    let mut layout = spec("final");
    (layout.parallel.dp, layout.train.micro_batch, layout.train.micro_batches) = (2, 4, 2);
    let dir = tempfile::tempdir().expect("temp dir");
    let points = run_into(&layout, dir.path());
    let &(step, reported) = val_losses(&points).last().expect("a validation loss");
    assert_eq!(step, 11);
    let bytes = std::fs::read(dir.path().join("model.safetensors")).expect("the exported model");
    let params = distlab_worker::generate::load_hf(&layout.model, &bytes).expect("GPT-2 weights");
    let mut model = distlab_worker::generate::Predictor::new(&layout.model, &params).expect("a model");
    let data = distlab_worker::data::Data::new(&layout.data, &layout.model, layout.global_batch()).expect("data");
    let (sequences, seq, vocab) = (layout.global_batch(), layout.model.seq_len, layout.model.vocab);
    let (mut inputs, mut targets) = (vec![0u32; sequences * seq], vec![0u32; sequences * seq]);
    data.fill_validation(0, sequences, seq, &mut inputs, &mut targets);
    let mut nll = 0.0;
    for (x, y) in inputs.chunks(seq).zip(targets.chunks(seq)) {
        let probs = model.probabilities(x).expect("probabilities");
        nll -= y.iter().enumerate().map(|(i, &t)| f64::from(probs[i * vocab + t as usize]).ln()).sum::<f64>();
    }
    let apart = nll / (sequences * seq) as f64;
    let rel = (apart - reported).abs() / apart;
    println!("validation loss after the last step: reported {reported}, computed apart {apart} ({rel:.1e})");
    assert!(rel < 1e-5, "reported {reported}, computed apart {apart}");
}

/// On the text, the validation loss (on the text's held-out last tenth) falls as the model
/// learns the language (`data.rs`'s tests hold the split itself).
#[test]
fn a_text_model_s_validation_loss_falls() {
    let _one = one_at_a_time();
    let mut text = spec("text");
    text.data.dataset = Dataset::Text;
    (text.model.vocab, text.model.seq_len) = (256, 64);
    (text.train.steps, text.train.eval_every, text.train.lr) = (60, 20, 1e-2);
    let val = val_losses(&run_steps(&text));
    assert_eq!(val.iter().map(|v| v.0).collect::<Vec<_>>(), [19, 39, 59]);
    assert!(val[2].1 < val[0].1 && val[0].1 < (256f64).ln(), "{val:?}");
}
