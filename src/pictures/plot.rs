//! Line charts as PNG pictures (feature `plot`, part of `cli` and `shapes`; not on wasm32).
//!
//! A [`LineChart`] draws one line with markers per [`Series`], each in its own colour and marker
//! shape, with a legend on the right. Each axis is linear or logarithmic: a logarithmic axis
//! spans whole powers and is ticked at powers of 2 (data within 12 octaves, from 0.125 up) or of
//! 10, labelled `0.25`, `1024`, `0.001`, or as powers (`2¹⁸`, `10⁻⁶`) on an axis that reaches
//! far from 1. The axis labels are the
//! caller's, unit included (`"time (ms)"`). Points that cannot be drawn (a non-finite
//! coordinate, or one ≤ 0 on a logarithmic axis) are skipped; a chart with nothing left to draw
//! is an error, never a panic. The text is drawn with the bundled DejaVu Sans, so no system font
//! is needed.
//!
//! ```no_run
//! use wgpu_attention::plot::LineChart;
//! let chart = LineChart::new("attention forward", "sequence length", "time (ms)")
//!     .with_series("fused", [(512.0, 0.8), (1024.0, 2.9), (2048.0, 11.0)])
//!     .with_series("unfused", [(512.0, 1.4), (1024.0, 5.6), (2048.0, 23.0)]);
//! chart.write("bench.png", 800, 500)?;
//! # Ok::<(), wgpu_attention::Error>(())
//! ```

use std::path::Path;

use plotters::prelude::*;

use crate::error::{Error, Result};
use crate::pictures::picture::{self, draw_err, nice_step, shorten, tick_label, Align, Area, Text};

/// One line of a [`LineChart`]: its legend name and its `(x, y)` points (drawn in x order).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    /// The name in the legend.
    pub name: String,
    /// The points; those that cannot be drawn on the chart's axes are skipped.
    pub points: Vec<(f64, f64)>,
}

impl Series {
    /// A series named `name` with `points`.
    pub fn new(name: impl Into<String>, points: impl IntoIterator<Item = (f64, f64)>) -> Self {
        Series {
            name: name.into(),
            points: points.into_iter().collect(),
        }
    }
}

/// A line chart with markers, a legend and linear or logarithmic axes (see the
/// [module docs](self)).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LineChart {
    /// The title above the chart (none when empty).
    pub title: String,
    /// The x axis label, unit included (`"sequence length"`, `"size (MiB)"`).
    pub x_label: String,
    /// The y axis label, unit included (`"time (ms)"`).
    pub y_label: String,
    /// Logarithmic x axis.
    pub log_x: bool,
    /// Logarithmic y axis.
    pub log_y: bool,
    /// The lines, in legend order.
    pub series: Vec<Series>,
}

/// Colours of the series in turn (Okabe and Ito's palette, told apart with colour-blindness,
/// less its yellow; then darker tones).
const COLOURS: [RGBColor; 10] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(0, 0, 0),
    RGBColor(120, 60, 20),
    RGBColor(90, 90, 160),
    RGBColor(110, 140, 40),
];

/// Marker shapes of the series in turn (cycled independently of the colours, so that no two of
/// the first 40 series look alike).
#[derive(Clone, Copy, Debug)]
enum Marker {
    Circle,
    Square,
    Triangle,
    Diamond,
    Cross,
    Plus,
    RingCircle,
    RingSquare,
}

const MARKERS: [Marker; 8] = [
    Marker::Circle,
    Marker::Square,
    Marker::Triangle,
    Marker::Diamond,
    Marker::Cross,
    Marker::Plus,
    Marker::RingCircle,
    Marker::RingSquare,
];

impl LineChart {
    /// An empty log-log chart (set [`log_x`](Self::log_x) / [`log_y`](Self::log_y) for linear
    /// axes).
    pub fn new(title: impl Into<String>, x_label: impl Into<String>, y_label: impl Into<String>) -> Self {
        LineChart {
            title: title.into(),
            x_label: x_label.into(),
            y_label: y_label.into(),
            log_x: true,
            log_y: true,
            series: Vec::new(),
        }
    }

    /// The chart with logarithmic (`true`) or linear axes.
    pub fn axes(mut self, log_x: bool, log_y: bool) -> Self {
        self.log_x = log_x;
        self.log_y = log_y;
        self
    }

    /// The chart with one more series.
    pub fn with_series(
        mut self,
        name: impl Into<String>,
        points: impl IntoIterator<Item = (f64, f64)>,
    ) -> Self {
        self.series.push(Series::new(name, points));
        self
    }

