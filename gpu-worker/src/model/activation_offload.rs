//! Activation offload (`train.activation_offload`): a block's saved activations leave the
//! device after its forward and come back before its backward, the next block's read
//! ahead while this one's backward runs.
//!
//! What moves is everything a block keeps but its output (`res_mlp`), which the next
//! block reads as its input in both passes and so stays, as the stage's input and the
//! head's activations do. Two tiers:
//!
//! * `host`: copied down into host memory (a GPU run's: the device keeps one block's);
//! * `disk`: handed to a thread that writes it to a file with no name (removed by the
//!   kernel when the process ends), and reads it back when asked: the CPU backend's tier,
//!   whose host memory is its device.
//!
//! One micro-batch through L blocks, disk tier:
//!
//! ```text
//!   forward i:   buffers made → block i runs → wait for block i-1's write → hand them over
//!   backward:    ask for block L-1 (before the head's backward)
//!   backward i:  wait for block i → ask for block i-1 → block i's backward → free its buffers
//! ```
//!
//! The thread takes requests in order, so a block's read always follows its write. On the
//! CPU backend the copies handed to and from the thread are the device's memory too: the
//! ledger books at most two blocks beside the micro-batches' outputs (the one running and
//! the one being written or read); on a GPU one. What is on disk or in host memory is
//! booked as offloaded. Every value comes back as it went: losses are bit-identical.

use std::collections::{HashMap, VecDeque};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use distlab_common::trace::{lane, Span, SpanKind};

use crate::backend::{Backend, Stored};
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::activations::BlockActivations;
use crate::trace::now_us;

/// Where offloaded activations go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ActivationTier {
    Host,
    /// A file in this directory.
    Disk(PathBuf),
}

/// The disk tier's file could not be made, written or read (a full disk, a missing
/// directory).
#[derive(Debug, thiserror::Error)]
#[error("activations offloaded to disk under {dir}: {what}: {source}")]
pub struct ActivationOffloadError {
    pub dir: PathBuf,
    pub what: &'static str,
    #[source]
    pub source: std::io::Error,
}

/// One block of one micro-batch through one of the stage's chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct BlockKey {
    pub(super) chunk: usize,
    pub(super) micro: usize,
    /// Its index in the chunk.
    pub(super) block: usize,
    /// Its layer in the model (for the timeline).
    pub(super) layer: usize,
}

/// A block's buffers in host memory, in [`BlockActivations::offloaded_mut`]'s order.
type Parts<E> = Vec<Vec<E>>;

/// The stage's offloaded activations and the buffers of the blocks on the device.
pub(super) struct ActivationOffload<B: Backend> {
    store: Store<B::Elem>,
    memory: Arc<MemoryTracker>,
    /// Floats of each buffer a block moves (its shape's).
    lens: Vec<usize>,
    /// Host memory is the device's (the CPU backend): the copies on their way to and from
    /// the disk are booked as activations.
    staging_on_device: bool,
    /// Blocks on the device, made for their forward or brought back for their backward.
    resident: HashMap<BlockKey, Receipt>,
    /// Blocks off it.
    offloaded: HashMap<BlockKey, Receipt>,
    /// Timeline: the step and whether its moves are recorded.
    step: u64,
    record: bool,
    spans: Vec<Span>,
}

enum Store<E: Stored> {
    Host(HashMap<BlockKey, Parts<E>>),
    Disk(DiskTier<E>),
}

impl<B: Backend> ActivationOffload<B> {
    /// An offload of blocks whose buffers are `lens` floats long, into `tier`.
    pub(super) fn new(
        be: &B,
        tier: &ActivationTier,
        lens: Vec<usize>,
        memory: &Arc<MemoryTracker>,
    ) -> Result<Self, ActivationOffloadError> {
        let store = match tier {
            ActivationTier::Host => Store::Host(HashMap::new()),
            ActivationTier::Disk(dir) => Store::Disk(DiskTier::open(dir)?),
        };
        Ok(Self {
            store,
            memory: memory.clone(),
            lens,
            staging_on_device: be.buffers_on_host(),
            resident: HashMap::new(),
            offloaded: HashMap::new(),
            step: 0,
            record: false,
            spans: Vec::new(),
        })
    }

    fn block_floats(&self) -> usize {
        self.lens.iter().sum()
    }

    fn book(&self, category: Category) -> Receipt {
        self.memory.alloc_of::<B::Elem>(category, self.block_floats())
    }

    /// A copy between the device and the disk's thread: device memory on the CPU backend.
    fn book_staging(&self) -> Option<Receipt> {
        self.staging_on_device.then(|| self.book(Category::Activations))
    }

