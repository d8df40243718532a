//! Pipeline parallelism: the model's blocks are cut into P contiguous stages (embeddings
//! on the first, final LayerNorm + LM head + loss on the last), one per rank of the
//! pipeline group; a step's micro-batches flow through them in the order a schedule
//! (`distlab_common::schedule`: GPipe, 1F1B, interleaved, ZB-H1 or ZBV) gives. Between neighbours only
//! activations go forward and their gradients go back, point to point.
//!
//! Stages get equal numbers of blocks (`chunk_range`, as the planner assumes); the
//! embeddings and the head are small next to a block at the sizes this lab runs. The
//! interleaved schedule cuts the blocks into P*v chunks instead and gives stage s chunks
//! s, s+P, ...: a micro-batch goes round the stages v times, and the last stage's chunk
//! hands on to the first stage's next one.
//!
//! [`run_step`] is one stage's step: the schedule's actions in order, each forward's input
//! received from the previous stage and its output sent to the next, each backward's output
//! gradient received from the next stage and its input gradient sent back. What a pass
//! computes is the trainer's business ([`StageWork`]).
//!
//! ZBV lays 2P chunks out in a V: stage s holds chunk s on the way down and 2P-1-s on the
//! way back, so the first stage holds the embeddings and the head, and the last hands its
//! first chunk's output to its own second chunk (kept, not sent).
//!
//! Sends do not wait for the receiver: each is queued to a sender thread (like NCCL's
//! asynchronous isend). A blocking send could deadlock 1F1B: stage s sending an
//! activation to s+1 while s+1 sends a gradient back to s, both waiting for the other to
//! receive. Receives block (the schedule needs the data to go on). A link delivers in its
//! sender's order, which every stage knows from the schedule: in a V a link carries
//! activations and gradients interleaved, and a stage waiting for one keeps those that
//! come before it ([`Pipeline::held_early`] of them at most).

use std::collections::VecDeque;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use distlab_common::trace::{Span, SpanKind};

use super::schedule::{Action, Message, Pipeline};
use super::TrainBackend;
use crate::backend::Stored;
use crate::comm::{CommError, Communicator};
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::Stage;
use crate::trace::now_us;

/// Which blocks stage `stage` of `pipe` runs (of a model of `layers` blocks), and where
/// every unit sits in the parameter buffer: stage after stage, each stage's units side by
/// side (its embeddings, its chunks' blocks, its head).
pub fn stage_of(pipe: &Pipeline, layers: usize, stage: usize) -> Stage {
    let of = |s: usize| Stage {
        chunks: pipe.blocks_of(layers, s),
        first: pipe.holds_embeddings(s),
        last: pipe.holds_head(s),
        unit_order: Vec::new(),
    };
    let unit_order = (0..pipe.stages).flat_map(|s| of(s).units()).collect();
    Stage { unit_order, ..of(stage) }
}

/// This rank's place in its pipeline group: two communicators over the same ranks, one
/// for the sender thread and one for receiving and the group's collectives.
pub struct PipelineGroup {
    pub stage: usize,
    pub stages: usize,
    pub send: Box<dyn Communicator>,
    pub recv: Box<dyn Communicator>,
}

/// A queued send: the data (a copy, held until it is written) and the peer's stage.
struct Outgoing {
    data: Vec<f32>,
    to: usize,
    _receipt: Receipt,
}

enum Job {
    Send(Outgoing),
    /// Answer on the channel once every earlier send is written.
    Flush(mpsc::Sender<Result<(), CommError>>),
}

