//! The safetensors format: the header parsed and validated completely, and
//! the byte ranges of its tensors read into 64-byte-aligned memory.
//!
//! A file is 8 bytes of little-endian header length `n`, `n` bytes of JSON
//! (an object: tensor name -> `{"dtype", "shape", "data_offsets": [begin,
//! end]}`, plus an optional `"__metadata__"` of strings), then the data;
//! offsets count from the end of the header. Every check here happens before
//! any tensor memory is allocated, and no allocation exceeds the file's size:
//! a corrupt length fails with a message, never with an attempt to allocate it.

pub mod convert;
pub mod http;
pub mod local;
pub mod plan;
pub mod tls;

use serde_json::Value;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of tensor data this process has received from files and URLs
/// (headers not counted; over HTTP, the bytes between pieces of one request
/// are counted, since they came).
static TENSOR_BYTES_READ: AtomicU64 = AtomicU64::new(0);

/// What [`TENSOR_BYTES_READ`] counts so far.
pub fn tensor_bytes_read() -> u64 {
    TENSOR_BYTES_READ.load(Ordering::Relaxed)
}

/// Counts `n` more bytes of tensor data received.
fn count_tensor_bytes(n: u64) {
    TENSOR_BYTES_READ.fetch_add(n, Ordering::Relaxed);
}

/// How many bytes the first read of a header takes: most headers fit, so a
/// file's header costs one read.
pub const FIRST_READ: u64 = 64 * 1024;

/// Headers longer than this are refused (safetensors' own limit is 100 MB).
pub const MAX_HEADER: u64 = 100 * 1000 * 1000;

/// The safetensors dtypes that JAX has, by their safetensors names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// `BOOL`
    Bool,
    /// `U8`
    U8,
    /// `I8`
    I8,
    /// `U16`
    U16,
    /// `I16`
    I16,
    /// `U32`
    U32,
    /// `I32`
    I32,
    /// `U64`
    U64,
    /// `I64`
    I64,
    /// `F16`
    F16,
    /// `BF16`
    Bf16,
    /// `F32`
    F32,
    /// `F64`
    F64,
    /// `F8_E4M3`
    F8E4m3,
    /// `F8_E5M2`
    F8E5m2,
    /// `F8_E8M0`
    F8E8m0,
    /// `F8_E4M3FNUZ`
    F8E4m3Fnuz,
    /// `F8_E5M2FNUZ`
    F8E5m2Fnuz,
    /// `C64`
    C64,
}

/// Safetensors dtypes with no JAX dtype of the same layout: refused, saying why.
const LACKING: [(&str, &str); 3] = [
    (
        "F4",
        "4-bit floats packed two to a byte; JAX's float4_e2m1fn takes a byte each",
    ),
    (
        "F6_E2M3",
        "6-bit floats packed four to three bytes; JAX has no 6-bit float",
    ),
    (
        "F6_E3M2",
        "6-bit floats packed four to three bytes; JAX has no 6-bit float",
    ),
];

impl Dtype {
    /// Every dtype, in declaration order.
    pub const ALL: [Dtype; 19] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::U32,
        Dtype::I32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::F64,
        Dtype::F8E4m3,
        Dtype::F8E5m2,
        Dtype::F8E8m0,
        Dtype::F8E4m3Fnuz,
        Dtype::F8E5m2Fnuz,
        Dtype::C64,
    ];

    /// The name in a safetensors header.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::F8E4m3 => "F8_E4M3",
            Dtype::F8E5m2 => "F8_E5M2",
            Dtype::F8E8m0 => "F8_E8M0",
            Dtype::F8E4m3Fnuz => "F8_E4M3FNUZ",
            Dtype::F8E5m2Fnuz => "F8_E5M2FNUZ",
            Dtype::C64 => "C64",
        }
    }

    /// The numpy/ml_dtypes name of the same type (F8_E4M3 is torch's and
    /// safetensors' `float8_e4m3fn`).
    pub fn numpy_name(self) -> &'static str {
        match self {
            Dtype::Bool => "bool",
            Dtype::U8 => "uint8",
            Dtype::I8 => "int8",
            Dtype::U16 => "uint16",
            Dtype::I16 => "int16",
            Dtype::U32 => "uint32",
            Dtype::I32 => "int32",
            Dtype::U64 => "uint64",
            Dtype::I64 => "int64",
            Dtype::F16 => "float16",
            Dtype::Bf16 => "bfloat16",
            Dtype::F32 => "float32",
            Dtype::F64 => "float64",
            Dtype::F8E4m3 => "float8_e4m3fn",
            Dtype::F8E5m2 => "float8_e5m2",
            Dtype::F8E8m0 => "float8_e8m0fnu",
            Dtype::F8E4m3Fnuz => "float8_e4m3fnuz",
            Dtype::F8E5m2Fnuz => "float8_e5m2fnuz",
            Dtype::C64 => "complex64",
        }
    }

    /// Bytes per element.
    pub fn itemsize(self) -> u64 {
        match self {
            Dtype::Bool
            | Dtype::U8
            | Dtype::I8
            | Dtype::F8E4m3
            | Dtype::F8E5m2
            | Dtype::F8E8m0
            | Dtype::F8E4m3Fnuz
            | Dtype::F8E5m2Fnuz => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 | Dtype::C64 => 8,
        }
    }

    /// The dtype of a safetensors name (`"F32"`), if JAX has it.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// The dtype of a numpy/ml_dtypes name ([`Dtype::numpy_name`]'s inverse).
    pub fn from_numpy_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.numpy_name() == name)
    }
}