    /// Step `step` starts; its moves are drawn on the timeline when `record`.
    pub(super) fn begin_step(&mut self, step: u64, record: bool) {
        (self.step, self.record) = (step, record);
    }

    /// The moves recorded so far, on the offload lane.
    pub(super) fn spans(&self) -> Vec<Span> {
        self.spans.clone()
    }

    /// Block `key`'s forward starts: its buffers are made (booked until they leave).
    pub(super) fn make(&mut self, be: &B, key: BlockKey, block: &mut BlockActivations<B::Buf>) {
        for (buf, &len) in block.offloaded_mut().into_iter().zip(&self.lens) {
            *buf = be.alloc(len);
        }
        let booked = self.book(Category::Activations);
        self.resident.insert(key, booked);
    }

    /// Block `key`'s forward is done: its buffers leave the device (a forward run again
    /// before its backward replaces what it left the first time).
    pub(super) fn put(
        &mut self,
        be: &B,
        key: BlockKey,
        block: &mut BlockActivations<B::Buf>,
    ) -> Result<(), ActivationOffloadError> {
        if let Store::Disk(disk) = &mut self.store {
            disk.finish_writes(&mut self.spans)?;
        }
        let start = now_us();
        let parts: Parts<B::Elem> =
            block.offloaded_mut().into_iter().map(|buf| be.move_to_host(std::mem::replace(buf, be.alloc(0)))).collect();
        let staging = self.book_staging();
        self.resident.remove(&key);
        let offloaded = self.book(Category::Offloaded);
        self.offloaded.insert(key, offloaded);
        let span = self.record.then(|| self.span(key, "out"));
        match &mut self.store {
            Store::Host(map) => {
                map.insert(key, parts);
                if let Some(span) = span {
                    self.spans.push(Span { start_us: start, end_us: now_us(), ..span });
                }
            }
            Store::Disk(disk) => disk.write(key, parts, staging, span),
        }
        Ok(())
    }

    /// Starts reading block `key` back (the disk tier; the host tier has it at hand).
    pub(super) fn read_ahead(&mut self, key: BlockKey) -> Result<(), ActivationOffloadError> {
        let staging = self.book_staging();
        let span = self.record.then(|| self.span(key, "back"));
        match &mut self.store {
            Store::Host(_) => Ok(()),
            Store::Disk(disk) => {
                disk.finish_writes(&mut self.spans)?;
                disk.read(key, staging, span);
                Ok(())
            }
        }
    }

    /// Block `key`'s backward starts: its buffers come back (waiting for their read), and
    /// the read of `next`, the block whose backward comes after, starts.
    pub(super) fn take_back(
        &mut self,
        be: &B,
        key: BlockKey,
        block: &mut BlockActivations<B::Buf>,
        next: Option<BlockKey>,
    ) -> Result<(), ActivationOffloadError> {
        let start = now_us();
        if let Store::Disk(disk) = &self.store {
            if !disk.reading.iter().any(|(k, ..)| *k == key) {
                self.read_ahead(key)?;
            }
        }
        let parts = match &mut self.store {
            Store::Host(map) => map.remove(&key),
            Store::Disk(disk) => Some(disk.wait_read(key, &mut self.spans)?),
        };
        let parts = parts.unwrap_or_else(|| panic!("block {key:?} came back without going: backward before forward"));
        self.offloaded.remove(&key);
        for (buf, part) in block.offloaded_mut().into_iter().zip(parts) {
            *buf = be.move_from_host(part);
        }
        let booked = self.book(Category::Activations);
        self.resident.insert(key, booked);
        if let (Store::Host(_), true) = (&self.store, self.record) {
            let span = self.span(key, "back");
            self.spans.push(Span { start_us: start, end_us: now_us(), ..span });
        }
        match next {
            Some(next) => self.read_ahead(next),
            None => Ok(()),
        }
    }

    /// Block `key`'s backward is done: its buffers are freed.
    pub(super) fn free(&mut self, be: &B, key: BlockKey, block: &mut BlockActivations<B::Buf>) {
        for buf in block.offloaded_mut() {
            *buf = be.alloc(0);
        }
        self.resident.remove(&key);
    }

