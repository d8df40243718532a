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
//!
//! ZBV (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"; PyTorch's
//! ScheduleZBVZeroBubble), P = 2, M = 4: the layers cut into 2P chunks laid out in a V,
//! stage s holding chunk s on the way down (a) and chunk 2P-1-s on the way back (b): the
//! first stage runs the embeddings and the head, so a micro-batch's backward starts where
//! its forward began, and the last stage hands chunk a's output to its own chunk b. B and
//! W split as in ZB-H1:
//!   stage 0:  Fa0 Fa1 Fa2 Fb0 Bb0 Wb0 Fb1 Bb1 Wb1 Fa3 Ba0 Wa0 Fb2 Bb2 Wb2 Ba1 Wa1 Fb3 Bb3 Wb3
//!             Ba2 Wa2 Ba3 Wa3
//!   stage 1:  Fa0 Fb0 Fa1 Fb1 Bb0 Wb0 Fa2 Ba0 Wa0 Fb2 Bb1 Wb1 Fa3 Ba1 Wa1 Fb3 Bb2 Wb2 Ba2 Bb3
//!             Ba3 Wa2 Wb3 Wa3
//!
//! DualPipeV (DeepSeek's DualPipe cut in half, Sea AI Lab's "cut-in-half"), P = 2, M = 4:
//! ZBV's V, run in DualPipe's phases: forwards down to fill the V, then pairs of a forward
//! and another micro-batch's backward (DeepSeek overlaps the two, one's compute with the
//! other's communication), the backward whole (B then W at once) in the steady state and
//! split, its W held back, only at the ends of the ramps:
//!   stage 0:  Fa0 Fa1 Fa2 Fb0 Bb0 Wb0 Fb1 Fa3 Bb1 Wb1 Fb2 Ba0 Wa0 Bb2 Wb2 Fb3 Ba1 Wa1 Bb3 Wb3
//!             Ba2 Wa2 Ba3 Wa3
//!   stage 1:  Fa0 Fb0 Fa1 Fb1 Fa2 Bb0 Wb0 Fb2 Ba0 Wa0 Fa3 Bb1 Wb1 Fb3 Ba1 Wa1 Bb2 Wb2 Ba2 Wa2
//!             Bb3 Ba3 Wb3 Wa3
//! ```
//!
//! GPipe and 1F1B leave the same bubble, (P-1)/(M+P-1) of the step on equal stages; 1F1B
//! holds at most P - stage micro-batches' activations at once where GPipe holds all M.
//! Interleaving passes through a stage v times per micro-batch, each pass 1/v as long, so
//! the ramp-up and ramp-down shrink v-fold: (P-1)/(v*M+P-1), for more messages and a
//! little more activation memory. ZB-H1's bubble is (P-1)(F+B-W) against 1F1B's
//! (P-1)(F+B+W) (the paper's section 3.1), a third of it when F = B = W: (P-1)/(3M+P-1);
//! every stage then holds P micro-batches until their W, the most 1F1B holds on any stage.
//! ZBV's chunk passes are half a stage's, and its ramp is P-1 of them: (P-1)/(6M+P-1) with
//! F = B = W, for M >= 2P-1; it holds at most 2P chunk activations (P micro-batches of a
//! stage's layers), as 1F1B's first stage does. A link of the V carries activations one way
//! and gradients the same way interleaved, in the sender's order: the receiver keeps what
//! comes before it needs it ([`Pipeline::held_early`]). DualPipeV's bubble is DeepSeek's
//! (P-1)(F&B + B - 3W) with B the whole backward and F&B a pair's time: with the pair run
//! one pass after the other (F&B = F + B) and F = B = W per chunk pass, 2(P-1) passes
//! idle against 6M busy, (P-1)/(3M+P-1), twice ZBV's. The formula counts a pair as one
//! block; run as two passes, the forward as soon as its input is there, the schedule
//! replays to ZBV's P-1 idle passes (`analysis::pipeline`'s tests). The pairs pay off where
//! one's compute hides the other's communication (F&B < F + B). Every stage holds 2P+1
//! chunk activations at once, one more than ZBV. M >= 2P.

use std::ops::Range;

use crate::plan::ring::chunk_range;
use crate::spec::{ExperimentSpec, PpSchedule};

