//! Pipeline schedules: in which order one stage runs the forward and backward passes of
//! the M micro-batches of a step. Plain functions of the pipeline's shape and the stage,
//! so they can be read, printed and tested on their own.
//!
//! ```text
//! GPipe, P = 3, M = 4 (F = forward, B = backward, . = idle):
//!   stage 0:  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
//!   stage 1:  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
//!   stage 2:  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .
//!
//! 1F1B, P = 3, M = 4: warm-up (P - stage - 1 forwards), steady state (one forward, one
//! backward), cool-down (the remaining backwards). In order of execution:
//!   stage 0:  F0 F1 | F2 B0 F3 B1 | B2 B3
//!   stage 1:  F0    | F1 B0 F2 B1 F3 B2 | B3
//!   stage 2:        | F0 B0 F1 B1 F2 B2 F3 B3 |
//!
//! Interleaved 1F1B (Megatron-LM), P = 2, v = 2 chunks per stage, M = 4: the layers are
//! cut into P*v = 4 chunks; stage 0 holds chunks 0 and 2 (a, b), stage 1 chunks 1 and 3.
//! Micro-batches go through a stage's chunks in groups of P (forwards a, a, b, b, a, a, ...;
//! backwards the other way round), warm-up 2(P - stage - 1) + (v-1)P forwards:
//!   stage 0:  Fa0 Fa1 Fb0 Fb1 | Fa2 Bb0 Fa3 Bb1 Fb2 Ba0 Fb3 Ba1 | Bb2 Bb3 Ba2 Ba3
//!   stage 1:  Fa0 Fa1         | Fb0 Bb0 Fb1 Bb1 Fa2 Ba0 Fa3 Ba1 Fb2 Bb2 Fb3 Bb3 | Ba2 Ba3
//!
//! ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"), P = 3, M = 4: the backward
//! is cut into B (the input's gradient, which the previous stage waits for) and W (the
//! weights' gradients, which nobody waits for). It runs 1F1B with B in place of the whole
//! backward, and stage s holds back its first s W passes, to run them where 1F1B would
//! wait for a neighbour:
//!   stage 0:  F0 F1 | F2 B0 W0 F3 B1 W1 | B2 W2 B3 W3
//!   stage 1:  F0    | F1 B0 F2 B1 W0 F3 B2 W1 | B3 W2 W3
//!   stage 2:        | F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 | W2 W3
//! ```
//!
//! GPipe and 1F1B leave the same bubble, (P-1)/(M+P-1) of the step on equal stages; 1F1B
//! holds at most P - stage micro-batches' activations at once where GPipe holds all M.
//! Interleaving passes through a stage v times per micro-batch, each pass 1/v as long, so
//! the ramp-up and ramp-down shrink v-fold: (P-1)/(v*M+P-1), for more messages and a
//! little more activation memory. ZB-H1's bubble is (P-1)(F+B-W) against 1F1B's
//! (P-1)(F+B+W) (the paper's section 3.1), a third of it when F = B = W: (P-1)/(3M+P-1);
//! every stage then holds P micro-batches until their W, the most 1F1B holds on any stage.

use std::ops::Range;

use crate::plan::ring::chunk_range;
use crate::spec::{ExperimentSpec, PpSchedule};

/// One pass of one micro-batch through one of this stage's chunks of layers (`chunk`
/// counts this stage's chunks from 0; always 0 but in the interleaved schedule).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Forward {
        micro: usize,
        chunk: usize,
    },
    /// The backward: whole, or (ZB-H1) the input's gradient only (B).
    Backward {
        micro: usize,
        chunk: usize,
    },
    /// ZB-H1: the weights' gradients of a micro-batch whose B ran (W).
    Weights {
        micro: usize,
        chunk: usize,
    },
}

impl Action {
    pub fn micro(self) -> usize {
        match self {
            Action::Forward { micro, .. } | Action::Backward { micro, .. } | Action::Weights { micro, .. } => micro,
        }
    }

    pub fn chunk(self) -> usize {
        match self {
            Action::Forward { chunk, .. } | Action::Backward { chunk, .. } | Action::Weights { chunk, .. } => chunk,
        }
    }