    /// Forgets every block of micro-batch `micro` through chunk `chunk` (an evaluation's
    /// forward, which no backward follows).
    pub(super) fn forget(&mut self, chunk: usize, micro: usize) -> Result<(), ActivationOffloadError> {
        let of = |k: &BlockKey| (k.chunk, k.micro) == (chunk, micro);
        self.resident.retain(|k, _| !of(k));
        let keys: Vec<BlockKey> = self.offloaded.keys().copied().filter(|k| of(k)).collect();
        for key in keys {
            self.offloaded.remove(&key);
            match &mut self.store {
                Store::Host(map) => drop(map.remove(&key)),
                Store::Disk(disk) => disk.forget(key),
            }
        }
        if let Store::Disk(disk) = &mut self.store {
            disk.finish_writes(&mut self.spans)?;
        }
        Ok(())
    }

    /// Bytes of the copies on their way to and from the disk that are device memory.
    pub(super) fn staging_bytes(&self) -> u64 {
        match (&self.store, self.staging_on_device) {
            (Store::Disk(disk), true) => {
                let blocks = disk.writing.len() + disk.reading.len();
                (blocks * self.block_floats() * std::mem::size_of::<B::Elem>()) as u64
            }
            _ => 0,
        }
    }

    fn span(&self, key: BlockKey, way: &str) -> Span {
        let bytes = (self.block_floats() * std::mem::size_of::<B::Elem>()) as u64;
        let tier = match self.store {
            Store::Host(_) => "host",
            Store::Disk(_) => "disk",
        };
        Span {
            kind: SpanKind::Comm,
            name: format!("offload {tier}: layer {} {way} (micro-batch {})", key.layer, key.micro),
            step: self.step,
            lane: lane::OFFLOAD.into(),
            start_us: 0,
            end_us: 0,
            layer: Some(key.layer as u32),
            bucket: None,
            bytes: Some(bytes),
            micro: Some(key.micro as u32),
            chunk: Some(key.chunk as u32),
        }
    }
}

/// What the disk tier's thread is asked to do, in order.
enum Request<E> {
    Write(BlockKey, Parts<E>),
    Read(BlockKey),
    Forget(BlockKey),
}

/// What it answers, with when it started and ended.
enum Reply<E> {
    Written(Result<(), std::io::Error>, (u64, u64)),
    Read(BlockKey, Result<Parts<E>, std::io::Error>, (u64, u64)),
}

/// The disk tier: its thread and what is on the way to and from it.
struct DiskTier<E: Stored> {
    dir: PathBuf,
    requests: Option<Sender<Request<E>>>,
    replies: Receiver<Reply<E>>,
    thread: Option<JoinHandle<()>>,
    /// Writes handed over and not yet confirmed, oldest first: their staging bookings and
    /// the spans to fill in.
    writing: VecDeque<(Option<Receipt>, Option<Span>)>,
    /// Reads asked for and not yet taken.
    reading: VecDeque<(BlockKey, Option<Receipt>, Option<Span>)>,
}

impl<E: Stored> DiskTier<E> {
    fn open(dir: &Path) -> Result<Self, ActivationOffloadError> {
        let fail = |what| move |source| ActivationOffloadError { dir: dir.to_path_buf(), what, source };
        std::fs::create_dir_all(dir).map_err(fail("making the directory"))?;
        let file = tempfile::tempfile_in(dir).map_err(fail("making the file"))?;
        let (requests, inbox) = channel();
        let (outbox, replies) = channel();
        let thread = std::thread::Builder::new()
            .name("activation-offload".into())
            .spawn(move || serve(DiskFile { file, slots: HashMap::new(), free: Vec::new(), end: 0 }, inbox, outbox))
            .map_err(fail("starting its thread"))?;
        Ok(Self {
            dir: dir.to_path_buf(),
            requests: Some(requests),
            replies,
            thread: Some(thread),
            writing: VecDeque::new(),
            reading: VecDeque::new(),
        })
    }

    fn fail(&self, what: &'static str, source: std::io::Error) -> ActivationOffloadError {
        ActivationOffloadError { dir: self.dir.clone(), what, source }
    }

    fn send(&self, request: Request<E>) {
        // (the thread lives as long as this tier; a send fails only once it has panicked,
        // which the next wait reports)
        if let Some(requests) = &self.requests {
            let _ = requests.send(request);
        }
    }

    fn write(&mut self, key: BlockKey, parts: Parts<E>, staging: Option<Receipt>, span: Option<Span>) {
        self.send(Request::Write(key, parts));
        self.writing.push_back((staging, span));
    }

    fn read(&mut self, key: BlockKey, staging: Option<Receipt>, span: Option<Span>) {
        self.send(Request::Read(key));
        self.reading.push_back((key, staging, span));
    }

    fn forget(&mut self, key: BlockKey) {
        self.send(Request::Forget(key));
    }

