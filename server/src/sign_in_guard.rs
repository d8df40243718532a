//! What keeps sign-in from being the way to knock a class server over or to guess a
//! password (`--auth accounts`).
//!
//! - **A bounded queue.** Each password check costs argon2id's memory (19 MiB) and tens of
//!   milliseconds; `passwords` runs at most [`passwords::HASHING_AT_ONCE`] at a time. Sign-ins
//!   beyond those and [`MAX_WAITING`] waiting ones are answered 503 at once, so a flood
//!   needs no memory and no thread.
//! - **Throttling.** Failed sign-ins are counted per account name and per client address.
//!   After `free_failures` of them, each further attempt must wait twice as long as the one
//!   before (1 s, 2 s, 4 s, ... at most `max_delay`): sooner is 429 with `Retry-After`, and
//!   no password is checked. After `lock_after` failures the account is locked (the
//!   address after `lock_address_after`) until `forget_after` passes without a failure, or
//!   an admin unlocks it (`DELETE /api/users/{name}/lock`, or a new password). A sign-in
//!   that succeeds clears its account's count. The counts live in this server's memory.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::passwords;

/// Sign-ins that may wait for a password check while [`passwords::HASHING_AT_ONCE`] run.
pub const MAX_WAITING: usize = 32;

/// How failed sign-ins are throttled (server settings; `ServerConfig::sign_in`).
#[derive(Clone, Copy, Debug)]
pub struct SignInPolicy {
    /// Failures of one account or address answered without delay.
    pub free_failures: u32,
    /// The longest wait asked between two attempts.
    pub max_delay: Duration,
    /// Failures after which an account is locked.
    pub lock_after: u32,
    /// Failures after which a client address is locked (a class behind one NAT shares it).
    pub lock_address_after: u32,
    /// A count is forgotten this long after its last failure (a lock ends with it).
    pub forget_after: Duration,
}

impl Default for SignInPolicy {
    fn default() -> Self {
        Self {
            free_failures: 5,
            max_delay: Duration::from_secs(60),
            lock_after: 20,
            lock_address_after: 100,
            forget_after: Duration::from_secs(15 * 60),
        }
    }
}

/// Why a sign-in is not even tried.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// Too many sign-ins are waiting for a password check.
    Busy,
    /// Too soon after the last failure: try again after this long.
    TooSoon(Duration),
    /// The account (or the address) is locked for this long at most.
    Locked { account: bool, for_at_most: Duration },
}

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Key {
    Account(String),
    Address(IpAddr),
}

#[derive(Clone, Copy, Debug)]
struct Failures {
    count: u32,
    last: Instant,
}

pub struct SignInGuard {
    policy: SignInPolicy,
    /// Sign-ins admitted (checking a password, or waiting to): at most
    /// HASHING_AT_ONCE + MAX_WAITING.
    admitted: std::sync::Arc<Semaphore>,
    failures: Mutex<HashMap<Key, Failures>>,
}

