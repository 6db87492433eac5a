//! The pictures, without a GPU: line charts (`plot`) and labelled heatmaps (`heatmap`) are PNGs
//! that decode, have the size asked for (or laid out), are not blank (several colours, text
//! where the labels go), change with their labels, and refuse bad input with an error instead of
//! a panic. With `WGPU_ATTENTION_PICTURES=DIR` the pictures are also written there, to look at.
#![cfg(all(feature = "plot", feature = "heatmap"))]

use std::collections::HashSet;

use ndarray::Array3;
use wgpu_attention::heatmap::{heatmap_png, Heatmap};
use wgpu_attention::plot::{LineChart, Series};
use wgpu_attention::Error;

/// A decoded 8-bit RGB picture.
struct Picture {
    width: u32,
    height: u32,
    rgb: Vec<u8>,
}

impl Picture {
    fn decode(png: &[u8]) -> Self {
        assert_eq!(&png[1..4], b"PNG");
        let mut reader = png::Decoder::new(std::io::Cursor::new(png))
            .read_info()
            .expect("PNG header");
        let mut rgb = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut rgb).expect("PNG data");
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        rgb.truncate(info.buffer_size());
        Picture {
            width: info.width,
            height: info.height,
            rgb,
        }
    }

    fn at(&self, x: u32, y: u32) -> [u8; 3] {
        let o = (y as usize * self.width as usize + x as usize) * 3;
        [self.rgb[o], self.rgb[o + 1], self.rgb[o + 2]]
    }

    fn colours(&self) -> HashSet<[u8; 3]> {
        self.rgb.chunks_exact(3).map(|p| [p[0], p[1], p[2]]).collect()
    }

    /// Pixels of text ink (dark and grey, unlike the heatmap's dark purple) in `xs` x `ys`.
    fn ink(&self, xs: std::ops::Range<u32>, ys: std::ops::Range<u32>) -> usize {
        let mut n = 0;
        for y in ys {
            for x in xs.clone() {
                let [r, g, b] = self.at(x, y);
                let (hi, lo) = (r.max(g).max(b), r.min(g).min(b));
                if hi < 110 && hi - lo < 20 {
                    n += 1;
                }
            }
        }
        n
    }
}

/// Saves `png` as `name` under `$WGPU_ATTENTION_PICTURES`, when set.
fn keep(name: &str, png: &[u8]) {
    if let Some(dir) = std::env::var_os("WGPU_ATTENTION_PICTURES") {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(std::path::Path::new(&dir).join(name), png).unwrap();
    }
}

fn timings() -> LineChart {
    let sizes = [128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0];
    LineChart::new(
        "attention forward, lavapipe",
        "sequence length L = S",
        "time (ms)",
    )
    .with_series("fused", sizes.map(|n: f64| (n, 2e-6 * n * n + 0.05)))
    .with_series("unfused", sizes.map(|n: f64| (n, 5e-6 * n * n + 0.08)))
    .with_series("decode", sizes.map(|n: f64| (n, 3e-4 * n + 0.02)))
}

#[test]
fn line_chart_of_three_series_on_log_axes() {
    let png = timings().png(800, 500).unwrap();
    keep("chart-log.png", &png);
    let p = Picture::decode(&png);
    assert_eq!((p.width, p.height), (800, 500));
    let colours = p.colours();
    assert!(colours.len() > 20, "{} colours", colours.len());
    // The first three series' colours are drawn (lines and markers).
    for c in [[0, 114, 178], [213, 94, 0], [0, 158, 115]] {
        assert!(colours.contains(&c), "series colour {c:?} missing");
    }
    // Text: the title at the top, the x label at the bottom, the y label on the left, the tick
    // labels and the legend on the right.
    assert!(p.ink(0..800, 0..30) > 50, "title");
    assert!(p.ink(0..800, 470..500) > 50, "x label");
    assert!(p.ink(0..30, 0..500) > 50, "y label");
    assert!(p.ink(600..800, 0..500) > 50, "legend");
}

#[test]
fn line_charts_on_linear_axes_single_points_and_equal_values_draw() {
    let chart = LineChart::new("linear", "x", "y")
        .axes(false, false)
        .with_series("a", [(0.0, -3.0), (1.0, 2.5), (2.0, 7.0)])
        .with_series("b", [(0.5, 1.0)]);
    let png = chart.png(640, 480).unwrap();
    keep("chart-linear.png", &png);
    assert_eq!(Picture::decode(&png).width, 640);
    // One point, all-equal values, log and linear.
    for (log_x, log_y) in [(true, true), (false, false), (true, false)] {
        let one = LineChart::new("", "", "")
            .axes(log_x, log_y)
            .with_series("one", [(4.0, 4.0)]);
        Picture::decode(&one.png(300, 200).unwrap());
        let flat = LineChart::new("flat", "x", "y")
            .axes(log_x, log_y)
            .with_series("flat", [(1.0, 5.0), (2.0, 5.0), (3.0, 5.0)])
            .with_series("zero", [(1.0, 0.0), (2.0, 0.0)]);
        Picture::decode(&flat.png(300, 200).unwrap());
    }
    // Points that cannot be drawn are skipped: NaN, infinities, ≤ 0 on a log axis.
    let mixed = timings().with_series(
        "gaps",
        [
            (f64::NAN, 1.0),
            (100.0, f64::INFINITY),
            (-5.0, 1.0),
            (200.0, 0.0),
            (300.0, 2.0),
        ],
    );
    keep("chart-mixed.png", &mixed.png(800, 500).unwrap());
    // Wide-ranging values: powers of ten, far-off ones written as powers.
    let wide = LineChart::new("wide", "n", "s").with_series("w", [(1e-7, 1e-9), (1e9, 1e12)]);
    keep("chart-wide.png", &wide.png(800, 500).unwrap());
}

