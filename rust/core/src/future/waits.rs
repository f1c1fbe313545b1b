//! Waits over many futures at once: all of them ([`wait_all`], [`Countdown`])
//! or each as it finishes ([`CompletionQueue`]).

use super::{Future, Outcome};
use crate::sync::{lock, wait_once};
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Instant;

/// Waits until every future is finished or `deadline` passes; true when all
/// are. It waits on the last unfinished one first, then looks again: pool
/// tasks finish about in the order they were queued, so one wake-up covers
/// most of them (waiting on each in turn woke the waiter once a future), and
/// nothing is registered on the futures, so a wait that times out, repeated,
/// leaves nothing behind.
pub fn wait_all<T, E>(futures: &[Future<T, E>], deadline: Option<Instant>) -> bool {
    while let Some(i) = futures.iter().rposition(|f| !f.is_finished()) {
        if !futures[i].wait_until(deadline) {
            return false;
        }
    }
    true
}

/// Waits for watched futures to finish, or for one to fail: the waiter wakes
/// once, when the last one finishes or the first one
/// fails or is cancelled, not at each completion. With one wake-up per
/// completion, 100k leaves cost the waiting thread 70k context switches and
/// the workers a core it took from them (2 cores).
pub struct Countdown {
    state: Mutex<CountdownState>,
    cond: Condvar,
    /// Per watched future, its callback's id while registered.
    ids: OnceLock<Vec<Option<u64>>>,
}

struct CountdownState {
    left: usize,
    /// The first watched index to fail or be cancelled.
    failed: Option<usize>,
    sleepers: usize,
}

impl Countdown {
    /// Watches `futures`; those already finished count at once, in index order.
    pub fn watch<T: 'static, E: 'static>(futures: &[Future<T, E>]) -> Arc<Self> {
        let countdown = Arc::new(Countdown {
            state: Mutex::new(CountdownState {
                left: futures.len(),
                failed: None,
                sleepers: 0,
            }),
            cond: Condvar::new(),
            ids: OnceLock::new(),
        });
        let ids = futures
            .iter()
            .enumerate()
            .map(|(i, future)| {
                let c = Arc::downgrade(&countdown);
                future.add_removable_callback(move |outcome| {
                    if let Some(c) = c.upgrade() {
                        c.finished(i, !matches!(outcome, Outcome::Value(_)));
                    }
                })
            })
            .collect();
        let _ = countdown.ids.set(ids);
        countdown
    }

    /// Removes its callbacks from the watched futures still pending (the
    /// same `futures` as `watch`), so a wait that timed out, repeated,
    /// leaves nothing behind (each left ~50 bytes a pending leaf before).
    pub fn unwatch<T: 'static, E: 'static>(&self, futures: &[Future<T, E>]) {
        let Some(ids) = self.ids.get() else { return };
        for (future, id) in futures.iter().zip(ids) {
            if let (Some(id), false) = (id, future.is_finished()) {
                future.remove_done_callback(*id);
            }
        }
    }

    fn finished(&self, index: usize, failed: bool) {
        let mut state = lock(&self.state);
        state.left -= 1;
        let first_failure = failed && state.failed.is_none();
        if first_failure {
            state.failed = Some(index);
        }
        if (state.left == 0 || first_failure) && state.sleepers > 0 {
            self.cond.notify_all();
        }
    }

    /// Waits until `deadline`: `Some(None)` when all finished and none
    /// failed, `Some(Some(i))` when watched future `i` was
    /// the first to fail, `None` on timeout.
    pub fn wait_until(&self, deadline: Option<Instant>) -> Option<Option<usize>> {
        let mut state = lock(&self.state);
        loop {
            if state.failed.is_some() {
                return Some(state.failed);
            }
            if state.left == 0 {
                return Some(None);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return None;
            }
            state.sleepers += 1;
            state = wait_once(&self.cond, state, deadline);
            state.sleepers -= 1;
        }
    }
}

/// Indices of watched futures in the order they finish: the building block of
/// `wait(FIRST_COMPLETED)` and `as_completed`, O(1) per completion however many
/// futures are watched.
pub struct CompletionQueue {
    /// Finished indices, and how many threads sleep on `cond` (see `Guarded`).
    ready: Mutex<(VecDeque<usize>, usize)>,
    cond: Condvar,
}

impl CompletionQueue {
    /// Watches `futures`; each one's index is queued when it finishes (at once if it has).
    pub fn watch<T: 'static, E: 'static>(futures: &[Future<T, E>]) -> Arc<Self> {
        let queue = Arc::new(CompletionQueue {
            ready: Mutex::new((VecDeque::new(), 0)),
            cond: Condvar::new(),
        });
        for (i, future) in futures.iter().enumerate() {
            let q = Arc::clone(&queue);
            future.add_done_callback(move |_| q.push(i));
        }
        queue
    }

    fn push(&self, index: usize) {
        let mut ready = lock(&self.ready);
        ready.0.push_back(index);
        if ready.1 > 0 {
            self.cond.notify_all();
        }
    }

    /// The next finished index, without blocking.
    pub fn try_pop(&self) -> Option<usize> {
        lock(&self.ready).0.pop_front()
    }

