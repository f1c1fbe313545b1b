//! Rust benches of the core: `cargo bench --bench core` (add `-- --sample-count 20`
//! for a short run, as `make bench` does).
//!
//! Each group has a plain-Rust twin where one exists: create + complete + wait
//! of one future (under 1 us), wake-up latency across threads, `wait_all` over
//! 100k futures, pool submit-to-done throughput by worker count. `benches/run_all.py` reads
//! the medians from divan's table by these names, so rename both together.

use async_array_core::future::waits::wait_all;
use async_array_core::future::{Future, Outcome};
use async_array_core::pool::{Job, Pool};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

fn main() {
    divan::main();
}

type F = Future<u64, ()>;

/// One future on one thread: the registry cost a leaf pays at least once.
mod future_create_complete_wait {
    use super::*;

    // Fixed sample sizes: a sample must be far above the 20 ns timer precision,
    // and divan's own calibration sometimes settles on 1 on a busy machine.
    #[divan::bench(sample_size = 1000)]
    fn async_array() -> bool {
        let f = F::new();
        f.set_running();
        f.complete(Outcome::Value(divan::black_box(7)));
        f.wait_until(None)
    }

    /// Twin: a one-shot std channel (create, send, receive).
    #[divan::bench(sample_size = 1000)]
    fn std_mpsc() -> u64 {
        let (tx, rx) = mpsc::sync_channel(1);
        tx.send(divan::black_box(7)).unwrap();
        rx.recv().unwrap()
    }
}

/// A ping-pong with a thread that lives for the whole bench: the main thread
/// completes `ping`, the echo thread (asleep on it) wakes and completes `pong`,
/// the main thread wakes. One iteration is two cross-thread wake-ups. The pairs
/// are made (and queued to the echo thread) outside the timed part.
mod wake_up_round_trip {
    use super::*;

    #[divan::bench]
    fn async_array(bencher: divan::Bencher) {
        let (tx, rx) = mpsc::channel::<(F, F)>();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let echo = thread::spawn(move || {
            for (ping, pong) in rx {
                // A pair divan made but never ran must not hang the echo thread.
                while !ping.wait_until(Some(Instant::now() + Duration::from_millis(10))) {
                    if stopped.load(Ordering::Relaxed) {
                        return;
                    }
                }
                pong.complete(Outcome::Value(1));
            }
        });
        bencher
            .with_inputs(|| {
                let (ping, pong) = (F::new(), F::new());
                tx.send((ping.clone(), pong.clone())).unwrap();
                (ping, pong)
            })
            .bench_local_values(|(ping, pong)| {
                ping.complete(Outcome::Value(1));
                pong.wait_until(None)
            });
        stop.store(true, Ordering::Relaxed);
        drop(tx);
        echo.join().unwrap();
    }

    /// Twin: the same ping-pong over one-shot std channels.
    #[divan::bench]
    fn std_mpsc(bencher: divan::Bencher) {
        type Pair = (mpsc::Receiver<u64>, mpsc::SyncSender<u64>);
        let (tx, rx) = mpsc::channel::<Pair>();
        let echo = thread::spawn(move || {
            for (ping, pong) in rx {
                if let Ok(v) = ping.recv() {
                    let _ = pong.send(v);
                }
            }
        });
        bencher
            .with_inputs(|| {
                let (ping_tx, ping_rx) = mpsc::sync_channel(1);
                let (pong_tx, pong_rx) = mpsc::sync_channel(1);
                tx.send((ping_rx, pong_tx)).unwrap();
                (ping_tx, pong_rx)
            })
            .bench_local_values(|(ping, pong)| {
                ping.send(1).unwrap();
                pong.recv().unwrap()
            });
        drop(tx);
        echo.join().unwrap();
    }
}

/// `wait_all` over 100k futures.
mod wait_all_100k {
    use super::*;

    const N: usize = 100_000;

    /// Every future already finished: the cost of looking.
    #[divan::bench(sample_size = 10)]
    fn finished(bencher: divan::Bencher) {
        let fs: Vec<F> = (0..N)
            .map(|i| {
                let f = F::new();
                f.complete(Outcome::Value(i as u64));
                f
            })
            .collect();
        bencher.bench(|| wait_all(&fs, None));
    }

    /// Completed one by one by another thread while this one waits (the
    /// thread's start, about 30 us, is inside the timing).
    #[divan::bench]
    fn completed_meanwhile(bencher: divan::Bencher) {
        bencher
            .with_inputs(|| {
                let fs: Vec<F> = (0..N).map(|_| F::new()).collect();
                let theirs = fs.clone();
                (fs, theirs)
            })
            .bench_local_values(|(fs, theirs)| {
                let t = thread::spawn(move || {
                    for (i, f) in theirs.iter().enumerate() {
                        f.complete(Outcome::Value(i as u64));
                    }
                    theirs
                });
                let all = wait_all(&fs, None);
                (all, fs, t.join().unwrap()) // dropped outside the timing
            });
    }
}

struct Done(F);

impl Job for Done {
    fn run(self: Box<Self>) {
        self.0.set_running();
        self.0.complete(Outcome::Value(1));
    }
    fn cancel(self: Box<Self>) {
        self.0.cancel();
    }
}

/// 10k trivial jobs from submit to done, by worker count: the pool's own
/// overhead (queue, wake-ups, completion). `one_by_one` is `submit` per job
/// (`aa.async_wrap`), `batch` is one `submit_all` (`aa.async_map`).
mod pool_submit_to_done_10k {
    use super::*;

    const JOBS: usize = 10_000;

    fn bench(bencher: divan::Bencher, workers: usize, batch: bool) {
        let pool = Pool::new("bench", workers);
        bencher.bench(|| {
            let fs: Vec<F> = (0..JOBS).map(|_| F::new()).collect();
            let jobs = fs.iter().map(|f| Box::new(Done(f.clone())) as Box<dyn Job>);
            if batch {
                pool.submit_all(jobs.collect()).unwrap();
            } else {
                jobs.for_each(|job| pool.submit(job).unwrap());
            }
            wait_all(&fs, None)
        });
        pool.shutdown();
    }

    #[divan::bench(args = [1, 2, 4, 8])]
    fn one_by_one(bencher: divan::Bencher, workers: usize) {
        bench(bencher, workers, false);
    }

    #[divan::bench(args = [1, 2, 4, 8])]
    fn batch(bencher: divan::Bencher, workers: usize) {
        bench(bencher, workers, true);
    }
}