/// Links of one stage to its neighbours, and the buffers it receives into.
pub struct PipelineLinks<S> {
    pub stage: usize,
    pub stages: usize,
    /// The input activation (all but the first stage; interleaved: every stage).
    activation: Vec<S>,
    /// The gradient of the stage's output (all but the last; interleaved: every stage).
    output_grad: Vec<S>,
    _received: Vec<Receipt>,
    /// Messages that came before the pass that needs them, and (the V's turn) those the
    /// stage handed itself, each in a buffer of its own.
    early: Vec<(Message, Vec<S>, Receipt)>,
    /// For every other stage, the messages its link brings next, in its order.
    coming: Vec<VecDeque<Message>>,
    /// Elements of every message, activation or gradient: one stage output.
    message_len: usize,
    recv: Box<dyn Communicator>,
    jobs: Option<mpsc::Sender<Job>>,
    sender: Option<JoinHandle<()>>,
    memory: Arc<MemoryTracker>,
}

impl<S: Stored<Acc = f32>> PipelineLinks<S> {
    /// Links for `group`, receiving activations of `activation` elements (and their
    /// gradients) as `pipe`'s chunks on this stage need them.
    pub fn new(group: PipelineGroup, pipe: &Pipeline, activation: usize, memory: &Arc<MemoryTracker>) -> Self {
        let (jobs, inbox) = mpsc::channel::<Job>();
        let mut comm = group.send;
        let sender = std::thread::Builder::new()
            .name("pp-send".into())
            .spawn(move || {
                let mut failed: Option<CommError> = None;
                for job in inbox {
                    match job {
                        Job::Send(out) if failed.is_none() => {
                            if let Err(e) = comm.send(&out.data, out.to) {
                                failed = Some(e);
                            }
                        }
                        Job::Send(_) => {}
                        Job::Flush(reply) => {
                            let _ = reply.send(match failed.take() {
                                Some(e) => Err(e),
                                None => Ok(()),
                            });
                        }
                    }
                }
            })
            .expect("spawn the pipeline sender thread");
        let (gets_activations, gets_gradients) = pipe.receives(group.stage);
        let input = if gets_activations { activation } else { 0 };
        let output_grad = if gets_gradients { activation } else { 0 };
        let received = [input, output_grad]
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| memory.alloc_of::<S>(Category::CommBuffers, n))
            .collect();
        PipelineLinks {
            stage: group.stage,
            stages: group.stages,
            activation: vec![S::default(); input],
            output_grad: vec![S::default(); output_grad],
            _received: received,
            early: Vec::new(),
            coming: vec![VecDeque::new(); group.stages],
            message_len: activation,
            recv: group.recv,
            jobs: Some(jobs),
            sender: Some(sender),
            memory: memory.clone(),
        }
    }

    /// Expects the step whose stages run `orders` (each stage's passes in order): each
    /// link will bring what its stage sends this one, in that stage's order.
    fn expect(&mut self, pipe: &Pipeline, orders: &[Vec<Action>]) {
        for (from, order) in orders.iter().enumerate().filter(|&(from, _)| from != self.stage) {
            self.coming[from] = pipe.messages(from, order, self.stage).into();
        }
    }

    /// Sends `message` (`data`) to stage `to` (the next or previous stage; interleaved, the
    /// last stage's next is the first; in a V's turn, this stage itself, which keeps it)
    /// and returns at once. Activations travel as f32 (bf16/fp16 ones widened exactly,
    /// and rounded back on arrival).
    pub fn send(&mut self, data: &[S], to: usize, message: Message) {
        if to == self.stage {
            let receipt = self.memory.alloc_of::<S>(Category::CommBuffers, data.len());
            self.early.push((message, data.to_vec(), receipt));
            return;
        }
        let data: Vec<f32> = data.iter().map(|x| x.load()).collect();
        let receipt = self.memory.alloc(Category::CommBuffers, data.len());
        let out = Outgoing { data, to, _receipt: receipt };
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Send(out));
        }
    }

    /// Receives `wanted` (an input activation or the gradient of an output) from stage
    /// `from`: kept already, or read off the link, keeping what comes before it.
    fn recv(&mut self, from: usize, wanted: Message) -> Result<&[S], CommError> {
        let buf = match wanted {
            Message::Activation { .. } => &mut self.activation,
            Message::Gradient { .. } => &mut self.output_grad,
        };
        if let Some(i) = self.early.iter().position(|(m, ..)| *m == wanted) {
            let (_, data, _receipt) = self.early.swap_remove(i);
            *buf = data;
            return Ok(buf);
        }
        loop {
            let next = self.coming[from].pop_front().ok_or_else(|| CommError::BadBuffer {
                collective: "pipeline receive".into(),
                detail: format!("stage {from} sends nothing more this step, and {wanted:?} has not come"),
            })?;
            let comm = &mut self.recv;
            if next == wanted {
                super::collective_f32(&self.memory, buf, |b| comm.recv(b, from))?;
                return Ok(buf);
            }
            let len = self.message_len;
            let receipt = self.memory.alloc_of::<S>(Category::CommBuffers, len);
            let mut early = vec![S::default(); len];
            super::collective_f32(&self.memory, &mut early, |b| comm.recv(b, from))?;
            self.early.push((next, early, receipt));
        }
    }

    /// Bytes of the buffers it receives into.
    pub fn held_bytes(&self) -> u64 {
        ((self.activation.len() + self.output_grad.len()) * size_of::<S>()) as u64
    }

    /// Waits until every queued send is written (before the group's collectives, which
    /// use the same pipes, and at the end of a step).
    pub fn flush(&mut self) -> Result<(), CommError> {
        let (reply, answer) = mpsc::channel();
        let gone =
            || CommError::BadBuffer { collective: "pipeline send".into(), detail: "the sender thread stopped".into() };
        self.jobs.as_ref().ok_or_else(gone)?.send(Job::Flush(reply)).map_err(|_| gone())?;
        answer.recv().map_err(|_| gone())?
    }

    /// Sums `value` over the pipeline group (the loss lives on the last stage, each stage
    /// has its own part of the gradient norm).
    pub fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError> {
        self.flush()?;
        crate::comm::sum_scalar(self.recv.as_mut(), value)
    }
}

