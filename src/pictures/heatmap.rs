//! Attention weights as a picture (feature `heatmap`, on by default).
//!
//! One panel per head, laid out in a near-square grid, each with its title (`head 0`, ... or the
//! caller's); in each panel rows are queries (top = first) and columns keys (left = first), each
//! weight a `cell` x `cell` square (from 16 pixels on, its last row and column white, parting
//! the cells), the query tokens (or indices) written along the left side and
//! the key tokens (or indices) under the panel, turned upright when they are wider than a cell.
//! Colours run from dark blue (0) through green to yellow (the largest weight in the picture);
//! the bar on the right is that colour scale, ticked from 0 to the maximum. The text is drawn
//! with the bundled DejaVu Sans, so no system font is needed.
//!
//! ```no_run
//! # let weights = ndarray::Array3::<f32>::zeros((4, 6, 6));
//! use wgpu_attention::heatmap::Heatmap;
//! let words = ["the", "cat", "sat", "on", "the", "mat"];
//! Heatmap::new(weights.view()).cell(24).tokens(&words).write("map.png")?;
//! # Ok::<(), wgpu_attention::Error>(())
//! ```
//!
//! On wasm32 only [`colour`] is here (plotters cannot draw text into a bitmap there).

#[cfg(not(target_arch = "wasm32"))]
pub use render::{heatmap_png, write_heatmap, Heatmap};

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

#[cfg(not(target_arch = "wasm32"))]
mod render {
    use ndarray::ArrayView3;
    use plotters::prelude::*;

    use super::colour;
    use crate::error::{Error, Result};
    use crate::pictures::picture::{
        self, check_size, draw_err, nice_step, shorten, tick_label, Align, Area, Text,
    };

    /// Margin around the picture.
    const MARGIN: i32 = 8;
    /// Space between panels, across and down.
    const GAP_X: i32 = 18;
    const GAP_Y: i32 = 12;
    /// Width of the colour bar, and its shortest height.
    const BAR: i32 = 14;
    const BAR_MIN: i32 = 80;
    /// The colour bar's caption.
    const BAR_CAPTION: &str = "weight";
    /// The note under the picture.
    const NOTE: &str = "rows: queries, columns: keys";
    /// Labels longer than this many characters are cut (with an ellipsis).
    const MAX_CHARS: usize = 20;

