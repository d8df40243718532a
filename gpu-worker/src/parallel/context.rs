//! Context parallelism, DeepSpeed-Ulysses (Jacobs et al. 2023): every sequence split along
//! its tokens over the `cp` ranks of a context-parallel group, consecutive ranks of the
//! data-parallel group that read the same sequences.
//!
//! Everything in a block but attention works token by token, so each rank runs it on its
//! own T/cp tokens. Attention needs every token of a sequence: around it, one all-to-all
//! turns q, k and v from "my tokens, every head" into "every token, my heads" (heads are
//! independent of each other), attention runs unchanged on whole sequences of H/cp heads,
//! and a second all-to-all turns its output back:
//!
//! ```text
//!   cp = 2, T = 4 (tokens t0..t3), heads A and B:
//!
//!   rank 0:  t0 t1 | A B          to_heads          rank 0:  t0 t1 t2 t3 | A
//!   rank 1:  t2 t3 | A B       ------------->       rank 1:  t0 t1 t2 t3 | B
//!
//!   each rank sends cp - 1 of its cp blocks: (cp-1)/cp of the tensor
//! ```
//!
//! Per block and micro-batch: q, k, v and the output forward; the output's and q, k, v's
//! gradients backward (the same exchanges in reverse), each (cp-1)/cp of a tensor of this
//! rank's tokens. The bytes do not grow with cp per rank, unlike a ring's, but every rank
//! must hold whole sequences of its heads, so cp can be at most the heads (per TP rank).
//!
//! The gradients of the parameters, each rank's from its tokens, are summed with the rest
//! of the data-parallel group's, which the context-parallel ranks belong to, as the loss is
//! (each rank's mean over its tokens counts for its share of the step's tokens).
//!
//! Ring attention (Liu et al. 2023) is the other way: the queries stay, the blocks of keys
//! and values travel round the ranks (`RecordedExchange::pass_on`), each block's attention
//! merged by its log-sum-exp (`ops/ring_attention.rs`). Per block and micro-batch a rank
//! sends a block of k and v cp-1 times forward and again backward, with the block's
//! gradient cp times: (3cp-2) blocks, each 1/cp of the sequence's k and v. No head limit,
//! and each pass could hide under the attention of the block before (not done here: the
//! passes and the blocks' attention take turns). With 2cp chunks, rank r holds chunks r and
//! 2cp-1-r, so every rank has as much of the causal triangle.
//!
//! The model's half of this is `model/context_parallel.rs`. As expert parallelism's
//! all-to-alls, the exchange goes through host memory (`exchange.rs`); the re-arranging
//! of rows and columns is done there, on the way.

use std::sync::Arc;

use distlab_common::trace::{lane, Span};

use super::exchange::{Arrangement, Columns, RecordedExchange};
use super::TrainBackend;
use crate::comm::{CommError, Communicator};
use crate::memory::MemoryTracker;
use crate::model::{ContextParallelGroup, ContextPlace, ExchangeShape};

/// One rank's context-parallel group: its communicator and the record of its all-to-alls.
pub struct ContextParallel(RecordedExchange);

impl ContextParallel {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        ContextParallel(RecordedExchange::new(comm, lane::CP))
    }

    /// The group's communicator, for a faster one over the same ranks to take its place
    /// (NCCL, see `train/cuda.rs`).
    pub fn comm_mut(&mut self) -> &mut Box<dyn Communicator> {
        self.0.comm_mut()
    }

    /// What the group's communicator keeps for staging (see `Communicator::staging_bytes`).
    pub fn staging_bytes(&self) -> u64 {
        self.0.staging_bytes()
    }
}

impl<B: TrainBackend> ContextParallelGroup<B> for ContextParallel {
    fn place(&self) -> ContextPlace {
        let (rank, size) = self.0.place();
        ContextPlace { rank, size }
    }