impl<S> Drop for PipelineLinks<S> {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.sender.take() {
            let _ = t.join();
        }
    }
}

/// What one stage computes for a micro-batch (the trainer implements it with its model,
/// strategy and data). `chunk` is which of the stage's chunks runs (0 but interleaved and ZBV).
pub trait StageWork<B: TrainBackend> {
    type Error: From<CommError>;
    /// Forward of micro-batch `micro` through `chunk`: from its tokens where the chunk
    /// starts the model, from `input` (the previous chunk's output) elsewhere. Returns the
    /// sum of its tokens' losses where the chunk ends the model, 0 elsewhere.
    fn forward(&mut self, be: &B, chunk: usize, micro: usize, input: Option<&[B::Elem]>) -> Result<f64, Self::Error>;
    /// Backward of micro-batch `micro` through `chunk`: from its loss where the chunk ends
    /// the model, from `output_grad` (the next chunk's input gradient) elsewhere. `last`:
    /// the chunk's last backward of the step (its gradients are complete after it).
    fn backward(
        &mut self,
        be: &B,
        chunk: usize,
        micro: usize,
        output_grad: Option<&[B::Elem]>,
        last: bool,
    ) -> Result<(), Self::Error>;
    /// The W (ZB-H1, ZBV) of micro-batch `micro` through `chunk` (after its B). `last`: the chunk's
    /// last W of the step.
    fn weights(&mut self, be: &B, chunk: usize, micro: usize, last: bool) -> Result<(), Self::Error>;
    /// What the forward of `micro` through `chunk` produced, read on the host.
    fn read_output(&self, be: &B, chunk: usize, micro: usize, f: &mut dyn FnMut(&[B::Elem]));
    /// What the last backward produced for the previous chunk (its input's gradient).
    fn read_input_grad(&self, be: &B, f: &mut dyn FnMut(&[B::Elem]));
    /// This stage waited from `start_us` to `end_us` for stage `neighbour` (the bubble).
    fn waited(&mut self, neighbour: usize, start_us: u64, end_us: u64);
}

