//! Claims about the all-reduce algorithms besides the ring, measured on the collective
//! demo's replay: the bytes each rank sent and the steps they took one after another.

use super::{Measurement, RunEvidence};
use crate::plan::all_reduce::{elements_sent, Nodes};
use crate::wire::trace::RingStep;
use crate::{AllReduce, CollectiveCheck};

/// The demo's byte counts, if the run is a collective demo with `algorithm`.
fn demo<'a>(run: &'a RunEvidence, algorithm: AllReduce) -> Result<&'a CollectiveCheck, String> {
    let c = run.view.summary.as_ref().and_then(|s| s.collective.as_ref()).ok_or_else(|| {
        format!("measured on the collective demo's replay: run the allreduce-{} preset", algorithm.as_str())
    })?;
    if c.algorithm != algorithm {
        return Err(format!("the run all-reduced with {}, not {}", c.algorithm.as_str(), algorithm.as_str()));
    }
    Ok(c)
}

/// Every step a rank sent in, each recorded once (by its sender).
fn sends<'a>(run: &'a RunEvidence) -> impl Iterator<Item = &'a RingStep> {
    run.ranks.iter().flat_map(|r| r.comm.steps.iter().filter(move |s| s.from == r.rank))
}

/// Steps one after another: the distinct (phase, step) pairs the replay holds.
fn sequential_steps<'a>(steps: impl Iterator<Item = &'a RingStep>) -> usize {
    let mut seen = Vec::new();
    for s in steps {
        if !seen.contains(&(s.phase, s.step)) {
            seen.push((s.phase, s.step));
        }
    }
    seen.len()
}

/// Tree: partial sums climb a binary tree to rank 0 and the result comes down, one level
/// per step: 2 ceil(log2 W) steps where the ring takes 2(W-1), but every edge carries the
/// whole buffer D, so rank 0 sends ceil(log2 W) x D where a ring rank sends 2(W-1)/W x D.
pub(super) fn tree(run: &RunEvidence) -> Result<Measurement, String> {
    let c = demo(run, AllReduce::Tree)?;
    let (w, d) = (c.world, c.elements as u64 * 4);
    let levels = w.next_power_of_two().trailing_zeros() as u64;
    let root = c.bytes_sent.first().copied().unwrap_or(0);
    let steps = sequential_steps(sends(run));
    if steps == 0 {
        return Err("the run recorded no steps".into());
    }
    Ok(Measurement {
        experiment_id: run.view.id,
        predicted: format!(
            "rank 0 sends ceil(log2 W) x D = {levels} x {d} = {} bytes in 2 ceil(log2 W) = {} steps; a ring sends {} \
             bytes per rank in 2(W-1) = {} steps (W = {w})",
            levels * d,
            2 * levels,
            c.formula_bytes,
            2 * w.saturating_sub(1)
        ),
        measured: format!(
            "rank 0 sent {root} bytes; the busiest rank {} and the least busy {}; the replay took {steps} steps",
            c.bytes_sent.iter().max().unwrap_or(&0),
            c.bytes_sent.iter().min().unwrap_or(&0)
        ),
        agrees: w > 1 && root == levels * d && steps as u64 == 2 * levels && c.bytes_sent == c.rank_formula_bytes,
        note: None,
    })
}