    fn to_heads(
        &mut self,
        be: &B,
        from: &B::Buf,
        to: &mut B::Buf,
        shape: ExchangeShape,
        what: &'static str,
        layer: usize,
    ) -> Result<(), CommError> {
        let cp = self.0.place().1;
        let pack = |mine: &[f32]| heads_blocks(mine, &shape, cp);
        let unpack = |received: &[f32], out: &mut [f32]| whole_sequences(received, out, &shape, cp);
        let arrangement = Some(Arrangement { pack: &pack, unpack: &unpack });
        self.0.all_to_all(be, (from, to), arrangement, format!("all_to_all cp: layer {layer} {what}"), layer)
    }

    fn to_tokens(
        &mut self,
        be: &B,
        from: &B::Buf,
        to: &mut B::Buf,
        shape: ExchangeShape,
        what: &'static str,
        layer: usize,
    ) -> Result<(), CommError> {
        let cp = self.0.place().1;
        let pack = |mine: &[f32]| token_blocks(mine, &shape, cp);
        let unpack = |received: &[f32], out: &mut [f32]| every_head(received, out, &shape, cp);
        let arrangement = Some(Arrangement { pack: &pack, unpack: &unpack });
        self.0.all_to_all(be, (from, to), arrangement, format!("all_to_all cp: layer {layer} {what}"), layer)
    }

    fn pass_on(
        &mut self,
        be: &B,
        send: (&B::Buf, Columns),
        recv: (&mut B::Buf, Columns),
        what: &'static str,
        step: usize,
        layer: usize,
    ) -> Result<(), CommError> {
        self.0.pass_on(be, send, recv, format!("ring cp: layer {layer} {what}, pass {step}"), layer)
    }

    fn begin_step(&mut self, step: u64, record: bool) {
        self.0.begin_step(step, record);
    }

    fn spans(&self) -> Vec<Span> {
        self.0.spans()
    }

    fn attach_memory(&mut self, memory: &Arc<MemoryTracker>) {
        self.0.attach_memory(memory);
    }
}

/// The columns of rank `r`'s heads in a row that holds every head: part r of each group.
fn head_columns(groups: &[usize; 3], cp: usize, r: usize) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let mut start = 0;
    groups.iter().filter(|&&w| w > 0).map(move |&w| {
        let part = w / cp;
        let at = start + r * part;
        start += w;
        at..at + part
    })
}

/// Width of a row of one rank's heads.
fn heads_width(shape: &ExchangeShape, cp: usize) -> usize {
    shape.groups.iter().map(|w| w / cp).sum()
}

/// to_heads, before the all-to-all: this rank's rows (batch x tokens, every head) as cp
/// blocks, block r holding rank r's heads' columns of every row.
fn heads_blocks(mine: &[f32], shape: &ExchangeShape, cp: usize) -> Vec<f32> {
    let width: usize = shape.groups.iter().sum();
    let mut send = Vec::with_capacity(mine.len());
    for r in 0..cp {
        for row in mine.chunks_exact(width) {
            for cols in head_columns(&shape.groups, cp, r) {
                send.extend_from_slice(&row[cols]);
            }
        }
    }
    send
}

/// to_heads, after it: block s came from rank s and holds its tokens (of every sequence)
/// for this rank's heads; they go to rows s*tokens.. of each whole sequence.
fn whole_sequences(received: &[f32], out: &mut [f32], shape: &ExchangeShape, cp: usize) {
    let width = heads_width(shape, cp);
    let block = shape.tokens * width;
    for (s, from) in received.chunks_exact(shape.batch * block).enumerate() {
        for (b, sequence) in from.chunks_exact(block).enumerate() {
            let at = (b * cp + s) * block;
            out[at..at + block].copy_from_slice(sequence);
        }
    }
}

