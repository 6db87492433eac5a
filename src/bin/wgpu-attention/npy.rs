//! Every `.npy` read and write of the tool, with messages naming the file and what was
//! expected.

use std::path::Path as FsPath;

use ndarray::{ArrayD, Ix4};
use ndarray_npy::{read_npy, write_npy, ReadNpyError, WritableElement};

use crate::CliResult;

/// Read a `.npy` of element type `T`, with messages naming the file and what was expected.
pub(crate) fn read_array<T: ndarray_npy::ReadableElement>(
    path: &FsPath,
    what: &str,
    dtype: &str,
    fix: &str,
) -> CliResult<ArrayD<T>> {
    read_npy::<_, ArrayD<T>>(path).map_err(|e| {
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

/// Read q, k or v: f32 and exactly 4-D.
pub(crate) fn read_qkv(path: &FsPath, what: &str, layout: &str) -> CliResult<ndarray::Array4<f32>> {
    let a = read_array::<f32>(path, what, "float32 ('<f4')", "x.astype(np.float32)")?;
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

/// Read an f32 `.npy` of exactly 3 dimensions.
pub(crate) fn read_3d(path: &FsPath, what: &str, layout: &str) -> CliResult<ndarray::Array3<f32>> {
    let a = read_array::<f32>(path, what, "float32 ('<f4')", "x.astype(np.float32)")?;
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