/// One tensor of a header; `start..end` are absolute byte offsets in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// The tensor's name in the header.
    pub name: String,
    /// Its element type.
    pub dtype: Dtype,
    /// Its shape (empty for a scalar).
    pub shape: Vec<u64>,
    /// Its first byte in the file (absolute offset).
    pub start: u64,
    /// One past its last byte in the file.
    pub end: u64,
}

impl TensorInfo {
    /// Its size in bytes.
    pub fn nbytes(&self) -> u64 {
        self.end - self.start
    }
}

/// The header length in the first 8 bytes, checked against the file size.
/// `prefix` is what the first read gave (at least 8 bytes unless the file is
/// shorter).
pub fn header_len(file: &str, prefix: &[u8], file_len: u64) -> Result<u64, String> {
    if file_len < 8 || prefix.len() < 8 {
        return Err(format!(
            "{file}: not a safetensors file: {file_len} bytes, shorter than the 8-byte \
             header length (bytes [0, 8))"
        ));
    }
    let n = u64::from_le_bytes(prefix[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER {
        return Err(format!(
            "{file}: header length {n} (bytes [0, 8)) exceeds the {MAX_HEADER}-byte limit; \
             the file is corrupt or not safetensors"
        ));
    }
    if n > file_len - 8 {
        return Err(format!(
            "{file}: header length {n} (bytes [0, 8)) goes beyond the file: the header \
             would end at byte {}, the file has {file_len} bytes",
            8 + n
        ));
    }
    Ok(n)
}

fn at(file: &str, name: &str) -> String {
    format!("{file}: tensor {name:?}")
}

/// The members of a JSON object in the order of the text, duplicates kept
/// (a `serde_json::Map` keeps only the last of a duplicated key, and the
/// earlier one would go unchecked).
struct Members(Vec<(String, Value)>);

impl<'de> serde::Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Members, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Members;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some(member) = map.next_entry::<String, Value>()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        d.deserialize_map(Visit)
    }
}

/// Parses and validates the JSON header `json` (the bytes after the length)
/// of a file of `file_len` bytes. Tensors come back in file order (by start
/// offset). Checks, at least as strict as the `safetensors` package's own
/// reader: a JSON object without duplicate keys; `__metadata__` absent, null
/// or an object of strings (so no tensor can be named `__metadata__`); each
/// other entry an object with a known dtype, a shape of non-negative integers
/// and two data offsets; end - begin = product(shape) x itemsize; and the
/// tensors covering the data section exactly once: no overlap, no gap, no
/// byte after the last tensor (safetensors refuses such files so that a file
/// cannot also be another format).
pub fn parse_header(file: &str, json: &[u8], file_len: u64) -> Result<Vec<TensorInfo>, String> {
    parse_header_and_metadata(file, json, file_len).map(|(tensors, _)| tensors)
}

/// The `__metadata__` of a header: its (key, value) pairs, by key.
pub type Metadata = Vec<(String, String)>;

