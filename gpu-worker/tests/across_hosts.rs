//! Ring collectives between ranks of different hosts: here threads of one process that
//! play two or three hosts, so that the ranks of one "host" share memory and the others
//! reach each other over TCP on 127.0.0.1 (addresses published in a shared directory). A
//! collective gives the same bits whichever way its bytes travel.

mod ranks;

use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

use distlab_common::{AllReduce, Precision};
use distlab_worker::comm::*;
use ranks::{on_hosts, SECRET};

/// Values whose sums depend on the order they are added in (so equal bits mean the same
/// order, not just exact arithmetic).
fn value(rank: usize, i: usize) -> f32 {
    ((rank * 31 + i * 7) % 17) as f32 * 0.1 + (i as f32).sin() * 1e-3
}

/// Every collective the strategies use, on both wire formats, large enough that the shared
/// memory path posts its chunks and shares its buffers.
fn every_collective(rank: usize, comm: &mut RingCommunicator) -> Vec<Vec<f32>> {
    let world = comm.size();
    let len = 300_007;
    let mut out = Vec::new();
    for wire in [Precision::Fp32, Precision::Bf16] {
        comm.set_wire(wire);
        let mut buf: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
        comm.all_reduce(&mut buf, ReduceOp::Avg).unwrap();
        out.push(buf);
    }
    comm.set_wire(Precision::Fp32);
    // The all-reduces that send whole buffers ahead of a receive (star, tree, two rings).
    for (algorithm, per_node) in [(AllReduce::Naive, 1), (AllReduce::Tree, 1), (AllReduce::Hierarchical, 2)] {
        comm.set_all_reduce(algorithm, per_node);
        let mut buf: Vec<f32> = (0..len).map(|i| value(rank + 3, i)).collect();
        comm.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
        out.push(buf);
    }
    comm.set_all_reduce(AllReduce::Ring, 1);
    let mut shared = comm.alloc_shared(len).unwrap();
    shared.iter_mut().enumerate().for_each(|(i, x)| *x = value(rank + 1, i));
    comm.reduce_scatter_in_place(&mut shared, ReduceOp::Sum).unwrap();
    comm.all_gather_in_place(&mut shared).unwrap();
    out.push(shared.to_vec());
    let mut input: Vec<f32> = (0..len).map(|i| value(rank + 2, i)).collect();
    let mut shard = vec![0.0; chunk_range(len, world, rank).len()];
    comm.reduce_scatter(&mut input, &mut shard, ReduceOp::Sum).unwrap();
    let mut gathered = vec![0.0; len];
    comm.all_gather(&shard, &mut gathered).unwrap();
    out.push(gathered);
    let mut root = if rank == 1 { (0..len).map(|i| value(9, i)).collect() } else { vec![0.0; len] };
    comm.broadcast(&mut root, 1).unwrap();
    out.push(root);
    let sent: Vec<f32> = (0..4 * world).map(|i| value(rank, i)).collect();
    let mut received = vec![0.0; 4 * world];
    comm.all_to_all(&sent, &mut received).unwrap();
    out.push(received);
    // Point to point round the ring, as a pipeline's stages send activations (larger than
    // any socket buffer).
    let next = (rank + 1) % world;
    let prev = (rank + world - 1) % world;
    let mine: Vec<f32> = (0..len).map(|i| value(rank, i)).collect();
    let mut theirs = vec![0.0; len];
    if rank.is_multiple_of(2) {
        comm.send(&mine, next).unwrap();
        comm.recv(&mut theirs, prev).unwrap();
    } else {
        comm.recv(&mut theirs, prev).unwrap();
        comm.send(&mine, next).unwrap();
    }
    out.push(theirs);
    out.push(vec![comm.bytes_sent() as f32]);
    out
}

#[test]
fn collectives_give_the_same_bits_across_hosts_as_inside_one() {
    for hosts in [vec![0, 0, 1, 1], vec![0, 1, 0, 1], vec![0, 0, 0, 1], vec![0, 1, 2, 2]] {
        let one_host = on_hosts(None, 4, every_collective);
        let across = on_hosts(Some(hosts.clone()), 4, every_collective);
        assert_eq!(across, one_host, "hosts {hosts:?}");
    }
}