    /// The chart as a `width` x `height` PNG (8-bit RGB). Errors: no series, no point that
    /// the axes can show, values whose range overflows, or a size under 160 x 120 or over
    /// 16384 pixels a side.
    pub fn png(&self, width: u32, height: u32) -> Result<Vec<u8>> {
        if width < 160 || height < 120 {
            return Err(Error::Picture(format!(
                "line chart of {width} x {height} pixels: at least 160 x 120 are needed"
            )));
        }
        if self.series.is_empty() {
            return Err(Error::Picture(format!(
                "line chart {:?} has no series",
                self.title
            )));
        }
        let drawable = |&(x, y): &(f64, f64)| {
            x.is_finite() && y.is_finite() && (!self.log_x || x > 0.0) && (!self.log_y || y > 0.0)
        };
        let lines: Vec<Vec<(f64, f64)>> = self
            .series
            .iter()
            .map(|s| {
                let mut p: Vec<(f64, f64)> = s.points.iter().copied().filter(drawable).collect();
                p.sort_by(|a, b| a.0.total_cmp(&b.0));
                p
            })
            .collect();
        if lines.iter().all(|l| l.is_empty()) {
            return Err(Error::Picture(format!(
                "line chart {:?}: no point can be drawn (coordinates must be finite{})",
                self.title,
                match (self.log_x, self.log_y) {
                    (true, true) => ", and > 0 on the logarithmic axes",
                    (true, false) => ", and x > 0 on the logarithmic x axis",
                    (false, true) => ", and y > 0 on the logarithmic y axis",
                    (false, false) => "",
                }
            )));
        }
        let xs = Scale::new(lines.iter().flatten().map(|p| p.0), self.log_x)?;
        let ys = Scale::new(lines.iter().flatten().map(|p| p.1), self.log_y)?;
        picture::png(width, height, |root| {
            self.draw(root, width, height, &lines, xs, ys)
        })
    }

    /// [`png`](Self::png) written to `path`.
    pub fn write(&self, path: impl AsRef<Path>, width: u32, height: u32) -> Result<()> {
        picture::write(path.as_ref(), &self.png(width, height)?)
    }

    fn draw(
        &self,
        root: &Area<'_>,
        width: u32,
        height: u32,
        lines: &[Vec<(f64, f64)>],
        xs: Scale,
        ys: Scale,
    ) -> Result<()> {
        let st = Style::new(width, height);
        let (names, legend_w) = self.legend_names(&st, width as i32)?;
        let (frame, x_ticks, y_ticks) = self.layout(&st, [width, height], legend_w, [&xs, &ys])?;
        // The plot: grid, frame, lines, markers.
        let area = root.clone().shrink(
            (frame.left, frame.top),
            (
                (frame.right - frame.left) as u32,
                (frame.bottom - frame.top) as u32,
            ),
        );
        let chart = ChartBuilder::on(&area)
            .build_cartesian_2d(xs.lo..xs.hi, ys.lo..ys.hi)
            .map_err(draw_err)?;
        let to_px = |u: f64, v: f64| chart.backend_coord(&(u, v));
        let x_at: Vec<i32> = x_ticks.iter().map(|t| to_px(t.at, ys.lo).0).collect();
        let y_at: Vec<i32> = y_ticks.iter().map(|t| to_px(xs.lo, t.at).1).collect();
        draw_grid(root, &frame, (&x_ticks, &x_at), (&y_ticks, &y_at))?;
        for (i, line) in lines.iter().enumerate() {
            let colour = COLOURS[i % COLOURS.len()];
            let points: Vec<(i32, i32)> = line.iter().map(|&(x, y)| to_px(xs.to(x), ys.to(y))).collect();
            root.draw(&PathElement::new(points, colour.stroke_width(st.stroke)))
                .map_err(draw_err)?;
        }
        for (i, line) in lines.iter().enumerate() {
            for &(x, y) in line {
                let p = to_px(xs.to(x), ys.to(y));
                marker(
                    root,
                    MARKERS[i % MARKERS.len()],
                    p,
                    st.px(4.5),
                    COLOURS[i % COLOURS.len()],
                )?;
            }
        }
        draw_ticks(root, &st, &frame, (&x_ticks, &x_at), (&y_ticks, &y_at))?;
        self.draw_labels(root, &st, &frame, height as i32)?;
        let legend_x = width as i32 - st.margin - legend_w;
        draw_legend(root, &st, &names, (legend_x, frame.top), width as i32 - st.margin)
    }

