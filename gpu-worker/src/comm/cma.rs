//! Copying bytes straight out of another process's memory ("cross-memory attach",
//! `process_vm_readv`), as MPI and NCCL do between processes on one host.
//!
//! A ring step moves a chunk with one copy this way (the peer's buffer -> this rank's),
//! where a pipe needs two (into shared memory, out again). The kernel allows it between
//! processes of the same user unless ptrace is restricted (Yama, seccomp); `transport.rs`
//! checks at rendezvous whether it works and falls back to the pipe's copies if not.

/// A known value at a known address, which a peer reads to check that it can read us.
pub static PROBE: u64 = 0x6469_7374_6c61_6221;

/// Copies `local.len()` bytes starting at `remote` in process `pid` into `local`.
pub fn read(pid: i32, remote: u64, local: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0;
    while done < local.len() {
        let rest = &mut local[done..];
        let local_iov = libc::iovec { iov_base: rest.as_mut_ptr().cast(), iov_len: rest.len() };
        let remote_iov = libc::iovec { iov_base: (remote + done as u64) as *mut libc::c_void, iov_len: rest.len() };
        // SAFETY: the local iovec covers `rest`, which we own mutably; the remote side is
        // only read by the kernel, which checks it against the peer's mappings.
        let n = unsafe { libc::process_vm_readv(pid, &local_iov, 1, &remote_iov, 1, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the peer's buffer ended early"));
        }
        done += n as usize;
    }
    Ok(())
}

/// Whether this process can read process `pid`'s copy of `PROBE` at `address`.
pub fn can_read(pid: i32, address: u64) -> bool {
    let mut value = [0u8; 8];
    read(pid, address, &mut value).is_ok() && u64::from_ne_bytes(value) == PROBE
}

/// Where this process's `PROBE` lies, for a peer to check with `can_read`.
pub fn probe_address() -> u64 {
    std::ptr::addr_of!(PROBE) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process_own_memory() {
        assert!(can_read(std::process::id() as i32, probe_address()));
        let source: Vec<u8> = (0..100_000).map(|i| (i % 251) as u8).collect();
        let mut copy = vec![0u8; source.len()];
        read(std::process::id() as i32, source.as_ptr() as u64, &mut copy).unwrap();
        assert!(copy == source);
    }

    #[test]
    fn a_bad_address_is_an_error_not_a_crash() {
        assert!(!can_read(std::process::id() as i32, 8));
    }
}
