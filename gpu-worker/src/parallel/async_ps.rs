//! Asynchronous SGD with one parameter server (the Downpour SGD of Dean et al. 2012, on
//! one server). Data-parallel rank 0 keeps the server beside its own training loop: the
//! fp32 parameters θ, the optimizer's state and a version counter. Every rank, rank 0's
//! own loop among them, trains on its slice of each step's batch without waiting for the
//! others; after each backward it
//!
//!   pushes  g_r, computed on θ of version v_r                 P floats to the server
//!   waits   θ ← AdamW/SGD(θ, g_r); version += 1               on the server, in arrival order
//!   pulls   θ and its version                                 P floats back
//!
//! and the server records the gradient's staleness, version - v_r before it applies it:
//! how many other gradients reached θ between this one's pull and its push. Nobody waits
//! for a slow worker, and a gradient may be stale: the price the texts name. Each worker's
//! push and pull cross the server's link, 2 (W-1) P floats per round where a ring all-reduce
//! sends 2 (W-1)/W P from every rank: the bottleneck the ring removed.
//!
//! A worker's gradient is its own mean over its tokens (the model weights each token by one
//! over the global batch's, so the push scales it by W), and its gradient norm and loss are
//! its own: async ranks never meet in a collective. At the end every worker says it is done
//! and rank 0 waits for them, then takes the server's final θ as its parameters (the model
//! a run exports).

use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use distlab_common::trace::{AppliedGradient, Span};
use distlab_common::{ExperimentSpec, Optimizer as OptimizerKind};

use super::{host_category, load_params, params_f32, SavedState, StateView, Strategy, TrainBackend};
use crate::backend::Stored;
use crate::comm::{CommError, Communicator};
use crate::error::TrainError;
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::{FlatState, ModelState, ParamLayout, Stage};
use crate::offload::OffloadError;
use crate::ops::optimizer::{AdamWStep, HostOptimizerBuffers, OptimizerSlices, Update};
use crate::optim::{OptimGroup, ADAM_BETA1, ADAM_BETA2, ADAM_EPS};
use crate::trace::{blocking_comm_span, now_us};

/// The floats of a push's header: what it is, the version its gradient was computed on,
/// and the worker's lr and gradient scale (each f64 as two f32 bit patterns).
const HEADER: usize = 6;
const PUSH: u32 = 1;
const DONE: u32 = 0;
/// The server's and the worker's places in their two-rank group.
const SERVER: usize = 0;
const WORKER: usize = 1;

/// This rank's links to the server: rank 0 keeps it (and a link to every other worker),
/// every other rank has one link to rank 0.
pub enum ServerLinks {
    /// Data-parallel rank 0: a two-rank group with each other worker (the server is 0 in it).
    Server(Vec<Box<dyn Communicator>>),
    /// Any other rank: its two-rank group with rank 0 (the worker is 1 in it).
    Worker(Box<dyn Communicator>),
}

/// What a push carries besides the gradient.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Push {
    version: u64,
    lr: f64,
    grad_scale: f64,
}

impl Push {
    fn encode(&self) -> [f32; HEADER] {
        let bits = |x: f64| {
            let b = x.to_bits();
            [f32::from_bits((b >> 32) as u32), f32::from_bits(b as u32)]
        };
        let [lr_hi, lr_lo] = bits(self.lr);
        let [scale_hi, scale_lo] = bits(self.grad_scale);
        [f32::from_bits(PUSH), f32::from_bits(self.version as u32), lr_hi, lr_lo, scale_hi, scale_lo]
    }

    /// The push a header says, or None for a worker's last word.
    fn decode(h: &[f32; HEADER]) -> Option<Push> {
        let f64_of = |hi: f32, lo: f32| f64::from_bits((u64::from(hi.to_bits()) << 32) | u64::from(lo.to_bits()));
        (h[0].to_bits() == PUSH).then(|| Push {
            version: u64::from(h[1].to_bits()),
            lr: f64_of(h[2], h[3]),
            grad_scale: f64_of(h[4], h[5]),
        })
    }

    fn done() -> [f32; HEADER] {
        [f32::from_bits(DONE), 0.0, 0.0, 0.0, 0.0, 0.0]
    }
}

/// The server's state: θ, the optimizer's, the version, and every gradient it applied.
struct Server {
    theta: Vec<f32>,
    optimizer: HostOptimizerBuffers<f32>,
    groups: Vec<OptimGroup>,
    kind: OptimizerKind,
    weight_decay: f64,
    version: u64,
    applied: Vec<AppliedGradient>,
}