    /// The legend's names (shortened until the legend takes at most 2/5 of the width) and
    /// its width.
    fn legend_names(&self, st: &Style, w: i32) -> Result<(Vec<String>, i32)> {
        let sample = st.px(30.0);
        let mut names: Vec<String> = self.series.iter().map(|s| shorten(&s.name, 40)).collect();
        let max_legend = w * 2 / 5;
        let mut name_w = 0;
        for limit in (4..=40).rev().step_by(4) {
            name_w = 0;
            for n in &names {
                name_w = name_w.max(st.legend.width(n)?);
            }
            if sample + st.px(24.0) + name_w <= max_legend {
                break;
            }
            names = self.series.iter().map(|s| shorten(&s.name, limit)).collect();
        }
        Ok((names, (sample + st.px(24.0) + name_w).min(max_legend)))
    }

    /// The plot's frame and the axes' ticks: vertically the title, the plot, the x ticks and
    /// the x label; horizontally the y label, the y ticks, the plot and the legend.
    fn layout(
        &self,
        st: &Style,
        [width, height]: [u32; 2],
        legend_w: i32,
        [xs, ys]: [&Scale; 2],
    ) -> Result<(Frame, Vec<Tick>, Vec<Tick>)> {
        let (w, h) = (width as i32, height as i32);
        let text_h = |text: &str, t: &Text, lines: f64| {
            if text.is_empty() {
                0
            } else {
                (t.size * lines).round() as i32
            }
        };
        let (title_h, x_label_h) = (
            text_h(&self.title, &st.title, 1.6),
            text_h(&self.x_label, &st.label, 1.5),
        );
        let x_ticks_h = st.tick_len + (st.tick.size * 1.3).round() as i32;
        let top = st.margin + title_h + st.px(6.0);
        let bottom = h - st.margin - x_label_h - x_ticks_h;
        let too_small = |what: &str| {
            Error::Picture(format!(
                "line chart of {width} x {height} pixels: too {what} to draw"
            ))
        };
        if bottom - top < 40 {
            return Err(too_small("short"));
        }
        let y_ticks = ys.ticks((bottom - top) as f64, |_| Ok(st.tick.size * 1.6))?;
        let mut y_ticks_w = 0;
        for t in y_ticks.iter().filter(|t| !t.label.is_empty()) {
            y_ticks_w = y_ticks_w.max(st.tick.width(&t.label)?);
        }
        let y_label_w = text_h(&self.y_label, &st.label, 1.5);
        let left = st.margin + y_label_w + y_ticks_w + st.px(4.0) + st.tick_len;
        let right = w - st.margin - legend_w - st.px(12.0);
        if right - left < 40 {
            return Err(too_small("narrow"));
        }
        let x_ticks = xs.ticks((right - left) as f64, |label| {
            Ok(f64::from(st.tick.width(label)?) + 14.0 * st.k)
        })?;
        let frame = Frame {
            left,
            right,
            top,
            bottom,
        };
        Ok((frame, x_ticks, y_ticks))
    }

    /// The title and the axis labels.
    fn draw_labels(&self, root: &Area<'_>, st: &Style, f: &Frame, h: i32) -> Result<()> {
        let mid_x = (f.left + f.right) / 2;
        st.title
            .draw(root, &self.title, (mid_x, st.margin), Align::Centre, Align::Start)?;
        st.label.draw(
            root,
            &self.x_label,
            (mid_x, h - st.margin),
            Align::Centre,
            Align::End,
        )?;
        st.label.upward().draw(
            root,
            &self.y_label,
            (st.margin + st.label.cap_height(), (f.top + f.bottom) / 2),
            Align::Centre,
            Align::End,
        )
    }
}

/// A chart's text and strokes, scaled to its pixels.
struct Style {
    /// Pixels per point of a 640-pixel chart.
    k: f64,
    title: Text,
    label: Text,
    tick: Text,
    legend: Text,
    margin: i32,
    tick_len: i32,
    stroke: u32,
}

impl Style {
    fn new(width: u32, height: u32) -> Style {
        let k = (f64::from(width.min(height * 4 / 3)) / 640.0).clamp(0.75, 2.5);
        let px = |v: f64| (v * k).round() as i32;
        let [title, label, tick, legend] = [18.0, 15.0, 13.0, 13.0].map(|pt| Text::new(pt * k));
        Style {
            k,
            title,
            label,
            tick,
            legend,
            margin: px(10.0),
            tick_len: px(5.0),
            stroke: px(2.0).max(1) as u32,
        }
    }