/// One pass of one micro-batch through one of this stage's chunks of layers (`chunk`
/// counts this stage's chunks from 0; always 0 but in the interleaved and V schedules).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    Forward {
        micro: usize,
        chunk: usize,
    },
    /// The backward: whole, or (ZB-H1, ZBV) the input's gradient only (B).
    Backward {
        micro: usize,
        chunk: usize,
    },
    /// ZB-H1, ZBV: the weights' gradients of a micro-batch whose B ran (W).
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

/// A message of the step between chunks: the activation going into model chunk `into`,
/// or the gradient of its output coming back into it, of one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Message {
    Activation { into: usize, micro: usize },
    Gradient { into: usize, micro: usize },
}

/// The shape of one step's pipeline: the schedule, P stages of v chunks each, M
/// micro-batches. Model chunk `g` (0..P*v, in layer order) lives on stage g % P as its
/// chunk g / P: consecutive chunks sit on consecutive stages, and the last stage's chunk
/// hands on to the first stage's next one. In a V (ZBV, DualPipeV, v = 2) chunk g < P
/// lives on stage g and chunk g >= P on stage 2P-1-g ([`Pipeline::place_of`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pipeline {
    pub kind: PpSchedule,
    pub stages: usize,
    /// Chunks of layers per stage (`parallel.virtual_stages` for interleaved, 2 in a V,
    /// else 1).
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
        let chunks = match kind {
            PpSchedule::Interleaved => p.virtual_stages.max(1),
            kind if kind.is_v() => 2,
            _ => 1,
        };
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

    /// The model chunk that is `stage`'s chunk `chunk`: interleaved, stage + chunk * P; in a
    /// V, the first chunk down the stages and the second back up, 2P - 1 - stage.
    pub fn model_chunk(&self, stage: usize, chunk: usize) -> usize {
        match chunk {
            1 if self.kind.is_v() => 2 * self.stages - 1 - stage,
            _ => chunk * self.stages + stage,
        }
    }

    /// The stage holding model chunk `g`, and which of its chunks it is.
    pub fn place_of(&self, g: usize) -> (usize, usize) {
        if self.kind.is_v() && g >= self.stages {
            (2 * self.stages - 1 - g, 1)
        } else {
            (g % self.stages, g / self.stages)
        }
    }

    /// Whether `stage` holds the embeddings (it runs the model's first chunk: stage 0).
    pub fn holds_embeddings(&self, stage: usize) -> bool {
        self.place_of(0).0 == stage
    }

    /// Whether `stage` holds the final norm, the LM head and the loss (it runs the model's
    /// last chunk: the last stage, or in a V the first).
    pub fn holds_head(&self, stage: usize) -> bool {
        self.place_of(self.model_chunks() - 1).0 == stage
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
            PpSchedule::Zbv => zbv(self.stages, m, stage),
            PpSchedule::DualPipeV => dualpipev(self.stages, m, stage),
        }
    }

    /// What `stage`'s `action` waits for, and the stage it comes from (itself where the V
    /// turns): a forward the activation out of the previous model chunk, a backward the
    /// gradient out of the next; None for the model's first forward, its last backward
    /// and every W.
    pub fn needs(&self, stage: usize, action: Action) -> Option<(usize, Message)> {
        let (g, micro) = (self.model_chunk(stage, action.chunk()), action.micro());
        match action {
            Action::Forward { .. } if g > 0 => Some((self.place_of(g - 1).0, Message::Activation { into: g, micro })),
            Action::Backward { .. } if g + 1 < self.model_chunks() => {
                Some((self.place_of(g + 1).0, Message::Gradient { into: g, micro }))
            }
            _ => None,
        }
    }

    /// What `stage`'s `action` sends when it is done, and to which stage: a forward its
    /// output to the next model chunk, a backward its input's gradient to the previous.
    pub fn sends(&self, stage: usize, action: Action) -> Option<(usize, Message)> {
        let (g, micro) = (self.model_chunk(stage, action.chunk()), action.micro());
        match action {
            Action::Forward { .. } if g + 1 < self.model_chunks() => {
                Some((self.place_of(g + 1).0, Message::Activation { into: g + 1, micro }))
            }
            Action::Backward { .. } if g > 0 => {
                Some((self.place_of(g - 1).0, Message::Gradient { into: g - 1, micro }))
            }
            _ => None,
        }
    }

    /// Activations and gradients `stage` sends other stages per micro-batch: each chunk's
    /// output but the model's last chunk's, each chunk's input gradient but the model's
    /// first's, less what the V's turn hands over on the stage itself.
    pub fn messages_per_micro_batch(&self, stage: usize) -> usize {
        let passes = (0..self.chunks)
            .flat_map(|chunk| [Action::Forward { micro: 0, chunk }, Action::Backward { micro: 0, chunk }]);
        passes.filter_map(|a| self.sends(stage, a)).filter(|&(to, _)| to != stage).count()
    }

    /// The messages stage `from`, running `order` (its schedule's, or an evaluation's
    /// forwards), sends stage `to`, in the order it sends them.
    pub fn messages(&self, from: usize, order: &[Action], to: usize) -> Vec<Message> {
        let sent = order.iter().filter_map(|&a| self.sends(from, a));
        sent.filter(|&(dest, _)| dest == to).map(|(_, message)| message).collect()
    }

    /// The most messages `stage` holds before the pass that needs them: those a link brings
    /// ahead of the one it waits for (each link delivers in its sender's order, and the
    /// stage reads on only while it waits), and the V's turn handed from chunk to chunk on
    /// the last stage. Depends on the orders only, not on timing: 0 for every schedule but
    /// the V's (the others' links deliver in the order their receivers want: not followed).
    pub fn held_early(&self, stage: usize) -> usize {
        if self.kind.is_v() {
            self.follow_held_early(stage)
        } else {
            0
        }
    }

    /// [`Self::held_early`], found by following the stage's passes whatever the schedule.
    fn follow_held_early(&self, stage: usize) -> usize {
        // Only the stages holding a neighbour of one of its chunks send to it (what the
        // stage sends itself is held from the send, never read off a link).
        let neighbours: Vec<usize> = (0..self.chunks)
            .map(|c| self.model_chunk(stage, c))
            .flat_map(|g| [g.checked_sub(1), Some(g + 1).filter(|&n| n < self.model_chunks())])
            .flatten()
            .map(|g| self.place_of(g).0)
            .collect();
        let mut links: Vec<std::collections::VecDeque<Message>> = vec![Default::default(); self.stages];
        for from in (0..self.stages).filter(|&from| from != stage && neighbours.contains(&from)) {
            links[from] = self.messages(from, &self.actions(from), stage).into();
        }
        let mut held: Vec<Message> = Vec::new();
        let mut most = 0;
        for action in self.actions(stage) {
            if let Some((from, wanted)) = self.needs(stage, action) {
                match held.iter().position(|&m| m == wanted) {
                    Some(i) => _ = held.remove(i),
                    None => {
                        while let Some(message) = links[from].pop_front().filter(|&m| m != wanted) {
                            held.push(message);
                            most = most.max(held.len());
                        }
                    }
                }
            }
            if let Some((_, message)) = self.sends(stage, action).filter(|&(to, _)| to == stage) {
                held.push(message);
                most = most.max(held.len());
            }
        }
        most
    }

    /// Passes of all the stages in a step (W passes not counted).
    pub fn passes(&self) -> usize {
        self.micro_batches.saturating_mul(self.chunks).saturating_mul(self.stages)
    }

    /// Whether the planner follows the schedule pass by pass to find its peaks (the
    /// others' are formulas).
    pub fn followed_pass_by_pass(&self) -> bool {
        matches!(self.kind, PpSchedule::Interleaved | PpSchedule::ZbH1) || self.kind.is_v()
    }

    /// Whether the backward runs as B and W (ZB-H1, ZBV, DualPipeV).
    pub fn splits_backward(&self) -> bool {
        self.kind.splits_backward()
    }

    /// Forwards `stage` runs before its first backward. 1F1B: P - stage - 1. Interleaved:
    /// Megatron-LM's 2(P - stage - 1) + (v - 1)P, everything when M = P.
    fn warmup(&self, stage: usize) -> usize {
        let (p, v, m) = (self.stages, self.chunks, self.micro_batches);
        let last = p - stage - 1;
        match self.kind {
            PpSchedule::Gpipe => m,
            PpSchedule::OneFOneB | PpSchedule::ZbH1 => last.min(m),
            // (the forwards before its first B, in the order `zbv` or `dualpipev` gives)
            PpSchedule::Zbv | PpSchedule::DualPipeV => {
                self.actions(stage).iter().take_while(|a| a.is_forward()).count()
            }
            PpSchedule::Interleaved if m == p => m.saturating_mul(v),
            PpSchedule::Interleaved => (2 * last + (v - 1) * p).min(m.saturating_mul(v)),
        }
    }

    /// Chunk activations (one chunk's, of one micro-batch) `stage` holds at once: GPipe all
    /// M, the others one more than their warm-up (ZB-H1 keeps them until the W, s more).
    pub fn activations_in_flight(&self, stage: usize) -> usize {
        if self.kind.is_v() {
            // (a forward takes a chunk's activations, its W gives them back)
            let mut held = 0usize;
            return self
                .actions(stage)
                .iter()
                .map(|a| {
                    match a {
                        Action::Forward { .. } => held += 1,
                        Action::Weights { .. } => held -= 1,
                        Action::Backward { .. } => {}
                    }
                    held
                })
                .max()
                .unwrap_or(0);
        }
        let passes = self.micro_batches.saturating_mul(self.chunks);
        let held_back = if self.splits_backward() { stage } else { 0 };
        self.warmup(stage).saturating_add(1).saturating_add(held_back).min(passes)
    }

    /// The bubble on equal stages, with free transfers: (P-1)/(M+P-1), or (P-1)/(v*M+P-1)
    /// interleaved (each stage's ramp is P-1 chunk passes, each 1/v of a stage's pass), or
    /// (P-1)/(3M+P-1) for ZB-H1 with F = B = W, or (P-1)/(6M+P-1) for ZBV with every chunk
    /// pass as long (M >= 2P-1), or (P-1)/(3M+P-1) for DualPipeV with its pairs run one pass
    /// after the other (M >= 2P).
    pub fn formula_bubble(&self) -> f64 {
        let (p, v, m) = (self.stages.max(1) as f64, self.chunks.max(1) as f64, self.micro_batches.max(1) as f64);
        match self.kind {
            // (P-1)(F+B-W) idle against M(F+B+W) busy, F = B = W.
            PpSchedule::ZbH1 => (p - 1.0) / (3.0 * m + p - 1.0),
            // P-1 chunk passes idle against 2 chunks x 3 passes x M busy, F = B = W.
            PpSchedule::Zbv => (p - 1.0) / (6.0 * m + p - 1.0),
            // (P-1)(F&B + B - 3W) idle with F&B = F + B and B = B + W: 2(P-1) chunk passes.
            PpSchedule::DualPipeV => (p - 1.0) / (3.0 * m + p - 1.0),
            _ => (p - 1.0) / (v * m + p - 1.0),
        }
    }

    /// [`Self::formula_bubble`] in symbols.
    pub fn formula_name(&self) -> &'static str {
        match self.kind {
            PpSchedule::Interleaved => "(P-1)/(vM+P-1)",
            PpSchedule::ZbH1 => "(P-1)/(3M+P-1) (ZB-H1, F = B = W)",
            PpSchedule::Zbv => "(P-1)/(6M+P-1) (ZBV, F = B = W per chunk, M >= 2P-1)",
            PpSchedule::DualPipeV => {
                "(P-1)(F&B+B-3W): (P-1)/(3M+P-1) (DualPipeV, F&B = F+B, F = B = W per chunk, M >= 2P)"
            }
            _ => "(P-1)/(M+P-1)",
        }
    }
}

