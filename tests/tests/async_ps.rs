//! Asynchronous SGD with a parameter server (`parallel.sync: async_ps`): every rank pushes
//! its gradient to the server on rank 0 and pulls the parameters without waiting for the
//! others. The server applies every gradient (W x steps of them) and says how stale they
//! were; the bytes each rank sends and the memory each holds are the planner's; the loss
//! falls, next to one rank taking as many updates of the same size in turn.

use distlab_common::planner::plan;
use distlab_common::trace::CollectiveOp;
use distlab_common::*;
use distlab_tests::*;

fn spec(dp: usize, steps: u64) -> ExperimentSpec {
    let mut spec = quick_spec("async ps", steps);
    (spec.parallel.dp, spec.parallel.sync) = (dp, DataSync::AsyncPs);
    spec.train.micro_batch = 2;
    spec
}

/// "staleness 0: 3, 1: 20, 2: 1 (mean 0.92)" of the server's line: the number of gradients
/// applied and their mean staleness.
fn server_line(log: &str) -> (u64, f64) {
    let line = log.lines().find(|l| l.contains("asynchronous SGD: the server applied")).expect("the server's line");
    let applied = line.split("applied ").nth(1).and_then(|r| r.split(' ').next()).and_then(|n| n.parse().ok());
    let mean = line.split("(mean ").nth(1).and_then(|r| r.trim_end_matches(')').parse().ok());
    (applied.expect("gradients applied"), mean.expect("mean staleness"))
}

#[test]
fn the_server_applies_every_workers_gradient_with_the_planners_bytes_and_memory() {
    let _serial = one_at_a_time();
    let (dp, steps) = (3, 8);
    let s = spec(dp, steps);
    let (points, log) = run_steps_with_env(&s, &[]);
    let (applied, mean_staleness) = server_line(&log);
    assert_eq!(applied, dp as u64 * steps, "every worker's every gradient: {log}");
    // Three workers on two cores: others push between a worker's pull and its push, but
    // hardly more than the two others each time.
    assert!(mean_staleness > 0.0 && mean_staleness < dp as f64, "staleness: {log}");
    // (4.15 to about 3.4 in 8 steps here; a worker still on its first parameters stays near 4.15)
    assert!(points.last().unwrap().loss < 0.9 * points[0].loss, "{points:?}");

    let (_, trace) = run_points_with_trace(&s);
    let planned = plan(&s).unwrap();
    let n = planned.stages[0].params_per_rank;
    for rank in trace.ranks.iter() {
        let sent: u64 = rank.comm.counters.iter().filter(|c| c.op == CollectiveOp::Send).map(|c| c.bytes_sent).sum();
        let expected = match rank.rank {
            0 => planned.parameter_server.as_ref().unwrap().comm.ps_push_pull * steps,
            // (and at the end a header saying the worker is done)
            _ => planned.stages[0].comm.ps_push_pull * steps + 24,
        };
        assert_eq!(sent, expected, "rank {}: bytes sent", rank.rank);
    }
    assert_rank_memory_is_planned(&s, &trace);
    let server = &planned.parameter_server.as_ref().unwrap().comm;
    println!(
        "{dp} workers of {n} parameters, {steps} steps: a worker sends {} B a step, the server {} B a round \
         (a ring all-reduce: {} B from every rank)",
        planned.stages[0].comm.ps_push_pull,
        server.ps_push_pull,
        distlab_common::plan::ring::ring_all_reduce_bytes(n, dp as u64, 4)
    );
}

/// Two workers of 12 steps make 24 updates of 2 sequences each, as one rank's 24 steps of
/// 2 sequences do in turn: the same tokens and updates, the asynchronous ones on stale
/// parameters. Both learn; the numbers are printed.
#[test]
fn async_sgd_against_one_rank_at_equal_updates() {
    let _serial = one_at_a_time();
    let (points, log) = run_steps_with_env(&spec(2, 12), &[]);
    let (applied, mean_staleness) = server_line(&log);
    let mut alone = quick_spec("one rank", 24);
    alone.train.micro_batch = 2;
    let sequential = run_losses(&alone);
    let (first, last) = (points[0].loss, points.last().unwrap().loss);
    println!(
        "async 2 workers: {applied} updates, mean staleness {mean_staleness:.2}, loss {first:.4} -> {last:.4}; \
         one rank: 24 updates, loss {:.4} -> {:.4}",
        sequential[0],
        sequential.last().unwrap()
    );
    assert_eq!(applied, 24);
    assert!(last < first && sequential.last().unwrap() < &sequential[0]);
}