    /// `v` points in pixels.
    fn px(&self, v: f64) -> i32 {
        (v * self.k).round() as i32
    }
}

/// The plot area's edges, in pixels.
struct Frame {
    left: i32,
    right: i32,
    top: i32,
    bottom: i32,
}

/// Ticks with their pixel positions along their axis.
type Placed<'t> = (&'t [Tick], &'t [i32]);

/// The grid lines at the ticks (lighter at unlabelled ones) and the frame.
fn draw_grid(root: &Area<'_>, f: &Frame, (xt, xp): Placed<'_>, (yt, yp): Placed<'_>) -> Result<()> {
    let grid = |t: &Tick| {
        if t.label.is_empty() {
            RGBColor(238, 238, 238)
        } else {
            RGBColor(215, 215, 215)
        }
    };
    for (t, &x) in xt.iter().zip(xp) {
        root.draw(&PathElement::new(vec![(x, f.top), (x, f.bottom)], grid(t)))
            .map_err(draw_err)?;
    }
    for (t, &y) in yt.iter().zip(yp) {
        root.draw(&PathElement::new(vec![(f.left, y), (f.right, y)], grid(t)))
            .map_err(draw_err)?;
    }
    root.draw(&Rectangle::new([(f.left, f.top), (f.right, f.bottom)], FRAME))
        .map_err(draw_err)?;
    Ok(())
}

/// The frame's colour.
const FRAME: RGBColor = RGBColor(110, 110, 110);

/// The ticks (half length where unlabelled) and their labels.
fn draw_ticks(
    root: &Area<'_>,
    st: &Style,
    f: &Frame,
    (xt, xp): Placed<'_>,
    (yt, yp): Placed<'_>,
) -> Result<()> {
    let len = |t: &Tick| {
        if t.label.is_empty() {
            st.tick_len / 2
        } else {
            st.tick_len
        }
    };
    for (t, &x) in xt.iter().zip(xp) {
        root.draw(&PathElement::new(
            vec![(x, f.bottom), (x, f.bottom + len(t))],
            FRAME,
        ))
        .map_err(draw_err)?;
        let at = (x, f.bottom + st.tick_len + st.px(3.0));
        st.tick.draw(root, &t.label, at, Align::Centre, Align::Start)?;
    }
    for (t, &y) in yt.iter().zip(yp) {
        root.draw(&PathElement::new(vec![(f.left - len(t), y), (f.left, y)], FRAME))
            .map_err(draw_err)?;
        let at = (f.left - st.tick_len - st.px(4.0), y);
        st.tick.draw(root, &t.label, at, Align::End, Align::Centre)?;
    }
    Ok(())
}

/// The legend from `(x, top)` to the right edge `x_end`: a sample of each line with its
/// marker, and the name.
fn draw_legend(
    root: &Area<'_>,
    st: &Style,
    names: &[String],
    (lx, top): (i32, i32),
    x_end: i32,
) -> Result<()> {
    let row = (st.legend.size * 1.5).round() as i32;
    let sample = st.px(30.0);
    let legend_h = row * names.len() as i32 + st.px(10.0);
    root.draw(&Rectangle::new(
        [(lx, top), (x_end, top + legend_h)],
        RGBColor(200, 200, 200),
    ))
    .map_err(draw_err)?;
    for (i, name) in names.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let y = top + st.px(5.0) + row * i as i32 + row / 2;
        let (x0, x1) = (lx + st.px(8.0), lx + st.px(8.0) + sample);
        root.draw(&PathElement::new(
            vec![(x0, y), (x1, y)],
            colour.stroke_width(st.stroke),
        ))
        .map_err(draw_err)?;
        marker(
            root,
            MARKERS[i % MARKERS.len()],
            ((x0 + x1) / 2, y),
            st.px(4.5),
            colour,
        )?;
        st.legend
            .draw(root, name, (x1 + st.px(8.0), y), Align::Start, Align::Centre)?;
    }
    Ok(())
}

