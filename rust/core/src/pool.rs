//! A fixed-size worker pool with a FIFO queue.
//!
//! Threads start lazily, up to `max_workers` busy at once. A worker that blocks on another future (through [`Pool::blocking`])
//! stops counting as busy, and the pool starts a stand-in thread when work is
//! queued: so `max_workers = 1` and a task that waits on a queued task cannot
//! deadlock. Stand-ins retire once the pool is back under its size.

use crate::sync::{lock, wait_once};
use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

/// One unit of work. `cancel` is called instead of `run` for work that will
/// never run (the pool shut down while it was queued); `refuse` for work that
/// cannot run for a reason its waiters must hear.
pub trait Job: Send + 'static {
    /// Runs the job on a pool thread.
    fn run(self: Box<Self>);
    /// Drops the job unrun (the pool shut down); its waiters must hear.
    fn cancel(self: Box<Self>);
    /// Refuses the job for `why`; by default, as [`Job::cancel`].
    fn refuse(self: Box<Self>, why: Refusal) {
        let _ = why;
        self.cancel();
    }
    /// Something to fail if this job's thread vanishes while it runs (after
    /// `fork`, the child has none of the parent's threads).
    fn abandon_handle(&self) -> Option<Arc<dyn Abandon>> {
        None
    }
    /// What [`Pool::run_next`] finds this job by (its future's id); 0 for none.
    fn key(&self) -> usize {
        0
    }
}

/// Threads the pool may start beyond `max_workers` for urgent jobs (an
/// `aa.jit` compile, a task some thread waits on) when every worker is busy.
pub const URGENT_LANE: usize = 4;

/// Fails the future of a job whose thread no longer exists. The pool drops
/// these under its lock, so they must not own anything whose drop runs
/// foreign code (hold the future weakly).
pub trait Abandon: Send + Sync {
    /// Fails the job's future: its thread is gone.
    fn abandon(&self);
}

/// Why a queued job will never run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No new thread could start (the OS error) while every one of the pool's
    /// `threads` was blocked waiting on other work: nothing would take it.
    ThreadStart {
        /// The OS error that refused the thread.
        error: String,
        /// How many threads the pool had, all blocked.
        threads: usize,
    },
    /// Queued in the parent when `fork()` made this process: it runs there.
    QueuedAtFork,
}

/// Why a job was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum SubmitError {
    /// The pool is shut down.
    ShutDown,
}

struct State {
    /// Jobs in the order workers take them: submission order, except that
    /// urgent ones go to the front.
    queue: VecDeque<Box<dyn Job>>,
    /// Urgent jobs for the threads of the urgent lane (every worker was busy).
    lane: VecDeque<Box<dyn Job>>,
    max_workers: usize,
    threads: usize,
    /// Workers waiting for work that no submitter has claimed yet.
    sleeping: usize,
    /// Claims on sleeping workers not yet taken up. A worker leaves its wait
    /// only by taking one (or at shutdown): std's condition variable may wake
    /// a thread spuriously, and that must not upset the count of sleepers.
    wakeups: usize,
    /// Workers inside `blocking`.
    blocked: usize,
    /// Threads of the urgent lane: beyond `max_workers`, each runs jobs of
    /// `lane` only and ends when none is left (never sleeps, not in `threads`).
    urgent_threads: usize,
    /// Threads that left `threads` (or `urgent_threads`) and still run their
    /// stop hook: see [`Pool::wait_for_threads_to_end`].
    stopping: usize,
    /// Threads between taking a job and finishing it (a batch counts once).
    running_jobs: usize,
    /// Of those, the workers (not threads of the urgent lane).
    worker_jobs: usize,
    /// Threads in `wait_for_running_jobs`.
    idle_waiters: usize,
    shutdown: bool,
    /// What each running job would need failing after `fork`, by worker slot.
    running: Vec<Option<Arc<dyn Abandon>>>,
    free_slots: Vec<usize>,
    spawned_total: usize,
    /// Jobs taken off the queue that will never run, refused once the lock
    /// is let go (dropping a job may run foreign code).
    refused: Vec<(Box<dyn Job>, Refusal)>,
}

impl State {
    /// Workers that count against `max_workers`: neither blocked nor retired.
    fn busy_capacity_used(&self) -> usize {
        self.threads - self.blocked
    }

    /// The next job for a worker: urgent ones first (those the lane's
    /// threads, all busy, have not taken yet).
    fn pop(&mut self) -> Option<Box<dyn Job>> {
        self.lane.pop_front().or_else(|| self.queue.pop_front())
    }

    /// Every queued job (the lane's first); both queues are left empty.
    fn take_queue(&mut self) -> VecDeque<Box<dyn Job>> {
        let mut all = std::mem::take(&mut self.lane);
        all.append(&mut self.queue);
        all
    }

    /// True when a worker will look at the queue without a new wake-up: one
    /// starting, woken, between jobs, or asleep (each submission woke one).
    fn worker_on_its_way(&self) -> bool {
        self.sleeping > 0 || self.threads > self.worker_jobs
    }

    /// True when this worker is one too many.
    fn over_size(&self) -> bool {
        self.busy_capacity_used() > self.max_workers
    }
}

struct Inner {
    state: Mutex<State>,
    work: Condvar,
    /// Signalled when the last running job finishes and someone waits for that.
    idle: Condvar,
    name: String,
    hooks: ThreadHooks,
}