/// ZBV, stage `s` of `p`, `m` micro-batches; chunk 0 is the V's way down (model chunk s),
/// chunk 1 its way back (2p-1-s). PyTorch's `ScheduleZBVZeroBubble` order: 2(p-s)-1
/// forwards down; s pairs of forwards, back and down; p-s forwards back, each followed by
/// its B and W; then, while forwards remain, a forward down, the B and W of the oldest
/// micro-batch down, a forward back and the B and W of the oldest back; then the Bs owed,
/// the Ws after. Built for max(m, 2p-1) micro-batches, the passes of those beyond m left
/// out (their slots are idle).
fn zbv(p: usize, m: usize, s: usize) -> Vec<Action> {
    let n = m.max(2 * p - 1);
    let (f, b, w) = (
        |micro, chunk| Action::Forward { micro, chunk },
        |micro, chunk| Action::Backward { micro, chunk },
        |micro, chunk| Action::Weights { micro, chunk },
    );
    let mut out = Vec::new();
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    for _ in 0..2 * (p - s) - 1 {
        out.push(f(f0, 0));
        f0 += 1;
    }
    for _ in 0..s {
        out.extend([f(f1, 1), f(f0, 0)]);
        (f0, f1) = (f0 + 1, f1 + 1);
    }
    for _ in 0..p - s {
        out.extend([f(f1, 1), b(b1, 1), w(b1, 1)]);
        (f1, b1) = (f1 + 1, b1 + 1);
    }
    while f1 < f0 || f0 < n {
        if f0 < n {
            out.push(f(f0, 0));
            f0 += 1;
        }
        out.extend([b(b0, 0), w(b0, 0), f(f1, 1), b(b1, 1), w(b1, 1)]);
        (b0, f1, b1) = (b0 + 1, f1 + 1, b1 + 1);
    }
    let (mut w0, w1) = (b0, b1);
    for _ in 0..s {
        out.extend([b(b0, 0), b(b1, 1)]);
        (b0, b1) = (b0 + 1, b1 + 1);
    }
    for _ in 0..p - s {
        out.extend([b(b0, 0), w(w0, 0)]);
        (b0, w0) = (b0 + 1, w0 + 1);
    }
    out.extend((w1..b1).map(|micro| w(micro, 1)));
    out.extend((w0..b0).map(|micro| w(micro, 0)));
    out.retain(|a| a.micro() < m);
    out
}