    pub fn is_forward(self) -> bool {
        matches!(self, Action::Forward { .. })
    }
}

/// The shape of one step's pipeline: the schedule, P stages of v chunks each, M
/// micro-batches. Model chunk `g` (0..P*v, in layer order) lives on stage g % P as its
/// chunk g / P: consecutive chunks sit on consecutive stages, and the last stage's chunk
/// hands on to the first stage's next one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pipeline {
    pub kind: PpSchedule,
    pub stages: usize,
    /// Chunks of layers per stage (`parallel.virtual_stages`; 1 but for interleaved).
    pub chunks: usize,
    pub micro_batches: usize,
}

impl Pipeline {
    /// The pipeline of a run: its micro-batches are every micro-step of the optimizer step.
    pub fn of(spec: &ExperimentSpec) -> Self {
        let p = &spec.parallel;
        // One stage runs forward, backward, forward, ... whatever the schedule (GPipe's
        // order would only hold every micro-batch's activations for nothing).
        let kind = if p.pp > 1 { p.pp_schedule } else { PpSchedule::OneFOneB };
        let chunks = if kind == PpSchedule::Interleaved { p.virtual_stages.max(1) } else { 1 };
        Pipeline { kind, stages: p.pp.max(1), chunks, micro_batches: spec.pipeline_micro_batches() }
    }

    /// The blocks of each of `stage`'s chunks, for a model of `layers` blocks: one run of
    /// about layers/P blocks, or (interleaved) v runs of layers/(P*v), model chunks
    /// stage, stage + P, ...
    pub fn blocks_of(&self, layers: usize, stage: usize) -> Vec<Range<usize>> {
        (0..self.chunks).map(|chunk| chunk_range(layers, self.model_chunks(), self.model_chunk(stage, chunk))).collect()
    }

    /// Whether `stage` receives activations (some chunk of it is not the model's first)
    /// and output gradients (some chunk is not the model's last).
    pub fn receives(&self, stage: usize) -> (bool, bool) {
        let g = |chunk| self.model_chunk(stage, chunk);
        ((0..self.chunks).any(|c| g(c) > 0), (0..self.chunks).any(|c| g(c) + 1 < self.model_chunks()))
    }

    /// Model chunks in all (P*v).
    pub fn model_chunks(&self) -> usize {
        self.stages * self.chunks
    }

    /// The model chunk that is `stage`'s chunk `chunk`.
    pub fn model_chunk(&self, stage: usize, chunk: usize) -> usize {
        chunk * self.stages + stage
    }

    /// The stage holding model chunk `g`, and which of its chunks it is.
    pub fn place_of(&self, g: usize) -> (usize, usize) {
        (g % self.stages, g / self.stages)
    }

    /// `stage`'s passes in the order it runs them.
    pub fn actions(&self, stage: usize) -> Vec<Action> {
        let m = self.micro_batches;
        match self.kind {
            PpSchedule::Gpipe => {
                let forwards = (0..m).map(|micro| Action::Forward { micro, chunk: 0 });
                forwards.chain((0..m).map(|micro| Action::Backward { micro, chunk: 0 })).collect()
            }
            PpSchedule::OneFOneB => one_f_one_b(
                self.warmup(stage),
                m,
                |micro| Action::Forward { micro, chunk: 0 },
                |micro| Action::Backward { micro, chunk: 0 },
            ),
            PpSchedule::Interleaved => {
                // The k-th forward takes micro-batches in groups of P through chunk 0, then
                // the same group through chunk 1, ...; backwards go through the chunks in
                // reverse (Megatron-LM's get_model_chunk_id).
                let (p, v) = (self.stages, self.chunks);
                let micro = |k: usize| (k / (p * v)) * p + k % p;
                let forward = |k: usize| Action::Forward { micro: micro(k), chunk: (k / p) % v };
                let backward = |k: usize| Action::Backward { micro: micro(k), chunk: v - 1 - (k / p) % v };
                one_f_one_b(self.warmup(stage), m * v, forward, backward)
            }
            PpSchedule::ZbH1 => {
                let f = |micro| Action::Forward { micro, chunk: 0 };
                let b = |micro| Action::Backward { micro, chunk: 0 };
                let mut actions = Vec::with_capacity(3 * m);
                let mut weights = 0;
                for a in one_f_one_b(self.warmup(stage), m, f, b) {
                    actions.push(a);
                    // Stage s runs the W of micro-batch k - s after the B of k.
                    if let Action::Backward { micro, .. } = a {
                        if micro >= stage {
                            actions.push(Action::Weights { micro: weights, chunk: 0 });
                            weights += 1;
                        }
                    }
                }
                actions.extend((weights..m).map(|micro| Action::Weights { micro, chunk: 0 }));
                actions
            }
        }
    }

