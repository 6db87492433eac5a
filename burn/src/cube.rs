//! burn's cubecl tensors as the kernels' buffers: the buffer, byte offset and strides behind a
//! tensor (fusion resolved, burn's pending work submitted), outputs allocated by burn, and the
//! way back into burn's fusion backend.

use burn::backend::fusion::stream::StreamId;
use burn::backend::fusion::{FusionTensor, NoOp};
use burn::backend::ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};
use burn::backend::{DType, Shape, TensorMetadata};
use burn_cubecl::cubecl::server::ServerError;
use burn_cubecl::cubecl::wgpu::{AutoCompiler, WgpuResource, WgpuServer};
use burn_cubecl::fusion::FusionCubeRuntime;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use wgpu_attention::{Context, Storage};

use crate::{Error, Result};

/// The primitive of burn's float tensors on the cubecl runtimes (fusion on).
pub(crate) type Fused = FusionTensor<FusionCubeRuntime>;

/// The cubecl tensor behind a fusion tensor: burn's fused work that produces it runs first.
pub(crate) fn resolve(t: Fused) -> CubeTensor {
    t.client.clone().resolve_tensor_float::<CubeBackend>(t)
}

/// A cubecl tensor handed back to burn's fusion backend.
pub(crate) fn fuse(t: CubeTensor) -> Fused {
    let client = burn::backend::fusion::get_client::<CubeBackend>(&t.device);
    let (shape, dtype) = (t.shape(), t.dtype);
    let handle = <CubeBackend as BackendIr>::float_tensor_handle(t);
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            StreamId::current(),
            OperationIr::Init(desc),
            NoOp::<CubeBackend>::new(),
        )
        .output()
}

/// The kernels' storage format of a burn dtype.
pub(crate) fn storage(dtype: DType, name: &'static str) -> Result<Storage> {
    match dtype {
        DType::F32 => Ok(Storage::F32),
        DType::F16 => Ok(Storage::F16),
        DType::BF16 => Ok(Storage::Bf16),
        other => Err(Error::DType {
            name,
            dtype: format!("{other:?}"),
        }),
    }
}

/// A tensor the kernels read or write: burn's tensor (kept alive until the work that uses it is
/// submitted) and its memory, pinned in place while this lives.
pub(crate) struct Bound {
    pub tensor: CubeTensor,
    resource: cubecl_runtime::storage::ManagedResource<WgpuResource>,
    pub storage: Storage,
}

impl Bound {
    /// Bind `t` in place: the layout burn gave it when the kernels can read it (row-major
    /// strides with E's 1, none 0), else a contiguous copy made by burn.
    pub fn new(t: CubeTensor, name: &'static str) -> Result<Bound> {
        let storage = storage(t.dtype, name)?;
        let strides = t.meta.strides();
        let readable = !t.meta.is_tiled() && strides.last() == Some(&1) && strides.iter().all(|&s| s > 0);
        let tensor = if readable {
            t
        } else {
            burn_cubecl::kernel::into_contiguous(t)
        };
        let resource = tensor
            .client
            .get_resource::<WgpuServer<AutoCompiler>>(tensor.handle.clone())
            .map_err(|e| not_wgpu(name, e))?;
        Ok(Bound {
            tensor,
            resource,
            storage,
        })
    }

    /// A new contiguous tensor of `shape` in `dtype`, allocated by burn on `like`'s device.
    pub fn empty(like: &CubeTensor, shape: Vec<usize>, dtype: DType, name: &'static str) -> Result<Bound> {
        let t = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            Shape::from(shape),
            dtype,
        );
        Bound::new(t, name)
    }

    /// [`Bound::empty`] with its byte size rounded up to 4: the destination of a buffer copy
    /// (wgpu copies whole 4-byte words).
    pub fn empty_padded(
        like: &CubeTensor,
        shape: Vec<usize>,
        dtype: DType,
        name: &'static str,
    ) -> Result<Bound> {
        let bytes = shape.iter().product::<usize>() * dtype.size();
        let handle = like.client.empty(bytes.next_multiple_of(4));
        let t = CubeTensor::new_contiguous(
            like.client.clone(),
            like.device.clone(),
            Shape::from(shape),
            handle,
            dtype,
        );
        Bound::new(t, name)
    }

    pub fn shape(&self) -> Vec<usize> {
        self.tensor.meta.shape().iter().copied().collect()
    }

    /// The kernels' view of it: the buffer from the tensor's byte offset, with its strides.
    pub fn view(&self) -> wgpu_attention::Tensor<'_> {
        let r = self.resource.resource();
        let t =
            wgpu_attention::Tensor::from_buffer(&r.buffer, self.storage, &self.shape()).at_offset(r.offset);
        if self.tensor.is_contiguous() {
            return t;
        }
        let strides: Vec<usize> = self.tensor.meta.strides().iter().copied().collect();
        t.with_strides(&strides)
    }

    pub fn buffer(&self) -> (&wgpu_attention::wgpu::Buffer, u64, u64) {
        let r = self.resource.resource();
        (&r.buffer, r.offset, r.size)
    }
}

fn not_wgpu(name: &'static str, e: ServerError) -> Error {
    Error::NotWgpu {
        name,
        detail: format!("{e:?}"),
    }
}

/// The context of the device a cubecl tensor lives on.
pub(crate) fn context(t: &CubeTensor, name: &'static str) -> Result<Context> {
    match &t.device {
        CubeDevice::Wgpu(d) => crate::device::lookup(d, name),
        other => Err(Error::NotWgpu {
            name,
            detail: format!("on {other:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_the_kernels_lack_are_refused_by_name() {
        assert_eq!(storage(DType::F32, "q").unwrap(), Storage::F32);
        assert_eq!(storage(DType::F16, "q").unwrap(), Storage::F16);
        assert_eq!(storage(DType::BF16, "q").unwrap(), Storage::Bf16);
        for dtype in [DType::F64, DType::Flex32, DType::I32, DType::U8] {
            match storage(dtype, "k") {
                Err(Error::DType { name: "k", dtype: d }) => assert_eq!(d, format!("{dtype:?}")),
                other => panic!("{dtype:?}: {other:?}"),
            }
        }
    }
}
