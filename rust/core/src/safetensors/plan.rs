//! Reading tensors of a safetensors file into new aligned memory: whole
//! tensors, or blocks of them (a shard: a start and stop per axis), several
//! in one call. Plain Rust, tested by `cargo test`.
//!
//! A block of a row-major tensor is a set of contiguous byte runs of the
//! file: one run when only axis 0 is sliced (or nothing is), else one run
//! per combination of indices on the axes before the last sliced one. Every
//! run of every block of one call becomes a [`Piece`]: where its bytes are in
//! the file and where they go.
//!
//! What is read: from a file, exactly the pieces (`preadv`, runs that follow
//! each other in the file in one call, each straight into its block's
//! memory: no byte read twice, none read that no block holds, no copy).
//! Over HTTP, pieces at most [`HTTP_GAP`] bytes apart share one range request
//! (the bytes between them are received and dropped, never stored): a request
//! costs a round trip, and 64 KiB take less time than one on any link over
//! 64 MB/s with 1 ms of latency. Runs of a block split on a later axis are
//! often closer than that; then a request brings the bytes of the other
//! blocks of those rows too, and the server sends more than the block's bytes.
//! A request of more than [`PARALLEL_ABOVE`] bytes is read as parts of at
//! most [`PART`] bytes, range requests in flight at once (scoped threads,
//! each part's bytes straight into the outputs' memory): one TCP stream is
//! slow wherever a server or CDN caps each connection.

use super::convert::{Cast, Overflow};
use super::http::{Failure, RemoteFile, POOL_CONNECTIONS};
use super::local::{preadv_exact, LocalFile};
use super::{count_tensor_bytes, Dtype, TensorInfo};
use crate::buffer::AlignedBuf;
use crate::error::Error;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Over HTTP, pieces at most this many bytes apart share one range request.
pub const HTTP_GAP: u64 = 64 * 1024;

/// Over HTTP, a range request that would cover more than this many bytes is
/// split into parts read at once (each through [`super::http::Http::read_range`],
/// so at most [`super::http::POOL_CONNECTIONS`] requests to one server are
/// in flight, as for any read).
pub const PARALLEL_ABOVE: u64 = 32 << 20;

/// The most bytes of one part of a split request: the request's bytes are
/// shared evenly by as few parts as that allows.
pub const PART: u64 = 16 << 20;

/// [`PARALLEL_ABOVE`] and [`PART`] as reads use them ([`set_parallel_ranges`]).
static PARALLEL: [AtomicU64; 2] = [AtomicU64::new(PARALLEL_ABOVE), AtomicU64::new(PART)];

/// Test hook: requests over `above` bytes are split into parts of at most
/// `part` bytes (at least 1) from now on, in this process. Returns the
/// values before.
pub fn set_parallel_ranges(above: u64, part: u64) -> (u64, u64) {
    (
        PARALLEL[0].swap(above, Ordering::Relaxed),
        PARALLEL[1].swap(part.max(1), Ordering::Relaxed),
    )
}

/// At most this many pieces in one `preadv` (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Bytes of a file a conversion reads at a time (into a stage reused across
/// a read), then converts: the stage stays in cache, so no second pass goes
/// to memory.
const STAGE: usize = 256 * 1024;

/// One contiguous byte range of the file and where it goes: `len` bytes from
/// file offset `src` to offset `dst` of output `out` (for an output that
/// converts, `dst` counts the output's bytes, `len` the file's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Its first byte in the file.
    pub src: u64,
    /// How many bytes.
    pub len: u64,
    /// Which output they go to.
    pub out: usize,
    /// Where in that output.
    pub dst: u64,
}

/// One output of a read: a tensor whole, or one block of it.
#[derive(Debug, Clone, PartialEq)]
pub struct Output {
    /// The tensor's position in the file's tensor list.
    pub tensor: usize,
    /// The block's shape (the tensor's for a whole tensor).
    pub shape: Vec<u64>,
    /// Its size in bytes (of the dtype it holds: the cast's target when it converts).
    pub nbytes: u64,
    /// The conversion made as it is read, if any.
    pub cast: Option<Cast>,
    /// Bytes of one element in the file.
    pub itemsize: u64,
    /// The first file byte it takes (`lo == hi` when it takes none).
    pub lo: u64,
    /// One past the last file byte it takes.
    pub hi: u64,
    /// How many runs it is read from.
    pub runs: usize,
    /// `" shard [0:4, :]"` for a block that is not the whole tensor, else empty.
    pub label: String,
}