/// A marker of `shape` and half-size `r` centred on the pixel `p`.
fn marker(root: &Area<'_>, shape: Marker, (x, y): (i32, i32), r: i32, colour: RGBColor) -> Result<()> {
    let fill = colour.filled();
    let line = colour.stroke_width(2);
    let r = r.max(2);
    let s = r * 9 / 10;
    match shape {
        Marker::Circle => root.draw(&Circle::new((x, y), r, fill)),
        Marker::Square => root.draw(&Rectangle::new([(x - s, y - s), (x + s, y + s)], fill)),
        Marker::Triangle => {
            let t = r * 6 / 5;
            root.draw(&Polygon::new(
                vec![(x, y - t), (x + t, y + t * 3 / 4), (x - t, y + t * 3 / 4)],
                fill,
            ))
        }
        Marker::Diamond => {
            let t = r * 6 / 5;
            root.draw(&Polygon::new(
                vec![(x, y - t), (x + t, y), (x, y + t), (x - t, y)],
                fill,
            ))
        }
        Marker::Cross => root
            .draw(&PathElement::new(vec![(x - s, y - s), (x + s, y + s)], line))
            .and_then(|_| root.draw(&PathElement::new(vec![(x - s, y + s), (x + s, y - s)], line))),
        Marker::Plus => root
            .draw(&PathElement::new(vec![(x - r, y), (x + r, y)], line))
            .and_then(|_| root.draw(&PathElement::new(vec![(x, y - r), (x, y + r)], line))),
        Marker::RingCircle => root
            .draw(&Circle::new((x, y), r, WHITE.filled()))
            .and_then(|_| root.draw(&Circle::new((x, y), r, line))),
        Marker::RingSquare => root
            .draw(&Rectangle::new([(x - s, y - s), (x + s, y + s)], WHITE.filled()))
            .and_then(|_| root.draw(&Rectangle::new([(x - s, y - s), (x + s, y + s)], line))),
    }
    .map_err(draw_err)
}

/// How an axis maps values to its drawing coordinate `u` (the value, or its logarithm), and the
/// range of `u` it shows.
#[derive(Clone, Copy, Debug)]
struct Scale {
    /// `None`: linear; else the logarithm's base (2 or 10).
    base: Option<u32>,
    /// Shown range of `u`, a little wider than the ticked one so that end markers show whole.
    lo: f64,
    hi: f64,
    /// The ticked range of `u`: whole powers (logarithmic) or multiples of `step` (linear).
    first: f64,
    last: f64,
}

/// A tick at axis coordinate `at`: labelled, or (empty label) a minor grid line.
struct Tick {
    at: f64,
    label: String,
}

/// Most ticks an axis may have (bounds the work on absurd ranges).
const MAX_TICKS: f64 = 2000.0;

impl Scale {
    /// The scale of a non-empty set of drawable `values`.
    fn new(values: impl Iterator<Item = f64>, log: bool) -> Result<Self> {
        let (min, max) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
        let (base, first, last) = if log {
            let (a2, b2) = (min.log2().floor(), max.log2().ceil());
            if b2 - a2 <= 12.0 && a2 >= -3.0 {
                (Some(2), a2, b2)
            } else {
                (Some(10), min.log10().floor(), max.log10().ceil())
            }
        } else {
            (None, min, max)
        };
        let (first, last) = if last > first {
            (first, last)
        } else if log {
            (first - 1.0, last + 1.0)
        } else if first == 0.0 {
            (-1.0, 1.0)
        } else {
            (first - first.abs() * 0.5, last + last.abs() * 0.5)
        };
        let span = last - first;
        if !span.is_finite() || span <= 0.0 || (log && span > MAX_TICKS) {
            return Err(Error::Picture(format!(
                "values from {min:e} to {max:e} cannot be drawn on a {} axis",
                if log { "logarithmic" } else { "linear" }
            )));
        }
        Ok(Scale {
            base,
            lo: first - 0.03 * span,
            hi: last + 0.03 * span,
            first,
            last,
        })
    }

    /// A value's axis coordinate.
    fn to(&self, v: f64) -> f64 {
        match self.base {
            None => v,
            Some(2) => v.log2(),
            Some(_) => v.log10(),
        }
    }