/// Called on each worker thread when it starts and when it retires (not when
/// the process exits or forks).
#[derive(Clone, Copy, Default)]
pub struct ThreadHooks {
    /// Run on the new thread before its first job.
    pub start: Option<fn()>,
    /// Run on the thread as it retires.
    pub stop: Option<fn()>,
}

/// Counters for tests and benchmarks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    /// How many jobs may run at once.
    pub max_workers: usize,
    /// Worker threads now (busy, idle or blocked).
    pub threads: usize,
    /// Workers waiting for a job.
    pub idle: usize,
    /// Workers blocked in a wait on other work.
    pub blocked: usize,
    /// Jobs queued, not yet taken.
    pub queued: usize,
    /// Threads started since the pool began.
    pub spawned_total: usize,
    /// Threads of the urgent lane now (not in `threads`).
    pub urgent_lane: usize,
}

#[derive(Clone)]
/// A pool of worker threads that run [`Job`]s, started lazily up to `max_workers` busy at once.
pub struct Pool {
    inner: Arc<Inner>,
}

/// The pool's lock, held by the thread that calls `fork()` from just before
/// until just after it (see [`Pool::lock_for_fork`]).
pub struct ForkGuard<'a> {
    _lock: MutexGuard<'a, State>,
}

thread_local! {
    /// On a worker: which pool (its `Inner`'s address) and which slot.
    static WORKER: Cell<Option<(usize, usize)>> = const { Cell::new(None) };
}

/// True on a pool worker thread.
pub fn on_worker_thread() -> bool {
    WORKER.with(Cell::get).is_some()
}

/// Lets go of the pool's lock, then refuses the jobs set aside under it.
fn refuse(mut st: MutexGuard<'_, State>) {
    if st.refused.is_empty() {
        return;
    }
    let refused = std::mem::take(&mut st.refused);
    drop(st);
    for (job, why) in refused {
        job.refuse(why);
    }
}

impl Pool {
    /// A pool named `name` (its threads' name) running at most `max_workers` jobs at once.
    pub fn new(name: &str, max_workers: usize) -> Self {
        Self::with_hooks(name, max_workers, ThreadHooks::default())
    }

    /// As [`Pool::new`], with hooks run on each thread as it starts and retires.
    pub fn with_hooks(name: &str, max_workers: usize, hooks: ThreadHooks) -> Self {
        Pool {
            inner: Arc::new(Inner {
                state: Mutex::new(State {
                    queue: VecDeque::new(),
                    lane: VecDeque::new(),
                    max_workers: max_workers.max(1),
                    threads: 0,
                    sleeping: 0,
                    wakeups: 0,
                    blocked: 0,
                    urgent_threads: 0,
                    stopping: 0,
                    running_jobs: 0,
                    worker_jobs: 0,
                    idle_waiters: 0,
                    shutdown: false,
                    running: Vec::new(),
                    free_slots: Vec::new(),
                    spawned_total: 0,
                    refused: Vec::new(),
                }),
                work: Condvar::new(),
                idle: Condvar::new(),
                name: name.to_owned(),
                hooks,
            }),
        }
    }

    fn id(&self) -> usize {
        Arc::as_ptr(&self.inner) as usize
    }

    /// This thread's worker slot, if it is a worker of this pool.
    fn my_slot(&self) -> Option<usize> {
        WORKER
            .with(Cell::get)
            .and_then(|(pool, slot)| (pool == self.id()).then_some(slot))
    }

    /// Queues `job`; it runs on a worker in FIFO order.
    pub fn submit(&self, job: Box<dyn Job>) -> Result<(), SubmitError> {
        self.submit_all(vec![job])
    }

    /// Queues every job under one lock, waking as many workers as there is work.
    pub fn submit_all(&self, jobs: Vec<Box<dyn Job>>) -> Result<(), SubmitError> {
        let mut st = lock(&self.inner.state);
        if st.shutdown {
            drop(st);
            jobs.into_iter().for_each(|job| job.cancel());
            return Err(SubmitError::ShutDown);
        }
        let n = jobs.len();
        st.queue.extend(jobs);
        for _ in 0..n {
            if st.sleeping == 0 && st.busy_capacity_used() >= st.max_workers {
                break;
            }
            self.wake_or_spawn(&mut st);
        }
        refuse(st);
        Ok(())
    }

    /// On a worker of this pool, the next queued job to run right away (the
    /// caller runs it before returning to the pool); None off the pool's
    /// threads, when the queue is empty, or when this worker should retire.
    pub fn try_pop(&self) -> Option<Box<dyn Job>> {
        let slot = self.my_slot()?;
        let mut st = lock(&self.inner.state);
        if st.shutdown || st.over_size() {
            return None;
        }
        let job = st.pop()?;
        st.running[slot] = job.abandon_handle();
        Some(job)
    }

    /// Gets one more worker onto the queue: wakes a sleeping one, or starts one
    /// if the pool is under its size.
    fn wake_or_spawn(&self, st: &mut State) {
        if st.sleeping > 0 {
            st.sleeping -= 1;
            st.wakeups += 1;
            self.inner.work.notify_one();
        } else if st.busy_capacity_used() < st.max_workers {
            self.spawn(st);
        }
    }

    /// True when no worker is free to take a job now.
    fn all_busy(st: &State) -> bool {
        st.sleeping == 0 && st.busy_capacity_used() >= st.max_workers
    }