/// What one call reads: its outputs, and every piece in file order.
#[derive(Debug, Default)]
pub struct Plan {
    /// What the call returns, in the order asked.
    pub outputs: Vec<Output>,
    /// Every piece, in file order.
    pub pieces: Vec<Piece>,
    /// Per output, whether it is still wanted (false once its leaf was
    /// cancelled); an output without one always is.
    pub wanted: Vec<Option<Wanted>>,
}

/// Asks whether an output is still wanted; called without any lock held,
/// between chunks of a read.
pub struct Wanted(pub Box<dyn Fn() -> bool + Send + Sync>);

impl std::fmt::Debug for Wanted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Wanted(..)")
    }
}

fn block_label(shape: &[u64], bounds: &[(u64, u64)]) -> String {
    if bounds
        .iter()
        .zip(shape)
        .all(|(&(a, b), &d)| a == 0 && b == d)
    {
        return String::new();
    }
    let axes: Vec<String> = bounds
        .iter()
        .zip(shape)
        .map(|(&(a, b), &d)| {
            if a == 0 && b == d {
                ":".to_owned()
            } else {
                format!("{a}:{b}")
            }
        })
        .collect();
    format!(" shard [{}]", axes.join(", "))
}

impl Plan {
    /// Adds tensor `tensor` of `tensors`, whole (`bounds` None) or the block
    /// `bounds` (a start and stop per axis, as `index[k].indices(dim)` gives),
    /// converted to `to` as it is read when `to` is another dtype (one that
    /// [`Cast::new`] takes, else an error).
    pub fn add(
        &mut self,
        tensors: &[TensorInfo],
        tensor: usize,
        bounds: Option<&[(u64, u64)]>,
        to: Option<Dtype>,
    ) -> Result<(), Error> {
        let t = tensors.get(tensor).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "read: tensor index {tensor} out of range for {} tensors",
                tensors.len()
            ))
        })?;
        let full: Vec<(u64, u64)>;
        let bounds = match bounds {
            Some(b) => b,
            None => {
                full = t.shape.iter().map(|&d| (0, d)).collect();
                &full
            }
        };
        if bounds.len() != t.shape.len()
            || bounds
                .iter()
                .zip(&t.shape)
                .any(|(&(a, b), &d)| a > b || b > d)
        {
            return Err(Error::InvalidArgument(format!(
                "read: tensor {:?} of shape {:?}: block {bounds:?} is not (start, stop) per axis \
                 within the shape",
                t.name, t.shape
            )));
        }
        let cast = match to {
            Some(to) if to != t.dtype => Some(Cast::new(t.dtype, to).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "read: tensor {:?}: the core converts only between float16, bfloat16, \
                     float32 and float64, not {} to {}",
                    t.name,
                    t.dtype.numpy_name(),
                    to.numpy_name()
                ))
            })?),
            _ => None,
        };
        let out = self.outputs.len();
        let itemsize = t.dtype.itemsize();
        let shape: Vec<u64> = bounds.iter().map(|&(a, b)| b - a).collect();
        let elements = shape.iter().product::<u64>();
        let nbytes = elements * cast.map_or(itemsize, |c| c.to.itemsize());
        let first = self.pieces.len();
        if nbytes > 0 {
            // Byte strides of the tensor's axes, row-major.
            let mut strides = vec![itemsize; t.shape.len()];
            for k in (0..t.shape.len().saturating_sub(1)).rev() {
                strides[k] = strides[k + 1] * t.shape[k + 1];
            }
            // The last sliced axis: every axis after it is whole, so a run
            // spans it and them.
            let last = (0..bounds.len())
                .rev()
                .find(|&k| bounds[k] != (0, t.shape[k]))
                .unwrap_or(0);
            let run = if bounds.is_empty() {
                itemsize
            } else {
                (bounds[last].1 - bounds[last].0) * strides[last]
            };
            let base = t.start
                + bounds
                    .iter()
                    .zip(&strides)
                    .map(|(&(a, _), &s)| a * s)
                    .sum::<u64>();
            // An odometer over the axes before `last`, row-major.
            let mut at: Vec<u64> = bounds[..last].iter().map(|&(a, _)| a).collect();
            let mut dst = 0;
            loop {
                let src = base
                    + at.iter()
                        .zip(bounds)
                        .zip(&strides)
                        .map(|((&i, &(a, _)), &s)| (i - a) * s)
                        .sum::<u64>();
                self.pieces.push(Piece {
                    src,
                    len: run,
                    out,
                    dst,
                });
                dst += cast.map_or(run, |c| c.out_len(run));
                let mut wrapped = true;
                for k in (0..at.len()).rev() {
                    at[k] += 1;
                    if at[k] < bounds[k].1 {
                        wrapped = false;
                        break;
                    }
                    at[k] = bounds[k].0;
                }
                if wrapped {
                    break;
                }
            }
            debug_assert_eq!(dst, nbytes);
        }
        let mine = &self.pieces[first..];
        let (lo, hi) = match (mine.first(), mine.last()) {
            (Some(a), Some(b)) => (a.src, b.src + b.len),
            _ => (t.start, t.start),
        };
        self.outputs.push(Output {
            tensor,
            shape,
            nbytes,
            cast,
            itemsize,
            lo,
            hi,
            runs: mine.len(),
            label: block_label(&t.shape, bounds),
        });
        Ok(())
    }

    /// Whether output `out` is still to be read: not failed and still wanted.
    fn to_read(&self, out: usize, results: &[Result<AlignedBuf, Error>], failed: &Failed) -> bool {
        results[out].is_ok()
            && failed[out].get().is_none()
            && self
                .wanted
                .get(out)
                .and_then(Option::as_ref)
                .is_none_or(|w| (w.0)())
    }

    /// Puts the pieces in file order (once, after the last `add`).
    pub fn sort(&mut self) {
        self.pieces.sort_unstable_by_key(|p| p.src);
    }

    /// The message prefix of output `out`: file, tensor, block, bytes.
    fn here(&self, source: &str, tensors: &[TensorInfo], out: usize) -> String {
        let o = &self.outputs[out];
        let runs = if o.runs > 1 {
            format!(" in {} runs", o.runs)
        } else {
            String::new()
        };
        format!(
            "{source}: tensor {:?}{} (bytes [{}, {}){runs})",
            tensors[o.tensor].name, o.label, o.lo, o.hi
        )
    }

    /// The errors of every output that has a piece in `group` and has not
    /// failed yet (`failed`), each naming its own tensor and bytes (and the
    /// read's bytes, `[start, end)`, when the read held more than that output).
    #[allow(clippy::too_many_arguments)]
    fn fail_group(
        &self,
        source: &str,
        tensors: &[TensorInfo],
        group: &[Piece],
        (start, end): (u64, u64),
        failure: &Failure,
        failed: impl Fn(usize) -> bool,
    ) -> Vec<(usize, Error)> {
        let mut errors: Vec<(usize, Error)> = Vec::new();
        for p in group {
            if failed(p.out) || errors.iter().any(|(out, _)| *out == p.out) {
                continue;
            }
            let o = &self.outputs[p.out];
            let here = self.here(source, tensors, p.out);
            let detail = if (o.lo, o.hi) == (start, end) {
                failure.clone()
            } else {
                Failure {
                    detail: format!(
                        "{} (the read of bytes [{start}, {end}) that held it)",
                        failure.detail
                    ),
                    ..failure.clone()
                }
            };
            errors.push((p.out, detail.at(&here)));
        }
        errors
    }

    fn allocate(&self) -> Vec<Result<AlignedBuf, Error>> {
        self.outputs
            .iter()
            .map(|o| {
                let n = o.nbytes as usize;
                AlignedBuf::uninit(n).ok_or(Error::OutOfMemory(n))
            })
            .collect()
    }

    /// Reads every output from a local file. An output fails alone (its
    /// error names it); the others are still read.
    ///
    /// The file is checked against its header read before and after the
    /// reads ([`LocalFile::changed`]): after a change every output fails.
    pub fn read_local(&self, file: &LocalFile) -> Vec<Result<AlignedBuf, Error>> {
        let mut results = self.allocate();
        if let Some(why) = file.changed() {
            self.fail_all(&file.path, &file.tensors, &why, &mut results);
            return results;
        }
        let mut i = 0;
        let mut stage = Vec::new();
        while i < self.pieces.len() {
            if let Some(cast) = self.outputs[self.pieces[i].out].cast {
                let p = self.pieces[i];
                i += 1;
                if results[p.out].is_ok() {
                    self.read_converted(file, p, cast, &mut stage, &mut results);
                }
                continue;
            }
            // Pieces that follow each other in the file: one preadv.
            let mut j = i + 1;
            while j < self.pieces.len()
                && j - i < IOV_MAX
                && self.pieces[j].src == self.pieces[j - 1].src + self.pieces[j - 1].len
                && self.outputs[self.pieces[j].out].cast.is_none()
            {
                j += 1;
            }
            let group = &self.pieces[i..j];
            i = j;
            if group.iter().all(|p| results[p.out].is_err()) {
                continue;
            }
            let mut iov: Vec<libc::iovec> = Vec::with_capacity(group.len());
            let mut scratch: Vec<Vec<u8>> = Vec::new();
            for p in group {
                let base = match &results[p.out] {
                    // SAFETY: `dst + len <= nbytes` of that output's buffer,
                    // which nobody else sees yet.
                    Ok(buf) => unsafe { buf.as_ptr().add(p.dst as usize) },
                    // Its output failed already: read into scratch (rare).
                    Err(_) => {
                        scratch.push(vec![0u8; p.len as usize]);
                        scratch
                            .last_mut()
                            .map_or(std::ptr::null_mut(), |v| v.as_mut_ptr())
                    }
                };
                iov.push(libc::iovec {
                    iov_base: base.cast(),
                    iov_len: p.len as usize,
                });
            }
            if let Err(failure) = preadv_exact(&file.file, &mut iov, group[0].src) {
                let span = (
                    group[0].src,
                    group[group.len() - 1].src + group[group.len() - 1].len,
                );
                let errors =
                    self.fail_group(&file.path, &file.tensors, group, span, &failure, |o| {
                        results[o].is_err()
                    });
                for (out, err) in errors {
                    results[out] = Err(err);
                }
            }
        }
        if let Some(why) = file.changed() {
            self.fail_all(&file.path, &file.tensors, &why, &mut results);
        }
        results
    }

    /// Fails every output not failed yet with `why` (an `OSError`), each
    /// error naming its own tensor and bytes.
    /// Reads one piece of an output that converts: a stage at a time into
    /// `stage` (reused), each converted into the output's memory.
    fn read_converted(
        &self,
        file: &LocalFile,
        p: Piece,
        cast: Cast,
        stage: &mut Vec<u8>,
        results: &mut [Result<AlignedBuf, Error>],
    ) {
        let step = (STAGE as u64 / cast.from.itemsize()).max(1) * cast.from.itemsize();
        let mut done = 0;
        while done < p.len {
            let n = step.min(p.len - done);
            stage.resize(n as usize, 0);
            let mut iov = [libc::iovec {
                iov_base: stage.as_mut_ptr().cast(),
                iov_len: n as usize,
            }];
            let outcome = preadv_exact(&file.file, &mut iov, p.src + done)
                .map_err(|failure| failure.at(&self.here(&file.path, &file.tensors, p.out)))
                .and_then(|()| {
                    self.convert_into(&file.path, &file.tensors, p, done, stage, cast, results)
                });
            if let Err(err) = outcome {
                results[p.out] = Err(err);
                return;
            }
            done += n;
        }
    }

    /// Converts `src`, the piece's file bytes from `offset` (whole elements),
    /// into its output's memory; an overflow is the output's error.
    #[allow(clippy::too_many_arguments)]
    fn convert_into(
        &self,
        source: &str,
        tensors: &[TensorInfo],
        p: Piece,
        offset: u64,
        src: &[u8],
        cast: Cast,
        results: &[Result<AlignedBuf, Error>],
    ) -> Result<(), Error> {
        let Ok(buf) = &results[p.out] else {
            return Ok(());
        };
        let at = (p.dst + cast.out_len(offset)) as usize;
        let len = cast.out_len(src.len() as u64) as usize;
        // SAFETY: the output owns `nbytes` bytes, nobody else sees them yet,
        // and `at + len <= dst + out_len(piece len) <= nbytes`.
        let dst = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr().add(at), len) };
        cast.run(src, dst).map_err(|Overflow { index, value }| {
            let element = (offset / cast.from.itemsize()) as usize + index;
            Error::Overflow(format!(
                "{}: {} value {value} (element {element} of the piece at byte {}) is finite but \
                 beyond {}'s range (it would become inf)",
                self.here(source, tensors, p.out),
                cast.from.numpy_name(),
                p.src,
                cast.to.numpy_name()
            ))
        })
    }

    /// Converts the bytes `part` of piece `p` (from byte `offset` of it, as
    /// they arrive over HTTP) into its output: whole elements at once, the
    /// start of one cut by the chunk's end kept in `carry` for the next.
    #[allow(clippy::too_many_arguments)]
    fn convert_chunk(
        &self,
        file: &RemoteFile,
        p: Piece,
        offset: u64,
        mut part: &[u8],
        cast: Cast,
        carry: &mut Vec<u8>,
        results: &[Result<AlignedBuf, Error>],
    ) -> Result<(), Error> {
        let size = cast.from.itemsize() as usize;
        let mut at = offset - carry.len() as u64;
        if !carry.is_empty() {
            let take = (size - carry.len()).min(part.len());
            carry.extend_from_slice(&part[..take]);
            part = &part[take..];
            if carry.len() < size {
                return Ok(());
            }
            let one = std::mem::take(carry);
            self.convert_into(&file.name, &file.tensors, p, at, &one, cast, results)?;
            at += size as u64;
        }
        let whole = part.len() / size * size;
        carry.extend_from_slice(&part[whole..]);
        self.convert_into(
            &file.name,
            &file.tensors,
            p,
            at,
            &part[..whole],
            cast,
            results,
        )
    }

    fn fail_all(
        &self,
        source: &str,
        tensors: &[TensorInfo],
        why: &str,
        results: &mut [Result<AlignedBuf, Error>],
    ) {
        for (out, result) in results.iter_mut().enumerate() {
            if result.is_ok() {
                *result = Err(Failure::io(why.to_owned()).at(&self.here(source, tensors, out)));
            }
        }
    }

    /// Reads every output over HTTP: pieces at most [`HTTP_GAP`] bytes apart
    /// in one range request, a request of more than [`PARALLEL_ABOVE`] bytes
    /// as parts read at once ([`Plan::parts`]). A failed request fails the
    /// outputs it held, each error naming its own tensor and bytes; other
    /// requests go on (the other parts of a split one stop once none of
    /// their outputs is still to be read).
    pub fn read_remote(&self, file: &RemoteFile) -> Vec<Result<AlignedBuf, Error>> {
        let mut results = self.allocate();
        let failed: Failed = (0..self.outputs.len()).map(|_| OnceLock::new()).collect();
        let above = PARALLEL[0].load(Ordering::Relaxed);
        let part = PARALLEL[1].load(Ordering::Relaxed);
        let mut i = 0;
        while i < self.pieces.len() {
            let mut j = i + 1;
            let mut end = self.pieces[i].src + self.pieces[i].len;
            // (A piece that overlaps the request so far, the same tensor asked
            // for twice, starts a request of its own.)
            // A server that ignores Range sends the file from its first byte
            // at every request: one request then reads every piece.
            let gap = if file.ranged() { HTTP_GAP } else { u64::MAX };
            while j < self.pieces.len()
                && self.pieces[j].src >= end
                && self.pieces[j].src.saturating_sub(end) <= gap
            {
                end = end.max(self.pieces[j].src + self.pieces[j].len);
                j += 1;
            }
            let group = &self.pieces[i..j];
            i = j;
            let start = group[0].src;
            let parts = if file.ranged() && end - start > above {
                self.parts(group, start, end, part)
            } else {
                Vec::new()
            };
            if parts.len() > 1 {
                // Workers take the next part until none is left: this thread
                // and up to POOL_CONNECTIONS - 1 more (fewer if the system
                // refuses a thread).
                let next = AtomicUsize::new(0);
                let work = || loop {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&(a, b)) = parts.get(n) else {
                        break;
                    };
                    let first = group.partition_point(|p| p.src + p.len <= a);
                    let last = group.partition_point(|p| p.src < b);
                    self.read_span(file, &group[first..last], a, b, &results, &failed);
                };
                std::thread::scope(|scope| {
                    for _ in 1..parts.len().min(POOL_CONNECTIONS) {
                        let spawned = std::thread::Builder::new()
                            .name("aa-http-part".into())
                            .spawn_scoped(scope, work);
                        if spawned.is_err() {
                            break;
                        }
                    }
                    work();
                });
            } else {
                self.read_span(file, group, start, end, &results, &failed);
            }
        }
        for (result, failed) in results.iter_mut().zip(failed) {
            if let Some(err) = failed.into_inner() {
                *result = Err(err);
            }
        }
        results
    }

    /// Splits the request `[start, end)` that holds `group` (pieces in file
    /// order) into parts of at most about `part` bytes, shared evenly: the
    /// parts cover `[start, end)` exactly, in order, and each boundary that
    /// falls inside a piece falls on an element boundary of it (moved back
    /// to the element's start), so that a part converts whole elements.
    pub fn parts(&self, group: &[Piece], start: u64, end: u64, part: u64) -> Vec<(u64, u64)> {
        let len = end - start;
        let count = len.div_ceil(part.max(1)).max(1);
        let size = len.div_ceil(count);
        let mut parts: Vec<(u64, u64)> = Vec::with_capacity(count as usize);
        let mut from = start;
        for k in 1..count {
            let mut at = start + k * size;
            let cut = group.partition_point(|p| p.src + p.len <= at);
            if let Some(p) = group.get(cut).filter(|p| p.src < at) {
                let item = self.outputs[p.out].itemsize.max(1);
                at = p.src + (at - p.src) / item * item;
            }
            if at > from {
                parts.push((from, at));
                from = at;
            }
        }
        parts.push((from, end));
        parts
    }

    /// Reads bytes `[start, end)` of the file, one range request, into the
    /// pieces of `group` (those it holds, in file order; the first and the
    /// last may start before `start` or end after `end`, at an element
    /// boundary). A failure is recorded in `failed` for the outputs it held.
    fn read_span(
        &self,
        file: &RemoteFile,
        group: &[Piece],
        start: u64,
        end: u64,
        results: &[Result<AlignedBuf, Error>],
        failed: &Failed,
    ) {
        if !group.iter().any(|p| self.to_read(p.out, results, failed)) {
            return; // failed or cancelled, all of them: no request
        }
        let mut pos = start;
        let mut k = 0;
        // The start of an element that a converting output still waits
        // the rest of (a chunk may end inside one).
        let mut carry: Vec<u8> = Vec::new();
        let read = file.http.read_range(
            &file.target,
            start,
            end,
            false,
            Some(&file.version),
            &mut |mut chunk| {
                count_tensor_bytes(chunk.len() as u64);
                while !chunk.is_empty() && k < group.len() {
                    let p = group[k];
                    if pos < p.src {
                        let skip = ((p.src - pos) as usize).min(chunk.len());
                        chunk = &chunk[skip..];
                        pos += skip as u64;
                        continue;
                    }
                    let n = ((p.src + p.len - pos) as usize).min(chunk.len());
                    if failed[p.out].get().is_some() {
                        // Its output failed already: the bytes are dropped.
                    } else if let Some(cast) = self.outputs[p.out].cast {
                        let offset = pos - p.src;
                        if let Err(err) = self.convert_chunk(
                            file,
                            p,
                            offset,
                            &chunk[..n],
                            cast,
                            &mut carry,
                            results,
                        ) {
                            let _ = failed[p.out].set(err);
                        }
                    } else if let Ok(buf) = &results[p.out] {
                        // SAFETY: the buffer owns `nbytes` bytes, nobody else
                        // sees it yet, this request alone writes these bytes
                        // (the parts of a request are disjoint), and
                        // `dst + (pos - src) + n <= dst + len <= nbytes`.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                chunk.as_ptr(),
                                buf.as_ptr().add((p.dst + pos - p.src) as usize),
                                n,
                            )
                        };
                    }
                    chunk = &chunk[n..];
                    pos += n as u64;
                    if pos == p.src + p.len {
                        k += 1;
                    }
                }
                // Go on while a piece still to come is wanted (or the
                // body is complete: nothing is left to drop).
                k >= group.len()
                    || group[k..]
                        .iter()
                        .any(|p| self.to_read(p.out, results, failed))
            },
        );
        if let Err(failure) = read {
            let errors = self.fail_group(
                &file.name,
                &file.tensors,
                group,
                (start, end),
                &failure,
                |o| results[o].is_err() || failed[o].get().is_some(),
            );
            for (out, err) in errors {
                let _ = failed[out].set(err);
            }
        }
    }
}

