//! Ranks as threads of one test process, joined like rank processes are.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Duration;

use distlab_worker::comm::*;
use distlab_worker::trace::CommTracer;

/// The run's secret the test ranks prove to each other.
pub const SECRET: [u8; 16] = *b"test-run-secret!";

/// Runs `f(rank, communicator)` on one thread per rank, rank r on host `hosts[r]` (None:
/// all on one host, no TCP at all).
pub fn on_hosts<T: Send + 'static>(
    hosts: Option<Vec<usize>>,
    world: usize,
    f: impl Fn(usize, &mut RingCommunicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let dir = tempfile::tempdir().unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let path = dir.path().to_path_buf();
            let (f, hosts) = (f.clone(), hosts.clone());
            std::thread::spawn(move || {
                let book = AddressFiles { dir: path.clone() };
                let hosts =
                    hosts.map(|of| Hosts { of, ip: IpAddr::V4(Ipv4Addr::LOCALHOST), book: &book, secret: SECRET });
                let mesh = Mesh::connect_hosts(&path, rank, world, hosts.as_ref(), Duration::from_secs(10)).unwrap();
                let tracer = Arc::new(CommTracer::new(rank, 1000));
                let mut comm =
                    RingCommunicator::new(&mesh, "world", (0..world).collect(), Duration::from_secs(20), Some(tracer))
                        .unwrap();
                f(rank, &mut comm)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

/// [`on_hosts`] with every rank on one host.
#[allow(dead_code)] // (each test binary uses one of the two)
pub fn on_ranks<T: Send + 'static>(
    world: usize,
    f: impl Fn(usize, &mut RingCommunicator) -> T + Send + Sync + 'static,
) -> Vec<T> {
    on_hosts(None, world, f)
}