/// DualPipeV, stage `s` of `p`, `m` micro-batches; chunk 0 the V's way down, chunk 1 its
/// way back. DeepSeek's `DualPipeV.step` in its eight phases (counts for stage s):
/// 2(p-s-1) forwards down; s+1 pairs of forwards, down and back; p-s-1 of B back, W, a
/// forward back; m-2p+s+1 of a forward down with a backward back and a forward back with
/// a backward down; p-s-1 of a backward back, a forward back and a backward down; s+1 of
/// a backward back and one down, the later half of them B only; p-s-1 of a W held back
/// and a B down; the s+1 Ws still owed. A whole backward is its B then its W; the Ws held
/// back run first in, first out. Built for max(m, 2p) micro-batches, the passes of those
/// beyond m left out.
fn dualpipev(p: usize, m: usize, s: usize) -> Vec<Action> {
    let n = m.max(2 * p);
    let mut run = DualPipeVStage::default();
    for _ in 0..2 * (p - s - 1) {
        run.forward(0);
    }
    for _ in 0..s + 1 {
        run.forward(0);
        run.forward(1);
    }
    for _ in 0..p - s - 1 {
        run.backward(1, true);
        run.weights();
        run.forward(1);
    }
    for _ in 0..n + s + 1 - 2 * p {
        run.forward(0);
        run.backward(1, false);
        run.forward(1);
        run.backward(0, false);
    }
    for _ in 0..p - s - 1 {
        run.backward(1, false);
        run.forward(1);
        run.backward(0, false);
    }
    // From the middle of these on the W waits (from the B back on odd stages, from the
    // B down on even ones).
    let pairs = s + 1;
    let half = pairs / 2;
    for i in 0..pairs {
        run.backward(1, i > half || (i == half && s % 2 == 1));
        run.backward(0, i >= half);
    }
    for _ in 0..p - s - 1 {
        run.weights();
        run.backward(0, true);
    }
    for _ in 0..s + 1 {
        run.weights();
    }
    debug_assert!(run.owed.is_empty());
    run.out.retain(|a| a.micro() < m);
    run.out
}

