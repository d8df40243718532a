//! Where each step of a finished run went, from its trace: compute, communication the
//! compute thread waited for (exposed), idle; the compare page's split, for a trace written
//! by `distlab-worker run SPEC --out DIR` (DIR/trace.json).
//!
//! `cargo run --release -p distlab-worker --example time_split -- DIR/trace.json`

use distlab_common::compare::time_split;
use distlab_common::trace::ExperimentTrace;

fn main() {
    let Some(path) = std::env::args().nth(1) else {
        eprintln!("usage: time_split TRACE.json");
        std::process::exit(2);
    };
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        eprintln!("cannot read {path}: {e}");
        std::process::exit(1)
    });
    let trace: ExperimentTrace = serde_json::from_str(&text).unwrap_or_else(|e| {
        eprintln!("{path} is not a trace: {e}");
        std::process::exit(1)
    });
    match time_split(&trace.ranks) {
        Some(t) => println!(
            "{}",
            serde_json::json!({"compute_ms": t.compute_ms, "exposed_comm_ms": t.comm_ms, "idle_ms": t.idle_ms, "steps": t.steps})
        ),
        None => {
            eprintln!("{path}: no recorded steps");
            std::process::exit(1)
        }
    }
}
