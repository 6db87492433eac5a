//! GPU-side timing: the time the device spent on recorded work, from timestamp queries.

use std::time::Duration;

use crate::device::context::Context;
use crate::error::{Error, Result};

/// What [`Context::time_gpu`] returns: the recorder's result and the GPU time.
#[derive(Debug)]
pub struct GpuTimed<T> {
    /// What the recorder returned (the output buffers, typically).
    pub value: T,
    /// The time between the GPU's timestamps written before and after the recorded commands;
    /// `None` where the device lacks `TIMESTAMP_QUERY` (the work still ran).
    pub gpu: Option<Duration>,
}

impl Context {
    /// Whether [`Context::time_gpu`] can measure: the device has `TIMESTAMP_QUERY`.
    pub fn has_gpu_timer(&self) -> bool {
        self.features().contains(wgpu::Features::TIMESTAMP_QUERY)
    }

    /// Record with `record` into a fresh encoder framed by two timestamp queries, submit it,
    /// wait for it, and return the recorder's result with the GPU time between the timestamps
    /// (the dispatches alone: no host work, upload or readback unless recorded). Uses empty
    /// compute passes' timestamp writes, so `TIMESTAMP_QUERY` suffices (no
    /// `TIMESTAMP_QUERY_INSIDE_ENCODERS`). Without the feature the work runs and `gpu` is
    /// `None`. Device errors in the recorded work are returned.
    pub async fn time_gpu<T>(
        &self,
        record: impl FnOnce(&mut wgpu::CommandEncoder) -> Result<T>,
    ) -> Result<GpuTimed<T>> {
        let device = self.device();
        let timed = self.has_gpu_timer();
        let (value, readback) = self
            .scoped(|| {
                let mut encoder = device.create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("wgpu-attention timed"),
                });
                let queries = timed.then(|| {
                    device.create_query_set(&wgpu::QuerySetDescriptor {
                        label: Some("wgpu-attention timer"),
                        ty: wgpu::QueryType::Timestamp,
                        count: 2,
                    })
                });
                let mark = |encoder: &mut wgpu::CommandEncoder, qs: &wgpu::QuerySet, i: u32| {
                    encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                        label: Some("wgpu-attention timestamp"),
                        timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                            query_set: qs,
                            beginning_of_pass_write_index: (i == 0).then_some(0),
                            end_of_pass_write_index: (i == 1).then_some(1),
                        }),
                    });
                };
                if let Some(qs) = &queries {
                    mark(&mut encoder, qs, 0);
                }
                let value = record(&mut encoder)?;
                let readback = queries.map(|qs| {
                    mark(&mut encoder, &qs, 1);
                    let resolve = device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some("wgpu-attention timer resolve"),
                        size: 16,
                        usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                        mapped_at_creation: false,
                    });
                    let read = device.create_buffer(&wgpu::BufferDescriptor {
                        label: Some("wgpu-attention timer readback"),
                        size: 16,
                        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                        mapped_at_creation: false,
                    });
                    encoder.resolve_query_set(&qs, 0..2, &resolve, 0);
                    encoder.copy_buffer_to_buffer(&resolve, 0, &read, 0, 16);
                    read
                });
                self.queue().submit([encoder.finish()]);
                Ok((value, readback))
            })
            .await?;
        let Some(read) = readback else {
            self.wait()?;
            return Ok(GpuTimed { value, gpu: None });
        };
        let (tx, rx) = futures_intrusive::channel::shared::oneshot_channel();
        read.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        match rx.receive().await {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(Error::Readback(e.to_string())),
            None => return Err(Error::Readback("map callback dropped".into())),
        }
        let ticks: [u64; 2] = {
            let view = read
                .get_mapped_range(..)
                .map_err(|e| Error::Readback(e.to_string()))?;
            bytemuck::pod_read_unaligned(&view[..16])
        };
        read.unmap();
        let ns = ticks[1].saturating_sub(ticks[0]) as f64 * f64::from(self.queue().get_timestamp_period());
        Ok(GpuTimed {
            value,
            gpu: Some(Duration::from_nanos(ns.round() as u64)),
        })
    }

    /// [`Context::time_gpu`], blocking (native targets).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn time_gpu_blocking<T>(
        &self,
        record: impl FnOnce(&mut wgpu::CommandEncoder) -> Result<T>,
    ) -> Result<GpuTimed<T>> {
        pollster::block_on(self.time_gpu(record))
    }
}
