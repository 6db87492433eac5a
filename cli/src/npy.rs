//! Every `.npy` read and write of the tool, with messages naming the file and what was
//! expected.
//!
//! Every read goes through [`open_checked`], which parses the header itself and checks that
//! the shape and dtype it claims account for exactly the bytes after it, before ndarray-npy
//! allocates the array: a header claiming a huge shape is an error, not an aborted
//! allocation.

use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom};
use std::path::Path as FsPath;

use ndarray::{ArrayD, Ix4};
use ndarray_npy::{write_npy, ReadNpyError, ReadNpyExt, WritableElement};

use crate::CliResult;

/// Read a `.npy` of element type `T`, with messages naming the file and what was expected.
pub(crate) fn read_array<T: ndarray_npy::ReadableElement>(
    path: &FsPath,
    what: &str,
    dtype: &str,
    fix: &str,
) -> CliResult<ArrayD<T>> {
    let reader = open_checked(path, what, dtype, fix)?;
    ArrayD::<T>::read_npy(reader).map_err(|e| {
        let p = path.display();
        match e {
            ReadNpyError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                format!("{what}: {p} is not a valid .npy file (it ends early)")
            }
            ReadNpyError::Io(io) => format!("{what}: cannot read {p}: {io}"),
            ReadNpyError::WrongDescriptor(d) => {
                format!("{what}: {p} has dtype {d}, expected {dtype} (in numpy: {fix})")
            }
            other => format!("{what}: {p} is not a valid .npy file: {other}"),
        }
        .into()
    })
}

/// Read a float `.npy`: f32 (`<f4`), or f16 (`<f2`, widened exactly to f32).
pub(crate) fn read_float(path: &FsPath, what: &str) -> CliResult<ArrayD<f32>> {
    const DTYPE: &str = "float32 ('<f4') or float16 ('<f2')";
    const FIX: &str = "x.astype(np.float32)";
    let (mut reader, header) = peek_header(path, what, DTYPE, FIX)?;
    let p = path.display();
    let cannot_read = |e: io::Error| format!("{what}: cannot read {p}: {e}");
    if header.descr.as_deref() != Some("<f2") {
        return read_array::<f32>(path, what, DTYPE, FIX);
    }
    // The sizes were checked against the file by `open_checked`.
    let shape: Vec<usize> = header.shape.iter().map(|&d| d as usize).collect();
    let mut bytes = Vec::new();
    reader.read_to_end(&mut bytes).map_err(cannot_read)?;
    let data = wgpu_attention::Storage::F16.decode(&bytes, bytes.len() / 2);
    let a = if header.fortran_order {
        use ndarray::ShapeBuilder;
        ArrayD::from_shape_vec(ndarray::IxDyn(&shape).f(), data)
    } else {
        ArrayD::from_shape_vec(ndarray::IxDyn(&shape), data)
    };
    Ok(a.map_err(|e| format!("{what}: {p}: {e}"))?
        .as_standard_layout()
        .into_owned())
}

/// Read an integer `.npy` as i32: int32 (`<i4`), or int64 (`<i8`) whose values fit in i32.
pub(crate) fn read_int(path: &FsPath, what: &str) -> CliResult<ArrayD<i32>> {
    const DTYPE: &str = "int32 ('<i4') or int64 ('<i8')";
    const FIX: &str = "x.astype(np.int32)";
    let (_, header) = peek_header(path, what, DTYPE, FIX)?;
    let p = path.display();
    if header.descr.as_deref() != Some("<i8") {
        return read_array::<i32>(path, what, DTYPE, FIX);
    }
    let wide = read_array::<i64>(path, what, DTYPE, FIX)?;
    if let Some(x) = wide.iter().find(|&&x| i32::try_from(x).is_err()) {
        return Err(format!("{what}: {p} holds {x}, outside int32").into());
    }
    Ok(wide.mapv(|x| x as i32))
}

