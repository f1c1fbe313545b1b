//! A one-shot future: pending -> running -> done | failed | cancelled.
//!
//! The outcome is written once into a `OnceLock`, so reading a finished future
//! takes no lock; the mutex only guards the callback list and pairs with the
//! condition variable that waiters sleep on (std's, for `fork`: see `sync`).

pub mod cycle;
pub mod waits;

use crate::sync::{lock, wait_once};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::Instant;

/// What must finish before a future can.
pub struct BlockedOn<T, E> {
    /// How messages name the future (its task's call); `None` for a future
    /// that a message need not name (its producer names it).
    pub label: Option<Arc<str>>,
    /// True when any one of `on` finishing lets it go on (`as_completed`),
    /// false when it needs all of them.
    pub any: bool,
    /// Weak, so that a record never keeps a future (or its value) alive.
    pub on: Vec<WeakFuture<T, E>>,
}

impl<T, E> Clone for BlockedOn<T, E> {
    fn clone(&self) -> Self {
        BlockedOn {
            label: self.label.clone(),
            any: self.any,
            on: self.on.clone(),
        }
    }
}

/// How a future finished.
#[derive(Debug)]
pub enum Outcome<T, E> {
    /// It returned this value.
    Value(T),
    /// It failed with this error.
    Error(E),
    /// It was cancelled before it ran.
    Cancelled,
}

/// The state of a future, as `concurrent.futures` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Not started.
    Pending,
    /// Its task runs.
    Running,
    /// Finished with a value.
    Done,
    /// Finished with an error.
    Failed,
    /// Cancelled before it ran.
    Cancelled,
}

const PENDING: u8 = 0;
const RUNNING: u8 = 1;
const FINISHING: u8 = 2;
const FINISHED: u8 = 3;

type Callback<T, E> = Box<dyn FnOnce(&Outcome<T, E>) + Send>;

/// What the future's mutex guards.
struct Guarded<T, E> {
    /// With the id [`Future::remove_done_callback`] takes (0: not removable).
    /// The first `firsts` are those of [`Future::add_first_done_callback`].
    callbacks: Vec<(u64, Callback<T, E>)>,
    firsts: usize,
    /// Threads sleeping on `cond`: std's `notify_all` is a system call even
    /// with nobody to wake, so finishing a future nobody waits on skips it.
    waiters: usize,
    /// What must finish before this future can (see `cycle`), when known.
    blocked_on: Option<Box<BlockedOn<T, E>>>,
}

struct Shared<T, E> {
    phase: AtomicU8,
    /// Set by the first wait that found the future pending (see `mark_wanted`).
    wanted: AtomicBool,
    outcome: OnceLock<Outcome<T, E>>,
    guarded: Mutex<Guarded<T, E>>,
    cond: Condvar,
}

/// A cloneable handle to one shared future.
pub struct Future<T, E> {
    shared: Arc<Shared<T, E>>,
}

/// A handle that does not keep the future (or its value) alive.
pub struct WeakFuture<T, E> {
    shared: Weak<Shared<T, E>>,
}

impl<T, E> Clone for WeakFuture<T, E> {
    fn clone(&self) -> Self {
        WeakFuture {
            shared: Weak::clone(&self.shared),
        }
    }
}

impl<T, E> WeakFuture<T, E> {
    /// The future, if any strong handle to it still exists.
    pub fn upgrade(&self) -> Option<Future<T, E>> {
        self.shared.upgrade().map(|shared| Future { shared })
    }
}

