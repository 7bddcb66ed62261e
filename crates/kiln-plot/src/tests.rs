//! Whole-chart tests: layout invariants, SVG well-formedness and content, PNG round trips.

use std::io::Cursor;

use crate::color::{self, PALETTE, Rgb};
use crate::scene::{self, Prim, Scene};
use crate::{Chart, Series, Style};

fn sample() -> Chart {
    Chart::new("Latency <p99> & \"TTFT\"", "load (req/s)", "TTFT 'ms'")
        .with_series(Series::new(
            "kiln",
            vec![(0.0, 10.0), (25.0, 12.0), (50.0, 20.0), (97.0, 55.0)],
            Style::LineAndMarkers,
        ))
        .with_series(Series::new(
            "vLLM's",
            vec![(5.0, 11.0), (40.0, 18.0), (90.0, 70.0)],
            Style::Markers,
        ))
}

/// Decodes PNG bytes into (width, height, RGB8 pixels), asserting the colour type.
fn decode(bytes: &[u8]) -> (u32, u32, Vec<u8>) {
    let mut reader = png::Decoder::new(Cursor::new(bytes)).read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb);
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

/// Counts pixels of colour `c` inside the scene's plot rectangle.
fn count_in_plot(scene: &Scene, pixels: &[u8], c: Rgb) -> usize {
    let p = scene.plot;
    let w = scene.width as usize;
    let (x0, x1) = (p.x.ceil() as usize, p.right().floor() as usize);
    let (y0, y1) = (p.y.ceil() as usize, p.bottom().floor() as usize);
    (y0..y1)
        .flat_map(|y| (x0..x1).map(move |x| (y * w + x) * 3))
        .filter(|&i| pixels[i..i + 3] == [c.0, c.1, c.2])
        .count()
}

/// A minimal XML well-formedness check: balanced tags, quoted attributes, only known entities.
fn assert_well_formed(xml: &str) {
    let mut stack: Vec<String> = Vec::new();
    let mut rest = xml;
    while let Some(start) = rest.find('<') {
        check_text(&rest[..start]);
        let end = rest[start..].find('>').expect("unterminated tag") + start;
        let tag = &rest[start + 1..end];
        assert!(!tag.contains('<'), "'<' inside tag: {tag}");
        assert_eq!(tag.matches('"').count() % 2, 0, "unbalanced quotes: {tag}");
        if let Some(name) = tag.strip_prefix('/') {
            assert_eq!(stack.pop().as_deref(), Some(name), "mismatched </{name}>");
        } else if !tag.ends_with('/') {
            let name = tag.split_whitespace().next().unwrap_or_default();
            stack.push(name.to_string());
        }
        rest = &rest[end + 1..];
    }
    check_text(rest);
    assert!(stack.is_empty(), "unclosed tags: {stack:?}");
}

fn check_text(text: &str) {
    assert!(!text.contains('>'), "raw '>' in text: {text}");
    for (i, _) in text.match_indices('&') {
        let entity = &text[i..];
        assert!(
            ["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"].iter().any(|e| entity.starts_with(e)),
            "bad entity at {entity}"
        );
    }
}

fn awkward_charts() -> Vec<Chart> {
    let nan = f64::NAN;
    let inf = f64::INFINITY;
    let mut charts = vec![
        Chart::default(),
        Chart::new("only empty", "x", "y").with_series(Series::new("none", vec![], Style::Line)),
        Chart::new("one", "x", "y").with_series(Series::new("p", vec![(3.0, 4.0)], Style::Line)),
        Chart::new("flat", "x", "y").with_series(Series::new(
            "f",
            vec![(2.0, 5.0); 4],
            Style::LineAndMarkers,
        )),
        Chart::new("bad", "x", "y").with_series(Series::new(
            "nan",
            vec![(nan, 1.0), (1.0, inf), (-inf, nan), (2.0, 3.0), (nan, nan), (4.0, 1.0)],
            Style::LineAndMarkers,
        )),
        Chart::new("all bad", "", "").with_series(Series::new(
            "x",
            vec![(nan, nan), (inf, -inf)],
            Style::Markers,
        )),
        Chart::new("extremes", "x", "y").with_series(Series::new(
            "big",
            vec![(f64::MAX, f64::MIN), (f64::MIN, f64::MAX), (0.0, f64::MIN_POSITIVE)],
            Style::LineAndMarkers,
        )),
        Chart::new("\n\t\u{0}ctl", "\u{7f}", "\u{1b}[31m").with_series(Series::new(
            "\u{0}",
            vec![(1.0, 1.0), (2.0, 2.0)],
            Style::Line,
        )),
    ];
    let mut log = Chart::new("log", "x", "y").with_series(Series::new(
        "neg",
        vec![(-1.0, 1.0), (0.0, 2.0)],
        Style::Line,
    ));
    log.x_log = true;
    charts.push(log);
    charts
}