/// As [`parse_header`], with the header's `__metadata__` (empty when it is
/// absent or null).
pub fn parse_header_and_metadata(
    file: &str,
    json: &[u8],
    file_len: u64,
) -> Result<(Vec<TensorInfo>, Metadata), String> {
    let data_start = 8 + json.len() as u64;
    let hdr = format!("{file}: header (bytes [8, {data_start}))");
    let members = match serde_json::from_slice::<Members>(json) {
        Ok(Members(members)) => members,
        // Parsed again only to say what is wrong.
        Err(e) => match serde_json::from_slice::<Value>(json) {
            Err(e) => return Err(format!("{hdr} is not valid JSON: {e}")),
            Ok(value) if !value.is_object() => {
                return Err(format!(
                    "{hdr} is not a JSON object: it is {}",
                    json_kind(&value)
                ))
            }
            Ok(_) => return Err(format!("{hdr} is not valid JSON: {e}")),
        },
    };
    let mut names: Vec<&str> = members.iter().map(|(name, _)| name.as_str()).collect();
    names.sort_unstable();
    if let Some(pair) = names.windows(2).find(|pair| pair[0] == pair[1]) {
        return Err(format!(
            "{hdr}: key {:?} appears more than once (a header names each tensor once)",
            pair[0]
        ));
    }
    let data_len = file_len - data_start;
    let mut tensors = Vec::with_capacity(members.len());
    let mut metadata = Metadata::new();
    for (name, entry) in &members {
        if name == "__metadata__" {
            let strings = match entry {
                Value::Null => true,
                Value::Object(m) => m.values().all(Value::is_string),
                _ => false,
            };
            if let Value::Object(m) = entry {
                metadata = m
                    .iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
                    .collect();
            }
            if !strings {
                return Err(format!(
                    "{hdr}: __metadata__ must be null or an object of strings (it names no \
                     tensor), got {entry:.200}"
                ));
            }
            continue;
        }
        let here = at(file, name);
        let Value::Object(fields) = entry else {
            return Err(format!(
                "{here}: the header entry must be an object with dtype, shape and \
                 data_offsets, got {}",
                json_kind(entry)
            ));
        };
        let dtype = match fields.get("dtype") {
            None => return Err(format!("{here}: the header entry has no dtype")),
            Some(Value::String(s)) => Dtype::from_name(s).ok_or_else(|| {
                let known: Vec<_> = Dtype::ALL.iter().map(|d| d.name()).collect();
                let why = match LACKING.iter().find(|(name, _)| name == s) {
                    Some((_, why)) => format!("dtype {s:?} cannot be loaded: {why}"),
                    None => format!("unknown dtype {s:?}"),
                };
                format!("{here}: {why} (the dtypes loaded: {})", known.join(", "))
            })?,
            Some(other) => {
                return Err(format!(
                    "{here}: dtype must be a string, got {}",
                    json_kind(other)
                ))
            }
        };
        let shape = match fields.get("shape") {
            None => return Err(format!("{here}: the header entry has no shape")),
            Some(Value::Array(dims)) => dims
                .iter()
                .map(|d| d.as_u64())
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| {
                    format!("{here}: shape must be a list of non-negative integers, got {entry}")
                })?,
            Some(other) => {
                return Err(format!(
                    "{here}: shape must be a list, got {}",
                    json_kind(other)
                ))
            }
        };
        let offsets = match fields.get("data_offsets") {
            None => return Err(format!("{here}: the header entry has no data_offsets")),
            Some(Value::Array(o)) if o.len() == 2 => (o[0].as_u64(), o[1].as_u64()),
            Some(other) => {
                return Err(format!(
                    "{here}: data_offsets must be [begin, end], got {other}"
                ))
            }
        };
        let (Some(begin), Some(end)) = offsets else {
            return Err(format!(
                "{here}: data_offsets must be two non-negative integers, got {}",
                fields["data_offsets"]
            ));
        };
        let range = format!(
            "data_offsets [{begin}, {end}) (file bytes [{}, {}))",
            data_start.saturating_add(begin),
            data_start.saturating_add(end)
        );
        if begin > end {
            return Err(format!("{here}: {range}: begin is after end"));
        }
        if end > data_len {
            return Err(format!(
                "{here}: {range} out of bounds: the data section has {data_len} bytes \
                 (the file {file_len})"
            ));
        }
        let expected = shape
            .iter()
            .try_fold(dtype.itemsize(), |acc, &d| acc.checked_mul(d));
        if expected != Some(end - begin) {
            let expected = expected.map_or_else(|| "more than 2**64".to_owned(), |e| e.to_string());
            return Err(format!(
                "{here}: {range} hold {} bytes, but shape {shape:?} of {} needs {expected}",
                end - begin,
                dtype.name()
            ));
        }
        tensors.push(TensorInfo {
            name: name.clone(),
            dtype,
            shape,
            start: data_start + begin,
            end: data_start + end,
        });
    }
    tensors.sort_by_key(|t| (t.start, t.end));
    let uncovered = |from: u64, to: u64, where_: String| {
        format!(
            "{file}: file bytes [{from}, {to}) {where_} belong to no tensor: the tensors \
             must cover the data section exactly, as safetensors requires"
        )
    };
    if let Some(first) = tensors.first() {
        if first.start > data_start {
            let where_ = format!("before tensor {:?}", first.name);
            return Err(uncovered(data_start, first.start, where_));
        }
    }
    for pair in tensors.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        if b.start < a.end {
            return Err(format!(
                "{file}: tensors {:?} (file bytes [{}, {})) and {:?} (file bytes [{}, {})) overlap",
                a.name, a.start, a.end, b.name, b.start, b.end
            ));
        }
        if b.start > a.end {
            let where_ = format!("between tensors {:?} and {:?}", a.name, b.name);
            return Err(uncovered(a.end, b.start, where_));
        }
    }
    let end = tensors.last().map_or(data_start, |t| t.end);
    if end < file_len {
        let where_ = match tensors.last() {
            Some(t) => format!("after the last tensor, {:?},", t.name),
            None => "after a header of no tensor".to_owned(),
        };
        return Err(uncovered(end, file_len, where_));
    }
    Ok((tensors, metadata))
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_bytes(json: &str, data: &[u8]) -> Vec<u8> {
        let mut v = (json.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(json.as_bytes());
        v.extend_from_slice(data);
        v
    }

    fn parse(json: &str, data_len: usize) -> Result<Vec<TensorInfo>, String> {
        let bytes = file_bytes(json, &vec![0; data_len]);
        let n = header_len("f", &bytes, bytes.len() as u64)?;
        parse_header("f", &bytes[8..8 + n as usize], bytes.len() as u64)
    }

    #[test]
    fn good_header_in_file_order() {
        let t = parse(
            r#"{"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]},
                "a":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]},
                "__metadata__":{"format":"pt"}}"#,
            12,
        )
        .unwrap();
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].name, "a");
        assert_eq!(t[0].dtype, Dtype::Bf16);
        assert_eq!(t[1].shape, vec![2]);
        assert_eq!(t[1].nbytes(), 8);
    }

    #[test]
    fn every_malformed_header_is_named() {
        let cases = [
            ("[1, 2]", 0, "not a JSON object"),
            ("{\"a\": 3}", 0, "must be an object"),
            (r#"{"a":{"shape":[1],"data_offsets":[0,4]}}"#, 4, "no dtype"),
            (
                r#"{"a":{"dtype":"Q9","shape":[1],"data_offsets":[0,4]}}"#,
                4,
                "unknown dtype \"Q9\" (the dtypes loaded: BOOL, U8, ",
            ),
            (
                r#"{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}"#,
                1,
                "dtype \"F4\" cannot be loaded: 4-bit floats packed two to a byte",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}}"#,
                4,
                "out of bounds",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                8,
                "needs 8",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
                4,
                "non-negative",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                   "b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                8,
                "overlap",
            ),
            ("{not json", 0, "not valid JSON"),
            // Stricter than a JSON parser, as strict as safetensors:
            (
                "{} ",
                1,
                "bytes [11, 12) after a header of no tensor belong to no tensor",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
                8,
                "before tensor \"a\" belong to no tensor",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                   "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
                12,
                "between tensors \"a\" and \"b\" belong to no tensor",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                5,
                "after the last tensor, \"a\", belong to no tensor",
            ),
            (
                r#"{"__metadata__":{"a":1}}"#,
                0,
                "must be null or an object of strings",
            ),
            (
                r#"{"__metadata__":[]}"#,
                0,
                "must be null or an object of strings",
            ),
            (
                r#"{"__metadata__":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                4,
                "must be null or an object of strings",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                   "a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                4,
                "key \"a\" appears more than once",
            ),
        ];
        for (json, data, want) in cases {
            let err = parse(json, data).unwrap_err();
            assert!(err.contains(want), "{json}: {err}");
            assert!(err.starts_with("f: "), "{err}");
        }
    }

    #[test]
    fn null_metadata_and_zero_sized_tensors_are_accepted() {
        let t = parse(
            r#"{"__metadata__":null,
                "e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},
                "a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            4,
        )
        .unwrap();
        let names: Vec<_> = t.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "e"]);
        assert!(parse("{}", 0).unwrap().is_empty());
    }

    #[test]
    fn header_length_beyond_the_file_allocates_nothing() {
        let mut bytes = file_bytes("{}", &[]);
        bytes[..8].copy_from_slice(&3_000_000_000u64.to_le_bytes());
        let err = header_len("f", &bytes, bytes.len() as u64).unwrap_err();
        assert!(err.contains("limit"), "{err}");
        bytes[..8].copy_from_slice(&1000u64.to_le_bytes());
        let err = header_len("f", &bytes, bytes.len() as u64).unwrap_err();
        assert!(err.contains("beyond the file"), "{err}");
        assert!(header_len("f", &bytes[..4], 4).is_err());
    }
}
