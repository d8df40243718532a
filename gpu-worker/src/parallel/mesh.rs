//! The topology of a run: world = dp x tp x pp ranks, numbered with tensor parallelism
//! innermost, then pipeline stages, then data-parallel replicas ("TP inside, PP across,
//! DP everywhere"):
//!
//! ```text
//!   rank = dp_index * (pp * tp) + stage * tp + tp_index
//!
//!   dp=2, pp=2, tp=2:   replica 0: stage 0 = ranks 0 1 | stage 1 = ranks 2 3
//!                       replica 1: stage 0 = ranks 4 5 | stage 1 = ranks 6 7
//! ```
//!
//! Tensor-parallel partners are neighbours (on a GPU node they share the fastest links),
//! a pipeline group is one replica's stages, a data-parallel group is the same stage and
//! TP position in every replica. Everything is computed here once and handed to the
//! strategies explicitly; there is no global state.

/// Where one rank sits in the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coords {
    pub dp: usize,
    pub stage: usize,
    pub tp: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Topology {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
}

impl Topology {
    pub fn new(dp: usize, tp: usize, pp: usize) -> Self {
        Topology { dp: dp.max(1), tp: tp.max(1), pp: pp.max(1) }
    }

    pub fn world(&self) -> usize {
        self.dp * self.tp * self.pp
    }

    pub fn coords(&self, rank: usize) -> Coords {
        Coords { dp: rank / (self.pp * self.tp), stage: (rank / self.tp) % self.pp, tp: rank % self.tp }
    }

    pub fn rank(&self, c: Coords) -> usize {
        c.dp * self.pp * self.tp + c.stage * self.tp + c.tp
    }

    /// The ranks holding the same part of the model in every replica, in replica order.
    pub fn dp_group(&self, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.dp).map(|dp| self.rank(Coords { dp, ..c })).collect()
    }

    /// This replica's stages, in stage order.
    pub fn pp_group(&self, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.pp).map(|stage| self.rank(Coords { stage, ..c })).collect()
    }

    /// The ranks splitting this stage's matrices, in TP order.
    pub fn tp_group(&self, rank: usize) -> Vec<usize> {
        let c = self.coords(rank);
        (0..self.tp).map(|tp| self.rank(Coords { tp, ..c })).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tp_inside_pp_across_dp_everywhere() {
        let t = Topology::new(2, 2, 2);
        assert_eq!(t.world(), 8);
        assert_eq!(t.coords(6), Coords { dp: 1, stage: 1, tp: 0 });
        assert_eq!(t.tp_group(6), vec![6, 7]);
        assert_eq!(t.pp_group(6), vec![4, 6]);
        assert_eq!(t.dp_group(6), vec![2, 6]);
        for rank in 0..8 {
            assert_eq!(t.rank(t.coords(rank)), rank);
            for group in [t.dp_group(rank), t.pp_group(rank), t.tp_group(rank)] {
                assert!(group.contains(&rank));
            }
        }
    }
}