impl Server {
    /// θ ← the optimizer's step on `grads` (a worker's, pushed as `push` says).
    fn apply(&mut self, worker: usize, push: Push, grads: &[f32]) {
        let staleness = self.version.saturating_sub(push.version);
        self.version += 1;
        for g in &self.groups {
            let weight_decay = if g.decay { self.weight_decay } else { 0.0 };
            let (lr, grad_scale) = (push.lr, push.grad_scale);
            let update = match self.kind {
                OptimizerKind::Sgd | OptimizerKind::Lars => Update::Sgd { lr, weight_decay, grad_scale },
                OptimizerKind::Adamw | OptimizerKind::Lamb => Update::AdamW(AdamWStep {
                    lr,
                    beta1: ADAM_BETA1,
                    beta2: ADAM_BETA2,
                    eps: ADAM_EPS,
                    weight_decay,
                    step: self.version,
                    grad_scale,
                }),
            };
            let r = g.local.clone();
            self.optimizer.update(&mut self.theta[r.clone()], &grads[r.clone()], r, &update);
        }
        self.applied.push(AppliedGradient { worker: worker as u32, staleness: staleness as u32 });
    }
}

fn lock(server: &Mutex<Server>) -> MutexGuard<'_, Server> {
    server.lock().unwrap_or_else(|e| e.into_inner())
}

/// Serves worker `worker` over `comm` (the server 0, the worker 1) until it says it is done:
/// each push applied in turn with the others', θ sent back while no other push changes it.
fn serve(
    server: &Mutex<Server>,
    comm: &mut dyn Communicator,
    worker: usize,
    grads: &mut [f32],
) -> Result<(), CommError> {
    let mut header = [0.0f32; HEADER];
    loop {
        comm.recv(&mut header, WORKER)?;
        let Some(push) = Push::decode(&header) else { return Ok(()) };
        comm.recv(grads, WORKER)?;
        let mut s = lock(server);
        s.apply(worker, push, grads);
        comm.send(&[f32::from_bits(s.version as u32)], WORKER)?;
        comm.send(&s.theta, WORKER)?;
    }
}

/// Where this rank's pushes go.
enum Role {
    /// Rank 0: the server itself, and a thread serving each other worker.
    Server {
        server: Arc<Mutex<Server>>,
        threads: Vec<JoinHandle<Result<(), CommError>>>,
    },
    Worker(Box<dyn Communicator>),
}

/// A worker of the parameter server (rank 0 also keeps the server).
pub struct AsyncPs<B: TrainBackend> {
    state: FlatState<B>,
    role: Role,
    workers: usize,
    /// The version of θ this rank's parameters are.
    version: u64,
    /// The gradient as it goes out and θ as it comes back, fp32 on the host.
    outgoing: Vec<f32>,
    incoming: Vec<f32>,
    layout: ParamLayout,
    step: u64,
    record: bool,
    spans: Vec<Span>,
    /// Bytes this rank sent to or for the server.
    sent: u64,
    _receipts: Vec<Receipt>,
}