/// Read q, k or v: f32 or f16, exactly 4-D.
pub(crate) fn read_qkv(path: &FsPath, what: &str, layout: &str) -> CliResult<ndarray::Array4<f32>> {
    let a = read_float(path, what)?;
    let shape = a.shape().to_vec();
    a.into_dimensionality::<Ix4>().map_err(|_| {
        format!(
            "{what}: {} has shape {shape:?} ({} dimensions); expected 4 dimensions {layout}",
            path.display(),
            shape.len()
        )
        .into()
    })
}

/// Read an f32 or f16 `.npy` of exactly 3 dimensions.
pub(crate) fn read_3d(path: &FsPath, what: &str, layout: &str) -> CliResult<ndarray::Array3<f32>> {
    let a = read_float(path, what)?;
    let shape = a.shape().to_vec();
    a.into_dimensionality::<ndarray::Ix3>().map_err(|_| {
        format!(
            "{what}: {} has shape {shape:?} ({} dimensions); expected 3 dimensions {layout}",
            path.display(),
            shape.len()
        )
        .into()
    })
}

/// Check, before anything is read or computed, that every output path (`(flag, path)`) can
/// be written: an existing file must open for writing (it is not changed here), a new one must
/// be creatable in an existing folder (a probe file beside it, named for this process and call,
/// is created and removed again: never the output's own name, so processes checking the same
/// output at once, as MPI ranks do, cannot collide). A run that would fail at its end after
/// minutes of work fails at once instead.
pub(crate) fn check_writable<'p>(
    outputs: impl IntoIterator<Item = (&'static str, Option<&'p FsPath>)>,
) -> CliResult<()> {
    for (flag, path) in outputs {
        let Some(path) = path else { continue };
        let fail = |e: &dyn std::fmt::Display| -> CliResult<()> {
            Err(format!(
                "{flag}: cannot write {}: {e} (checked before computing)",
                path.display()
            )
            .into())
        };
        if path.is_dir() {
            return fail(&"it is a folder");
        }
        if path.exists() {
            if let Err(e) = std::fs::OpenOptions::new().append(true).open(path) {
                return fail(&e);
            }
        } else {
            static PROBES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
            let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut name = path.file_name().unwrap_or_default().to_os_string();
            name.push(format!(".probe-{}-{n}", std::process::id()));
            let probe = path.with_file_name(name);
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&probe)
            {
                Ok(_) => {
                    let _ = std::fs::remove_file(&probe);
                }
                Err(e) => return fail(&e),
            }
        }
    }
    Ok(())
}

/// Write `a` to `path` and say so.
pub(crate) fn write_array<T: WritableElement>(path: &FsPath, what: &str, a: &ArrayD<T>) -> CliResult<()> {
    write_npy(path, a).map_err(|e| format!("{what}: cannot write {}: {e}", path.display()))?;
    println!("wrote {} {:?} to {}", what, a.shape(), path.display());
    Ok(())
}

/// A key padding mask `[B, S]` as `[B, 1, 1, S]`, and-ed with the attention mask if both.
pub(crate) fn combine_masks(
    mask: Option<ArrayD<bool>>,
    kpm: Option<ArrayD<bool>>,
) -> CliResult<Option<ArrayD<bool>>> {
    let Some(kpm) = kpm else { return Ok(mask) };
    let &[b, s] = kpm.shape() else {
        return Err(format!(
            "key padding mask: shape {:?}, expected 2 dimensions [B, S]",
            kpm.shape()
        )
        .into());
    };
    let kpm = kpm.into_shape_with_order(ndarray::IxDyn(&[b, 1, 1, s]))?;
    let Some(mask) = mask else { return Ok(Some(kpm)) };
    // Broadcast both to the larger of each dimension (mask shapes are right-aligned).
    let mut m4 = vec![1usize; 4usize.saturating_sub(mask.ndim())];
    m4.extend_from_slice(mask.shape());
    if m4.len() != 4 {
        return Err(format!("mask: shape {:?} has more than 4 dimensions", mask.shape()).into());
    }
    let mask = mask.into_shape_with_order(ndarray::IxDyn(&m4))?;
    let target: Vec<usize> = (0..4).map(|i| m4[i].max(kpm.shape()[i])).collect();
    let (mb, kb) = (
        mask.broadcast(target.clone()).ok_or_else(|| {
            format!("mask {m4:?} and key padding mask [{b}, {s}] do not broadcast together")
        })?,
        kpm.broadcast(target.clone()).ok_or_else(|| {
            format!("mask {m4:?} and key padding mask [{b}, {s}] do not broadcast together")
        })?,
    );
    Ok(Some(
        ndarray::Zip::from(&mb).and(&kb).map_collect(|&x, &y| x && y),
    ))
}

