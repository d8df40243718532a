//! What each all-reduce algorithm sends, rank by rank (`parallel.allreduce`; the engine's
//! algorithms are in the worker's `comm/ring.rs` and `comm/ring/all_reduce.rs`). Exact
//! for the engine: buffers are cut into chunks as [`chunk_range`] cuts them.
//!
//! For D elements over W ranks:
//!
//! ```text
//!   ring          every rank 2(W-1)/W x D   (bandwidth-optimal: the same for every W)
//!   naive         rank 0 (W-1) x D out and (W-1) x D in; the others D each way
//!   tree          a rank D up to its parent, D down to each child: rank 0 ceil(log2 W) x D
//!   hierarchical  a ring inside each node of L ranks (2(L-1)/L x D), a ring across the
//!                 W/L leaders (2(W/L-1)/(W/L) x D), then each leader (L-1) x D to its node
//! ```

use crate::plan::ring::chunk_range;
use crate::spec::AllReduce;

/// Elements rank `rank` of `w` sends in an all-reduce of `n` elements with `algorithm`
/// (`ranks_per_node`: the node size of `hierarchical`).
pub fn elements_sent(algorithm: AllReduce, n: usize, w: usize, ranks_per_node: usize, rank: usize) -> usize {
    if w <= 1 || rank >= w {
        return 0;
    }
    match algorithm {
        AllReduce::Ring => ring_elements_sent(n, w, rank),
        AllReduce::Naive => {
            if rank == 0 {
                (w - 1) * n
            } else {
                n
            }
        }
        AllReduce::Tree => {
            let up = usize::from(rank != 0);
            up * n + tree_children(rank, w).len() * n
        }
        AllReduce::Hierarchical => {
            let node = Nodes::new(w, ranks_per_node);
            let (members, index) = (node.members(rank), rank % node.size);
            let inside = ring_elements_sent(n, members.len(), index);
            let leaders = if index == 0 { ring_elements_sent(n, node.count, rank / node.size) } else { 0 };
            let to_node = if index == 0 { (members.len() - 1) * n } else { 0 };
            inside + leaders + to_node
        }
    }
}

/// The most any rank sends (see [`elements_sent`]).
pub fn busiest_elements_sent(algorithm: AllReduce, n: usize, w: usize, ranks_per_node: usize) -> usize {
    (0..w).map(|r| elements_sent(algorithm, n, w, ranks_per_node, r)).max().unwrap_or(0)
}

/// A ring's reduce-scatter sends every chunk but the rank's own, its all-gather every
/// chunk but its right neighbour's.
fn ring_elements_sent(n: usize, w: usize, me: usize) -> usize {
    if w <= 1 {
        return 0;
    }
    2 * n - chunk_range(n, w, me).len() - chunk_range(n, w, (me + 1) % w).len()
}

/// A binary tree over ranks 0..w rooted at 0: rank r's children are r + d for every power
/// of two d below r's lowest set bit (every d for the root) with r + d < w, largest first
/// (the order the result travels down).
pub fn tree_children(rank: usize, w: usize) -> Vec<usize> {
    let lowest = if rank == 0 { w.next_power_of_two() } else { 1 << rank.trailing_zeros() };
    let mut d = lowest / 2;
    let mut children = Vec::new();
    while d >= 1 {
        if rank + d < w {
            children.push(rank + d);
        }
        d /= 2;
    }
    children
}

/// Rank r's parent in [`tree_children`]'s tree: r less its lowest set bit.
pub fn tree_parent(rank: usize) -> Option<usize> {
    (rank != 0).then(|| rank - (1 << rank.trailing_zeros()))
}

/// `hierarchical`'s nodes: consecutive runs of `size` ranks (the last may be shorter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nodes {
    pub size: usize,
    pub count: usize,
    world: usize,
}

impl Nodes {
    pub fn new(world: usize, ranks_per_node: usize) -> Self {
        let size = ranks_per_node.clamp(1, world.max(1));
        Nodes { size, count: world.div_ceil(size), world }
    }

    /// The ranks of `rank`'s node, its leader (the node's first rank) first.
    pub fn members(&self, rank: usize) -> std::ops::Range<usize> {
        let start = rank / self.size * self.size;
        start..(start + self.size).min(self.world)
    }

    /// Every node's leader, in order.
    pub fn leaders(&self) -> Vec<usize> {
        (0..self.count).map(|k| k * self.size).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tree_reaches_every_rank_once() {
        for w in 1..=9 {
            let mut reached = vec![0; w];
            for r in 0..w {
                for c in tree_children(r, w) {
                    reached[c] += 1;
                    assert_eq!(tree_parent(c), Some(r), "w={w}");
                }
            }
            assert_eq!(reached[0], 0);
            assert!(reached[1..].iter().all(|&n| n == 1), "w={w}: {reached:?}");
        }
        assert_eq!(tree_children(0, 8), [4, 2, 1]);
        assert_eq!(tree_children(4, 8), [6, 5]);
        assert_eq!(tree_children(0, 5), [4, 2, 1]);
    }

    #[test]
    fn the_busiest_rank_of_each_algorithm_sends_its_formula() {
        let d = 8 * 1024;
        for w in [4usize, 8] {
            let ring = busiest_elements_sent(AllReduce::Ring, d, w, 2);
            assert_eq!(ring, 2 * (w - 1) * d / w);
            assert_eq!(busiest_elements_sent(AllReduce::Naive, d, w, 2), (w - 1) * d);
            assert_eq!(busiest_elements_sent(AllReduce::Tree, d, w, 2), (w.ilog2() as usize) * d);
            // Nodes of 2: a ring of 2 (D), a ring of w/2 leaders, then D to the other member.
            let leaders = w / 2;
            let hierarchical = d + 2 * (leaders - 1) * d / leaders + d;
            assert_eq!(busiest_elements_sent(AllReduce::Hierarchical, d, w, 2), hierarchical);
        }
        assert_eq!(elements_sent(AllReduce::Naive, 10, 1, 2, 0), 0);
    }
}