#[test]
fn ranks_of_one_host_still_share_memory() {
    let dir = tempfile::tempdir().unwrap();
    let handles: Vec<_> = (0..4)
        .map(|rank| {
            let path = dir.path().to_path_buf();
            std::thread::spawn(move || {
                let book = AddressFiles { dir: path.clone() };
                let hosts =
                    Hosts { of: vec![0, 0, 1, 1], ip: IpAddr::V4(Ipv4Addr::LOCALHOST), book: &book, secret: SECRET };
                let mesh = Mesh::connect_hosts(&path, rank, 4, Some(&hosts), Duration::from_secs(10)).unwrap();
                (0..4).map(|peer| mesh.same_host(peer)).collect::<Vec<_>>()
            })
        })
        .collect();
    let seen: Vec<Vec<bool>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(seen[0], [true, true, false, false]);
    assert_eq!(seen[3], [false, false, true, true]);
}

/// A rank of another host that goes away mid-collective: its peers fail at once (the
/// connection closes), naming it, well before the collective timeout.
#[test]
fn a_rank_of_another_host_that_exits_is_named_at_once() {
    let started = Instant::now();
    let results = on_hosts(Some(vec![0, 1]), 2, |rank, comm| {
        if rank == 1 {
            return Ok(());
        }
        let mut buf = vec![1.0; 1 << 20];
        comm.all_reduce(&mut buf, ReduceOp::Sum)
    });
    match &results[0] {
        Err(CommError::Disconnected { peer: 1, .. }) => {}
        other => panic!("rank 0 should blame rank 1's exit: {other:?}"),
    }
    assert!(started.elapsed() < Duration::from_secs(10), "{:?}", started.elapsed());
}

/// Connections that are not the run's ranks (a port scanner, a client of another run)
/// are dropped: the rendezvous goes on and the ranks meet.
#[test]
fn strangers_on_the_rendezvous_port_are_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (path, book_dir) = (dir.path().to_path_buf(), dir.path().to_path_buf());
    let rank0 = std::thread::spawn(move || {
        let book = AddressFiles { dir: book_dir.clone() };
        let hosts = Hosts { of: vec![0, 1], ip: IpAddr::V4(Ipv4Addr::LOCALHOST), book: &book, secret: SECRET };
        Mesh::connect_hosts(&book_dir, 0, 2, Some(&hosts), Duration::from_secs(10)).map(|m| m.same_host(1))
    });
    let book = AddressFiles { dir: path.clone() };
    let address = loop {
        if let Some(address) = book.lookup(0).unwrap() {
            break address;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    // One sends nothing and hangs up, one sends garbage, one claims rank 1 with a wrong secret.
    drop(std::net::TcpStream::connect(address).unwrap());
    let mut garbage = std::net::TcpStream::connect(address).unwrap();
    std::io::Write::write_all(&mut garbage, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut impostor = std::net::TcpStream::connect(address).unwrap();
    let mut hello = [1u8, 0, 0, 0, 2, 0, 0, 0].to_vec();
    hello.extend_from_slice(b"another secret!!");
    std::io::Write::write_all(&mut impostor, &hello).unwrap();
    // The real rank 1.
    let hosts = Hosts { of: vec![0, 1], ip: IpAddr::V4(Ipv4Addr::LOCALHOST), book: &book, secret: SECRET };
    let mesh = Mesh::connect_hosts(&path, 1, 2, Some(&hosts), Duration::from_secs(10)).unwrap();
    assert!(!mesh.same_host(0));
    assert!(!rank0.join().unwrap().unwrap(), "rank 0 sees rank 1 on another host");
    // The impostor got no answer: rank 0 hung up on it.
    impostor.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut answer = [0u8; 24];
    assert!(std::io::Read::read_exact(&mut impostor, &mut answer).is_err());
}

#[test]
fn a_host_that_never_comes_times_the_rendezvous_out() {
    let dir = tempfile::tempdir().unwrap();
    let book = AddressFiles { dir: dir.path().to_path_buf() };
    let hosts = Hosts { of: vec![0, 1], ip: IpAddr::V4(Ipv4Addr::LOCALHOST), book: &book, secret: SECRET };
    match Mesh::connect_hosts(dir.path(), 0, 2, Some(&hosts), Duration::from_millis(300)) {
        Err(RendezvousError::Timeout { rank: 0, peer: 1, .. }) => {}
        Err(e) => panic!("expected a timeout waiting for rank 1: {e}"),
        Ok(_) => panic!("expected a timeout waiting for rank 1"),
    }
}