/// Hierarchical: rings inside the nodes, one ring across the n nodes' leaders, then each
/// leader to its node. Only the leaders' ring crosses between nodes: 2(n-1) steps of D/n,
/// 2(n-1)/n x D per leader, where a flat ring over the W ranks crosses between nodes in
/// every one of its 2(W-1) steps.
pub(super) fn hierarchical(run: &RunEvidence) -> Result<Measurement, String> {
    let c = demo(run, AllReduce::Hierarchical)?;
    let nodes = Nodes::new(c.world, run.view.spec.parallel.ranks_per_node);
    let node_of = |rank: u32| rank as usize / nodes.size;
    let crossing: Vec<&RingStep> = sends(run).filter(|s| node_of(s.from) != node_of(s.to)).collect();
    let leaders = nodes.leaders();
    let mut senders: Vec<usize> = crossing.iter().map(|s| s.from as usize).collect();
    senders.sort_unstable();
    senders.dedup();
    // What each leader should send across: its share of a ring over the n leaders.
    let leader_bytes = |k: usize| elements_sent(AllReduce::Ring, c.elements, nodes.count, 1, k) as u64 * 4;
    let sent_by = |leader: usize| -> (u64, usize) {
        let mine = crossing.iter().filter(|s| s.from as usize == leader);
        (mine.clone().map(|s| s.bytes).sum(), mine.count())
    };
    let n = nodes.count;
    let across: u64 = crossing.iter().map(|s| s.bytes).sum();
    // A flat ring in rank order: the ranks whose right neighbour is on another node send
    // their whole ring share across.
    let flat: u64 = (0..c.world)
        .filter(|&r| node_of(r as u32) != node_of(((r + 1) % c.world) as u32))
        .map(|r| elements_sent(AllReduce::Ring, c.elements, c.world, 1, r) as u64 * 4)
        .sum();
    let each_as_said = leaders.iter().enumerate().all(|(k, &leader)| sent_by(leader) == (leader_bytes(k), 2 * (n - 1)));
    Ok(Measurement {
        experiment_id: run.view.id,
        predicted: format!(
            "only the n = {n} leaders (ranks {leaders:?}) send between nodes: each 2(n-1) = {} steps carrying \
             2(n-1)/n x D = {} bytes ({} bytes in all); a flat ring over the {} ranks would send {flat} bytes \
             between nodes, in every one of its {} steps",
            2 * (n.saturating_sub(1)),
            leader_bytes(0),
            leaders.iter().enumerate().map(|(k, _)| leader_bytes(k)).sum::<u64>(),
            c.world,
            2 * c.world.saturating_sub(1)
        ),
        measured: format!(
            "ranks {senders:?} sent between nodes: {across} bytes in {} steps in all (rank 0: {} bytes in {} steps)",
            crossing.len(),
            sent_by(0).0,
            sent_by(0).1
        ),
        agrees: n > 1 && senders == leaders && each_as_said,
        note: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::all_reduce::{tree_children, tree_parent};
    use crate::spec::presets::presets;
    use crate::wire::trace::{RankCommTrace, RankTrace, RingPhase};
    use crate::{ExperimentView, RunSummary};

    const N: usize = 16;

    fn step(phase: RingPhase, step: u32, from: usize, to: usize, bytes: u64) -> RingStep {
        RingStep {
            collective: 0,
            phase,
            step,
            chunk: 0,
            from: from as u32,
            to: to as u32,
            bytes,
            start_us: 0,
            end_us: 0,
            values: None,
        }
    }

    /// The preset's run with each rank's sends, and the demo's counts made from them.
    fn run_of(key: &str, sends: Vec<RingStep>) -> (ExperimentView, Vec<RankTrace>) {
        let spec = presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap();
        let (w, rpn) = (spec.parallel.dp, spec.parallel.ranks_per_node);
        let ranks: Vec<RankTrace> = (0..w)
            .map(|r| RankTrace {
                rank: r as u32,
                comm: RankCommTrace {
                    steps: sends.iter().filter(|s| s.from == r as u32).cloned().collect(),
                    ..Default::default()
                },
                ..Default::default()
            })
            .collect();
        let collective = CollectiveCheck {
            world: w,
            elements: N,
            bytes_sent: ranks.iter().map(|r| r.comm.steps.iter().map(|s| s.bytes).sum()).collect(),
            formula_bytes: 2.0 * (w as f64 - 1.0) / w as f64 * (N * 4) as f64,
            algorithm: spec.parallel.allreduce,
            rank_formula_bytes: (0..w)
                .map(|r| elements_sent(spec.parallel.allreduce, N, w, rpn, r) as u64 * 4)
                .collect(),
            ..Default::default()
        };
        let summary = RunSummary { collective: Some(collective), ..Default::default() };
        let view = super::super::test_runs::succeeded_view(1, spec, Some(summary));
        (view, ranks)
    }

    fn evidence<'a>(v: &'a ExperimentView, ranks: &'a [RankTrace]) -> RunEvidence<'a> {
        RunEvidence { view: v, metrics: &[], ranks, traced_steps: 1 }
    }

    /// A ring's steps over `ring` (positions in order): 2(len-1) steps of D/len.
    fn ring_sends(ring: &[usize]) -> Vec<RingStep> {
        let len = ring.len();
        let mut out = Vec::new();
        for phase in [RingPhase::ReduceScatter, RingPhase::AllGather] {
            for s in 0..len - 1 {
                for (i, &r) in ring.iter().enumerate() {
                    out.push(step(phase, s as u32, r, ring[(i + 1) % len], (N * 4 / len) as u64));
                }
            }
        }
        out
    }

    #[test]
    fn the_tree_is_held_to_its_root_bytes_and_its_levels() {
        let d = (N * 4) as u64;
        let mut tree = Vec::new();
        for r in 0..8usize {
            if let Some(p) = tree_parent(r) {
                tree.push(step(RingPhase::Reduce, (r - p).trailing_zeros(), r, p, d));
            }
            for c in tree_children(r, 8) {
                tree.push(step(RingPhase::Broadcast, (c - r).trailing_zeros(), r, c, d));
            }
        }
        let (v, ranks) = run_of("allreduce-tree", tree.clone());
        let got = tree_check(&v, &ranks);
        assert!(got.agrees && got.measured.starts_with("rank 0 sent 192 bytes"), "{got:?}");
        assert!(got.measured.ends_with("took 6 steps"), "{got:?}");
        // An engine whose tree sends one edge after another (14 steps) disagrees...
        let serial: Vec<RingStep> =
            tree.iter().enumerate().map(|(i, s)| RingStep { step: i as u32, ..s.clone() }).collect();
        let (v, ranks) = run_of("allreduce-tree", serial);
        assert!(!tree_check(&v, &ranks).agrees);
        // ...and so does one that runs a ring under the tree's name.
        let (v, ranks) = run_of("allreduce-tree", ring_sends(&(0..8).collect::<Vec<_>>()));
        assert!(!tree_check(&v, &ranks).agrees);
    }

    fn tree_check(v: &ExperimentView, ranks: &[RankTrace]) -> Measurement {
        tree(&evidence(v, ranks)).unwrap()
    }

    #[test]
    fn only_the_leaders_cross_between_nodes() {
        let mut sends = ring_sends(&[0, 1, 2, 3]);
        sends.extend(ring_sends(&[4, 5, 6, 7]));
        sends.extend(ring_sends(&[0, 4]));
        for (leader, members) in [(0, 1..4), (4, 5..8)] {
            for (i, m) in members.enumerate() {
                sends.push(step(RingPhase::Broadcast, i as u32, leader, m, (N * 4) as u64));
            }
        }
        let (v, ranks) = run_of("allreduce-hierarchical", sends);
        let got = hierarchical(&evidence(&v, &ranks)).unwrap();
        assert!(got.agrees, "{got:?}");
        assert!(
            got.measured.starts_with(
                "ranks [0, 4] sent between nodes: 128 bytes in 4 steps in all (rank 0: 64 bytes in 2 steps)"
            ),
            "{got:?}"
        );
        assert!(got.predicted.contains("a flat ring over the 8 ranks would send 224 bytes"), "{got:?}");
        // A flat ring over all eight ranks crosses between nodes from ranks 3 and 7.
        let (v, ranks) = run_of("allreduce-hierarchical", ring_sends(&(0..8).collect::<Vec<_>>()));
        let got = hierarchical(&evidence(&v, &ranks)).unwrap();
        assert!(!got.agrees && got.measured.starts_with("ranks [3, 7]"), "{got:?}");
        // The tree's demo is not this check's.
        let (v, ranks) = run_of("allreduce-tree", vec![]);
        assert!(hierarchical(&evidence(&v, &ranks)).unwrap_err().contains("not hierarchical"));
    }
}
