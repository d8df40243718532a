//! Hosts for a test as Linux network namespaces: each has its loopback and one veth
//! interface into a switch (a bridge in a namespace of its own), with an address on a
//! private /24 that exists only inside them. The test makes them and [`Hosts`] removes
//! them when dropped (after killing whatever still runs inside). Needs root and iproute2;
//! [`Hosts::new`] says why when it cannot.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

pub struct Hosts {
    /// The switch's namespace.
    switch: String,
    /// Each host's namespace.
    pub names: Vec<String>,
    /// Each host's address.
    pub ips: Vec<Ipv4Addr>,
}

/// Runs `ip ARGS`; the error says what failed.
fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run `ip` (iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Hosts {
    /// `n` hosts on one switch, or why they cannot be made here.
    pub fn new(n: usize) -> Result<Hosts, String> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let prefix = format!("dl{}x{k}", pid % 100_000);
        let subnet = [10, 100 + (k % 100) as u8, (pid % 250) as u8];
        let switch = format!("{prefix}sw");
        ip(&["netns", "add", &switch])?;
        // From here on, dropping `hosts` removes what was made.
        let mut hosts = Hosts { switch: switch.clone(), names: Vec::new(), ips: Vec::new() };
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        for h in 0..n {
            let name = format!("{prefix}h{h}");
            let address = Ipv4Addr::new(subnet[0], subnet[1], subnet[2], h as u8 + 1);
            let port = format!("p{h}");
            ip(&["netns", "add", &name])?;
            hosts.names.push(name.clone());
            ip(&["-n", &name, "link", "add", "eth0", "type", "veth", "peer", "name", &port, "netns", &switch])?;
            ip(&["-n", &name, "addr", "add", &format!("{address}/24"), "dev", "eth0"])?;
            ip(&["-n", &name, "link", "set", "eth0", "up"])?;
            ip(&["-n", &name, "link", "set", "lo", "up"])?;
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &port, "up"])?;
            hosts.ips.push(address);
        }
        Ok(hosts)
    }

    /// Host `h`'s namespace.
    pub fn namespace(&self, h: usize) -> &str {
        &self.names[h]
    }

    /// `program ARGS...` to run inside host `h` (`ip netns exec`, which then becomes the
    /// program: killing the child kills it).
    pub fn command(&self, h: usize, program: &std::path::Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", self.namespace(h)]).arg(program);
        c
    }

    /// Runs `f` on a thread that has entered host `h`'s network namespace (what it
    /// connects to, it reaches from there).
    pub fn inside<T: Send>(&self, h: usize, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.namespace(h));
        std::thread::scope(|s| {
            s.spawn(|| {
                let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                // SAFETY: setns on this thread only, with a namespace file it holds open.
                let entered = unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
                assert_eq!(entered, 0, "setns into {path}: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .expect("the thread inside the namespace")
        })
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for name in self.names.iter().chain([&self.switch]) {
            // Whatever still runs inside goes first, then the namespace (and its veth).
            if let Ok(out) = Command::new("ip").args(["netns", "pids", name]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|p| p.parse::<i32>().ok())
                {
                    // SAFETY: a plain kill(2) of a process inside the test's own namespace.
                    unsafe {
                        libc::kill(pid, libc::SIGKILL);
                    }
                }
            }
            let _ = ip(&["netns", "del", name]);
        }
    }
}
