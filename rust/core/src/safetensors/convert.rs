//! Dtype conversion while reading: a tensor stored as one floating-point
//! type lands in memory of another (a float32 checkpoint into bfloat16
//! parameters) in the same pass that reads it, block by block, instead of a
//! second pass over the whole tensor afterwards.
//!
//! Only the floating-point types of IEEE and bfloat16 layouts convert here
//! (float16, bfloat16, float32, float64, each way); values round to nearest
//! even (`half`'s conversions, Rust's `as` for float64 to float32). A finite
//! value that would become infinite is an overflow, as the Python side's
//! checked casts refuse it.

use super::Dtype;

/// Elements converted per block: a block's float32 staging fits in L1.
const BLOCK: usize = 1024;

/// A conversion the core makes while reading: `from` as stored, `to` as the
/// leaf holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cast {
    /// The tensor's dtype in the file.
    pub from: Dtype,
    /// The dtype the leaf's memory holds.
    pub to: Dtype,
}

/// The dtypes [`Cast`] converts between.
pub const CONVERTIBLE: [Dtype; 4] = [Dtype::F16, Dtype::Bf16, Dtype::F32, Dtype::F64];

/// A finite value that the target dtype cannot hold (it would become
/// infinite): its index among the elements converted, and the value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Overflow {
    /// Index of the element, from the start of the slice given.
    pub index: usize,
    /// The value as read, widened to float64.
    pub value: f64,
}

impl Cast {
    /// The conversion from `from` to `to`, when the core makes it (both in
    /// [`CONVERTIBLE`] and different).
    pub fn new(from: Dtype, to: Dtype) -> Option<Cast> {
        (from != to && CONVERTIBLE.contains(&from) && CONVERTIBLE.contains(&to))
            .then_some(Cast { from, to })
    }

    /// Bytes of output for `n` bytes of input (whole elements).
    pub fn out_len(&self, n: u64) -> u64 {
        n / self.from.itemsize() * self.to.itemsize()
    }

    /// Converts the whole elements of `src` (little-endian, as safetensors
    /// stores them) into `dst`, which holds exactly as many elements of the
    /// target type. Stops at the first finite value the target cannot hold.
    pub fn run(&self, src: &[u8], dst: &mut [u8]) -> Result<(), Overflow> {
        let (fs, ts) = (self.from.itemsize() as usize, self.to.itemsize() as usize);
        let n = src.len() / fs;
        debug_assert_eq!(dst.len(), n * ts);
        let wide = self.from == Dtype::F64 || self.to == Dtype::F64;
        let mut at = 0;
        while at < n {
            let m = (n - at).min(BLOCK);
            let (s, d) = (
                &src[at * fs..(at + m) * fs],
                &mut dst[at * ts..(at + m) * ts],
            );
            let found = if wide {
                let mut block = [0f64; BLOCK];
                decode(self.from, s, &mut block[..m]);
                encode(self.to, &block[..m], d)
            } else {
                let mut block = [0f32; BLOCK];
                decode(self.from, s, &mut block[..m]);
                encode(self.to, &block[..m], d)
            };
            if let Some(k) = found {
                let mut value = [0f64; 1];
                decode(self.from, &s[k * fs..(k + 1) * fs], &mut value);
                return Err(Overflow {
                    index: at + k,
                    value: value[0],
                });
            }
            at += m;
        }
        Ok(())
    }
}

/// A float type a block is staged in: float32, or float64 when either side is.
trait Stage: Copy {
    fn from_f64(v: f64) -> Self;
    fn from_f32(v: f32) -> Self;
    fn from_f16(v: half::f16) -> Self;
    fn from_bf16(v: half::bf16) -> Self;
    fn to_f64(self) -> f64;
    fn to_f32(self) -> f32;
    fn to_f16(self) -> half::f16;
    fn to_bf16(self) -> half::bf16;
    fn is_finite(self) -> bool;
}

impl Stage for f32 {
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn from_f32(v: f32) -> Self {
        v
    }
    fn from_f16(v: half::f16) -> Self {
        v.to_f32()
    }
    fn from_bf16(v: half::bf16) -> Self {
        v.to_f32()
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn to_f32(self) -> f32 {
        self
    }
    fn to_f16(self) -> half::f16 {
        half::f16::from_f32(self)
    }
    fn to_bf16(self) -> half::bf16 {
        half::bf16::from_f32(self)
    }
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
}

impl Stage for f64 {
    fn from_f64(v: f64) -> Self {
        v
    }
    fn from_f32(v: f32) -> Self {
        v as f64
    }
    fn from_f16(v: half::f16) -> Self {
        v.to_f64()
    }
    fn from_bf16(v: half::bf16) -> Self {
        v.to_f64()
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn to_f16(self) -> half::f16 {
        half::f16::from_f64(self)
    }
    fn to_bf16(self) -> half::bf16 {
        half::bf16::from_f64(self)
    }
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
}

fn decode<S: Stage>(from: Dtype, src: &[u8], out: &mut [S]) {
    match from {
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = S::from_f16(half::f16::from_le_bytes([c[0], c[1]]));
            }
        }
        Dtype::Bf16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = S::from_bf16(half::bf16::from_le_bytes([c[0], c[1]]));
            }
        }
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = S::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
            }
        }
        Dtype::F64 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(8)) {
                let bytes: [u8; 8] = c.try_into().expect("chunks of 8");
                *o = S::from_f64(f64::from_le_bytes(bytes));
            }
        }
        _ => unreachable!("Cast::new admits only CONVERTIBLE dtypes"),
    }
}