    /// Waits until every write handed over is on disk.
    fn finish_writes(&mut self, spans: &mut Vec<Span>) -> Result<(), ActivationOffloadError> {
        while !self.writing.is_empty() {
            if let Some(read) = self.next_reply(spans)? {
                unreachable!("a read ({:?}) answered before the writes asked first", read.0);
            }
        }
        Ok(())
    }

    /// Waits for block `key`'s read (asked for, the writes before it done).
    fn wait_read(&mut self, key: BlockKey, spans: &mut Vec<Span>) -> Result<Parts<E>, ActivationOffloadError> {
        loop {
            if let Some((got, parts)) = self.next_reply(spans)? {
                assert_eq!(got, key, "the reads come back in the order they were asked for");
                return Ok(parts);
            }
        }
    }

    /// Takes the thread's next answer: a write confirmed (None), or a read's block.
    fn next_reply(&mut self, spans: &mut Vec<Span>) -> Result<Option<(BlockKey, Parts<E>)>, ActivationOffloadError> {
        let gone = || std::io::Error::other("the offload thread stopped");
        let reply = self.replies.recv().map_err(|_| self.fail("waiting for its thread", gone()))?;
        let finish = |span: Option<Span>, (start_us, end_us), spans: &mut Vec<Span>| {
            spans.extend(span.map(|s| Span { start_us, end_us, ..s }));
        };
        match reply {
            Reply::Written(result, times) => {
                let (_staging, span) = self.writing.pop_front().expect("a write was asked for");
                result.map_err(|e| self.fail("writing a block", e))?;
                finish(span, times, spans);
                Ok(None)
            }
            Reply::Read(key, result, times) => {
                let (_, _staging, span) = self.reading.pop_front().expect("a read was asked for");
                let parts = result.map_err(|e| self.fail("reading a block back", e))?;
                finish(span, times, spans);
                Ok(Some((key, parts)))
            }
        }
    }
}

impl<E: Stored> Drop for DiskTier<E> {
    fn drop(&mut self) {
        self.requests = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The file, in slots of one block each (every block of a stage is the same size), and
/// where each stored block is.
struct DiskFile {
    file: File,
    /// Stored blocks: their slot's offset and each part's length.
    slots: HashMap<BlockKey, (u64, Vec<usize>)>,
    /// Offsets of slots no block holds now.
    free: Vec<u64>,
    /// The file's end.
    end: u64,
}

/// The thread: answers requests in the order they come until the tier is dropped.
fn serve<E: Stored>(mut disk: DiskFile, inbox: Receiver<Request<E>>, outbox: Sender<Reply<E>>) {
    for request in inbox {
        let start = now_us();
        let reply = match request {
            Request::Write(key, parts) => Reply::Written(disk.write(key, &parts), (start, now_us())),
            Request::Read(key) => {
                let parts = disk.read(key);
                Reply::Read(key, parts, (start, now_us()))
            }
            Request::Forget(key) => {
                disk.release(key);
                continue;
            }
        };
        if outbox.send(reply).is_err() {
            return;
        }
    }
}

impl DiskFile {
    fn write<E: Stored>(&mut self, key: BlockKey, parts: &Parts<E>) -> std::io::Result<()> {
        self.release(key);
        let bytes: u64 = parts.iter().map(|p| std::mem::size_of_val(p.as_slice()) as u64).sum();
        let offset = self.free.pop().unwrap_or_else(|| {
            self.end += bytes;
            self.end - bytes
        });
        self.slots.insert(key, (offset, parts.iter().map(Vec::len).collect()));
        let mut at = offset;
        for part in parts {
            let part: &[u8] = bytemuck::cast_slice(part);
            self.file.write_all_at(part, at)?;
            at += part.len() as u64;
        }
        Ok(())
    }

    fn read<E: Stored>(&mut self, key: BlockKey) -> std::io::Result<Parts<E>> {
        let missing = || std::io::Error::other(format!("block {key:?} was never written"));
        let (mut at, lens) = self.slots.get(&key).cloned().ok_or_else(missing)?;
        let mut parts = Vec::with_capacity(lens.len());
        for len in lens {
            let mut part = vec![E::zeroed(); len];
            let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut part);
            self.file.read_exact_at(bytes, at)?;
            at += bytes.len() as u64;
            parts.push(part);
        }
        self.release(key);
        Ok(parts)
    }

    /// Block `key`'s slot (if it has one) is free again.
    fn release(&mut self, key: BlockKey) {
        if let Some((offset, _)) = self.slots.remove(&key) {
            self.free.push(offset);
        }
    }
}