    /// Ticks for an axis `pixels` long whose labels each need `room(label)` pixels.
    fn ticks(&self, pixels: f64, room: impl Fn(&str) -> Result<f64>) -> Result<Vec<Tick>> {
        let per_u = pixels / (self.hi - self.lo);
        let Some(base) = self.base else {
            // Linear: the densest 1-2-5 step whose labels fit.
            let mut step = nice_step((self.last - self.first) / 10.0);
            for _ in 0..40 {
                let start = (self.lo / step).ceil();
                let n = ((self.hi / step).floor() - start + 1.0).max(0.0);
                if n <= MAX_TICKS {
                    let at: Vec<f64> = (0..n as i64).map(|i| (start + i as f64) * step).collect();
                    let mut need: f64 = 0.0;
                    for &v in &at {
                        need = need.max(room(&tick_label(v, step))?);
                    }
                    if need <= step * per_u || n <= 2.0 {
                        return Ok(at
                            .into_iter()
                            .map(|v| Tick {
                                at: v,
                                label: tick_label(v, step),
                            })
                            .collect());
                    }
                }
                step = nice_step(step * 1.5);
            }
            return Ok(Vec::new());
        };
        // Logarithmic: every whole power, labelled every `every`-th power, the rest light lines;
        // on base 10 with room, light lines at 2..9 times each power.
        let powers: Vec<i32> = (self.first as i32..=self.last as i32).collect();
        // One style per axis: all decimal, or (when any power is far from 1) all powers.
        let as_power = powers.iter().any(|&e| !decimal(base, e));
        let label = |e: i32| power_label(base, e, as_power);
        let mut need: f64 = 0.0;
        for &e in &powers {
            need = need.max(room(&label(e))?);
        }
        let every = [1, 2, 3, 4, 5, 10, 20, 50, 100, 200, 500, 1000]
            .into_iter()
            .find(|&k| k as f64 * per_u >= need)
            .unwrap_or(2000);
        let mut ticks = Vec::new();
        for &e in &powers {
            let labelled = e.rem_euclid(every) == 0;
            if labelled || per_u >= 6.0 {
                ticks.push(Tick {
                    at: e as f64,
                    label: if labelled { label(e) } else { String::new() },
                });
            }
            if base == 10 && per_u >= 60.0 && e < self.last as i32 {
                for m in 2..10 {
                    ticks.push(Tick {
                        at: e as f64 + (m as f64).log10(),
                        label: String::new(),
                    });
                }
            }
        }
        Ok(ticks)
    }
}

/// Whether `base^e` reads well as a decimal (`0.125`, `65536`, `0.0001`, `100000`).
fn decimal(base: u32, e: i32) -> bool {
    match base {
        2 => (-3..=16).contains(&e),
        _ => (-4..=5).contains(&e),
    }
}

/// `base^e` as a tick label: a decimal (`0.125`, `1024`, `0.001`), or with `as_power` a power
/// (`2¹⁸`, `10⁻⁶`).
fn power_label(base: u32, e: i32, as_power: bool) -> String {
    if !as_power {
        let v = f64::from(base).powi(e);
        let s = format!("{v:.4}");
        let s = s.trim_end_matches('0').trim_end_matches('.');
        return s.to_string();
    }
    const SUP: [char; 10] = ['⁰', '¹', '²', '³', '⁴', '⁵', '⁶', '⁷', '⁸', '⁹'];
    let mut s = base.to_string();
    if e < 0 {
        s.push('⁻');
    }
    for d in e.unsigned_abs().to_string().bytes() {
        s.push(SUP[(d - b'0') as usize]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power_labels_read_as_numbers() {
        assert_eq!(power_label(2, 0, false), "1");
        assert_eq!(power_label(2, 10, false), "1024");
        assert_eq!(power_label(2, -3, false), "0.125");
        assert_eq!(power_label(2, 18, true), "2¹⁸");
        assert_eq!(power_label(10, -3, false), "0.001");
        assert_eq!(power_label(10, 5, false), "100000");
        assert_eq!(power_label(10, -6, true), "10⁻⁶");
        assert_eq!(power_label(10, 0, true), "10⁰");
        assert!(decimal(10, 5) && !decimal(10, 6) && decimal(2, 16) && !decimal(2, -4));
    }

    #[test]
    fn scales_choose_their_base_and_span_whole_powers() {
        let s = Scale::new([128.0, 16384.0].into_iter(), true).unwrap();
        assert_eq!((s.base, s.first, s.last), (Some(2), 7.0, 14.0));
        let s = Scale::new([0.01, 300.0].into_iter(), true).unwrap();
        assert_eq!((s.base, s.first, s.last), (Some(10), -2.0, 3.0));
        let s = Scale::new([5.0, 5.0].into_iter(), false).unwrap();
        assert!(s.first < 5.0 && s.last > 5.0);
        let s = Scale::new([4.0].into_iter(), true).unwrap();
        assert_eq!((s.first, s.last), (1.0, 3.0));
        assert!(Scale::new([-1e308, 1e308].into_iter(), false).is_err());
        assert!(Scale::new([1e-300, 1e300].into_iter(), true).is_ok());
    }
}
