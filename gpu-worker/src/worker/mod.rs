//! The `distlab-worker` binary's own modules (the engine is the library): the loop that
//! leases experiments from a server (`worker_loop.rs`, through `client.rs`), a spec file
//! run locally (`run_local.rs`), one run's block of ranks on this machine (`execute.rs`,
//! with `rendezvous.rs` when the run spans workers), the launcher that starts one process
//! per rank (`launch.rs`) and the rank's side of it (`rank.rs`), what they say to each
//! other (`protocol.rs`), the fault-tolerant replicas' quorum the launcher keeps (`quorum.rs`), the devices' peak FLOP/s for a run's MFU (`peak.rs`), and what a
//! rank process runs: training (`ddp_rank.rs`), a collective demo (`demo.rs`) or a
//! bandwidth sweep (`bench_comm.rs`).

pub mod bench_comm;
pub mod client;
pub mod ddp_rank;
pub mod demo;
pub mod execute;
pub mod launch;
pub mod peak;
pub mod protocol;
pub mod quorum;
pub mod rank;
pub mod rendezvous;
pub mod run_local;
pub mod worker_loop;
