//! Attention weights as a picture (feature `heatmap`, on by default).
//!
//! One panel per head, laid out in a near-square grid; in each panel rows are queries (top =
//! first) and columns keys (left = first); colours run from dark blue (0) through green to
//! yellow (the largest weight in the picture), and the bar on the right is that colour scale
//! (bottom 0, top the maximum).

use std::io::Cursor;

use ndarray::ArrayView3;

use crate::error::{Error, Result};

/// Pixels between panels and around the picture.
const GAP: u32 = 6;
/// Width of the colour bar.
const BAR: u32 = 14;
/// Largest picture side accepted.
const MAX_SIDE: u64 = 16_384;

/// The colour map of the pictures (viridis-like): `t` in [0, 1] to RGB (NaN as 0). The web
/// demo draws its canvas heatmap with it.
pub fn colour(t: f32) -> [u8; 3] {
    const STOPS: [[f32; 3]; 5] = [
        [68.0, 1.0, 84.0],
        [59.0, 82.0, 139.0],
        [33.0, 145.0, 140.0],
        [94.0, 201.0, 98.0],
        [253.0, 231.0, 37.0],
    ];
    let t = if t.is_nan() { 0.0 } else { t.clamp(0.0, 1.0) } * (STOPS.len() - 1) as f32;
    let i = (t.floor() as usize).min(STOPS.len() - 2);
    let f = t - i as f32;
    let mut rgb = [0u8; 3];
    for (c, out) in rgb.iter_mut().enumerate() {
        *out = (STOPS[i][c] + (STOPS[i + 1][c] - STOPS[i][c]) * f).round() as u8;
    }
    rgb
}

/// Render `weights` `[heads, queries, keys]` (one batch element's per-head weights, or
/// `[1, L, S]` averaged weights) as PNG bytes, each weight a `cell` x `cell` square.
pub fn heatmap_png(weights: ArrayView3<f32>, cell: u32) -> Result<Vec<u8>> {
    let (h, l, s) = weights.dim();
    if h == 0 || l == 0 || s == 0 || cell == 0 {
        return Err(Error::ZeroSized {
            tensor: "heatmap weights",
            shape: vec![h, l, s, cell as usize],
        });
    }
    let cols = (h as f64).sqrt().ceil() as u64;
    let rows = (h as u64).div_ceil(cols);
    let (pw, ph) = (s as u64 * cell as u64, l as u64 * cell as u64);
    let width = GAP as u64 + cols * (pw + GAP as u64) + BAR as u64 + GAP as u64;
    let height = GAP as u64 + rows * (ph + GAP as u64);
    if width > MAX_SIDE || height > MAX_SIDE {
        return Err(Error::TooLargeForDevice {
            what: format!("heatmap of {width} x {height} pixels"),
            bytes: width * height * 3,
            limit_name: "heatmap side",
            limit: MAX_SIDE,
            hint: " (use a smaller cell size)",
        });
    }
    let max = weights
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .fold(0.0f32, f32::max);
    let scale = if max > 0.0 { 1.0 / max } else { 0.0 };
    let mut img = image::RgbImage::from_pixel(width as u32, height as u32, image::Rgb([255, 255, 255]));
    for head in 0..h {
        let x0 = GAP as u64 + (head as u64 % cols) * (pw + GAP as u64);
        let y0 = GAP as u64 + (head as u64 / cols) * (ph + GAP as u64);
        for i in 0..l {
            for j in 0..s {
                let rgb = image::Rgb(colour(weights[[head, i, j]] * scale));
                for dy in 0..cell as u64 {
                    for dx in 0..cell as u64 {
                        let x = (x0 + j as u64 * cell as u64 + dx) as u32;
                        let y = (y0 + i as u64 * cell as u64 + dy) as u32;
                        img.put_pixel(x, y, rgb);
                    }
                }
            }
        }
    }
    // The colour bar: bottom = 0, top = max.
    let bx = (width - GAP as u64 - BAR as u64) as u32;
    let (top, bottom) = (GAP, (height - GAP as u64) as u32);
    for y in top..bottom {
        let t = (bottom - 1 - y) as f32 / (bottom - top - 1).max(1) as f32;
        for x in bx..bx + BAR {
            img.put_pixel(x, y, image::Rgb(colour(t)));
        }
    }
    let mut png = Vec::new();
    img.write_to(&mut Cursor::new(&mut png), image::ImageFormat::Png)
        .map_err(|e| Error::Io(format!("PNG encoding: {e}")))?;
    Ok(png)
}

/// [`heatmap_png`] written to `path`.
#[cfg(not(target_arch = "wasm32"))]
pub fn write_heatmap(path: impl AsRef<std::path::Path>, weights: ArrayView3<f32>, cell: u32) -> Result<()> {
    let png = heatmap_png(weights, cell)?;
    std::fs::write(path.as_ref(), png)
        .map_err(|e| Error::Io(format!("writing {}: {e}", path.as_ref().display())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array3;

    #[test]
    fn colour_map_ends_and_monotone_brightness() {
        assert_eq!(colour(0.0), [68, 1, 84]);
        assert_eq!(colour(1.0), [253, 231, 37]);
        assert_eq!(colour(f32::NAN), colour(0.0));
        let lum = |c: [u8; 3]| c[0] as u32 * 3 + c[1] as u32 * 6 + c[2] as u32;
        let mut last = 0;
        for i in 0..=20 {
            let l = lum(colour(i as f32 / 20.0));
            assert!(l >= last, "brightness must not fall");
            last = l;
        }
    }

    #[test]
    fn png_has_one_panel_per_head_and_decodes() {
        let mut w = Array3::<f32>::zeros((3, 4, 5));
        w[[1, 2, 3]] = 1.0;
        let png = heatmap_png(w.view(), 2).unwrap();
        let img = image::load_from_memory(&png).unwrap().to_rgb8();
        // 2 x 2 grid of 10 x 8 panels, gaps of 6, bar of 14.
        assert_eq!(img.width(), 6 + 2 * (10 + 6) + 14 + 6);
        assert_eq!(img.height(), 6 + 2 * (8 + 6));
        // Head 1 is the second panel of the first row; its weight (2, 3) is the brightest.
        let (x, y) = (6 + 16 + 3 * 2, 6 + 2 * 2);
        assert_eq!(img.get_pixel(x, y).0, colour(1.0));
        assert_eq!(img.get_pixel(6, 6).0, colour(0.0));
        assert!(heatmap_png(Array3::<f32>::zeros((0, 1, 1)).view(), 1).is_err());
        assert!(heatmap_png(Array3::<f32>::zeros((1, 10_000, 10_000)).view(), 4).is_err());
    }
}