/// Open the `.npy` file at `path`, parse its header and check that the shape it claims, times
/// the size of its dtype, is exactly the number of bytes after the header (with overflow an
/// error); the file is returned rewound to its start. Every read of the tool goes through
/// here, so a header claiming more data than the file holds never reaches an allocation.
fn open_checked(path: &FsPath, what: &str, dtype: &str, fix: &str) -> CliResult<BufReader<File>> {
    let p = path.display();
    let cannot_read = |e: io::Error| format!("{what}: cannot read {p}: {e}");
    let file = File::open(path).map_err(cannot_read)?;
    let file_len = file.metadata().map_err(cannot_read)?.len();
    let mut reader = BufReader::new(file);
    let header = read_header(&mut reader, file_len).map_err(|e| match e {
        HeaderError::Io(io) if io.kind() == io::ErrorKind::UnexpectedEof => {
            format!("{what}: {p} is not a valid .npy file (it ends early)")
        }
        HeaderError::Io(io) => cannot_read(io),
        HeaderError::Invalid(reason) => format!("{what}: {p} is not a valid .npy file: {reason}"),
    })?;
    let data_len = file_len - header.len;
    let descr = &header.descr_text;
    let Some(item) = header.descr.as_deref().and_then(item_size) else {
        return Err(format!("{what}: {p} has dtype {descr}, expected {dtype} (in numpy: {fix})").into());
    };
    let shape = &header.shape;
    let claimed = shape
        .iter()
        .try_fold(item, |acc, &d| {
            usize::try_from(d).ok().and_then(|d| acc.checked_mul(d))
        })
        .and_then(|n| u64::try_from(n).ok());
    match claimed {
        None => Err(format!(
            "{what}: {p} is not a valid .npy file: its header claims shape {shape:?} of {descr}, \
             whose size overflows, but the file has {data_len} bytes of data"
        )
        .into()),
        Some(n) if n != data_len => Err(format!(
            "{what}: {p} is not a valid .npy file: its header claims shape {shape:?} of {descr} \
             ({n} bytes of data), but the file has {data_len} bytes of data after the header"
        )
        .into()),
        Some(_) => {
            reader.seek(SeekFrom::Start(0)).map_err(cannot_read)?;
            Ok(reader)
        }
    }
}

/// What [`open_checked`] needs of a `.npy` header.
#[derive(Debug)]
struct NpyHeader {
    /// The dtype, when `descr` is a string (`<f4`); `None` for a structured dtype.
    descr: Option<String>,
    /// `descr` as written in the header (`'<f4'`), for messages.
    descr_text: String,
    /// The claimed shape (arbitrary Python integers, so wider than `usize`).
    shape: Vec<u128>,
    /// Column-major data.
    fortran_order: bool,
    /// Bytes before the data: magic string, version, header length and header.
    len: u64,
}

#[derive(Debug)]
enum HeaderError {
    Io(io::Error),
    Invalid(String),
}

impl From<io::Error> for HeaderError {
    fn from(e: io::Error) -> Self {
        HeaderError::Io(e)
    }
}