/// Per output, its error once a read failed it (set once, from any part).
type Failed = Vec<OnceLock<Error>>;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::safetensors::tensor_bytes_read;

    fn tensor(shape: &[u64], start: u64) -> TensorInfo {
        let n: u64 = shape.iter().product::<u64>() * 4;
        TensorInfo {
            name: "t".into(),
            dtype: Dtype::F32,
            shape: shape.to_vec(),
            start,
            end: start + n,
        }
    }

    fn pieces(shape: &[u64], bounds: &[(u64, u64)]) -> (Plan, Vec<(u64, u64)>) {
        let t = [tensor(shape, 100)];
        let mut plan = Plan::default();
        plan.add(&t, 0, Some(bounds), None).unwrap();
        let runs = plan.pieces.iter().map(|p| (p.src, p.len)).collect();
        (plan, runs)
    }

    #[test]
    fn a_block_sliced_on_axis_0_is_one_run() {
        let (plan, runs) = pieces(&[8, 4], &[(2, 6), (0, 4)]);
        assert_eq!(runs, vec![(100 + 2 * 16, 4 * 16)]);
        assert_eq!(plan.outputs[0].label, " shard [2:6, :]");
        let (plan, runs) = pieces(&[8, 4], &[(0, 8), (0, 4)]);
        assert_eq!(runs, vec![(100, 128)]);
        assert_eq!(plan.outputs[0].label, "");
    }

    #[test]
    fn a_block_sliced_on_a_later_axis_is_one_run_a_row() {
        let (plan, runs) = pieces(&[3, 4], &[(0, 3), (2, 4)]);
        assert_eq!(runs, vec![(108, 8), (124, 8), (140, 8)]);
        let dsts: Vec<u64> = plan.pieces.iter().map(|p| p.dst).collect();
        assert_eq!(dsts, vec![0, 8, 16]);
        assert_eq!(plan.outputs[0].nbytes, 24);
        assert_eq!((plan.outputs[0].lo, plan.outputs[0].hi), (108, 148));
        // Three axes, the middle one sliced: a run spans the last axis.
        let (_, runs) = pieces(&[2, 4, 3], &[(0, 2), (1, 3), (0, 3)]);
        assert_eq!(runs, vec![(112, 24), (160, 24)]);
        // Empty blocks and scalars.
        let (plan, runs) = pieces(&[2, 4], &[(1, 1), (0, 4)]);
        assert!(runs.is_empty() && plan.outputs[0].nbytes == 0);
        let (_, runs) = pieces(&[], &[]);
        assert_eq!(runs, vec![(100, 4)]);
    }

    #[test]
    fn a_request_splits_into_parts_on_element_boundaries() {
        // Three tensors back to back from an odd offset: float64 converted to
        // float32, float32 read as it is, float64 converted; a block of the
        // last, so that its runs leave gaps in the request.
        let mut tensors = vec![
            tensor(&[1000], 101),
            tensor(&[999], 0),
            tensor(&[40, 30], 0),
        ];
        tensors[0].dtype = Dtype::F64;
        tensors[0].end = 101 + 8000;
        tensors[1].start = tensors[0].end;
        tensors[1].end = tensors[1].start + 3996;
        tensors[2].dtype = Dtype::F64;
        tensors[2].start = tensors[1].end;
        tensors[2].end = tensors[2].start + 40 * 30 * 8;
        let mut plan = Plan::default();
        plan.add(&tensors, 0, None, Some(Dtype::F32)).unwrap();
        plan.add(&tensors, 1, None, None).unwrap();
        plan.add(&tensors, 2, Some(&[(0, 40), (3, 29)]), Some(Dtype::F32))
            .unwrap();
        plan.sort();
        let (start, end) = (plan.pieces[0].src, {
            let p = plan.pieces.last().unwrap();
            p.src + p.len
        });
        for part in [1, 7, 100, 997, 1000, 4096, 20_000, 30_000] {
            let parts = plan.parts(&plan.pieces, start, end, part);
            // Exact coverage, in order, none empty, none much above `part`.
            assert_eq!(parts[0].0, start);
            assert_eq!(parts.last().unwrap().1, end);
            for w in parts.windows(2) {
                assert_eq!(w[0].1, w[1].0);
            }
            let size = (end - start).div_ceil((end - start).div_ceil(part));
            for &(a, b) in &parts {
                assert!(a < b && b - a <= size + 8, "{part}: [{a}, {b})");
            }
            // Every boundary inside a piece is on an element boundary of it.
            for &(_, b) in &parts[..parts.len() - 1] {
                for p in plan
                    .pieces
                    .iter()
                    .filter(|p| p.src < b && b < p.src + p.len)
                {
                    let item = tensors[plan.outputs[p.out].tensor].dtype.itemsize();
                    assert_eq!((b - p.src) % item, 0, "{part}: {b} cuts {p:?}");
                }
            }
            if part >= 997 {
                assert_eq!(parts.len() as u64, (end - start).div_ceil(part));
            }
        }
        // Under the part size: one part, the request.
        assert_eq!(
            plan.parts(&plan.pieces, start, end, end),
            vec![(start, end)]
        );
    }

    #[test]
    fn blocks_out_of_bounds_are_refused() {
        let t = [tensor(&[3, 4], 0)];
        let mut plan = Plan::default();
        assert!(plan.add(&t, 0, Some(&[(0, 4), (0, 4)]), None).is_err());
        assert!(plan.add(&t, 0, Some(&[(2, 1), (0, 4)]), None).is_err());
        assert!(plan.add(&t, 0, Some(&[(0, 3)]), None).is_err());
        assert!(plan.add(&t, 1, None, None).is_err());
    }

    #[test]
    fn local_reads_scatter_blocks_bit_exact() {
        let dir = std::env::temp_dir().join(format!("readplan-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let values: Vec<f32> = (0..60).map(|v| v as f32).collect();
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let json = r#"{"t":{"dtype":"F32","shape":[5,12],"data_offsets":[0,240]}}"#;
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json.as_bytes());
        bytes.extend_from_slice(&data);
        std::fs::write(&path, &bytes).unwrap();
        let file = LocalFile::open(&path).unwrap();
        let mut plan = Plan::default();
        for c in 0..3 {
            plan.add(&file.tensors, 0, Some(&[(1, 4), (c * 4, c * 4 + 4)]), None)
                .unwrap();
        }
        plan.add(&file.tensors, 0, None, None).unwrap();
        plan.sort();
        let before = tensor_bytes_read();
        let out = plan.read_local(&file);
        // Three blocks of 3x4 and the whole tensor: nothing more.
        assert_eq!(tensor_bytes_read() - before, 3 * 48 + 240);
        for (c, buf) in out[..3].iter().enumerate() {
            let buf = buf.as_ref().unwrap();
            // SAFETY: 48 initialized bytes.
            let got = unsafe { std::slice::from_raw_parts(buf.as_ptr(), 48) };
            let want: Vec<u8> = (1..4)
                .flat_map(|r| (0..4).map(move |k| (r * 12 + c * 4 + k) as f32))
                .flat_map(|v| v.to_le_bytes())
                .collect();
            assert_eq!(got, &want[..]);
        }
        let whole = out[3].as_ref().unwrap();
        // SAFETY: 240 initialized bytes.
        assert_eq!(
            unsafe { std::slice::from_raw_parts(whole.as_ptr(), 240) },
            &data[..]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