    /// The next finished index, waiting until `deadline`; `None` on timeout.
    pub fn pop_until(&self, deadline: Option<Instant>) -> Option<usize> {
        let mut guard = lock(&self.ready);
        loop {
            if let Some(i) = guard.0.pop_front() {
                return Some(i);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return None;
            }
            guard.1 += 1;
            guard = wait_once(&self.cond, guard, deadline);
            guard.1 -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::thread;
    use std::time::Duration;

    type F = Future<u64, String>;

    #[test]
    fn wait_all_waits_for_every_future_whatever_the_order() {
        let fs: Vec<F> = (0..4).map(|_| F::new()).collect();
        fs[3].complete(Outcome::Value(3));
        let soon = Some(Instant::now() + Duration::from_millis(10));
        assert!(!wait_all(&fs, soon));
        let theirs = fs.clone();
        let finisher = thread::spawn(move || {
            for i in [1usize, 0, 2] {
                theirs[i].complete(Outcome::Value(i as u64));
            }
        });
        assert!(wait_all(&fs, None));
        assert!(fs.iter().all(|f| f.is_finished()));
        finisher.join().unwrap();
    }

    #[test]
    fn a_countdown_given_up_leaves_nothing_on_its_futures() {
        let fs: Vec<F> = (0..3).map(|_| F::new()).collect();
        fs[2].complete(Outcome::Value(2));
        for _ in 0..5 {
            let all = Countdown::watch(&fs);
            let soon = Some(Instant::now() + Duration::from_millis(1));
            assert_eq!(all.wait_until(soon), None);
            all.unwatch(&fs);
            let weak = Arc::downgrade(&all);
            drop(all);
            assert!(weak.upgrade().is_none());
        }
        for f in &fs[..2] {
            assert_eq!(lock(&f.shared.guarded).callbacks.len(), 0);
        }
        let hit = Arc::new(AtomicUsize::new(0));
        let h = Arc::clone(&hit);
        fs[0].add_done_callback(move |_| {
            h.fetch_add(1, Ordering::SeqCst);
        });
        fs[0].complete(Outcome::Error("late".into()));
        assert_eq!(hit.load(Ordering::SeqCst), 1, "other callbacks stay");
    }

    #[test]
    fn countdown_counts_the_finished_and_times_out_on_the_rest() {
        let fs: Vec<F> = (0..4).map(|_| F::new()).collect();
        fs[0].complete(Outcome::Value(0));
        fs[1].complete(Outcome::Value(1));
        let all = Countdown::watch(&fs);
        let soon = Some(Instant::now() + Duration::from_millis(10));
        assert_eq!(all.wait_until(soon), None);
        fs[2].complete(Outcome::Value(2));
        assert_eq!(all.wait_until(soon), None);
        fs[3].complete(Outcome::Value(3));
        assert_eq!(
            all.wait_until(None),
            Some(None),
            "all finished, none failed"
        );
    }

    #[test]
    fn countdown_stops_at_the_first_failure() {
        let fs: Vec<F> = (0..5).map(|_| F::new()).collect();
        fs[3].complete(Outcome::Error("late".into()));
        fs[4].complete(Outcome::Cancelled);
        let all = Countdown::watch(&fs);
        assert_eq!(
            all.wait_until(None),
            Some(Some(3)),
            "finished before the watch: the first in index order"
        );
        let fs: Vec<F> = (0..3).map(|_| F::new()).collect();
        let all = Countdown::watch(&fs);
        let f = fs[2].clone();
        let failer = thread::spawn(move || f.complete(Outcome::Cancelled));
        assert_eq!(all.wait_until(None), Some(Some(2)));
        failer.join().unwrap();
        fs[0].complete(Outcome::Error("after".into()));
        assert_eq!(all.wait_until(None), Some(Some(2)), "the first stays");
    }

    #[test]
    fn countdown_wakes_its_waiter_once() {
        let fs: Vec<F> = (0..1000).map(|_| F::new()).collect();
        let all = Countdown::watch(&fs);
        let waiter = {
            let all = Arc::clone(&all);
            thread::spawn(move || all.wait_until(None))
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while lock(&all.state).sleepers == 0 {
            assert!(Instant::now() < deadline, "gave up waiting for the waiter");
            thread::yield_now();
        }
        let (last, rest) = fs.split_last().unwrap();
        for (i, f) in rest.iter().enumerate() {
            f.complete(Outcome::Value(i as u64));
            // Nobody is woken before the last one.
            assert_eq!(lock(&all.state).sleepers, 1);
        }
        // The last wakes the waiter, which may leave before this thread
        // looks again: nothing to assert on `sleepers` after it.
        last.complete(Outcome::Value(999));
        assert_eq!(waiter.join().unwrap(), Some(None));
    }

    #[test]
    fn completion_queue_follows_completion_order() {
        let fs: Vec<F> = (0..5).map(|_| F::new()).collect();
        fs[3].complete(Outcome::Value(3));
        let q = CompletionQueue::watch(&fs);
        assert_eq!(
            q.try_pop(),
            Some(3),
            "already finished futures are queued at once"
        );
        assert_eq!(q.try_pop(), None);
        for &i in &[4usize, 0, 2, 1] {
            let f = fs[i].clone();
            thread::spawn(move || {
                f.complete(Outcome::Value(i as u64));
            })
            .join()
            .unwrap();
            assert_eq!(q.pop_until(None), Some(i));
        }
        let soon = Some(Instant::now() + Duration::from_millis(5));
        assert_eq!(q.pop_until(soon), None);
    }
}