impl From<String> for HeaderError {
    fn from(reason: String) -> Self {
        HeaderError::Invalid(reason)
    }
}

/// The magic string every `.npy` file starts with.
const MAGIC: &[u8; 6] = b"\x93NUMPY";

/// Read the header of a `.npy` file of `file_len` bytes: the magic string, the version (1.0
/// with a 2-byte header length, 2.0 or 3.0 with a 4-byte one, little-endian) and the header, a
/// Python dict literal with the keys `descr`, `fortran_order` and `shape`. The header length is
/// checked against `file_len` before the header is read.
fn read_header(reader: &mut impl Read, file_len: u64) -> Result<NpyHeader, HeaderError> {
    let mut magic = [0u8; 6];
    reader.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err("it does not start with the magic string \\x93NUMPY"
            .to_string()
            .into());
    }
    let mut version = [0u8; 2];
    reader.read_exact(&mut version)?;
    let (len_bytes, header_len) = match version {
        [1, 0] => {
            let mut n = [0u8; 2];
            reader.read_exact(&mut n)?;
            (2, u64::from(u16::from_le_bytes(n)))
        }
        [2 | 3, 0] => {
            let mut n = [0u8; 4];
            reader.read_exact(&mut n)?;
            (4, u64::from(u32::from_le_bytes(n)))
        }
        [major, minor] => return Err(format!("unknown format version {major}.{minor}").into()),
    };
    let len = 6 + 2 + len_bytes + header_len;
    if len > file_len {
        return Err(io::Error::from(io::ErrorKind::UnexpectedEof).into());
    }
    let mut text = vec![0u8; header_len as usize];
    reader.read_exact(&mut text)?;
    let Some((b'\n', text)) = text.split_last() else {
        return Err("its header does not end with a newline".to_string().into());
    };
    let text = std::str::from_utf8(text).map_err(|_| "its header is not UTF-8".to_string())?;
    let (mut descr, mut fortran_order, mut shape) = (None, None, None);
    for (key, value, raw) in PyParser::parse_dict(text)? {
        match (key.as_str(), value) {
            ("descr", v) => {
                let s = match v {
                    Py::Str(s) => Some(s),
                    _ => None,
                };
                descr = Some((s, raw.to_string()));
            }
            ("fortran_order", Py::Bool(b)) => fortran_order = Some(b),
            ("shape", Py::Tuple(dims)) => {
                let dims = dims.into_iter().map(|d| match d {
                    Py::Int(n) => Ok(n),
                    _ => Err(format!("its shape {raw} is not a tuple of non-negative integers")),
                });
                shape = Some(dims.collect::<Result<Vec<u128>, _>>()?);
            }
            ("fortran_order" | "shape", _) => {
                return Err(format!("its header has an invalid {key}: {raw}").into());
            }
            _ => {}
        }
    }
    let missing = |k: &str| format!("its header has no {k:?}");
    let (descr, descr_text) = descr.ok_or_else(|| missing("descr"))?;
    let fortran_order = fortran_order.ok_or_else(|| missing("fortran_order"))?;
    let shape = shape.ok_or_else(|| missing("shape"))?;
    Ok(NpyHeader {
        descr,
        descr_text,
        shape,
        fortran_order,
        len,
    })
}

/// Bytes per element of a numpy type string (`<f4` -> 4, `|b1` -> 1, `<U3` -> 12,
/// `<M8[ns]` -> 8); `None` for one without a size (`|O`).
fn item_size(descr: &str) -> Option<usize> {
    let rest = descr.strip_prefix(['<', '>', '|', '=']).unwrap_or(descr);
    let mut chars = rest.chars();
    let kind = chars.next()?;
    let rest = chars.as_str();
    let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    let (size, unit) = rest.split_at(digits);
    let size: usize = size.parse().ok()?;
    match kind {
        'b' | 'i' | 'u' | 'f' | 'c' | 'S' | 'a' | 'V' if unit.is_empty() => Some(size),
        'U' if unit.is_empty() => size.checked_mul(4),
        'm' | 'M' if unit.is_empty() || (unit.starts_with('[') && unit.ends_with(']')) => Some(size),
        _ => None,
    }
}

