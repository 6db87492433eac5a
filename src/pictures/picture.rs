//! What the pictures ([`crate::heatmap`], [`crate::plot`]) share: the bundled font and its text,
//! the RGB canvas (plotters' bitmap backend), PNG encoding and the size limits.
//!
//! Text is laid out and rasterised here with ab_glyph (the rasteriser plotters' `ab_glyph`
//! feature uses) rather than by plotters' text elements, which drop each glyph's side bearing
//! (uneven letter spacing) and place the baseline half the size below the anchor: here glyphs
//! sit on their bearings and kerning, anchored by their ink (start, middle or end along the
//! text; top, middle of the capitals or baseline across it), horizontal or reading upward.

use std::sync::OnceLock;

use ab_glyph::{point, Font, FontRef, GlyphId, PxScale, ScaleFont};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::{Error, Result};

/// The name the bundled font is registered under (process-wide, in plotters' font table).
const FONT: &str = "wgpu-attention DejaVu Sans";
/// DejaVu Sans 2.37 (assets/fonts/LICENSE-DejaVu.txt): Latin, Greek, Cyrillic and the common
/// symbols, so that no system font is needed.
static FONT_BYTES: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// Largest picture side accepted.
pub(crate) const MAX_SIDE: u64 = 16_384;
/// Largest picture area accepted (pixels; 3 bytes each while drawing).
pub(crate) const MAX_PIXELS: u64 = 1 << 26;

/// The drawing surface of every picture.
pub(crate) type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// Text colour.
pub(crate) const INK: RGBColor = RGBColor(30, 30, 30);

/// The bundled font, parsed once; on first use it is also registered with plotters under its
/// own name and as `"sans-serif"`, so that text plotters draws itself needs no system font.
fn font() -> Result<&'static FontRef<'static>> {
    static PARSED: OnceLock<Option<FontRef<'static>>> = OnceLock::new();
    PARSED
        .get_or_init(|| {
            let font = FontRef::try_from_slice(FONT_BYTES).ok()?;
            for name in [FONT, "sans-serif"] {
                plotters::style::register_font(name, FontStyle::Normal, FONT_BYTES).ok()?;
            }
            Some(font)
        })
        .as_ref()
        .ok_or_else(|| Error::Picture("the bundled font does not parse".into()))
}

/// A plotters (or other drawing) error as the crate's error.
pub(crate) fn draw_err(e: impl std::fmt::Display) -> Error {
    Error::Picture(format!("drawing failed: {e}"))
}

/// `width` x `height` within the limits, else an error naming `what`.
pub(crate) fn check_size(what: &str, width: u64, height: u64) -> Result<(u32, u32)> {
    if width == 0 || height == 0 || width > MAX_SIDE || height > MAX_SIDE || width * height > MAX_PIXELS {
        return Err(Error::Picture(format!(
            "{what} of {width} x {height} pixels: each side must be 1 to {MAX_SIDE} pixels and the \
             area at most {MAX_PIXELS} pixels"
        )));
    }
    Ok((width as u32, height as u32))
}

/// A white `width` x `height` canvas handed to `draw`, then encoded as an 8-bit RGB PNG.
pub(crate) fn png(width: u32, height: u32, draw: impl FnOnce(&Area<'_>) -> Result<()>) -> Result<Vec<u8>> {
    check_size("picture", width as u64, height as u64)?;
    font()?;
    let mut rgb = vec![255u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        draw(&root)?;
        root.present().map_err(draw_err)?;
    }
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Balanced);
    let encode_err = |e: png::EncodingError| Error::Io(format!("PNG encoding: {e}"));
    let mut writer = encoder.write_header().map_err(encode_err)?;
    writer.write_image_data(&rgb).map_err(encode_err)?;
    writer.finish().map_err(encode_err)?;
    Ok(out)
}

/// `bytes` written to `path`.
pub(crate) fn write(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::Io(format!("writing {}: {e}", path.display())))
}

/// Where a text sits against its anchor point, along and across its reading direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Align {
    /// The anchor is the text's start (along) or the top of its capitals (across).
    Start,
    /// The anchor is the text's middle (along) or the middle of its capitals (across).
    Centre,
    /// The anchor is the text's end (along) or its baseline (across).
    End,
}

/// A piece of text: size (pixels, ab_glyph's scale: ascent to descent), colour and direction.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Text {
    /// Font size in pixels.
    pub size: f64,
    /// Colour.
    pub colour: RGBColor,
    /// Turned a quarter to the left (reads upward).
    pub upward: bool,
}

impl Text {
    /// Horizontal text of `size` pixels in [`INK`].
    pub(crate) fn new(size: f64) -> Self {
        Text {
            size,
            colour: INK,
            upward: false,
        }
    }

    /// The same, read upward.
    pub(crate) fn upward(self) -> Self {
        Text { upward: true, ..self }
    }