impl<T, E> Clone for Future<T, E> {
    fn clone(&self) -> Self {
        Future {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<T, E> Default for Future<T, E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, E> Future<T, E> {
    /// A pending future.
    pub fn new() -> Self {
        Future {
            shared: Arc::new(Shared {
                phase: AtomicU8::new(PENDING),
                wanted: AtomicBool::new(false),
                outcome: OnceLock::new(),
                guarded: Mutex::new(Guarded {
                    callbacks: Vec::new(),
                    firsts: 0,
                    waiters: 0,
                    blocked_on: None,
                }),
                cond: Condvar::new(),
            }),
        }
    }

    /// A handle that lets the future be freed: dropping it never drops the
    /// value (which may hold Python objects whose destructors need the GIL).
    pub fn downgrade(&self) -> WeakFuture<T, E> {
        WeakFuture {
            shared: Arc::downgrade(&self.shared),
        }
    }

    /// True when no other strong handle to this future exists right now.
    pub fn is_sole_handle(&self) -> bool {
        Arc::strong_count(&self.shared) == 1
    }

    /// True the first time it is called while the future has not started:
    /// the caller then asks the pool to run its job next, once.
    pub fn mark_wanted(&self) -> bool {
        self.status() == Status::Pending && !self.shared.wanted.swap(true, Ordering::AcqRel)
    }

    /// True when both handles name the same future.
    pub fn same_as(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// An identity for the future, the same for every handle while it lives.
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.shared) as *const () as usize
    }

    /// Records what must finish before this future can (`None`: nothing
    /// known), for the cycle check of waits; returns what was recorded before.
    pub fn set_blocked_on(&self, blocked_on: Option<BlockedOn<T, E>>) -> Option<BlockedOn<T, E>> {
        let new = blocked_on.map(Box::new);
        let old = std::mem::replace(&mut lock(&self.shared.guarded).blocked_on, new);
        old.map(|b| *b)
    }

    /// A copy of what [`Self::set_blocked_on`] recorded last.
    pub fn blocked_on(&self) -> Option<BlockedOn<T, E>> {
        lock(&self.shared.guarded).blocked_on.as_deref().cloned()
    }

    /// The outcome, once finished; never blocks.
    pub fn outcome(&self) -> Option<&Outcome<T, E>> {
        self.shared.outcome.get()
    }

    /// Whether it is finished (done, failed or cancelled). Never blocks.
    pub fn is_finished(&self) -> bool {
        self.shared.outcome.get().is_some()
    }

    /// Where it is now. Never blocks.
    pub fn status(&self) -> Status {
        match self.shared.outcome.get() {
            Some(Outcome::Value(_)) => Status::Done,
            Some(Outcome::Error(_)) => Status::Failed,
            Some(Outcome::Cancelled) => Status::Cancelled,
            None => match self.shared.phase.load(Ordering::Acquire) {
                PENDING => Status::Pending,
                _ => Status::Running,
            },
        }
    }

    /// Marks the future running; false when it was cancelled (or finished) first,
    /// in which case the task must not run.
    pub fn set_running(&self) -> bool {
        self.shared
            .phase
            .compare_exchange(PENDING, RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Cancels a future that has not started. True when it is (now) cancelled,
    /// as `concurrent.futures.Future.cancel` answers.
    pub fn cancel(&self) -> bool {
        if self
            .shared
            .phase
            .compare_exchange(PENDING, FINISHING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            self.publish(Outcome::Cancelled);
            return true;
        }
        matches!(self.shared.outcome.get(), Some(Outcome::Cancelled))
    }

    /// Finishes the future with `outcome`; false (and `outcome` dropped) when it
    /// had already finished.
    pub fn complete(&self, outcome: Outcome<T, E>) -> bool {
        let mut phase = self.shared.phase.load(Ordering::Acquire);
        loop {
            if phase >= FINISHING {
                return false;
            }
            match self.shared.phase.compare_exchange_weak(
                phase,
                FINISHING,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now) => phase = now,
            }
        }
        self.publish(outcome);
        true
    }

    fn publish(&self, outcome: Outcome<T, E>) {
        // Only the thread that moved the phase to FINISHING gets here, so `set` succeeds.
        let _ = self.shared.outcome.set(outcome);
        let callbacks = {
            let mut guard = lock(&self.shared.guarded);
            self.shared.phase.store(FINISHED, Ordering::Release);
            if guard.waiters > 0 {
                self.shared.cond.notify_all();
            }
            std::mem::take(&mut guard.callbacks)
        };
        // Callbacks run after the lock is released: they may call back into this future.
        let outcome = self.shared.outcome.get().expect("outcome was just set");
        for (_, callback) in callbacks {
            callback(outcome);
        }
    }

    /// Runs `callback` when the future finishes, or at once (on this thread) if it has.
    pub fn add_done_callback(&self, callback: impl FnOnce(&Outcome<T, E>) + Send + 'static) {
        self.add_callback(0, Box::new(callback), false);
    }

    /// As [`Future::add_done_callback`], but the callback runs before every
    /// callback added otherwise, earlier or later (and after the first ones
    /// added before it): what must be in step with the outcome before anyone
    /// else hears of it.
    pub fn add_first_done_callback(&self, callback: impl FnOnce(&Outcome<T, E>) + Send + 'static) {
        self.add_callback(0, Box::new(callback), true);
    }

    /// As [`Future::add_done_callback`]; returns the id that removes the
    /// callback, or `None` when it ran at once (the future had finished).
    pub fn add_removable_callback(
        &self,
        callback: impl FnOnce(&Outcome<T, E>) + Send + 'static,
    ) -> Option<u64> {
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        self.add_callback(id, Box::new(callback), false)
            .then_some(id)
    }

    /// Registers `callback` (before every other but the first ones when
    /// `first`), or runs it at once; true when registered.
    fn add_callback(&self, id: u64, callback: Callback<T, E>, first: bool) -> bool {
        {
            let mut guard = lock(&self.shared.guarded);
            if self.shared.phase.load(Ordering::Acquire) != FINISHED {
                if first {
                    let at = guard.firsts;
                    guard.callbacks.insert(at, (id, callback));
                    guard.firsts += 1;
                } else {
                    guard.callbacks.push((id, callback));
                }
                return true;
            }
        }
        callback(
            self.shared
                .outcome
                .get()
                .expect("finished future has an outcome"),
        );
        false
    }

    /// Drops the callback `id` if it has not run (a wait that gave up).
    pub fn remove_done_callback(&self, id: u64) {
        let removed = {
            let mut guard = lock(&self.shared.guarded);
            let at = guard.callbacks.iter().position(|(i, _)| *i == id);
            // Removable callbacks are never first ones: `firsts` stays right.
            at.map(|at| guard.callbacks.remove(at))
        };
        drop(removed); // outside the lock: dropping a callback may free anything
    }

    /// Blocks until the future finishes or `deadline` passes (`None`: no deadline).
    /// True when finished. Call it from the GIL-free wait helper, never directly
    /// from a Python-facing method.
    pub fn wait_until(&self, deadline: Option<Instant>) -> bool {
        if self.is_finished() {
            return true;
        }
        let mut guard = lock(&self.shared.guarded);
        while self.shared.phase.load(Ordering::Acquire) != FINISHED {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            guard.waiters += 1;
            guard = wait_once(&self.shared.cond, guard, deadline);
            guard.waiters -= 1;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::waits::wait_all;
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::thread;
    use std::time::Duration;

    type F = Future<u64, String>;

    #[test]
    fn value_is_seen_by_every_waiter() {
        let f = F::new();
        let waiters: Vec<_> = (0..8)
            .map(|_| {
                let f = f.clone();
                thread::spawn(move || {
                    assert!(f.wait_until(None));
                    match f.outcome() {
                        Some(Outcome::Value(v)) => *v,
                        other => panic!("unexpected {other:?}"),
                    }
                })
            })
            .collect();
        // All eight blocked before the value comes (the count has no
        // notification: polled, bounded).
        let deadline = Instant::now() + Duration::from_secs(30);
        while lock(&f.shared.guarded).waiters < 8 {
            assert!(Instant::now() < deadline, "gave up waiting for 8 waiters");
            thread::yield_now();
        }
        assert!(f.set_running());
        assert_eq!(f.status(), Status::Running);
        assert!(f.complete(Outcome::Value(42)));
        for w in waiters {
            assert_eq!(w.join().unwrap(), 42);
        }
        assert_eq!(f.status(), Status::Done);
        assert!(
            !f.complete(Outcome::Value(7)),
            "a second completion is refused"
        );
        assert!(matches!(f.outcome(), Some(Outcome::Value(42))));
    }

    #[test]
    fn a_weak_handle_does_not_keep_the_value() {
        let f = F::new();
        let weak = f.downgrade();
        assert!(weak.upgrade().is_some_and(|g| g.same_as(&f)));
        f.complete(Outcome::Value(1));
        drop(f);
        assert!(weak.upgrade().is_none());
    }

    #[test]
    fn timeout_returns_false_and_leaves_it_pending() {
        let f = F::new();
        let start = Instant::now();
        assert!(!f.wait_until(Some(start + Duration::from_millis(30))));
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert_eq!(f.status(), Status::Pending);
    }

    #[test]
    fn cancel_only_before_running() {
        let f = F::new();
        assert!(f.cancel());
        assert!(f.cancel(), "cancelling twice still answers true");
        assert!(!f.set_running(), "a cancelled task must not run");
        assert_eq!(f.status(), Status::Cancelled);

        let g = F::new();
        assert!(g.set_running());
        assert!(!g.cancel());
        assert!(g.complete(Outcome::Error("boom".into())));
        assert_eq!(g.status(), Status::Failed);
        assert!(!g.cancel());
    }

    #[test]
    fn callbacks_run_once_before_and_after_completion() {
        let f = F::new();
        let seen = Arc::new(AtomicUsize::new(0));
        let s = Arc::clone(&seen);
        f.add_done_callback(move |o| {
            if let Outcome::Value(v) = o {
                s.fetch_add(*v as usize, Ordering::SeqCst);
            }
        });
        f.complete(Outcome::Value(5));
        let s = Arc::clone(&seen);
        f.add_done_callback(move |o| {
            if let Outcome::Value(v) = o {
                s.fetch_add(*v as usize * 100, Ordering::SeqCst);
            }
        });
        assert_eq!(seen.load(Ordering::SeqCst), 505);
    }

    #[test]
    fn first_callbacks_run_before_the_others_in_their_own_order() {
        let f = F::new();
        let order = Arc::new(Mutex::new(Vec::new()));
        for (name, first) in [("a", false), ("b", true), ("c", false), ("d", true)] {
            let order = Arc::clone(&order);
            let push = move |_: &Outcome<u64, String>| lock(&order).push(name);
            if first {
                f.add_first_done_callback(push);
            } else {
                f.add_done_callback(push);
            }
        }
        f.complete(Outcome::Value(1));
        assert_eq!(*lock(&order), ["b", "d", "a", "c"]);
    }

    #[test]
    fn callback_may_touch_its_own_future() {
        let f = F::new();
        let g = f.clone();
        let hit = Arc::new(AtomicUsize::new(0));
        let h = Arc::clone(&hit);
        f.add_done_callback(move |_| {
            // Would deadlock if callbacks ran under the future's lock.
            g.add_done_callback(move |_| {
                h.fetch_add(1, Ordering::SeqCst);
            });
            assert!(g.wait_until(None));
        });
        f.complete(Outcome::Value(1));
        assert_eq!(hit.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn many_threads_many_futures() {
        let fs: Vec<F> = (0..10_000).map(|_| F::new()).collect();
        let producers: Vec<_> = (0..4)
            .map(|t| {
                let fs = fs.clone();
                thread::spawn(move || {
                    for (i, f) in fs.iter().enumerate().filter(|(i, _)| i % 4 == t) {
                        assert!(f.set_running());
                        f.complete(Outcome::Value(i as u64 * 3));
                    }
                })
            })
            .collect();
        assert!(wait_all(&fs, None));
        for p in producers {
            p.join().unwrap();
        }
        for (i, f) in fs.iter().enumerate() {
            assert!(matches!(f.outcome(), Some(Outcome::Value(v)) if *v == i as u64 * 3));
        }
    }
}
