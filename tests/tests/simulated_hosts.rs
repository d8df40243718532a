//! One machine playing several hosts (`distlab-worker --simulated-hosts N`): ranks of
//! different simulated hosts talk over TCP on 127.0.0.1, those of one host through shared
//! memory, and training gives the same losses, bit for bit, as on one host.

use distlab_common::trace::{link_uses, ExperimentTrace};
use distlab_common::*;
use distlab_tests::*;

fn losses(points: &[MetricPoint]) -> Vec<f64> {
    points.iter().map(|m| m.loss).collect()
}

/// The run on `hosts` simulated hosts: its losses, after checking that its ranks recorded
/// those hosts and, with data parallelism (whose ring steps the trace records), that some
/// steps crossed between them.
fn losses_on_hosts(spec: &ExperimentSpec, hosts: usize, expected: &[u32]) -> Vec<f64> {
    let (points, trace): (Vec<MetricPoint>, ExperimentTrace) = run_on_hosts(spec, hosts);
    let recorded: Vec<Option<u32>> = trace.ranks.iter().map(|r| r.host).collect();
    assert_eq!(recorded, expected.iter().map(|&h| Some(h)).collect::<Vec<_>>(), "{}", spec.name);
    if spec.parallel.dp > 1 {
        assert!(link_uses(&trace).iter().any(|l| l.crosses_hosts), "{}: no recorded step crossed hosts", spec.name);
    }
    losses(&points)
}

/// Data parallelism over two hosts of two ranks each: every all-reduce crosses hosts.
#[test]
fn dp4_over_two_hosts_trains_as_on_one() {
    let mut spec = quick_spec("dp4 over two hosts", 6);
    (spec.parallel.dp, spec.train.micro_batch) = (4, 2);
    let one_host = losses(&run_steps(&spec));
    assert_eq!(losses_on_hosts(&spec, 2, &[0, 0, 1, 1]), one_host);
}

/// tp=2 x pp=2 over two hosts: each tensor-parallel pair inside a host, the pipeline's
/// activations and gradients between the hosts. FSDP over four hosts of one rank: every
/// gather and reduce-scatter crosses.
#[test]
fn tensor_pipeline_and_sharded_runs_train_across_hosts_as_on_one() {
    let mut spec = quick_spec("tp2 x pp2 over two hosts", 6);
    (spec.parallel.tp, spec.parallel.pp, spec.train.micro_batches) = (2, 2, 2);
    assert_eq!(losses_on_hosts(&spec, 2, &[0, 0, 1, 1]), losses(&run_steps(&spec)));

    let mut fsdp = quick_spec("fsdp over four hosts", 6);
    (fsdp.parallel.dp, fsdp.parallel.sharding, fsdp.train.micro_batch) = (4, Sharding::Fsdp, 2);
    assert_eq!(losses_on_hosts(&fsdp, 4, &[0, 1, 2, 3]), losses(&run_steps(&fsdp)));
}