/// Writes `vals` as `to`; the index of the first finite value that became
/// infinite, if any (checked once a block: the loop itself stays branch-free).
fn encode<S: Stage>(to: Dtype, vals: &[S], dst: &mut [u8]) -> Option<usize> {
    let mut grew = false;
    match to {
        Dtype::F16 => {
            for (v, c) in vals.iter().zip(dst.chunks_exact_mut(2)) {
                let h = v.to_f16();
                grew |= h.is_infinite() & v.is_finite();
                c.copy_from_slice(&h.to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for (v, c) in vals.iter().zip(dst.chunks_exact_mut(2)) {
                let h = v.to_bf16();
                grew |= h.is_infinite() & v.is_finite();
                c.copy_from_slice(&h.to_le_bytes());
            }
        }
        Dtype::F32 => {
            for (v, c) in vals.iter().zip(dst.chunks_exact_mut(4)) {
                let h = v.to_f32();
                grew |= h.is_infinite() & v.is_finite();
                c.copy_from_slice(&h.to_le_bytes());
            }
        }
        Dtype::F64 => {
            for (v, c) in vals.iter().zip(dst.chunks_exact_mut(8)) {
                c.copy_from_slice(&v.to_f64().to_le_bytes());
            }
        }
        _ => unreachable!("Cast::new admits only CONVERTIBLE dtypes"),
    }
    if !grew {
        return None;
    }
    vals.iter().position(|v| {
        v.is_finite()
            && match to {
                Dtype::F16 => v.to_f16().is_infinite(),
                Dtype::Bf16 => v.to_bf16().is_infinite(),
                _ => v.to_f32().is_infinite(),
            }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes_f32(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn float32_to_bfloat16_rounds_to_nearest_even_as_half_does() {
        let vals: Vec<f32> = (0..5000)
            .map(|i| (i as f32 - 2500.0) * 1.000_123_4e-3 * (1 + i % 7) as f32)
            .chain([f32::NAN, f32::INFINITY, -0.0, 1e-40, 3.3e38])
            .collect();
        let cast = Cast::new(Dtype::F32, Dtype::Bf16).expect("a float pair");
        let mut out = vec![0u8; vals.len() * 2];
        cast.run(&bytes_f32(&vals), &mut out).expect("no overflow");
        for (v, c) in vals.iter().zip(out.chunks_exact(2)) {
            let got = half::bf16::from_le_bytes([c[0], c[1]]);
            let want = half::bf16::from_f32(*v);
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()));
        }
    }

    #[test]
    fn every_pair_round_trips_values_both_types_hold() {
        let vals = [0.5f64, -2.0, 1024.0, 0.0, -0.25];
        for &from in &CONVERTIBLE {
            for &to in &CONVERTIBLE {
                let Some(cast) = Cast::new(from, to) else {
                    assert_eq!(from, to);
                    continue;
                };
                let mut src = vec![0u8; vals.len() * from.itemsize() as usize];
                assert_eq!(encode(from, &vals, &mut src), None);
                let mut dst = vec![0u8; vals.len() * to.itemsize() as usize];
                cast.run(&src, &mut dst).expect("no overflow");
                let mut got = [0f64; 5];
                decode(to, &dst, &mut got);
                assert_eq!(got, vals, "{from:?} -> {to:?}");
            }
        }
    }

    #[test]
    fn a_finite_value_beyond_the_target_is_an_overflow_at_its_index() {
        let mut vals = vec![1.0f32; 3000];
        vals[2049] = 1e5; // float16's largest is 65504
        vals[2500] = f32::INFINITY; // infinite already: kept, not an overflow
        let cast = Cast::new(Dtype::F32, Dtype::F16).expect("a float pair");
        let mut out = vec![0u8; vals.len() * 2];
        let err = cast
            .run(&bytes_f32(&vals), &mut out)
            .expect_err("1e5 overflows");
        assert_eq!(
            err,
            Overflow {
                index: 2049,
                value: 1e5
            }
        );
        vals[2049] = 1.0;
        cast.run(&bytes_f32(&vals), &mut out)
            .expect("inf stays inf");
    }

    #[test]
    fn only_distinct_float_pairs_convert() {
        assert!(Cast::new(Dtype::F32, Dtype::F32).is_none());
        assert!(Cast::new(Dtype::I32, Dtype::F32).is_none());
        assert!(Cast::new(Dtype::F32, Dtype::F8E4m3).is_none());
        assert_eq!(
            Cast::new(Dtype::F64, Dtype::Bf16).map(|c| c.out_len(80)),
            Some(20)
        );
    }
}