    /// Runs `job` on a thread of the urgent lane, started for it (up to
    /// [`URGENT_LANE`] beyond `max_workers`). With the lane full it waits in
    /// the lane for the first of its threads or of the workers to come free;
    /// when no thread can start, it goes to the front of the queue.
    fn to_lane(&self, st: &mut State, job: Box<dyn Job>) {
        st.lane.push_back(job);
        if st.urgent_threads >= URGENT_LANE {
            return;
        }
        if !self.start_thread(st, true) {
            let job = st.lane.pop_back().expect("pushed above");
            st.queue.push_front(job);
        }
    }

    /// Queues `job` ahead of every job that is not urgent; a worker takes it
    /// at once, on a thread beyond `max_workers` if all are busy (see
    /// [`URGENT_LANE`]). For work a consumer waits on: a compile, not a load.
    pub fn submit_urgent(&self, job: Box<dyn Job>) -> Result<(), SubmitError> {
        let mut st = lock(&self.inner.state);
        if st.shutdown {
            drop(st);
            job.cancel();
            return Err(SubmitError::ShutDown);
        }
        if Self::all_busy(&st) {
            self.to_lane(&mut st, job);
        } else {
            st.queue.push_front(job);
            self.wake_or_spawn(&mut st);
        }
        refuse(st);
        Ok(())
    }

    /// Runs the queued job with `key` next: a thread that waits on a task must
    /// not wait behind every task queued before it, nor for a running one to
    /// end. It goes to the front of the queue when a worker is on its way to
    /// the queue or may start, else to a thread of the urgent lane (see
    /// [`URGENT_LANE`]). A no-op when no queued job has that key (it runs
    /// already).
    pub fn run_next(&self, key: usize) {
        let mut st = lock(&self.inner.state);
        if let Some(at) = st.queue.iter().position(|job| job.key() == key) {
            let job = st.queue.remove(at).expect("found above");
            if st.worker_on_its_way() || st.busy_capacity_used() < st.max_workers {
                st.queue.push_front(job);
                self.wake_for_unclaimed_work(&mut st);
            } else {
                self.to_lane(&mut st, job);
            }
        }
        refuse(st);
    }

    /// Like `wake_or_spawn`, but only for queued work no worker is on its way to.
    fn wake_for_unclaimed_work(&self, st: &mut State) {
        if st.queue.len() + st.lane.len() > st.wakeups {
            self.wake_or_spawn(st);
        }
    }

    fn spawn(&self, st: &mut State) {
        let _ = self.start_thread(st, false);
    }

