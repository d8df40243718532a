//! One machine playing several hosts (`distlab-worker --simulated-hosts N`): ranks of
//! different simulated hosts talk over TCP on 127.0.0.1, those of one host through shared
//! memory, and training gives the same losses, bit for bit, as on one host.

use distlab_common::*;
use distlab_tests::*;

fn losses(points: &[MetricPoint]) -> Vec<f64> {
    points.iter().map(|m| m.loss).collect()
}

/// Data parallelism over two hosts of two ranks each: every all-reduce crosses hosts.
#[test]
fn dp4_over_two_hosts_trains_as_on_one() {
    let mut spec = quick_spec("dp4 over two hosts", 6);
    (spec.parallel.dp, spec.train.micro_batch) = (4, 2);
    let one_host = losses(&run_steps(&spec));
    let two_hosts = losses(&run_steps_on_hosts(&spec, 2));
    assert_eq!(two_hosts, one_host);
}

/// tp=2 x pp=2 over two hosts: each tensor-parallel pair inside a host, the pipeline's
/// activations and gradients between the hosts. FSDP over four hosts of one rank: every
/// gather and reduce-scatter crosses.
#[test]
fn tensor_pipeline_and_sharded_runs_train_across_hosts_as_on_one() {
    let mut spec = quick_spec("tp2 x pp2 over two hosts", 6);
    (spec.parallel.tp, spec.parallel.pp, spec.train.micro_batches) = (2, 2, 2);
    assert_eq!(losses(&run_steps_on_hosts(&spec, 2)), losses(&run_steps(&spec)));

    let mut fsdp = quick_spec("fsdp over four hosts", 6);
    (fsdp.parallel.dp, fsdp.parallel.sharding, fsdp.train.micro_batch) = (4, Sharding::Fsdp, 2);
    assert_eq!(losses(&run_steps_on_hosts(&fsdp, 4)), losses(&run_steps(&fsdp)));
}