/// A Python literal, as far as `.npy` headers use them.
#[derive(Debug, PartialEq)]
enum Py {
    Str(String),
    /// A non-negative integer.
    Int(u128),
    Bool(bool),
    Tuple(Vec<Py>),
    /// `None`, a list or a dict (structured dtypes): parsed, not kept.
    Other,
}

/// A recursive-descent parser of the Python literals in a `.npy` header, nesting bounded.
struct PyParser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> PyParser<'a> {
    /// Deepest nesting accepted (structured dtypes nest a few levels).
    const MAX_DEPTH: usize = 32;

    /// The entries of the dict literal that is all of `text`: (key, value, value as written).
    fn parse_dict(text: &'a str) -> Result<Vec<(String, Py, &'a str)>, String> {
        let mut p = PyParser { text, pos: 0 };
        p.skip_space();
        p.expect('{')?;
        let mut entries = Vec::new();
        loop {
            p.skip_space();
            if p.eat('}') {
                break;
            }
            let Py::Str(key) = p.value(1)? else {
                return Err("its header has a dict key that is not a string".to_string());
            };
            p.skip_space();
            p.expect(':')?;
            p.skip_space();
            let start = p.pos;
            let value = p.value(1)?;
            entries.push((key, value, &text[start..p.pos]));
            p.skip_space();
            if !p.eat(',') {
                p.skip_space();
                p.expect('}')?;
                break;
            }
        }
        p.skip_space();
        if p.pos != text.len() {
            return Err(format!("its header has text after the dict at byte {}", p.pos));
        }
        Ok(entries)
    }

    fn peek(&self) -> Option<char> {
        self.text[self.pos..].chars().next()
    }

    fn eat(&mut self, c: char) -> bool {
        let found = self.peek() == Some(c);
        if found {
            self.pos += c.len_utf8();
        }
        found
    }

    fn expect(&mut self, c: char) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!(
                "its header is not a Python dict literal: expected {c:?} at byte {}",
                self.pos
            ))
        }
    }

    fn skip_space(&mut self) {
        while self.peek().is_some_and(char::is_whitespace) {
            self.pos += self.peek().map_or(0, char::len_utf8);
        }
    }

    fn value(&mut self, depth: usize) -> Result<Py, String> {
        if depth > Self::MAX_DEPTH {
            return Err("its header nests too deeply".to_string());
        }
        let invalid =
            |pos: usize| format!("its header is not a Python dict literal: unexpected text at byte {pos}");
        match self.peek() {
            Some(q @ ('\'' | '"')) => {
                self.pos += 1;
                let mut s = String::new();
                loop {
                    let c = self
                        .peek()
                        .ok_or_else(|| "its header has an unterminated string".to_string())?;
                    self.pos += c.len_utf8();
                    match c {
                        '\\' => {
                            let e = self
                                .peek()
                                .ok_or_else(|| "its header has an unterminated string".to_string())?;
                            self.pos += e.len_utf8();
                            s.push(e);
                        }
                        c if c == q => return Ok(Py::Str(s)),
                        c => s.push(c),
                    }
                }
            }
            Some(open @ ('(' | '[')) => {
                self.pos += 1;
                let close = if open == '(' { ')' } else { ']' };
                let mut items = Vec::new();
                loop {
                    self.skip_space();
                    if self.eat(close) {
                        break;
                    }
                    items.push(self.value(depth + 1)?);
                    self.skip_space();
                    if !self.eat(',') {
                        self.skip_space();
                        self.expect(close)?;
                        break;
                    }
                }
                Ok(if open == '(' { Py::Tuple(items) } else { Py::Other })
            }
            Some('{') => {
                // Only in the metadata of structured dtypes: skipped, its nesting bounded.
                self.pos += 1;
                loop {
                    self.skip_space();
                    if self.eat('}') {
                        break;
                    }
                    self.value(depth + 1)?;
                    self.skip_space();
                    self.expect(':')?;
                    self.skip_space();
                    self.value(depth + 1)?;
                    self.skip_space();
                    if !self.eat(',') {
                        self.skip_space();
                        self.expect('}')?;
                        break;
                    }
                }
                Ok(Py::Other)
            }
            Some(c) if c.is_ascii_digit() => {
                let start = self.pos;
                while self.peek().is_some_and(|c| c.is_ascii_digit()) {
                    self.pos += 1;
                }
                let digits = &self.text[start..self.pos];
                // Python 2 wrote long integers with an L.
                self.eat('L');
                digits
                    .parse()
                    .map(Py::Int)
                    .map_err(|_| format!("its header has an integer too large: {digits}"))
            }
            Some(c) if c.is_ascii_alphabetic() => {
                let start = self.pos;
                while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                    self.pos += 1;
                }
                match &self.text[start..self.pos] {
                    "True" => Ok(Py::Bool(true)),
                    "False" => Ok(Py::Bool(false)),
                    "None" => Ok(Py::Other),
                    _ => Err(invalid(start)),
                }
            }
            _ => Err(invalid(self.pos)),
        }
    }
}