/// A sign-in's place in the queue; dropped when its answer is decided.
pub struct Admitted(#[allow(dead_code)] OwnedSemaphorePermit);

impl SignInGuard {
    pub fn new(policy: SignInPolicy) -> Self {
        Self {
            policy,
            admitted: std::sync::Arc::new(Semaphore::new(passwords::HASHING_AT_ONCE + MAX_WAITING)),
            failures: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a sign-in as `name` from `address` may check its password now: refused
    /// while throttled or locked, or when the queue is full.
    pub fn admit(&self, name: &str, address: Option<IpAddr>, now: Instant) -> Result<Admitted, Refused> {
        {
            let mut failures = self.lock();
            let forget = self.policy.forget_after;
            failures.retain(|_, f| now.saturating_duration_since(f.last) < forget);
            let account = failures.get(&Key::Account(name.to_string())).copied();
            let from = address.and_then(|a| failures.get(&Key::Address(a)).copied());
            for (f, is_account, lock_after) in
                [(account, true, self.policy.lock_after), (from, false, self.policy.lock_address_after)]
            {
                let Some(f) = f else { continue };
                let since = now.saturating_duration_since(f.last);
                if f.count >= lock_after {
                    return Err(Refused::Locked { account: is_account, for_at_most: forget.saturating_sub(since) });
                }
                let wait = self.delay_after(f.count);
                if since < wait {
                    return Err(Refused::TooSoon(wait - since));
                }
            }
        }
        self.admitted.clone().try_acquire_owned().map(Admitted).map_err(|_| Refused::Busy)
    }

    /// The wait asked before the attempt after `count` failures.
    fn delay_after(&self, count: u32) -> Duration {
        match count.checked_sub(self.policy.free_failures) {
            None => Duration::ZERO,
            Some(over) => Duration::from_secs(1u64 << over.min(20)).min(self.policy.max_delay),
        }
    }

    /// A failed sign-in as `name` from `address`.
    pub fn failed(&self, name: &str, address: Option<IpAddr>, now: Instant) {
        let mut failures = self.lock();
        for key in [Some(Key::Account(name.to_string())), address.map(Key::Address)].into_iter().flatten() {
            let f = failures.entry(key).or_insert(Failures { count: 0, last: now });
            f.count = f.count.saturating_add(1);
            f.last = now;
        }
    }

    /// A sign-in as `name` that succeeded: its account starts afresh (the address's count
    /// stays: one good password does not excuse guessing others).
    pub fn succeeded(&self, name: &str) {
        self.unlock(name);
    }

    /// Forgets `name`'s failures (an admin unlocked it, or gave it a new password); true if
    /// it had any.
    pub fn unlock(&self, name: &str) -> bool {
        self.lock().remove(&Key::Account(name.to_string())).is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, Failures>> {
        self.failures.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> SignInGuard {
        SignInGuard::new(SignInPolicy::default())
    }

    const ADA: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 7)));

    #[test]
    fn failures_beyond_the_free_ones_wait_twice_as_long_each_time() {
        let g = guard();
        let t0 = Instant::now();
        for _ in 0..5 {
            assert!(g.admit("ada", ADA, t0).is_ok());
            g.failed("ada", ADA, t0);
        }
        // After 5 failures the next attempt waits 1 s, then 2 s, 4 s, ...
        assert_eq!(g.admit("ada", ADA, t0).err(), Some(Refused::TooSoon(Duration::from_secs(1))));
        let mut t = t0;
        for wait in [1, 2, 4, 8, 16, 32, 60, 60] {
            let early = t + Duration::from_secs(wait) - Duration::from_millis(10);
            assert!(matches!(g.admit("ada", ADA, early), Err(Refused::TooSoon(_))), "{wait} s");
            t += Duration::from_secs(wait);
            assert!(g.admit("ada", ADA, t).is_ok(), "after {wait} s");
            g.failed("ada", ADA, t);
        }
    }

    #[test]
    fn the_21st_failure_in_a_row_is_refused_until_an_admin_unlocks() {
        let g = SignInGuard::new(SignInPolicy { free_failures: 100, ..SignInPolicy::default() });
        let t = Instant::now();
        for _ in 0..20 {
            assert!(g.admit("ada", None, t).is_ok());
            g.failed("ada", None, t);
        }
        let later = t + Duration::from_secs(60);
        assert!(matches!(g.admit("ada", None, later), Err(Refused::Locked { account: true, .. })));
        // Another account is not locked by ada's failures.
        assert!(g.admit("bob", None, later).is_ok());
        assert!(g.unlock("ada"));
        assert!(g.admit("ada", None, later).is_ok());
        // ... and a lock ends by itself once its failures are forgotten.
        for _ in 0..20 {
            g.failed("ada", None, later);
        }
        assert!(g.admit("ada", None, later + Duration::from_secs(14 * 60)).is_err());
        assert!(g.admit("ada", None, later + Duration::from_secs(15 * 60)).is_ok());
    }

    #[test]
    fn an_address_guessing_many_accounts_is_locked_too() {
        let g = SignInGuard::new(SignInPolicy { free_failures: 1000, ..SignInPolicy::default() });
        let t = Instant::now();
        for i in 0..100 {
            g.failed(&format!("student{i}"), ADA, t);
        }
        assert!(matches!(g.admit("student200", ADA, t), Err(Refused::Locked { account: false, .. })));
        assert!(g.admit("student200", None, t).is_ok(), "another address is not");
    }

    #[test]
    fn a_success_clears_the_account_and_not_the_address() {
        let g = guard();
        let t = Instant::now();
        for _ in 0..7 {
            g.failed("ada", ADA, t);
        }
        g.succeeded("ada");
        assert!(g.admit("ada", None, t).is_ok());
        assert!(matches!(g.admit("ada", ADA, t), Err(Refused::TooSoon(_))), "the address still waits");
    }

    #[test]
    fn the_queue_is_bounded() {
        let g = guard();
        let t = Instant::now();
        let held: Vec<Admitted> = (0..passwords::HASHING_AT_ONCE + MAX_WAITING)
            .map(|i| g.admit(&format!("u{i}"), None, t).unwrap())
            .collect();
        assert_eq!(g.admit("one-more", None, t).err(), Some(Refused::Busy));
        drop(held);
        assert!(g.admit("one-more", None, t).is_ok());
    }
}