    /// Whether the backward runs as B and W (ZB-H1).
    pub fn splits_backward(&self) -> bool {
        self.kind == PpSchedule::ZbH1
    }

    /// Forwards `stage` runs before its first backward. 1F1B: P - stage - 1. Interleaved:
    /// Megatron-LM's 2(P - stage - 1) + (v - 1)P, everything when M = P.
    fn warmup(&self, stage: usize) -> usize {
        let (p, v, m) = (self.stages, self.chunks, self.micro_batches);
        let last = p - stage - 1;
        match self.kind {
            PpSchedule::Gpipe => m,
            PpSchedule::OneFOneB | PpSchedule::ZbH1 => last.min(m),
            PpSchedule::Interleaved if m == p => m.saturating_mul(v),
            PpSchedule::Interleaved => (2 * last + (v - 1) * p).min(m.saturating_mul(v)),
        }
    }

    /// Chunk activations (one chunk's, of one micro-batch) `stage` holds at once: GPipe all
    /// M, the others one more than their warm-up (ZB-H1 keeps them until the W, s more).
    pub fn activations_in_flight(&self, stage: usize) -> usize {
        let passes = self.micro_batches.saturating_mul(self.chunks);
        let held_back = if self.splits_backward() { stage } else { 0 };
        self.warmup(stage).saturating_add(1).saturating_add(held_back).min(passes)
    }

    /// The bubble on equal stages, with free transfers: (P-1)/(M+P-1), or (P-1)/(v*M+P-1)
    /// interleaved (each stage's ramp is P-1 chunk passes, each 1/v of a stage's pass), or
    /// (P-1)/(3M+P-1) for ZB-H1 with F = B = W.
    pub fn formula_bubble(&self) -> f64 {
        let (p, v, m) = (self.stages.max(1) as f64, self.chunks.max(1) as f64, self.micro_batches.max(1) as f64);
        match self.kind {
            // (P-1)(F+B-W) idle against M(F+B+W) busy, F = B = W.
            PpSchedule::ZbH1 => (p - 1.0) / (3.0 * m + p - 1.0),
            _ => (p - 1.0) / (v * m + p - 1.0),
        }
    }

    /// [`Self::formula_bubble`] in symbols.
    pub fn formula_name(&self) -> &'static str {
        match self.kind {
            PpSchedule::Interleaved => "(P-1)/(vM+P-1)",
            PpSchedule::ZbH1 => "(P-1)/(3M+P-1) (ZB-H1, F = B = W)",
            _ => "(P-1)/(M+P-1)",
        }
    }
}