    /// Each glyph of `text` with its pen position along the baseline, and the total advance.
    fn glyphs(&self, text: &str) -> Result<(Vec<(GlyphId, f32)>, f32)> {
        let font = font()?.as_scaled(PxScale::from(self.size as f32));
        let mut pen = 0.0f32;
        let mut prev = None;
        let mut glyphs = Vec::new();
        for c in text.chars() {
            let id = font.glyph_id(c);
            if let Some(p) = prev {
                pen += font.kern(p, id);
            }
            glyphs.push((id, pen));
            pen += font.h_advance(id);
            prev = Some(id);
        }
        Ok((glyphs, pen))
    }

    /// The advance width of `text` in pixels (its length along the reading direction).
    pub(crate) fn width(&self, text: &str) -> Result<i32> {
        Ok(self.glyphs(text)?.1.ceil() as i32)
    }

    /// Height of the capitals in pixels.
    pub(crate) fn cap_height(&self) -> i32 {
        (self.size * CAP).round() as i32
    }

    /// Draws `text` with the point `along` x `across` of it at `at` (pixels), glyph by glyph
    /// with the font's side bearings and kerning, blended by coverage.
    pub(crate) fn draw(
        &self,
        area: &Area<'_>,
        text: &str,
        at: (i32, i32),
        along: Align,
        across: Align,
    ) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        let (glyphs, w) = self.glyphs(text)?;
        let font = font()?;
        let scale = PxScale::from(self.size as f32);
        // The anchor in the text's own frame: x along the baseline, y down from it.
        let ax = match along {
            Align::Start => 0.0,
            Align::Centre => w / 2.0,
            Align::End => w,
        };
        let cap = (self.size * CAP) as f32;
        let ay = match across {
            Align::Start => -cap,
            Align::Centre => -cap / 2.0,
            Align::End => 0.0,
        };
        let (fx, fy) = (at.0 as f32, at.1 as f32);
        for (id, pen) in glyphs {
            let glyph = id.with_scale_and_position(scale, point(pen - ax, -ay));
            let Some(outline) = font.outline_glyph(glyph) else {
                continue;
            };
            let b = outline.px_bounds();
            let mut result = Ok(());
            outline.draw(|x, y, coverage| {
                if coverage <= 0.0 || result.is_err() {
                    return;
                }
                let (tx, ty) = (b.min.x + x as f32, b.min.y + y as f32);
                let p = if self.upward {
                    (fx + ty, fy - tx)
                } else {
                    (fx + tx, fy + ty)
                };
                let colour = self.colour.mix(f64::from(coverage.min(1.0)));
                result = area.draw_pixel((p.0.floor() as i32, p.1.floor() as i32), &colour);
            });
            result.map_err(draw_err)?;
        }
        Ok(())
    }
}

/// Capital height of DejaVu Sans as a fraction of ab_glyph's scale (ascent 0.928 + descent 0.236
/// em; capitals 0.729 em).
const CAP: f64 = 0.729 / 1.164;

/// `text` cut to at most `max` characters, with an ellipsis when cut.
pub(crate) fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_string()
    } else {
        let mut s: String = text.chars().take(max.saturating_sub(1)).collect();
        s.push('…');
        s
    }
}

/// A step of 1, 2 or 5 times a power of ten, at least `raw` (> 0, finite).
pub(crate) fn nice_step(raw: f64) -> f64 {
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&s| s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * p)
}

/// `v` written with the decimals a tick `step` needs (no "-0").
pub(crate) fn tick_label(v: f64, step: f64) -> String {
    let mag = v.abs().max(step.abs());
    if mag >= 1e6 || (mag > 0.0 && mag < 1e-4) {
        let s = format!("{v:.1e}");
        return s.replace(".0e", "e");
    }
    let decimals = if step > 0.0 {
        (-step.log10().floor()).max(0.0) as usize
    } else {
        0
    };
    let s = format!("{v:.decimals$}");
    if s.trim_start_matches('-').chars().all(|c| c == '0' || c == '.') {
        format!("{:.decimals$}", 0.0)
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_and_labels() {
        assert_eq!(nice_step(0.17), 0.2);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(1.0), 1.0);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(tick_label(0.4, 0.2), "0.4");
        assert_eq!(tick_label(-0.0, 0.2), "0.0");
        assert_eq!(tick_label(15.0, 5.0), "15");
        assert_eq!(tick_label(2.0e7, 1.0e7), "2e7");
        assert_eq!(shorten("abcdef", 4), "abc…");
        assert_eq!(shorten("abc", 4), "abc");
    }

    #[test]
    fn sizes_out_of_range_are_errors() {
        assert!(check_size("x", 0, 10).is_err());
        assert!(check_size("x", 20_000, 10).is_err());
        assert!(check_size("x", 16_000, 16_000).is_err());
        assert_eq!(check_size("x", 640, 480).unwrap(), (640, 480));
    }
}