    /// Starts a worker, or with `urgent_lane` a thread of the urgent lane;
    /// false when the thread could not start.
    fn start_thread(&self, st: &mut State, urgent_lane: bool) -> bool {
        let slot = st.free_slots.pop().unwrap_or_else(|| {
            st.running.push(None);
            st.running.len() - 1
        });
        let pool = self.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("{}-{}", self.inner.name, slot))
            .spawn(move || {
                if urgent_lane {
                    pool.urgent_lane(slot)
                } else {
                    pool.worker(slot)
                }
            });
        match spawned {
            Ok(_) if urgent_lane => {
                st.urgent_threads += 1;
                st.spawned_total += 1;
                true
            }
            Ok(_) => {
                st.threads += 1;
                st.spawned_total += 1;
                true
            }
            Err(_) if urgent_lane => {
                st.free_slots.push(slot);
                false
            }
            Err(error) => {
                st.free_slots.push(slot);
                // Out of threads: the queued work waits for a worker that is
                // running a job. With every worker blocked on other work (or
                // none at all), nothing would ever take it: refuse it, so that
                // its waiters get an error instead of a hang.
                if st.threads == st.blocked && st.sleeping == 0 {
                    let why = Refusal::ThreadStart {
                        error: error.to_string(),
                        threads: st.threads,
                    };
                    let queued = st.take_queue();
                    st.refused
                        .extend(queued.into_iter().map(|job| (job, why.clone())));
                }
                false
            }
        }
    }

    /// Runs `job` on worker `slot` with the pool's lock let go, and takes the
    /// lock back: the one place that counts running jobs.
    fn run_job<'a>(
        &'a self,
        mut st: MutexGuard<'a, State>,
        slot: usize,
        job: Box<dyn Job>,
        worker: bool,
    ) -> MutexGuard<'a, State> {
        st.running[slot] = job.abandon_handle();
        st.running_jobs += 1;
        st.worker_jobs += usize::from(worker);
        drop(st);
        job.run();
        let mut st = lock(&self.inner.state);
        st.running[slot] = None;
        st.running_jobs -= 1;
        st.worker_jobs -= usize::from(worker);
        if st.running_jobs == 0 && st.idle_waiters > 0 {
            self.inner.idle.notify_all();
        }
        st
    }

    /// A thread of the urgent lane: runs the lane's jobs while there are any,
    /// then ends. Not a worker for `try_pop` and `blocking` (so it never takes a
    /// load, and a wait in it starts no stand-in): its jobs are compiles,
    /// dispatches and tasks someone waits on.
    fn urgent_lane(&self, slot: usize) {
        if let Some(start) = self.inner.hooks.start {
            start();
        }
        let mut st = lock(&self.inner.state);
        while let Some(job) = st.lane.pop_front() {
            st = self.run_job(st, slot, job, false);
        }
        st.urgent_threads -= 1;
        st.free_slots.push(slot);
        self.stop_thread(st);
    }

    /// Ends a thread that left the counts: its stop hook, counted in `stopping`.
    fn stop_thread(&self, mut st: MutexGuard<'_, State>) {
        st.stopping += 1;
        drop(st);
        self.run_stop_hook();
    }

    /// Runs the stop hook, then counts this thread as ended and tells a
    /// [`Pool::wait_for_threads_to_end`] waiter.
    fn run_stop_hook(&self) {
        if let Some(stop) = self.inner.hooks.stop {
            stop();
        }
        let mut st = lock(&self.inner.state);
        st.stopping -= 1;
        if st.idle_waiters > 0 {
            self.inner.idle.notify_all();
        }
    }

    fn worker(&self, slot: usize) {
        WORKER.with(|w| w.set(Some((self.id(), slot))));
        if let Some(start) = self.inner.hooks.start {
            start();
        }
        let mut st = lock(&self.inner.state);
        loop {
            // Retire first: a worker back from `blocking` may leave the pool over size.
            if st.shutdown || st.over_size() {
                st.threads -= 1;
                st.free_slots.push(slot);
                if !st.shutdown {
                    // This thread may have been woken for queued work: pass it on.
                    self.wake_for_unclaimed_work(&mut st);
                }
                st.stopping += 1;
                refuse(st);
                self.run_stop_hook();
                return;
            }
            if let Some(job) = st.pop() {
                st = self.run_job(st, slot, job, true);
                continue;
            }
            st.sleeping += 1;
            while st.wakeups == 0 && !st.shutdown {
                st = wait_once(&self.inner.work, st, None);
            }
            if st.wakeups > 0 {
                st.wakeups -= 1;
            }
        }
    }

    /// Runs `wait` (which blocks on something that other pool work may produce).
    /// On a worker thread the pool counts this worker as blocked and starts a
    /// stand-in when work is queued, so the pool never deadlocks on itself.
    pub fn blocking<R>(&self, wait: impl FnOnce() -> R) -> R {
        if !on_worker_thread() {
            return wait();
        }
        {
            let mut st = lock(&self.inner.state);
            st.blocked += 1;
            self.wake_for_unclaimed_work(&mut st);
            refuse(st);
        }
        struct Unblock<'a>(&'a Pool);
        impl Drop for Unblock<'_> {
            fn drop(&mut self) {
                lock(&self.0.inner.state).blocked -= 1;
            }
        }
        let _unblock = Unblock(self);
        wait()
    }

    /// Changes the number of workers that may run at once.
    pub fn set_max_workers(&self, max_workers: usize) {
        let mut st = lock(&self.inner.state);
        st.max_workers = max_workers.max(1);
        let startable = st
            .queue
            .len()
            .min(st.max_workers.saturating_sub(st.busy_capacity_used()));
        for _ in 0..startable {
            self.spawn(&mut st);
        }
        if st.busy_capacity_used() > st.max_workers && st.sleeping > 0 {
            // Surplus sleepers wake to retire.
            st.wakeups += st.sleeping;
            st.sleeping = 0;
            self.inner.work.notify_all();
        }
        refuse(st);
    }

    /// How many jobs may run at once.
    pub fn max_workers(&self) -> usize {
        lock(&self.inner.state).max_workers
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> PoolStats {
        let st = lock(&self.inner.state);
        PoolStats {
            max_workers: st.max_workers,
            threads: st.threads,
            idle: st.sleeping,
            blocked: st.blocked,
            queued: st.queue.len() + st.lane.len(),
            spawned_total: st.spawned_total,
            urgent_lane: st.urgent_threads,
        }
    }

    /// Cancels queued work and lets workers exit once their running job ends;
    /// waits for nothing. Later submissions are refused.
    pub fn shutdown(&self) {
        let queued = {
            let mut st = lock(&self.inner.state);
            st.shutdown = true;
            st.sleeping = 0;
            self.inner.work.notify_all();
            st.take_queue()
        };
        for job in queued {
            job.cancel();
        }
    }

    /// Waits until no worker runs a job, or until `deadline`; true when none
    /// does. With the queue cancelled by [`Pool::shutdown`], this is the wait
    /// at interpreter exit for the jobs already running.
    pub fn wait_for_running_jobs(&self, deadline: Option<Instant>) -> bool {
        self.wait_until(|st| st.running_jobs == 0, deadline)
    }

    /// After [`Pool::shutdown`]: waits until every thread of the pool has ended
    /// (its stop hook done), or until `deadline`; true when all have. At
    /// interpreter exit, so that each thread's stop hook (its Python thread
    /// state deleted, what it kept in `threading.local` freed) runs while the
    /// interpreter still runs Python normally.
    pub fn wait_for_threads_to_end(&self, deadline: Option<Instant>) -> bool {
        self.wait_until(
            |st| st.threads + st.urgent_threads + st.stopping == 0,
            deadline,
        )
    }

    /// Waits on the `idle` condition until `done(state)`, or until `deadline`;
    /// true when done. Whoever makes `done` true notifies `idle` when
    /// `idle_waiters > 0`.
    fn wait_until(&self, done: impl Fn(&State) -> bool, deadline: Option<Instant>) -> bool {
        let mut st = lock(&self.inner.state);
        while !done(&st) {
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return false;
            }
            st.idle_waiters += 1;
            st = wait_once(&self.inner.idle, st, deadline);
            st.idle_waiters -= 1;
        }
        true
    }

    /// Takes the pool's lock for the duration of the `fork()` call itself (from
    /// a `pthread_atfork` prepare handler), so that the child inherits neither
    /// the lock held by a thread it does not have, nor the state mid-update.
    /// Drop the guard in the parent and child handlers, on the same thread.
    ///
    /// No thread waits for the GIL while holding this lock, so a forking thread
    /// that holds the GIL cannot deadlock here. Held any longer (across Python
    /// fork hooks, which may let the GIL go), it could: a thread holding the
    /// GIL would then wait for it while the forking thread waits for the GIL.
    pub fn lock_for_fork(&self) -> ForkGuard<'_> {
        ForkGuard {
            _lock: lock(&self.inner.state),
        }
    }

    /// In the child only the forking thread exists: forget the parent's
    /// workers and fail the jobs they were running. What was queued runs in
    /// the parent; here it is refused ([`Refusal::QueuedAtFork`]), so that no
    /// loader runs once per process. Call it once the guard of
    /// [`Pool::lock_for_fork`] is dropped.
    pub fn after_fork_child(&self) {
        let mut st = lock(&self.inner.state);
        // A worker that forks (a task calling os.fork) lives on in the child.
        let me = self.my_slot();
        st.threads = usize::from(me.is_some());
        st.urgent_threads = 0;
        st.running_jobs = usize::from(me.is_some());
        st.worker_jobs = st.running_jobs;
        st.idle_waiters = 0;
        st.sleeping = 0;
        st.wakeups = 0;
        st.blocked = 0;
        st.free_slots = (0..st.running.len())
            .rev()
            .filter(|&s| Some(s) != me)
            .collect();
        let abandoned: Vec<Arc<dyn Abandon>> = st
            .running
            .iter_mut()
            .enumerate()
            .filter(|&(s, _)| Some(s) != me)
            .filter_map(|(_, job)| job.take())
            .collect();
        let queued = st.take_queue();
        st.refused
            .extend(queued.into_iter().map(|job| (job, Refusal::QueuedAtFork)));
        refuse(st);
        for job in abandoned {
            job.abandon();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::future::{Future, Outcome};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    type F = Future<usize, String>;

    /// The bound of every wait for a state; reaching it fails the test.
    const WAIT: Duration = Duration::from_secs(30);

    /// Polls `done` (the pool's counters have no notification) until it holds;
    /// panics, naming `what`, after `WAIT`. Never sleeps: it yields.
    fn eventually(what: &str, mut done: impl FnMut() -> bool) {
        let deadline = Instant::now() + WAIT;
        while !done() {
            assert!(Instant::now() < deadline, "gave up waiting for {what}");
            std::thread::yield_now();
        }
    }

    /// A count that tasks raise and tests wait on.
    #[derive(Default)]
    struct Counter {
        n: Mutex<usize>,
        changed: Condvar,
    }

    impl Counter {
        fn add(&self, delta: isize) -> usize {
            let mut n = lock(&self.n);
            *n = n.checked_add_signed(delta).unwrap();
            self.changed.notify_all();
            *n
        }

        /// Waits until the count satisfies `done`; panics, naming `what`, after `WAIT`.
        fn wait_for(&self, what: &str, done: impl Fn(usize) -> bool) -> usize {
            let deadline = Instant::now() + WAIT;
            let mut n = lock(&self.n);
            while !done(*n) {
                assert!(
                    Instant::now() < deadline,
                    "gave up waiting for {what}: {}",
                    *n
                );
                n = wait_once(&self.changed, n, Some(deadline));
            }
            *n
        }
    }

    struct Task<G: FnOnce() -> usize + Send + 'static> {
        f: G,
        future: F,
    }

    impl<G: FnOnce() -> usize + Send + 'static> Job for Task<G> {
        fn run(self: Box<Self>) {
            if self.future.set_running() {
                let v = (self.f)();
                self.future.complete(Outcome::Value(v));
            }
        }
        fn cancel(self: Box<Self>) {
            self.future.cancel();
        }
        fn refuse(self: Box<Self>, why: Refusal) {
            self.future.complete(Outcome::Error(format!("{why:?}")));
        }
        fn key(&self) -> usize {
            self.future.id()
        }
    }

    fn submit(pool: &Pool, f: impl FnOnce() -> usize + Send + 'static) -> F {
        let future = F::new();
        pool.submit(Box::new(Task {
            f,
            future: future.clone(),
        }))
        .unwrap();
        future
    }

    fn value(f: &F) -> usize {
        assert!(
            f.wait_until(Some(Instant::now() + WAIT)),
            "gave up waiting for a task"
        );
        match f.outcome() {
            Some(Outcome::Value(v)) => *v,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn runs_everything_in_fifo_order_on_one_worker() {
        let pool = Pool::new("t", 1);
        let order = Arc::new(Mutex::new(Vec::new()));
        let fs: Vec<F> = (0..100)
            .map(|i| {
                let order = Arc::clone(&order);
                submit(&pool, move || {
                    lock(&order).push(i);
                    i * 2
                })
            })
            .collect();
        for (i, f) in fs.iter().enumerate() {
            assert_eq!(value(f), i * 2);
        }
        assert_eq!(*lock(&order), (0..100).collect::<Vec<_>>());
        assert_eq!(pool.stats().spawned_total, 1);
    }

    #[test]
    fn never_more_than_max_workers_busy() {
        // Every task holds its worker until the gate opens: three run, the
        // rest stay queued, and the pool starts no fourth thread for them.
        let pool = Pool::new("t", 3);
        let busy = Arc::new(Counter::default());
        let peak = Arc::new(AtomicUsize::new(0));
        let gate = Arc::new(Mutex::new(()));
        let held = lock(&gate);
        let fs: Vec<F> = (0..30)
            .map(|_| {
                let (busy, peak, gate) = (Arc::clone(&busy), Arc::clone(&peak), Arc::clone(&gate));
                submit(&pool, move || {
                    peak.fetch_max(busy.add(1), Ordering::SeqCst);
                    drop(lock(&gate));
                    busy.add(-1);
                    0
                })
            })
            .collect();
        busy.wait_for("three busy workers", |n| n >= 3);
        let st = pool.stats();
        assert_eq!((st.threads, st.queued), (3, 27), "{st:?}");
        drop(held);
        fs.iter().for_each(|f| assert_eq!(value(f), 0));
        assert_eq!(peak.load(Ordering::SeqCst), 3);
        assert!(pool.stats().threads <= 3);
    }

    #[test]
    fn one_worker_waiting_on_queued_work_does_not_deadlock() {
        let pool = Pool::new("t", 1);
        let p = pool.clone();
        let outer = submit(&pool, move || {
            let inner = submit(&p, || 41);
            let p2 = p.clone();
            p2.blocking(|| value(&inner)) + 1
        });
        assert_eq!(value(&outer), 42);
        // The stand-in retires once nothing is blocked.
        eventually("the stand-in to retire", || pool.stats().threads == 1);
        let st = pool.stats();
        assert_eq!((st.blocked, st.max_workers), (0, 1));
        assert!(st.spawned_total >= 2);
    }

    #[test]
    fn work_queued_as_a_surplus_worker_retires_still_runs() {
        // A worker back from a wait leaves the pool over size; the idle worker
        // woken for the next job retires instead of running it. The wake-up
        // must pass on to another sleeper, or the job waits forever.
        for _ in 0..3 {
            let pool = Pool::new("t", 2);
            let gate = Arc::new(Mutex::new(()));
            let held = lock(&gate);
            let g = Arc::clone(&gate);
            let busy = submit(&pool, move || {
                drop(lock(&g));
                0
            });
            let unblock = F::new();
            let (p, u) = (pool.clone(), unblock.clone());
            let outer = submit(&pool, move || {
                p.blocking(|| value(&u));
                let inner = submit(&p, || 7);
                // Waits as a task waiting on a threading.Event would: the pool
                // does not know, so only the spare sleeper can run `inner`.
                value(&inner) * 6
            });
            // Runs on a stand-in while `outer` is blocked; the stand-in then idles.
            assert_eq!(value(&submit(&pool, || 1)), 1);
            drop(held);
            assert_eq!(value(&busy), 0);
            eventually("both spare workers to fall asleep", || {
                pool.stats().idle == 2
            });
            unblock.complete(Outcome::Value(0));
            assert_eq!(value(&outer), 42);
        }
    }

    #[test]
    fn spurious_wakeups_do_not_lose_or_duplicate_work() {
        // Wakes every sleeper without a claim, many times, while work flows.
        let pool = Pool::new("t", 3);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (p, s) = (pool.clone(), Arc::clone(&stop));
        let poker = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.inner.work.notify_all();
                std::thread::yield_now();
            }
        });
        let fs: Vec<F> = (0..2000).map(|i| submit(&pool, move || i)).collect();
        for (i, f) in fs.iter().enumerate() {
            assert_eq!(value(f), i);
        }
        stop.store(true, Ordering::Relaxed);
        poker.join().unwrap();
        // Once every worker is back asleep, each is counted once: a count off
        // by a lost or doubled sleeper never settles, and the wait fails.
        eventually("every worker counted idle once", || {
            let st = pool.stats();
            st.idle == st.threads
        });
        let st = pool.stats();
        assert_eq!((st.queued, st.blocked), (0, 0));
    }

    #[test]
    fn fork_guard_holds_the_lock_until_dropped() {
        let pool = Pool::new("t", 2);
        let guard = pool.lock_for_fork();
        assert!(
            pool.inner.state.try_lock().is_err(),
            "the guard holds the pool's lock"
        );
        let p = pool.clone();
        let (started, on_the_way) = std::sync::mpsc::channel();
        let submitted = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = Arc::clone(&submitted);
        let submitter = std::thread::spawn(move || {
            started.send(()).unwrap();
            let f = submit(&p, || 5);
            done.store(true, Ordering::SeqCst);
            value(&f)
        });
        on_the_way.recv_timeout(WAIT).unwrap();
        assert!(
            !submitted.load(Ordering::SeqCst),
            "submit waits for the fork to end"
        );
        drop(guard);
        assert_eq!(submitter.join().unwrap(), 5);
        assert!(submitted.load(Ordering::SeqCst));
    }

    #[test]
    fn wait_for_running_jobs_returns_once_the_last_one_ends() {
        let pool = Pool::new("t", 2);
        assert!(
            pool.wait_for_running_jobs(Some(Instant::now())),
            "nothing runs"
        );
        let gate = Arc::new(Mutex::new(()));
        let held = lock(&gate);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let g = Arc::clone(&gate);
        let running = submit(&pool, move || {
            started_tx.send(()).unwrap();
            drop(lock(&g));
            5
        });
        started_rx.recv_timeout(WAIT).unwrap();
        assert!(
            !pool.wait_for_running_jobs(Some(Instant::now())),
            "one runs"
        );
        drop(held);
        assert!(pool.wait_for_running_jobs(Some(Instant::now() + WAIT)));
        assert_eq!(value(&running), 5);
    }

    /// A pool of one worker held by a job that waits on `gate`, with
    /// `queued` more jobs behind it; returns their futures.
    fn held_pool(gate: &Arc<Mutex<()>>, queued: usize) -> (Pool, F, Vec<F>) {
        let pool = Pool::new("t", 1);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let g = Arc::clone(gate);
        let held = submit(&pool, move || {
            started_tx.send(()).unwrap();
            drop(lock(&g));
            0
        });
        started_rx.recv_timeout(WAIT).unwrap();
        let behind = (0..queued).map(|i| submit(&pool, move || i + 1)).collect();
        (pool, held, behind)
    }

    #[test]
    fn an_urgent_job_runs_while_every_worker_is_busy() {
        let gate = Arc::new(Mutex::new(()));
        let closed = lock(&gate);
        let (pool, held, behind) = held_pool(&gate, 3);
        let urgent = F::new();
        pool.submit_urgent(Box::new(Task {
            f: || 42,
            future: urgent.clone(),
        }))
        .unwrap();
        assert_eq!(value(&urgent), 42, "ran on a thread beyond max_workers");
        assert_eq!(pool.stats().queued, 3, "the others still wait");
        drop(closed);
        assert_eq!(behind.iter().map(value).collect::<Vec<_>>(), [1, 2, 3]);
        assert_eq!(value(&held), 0);
        eventually("the extra thread to retire", || pool.stats().threads <= 1);
    }

    #[test]
    fn run_next_takes_a_waited_job_out_of_turn() {
        // Every worker and every thread of the urgent lane busy: the waited
        // job goes ahead of the queue, for the first thread to come free.
        let gate = Arc::new(Mutex::new(()));
        let closed = lock(&gate);
        let (pool, held, _) = held_pool(&gate, 0);
        let lane_gate = Arc::new(Mutex::new(()));
        let lane_closed = lock(&lane_gate);
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let lane: Vec<F> = (0..URGENT_LANE)
            .map(|_| {
                let future = F::new();
                let g = Arc::clone(&lane_gate);
                let started = started_tx.clone();
                pool.submit_urgent(Box::new(Task {
                    f: move || {
                        started.send(()).unwrap();
                        drop(lock(&g));
                        0
                    },
                    future: future.clone(),
                }))
                .unwrap();
                future
            })
            .collect();
        for _ in 0..URGENT_LANE {
            started_rx.recv_timeout(WAIT).unwrap(); // each on its own lane thread
        }
        assert_eq!(pool.stats().urgent_lane, URGENT_LANE);
        let order = Arc::new(Mutex::new(Vec::new()));
        let behind: Vec<F> = (0..3)
            .map(|i| {
                let order = Arc::clone(&order);
                submit(&pool, move || {
                    lock(&order).push(i);
                    i
                })
            })
            .collect();
        pool.run_next(behind[2].id());
        pool.run_next(12345); // no such job: nothing happens
        drop(closed);
        assert_eq!(behind.iter().map(value).sum::<usize>() + value(&held), 3);
        assert_eq!(
            *lock(&order),
            [2, 0, 1],
            "the waited one first, then in order"
        );
        drop(lane_closed);
        assert_eq!(lane.iter().map(value).sum::<usize>(), 0);
    }

    #[test]
    fn a_waited_job_runs_while_every_worker_is_busy() {
        // One worker, held by a long job: the waited job must not wait for it.
        let gate = Arc::new(Mutex::new(()));
        let closed = lock(&gate);
        let (pool, held, behind) = held_pool(&gate, 2);
        pool.run_next(behind[1].id());
        assert_eq!(value(&behind[1]), 2, "ran on a thread of the urgent lane");
        assert_eq!(pool.stats().queued, 1, "the other still waits");
        drop(closed);
        assert_eq!(value(&behind[0]), 1);
        assert_eq!(value(&held), 0);
    }

    #[test]
    fn waited_jobs_beyond_the_lane_run_as_its_threads_come_free() {
        // One worker held; more waited jobs than the lane has threads: the
        // extra ones run on a lane thread once it is done, not after the worker.
        let gate = Arc::new(Mutex::new(()));
        let closed = lock(&gate);
        let (pool, held, behind) = held_pool(&gate, URGENT_LANE + 3);
        for job in &behind {
            pool.run_next(job.id());
        }
        assert_eq!(
            behind.iter().map(value).collect::<Vec<_>>(),
            (1..=URGENT_LANE + 3).collect::<Vec<_>>()
        );
        drop(closed);
        assert_eq!(value(&held), 0);
    }

    #[test]
    fn after_fork_child_fails_running_jobs_and_refuses_queued_ones() {
        // In-process stand-in for a fork: the "parent's" worker is stuck, so
        // it looks exactly like a thread the child does not have.
        struct Stuck(F, Arc<Mutex<()>>);
        impl Job for Stuck {
            fn run(self: Box<Self>) {
                self.0.set_running();
                drop(lock(&self.1));
            }
            fn cancel(self: Box<Self>) {
                self.0.cancel();
            }
            fn abandon_handle(&self) -> Option<Arc<dyn Abandon>> {
                struct Fail(F);
                impl Abandon for Fail {
                    fn abandon(&self) {
                        self.0.complete(Outcome::Error("abandoned".into()));
                    }
                }
                Some(Arc::new(Fail(self.0.clone())))
            }
        }
        let pool = Pool::new("t", 1);
        let gate = Arc::new(Mutex::new(()));
        let held = lock(&gate);
        let stuck = F::new();
        pool.submit(Box::new(Stuck(stuck.clone(), Arc::clone(&gate))))
            .unwrap();
        let queued = submit(&pool, || 9);
        eventually("the stuck job to run", || {
            stuck.status() == crate::future::Status::Running
        });
        drop(pool.lock_for_fork());
        pool.after_fork_child();
        assert!(stuck.wait_until(Some(Instant::now() + WAIT)));
        assert!(matches!(stuck.outcome(), Some(Outcome::Error(e)) if e == "abandoned"));
        assert!(queued.wait_until(Some(Instant::now() + WAIT)));
        assert!(
            matches!(queued.outcome(), Some(Outcome::Error(e)) if e == "QueuedAtFork"),
            "what was queued runs in the parent only"
        );
        assert_eq!(value(&submit(&pool, || 9)), 9, "new work runs in the child");
        // The stuck worker stands for a thread that no longer exists: it never wakes.
        std::mem::forget(held);
    }

    #[test]
    fn shutdown_cancels_queued_and_refuses_new() {
        let pool = Pool::new("t", 1);
        let gate = Arc::new(Mutex::new(()));
        let held = lock(&gate);
        let g = Arc::clone(&gate);
        let running = submit(&pool, move || {
            drop(lock(&g));
            1
        });
        let queued = submit(&pool, || 2);
        eventually("the first job to leave the queue", || {
            pool.stats().queued == 1
        });
        pool.shutdown();
        assert!(matches!(queued.outcome(), Some(Outcome::Cancelled)));
        drop(held);
        assert_eq!(value(&running), 1, "running work finishes");
        let refused = pool.submit(Box::new(Task {
            f: || 3,
            future: F::new(),
        }));
        assert_eq!(refused, Err(SubmitError::ShutDown));
    }

    #[test]
    fn a_worker_can_take_the_next_job_itself() {
        let pool = Pool::new("t", 1);
        assert!(pool.try_pop().is_none(), "only workers take jobs");
        let p = pool.clone();
        let taken = submit(&pool, move || {
            eventually("a job queued behind this one", || p.stats().queued > 0);
            // Runs the job queued behind this one, on this same thread.
            let next = p.try_pop().expect("queued job");
            next.run();
            7
        });
        let queued = submit(&pool, || 8);
        assert_eq!(value(&taken), 7);
        assert_eq!(value(&queued), 8);
    }

    #[test]
    fn submit_all_runs_every_job() {
        let pool = Pool::new("t", 3);
        let fs: Vec<F> = (0..50).map(|_| F::new()).collect();
        let jobs: Vec<Box<dyn Job>> = fs
            .iter()
            .enumerate()
            .map(|(i, f)| {
                Box::new(Task {
                    f: move || i,
                    future: f.clone(),
                }) as Box<dyn Job>
            })
            .collect();
        pool.submit_all(jobs).unwrap();
        for (i, f) in fs.iter().enumerate() {
            assert_eq!(value(f), i);
        }
        assert!(pool.stats().spawned_total <= 3);
    }

    #[test]
    fn thread_hooks_run_on_start_and_retire() {
        static STARTED: AtomicUsize = AtomicUsize::new(0);
        static STOPPED: Counter = Counter {
            n: Mutex::new(0),
            changed: Condvar::new(),
        };
        let hooks = ThreadHooks {
            start: Some(|| {
                STARTED.fetch_add(1, Ordering::SeqCst);
            }),
            stop: Some(|| {
                STOPPED.add(1);
            }),
        };
        let pool = Pool::with_hooks("t", 2, hooks);
        let fs: Vec<F> = (0..4).map(|i| submit(&pool, move || i)).collect();
        fs.iter().for_each(|f| assert!(value(f) < 4));
        // A spawned thread may not have run its start hook yet: count threads
        // from the pool, and let the hooks catch up.
        let spawned = pool.stats().spawned_total;
        assert!((1..=2).contains(&spawned));
        pool.shutdown();
        let stopped = STOPPED.wait_for("every worker's stop hook", |n| n >= spawned);
        assert_eq!(STARTED.load(Ordering::SeqCst), spawned);
        assert_eq!(stopped, spawned);
    }

    #[test]
    fn waiting_for_threads_to_end_sees_every_stop_hook_done() {
        static STOPPED: AtomicUsize = AtomicUsize::new(0);
        let hooks = ThreadHooks {
            start: None,
            stop: Some(|| {
                STOPPED.fetch_add(1, Ordering::SeqCst);
            }),
        };
        let pool = Pool::with_hooks("t", 3, hooks);
        let fs: Vec<F> = (0..6).map(|i| submit(&pool, move || i)).collect();
        fs.iter().for_each(|f| assert!(value(f) < 6));
        let spawned = pool.stats().spawned_total;
        pool.shutdown();
        // Bounded by a deadline only so that a bug fails instead of hanging.
        let deadline = Instant::now() + Duration::from_secs(60);
        assert!(pool.wait_for_threads_to_end(Some(deadline)));
        // Returned only after every hook had run, not merely once the threads left.
        assert_eq!(STOPPED.load(Ordering::SeqCst), spawned);
        assert_eq!(pool.stats().threads, 0);
    }

    #[test]
    fn resizing_starts_threads_for_queued_work() {
        let pool = Pool::new("t", 1);
        let gate = Arc::new(Mutex::new(()));
        let held = lock(&gate);
        let fs: Vec<F> = (0..4)
            .map(|i| {
                let g = Arc::clone(&gate);
                submit(&pool, move || {
                    drop(lock(&g));
                    i
                })
            })
            .collect();
        pool.set_max_workers(4);
        assert_eq!(pool.max_workers(), 4);
        assert_eq!(pool.stats().threads, 4);
        drop(held);
        for (i, f) in fs.iter().enumerate() {
            assert_eq!(value(f), i);
        }
    }
}
