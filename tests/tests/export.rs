//! The trained model out of the lab: `distlab-worker run --out DIR` writes
//! model.safetensors and config.json in GPT-2's format, and whatever the strategy that
//! trained it (data, tensor or pipeline parallel, sharded or not), the file holds the
//! model one rank trains on the same batches.

use std::collections::BTreeMap;

use distlab_common::*;
use distlab_tests::*;
use serde_json::Value;

type Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

fn spec(name: &str, micro_batch: usize, micro_batches: usize) -> ExperimentSpec {
    let mut spec = quick_spec(name, 4);
    spec.model = ModelSpec::dense(4, 64, 4, 32, 64);
    spec.train.micro_batch = micro_batch;
    spec.train.micro_batches = micro_batches;
    spec
}

/// Trains `spec` and reads back the model it wrote, and its config.json.
fn exported(spec: &ExperimentSpec) -> (Tensors, Value) {
    let dir = tempfile::tempdir().expect("temp dir");
    run_into(spec, dir.path());
    read_export(dir.path())
}

/// The model and config.json a run wrote into `dir`.
fn read_export(dir: &std::path::Path) -> (Tensors, Value) {
    let bytes = std::fs::read(dir.join(export::WEIGHTS_FILE)).expect("model.safetensors");
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    let tensors = file
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view.data().chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect();
    let config = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let left: Vec<_> = std::fs::read_dir(dir).expect("the run's directory").flatten().map(|e| e.file_name()).collect();
    assert!(
        !left.iter().any(|name| name.to_string_lossy().contains("final-weights")),
        "the ranks' files are removed: {left:?}"
    );
    (tensors, serde_json::from_str(&config).expect("config JSON"))
}

/// The largest difference between two exports' values (their names and shapes equal).
fn largest_difference(a: &Tensors, b: &Tensors, what: &str) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}: tensor names");
    let mut worst = 0.0f32;
    for (name, (shape, values)) in a {
        let (other_shape, other) = &b[name];
        assert_eq!(shape, other_shape, "{what}: {name}");
        for (x, y) in values.iter().zip(other) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

#[test]
fn a_run_writes_gpt2s_tensors_and_config() {
    let _serial = one_at_a_time();
    let spec = spec("export", 2, 4);
    let dir = tempfile::tempdir().expect("temp dir");
    run_into(&spec, dir.path());
    let (tensors, config) = read_export(dir.path());
    let (v, t, d, layers) = (64, 32, 64, 4);
    assert_eq!(tensors.len(), 2 + 12 * layers + 3, "{:?}", tensors.keys());
    let shape = |name: &str| tensors.get(name).map(|(s, _)| s.clone()).unwrap_or_else(|| panic!("no {name}"));
    assert_eq!(shape("transformer.wte.weight"), [v, d]);
    assert_eq!(shape("transformer.wpe.weight"), [t, d]);
    assert_eq!(shape("transformer.h.3.attn.c_attn.weight"), [d, 3 * d]);
    assert_eq!(shape("transformer.h.3.attn.c_proj.weight"), [d, d]);
    assert_eq!(shape("transformer.h.0.mlp.c_fc.weight"), [d, 4 * d]);
    assert_eq!(shape("transformer.h.0.mlp.c_proj.weight"), [4 * d, d]);
    assert_eq!(shape("transformer.ln_f.bias"), [d]);
    assert_eq!(shape("lm_head.weight"), [v, d]);
    assert!(tensors.values().all(|(_, values)| values.iter().all(|x| x.is_finite())));
    // Trained: the LayerNorm gains have moved off their initial 1.
    assert!(tensors["transformer.h.0.ln_1.weight"].1.iter().any(|&g| g != 1.0));
    assert_eq!(config["n_layer"], 4);
    assert_eq!(config["n_embd"], 64);
    assert_eq!(config["n_positions"], 32);
    assert_eq!(config["vocab_size"], 64);
    assert_eq!(config["tie_word_embeddings"], false);

    // The export's own predictions, read back by the engine (what check_export.py sets
    // against transformers'): one row per token, each a distribution.
    let out = std::process::Command::new(bin_path("distlab-worker"))
        .arg("probabilities")
        .arg(dir.path())
        .args(["1", "2", "3", "63"])
        .output()
        .expect("distlab-worker probabilities");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<Vec<f64>> = serde_json::from_slice(&out.stdout).expect("JSON rows");
    assert_eq!(rows.len(), 4);
    for row in &rows {
        assert_eq!(row.len(), 64);
        assert!((row.iter().sum::<f64>() - 1.0).abs() < 1e-4, "{row:?}");
    }
    let out = std::process::Command::new(bin_path("distlab-worker"))
        .arg("probabilities")
        .arg(dir.path())
        .arg("64")
        .output()
        .expect("distlab-worker probabilities");
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("outside the model's vocabulary"));

    // A model GPT-2 cannot hold (experts) trains but writes no model.
    let mut moe = spec.clone();
    moe.model = ModelSpec { experts: 2, expert_top_k: 1, ..moe.model };
    let dir = tempfile::tempdir().expect("temp dir");
    run_into(&moe, dir.path());
    assert!(!dir.path().join(export::WEIGHTS_FILE).exists());
}

