//! Whole-chart tests: the SVG's texts and its one element per data point and line piece, PNG
//! decoding (size, colours actually drawn), awkward data, legend overflow, files on disk.

use std::io::Cursor;

use plotters::prelude::WHITE;

use super::*;

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

/// `#RRGGBB` as the SVG backend writes colours.
fn hex(c: RGBColor) -> String {
    format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
}

/// SVG elements of kind `tag` (`circle`, `rect`, `polyline`) whose `attr` is `color`.
fn count(svg: &str, tag: &str, attr: &str, color: RGBColor) -> usize {
    let needle = format!("{attr}=\"{}\"", hex(color));
    svg.lines().filter(|l| l.starts_with(&format!("<{tag} ")) && l.contains(&needle)).count()
}

/// The texts of all `<text>` elements.
fn texts(svg: &str) -> Vec<String> {
    svg.split("<text")
        .skip(1)
        .filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim().to_string()))
        .collect()
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

fn pixels_of(pixels: &[u8], c: RGBColor) -> usize {
    pixels.chunks(3).filter(|p| p == &[c.0, c.1, c.2]).count()
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
            stack.push(tag.split_whitespace().next().unwrap_or_default().to_string());
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

#[test]
fn svg_has_the_texts_and_one_element_per_point_and_line() {
    let svg = sample().to_svg(800, 500).unwrap();
    assert!(svg.starts_with("<svg ") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("width=\"800\" height=\"500\""));
    assert_well_formed(&svg);
    let texts = texts(&svg);
    for expected in [
        "Latency &lt;p99&gt; &amp; &quot;TTFT&quot;",
        "load (req/s)",
        "TTFT &apos;ms&apos;",
        "kiln",
        "vLLM&apos;s",
    ] {
        assert!(texts.iter().any(|t| t == expected), "no text {expected:?} in {texts:?}");
    }
    // The x axis fitted to 0..97 is labelled 0, 20, ..., 100 (or finer).
    for label in ["0", "20", "40", "60", "80", "100"] {
        assert!(texts.iter().any(|t| t == label), "missing tick {label} in {texts:?}");
    }
    // Series 0: one line and four circles, plus its legend swatch (a line and a circle).
    assert_eq!(count(&svg, "polyline", "stroke", PALETTE[0]), 1 + 1);
    assert_eq!(count(&svg, "circle", "fill", PALETTE[0]), 4 + 1);
    // Series 1: markers only, three squares plus the swatch's; no line.
    assert_eq!(count(&svg, "rect", "fill", PALETTE[1]), 3 + 1);
    assert_eq!(count(&svg, "polyline", "stroke", PALETTE[1]), 0);
    assert!(!svg.contains(&hex(PALETTE[2])));
}

#[test]
fn png_decodes_to_the_size_with_the_series_drawn() {
    let bytes = sample().to_png(640, 400).unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"));
    let (w, h, pixels) = decode(&bytes);
    assert_eq!((w, h, pixels.len()), (640, 400, 640 * 400 * 3));
    // Line plus markers of series 0, squares of series 1, and no third series.
    assert!(pixels_of(&pixels, PALETTE[0]) > 100, "{}", pixels_of(&pixels, PALETTE[0]));
    assert!(pixels_of(&pixels, PALETTE[1]) >= 100, "{}", pixels_of(&pixels, PALETTE[1]));
    assert_eq!(pixels_of(&pixels, PALETTE[2]), 0);
    assert!(pixels_of(&pixels, draw::GRID) > 500);
    // Text was rasterised: many dark pixels, anti-aliased into many grey levels.
    let dark = pixels.chunks(3).filter(|p| p.iter().all(|&v| v < 0x80)).count();
    assert!(dark > 1000, "{dark} dark pixels");
    let mut colours: Vec<&[u8]> = pixels.chunks(3).collect();
    colours.sort_unstable();
    colours.dedup();
    assert!(colours.len() > 20, "{} distinct colours", colours.len());
}

#[test]
fn lone_points_of_line_series_still_show() {
    let chart = Chart::new("", "", "").with_series(Series::new(
        "gappy",
        vec![(1.0, 1.0), (f64::NAN, 0.0), (2.0, 2.0), (3.0, 3.0)],
        Style::Line,
    ));
    let svg = chart.to_svg(400, 300).unwrap();
    // One piece (2,2)-(3,3) plus the legend line; the isolated (1,1) becomes a marker.
    assert_eq!(count(&svg, "polyline", "stroke", PALETTE[0]), 2);
    assert_eq!(count(&svg, "circle", "fill", PALETTE[0]), 1);
}

#[test]
fn log_x_axis_has_decade_labels() {
    let mut chart = Chart::new("log", "batch", "tok/s").with_series(Series::new(
        "s",
        vec![(1.0, 5.0), (10.0, 20.0), (1000.0, 40.0), (0.0, 1.0)],
        Style::LineAndMarkers,
    ));
    chart.x_log = true;
    let texts = texts(&chart.to_svg(800, 500).unwrap());
    for label in ["1", "10", "100", "1000"] {
        assert!(texts.iter().any(|t| t == label), "missing {label} in {texts:?}");
    }
    // (0, 1) cannot be shown on the log axis: three markers plus the legend's.
    let svg = chart.to_svg(800, 500).unwrap();
    assert_eq!(count(&svg, "circle", "fill", PALETTE[0]), 3 + 1);
}

fn awkward_charts() -> Vec<Chart> {
    let (nan, inf) = (f64::NAN, f64::INFINITY);
    let one = |name: &str, points: Vec<(f64, f64)>, style| {
        Chart::new(name, "x", "y").with_series(Series::new(name, points, style))
    };
    let mut log = one("log", vec![(-1.0, 1.0), (0.0, 2.0)], Style::Line);
    log.x_log = true;
    vec![
        Chart::default(),
        one("empty", vec![], Style::Line),
        one("one", vec![(3.0, 4.0)], Style::Line),
        one("flat", vec![(2.0, 5.0); 4], Style::LineAndMarkers),
        one("bad", vec![(nan, 1.0), (1.0, inf), (2.0, 3.0), (nan, nan), (4.0, 1.0)], Style::Line),
        one("all bad", vec![(nan, nan), (inf, -inf)], Style::Markers),
        one("extremes", vec![(f64::MAX, f64::MIN), (f64::MIN, f64::MAX)], Style::LineAndMarkers),
        one("tiny", vec![(0.0, f64::MIN_POSITIVE), (1e-300, 2e-300)], Style::LineAndMarkers),
        one("\n\t\u{0}ctl", vec![(1.0, 1.0), (2.0, 2.0)], Style::Line),
        one("ünïcødé → 日本", vec![(1.0, 1.0), (2.0, 2.0)], Style::Markers),
        log,
    ]
}

#[test]
fn awkward_data_renders() {
    for chart in awkward_charts() {
        for (w, h) in [(0, 0), (160, 120), (333, 217), (1000, 700)] {
            let svg = chart.to_svg(w, h).unwrap();
            assert_well_formed(&svg);
            assert!(!svg.contains('\u{0}') && !svg.contains('\t'), "{}", chart.title);
            let (pw, ph, _) = decode(&chart.to_png(w, h).unwrap());
            assert_eq!((pw, ph), (w.clamp(MIN_WIDTH, MAX_SIDE), h.clamp(MIN_HEIGHT, MAX_SIDE)));
        }
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
    let svg = chart.to_svg(400, 300).unwrap();
    assert_well_formed(&svg);
    let texts = texts(&svg);
    assert!(texts.iter().any(|t| t.starts_with("TTT") && t.ends_with("...")), "{texts:?}");
    assert!(texts.iter().any(|t| t.starts_with('+') && t.ends_with(" more")), "{texts:?}");
    assert!(texts.iter().any(|t| t.starts_with("series number 0") && t.ends_with("...")));
    // The legend box (the rectangle outlined in its border colour) stays within the image.
    let border = svg.lines().find(|l| l.starts_with("<rect ") && l.contains("#BBBBBB")).unwrap();
    let attr = |name: &str| -> i64 {
        let v = border.split(&format!(" {name}=\"")).nth(1).unwrap();
        v[..v.find('"').unwrap()].parse().unwrap()
    };
    assert!(attr("x") + attr("width") <= 400 && attr("y") + attr("height") <= 300, "{border}");
}

#[test]
fn save_writes_both_files() {
    let dir = std::env::temp_dir().join(format!("kiln-plot-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let chart = sample();
    chart.save(&dir.join("v1.2"), 320, 240).unwrap();
    let svg = std::fs::read_to_string(dir.join("v1.2.svg")).unwrap();
    let png = std::fs::read(dir.join("v1.2.png")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("kiln"));
    assert_eq!(decode(&png).0, 320);
    assert!(chart.save(&dir.join("missing-dir").join("x"), 320, 240).is_err());
}

#[test]
fn sizes_styles_and_colours() {
    assert_eq!(clamp_size(0, 0), (MIN_WIDTH, MIN_HEIGHT));
    assert_eq!(clamp_size(800, 500), (800, 500));
    assert_eq!(clamp_size(u32::MAX, 9000), (MAX_SIDE, MAX_SIDE));
    assert!(Style::Line.has_line() && !Style::Line.has_markers());
    assert!(!Style::Markers.has_line() && Style::Markers.has_markers());
    assert!(Style::LineAndMarkers.has_line() && Style::LineAndMarkers.has_markers());
    assert_eq!(series_color(9), PALETTE[1]);
    for (i, a) in PALETTE.iter().enumerate() {
        assert!(PALETTE[i + 1..].iter().all(|b| b != a));
        assert!([draw::GRID, draw::AXIS, draw::TEXT, WHITE].iter().all(|f| f != a));
    }
}