/// Checks the documented scene invariants.
fn assert_scene_invariants(scene: &Scene) {
    let p = scene.plot;
    assert!(p.w >= 1.0 && p.h >= 1.0, "{p:?}");
    assert!(p.x >= 0.0 && p.y >= 0.0, "{p:?}");
    assert!(p.right() <= f64::from(scene.width) && p.bottom() <= f64::from(scene.height));
    let inside = |x: f64, y: f64| {
        x >= p.x - 0.5 && x <= p.right() + 0.5 && y >= p.y - 0.5 && y <= p.bottom() + 0.5
    };
    let legend_x = p.right();
    for prim in &scene.prims {
        match prim {
            Prim::Polyline { points, .. } => {
                assert!(points.len() >= 2);
                for &(x, y) in points {
                    assert!(x.is_finite() && y.is_finite());
                    assert!(inside(x, y) || x > legend_x, "({x}, {y}) outside {p:?}");
                }
            }
            Prim::Marker { x, y, .. } => {
                assert!(inside(*x, *y) || *x > legend_x, "({x}, {y}) outside {p:?}");
            }
            Prim::Text { x, y, text, .. } => {
                assert!(x.is_finite() && y.is_finite());
                assert!(!text.chars().any(char::is_control), "{text:?}");
            }
            Prim::Hairline { x1, y1, x2, y2, .. } => {
                assert!([x1, y1, x2, y2].iter().all(|v| v.is_finite()));
            }
            Prim::Rect { rect, .. } => assert!(rect.x.is_finite() && rect.h.is_finite()),
        }
    }
}

#[test]
fn svg_contains_title_series_names_and_escaped_text() {
    let svg = sample().to_svg(800, 500);
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<svg").count(), 1);
    assert_eq!(svg.matches("</svg>").count(), 1);
    assert!(svg.contains("Latency &lt;p99&gt; &amp; &quot;TTFT&quot;"));
    assert!(svg.contains("<title>Latency &lt;p99&gt; &amp; &quot;TTFT&quot;</title>"));
    assert!(!svg.contains("<p99>"));
    assert!(svg.contains(">kiln</text>"));
    assert!(svg.contains(">vLLM&apos;s</text>"));
    assert!(svg.contains("TTFT &apos;ms&apos;"));
    assert!(svg.contains("load (req/s)"));
    assert!(svg.contains(&PALETTE[0].hex()) && svg.contains(&PALETTE[1].hex()));
    // Tick labels of the x axis fitted to 0..97.
    for label in ["0", "20", "40", "60", "80", "100"] {
        assert!(svg.contains(&format!(">{label}</text>")), "missing tick {label}");
    }
    assert_well_formed(&svg);
}

#[test]
fn well_formedness_checker_rejects_broken_markup() {
    let broken = ["<svg><g></svg>", "<svg>a < b</svg>", "<svg>&nbsp;</svg>", "<svg>"];
    for xml in broken {
        let result = std::panic::catch_unwind(|| assert_well_formed(xml));
        assert!(result.is_err(), "accepted {xml}");
    }
}

#[test]
fn png_decodes_to_requested_size_with_series_colours_in_the_plot() {
    let chart = sample();
    let bytes = chart.to_png(640, 400);
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
    let (w, h, pixels) = decode(&bytes);
    assert_eq!((w, h), (640, 400));
    assert_eq!(pixels.len(), 640 * 400 * 3);
    let scene = scene::build(&chart, 640, 400);
    // Line plus markers of series 0, markers of series 1, all inside the plot area.
    assert!(count_in_plot(&scene, &pixels, PALETTE[0]) > 200);
    assert!(count_in_plot(&scene, &pixels, PALETTE[1]) > 30);
    assert_eq!(count_in_plot(&scene, &pixels, PALETTE[2]), 0);
    assert!(count_in_plot(&scene, &pixels, color::GRID) > 100);
    // Text was drawn (title and labels live outside the plot).
    let text_px = pixels.chunks(3).filter(|p| p == &[color::TEXT.0, color::TEXT.1, color::TEXT.2]);
    assert!(text_px.count() > 500);
}