/// One step of one stage: its passes in `orders` (every stage's, in order: `pipe`'s
/// schedule, or an evaluation's forwards) run by `work`, with the activations and their
/// gradients passed over `links` (None: the only stage). With `record`, the device is
/// synchronised before each wait so that a wait is a wait. Returns the sum of the losses
/// this stage computed.
pub fn run_step<B: TrainBackend, W: StageWork<B>>(
    be: &B,
    mut links: Option<&mut PipelineLinks<B::Elem>>,
    pipe: &Pipeline,
    orders: &[Vec<Action>],
    work: &mut W,
    record: bool,
) -> Result<f64, W::Error> {
    let stage = links.as_ref().map_or(0, |l| l.stage);
    if let Some(links) = links.as_deref_mut() {
        links.expect(pipe, orders);
    }
    let actions = &orders[stage];
    // Where each chunk's gradients are complete: its last backward of the step (split: its
    // last B for the embeddings, its last W for the rest).
    let (mut last_backward, mut last_weights) = (vec![None; pipe.chunks], vec![None; pipe.chunks]);
    for (index, action) in actions.iter().enumerate() {
        match action {
            Action::Backward { chunk, .. } => last_backward[*chunk] = Some(index),
            Action::Weights { chunk, .. } => last_weights[*chunk] = Some(index),
            Action::Forward { .. } => {}
        }
    }
    let mut loss_sum = 0.0;
    for (index, &action) in actions.iter().enumerate() {
        if record {
            be.synchronize();
        }
        let (chunk, micro) = (action.chunk(), action.micro());
        // What this action needs from a neighbour (the wait is the pipeline's bubble), and
        // what it hands on.
        let (needs, sends) = (pipe.needs(stage, action), pipe.sends(stage, action));
        let wait_start = now_us();
        let received = match (needs, links.as_deref_mut()) {
            (Some((from, wanted)), Some(links)) => Some(links.recv(from, wanted)?),
            _ => None,
        };
        let waited_until = now_us();
        // (the V's turn on the last stage waits for nobody)
        let waited_for = needs.map(|(from, _)| from).filter(|&from| from != stage);
        if let (true, Some(from)) = (record, waited_for.filter(|_| received.is_some() && waited_until > wait_start)) {
            work.waited(from, wait_start, waited_until);
        }
        match action {
            Action::Forward { .. } => {
                loss_sum += work.forward(be, chunk, micro, received)?;
                if let (Some(links), Some((to, message))) = (links.as_deref_mut(), sends) {
                    work.read_output(be, chunk, micro, &mut |out| links.send(out, to, message));
                }
            }
            Action::Backward { .. } => {
                work.backward(be, chunk, micro, received, Some(index) == last_backward[chunk])?;
                if let (Some(links), Some((to, message))) = (links.as_deref_mut(), sends) {
                    work.read_input_grad(be, &mut |grad| links.send(grad, to, message));
                }
            }
            Action::Weights { .. } => work.weights(be, chunk, micro, Some(index) == last_weights[chunk])?,
        }
    }
    if let Some(links) = links {
        debug_assert!(
            links.early.is_empty() && links.coming.iter().all(VecDeque::is_empty),
            "stage {stage}: messages left over at the end of the step"
        );
    }
    Ok(loss_sum)
}

/// A span of the compute lane for a pass of micro-batch `micro` (through `chunk` where a
/// stage has several), from `start_us` to now.
pub fn pass_span(kind: SpanKind, micro: usize, chunk: Option<usize>, step: u64, start_us: u64) -> Span {
    Span {
        kind,
        name: distlab_common::pipeline::pass_name(kind, micro, chunk),
        step,
        lane: "compute".into(),
        start_us,
        end_us: now_us(),
        layer: None,
        bucket: None,
        bytes: None,
        micro: Some(micro as u32),
        chunk: chunk.map(|c| c as u32),
    }
}