    /// A labelled attention heatmap (see the [module docs](super)): built with [`Heatmap::new`],
    /// then drawn with [`png`](Self::png) or [`write`](Self::write).
    #[derive(Clone, Debug)]
    pub struct Heatmap<'a> {
        weights: ArrayView3<'a, f32>,
        cell: u32,
        queries: Option<Vec<String>>,
        keys: Option<Vec<String>>,
        titles: Option<Vec<String>>,
    }

    /// `tokens` as owned strings.
    fn owned<S: AsRef<str>>(tokens: &[S]) -> Vec<String> {
        tokens.iter().map(|t| t.as_ref().to_string()).collect()
    }

    impl<'a> Heatmap<'a> {
        /// The heatmap of `weights` `[heads, queries, keys]` (one batch element's per-head
        /// weights, or `[1, L, S]` averaged weights), 8 pixels per weight, labelled with indices
        /// and titled `head 0`, `head 1`, ....
        pub fn new(weights: ArrayView3<'a, f32>) -> Self {
            Heatmap {
                weights,
                cell: 8,
                queries: None,
                keys: None,
                titles: None,
            }
        }

        /// Pixels per weight (a side of each square).
        pub fn cell(mut self, cell: u32) -> Self {
            self.cell = cell;
            self
        }

        /// One label per query (row), e.g. the input's tokens.
        pub fn queries<S: AsRef<str>>(mut self, tokens: &[S]) -> Self {
            self.queries = Some(owned(tokens));
            self
        }

        /// One label per key (column).
        pub fn keys<S: AsRef<str>>(mut self, tokens: &[S]) -> Self {
            self.keys = Some(owned(tokens));
            self
        }

        /// The same labels for queries and keys (self-attention).
        pub fn tokens<S: AsRef<str>>(self, tokens: &[S]) -> Self {
            self.queries(tokens).keys(tokens)
        }

        /// One title per panel (head), instead of `head 0`, `head 1`, ....
        pub fn titles<S: AsRef<str>>(mut self, titles: &[S]) -> Self {
            self.titles = Some(owned(titles));
            self
        }

        /// The picture's width and height in pixels. Errors as [`png`](Self::png).
        pub fn size(&self) -> Result<(u32, u32)> {
            Ok(self.layout()?.size)
        }

        /// The picture as PNG bytes (8-bit RGB). Errors: a zero dimension or cell
        /// ([`Error::ZeroSized`]); as many query labels as queries, key labels as keys or titles as
        /// heads not given, or a picture over 16384 pixels a side or 2²⁶ pixels
        /// ([`Error::Picture`]).
        pub fn png(&self) -> Result<Vec<u8>> {
            let layout = self.layout()?;
            let (w, h) = layout.size;
            picture::png(w, h, |root| self.draw(root, &layout))
        }

        /// [`png`](Self::png) written to `path`.
        pub fn write(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
            picture::write(path.as_ref(), &self.png()?)
        }

        /// Checks the weights, the cell size and the labels' counts: `(H, L, S)`.
        fn check(&self) -> Result<(usize, usize, usize)> {
            let (h, l, s) = self.weights.dim();
            let c = self.cell;
            if h == 0 || l == 0 || s == 0 || c == 0 {
                return Err(Error::ZeroSized {
                    tensor: "heatmap weights",
                    shape: vec![h, l, s, c as usize],
                });
            }
            let count = |what: &str, labels: &Option<Vec<String>>, want: usize, of: &str| match labels {
                Some(v) if v.len() != want => Err(Error::Picture(format!(
                    "heatmap: {} {what} for {want} {of}",
                    v.len()
                ))),
                _ => Ok(()),
            };
            count("query labels", &self.queries, l, "queries (L)")?;
            count("key labels", &self.keys, s, "keys (S)")?;
            count("titles", &self.titles, h, "heads")?;
            Ok((h, l, s))
        }

        /// The column labels, every how many columns, and whether upright: across when each
        /// fits its cell(s), else upright.
        fn x_labels(&self, label_t: &Text, s: usize, c: i32) -> Result<(Labels, usize, bool)> {
            let line = label_t.size * 1.25;
            Ok(match &self.keys {
                Some(_) => {
                    let (all, _) = labels(&self.keys, s, 1.0);
                    if widest(label_t, &all)? + 4 <= c {
                        (all, 1, false)
                    } else {
                        let (some, step) = labels(&self.keys, s, line / c as f64);
                        (some, step, true)
                    }
                }
                None => {
                    let widest = label_t.width(&(s - 1).to_string())?;
                    let (some, step) = labels(&None, s, (widest + 6) as f64 / c as f64);
                    (some, step, false)
                }
            })
        }

        /// Checks the input and places everything.
        fn layout(&self) -> Result<Layout> {
            let (h, l, s) = self.check()?;
            let c = self.cell;
            // Too many cells for any picture: refuse before measuring labels.
            let (cells_w, cells_h) = (s as u64 * c as u64, l as u64 * c as u64);
            check_size("heatmap", cells_w, cells_h)?;
            let (cells_w, cells_h) = (cells_w as i32, cells_h as i32);
            let c = c as i32;

            let label_t = Text::new((c as f64 * 0.6).clamp(11.0, 15.0));
            let title_t = Text::new(label_t.size + 2.0);
            let line = label_t.size * 1.25;
            // Rows: every `y_step`-th labelled, so that labels do not overlap.
            let (y_labels, y_step) = labels(&self.queries, l, line / c as f64);
            let y_labels_w = widest(&label_t, &y_labels)?;
            let (x_labels, x_step, upright) = self.x_labels(&label_t, s, c)?;
            let x_labels_w = widest(&label_t, &x_labels)?;
            let titles: Vec<String> = match &self.titles {
                Some(t) => t.iter().map(|t| shorten(t, 40)).collect(),
                None => (0..h).map(|i| format!("head {i}")).collect(),
            };
            let mut title_w = 0;
            for t in &titles {
                title_w = title_w.max(title_t.width(t)?);
            }

            let tick = |step: usize| if step > 1 { 3 } else { 0 };
            let y_labels_w = y_labels_w + 5 + tick(y_step);
            let x_labels_h = 4
                + tick(x_step)
                + if upright {
                    x_labels_w
                } else {
                    label_t.cap_height() + (label_t.size * 0.3) as i32
                };
            let title_h = (title_t.size * 1.5).round() as i32;
            let panel_w = (y_labels_w + cells_w).max(title_w + 4);
            let panel_h = title_h + cells_h + x_labels_h;
            let cols = (h as f64).sqrt().ceil() as i32;
            let rows = (h as i32 + cols - 1) / cols;
            let grid_w = cols * panel_w + (cols - 1) * GAP_X;
            let grid_h = rows * panel_h + (rows - 1) * GAP_Y;

            // The colour bar, beside the grid, as tall as the cells, and its ticks.
            let max = self
                .weights
                .iter()
                .copied()
                .filter(|x| x.is_finite())
                .fold(0.0f32, f32::max);
            let bar_t = Text::new(12.0);
            let bar_top = MARGIN + title_h;
            let bar_bottom = (MARGIN + grid_h - x_labels_h).max(bar_top + BAR_MIN);
            let bar_ticks = bar_ticks(max as f64, (bar_bottom - bar_top) as f64, bar_t.size * 1.3);
            let bar_labels_w = widest(&bar_t, &bar_ticks)?;
            let bar_x = MARGIN + grid_w + GAP_X;
            let bar_w = (BAR + 6 + bar_labels_w).max(bar_t.width(BAR_CAPTION)? + 2);
            // Under everything, which way the panels read.
            let note_t = Text::new(12.0);
            let note_w = note_t.width(NOTE)?;
            let grid_bottom = (MARGIN + grid_h).max(bar_bottom + bar_t.size as i32);
            let width = (bar_x + bar_w).max(MARGIN + note_w) + MARGIN;
            let height = grid_bottom + 6 + (note_t.size * 1.2) as i32 + MARGIN;
            let size = check_size("heatmap", width as u64, height as u64)?;
            Ok(Layout {
                size,
                cell: c,
                label_t,
                title_t,
                bar_t,
                y_labels,
                y_step,
                x_labels,
                x_step,
                upright,
                titles,
                y_labels_w,
                title_h,
                panel: (panel_w, panel_h),
                cols,
                max,
                bar: (bar_x, bar_top, bar_bottom),
                bar_ticks,
                note: (note_t, grid_bottom + 6),
            })
        }

        fn draw(&self, root: &Area<'_>, p: &Layout) -> Result<()> {
            let (_, l, s) = self.weights.dim();
            let c = p.cell;
            let scale = if p.max > 0.0 { 1.0 / p.max } else { 0.0 };
            // Cells of 16 pixels or more keep a 1-pixel white line on their right and bottom.
            let fill = if c >= 16 { c - 1 } else { c };
            let ink = picture::INK;
            for (head, weights) in self.weights.outer_iter().enumerate() {
                let (px, py) = (
                    MARGIN + (head as i32 % p.cols) * (p.panel.0 + GAP_X),
                    MARGIN + (head as i32 / p.cols) * (p.panel.1 + GAP_Y),
                );
                let (x0, y0) = (px + p.y_labels_w, py + p.title_h);
                for ((i, j), &w) in weights.indexed_iter() {
                    let [r, g, b] = colour(w * scale);
                    let (x, y) = (x0 + j as i32 * c, y0 + i as i32 * c);
                    root.draw(&Rectangle::new(
                        [(x, y), (x + fill, y + fill)],
                        RGBColor(r, g, b).filled(),
                    ))
                    .map_err(draw_err)?;
                }
                let (cells_w, cells_h) = (s as i32 * c, l as i32 * c);
                let title = &p.titles[head];
                let tw = p.title_t.width(title)?;
                let tx = (x0 + cells_w / 2).max(px + tw / 2);
                p.title_t
                    .draw(root, title, (tx, py + 3), Align::Centre, Align::Start)?;
                let y_tick = if p.y_step > 1 { 3 } else { 0 };
                for (i, t) in &p.y_labels {
                    let y = y0 + *i as i32 * c + c / 2;
                    if y_tick > 0 {
                        root.draw(&PathElement::new(vec![(x0 - y_tick, y), (x0 - 1, y)], ink))
                            .map_err(draw_err)?;
                    }
                    p.label_t
                        .draw(root, t, (x0 - 4 - y_tick, y), Align::End, Align::Centre)?;
                }
                let x_tick = if p.x_step > 1 { 3 } else { 0 };
                let below = y0 + cells_h;
                for (j, t) in &p.x_labels {
                    let x = x0 + *j as i32 * c + c / 2;
                    if x_tick > 0 {
                        root.draw(&PathElement::new(vec![(x, below), (x, below + x_tick - 1)], ink))
                            .map_err(draw_err)?;
                    }
                    let at = (x, below + 4 + x_tick);
                    if p.upright {
                        p.label_t.upward().draw(root, t, at, Align::End, Align::Centre)?;
                    } else {
                        p.label_t.draw(root, t, at, Align::Centre, Align::Start)?;
                    }
                }
            }
            // The colour bar: bottom 0, top the maximum, captioned above.
            let (bx, top, bottom) = p.bar;
            p.bar_t
                .draw(root, BAR_CAPTION, (bx, MARGIN + 3), Align::Start, Align::Start)?;
            for y in top..bottom {
                let t = (bottom - 1 - y) as f32 / (bottom - top - 1).max(1) as f32;
                let [r, g, b] = colour(t);
                root.draw(&PathElement::new(
                    vec![(bx, y), (bx + BAR - 1, y)],
                    RGBColor(r, g, b),
                ))
                .map_err(draw_err)?;
            }
            root.draw(&Rectangle::new(
                [(bx, top), (bx + BAR - 1, bottom - 1)],
                RGBColor(120, 120, 120),
            ))
            .map_err(draw_err)?;
            for (y, label) in &p.bar_ticks {
                let y = bottom - 1 - (*y * (bottom - top - 1) as f64).round() as i32;
                root.draw(&PathElement::new(vec![(bx + BAR, y), (bx + BAR + 3, y)], ink))
                    .map_err(draw_err)?;
                p.bar_t
                    .draw(root, label, (bx + BAR + 6, y), Align::Start, Align::Centre)?;
            }
            let (note_t, note_y) = p.note;
            let grey = Text {
                colour: RGBColor(90, 90, 90),
                ..note_t
            };
            grey.draw(root, NOTE, (MARGIN, note_y), Align::Start, Align::Start)?;
            Ok(())
        }
    }

    /// Everything placed: sizes and positions in pixels.
    struct Layout {
        size: (u32, u32),
        cell: i32,
        label_t: Text,
        title_t: Text,
        bar_t: Text,
        /// (row, label) of the labelled rows, every `y_step`-th.
        y_labels: Vec<(usize, String)>,
        y_step: usize,
        /// (column, label) of the labelled columns, every `x_step`-th; upright or across.
        x_labels: Vec<(usize, String)>,
        x_step: usize,
        upright: bool,
        titles: Vec<String>,
        /// Width left of the cells for the row labels.
        y_labels_w: i32,
        /// Height above the cells for the title.
        title_h: i32,
        /// Panel width and height.
        panel: (i32, i32),
        cols: i32,
        max: f32,
        /// Colour bar: left x, top and bottom y.
        bar: (i32, i32, i32),
        /// Colour bar ticks: (fraction of the bar's height, label).
        bar_ticks: Vec<(f64, String)>,
        /// The note's text style and top.
        note: (Text, i32),
    }

    /// Labels and the index (row or column) each names.
    type Labels = Vec<(usize, String)>;

    /// The widest of `labels` in `t`'s text (0 for none).
    fn widest<T>(t: &Text, labels: &[(T, String)]) -> Result<i32> {
        labels.iter().try_fold(0, |w, (_, s)| Ok(w.max(t.width(s)?)))
    }

    /// The labels of `n` positions (the given ones, else indices), every `step`-th, where `step`
    /// is the least that spaces them at least `min_cells` cells apart (a 1-2-5 number for
    /// indices, so that they read 0, 5, 10, ...).
    fn labels(given: &Option<Vec<String>>, n: usize, min_cells: f64) -> (Vec<(usize, String)>, usize) {
        let step = match given {
            Some(_) => min_cells.ceil().max(1.0) as usize,
            None => nice_step(min_cells.max(1.0)) as usize,
        };
        let labels = (0..n)
            .step_by(step)
            .map(|i| {
                let text = match given {
                    Some(t) => shorten(&t[i], MAX_CHARS),
                    None => i.to_string(),
                };
                (i, text)
            })
            .collect();
        (labels, step)
    }

    /// Colour bar ticks for weights 0 to `max` on a bar `pixels` tall whose labels need `room`
    /// pixels each: 0, every 1-2-5 step, and the maximum at the top (with one more decimal when
    /// it is not a step).
    fn bar_ticks(max: f64, pixels: f64, room: f64) -> Vec<(f64, String)> {
        if max <= 0.0 || !max.is_finite() {
            return vec![(0.0, "0".into())];
        }
        let most = (pixels / room).floor().max(2.0);
        let step = nice_step(max / most.min(6.0));
        let mut ticks = Vec::new();
        let mut k = 0.0;
        while k * step <= max * (1.0 + 1e-6) && ticks.len() < 64 {
            ticks.push((k * step / max, tick_label(k * step, step)));
            k += 1.0;
        }
        // The maximum at the top, in place of any step too close to it (never of 0).
        if ticks.last().is_some_and(|t| (1.0 - t.0) * pixels < 1.0) {
            ticks.pop();
        }
        while ticks.len() > 1 && ticks.last().is_some_and(|t| (1.0 - t.0) * pixels < room) {
            ticks.pop();
        }
        let on_step = ((max / step).round() - max / step).abs() < 1e-6;
        ticks.push((1.0, tick_label(max, if on_step { step } else { step / 10.0 })));
        ticks
    }

    /// Render `weights` `[heads, queries, keys]` (one batch element's per-head weights, or
    /// `[1, L, S]` averaged weights) as PNG bytes, each weight a `cell` x `cell` square, labelled
    /// with indices: [`Heatmap`] with its defaults.
    pub fn heatmap_png(weights: ArrayView3<f32>, cell: u32) -> Result<Vec<u8>> {
        Heatmap::new(weights).cell(cell).png()
    }

    /// [`heatmap_png`] written to `path`.
    pub fn write_heatmap(
        path: impl AsRef<std::path::Path>,
        weights: ArrayView3<f32>,
        cell: u32,
    ) -> Result<()> {
        Heatmap::new(weights).cell(cell).write(path)
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use ndarray::Array3;

        /// Decoded RGB pixels and size.
        fn decode(png: &[u8]) -> (Vec<u8>, u32, u32) {
            let mut reader = png::Decoder::new(std::io::Cursor::new(png)).read_info().unwrap();
            let mut buf = vec![0; reader.output_buffer_size().unwrap()];
            let info = reader.next_frame(&mut buf).unwrap();
            assert_eq!(info.color_type, png::ColorType::Rgb);
            buf.truncate(info.buffer_size());
            (buf, info.width, info.height)
        }

        #[test]
        fn cells_sit_where_the_layout_puts_them() {
            let mut w = Array3::<f32>::zeros((3, 4, 5));
            w[[1, 2, 3]] = 1.0;
            let map = Heatmap::new(w.view()).cell(10);
            let layout = map.layout().unwrap();
            let (rgb, width, height) = decode(&map.png().unwrap());
            assert_eq!((width, height), layout.size);
            assert_eq!(layout.cols, 2);
            let at = |x: i32, y: i32| {
                let o = (y as usize * width as usize + x as usize) * 3;
                [rgb[o], rgb[o + 1], rgb[o + 2]]
            };
            // Head 1 is the second panel of the first row; its weight (2, 3) is the brightest.
            let (x0, y0) = (
                MARGIN + layout.panel.0 + GAP_X + layout.y_labels_w,
                MARGIN + layout.title_h,
            );
            for (dx, dy) in [(0, 0), (9, 9), (0, 9), (9, 0)] {
                assert_eq!(at(x0 + 3 * 10 + dx, y0 + 2 * 10 + dy), colour(1.0));
            }
            assert_eq!(at(x0 + 3 * 10 - 1, y0 + 2 * 10), colour(0.0));
            assert_eq!(at(x0 + 4 * 10, y0 + 2 * 10), colour(0.0));
            assert_eq!(at(x0 + 3 * 10, y0 + 3 * 10), colour(0.0));
            assert_eq!(at(x0 + 5, y0 + 5), colour(0.0));
            assert!(heatmap_png(Array3::<f32>::zeros((0, 1, 1)).view(), 1).is_err());
            assert!(heatmap_png(Array3::<f32>::zeros((1, 10_000, 10_000)).view(), 4).is_err());
        }

        #[test]
        fn bar_ticks_run_from_zero_to_the_maximum() {
            let t = bar_ticks(0.93, 200.0, 16.0);
            assert_eq!(t[0], (0.0, "0.0".to_string()));
            assert_eq!(t.last().unwrap(), &(1.0, "0.93".to_string()));
            assert_eq!(bar_ticks(0.0, 200.0, 16.0), vec![(0.0, "0".to_string())]);
            let t = bar_ticks(1.0, 200.0, 16.0);
            assert_eq!(t.last().unwrap(), &(1.0, "1.0".to_string()));
            assert_eq!(t[t.len() - 2].1, "0.8");
            // 0.6 is too close to the top of a 100-pixel bar for 0.62: the maximum replaces it.
            let t = bar_ticks(0.62, 100.0, 16.0);
            let labels: Vec<&str> = t.iter().map(|t| t.1.as_str()).collect();
            assert_eq!(labels, ["0.0", "0.2", "0.4", "0.62"]);
        }
    }
}