/// Each strategy's export against one rank's on the same batches: the DP shards, the
/// pipeline stages (interleaved chunks too) and the TP cuts all go back in their place.
#[test]
fn every_strategy_exports_the_model_one_rank_trains() {
    let _serial = one_at_a_time();
    let (one, _) = exported(&spec("one rank", 2, 4));
    let mut cases = Vec::new();
    let mut tp = spec("tp2", 2, 4);
    tp.parallel.tp = 2;
    cases.push(("tp=2", tp));
    let mut pp = spec("pp2", 2, 4);
    (pp.parallel.pp, pp.parallel.pp_schedule) = (2, PpSchedule::OneFOneB);
    cases.push(("pp=2 1f1b", pp));
    let mut interleaved = spec("interleaved", 2, 4);
    (interleaved.parallel.pp, interleaved.parallel.pp_schedule) = (2, PpSchedule::Interleaved);
    interleaved.parallel.virtual_stages = 2;
    cases.push(("pp=2 interleaved v=2", interleaved));
    for (what, spec) in cases {
        let worst = largest_difference(&one, &exported(&spec).0, what);
        println!("{what}: largest difference from one rank {worst:.1e}");
        assert!(worst < 1e-4, "{what}: {worst}");
    }
    // Data parallel: each of 2 ranks takes half of every micro-batch.
    let (one, _) = exported(&spec("one rank", 4, 2));
    for sharding in [Sharding::None, Sharding::Zero1, Sharding::Fsdp] {
        let mut dp = spec("dp2", 2, 2);
        (dp.parallel.dp, dp.parallel.sharding) = (2, sharding);
        let what = format!("dp=2 {}", sharding.as_str());
        let worst = largest_difference(&one, &exported(&dp).0, &what);
        println!("{what}: largest difference from one rank {worst:.1e}");
        assert!(worst < 1e-4, "{what}: {worst}");
    }
    let mut mesh = spec("3d", 2, 2);
    (mesh.parallel.dp, mesh.parallel.tp, mesh.parallel.pp) = (2, 2, 2);
    mesh.parallel.sharding = Sharding::Fsdp;
    let worst = largest_difference(&one, &exported(&mesh).0, "dp2 x tp2 x pp2 fsdp");
    println!("dp2 x tp2 x pp2 fsdp: largest difference from one rank {worst:.1e}");
    assert!(worst < 1e-4, "3d: {worst}");
}

/// A BPE run learns its tokenizer and cuts the text once for both of its ranks (the log
/// says so once, and the ranks train on what it cut), and exports that tokenizer beside
/// the model.
#[test]
fn a_bpe_run_cuts_its_text_once_and_exports_that_tokenizer() {
    let mut spec = quick_spec("bpe export", 3);
    spec.data = DataSpec { dataset: Dataset::Text, tokenizer: TokenizerKind::Bpe, ..DataSpec::default() };
    spec.model = ModelSpec::llama(1, 32, 2, 1, 64, 32, 320);
    spec.parallel.dp = 2;
    let (points, log) = run_steps_with_env(&spec, &[]);
    assert_eq!(log.matches("the text cut into tokens once for every rank").count(), 1, "{log}");
    assert_eq!(points.len(), 3);
    let dir = tempfile::tempdir().expect("temp dir");
    run_into(&spec, dir.path());
    let exported = std::fs::read_to_string(dir.path().join("tokenizer.json")).expect("tokenizer.json");
    let learned = distlab_worker::data::Data::new(&spec.data, &spec.model, spec.global_batch()).expect("data");
    assert_eq!(Some(exported), learned.tokenizer().and_then(|t| t.to_json()));
    assert!(dir.path().join("tokenizer_config.json").exists());
}