/// A paged cache as its file holds it: float values, int8 codes (`|i1`) or e4m3 bit patterns
/// (`|u1`).
pub(crate) enum CacheFile {
    Float(ArrayD<f32>),
    Int8(ArrayD<i8>),
    Fp8(ArrayD<u8>),
}

impl CacheFile {
    pub(crate) fn shape(&self) -> &[usize] {
        match self {
            CacheFile::Float(a) => a.shape(),
            CacheFile::Int8(a) => a.shape(),
            CacheFile::Fp8(a) => a.shape(),
        }
    }
}

/// Open a `.npy` ([`open_checked`]) and read its header: the reader (past the header) and
/// the header, for a reader that picks the element type by the header's dtype.
fn peek_header(path: &FsPath, what: &str, dtype: &str, fix: &str) -> CliResult<(BufReader<File>, NpyHeader)> {
    let mut reader = open_checked(path, what, dtype, fix)?;
    let p = path.display();
    let file_len = reader
        .get_ref()
        .metadata()
        .map_err(|e| format!("{what}: cannot read {p}: {e}"))?
        .len();
    let header = read_header(&mut reader, file_len).map_err(|_| format!("{what}: cannot read {p}"))?;
    Ok((reader, header))
}

/// Read a paged cache: f32 or f16 values, int8 codes (`|i1`), or fp8 e4m3 bit patterns (`|u1`).
pub(crate) fn read_cache(path: &FsPath, what: &str) -> CliResult<CacheFile> {
    const DTYPE: &str = "float32 ('<f4'), float16 ('<f2'), int8 codes ('|i1') or fp8 e4m3 bits ('|u1')";
    let (_, header) = peek_header(path, what, DTYPE, "x.astype(np.float32)")?;
    Ok(match header.descr.as_deref() {
        Some("|i1") => CacheFile::Int8(read_array::<i8>(path, what, DTYPE, "codes.astype(np.int8)")?),
        Some("|u1") => CacheFile::Fp8(read_array::<u8>(path, what, DTYPE, "bits.view(np.uint8)")?),
        _ => CacheFile::Float(read_float(path, what)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Many checks of one new output at once (MPI ranks each check `--out`) all pass, and
    /// leave nothing behind; the race once failed a rank with "File exists".
    #[test]
    fn concurrent_checks_of_one_output_do_not_race() {
        let dir = std::env::temp_dir().join(format!("wgpu-attention-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("out.npy");
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    s.spawn(|| {
                        (0..200)
                            .map(|_| {
                                check_writable([("--out", Some(out.as_path()))]).map_err(|e| e.to_string())
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            for h in handles {
                for r in h.join().unwrap() {
                    assert!(r.is_ok(), "{r:?}");
                }
            }
        });
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            0,
            "probe files left behind"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        // A folder that does not exist still fails.
        assert!(check_writable([("--out", Some(dir.join("no/such/out.npy").as_path()))]).is_err());
    }

    /// A `.npy` header of format `version` for the dict literal `dict`, padded as numpy pads it.
    fn header(version: u8, dict: &str) -> Vec<u8> {
        let len_bytes = if version == 1 { 2 } else { 4 };
        let unpadded = 6 + 2 + len_bytes + dict.len() + 1;
        let text = format!("{dict}{}\n", " ".repeat(unpadded.next_multiple_of(64) - unpadded));
        let mut out = MAGIC.to_vec();
        out.extend([version, 0]);
        match version {
            1 => out.extend((text.len() as u16).to_le_bytes()),
            _ => out.extend((text.len() as u32).to_le_bytes()),
        }
        out.extend(text.as_bytes());
        out
    }

    fn parse(bytes: &[u8], file_len: u64) -> Result<NpyHeader, HeaderError> {
        read_header(&mut &bytes[..], file_len)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]

        /// Hostile headers (random bytes, valid headers cut short or with bytes overwritten,
        /// any claimed length) are parsed or refused, never a panic; a parsed header never
        /// claims to be longer than the file.
        #[test]
        fn hostile_headers_are_parsed_or_refused(
            random in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300),
            cut in 0usize..200,
            flips in proptest::collection::vec((0usize..128, proptest::prelude::any::<u8>()), 0..6),
            use_valid in proptest::prelude::any::<bool>(),
            file_len in proptest::prelude::any::<u64>(),
        ) {
            let bytes = if use_valid {
                let mut h = header(1 + (cut % 3) as u8, "{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }");
                for (i, b) in flips {
                    if let Some(x) = h.get_mut(i) {
                        *x = b;
                    }
                }
                h.truncate(h.len().saturating_sub(cut % 7 * (cut % 2)));
                h
            } else {
                random
            };
            let file_len = file_len.min(bytes.len() as u64 + 64);
            if let Ok(h) = parse(&bytes, file_len) {
                proptest::prop_assert!(h.len <= file_len, "header of {} bytes in a {file_len}-byte file", h.len);
            }
        }
    }

    #[test]
    fn reads_numpys_headers_of_every_version() {
        for version in [1, 2, 3] {
            let h = header(
                version,
                "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            );
            let len = h.len() as u64;
            let got = parse(&h, len + 24).unwrap();
            assert_eq!(got.descr.as_deref(), Some("<f4"));
            assert_eq!(got.descr_text, "'<f4'");
            assert_eq!(got.shape, [2, 3]);
            assert_eq!(got.len, len);
        }
        let h = header(1, "{\"shape\": (), \"fortran_order\": True, \"descr\": \"|b1\"}");
        let got = parse(&h, h.len() as u64 + 1).unwrap();
        assert_eq!((got.descr.as_deref(), got.shape), (Some("|b1"), vec![]));
        let h = header(
            1,
            "{'descr': [('a', '<f4', (2,)), ('b', '|b1')], 'fortran_order': False, 'shape': (5,)}",
        );
        let got = parse(&h, h.len() as u64).unwrap();
        assert_eq!(got.descr, None);
        assert_eq!(got.descr_text, "[('a', '<f4', (2,)), ('b', '|b1')]");
        assert_eq!(got.shape, [5]);
    }

    #[test]
    fn refuses_malformed_headers_without_reading_past_the_file() {
        let invalid = |bytes: &[u8]| match parse(bytes, bytes.len() as u64) {
            Err(HeaderError::Invalid(reason)) => reason,
            other => panic!("expected an invalid header, got {other:?}"),
        };
        let ok = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
        let mut h = header(1, ok);
        h[0] = b'x';
        assert!(invalid(&h).contains("magic"));
        let mut h = header(1, ok);
        h[6] = 4;
        assert!(invalid(&h).contains("version 4.0"));
        assert!(invalid(&header(1, "{'descr': '<f4', 'shape': (2, 3)}")).contains("fortran_order"));
        assert!(invalid(&header(
            1,
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, -3)}"
        ))
        .contains("byte"));
        assert!(
            invalid(&header(1, "{'descr': '<f4', 'fortran_order': 0, 'shape': (2,)}"))
                .contains("fortran_order")
        );
        let deep = format!(
            "{{'descr': '<f4', 'fortran_order': False, 'shape': {}}}",
            "(".repeat(100_000)
        );
        assert!(invalid(&header(2, &deep)).contains("nests too deeply"));
        let huge =
            "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999999999999999999999999,)}";
        assert!(invalid(&header(1, huge)).contains("too large"));
        // A header length past the end of the file: an early end, nothing allocated.
        let mut h = MAGIC.to_vec();
        h.extend([2, 0]);
        h.extend(u32::MAX.to_le_bytes());
        assert!(
            matches!(parse(&h, h.len() as u64), Err(HeaderError::Io(e)) if e.kind() == io::ErrorKind::UnexpectedEof)
        );
    }

    #[test]
    fn item_sizes_of_numpy_type_strings() {
        for (descr, size) in [
            ("<f4", Some(4)),
            (">f8", Some(8)),
            ("|b1", Some(1)),
            ("<i8", Some(8)),
            ("|u1", Some(1)),
            ("<c16", Some(16)),
            ("<U3", Some(12)),
            ("|S5", Some(5)),
            ("<M8[ns]", Some(8)),
            ("f4", Some(4)),
            ("|O", None),
            ("<f", None),
            ("", None),
            ("<x4", None),
        ] {
            assert_eq!(item_size(descr), size, "{descr}");
        }
    }

    #[test]
    fn the_claimed_shape_must_account_for_exactly_the_data() {
        let dir = std::env::temp_dir().join(format!("wgpu-attention-npy-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let check = |name: &str, dict: &str, data: usize| {
            let path = dir.join(name);
            let mut bytes = header(1, dict);
            bytes.resize(bytes.len() + data, 0);
            std::fs::write(&path, bytes).unwrap();
            open_checked(&path, "q", "float32 ('<f4')", "x.astype(np.float32)")
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let f4 = |shape: &str| format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape}, }}");
        check("ok.npy", &f4("(2, 3)"), 24).unwrap();
        check("empty.npy", &f4("(0, 3)"), 0).unwrap();
        check("scalar.npy", &f4("()"), 4).unwrap();
        let e = check("short.npy", &f4("(4, 4)"), 8).unwrap_err();
        assert!(
            e.contains("[4, 4]") && e.contains("64 bytes") && e.contains("has 8 bytes"),
            "{e}"
        );
        let e = check("long.npy", &f4("(2,)"), 9).unwrap_err();
        assert!(e.contains("has 9 bytes"), "{e}");
        let e = check("overflow.npy", &f4("(4294967296, 4294967296, 4294967296)"), 4).unwrap_err();
        assert!(
            e.contains("[4294967296, 4294967296, 4294967296]") && e.contains("overflows"),
            "{e}"
        );
        let e = check(
            "object.npy",
            "{'descr': '|O', 'fortran_order': False, 'shape': (1,)}",
            8,
        )
        .unwrap_err();
        assert!(e.contains("has dtype '|O', expected float32"), "{e}");
        let e = check("none.npy", "", 0).unwrap_err();
        assert!(e.contains("not a valid .npy file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
