//! Pipeline parallelism: the model's blocks are cut into P contiguous stages (embeddings
//! on the first, final LayerNorm + LM head + loss on the last), one per rank of the
//! pipeline group; a step's micro-batches flow through them in the order a schedule
//! (`schedule.rs`: GPipe or 1F1B) gives. Between neighbours only activations go forward
//! and their gradients go back, point to point.
//!
//! Stages get equal numbers of blocks (`chunk_range`, as the planner assumes); the
//! embeddings and the head are small next to a block at the sizes this lab runs.
//!
//! Sends do not wait for the receiver: each is queued to a sender thread (like NCCL's
//! asynchronous isend). A blocking send could deadlock 1F1B: stage s sending an
//! activation to s+1 while s+1 sends a gradient back to s, both waiting for the other to
//! receive. Receives block (the schedule needs the data to go on).

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;

use crate::backend::Stored;
use crate::comm::{chunk_range, CommError, Communicator};
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::Stage;

/// Which blocks stage `stage` of `stages` runs.
pub fn stage_of(layers: usize, stages: usize, stage: usize) -> Stage {
    Stage { blocks: chunk_range(layers, stages, stage), first: stage == 0, last: stage + 1 == stages }
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

/// Links of one stage to its neighbours.
pub struct PipelineLinks {
    pub stage: usize,
    pub stages: usize,
    recv: Box<dyn Communicator>,
    jobs: Option<mpsc::Sender<Job>>,
    sender: Option<JoinHandle<()>>,
    memory: Arc<MemoryTracker>,
}

impl PipelineLinks {
    pub fn new(group: PipelineGroup, memory: &Arc<MemoryTracker>) -> Self {
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
        PipelineLinks {
            stage: group.stage,
            stages: group.stages,
            recv: group.recv,
            jobs: Some(jobs),
            sender: Some(sender),
            memory: memory.clone(),
        }
    }

    /// Queues `data` for stage `to` (a neighbour) and returns at once. Activations travel
    /// as f32 (bf16/fp16 ones widened exactly, and rounded back on arrival).
    pub fn send<S: Stored<Acc = f32>>(&mut self, data: &[S], to: usize) {
        let data: Vec<f32> = data.iter().map(|x| x.load()).collect();
        let receipt = self.memory.alloc(Category::CommBuffers, data.len());
        let out = Outgoing { data, to, _receipt: receipt };
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Send(out));
        }
    }

    /// Receives what stage `from` sent next, into `buf` (its length is known).
    pub fn recv<S: Stored<Acc = f32>>(&mut self, buf: &mut [S], from: usize) -> Result<(), CommError> {
        let comm = &mut self.recv;
        super::collective_f32(&self.memory, buf, |b| comm.recv(b, from))
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
        super::ddp::sum_scalar(self.recv.as_mut(), value)
    }
}

impl Drop for PipelineLinks {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(t) = self.sender.take() {
            let _ = t.join();
        }
    }
}