/// `warmup` forwards, then one forward and one backward while forwards remain, then the
/// backwards still owed: the k-th forward is `forward(k)`, the k-th backward `backward(k)`.
fn one_f_one_b(
    warmup: usize,
    passes: usize,
    forward: impl Fn(usize) -> Action,
    backward: impl Fn(usize) -> Action,
) -> Vec<Action> {
    let mut actions: Vec<Action> = (0..warmup).map(&forward).collect();
    for i in 0..passes - warmup {
        actions.push(forward(warmup + i));
        actions.push(backward(i));
    }
    actions.extend((passes - warmup..passes).map(backward));
    actions
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use Action::*;

    fn pipe(kind: PpSchedule, stages: usize, chunks: usize, micro_batches: usize) -> Pipeline {
        Pipeline { kind, stages, chunks, micro_batches }
    }

    fn f(micro: usize) -> Action {
        Forward { micro, chunk: 0 }
    }

    fn b(micro: usize) -> Action {
        Backward { micro, chunk: 0 }
    }

    #[test]
    fn one_f_one_b_warms_up_then_alternates() {
        let one_f_one_b = |p, s, m| pipe(PpSchedule::OneFOneB, p, 1, m).actions(s);
        assert_eq!(one_f_one_b(3, 0, 4), vec![f(0), f(1), f(2), b(0), f(3), b(1), b(2), b(3)]);
        // The last stage has no warm-up; a single stage is plain accumulation.
        assert_eq!(one_f_one_b(3, 2, 2), vec![f(0), b(0), f(1), b(1)]);
        assert_eq!(one_f_one_b(1, 0, 2), one_f_one_b(3, 2, 2));
        // Fewer micro-batches than stages: every forward is warm-up.
        assert_eq!(one_f_one_b(4, 0, 2), pipe(PpSchedule::Gpipe, 4, 1, 2).actions(0));
    }

    #[test]
    fn interleaved_goes_through_the_chunks_in_groups_of_p() {
        let fc = |micro, chunk| Forward { micro, chunk };
        let bc = |micro, chunk| Backward { micro, chunk };
        // P = 2, v = 2, M = 4: stage 1 warms up with (v-1)P = 2 forwards.
        assert_eq!(
            pipe(PpSchedule::Interleaved, 2, 2, 4).actions(1),
            vec![
                fc(0, 0),
                fc(1, 0),
                fc(0, 1),
                bc(0, 1),
                fc(1, 1),
                bc(1, 1),
                fc(2, 0),
                bc(0, 0),
                fc(3, 0),
                bc(1, 0),
                fc(2, 1),
                bc(2, 1),
                fc(3, 1),
                bc(3, 1),
                bc(2, 0),
                bc(3, 0),
            ]
        );
        // M = P: all forwards first.
        let all = pipe(PpSchedule::Interleaved, 2, 2, 2).actions(0);
        assert!(all[..4].iter().all(|a| a.is_forward()) && all[4..].iter().all(|a| !a.is_forward()));
    }

    /// A message between stages: the activation entering model chunk g, or the gradient
    /// leaving it backwards, of one micro-batch.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Message {
        Activation { into: usize, micro: usize },
        Gradient { into: usize, micro: usize },
    }

    /// Runs every stage's actions with sends that never wait and receives that do, each
    /// pair of stages joined by one first-in-first-out channel per direction (as the
    /// engine's links are): panics if a stage would take a message that is not the one its
    /// action needs, or if the step cannot finish. Returns the most chunk activations each
    /// stage held at once.
    fn run_over_fifo_channels(pipe: Pipeline) -> Vec<usize> {
        let (p, g_last) = (pipe.stages, pipe.model_chunks() - 1);
        let orders: Vec<Vec<Action>> = (0..p).map(|s| pipe.actions(s)).collect();
        let mut channels = vec![vec![VecDeque::<Message>::new(); p]; p];
        let mut next = vec![0; p];
        let (mut held, mut most) = (vec![0; p], vec![0; p]);
        loop {
            let mut progressed = false;
            for s in 0..p {
                while let Some(&action) = orders[s].get(next[s]) {
                    let (micro, g) = (action.micro(), pipe.model_chunk(s, action.chunk()));
                    let needs = match action {
                        Forward { .. } if g > 0 => {
                            Some((pipe.place_of(g - 1).0, Message::Activation { into: g, micro }))
                        }
                        Backward { .. } if g < g_last => {
                            Some((pipe.place_of(g + 1).0, Message::Gradient { into: g, micro }))
                        }
                        _ => None,
                    };
                    if let Some((from, wanted)) = needs {
                        match channels[from][s].front() {
                            None => break,
                            Some(&m) => assert_eq!(m, wanted, "{pipe:?} stage {s}: channel from {from} out of order"),
                        }
                        channels[from][s].pop_front();
                    }
                    match action {
                        Forward { .. } => {
                            held[s] += 1;
                            most[s] = most[s].max(held[s]);
                            if g < g_last {
                                let to = pipe.place_of(g + 1).0;
                                channels[s][to].push_back(Message::Activation { into: g + 1, micro });
                            }
                        }
                        Backward { .. } => {
                            // (ZB-H1 keeps the activations for the W)
                            held[s] -= usize::from(!pipe.splits_backward());
                            if g > 0 {
                                let to = pipe.place_of(g - 1).0;
                                channels[s][to].push_back(Message::Gradient { into: g - 1, micro });
                            }
                        }
                        Weights { .. } => held[s] -= 1,
                    }
                    next[s] += 1;
                    progressed = true;
                }
            }
            if (0..p).all(|s| next[s] == orders[s].len()) {
                return most;
            }
            assert!(progressed, "{pipe:?}: deadlock at {next:?}");
        }
    }

    fn shapes() -> Vec<Pipeline> {
        let mut shapes = Vec::new();
        for kind in [PpSchedule::Gpipe, PpSchedule::OneFOneB, PpSchedule::ZbH1] {
            for p in 1..=4 {
                shapes.extend((1..=9).map(|m| pipe(kind, p, 1, m)));
            }
        }
        for p in 2..=4 {
            for v in 2..=3 {
                shapes.extend((1..=4).map(|groups| pipe(PpSchedule::Interleaved, p, v, groups * p)));
            }
        }
        shapes
    }

    #[test]
    fn every_pass_runs_once_after_its_inputs_over_fifo_links_and_the_most_in_flight_is_the_formula() {
        for pipe in shapes() {
            for s in 0..pipe.stages {
                let actions = pipe.actions(s);
                let passes = if pipe.splits_backward() { 3 } else { 2 };
                assert_eq!(actions.len(), passes * pipe.micro_batches * pipe.chunks, "{pipe:?}");
                let mut seen = std::collections::HashSet::new();
                for a in &actions {
                    assert!(a.micro() < pipe.micro_batches && a.chunk() < pipe.chunks, "{pipe:?} {a:?}");
                    assert!(seen.insert(*a), "{pipe:?} stage {s}: {a:?} twice");
                    match *a {
                        Backward { micro, chunk } => {
                            assert!(seen.contains(&Forward { micro, chunk }), "{pipe:?}: {a:?} before its forward");
                        }
                        Weights { micro, chunk } => {
                            assert!(pipe.splits_backward(), "{pipe:?}: a W without ZB-H1");
                            assert!(seen.contains(&Backward { micro, chunk }), "{pipe:?}: {a:?} before its B");
                        }
                        Forward { .. } => {}
                    }
                }
            }
            let most = run_over_fifo_channels(pipe);
            for (s, most) in most.into_iter().enumerate() {
                assert_eq!(most, pipe.activations_in_flight(s), "{pipe:?} stage {s}");
            }
        }
    }

    #[test]
    fn zb_h1_holds_back_s_weight_passes_and_p_micro_batches() {
        let w = |micro| Weights { micro, chunk: 0 };
        // The doc comment's P = 3, M = 4.
        let zb = |s| pipe(PpSchedule::ZbH1, 3, 1, 4).actions(s);
        assert_eq!(zb(0), vec![f(0), f(1), f(2), b(0), w(0), f(3), b(1), w(1), b(2), w(2), b(3), w(3)]);
        assert_eq!(zb(1), vec![f(0), f(1), b(0), f(2), b(1), w(0), f(3), b(2), w(1), b(3), w(2), w(3)]);
        assert_eq!(zb(2), vec![f(0), b(0), f(1), b(1), f(2), b(2), w(0), f(3), b(3), w(1), w(2), w(3)]);
        // Every stage holds P micro-batches, 1F1B's first stage's number.
        let shape = pipe(PpSchedule::ZbH1, 4, 1, 8);
        assert!((0..4).all(|s| shape.activations_in_flight(s) == 4));
        assert!((shape.formula_bubble() - 3.0 / 27.0).abs() < 1e-12);
    }

    #[test]
    fn interleaving_shrinks_the_bubble_v_fold() {
        assert_eq!(pipe(PpSchedule::OneFOneB, 1, 1, 8).formula_bubble(), 0.0);
        assert!((pipe(PpSchedule::OneFOneB, 4, 1, 8).formula_bubble() - 3.0 / 11.0).abs() < 1e-12);
        assert!((pipe(PpSchedule::Interleaved, 4, 2, 8).formula_bubble() - 3.0 / 19.0).abs() < 1e-12);
    }
}
