//! Where an experiment's ranks run: on the worker that asks for work when it hosts them
//! all, else on it and other idle workers together (gang scheduling).
//!
//! Ranks are numbered with tensor parallelism innermost, then pipeline stages, then
//! data-parallel replicas, and every worker takes a run of consecutive ranks. A share is a
//! whole number of pipeline replicas (tp x pp ranks) where the workers allow it, so that
//! tensor-parallel groups and pipeline stages stay inside a host, as the planner assumes
//! (their traffic is the heaviest and most frequent); failing that, of tensor-parallel
//! groups (tp ranks), so that only pipeline sends and data-parallel collectives cross
//! hosts. A tensor-parallel group is never cut. The fewest hosts win: the asking worker
//! first, then the others from the largest.

/// A worker that could take ranks: its id and how many ranks it hosts at once (None: as
/// many as a run has).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Candidate {
    pub worker_id: i64,
    pub ranks: Option<usize>,
}

impl Candidate {
    fn capacity(self) -> usize {
        self.ranks.unwrap_or(usize::MAX)
    }
}

/// One host of a placement: a worker and how many consecutive ranks it runs (host 0 starts
/// at rank 0, each next host where the previous one ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Share {
    pub worker_id: i64,
    pub ranks: usize,
}

/// The run's shape as placement sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub world: usize,
    pub tp: usize,
    pub pp: usize,
}

impl Shape {
    pub fn of(spec: &distlab_common::ExperimentSpec) -> Self {
        Shape { world: spec.world_size(), tp: spec.parallel.tp.max(1), pp: spec.parallel.pp.max(1) }
    }
}

/// Places a run of `shape` with `asking` as host 0: `asking` alone when it hosts the whole
/// world, else (with `multi_host`) `asking` and as few of `idle` as it takes. None when the
/// run cannot start now.
pub fn place(shape: Shape, asking: Candidate, idle: &[Candidate], multi_host: bool) -> Option<Vec<Share>> {
    if shape.world == 0 {
        return None;
    }
    if asking.capacity() >= shape.world {
        return Some(vec![Share { worker_id: asking.worker_id, ranks: shape.world }]);
    }
    if !multi_host {
        return None;
    }
    let mut others: Vec<Candidate> = idle.iter().copied().filter(|c| c.worker_id != asking.worker_id).collect();
    others.sort_by_key(|c| (std::cmp::Reverse(c.capacity()), c.worker_id));
    let mut units = vec![shape.tp * shape.pp, shape.tp];
    units.dedup();
    units
        .into_iter()
        .filter(|unit| shape.world % unit == 0)
        .find_map(|unit| shares_of(shape.world, unit, asking, &others))
}

/// `asking` then `others` in turn, each taking as many whole `unit`s of ranks as it hosts,
/// until the world is placed. None when `asking` cannot take one unit or they all fall short.
fn shares_of(world: usize, unit: usize, asking: Candidate, others: &[Candidate]) -> Option<Vec<Share>> {
    let mut shares = Vec::new();
    let mut left = world;
    for (i, c) in std::iter::once(asking).chain(others.iter().copied()).enumerate() {
        let take = (c.capacity() / unit * unit).min(left);
        if take == 0 {
            if i == 0 {
                return None;
            }
            continue;
        }
        shares.push(Share { worker_id: c.worker_id, ranks: take });
        left -= take;
        if left == 0 {
            return Some(shares);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(worker_id: i64, ranks: usize) -> Candidate {
        Candidate { worker_id, ranks: Some(ranks) }
    }

    fn shares(placed: Option<Vec<Share>>) -> Vec<(i64, usize)> {
        placed.unwrap_or_default().into_iter().map(|s| (s.worker_id, s.ranks)).collect()
    }

    const DP4: Shape = Shape { world: 4, tp: 1, pp: 1 };

    #[test]
    fn a_worker_that_hosts_the_world_runs_it_alone() {
        let unlimited = Candidate { worker_id: 1, ranks: None };
        assert_eq!(shares(place(DP4, unlimited, &[worker(2, 8)], true)), [(1, 4)]);
        assert_eq!(shares(place(DP4, worker(1, 4), &[], false)), [(1, 4)]);
    }

    #[test]
    fn a_wider_run_spans_idle_workers_largest_first_or_waits() {
        assert_eq!(shares(place(DP4, worker(1, 2), &[worker(2, 2)], true)), [(1, 2), (2, 2)]);
        // The fewest hosts: the 3-rank worker before the 1-rank ones.
        let idle = [worker(2, 1), worker(3, 3), worker(4, 1)];
        assert_eq!(
            shares(place(Shape { world: 6, tp: 1, pp: 1 }, worker(1, 2), &idle, true)),
            [(1, 2), (3, 3), (2, 1)]
        );
        // The last host takes only what is left.
        assert_eq!(shares(place(DP4, worker(1, 2), &[worker(2, 8)], true)), [(1, 2), (2, 2)]);
        // Not enough idle ranks, multi-host runs switched off, or the asking worker listed
        // again: nothing starts.
        assert!(place(DP4, worker(1, 2), &[worker(2, 1)], true).is_none());
        assert!(place(DP4, worker(1, 2), &[worker(2, 2)], false).is_none());
        assert!(place(DP4, worker(1, 2), &[worker(1, 2)], true).is_none());
    }

    #[test]
    fn tensor_parallel_groups_then_pipelines_stay_inside_a_host() {
        // tp=2 x pp=2 x dp=2 on workers of 4: one whole replica each.
        let shape = Shape { world: 8, tp: 2, pp: 2 };
        assert_eq!(shares(place(shape, worker(1, 4), &[worker(2, 4)], true)), [(1, 4), (2, 4)]);
        // Workers of 3 ranks cannot hold a replica of 4, so each takes one TP pair: the
        // pipeline crosses hosts, the TP groups do not.
        let idle = [worker(2, 3), worker(3, 3), worker(4, 3)];
        assert_eq!(shares(place(shape, worker(1, 3), &idle, true)), [(1, 2), (2, 2), (3, 2), (4, 2)]);
        // A worker too small for a TP group cannot take part.
        let tp4 = Shape { world: 8, tp: 4, pp: 1 };
        assert!(place(tp4, worker(1, 3), &[worker(2, 8)], true).is_none());
        assert_eq!(shares(place(tp4, worker(1, 4), &[worker(2, 3), worker(3, 5)], true)), [(1, 4), (3, 4)]);
    }
}