#[test]
fn line_charts_without_drawable_points_are_errors() {
    let picture_err = |r: Result<Vec<u8>, Error>| matches!(r, Err(Error::Picture(_)));
    assert!(picture_err(LineChart::new("t", "x", "y").png(800, 500)));
    let empty = LineChart::new("t", "x", "y").with_series("none", []);
    assert!(picture_err(empty.png(800, 500)));
    let bad = LineChart::new("t", "x", "y").with_series("bad", [(0.0, 1.0), (-1.0, 2.0), (f64::NAN, 1.0)]);
    let Err(Error::Picture(why)) = bad.png(800, 500) else {
        panic!("expected a picture error")
    };
    assert!(why.contains("> 0"), "{why}");
    assert!(bad.clone().axes(false, true).png(800, 500).is_ok());
    assert!(picture_err(timings().png(100, 50)));
    assert!(picture_err(timings().png(100_000, 500)));
    let huge = LineChart::new("t", "x", "y")
        .axes(false, false)
        .with_series("s", [(-1e308, 0.0), (1e308, 1.0)]);
    assert!(picture_err(huge.png(800, 500)));
    let s = Series::new("x", [(1.0, 1.0)]);
    assert_eq!(s.points.len(), 1);
}

/// Causal-looking weights `[heads, n, n]`: row i spread over keys 0..=i.
fn causal(heads: usize, n: usize) -> Array3<f32> {
    Array3::from_shape_fn((heads, n, n), |(h, i, j)| {
        if j <= i {
            (1.0 + ((h + i * 3 + j * 7) % 5) as f32) / (i as f32 + 1.0) / 3.0
        } else {
            0.0
        }
    })
}

#[test]
fn heatmaps_with_tokens_are_labelled_pictures() {
    let w = causal(4, 6);
    let words = ["the", "cat", "sat", "on", "the", "mat"];
    let plain = Heatmap::new(w.view()).cell(24);
    let labelled = plain.clone().tokens(&words);
    let (a, b) = (plain.png().unwrap(), labelled.png().unwrap());
    keep("heatmap-indices.png", &a);
    keep("heatmap-tokens.png", &b);
    assert_ne!(a, b, "tokens change the picture");
    let (pa, pb) = (Picture::decode(&a), Picture::decode(&b));
    assert_eq!((pa.width, pa.height), plain.size().unwrap());
    assert_eq!((pb.width, pb.height), labelled.size().unwrap());
    // 2 x 2 panels of 6 x 6 cells of 24 pixels, with labels, titles and the colour bar.
    assert!(pb.width > 2 * 6 * 24 + 40 && pb.height > 2 * 6 * 24 + 40);
    assert!(pb.width > pa.width, "words are wider than indices");
    let colours = pb.colours();
    assert!(colours.len() > 30, "{} colours", colours.len());
    assert!(colours.contains(&wgpu_attention::heatmap::colour(0.0)));
    // Row labels left of the first panel, titles above, the colour bar's numbers on the right.
    assert!(pb.ink(0..40, 30..pb.height) > 50, "row labels");
    assert!(pb.ink(0..pb.width / 2, 0..20) > 20, "titles");
    assert!(
        pb.ink(pb.width - 30..pb.width, 0..pb.height) > 20,
        "colour bar ticks"
    );

    // The old functions still draw (indices), and cross-attention labels its own keys.
    Picture::decode(&heatmap_png(w.view(), 8).unwrap());
    let cross = Array3::from_shape_fn((3, 7, 11), |(h, i, j)| ((h + i + j) % 4) as f32 / 10.0);
    let keys: Vec<String> = (0..11).map(|j| format!("key{j}")).collect();
    let map = Heatmap::new(cross.view())
        .cell(20)
        .queries(&["a", "b", "c", "d", "e", "f", "g"])
        .keys(&keys)
        .titles(&["first", "second", "third"]);
    keep("heatmap-cross.png", &map.png().unwrap());
    // One panel of averaged weights, many positions, a cell of one pixel.
    let big = causal(1, 300);
    keep("heatmap-big.png", &heatmap_png(big.view(), 1).unwrap());
    keep(
        "heatmap-zeros.png",
        &heatmap_png(Array3::<f32>::zeros((1, 3, 3)).view(), 8).unwrap(),
    );
}

#[test]
fn heatmaps_with_mismatched_labels_are_errors() {
    let w = causal(2, 5);
    let picture_err = |map: Heatmap<'_>| {
        let r = map.png();
        assert!(matches!(r, Err(Error::Picture(_))), "{r:?}");
        r.unwrap_err().to_string()
    };
    let why = picture_err(Heatmap::new(w.view()).tokens(&["a", "b", "c"]));
    assert!(why.contains("3 query labels for 5 queries"), "{why}");
    picture_err(Heatmap::new(w.view()).keys(&["a"; 6]));
    picture_err(Heatmap::new(w.view()).titles(&["only one"]));
    assert!(Heatmap::new(w.view()).cell(0).png().is_err());
    assert!(Heatmap::new(Array3::<f32>::zeros((1, 0, 4)).view())
        .png()
        .is_err());
    assert!(Heatmap::new(causal(1, 2100).view()).cell(8).png().is_err());
    // NaN and infinite weights draw (as 0 and as the maximum's colour).
    let mut odd = causal(1, 4);
    odd[[0, 1, 1]] = f32::NAN;
    odd[[0, 2, 2]] = f32::INFINITY;
    Picture::decode(&Heatmap::new(odd.view()).png().unwrap());
}