impl<B: TrainBackend> AsyncPs<B> {
    pub fn new(
        spec: &ExperimentSpec,
        be: &B,
        layout: &ParamLayout,
        stage: &Stage,
        memory: &Arc<MemoryTracker>,
        workers: usize,
        links: ServerLinks,
    ) -> Result<Self, TrainError> {
        let range = stage.range(layout);
        let len = range.len();
        let seed = spec.train.seed;
        let state = FlatState::for_range(be, layout, range.clone(), seed);
        let comm_category = host_category(be, Category::CommBuffers);
        let mut receipts = vec![
            memory.alloc_of::<B::Elem>(Category::Parameters, len),
            memory.alloc_of::<B::Elem>(Category::Gradients, len),
            memory.alloc(comm_category, 2 * len),
        ];
        let role = match links {
            ServerLinks::Worker(comm) => Role::Worker(comm),
            ServerLinks::Server(links) => {
                let t = &spec.train;
                let moments = t.optimizer.keeps_moments();
                let theta = layout.init_params_range::<f32>(seed, range.clone());
                let optimizer = HostOptimizerBuffers::new::<f32>(len, moments, Vec::new);
                // θ and the moments; each other worker's gradient as it arrives.
                let state_floats = len * (1 + 2 * moments as usize);
                receipts.push(memory.alloc(host_category(be, Category::OptimizerState), state_floats));
                receipts.push(memory.alloc(comm_category, links.len() * len));
                let groups = OptimGroup::unsharded(&layout.param_groups_in(&range, false));
                let server = Server {
                    theta,
                    optimizer,
                    groups,
                    kind: t.optimizer,
                    weight_decay: t.weight_decay,
                    version: 0,
                    applied: Vec::new(),
                };
                let server = Arc::new(Mutex::new(server));
                let threads = links
                    .into_iter()
                    .enumerate()
                    .map(|(i, mut comm)| {
                        let server = server.clone();
                        std::thread::Builder::new()
                            .name(format!("distlab-ps-{}", i + 1))
                            .spawn(move || {
                                crate::trace::count_this_thread_as_training();
                                serve(&server, comm.as_mut(), i + 1, &mut vec![0.0; len])
                            })
                            .map_err(|e| TrainError::Unsupported(format!("cannot start the server's thread: {e}")))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Role::Server { server, threads }
            }
        };
        Ok(Self {
            state,
            role,
            workers,
            version: 0,
            outgoing: vec![0.0; len],
            incoming: vec![0.0; len],
            layout: layout.clone(),
            step: 0,
            record: false,
            spans: Vec::new(),
            sent: 0,
            _receipts: receipts,
        })
    }

    /// Pushes the gradient (in `outgoing`) and pulls θ (into `incoming`); returns θ's version.
    fn push_and_pull(&mut self, push: Push) -> Result<u64, CommError> {
        match &mut self.role {
            Role::Server { server, .. } => {
                let mut s = lock(server);
                s.apply(0, push, &self.outgoing);
                self.incoming.copy_from_slice(&s.theta);
                Ok(s.version)
            }
            Role::Worker(comm) => {
                let before = comm.bytes_sent();
                comm.send(&push.encode(), SERVER)?;
                comm.send(&self.outgoing, SERVER)?;
                let mut version = [0.0f32];
                comm.recv(&mut version, SERVER)?;
                comm.recv(&mut self.incoming, SERVER)?;
                self.sent += comm.bytes_sent() - before;
                Ok(u64::from(version[0].to_bits()))
            }
        }
    }
}

impl<B: TrainBackend> Strategy<B> for AsyncPs<B> {
    fn begin_step(&mut self, be: &B, step: u64, record: bool) -> Result<(), TrainError> {
        self.state.zero_grads(be);
        (self.step, self.record) = (step, record);
        Ok(())
    }

    fn state(&mut self, _last: bool) -> &mut dyn ModelState<B> {
        &mut self.state
    }

    /// This rank's own gradient (its tokens' mean is W times what backward summed).
    fn reduce_gradients(&mut self, be: &B) -> Result<f64, CommError> {
        let w = self.workers as f64;
        let grads = &self.state.grads;
        Ok(self.layout.grad_squares(be, grads, 0..be.buf_len(grads), 0) * w * w)
    }

    fn update(&mut self, be: &B, lr: f64, grad_scale: f64) -> Result<(), TrainError> {
        let outgoing = &mut self.outgoing;
        be.read_host(be.all(&self.state.grads), |g| {
            for (o, x) in outgoing.iter_mut().zip(g) {
                *o = x.load();
            }
        });
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.sent);
        let push = Push { version: self.version, lr, grad_scale: grad_scale * self.workers as f64 };
        self.version = self.push_and_pull(push)?;
        if self.record {
            let name = "push gradient, pull parameters (parameter server)";
            self.spans.push(blocking_comm_span(name, self.step, start, self.sent - sent_before));
        }
        let incoming = &self.incoming;
        be.on_host(be.all_mut(&mut self.state.params), |p| {
            for (x, &t) in p.iter_mut().zip(incoming) {
                *x = B::Elem::store(t);
            }
        });
        Ok(())
    }

    /// A rank's own value stands for the group's: async ranks never meet in a collective.
    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError> {
        Ok(value * self.workers as f64)
    }

    fn comm_spans(&self) -> Vec<Span> {
        self.spans.clone()
    }

    /// Rank 0: every gradient the server applied, with its staleness.
    fn applied_gradients(&self) -> Vec<AppliedGradient> {
        match &self.role {
            Role::Server { server, .. } => lock(server).applied.clone(),
            Role::Worker(_) => Vec::new(),
        }
    }

    fn held_bytes(&self, be: &B) -> u64 {
        let flat = (be.buf_len(&self.state.params) + be.buf_len(&self.state.grads)) * size_of::<B::Elem>();
        // (the server's state, and a receive buffer for each other worker's gradient)
        let server = match &self.role {
            Role::Server { server, .. } => {
                let s = lock(server);
                s.theta.len() + s.optimizer.m.len() + s.optimizer.v.len() + (self.workers - 1) * s.theta.len()
            }
            Role::Worker(_) => 0,
        };
        let host = server + self.outgoing.len() + self.incoming.len();
        flat as u64 + if be.buffers_on_host() { host as u64 * 4 } else { 0 }
    }

    /// Rank 0 shows the server's θ and optimizer (after `end`, the run's final ones);
    /// another rank its own parameters, which rank 0's stand for.
    fn view_state(&self, be: &B, f: &mut dyn FnMut(StateView<'_>)) -> Result<(), OffloadError> {
        match &self.role {
            Role::Server { server, .. } => {
                let s = lock(server);
                let optimizer = OptimizerSlices { m: &s.optimizer.m, v: &s.optimizer.v, master: None };
                f(StateView {
                    params: std::borrow::Cow::Borrowed(&s.theta),
                    optimizer,
                    optimizer_steps: s.version,
                    params_replicated: true,
                    optimizer_replicated: true,
                    local: Vec::new(),
                });
            }
            Role::Worker(_) => be.read_host(be.all(&self.state.params), |params| {
                f(StateView {
                    params: params_f32(params),
                    optimizer: OptimizerSlices { m: &[], v: &[], master: None },
                    optimizer_steps: self.version,
                    params_replicated: true,
                    optimizer_replicated: true,
                    local: Vec::new(),
                })
            }),
        }
        Ok(())
    }

    /// (checkpoints are refused: a run never resumes)
    fn load(&mut self, be: &B, state: SavedState) -> Result<(), String> {
        be.on_host(be.all_mut(&mut self.state.params), |params| load_params(params, state.params))
    }

    /// A worker says it is done; rank 0 waits for every worker to, then takes the server's
    /// final θ, and says what the server applied.
    fn end(&mut self, be: &B) -> Result<Option<String>, TrainError> {
        match &mut self.role {
            Role::Worker(comm) => {
                comm.send(&Push::done(), SERVER)?;
                Ok(None)
            }
            Role::Server { server, threads } => {
                for thread in threads.drain(..) {
                    thread.join().map_err(|_| TrainError::Unsupported("the server's thread panicked".into()))??;
                }
                let s = lock(server);
                let theta = &s.theta;
                be.on_host(be.all_mut(&mut self.state.params), |p| {
                    for (x, &t) in p.iter_mut().zip(theta) {
                        *x = B::Elem::store(t);
                    }
                });
                Ok(Some(staleness_line(&s.applied, self.workers)))
            }
        }
    }
}

/// "the server applied 24 gradients from 4 workers; staleness 0: 6, 1: 10, 2: 8 (mean 1.08)".
pub fn staleness_line(applied: &[AppliedGradient], workers: usize) -> String {
    let most = applied.iter().map(|a| a.staleness).max().unwrap_or(0) as usize;
    let mut counts = vec![0usize; most + 1];
    for a in applied {
        counts[a.staleness as usize] += 1;
    }
    let mean = applied.iter().map(|a| a.staleness as f64).sum::<f64>() / applied.len().max(1) as f64;
    let counts: Vec<String> =
        counts.iter().enumerate().filter(|(_, &n)| n > 0).map(|(s, n)| format!("{s}: {n}")).collect();
    format!(
        "asynchronous SGD: the server applied {} gradients from {workers} workers; staleness {} (mean {mean:.2})",
        applied.len(),
        counts.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_header_carries_its_numbers_exactly() {
        let push = Push { version: 123_456, lr: 3e-4 * 0.7, grad_scale: 4.0 / 3.0 };
        assert_eq!(Push::decode(&push.encode()), Some(push));
        assert_eq!(Push::decode(&Push::done()), None);
    }

    #[test]
    fn the_staleness_line_counts_every_gradient() {
        let applied = [(0, 0), (1, 1), (2, 1), (0, 2)].map(|(worker, staleness)| AppliedGradient { worker, staleness });
        assert_eq!(
            staleness_line(&applied, 3),
            "asynchronous SGD: the server applied 4 gradients from 3 workers; staleness 0: 1, 1: 2, 2: 1 (mean 1.00)"
        );
    }
}