/// to_tokens, before the all-to-all: whole sequences of this rank's heads as cp blocks,
/// block r holding rank r's tokens of every sequence (the inverse of [`whole_sequences`]).
fn token_blocks(mine: &[f32], shape: &ExchangeShape, cp: usize) -> Vec<f32> {
    let block = shape.tokens * heads_width(shape, cp);
    let mut send = Vec::with_capacity(mine.len());
    for r in 0..cp {
        for b in 0..shape.batch {
            let at = (b * cp + r) * block;
            send.extend_from_slice(&mine[at..at + block]);
        }
    }
    send
}

/// to_tokens, after it: block s came from rank s and holds its heads' columns of this
/// rank's rows; they go back to their columns (the inverse of [`heads_blocks`]).
fn every_head(received: &[f32], out: &mut [f32], shape: &ExchangeShape, cp: usize) {
    let (width, mine) = (shape.groups.iter().sum::<usize>(), heads_width(shape, cp));
    let rows = shape.batch * shape.tokens;
    for (s, from) in received.chunks_exact(rows * mine).enumerate() {
        for (row, piece) in out.chunks_exact_mut(width).zip(from.chunks_exact(mine)) {
            let mut piece = piece;
            for cols in head_columns(&shape.groups, cp, s) {
                let (here, rest) = piece.split_at(cols.len());
                row[cols].copy_from_slice(here);
                piece = rest;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank r of cp holds tokens r*T/cp.. of every sequence; every element is named by
    /// (sequence, token, column) so where it lands can be checked one by one.
    fn value(b: usize, t: usize, col: usize) -> f32 {
        (b * 10_000 + t * 100 + col) as f32
    }

    #[test]
    fn to_heads_gives_each_rank_whole_sequences_of_its_heads_and_to_tokens_undoes_it() {
        let (batch, seq, cp) = (2, 6, 3);
        let tokens = seq / cp;
        // q 6 wide (two columns per rank), k and v 3 wide (one each)
        let shape = ExchangeShape { batch, tokens, groups: [6, 3, 3] };
        let width = 12;
        let mine: Vec<Vec<f32>> = (0..cp)
            .map(|r| {
                let mut rows = Vec::new();
                for b in 0..batch {
                    for t in 0..tokens {
                        rows.extend((0..width).map(|col| value(b, r * tokens + t, col)));
                    }
                }
                rows
            })
            .collect();
        // the all-to-all: block r of rank s's send goes to rank r, as block s
        let all_to_all = |sends: &[Vec<f32>]| -> Vec<Vec<f32>> {
            let n = sends[0].len() / cp;
            (0..cp).map(|r| (0..cp).flat_map(|s| sends[s][r * n..(r + 1) * n].to_vec()).collect()).collect()
        };
        let sends: Vec<Vec<f32>> = mine.iter().map(|m| heads_blocks(m, &shape, cp)).collect();
        let received = all_to_all(&sends);
        let heads: Vec<Vec<f32>> = received
            .iter()
            .map(|got| {
                let mut out = vec![0.0; got.len()];
                whole_sequences(got, &mut out, &shape, cp);
                out
            })
            .collect();
        for (r, out) in heads.iter().enumerate() {
            let columns: Vec<usize> = [2 * r, 2 * r + 1, 6 + r, 9 + r].to_vec();
            let expected: Vec<f32> = (0..batch)
                .flat_map(|b| (0..seq).flat_map(move |t| (0..4).map(move |i| (b, t, i))))
                .map(|(b, t, i)| value(b, t, columns[i]))
                .collect();
            assert_eq!(out, &expected, "rank {r}: every token of its heads, in order");
        }
        let sends: Vec<Vec<f32>> = heads.iter().map(|h| token_blocks(h, &shape, cp)).collect();
        let received = all_to_all(&sends);
        for (r, got) in received.iter().enumerate() {
            let mut back = vec![0.0; got.len()];
            every_head(got, &mut back, &shape, cp);
            assert_eq!(back, mine[r], "rank {r}: its tokens again, every head");
        }
    }
}