/// What [`dualpipev`] has laid out so far: each chunk's next forward and backward, and the
/// Ws held back in the order their Bs ran.
#[derive(Default)]
struct DualPipeVStage {
    out: Vec<Action>,
    forwards: [usize; 2],
    backwards: [usize; 2],
    owed: std::collections::VecDeque<Action>,
}

impl DualPipeVStage {
    fn forward(&mut self, chunk: usize) {
        self.out.push(Action::Forward { micro: self.forwards[chunk], chunk });
        self.forwards[chunk] += 1;
    }

    /// A B, and its W at once unless `hold_weights`.
    fn backward(&mut self, chunk: usize, hold_weights: bool) {
        let micro = self.backwards[chunk];
        self.out.push(Action::Backward { micro, chunk });
        let w = Action::Weights { micro, chunk };
        if hold_weights {
            self.owed.push_back(w);
        } else {
            self.out.push(w);
        }
        self.backwards[chunk] += 1;
    }

    fn weights(&mut self) {
        self.out.extend(self.owed.pop_front());
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

    /// Runs every stage's actions with sends that never wait and receives that do, each
    /// pair of stages joined by one first-in-first-out channel per direction (as the
    /// engine's links are): panics if a stage would take a message that is not the one its
    /// action needs, or if the step cannot finish. Returns the most chunk activations each
    /// stage held at once.
    fn run_over_fifo_channels(pipe: Pipeline) -> Vec<usize> {
        let p = pipe.stages;
        let orders: Vec<Vec<Action>> = (0..p).map(|s| pipe.actions(s)).collect();
        let mut channels = vec![vec![VecDeque::<Message>::new(); p]; p];
        let mut next = vec![0; p];
        let (mut held, mut most) = (vec![0; p], vec![0; p]);
        loop {
            let mut progressed = false;
            for s in 0..p {
                while let Some(&action) = orders[s].get(next[s]) {
                    if let Some((from, wanted)) = pipe.needs(s, action) {
                        // (a V: a link carries its activations and gradients interleaved;
                        // the receiver keeps what comes early, `held_early`)
                        let Some(i) = channels[from][s].iter().position(|&m| m == wanted) else { break };
                        assert!(i == 0 || pipe.kind.is_v(), "{pipe:?} stage {s}: link from {from} out of order");
                        channels[from][s].remove(i);
                    }
                    if let Some((to, message)) = pipe.sends(s, action) {
                        channels[s][to].push_back(message);
                    }
                    match action {
                        Forward { .. } => {
                            held[s] += 1;
                            most[s] = most[s].max(held[s]);
                        }
                        // (ZB-H1 and the V's keep the activations for the W)
                        Backward { .. } => held[s] -= usize::from(!pipe.splits_backward()),
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
        for p in 1..=4 {
            shapes.extend((1..=12).map(|m| pipe(PpSchedule::Zbv, p, 2, m)));
            shapes.extend((2 * p..=12).map(|m| pipe(PpSchedule::DualPipeV, p, 2, m)));
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

    /// A V's passes at `stage` written as in the module's diagrams.
    fn v_text(shape: Pipeline, stage: usize) -> String {
        let names: Vec<String> = shape
            .actions(stage)
            .into_iter()
            .map(|a| {
                let pass = match a {
                    Forward { .. } => 'F',
                    Backward { .. } => 'B',
                    Weights { .. } => 'W',
                };
                format!("{pass}{}{}", ['a', 'b'][a.chunk()], a.micro())
            })
            .collect();
        names.join(" ")
    }

    /// ZBV, P = 2, M = 4: PyTorch's ScheduleZBVZeroBubble order (the module's diagram).
    #[test]
    fn zbv_runs_pytorchs_order() {
        let text = |s| v_text(pipe(PpSchedule::Zbv, 2, 2, 4), s);
        assert_eq!(
            text(0),
            "Fa0 Fa1 Fa2 Fb0 Bb0 Wb0 Fb1 Bb1 Wb1 Fa3 Ba0 Wa0 Fb2 Bb2 Wb2 Ba1 Wa1 Fb3 Bb3 Wb3 Ba2 Wa2 Ba3 Wa3"
        );
        assert_eq!(
            text(1),
            "Fa0 Fb0 Fa1 Fb1 Bb0 Wb0 Fa2 Ba0 Wa0 Fb2 Bb1 Wb1 Fa3 Ba1 Wa1 Fb3 Bb2 Wb2 Ba2 Bb3 Ba3 Wa2 Wb3 Wa3"
        );
        // Stage 0 holds the embeddings (chunk 0) and the head (chunk 3); stage 1 turns the V.
        let v = pipe(PpSchedule::Zbv, 2, 2, 4);
        assert_eq!((v.model_chunk(0, 1), v.model_chunk(1, 0), v.model_chunk(1, 1)), (3, 1, 2));
        assert!(v.holds_embeddings(0) && v.holds_head(0) && !v.holds_head(1));
        assert_eq!((v.messages_per_micro_batch(0), v.messages_per_micro_batch(1)), (2, 2));
    }

    /// DualPipeV: the module's diagram (P = 2, M = 4), and stage 0 of DeepSeek's picture of
    /// it (P = 4, M = 10: README of deepseek-ai/DualPipe), with its holdings.
    #[test]
    fn dualpipev_runs_deepseeks_order() {
        let text = |s| v_text(pipe(PpSchedule::DualPipeV, 2, 2, 4), s);
        assert_eq!(
            text(0),
            "Fa0 Fa1 Fa2 Fb0 Bb0 Wb0 Fb1 Fa3 Bb1 Wb1 Fb2 Ba0 Wa0 Bb2 Wb2 Fb3 Ba1 Wa1 Bb3 Wb3 Ba2 Wa2 Ba3 Wa3"
        );
        assert_eq!(
            text(1),
            "Fa0 Fb0 Fa1 Fb1 Fa2 Bb0 Wb0 Fb2 Ba0 Wa0 Fa3 Bb1 Wb1 Fb3 Ba1 Wa1 Bb2 Wb2 Ba2 Wa2 Bb3 Ba3 Wb3 Wa3"
        );
        let big = pipe(PpSchedule::DualPipeV, 4, 2, 10);
        assert_eq!(
            v_text(big, 0),
            "Fa0 Fa1 Fa2 Fa3 Fa4 Fa5 Fa6 Fb0 Bb0 Wb0 Fb1 Bb1 Wb1 Fb2 Bb2 Wb2 Fb3 \
             Fa7 Bb3 Wb3 Fb4 Ba0 Wa0 Fa8 Bb4 Wb4 Fb5 Ba1 Wa1 Fa9 Bb5 Wb5 Fb6 Ba2 Wa2 \
             Bb6 Wb6 Fb7 Ba3 Wa3 Bb7 Wb7 Fb8 Ba4 Wa4 Bb8 Wb8 Fb9 Ba5 Wa5 \
             Bb9 Wb9 Ba6 Wa6 Ba7 Wa7 Ba8 Wa8 Ba9 Wa9"
        );
        // The last stage turns the V with no warm-up down: F a, F b in pairs.
        assert!(v_text(big, 3).starts_with("Fa0 Fb0 Fa1 Fb1 Fa2 Fb2 Fa3 Fb3 Fa4 Bb0 Wb0"));
        // Every stage holds 2P+1 chunk activations at once (DeepSeek's PP+1 with PP = 2P
        // chunk stages), one more than ZBV; the formula's bubble is ZB-H1's, twice ZBV's.
        let zbv = pipe(PpSchedule::Zbv, 4, 2, 10);
        assert!((0..4).all(|s| big.activations_in_flight(s) == 9 && zbv.activations_in_flight(s) == 8));
        let m8 = pipe(PpSchedule::DualPipeV, 4, 2, 8);
        assert!((m8.formula_bubble() - 3.0 / 27.0).abs() < 1e-12);
    }

    /// Only a V's links deliver messages before they are wanted (and its last stage hands
    /// the V's turn to itself); the others' order on every link is the receiver's.
    #[test]
    fn only_the_v_holds_messages_that_came_early() {
        for shape in shapes() {
            let early: Vec<usize> = (0..shape.stages).map(|s| shape.follow_held_early(s)).collect();
            match shape.kind {
                kind if kind.is_v() && shape.stages > 1 => {
                    assert_eq!(early[0], 0, "{shape:?}: the first stage hears only from the second");
                    assert!(early[shape.stages - 1] >= 1, "{shape:?}: the turn of the V");
                }
                kind if kind.is_v() => {}
                _ => assert!(early.iter().all(|&e| e == 0), "{shape:?}: {early:?}"),
            }
        }
        let v = pipe(PpSchedule::Zbv, 4, 2, 8);
        assert_eq!((0..4).map(|s| v.held_early(s)).collect::<Vec<_>>(), vec![0, 1, 1, 2]);
        assert_eq!(
            v.messages(3, &v.actions(3), 3).len(),
            2 * 8,
            "the turn: an activation and a gradient per micro-batch"
        );
    }
}