#[test]
fn data_points_land_where_the_axes_say() {
    let chart = Chart::new("", "", "").with_series(Series::new(
        "s",
        vec![(0.0, 0.0), (50.0, 50.0), (97.0, 97.0)],
        Style::Markers,
    ));
    let scene = scene::build(&chart, 800, 500);
    let p = scene.plot;
    let markers: Vec<(f64, f64)> = scene
        .prims
        .iter()
        .filter_map(|prim| match prim {
            Prim::Marker { x, y, .. } if *x <= p.right() => Some((*x, *y)),
            _ => None,
        })
        .collect();
    assert_eq!(markers.len(), 3, "{markers:?}");
    // Both axes run 0..100, so (50, 50) sits in the middle and (0, 0) at the bottom-left.
    assert!((markers[0].0 - p.x).abs() < 1e-6 && (markers[0].1 - p.bottom()).abs() < 1e-6);
    assert!((markers[1].0 - (p.x + p.w / 2.0)).abs() < 1e-6);
    assert!((markers[1].1 - (p.y + p.h / 2.0)).abs() < 1e-6);
}

#[test]
fn awkward_data_renders_without_panicking() {
    for chart in awkward_charts() {
        for (w, h) in [(0, 0), (160, 120), (333, 217), (1000, 700)] {
            let svg = chart.to_svg(w, h);
            assert_well_formed(&svg);
            let (pw, ph, _) = decode(&chart.to_png(w, h));
            assert_eq!((pw, ph), (w.clamp(160, 8192), h.clamp(120, 8192)));
            assert_scene_invariants(&scene::build(&chart, pw, ph));
        }
    }
    assert_scene_invariants(&scene::build(&sample(), 800, 500));
}

#[test]
fn lone_points_of_line_series_still_show() {
    let chart = Chart::new("", "", "").with_series(Series::new(
        "gappy",
        vec![(1.0, 1.0), (f64::NAN, 0.0), (2.0, 2.0), (3.0, 3.0)],
        Style::Line,
    ));
    let scene = scene::build(&chart, 400, 300);
    let polylines = scene.prims.iter().filter(|p| matches!(p, Prim::Polyline { .. })).count();
    let markers = scene.prims.iter().filter(|p| matches!(p, Prim::Marker { .. })).count();
    // One piece (2,2)-(3,3) plus the legend swatch; the isolated (1,1) becomes a marker.
    assert_eq!((polylines, markers), (2, 1));
}

#[test]
fn log_x_axis_has_decade_labels() {
    let mut chart = Chart::new("log", "batch", "tok/s").with_series(Series::new(
        "s",
        vec![(1.0, 5.0), (10.0, 20.0), (1000.0, 40.0)],
        Style::LineAndMarkers,
    ));
    chart.x_log = true;
    let svg = chart.to_svg(800, 500);
    for label in [">1</text>", ">10</text>", ">100</text>", ">1000</text>"] {
        assert!(svg.contains(label), "missing {label}");
    }
}

#[test]
fn long_text_and_many_series_are_fitted() {
    let mut chart = Chart::new("T".repeat(500), "x", "y");
    for i in 0..60 {
        chart.series.push(Series::new(
            format!("series number {i} {}", "n".repeat(80)),
            vec![(f64::from(i), f64::from(i * i))],
            Style::Markers,
        ));
    }
    let svg = chart.to_svg(400, 300);
    assert_well_formed(&svg);
    assert!(svg.contains("TTT..."));
    assert!(svg.contains(" more</text>"));
    let scene = scene::build(&chart, 400, 300);
    assert_scene_invariants(&scene);
    // The legend box stays within the image.
    for prim in &scene.prims {
        if let Prim::Rect { rect, .. } = prim {
            assert!(rect.right() <= 400.5 && rect.bottom() <= 300.5, "{rect:?}");
        }
    }
}
