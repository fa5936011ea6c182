//! Line charts and stacked bar charts as inline SVG, drawn from plain numbers and names (no
//! report types), for self-contained HTML reports: no scripts, no external resources, every
//! piece of text escaped. Hovering a point or a bar shows its values (an SVG `<title>`).
//!
//! Axes start at zero (or below it, for negative data) and end at a "nice" number; ticks are
//! 1, 2 or 5 × 10ⁿ apart (Heckbert, "Nice numbers for graph labels", Graphics Gems, 1990).
//! Points that are not finite are skipped; a chart with no data says so instead of drawing axes.

use std::fmt::Write as _;

/// Size of every chart, in SVG user units (it scales with the page).
pub const WIDTH: f64 = 720.0;
pub const HEIGHT: f64 = 360.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 50.0;
/// Legend names longer than this are cut (the full name is in the tooltip).
const LEGEND_CHARS: usize = 20;
/// Ticks per axis to aim for.
const TICKS: usize = 6;

/// Colour-blind-safe series colours (Okabe & Ito), used in order and then repeated.
pub const PALETTE: [&str; 7] = ["#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000"];

/// One named polyline: points in the order they are joined.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

impl Series {
    pub fn new(name: impl Into<String>, points: Vec<(f64, f64)>) -> Self {
        Series { name: name.into(), points }
    }
}

/// Which axis a [`Rule`] crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuleAxis {
    /// A horizontal line at a y value (a latency SLO).
    Y,
    /// A vertical line at an x value (an answer on the load axis).
    X,
}

/// A dashed, labelled reference line.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub axis: RuleAxis,
    pub value: f64,
    pub label: String,
}

/// A line chart: x and y axes, one polyline with markers per series, a legend.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LineChart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub series: Vec<Series>,
    pub rules: Vec<Rule>,
}

/// One layer of a stacked bar chart: a value per category.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Segment {
    pub name: String,
    pub values: Vec<f64>,
}

/// Stacked bars: one bar per category, each the sum of the segments' values (bottom first).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StackedBars {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub categories: Vec<String>,
    pub segments: Vec<Segment>,
}

/// Escapes text for HTML and SVG content and attribute values.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A linear axis from `lo` to `hi` (nice numbers) with its ticks.
#[derive(Clone, Debug, PartialEq)]
pub struct Axis {
    pub lo: f64,
    pub hi: f64,
    pub step: f64,
}

impl Axis {
    /// An axis covering `values` and zero, ending on ticks about `TICKS` apart.
    pub fn covering(values: impl IntoIterator<Item = f64>) -> Axis {
        let (mut lo, mut hi) = (0.0f64, 0.0f64);
        for v in values.into_iter().filter(|v| v.is_finite()) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if hi - lo <= 0.0 {
            hi = lo + 1.0;
        }
        let step = nice_step((hi - lo) / (TICKS - 1) as f64);
        Axis { lo: (lo / step).floor() * step, hi: (hi / step).ceil() * step, step }
    }

    /// The tick values, `lo` to `hi` inclusive.
    pub fn ticks(&self) -> Vec<f64> {
        let n = ((self.hi - self.lo) / self.step).round() as usize;
        (0..=n).map(|i| self.lo + self.step * i as f64).collect()
    }

    /// Where `v` falls between `from` (at `lo`) and `to` (at `hi`).
    fn map(&self, v: f64, from: f64, to: f64) -> f64 {
        from + (v - self.lo) / (self.hi - self.lo) * (to - from)
    }
}

/// The nice number (1, 2 or 5 × 10ⁿ) at or above `raw`.
pub fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let magnitude = 10f64.powf(raw.log10().floor());
    let fraction = raw / magnitude;
    let nice = if fraction <= 1.0 {
        1.0
    } else if fraction <= 2.0 {
        2.0
    } else if fraction <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * magnitude
}

/// A tick label: as many decimals as the step needs, thousands as `k` and millions as `M`.
pub fn format_tick(v: f64, step: f64) -> String {
    if v.abs() < step * 1e-9 {
        return "0".into();
    }
    let (scale, suffix) = if step >= 1e6 {
        (1e6, "M")
    } else if step >= 1e3 {
        (1e3, "k")
    } else {
        (1.0, "")
    };
    let (v, step) = (v / scale, step / scale);
    let decimals = if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize }.min(6);
    format!("{v:.decimals$}{suffix}")
}

/// A value for a tooltip or a label: up to 4 significant digits, no trailing zeros.
pub fn format_value(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let decimals = (3 - v.abs().log10().floor() as i32).clamp(0, 6) as usize;
    let text = format!("{v:.decimals$}");
    if text.contains('.') { text.trim_end_matches('0').trim_end_matches('.').to_string() } else { text }
}

fn color(i: usize) -> &'static str {
    PALETTE[i % PALETTE.len()]
}

fn legend_name(name: &str) -> String {
    if name.chars().count() > LEGEND_CHARS {
        let cut: String = name.chars().take(LEGEND_CHARS - 1).collect();
        format!("{cut}…")
    } else {
        name.to_string()
    }
}

/// The `<svg>` element and title; the caller closes it.
fn open(out: &mut String, title: &str) {
    let _ = write!(
        out,
        r#"<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" font-family="sans-serif" font-size="12"><title>{t}</title><text x="{x}" y="20" font-size="14" font-weight="bold" text-anchor="middle">{t}</text>"#,
        t = escape(title),
        x = LEFT + (WIDTH - LEFT - RIGHT) / 2.0,
    );
}

fn no_data(title: &str) -> String {
    let mut out = String::new();
    open(&mut out, title);
    let _ = write!(
        out,
        r##"<text x="{}" y="{}" text-anchor="middle" fill="#666">no data</text></svg>"##,
        WIDTH / 2.0,
        HEIGHT / 2.0
    );
    out
}

/// The plot frame, gridlines, ticks and axis labels. `x_ticks` are (position, label).
fn frame(out: &mut String, x_ticks: &[(f64, String)], y: &Axis, x_label: &str, y_label: &str) {
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP);
    for t in y.ticks() {
        let py = y.map(t, y0, y1);
        let _ = write!(
            out,
            r##"<line x1="{x0}" y1="{py:.1}" x2="{x1}" y2="{py:.1}" stroke="#e4e4e4"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
            x0 - 6.0,
            py + 4.0,
            escape(&format_tick(t, y.step))
        );
    }
    for (px, label) in x_ticks {
        let _ = write!(
            out,
            r##"<line x1="{px:.1}" y1="{y0}" x2="{px:.1}" y2="{:.1}" stroke="#888"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            y0 + 5.0,
            y0 + 18.0,
            escape(label)
        );
    }
    let _ = write!(
        out,
        r##"<rect x="{x0}" y="{y1}" width="{:.1}" height="{:.1}" fill="none" stroke="#888"/><text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text><text transform="translate(16 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"##,
        x1 - x0,
        y0 - y1,
        (x0 + x1) / 2.0,
        HEIGHT - 12.0,
        escape(x_label),
        (y0 + y1) / 2.0,
        escape(y_label)
    );
}

/// One legend entry, `index` rows down the right margin; `swatch` draws its key at (x, y).
fn legend_entry(out: &mut String, index: usize, name: &str, swatch: impl FnOnce(&mut String, f64, f64)) {
    let (x, y) = (WIDTH - RIGHT + 14.0, TOP + 8.0 + 18.0 * index as f64);
    swatch(out, x, y);
    let _ = write!(
        out,
        r#"<text x="{:.1}" y="{:.1}"><title>{n}</title>{}</text>"#,
        x + 24.0,
        y + 4.0,
        escape(&legend_name(name)),
        n = escape(name)
    );
}

/// A line chart as an `<svg>` element.
pub fn line_chart(chart: &LineChart) -> String {
    plot(chart, |_| true)
}

/// A scatter plot as an `<svg>` element: every series drawn as markers, and those whose
/// `joined[i]` is true also joined by a line in the order of their points (a frontier over a
/// cloud of points, say). Series beyond `joined` are not joined.
pub fn scatter_chart(chart: &LineChart, joined: &[bool]) -> String {
    plot(chart, |i| joined.get(i).copied().unwrap_or(false))
}

fn plot(chart: &LineChart, joined: impl Fn(usize) -> bool) -> String {
    let finite = |(x, y): &(f64, f64)| x.is_finite() && y.is_finite();
    let points: Vec<Vec<(f64, f64)>> =
        chart.series.iter().map(|s| s.points.iter().copied().filter(finite).collect()).collect();
    if points.iter().all(|p| p.is_empty()) {
        return no_data(&chart.title);
    }
    let rules = |axis: RuleAxis| chart.rules.iter().filter(move |r| r.axis == axis && r.value.is_finite());
    let x = Axis::covering(points.iter().flatten().map(|p| p.0).chain(rules(RuleAxis::X).map(|r| r.value)));
    let y = Axis::covering(points.iter().flatten().map(|p| p.1).chain(rules(RuleAxis::Y).map(|r| r.value)));
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP);
    let px = |v: f64| x.map(v, x0, x1);
    let py = |v: f64| y.map(v, y0, y1);

    let mut out = String::new();
    open(&mut out, &chart.title);
    let x_ticks: Vec<(f64, String)> = x.ticks().into_iter().map(|t| (px(t), format_tick(t, x.step))).collect();
    frame(&mut out, &x_ticks, &y, &chart.x_label, &chart.y_label);
    for r in rules(RuleAxis::Y) {
        let at = py(r.value);
        let _ = write!(
            out,
            r##"<line x1="{x0}" y1="{at:.1}" x2="{x1}" y2="{at:.1}" stroke="#B00020" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#B00020">{}</text>"##,
            x1 - 4.0,
            at - 4.0,
            escape(&r.label)
        );
    }
    for r in rules(RuleAxis::X) {
        let at = px(r.value);
        let _ = write!(
            out,
            r##"<line x1="{at:.1}" y1="{y0}" x2="{at:.1}" y2="{y1}" stroke="#B00020" stroke-dasharray="6 4"/><text x="{:.1}" y="{:.1}" fill="#B00020">{}</text>"##,
            at + 4.0,
            y1 + 14.0,
            escape(&r.label)
        );
    }
    for (i, (series, pts)) in chart.series.iter().zip(&points).enumerate() {
        let c = color(i);
        let _ = write!(out, r#"<g class="series"><title>{}</title>"#, escape(&series.name));
        if pts.len() > 1 && joined(i) {
            let path: Vec<String> = pts.iter().map(|(a, b)| format!("{:.1},{:.1}", px(*a), py(*b))).collect();
            let _ = write!(out, r#"<polyline fill="none" stroke="{c}" stroke-width="2" points="{}"/>"#, path.join(" "));
        }
        for (a, b) in pts {
            let _ = write!(
                out,
                r#"<circle cx="{:.1}" cy="{:.1}" r="3.5" fill="{c}"><title>{}: {} = {}, {} = {}</title></circle>"#,
                px(*a),
                py(*b),
                escape(&series.name),
                escape(&chart.x_label),
                format_value(*a),
                escape(&chart.y_label),
                format_value(*b)
            );
        }
        out.push_str("</g>");
        let line = joined(i);
        legend_entry(&mut out, i, &series.name, |out, lx, ly| {
            if line {
                let _ = write!(
                    out,
                    r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{c}" stroke-width="2"/>"#,
                    lx + 18.0
                );
            }
            let _ = write!(out, r#"<circle cx="{:.1}" cy="{ly:.1}" r="3.5" fill="{c}"/>"#, lx + 9.0);
        });
    }
    out.push_str("</svg>");
    out
}

/// A stacked bar chart as an `<svg>` element.
pub fn stacked_bars(chart: &StackedBars) -> String {
    let n = chart.categories.len();
    let value = |s: &Segment, i: usize| s.values.get(i).copied().filter(|v| v.is_finite() && *v > 0.0).unwrap_or(0.0);
    let totals: Vec<f64> = (0..n).map(|i| chart.segments.iter().map(|s| value(s, i)).sum()).collect();
    if n == 0 || totals.iter().all(|t| *t <= 0.0) {
        return no_data(&chart.title);
    }
    let y = Axis::covering(totals.iter().copied());
    let (x0, x1, y0, y1) = (LEFT, WIDTH - RIGHT, HEIGHT - BOTTOM, TOP);
    let band = (x1 - x0) / n as f64;
    let bar = (band * 0.7).min(60.0);
    let center = |i: usize| x0 + band * (i as f64 + 0.5);

    let mut out = String::new();
    open(&mut out, &chart.title);
    // Label every category while they fit, else about 12 of them.
    let every = n.div_ceil(12).max(1);
    let x_ticks: Vec<(f64, String)> =
        (0..n).filter(|i| i % every == 0).map(|i| (center(i), chart.categories[i].clone())).collect();
    frame(&mut out, &x_ticks, &y, &chart.x_label, &chart.y_label);
    for (i, category) in chart.categories.iter().enumerate() {
        let mut base = 0.0;
        for (k, s) in chart.segments.iter().enumerate() {
            let v = value(s, i);
            if v <= 0.0 {
                continue;
            }
            let (top, bottom) = (y.map(base + v, y0, y1), y.map(base, y0, y1));
            let _ = write!(
                out,
                r#"<rect x="{:.1}" y="{top:.1}" width="{bar:.1}" height="{:.1}" fill="{}"><title>{}: {} = {} (total {})</title></rect>"#,
                center(i) - bar / 2.0,
                bottom - top,
                color(k),
                escape(category),
                escape(&s.name),
                format_value(v),
                format_value(totals[i])
            );
            base += v;
        }
    }
    for (k, s) in chart.segments.iter().enumerate() {
        legend_entry(&mut out, k, &s.name, |out, lx, ly| {
            let _ =
                write!(out, r#"<rect x="{lx:.1}" y="{:.1}" width="18" height="10" fill="{}"/>"#, ly - 5.0, color(k));
        });
    }
    out.push_str("</svg>");
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Checks that `doc` is well-formed markup: every tag closed in order (HTML void elements
    /// excepted), attribute values quoted, every `&` an entity, no stray `<` or `>` in text.
    pub(crate) fn assert_well_formed(doc: &str) {
        const VOID: [&str; 5] = ["meta", "br", "hr", "img", "col"];
        let mut stack: Vec<String> = Vec::new();
        let mut rest = doc;
        while let Some(i) = rest.find(['<', '>', '&']) {
            let (text, tail) = rest.split_at(i);
            let _ = text;
            match tail.as_bytes()[0] {
                b'>' => panic!("stray '>' in text near {:?}", &tail[..tail.len().min(60)]),
                b'&' => {
                    let end = tail.find(';').unwrap_or_else(|| panic!("unterminated entity near {:?}", &tail[..20]));
                    let name = &tail[1..end];
                    let ok = matches!(name, "amp" | "lt" | "gt" | "quot" | "#39" | "middot" | "nbsp")
                        || (name.starts_with('#') && name[1..].chars().all(|c| c.is_ascii_digit()));
                    assert!(ok && end < 10, "bad entity {:?}", &tail[..end + 1]);
                    rest = &tail[end + 1..];
                }
                _ => {
                    if let Some(comment) = tail.strip_prefix("<!--") {
                        rest = &comment[comment.find("-->").expect("comment closed") + 3..];
                        continue;
                    }
                    let end = tail.find('>').expect("tag closed");
                    let tag = &tail[1..end];
                    assert!(!tag.contains('<'), "'<' inside a tag: {tag:?}");
                    assert_eq!(tag.matches('"').count() % 2, 0, "unbalanced quotes in <{tag}>");
                    rest = &tail[end + 1..];
                    if tag.starts_with('!') {
                        continue;
                    }
                    if let Some(name) = tag.strip_prefix('/') {
                        let open = stack.pop().unwrap_or_else(|| panic!("</{name}> closes nothing"));
                        assert_eq!(open, name, "</{name}> closes <{open}>");
                        continue;
                    }
                    let name: String = tag.chars().take_while(|c| c.is_ascii_alphanumeric()).collect();
                    assert!(!name.is_empty(), "empty tag name in <{tag}>");
                    if !tag.ends_with('/') && !VOID.contains(&name.as_str()) {
                        stack.push(name);
                    }
                }
            }
        }
        assert!(stack.is_empty(), "unclosed elements: {stack:?}");
    }

    fn chart() -> LineChart {
        LineChart {
            title: "latency <vs> throughput".into(),
            x_label: "throughput (infer/s)".into(),
            y_label: "latency (ms)".into(),
            series: vec![
                Series::new("p50", vec![(100.0, 1.0), (200.0, 1.5), (250.0, 3.0)]),
                Series::new("p99 & \"friends\"", vec![(100.0, 2.0), (200.0, f64::NAN), (250.0, 9.0)]),
            ],
            rules: vec![Rule { axis: RuleAxis::Y, value: 5.0, label: "SLO 5 ms".into() }],
        }
    }

    #[test]
    fn line_charts_draw_every_series_escaped() {
        let svg = line_chart(&chart());
        assert_well_formed(&svg);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(svg.matches("<circle").count(), 5 + 2, "5 finite points and 2 legend markers");
        assert!(svg.contains("latency &lt;vs&gt; throughput") && !svg.contains("<vs>"));
        assert!(svg.contains("p99 &amp; &quot;friends&quot;"));
        assert!(svg.contains("SLO 5 ms") && svg.contains("stroke-dasharray"));
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn scatter_charts_join_only_the_chosen_series() {
        let svg = scatter_chart(&chart(), &[false, true]);
        assert_well_formed(&svg);
        assert_eq!(svg.matches("<polyline").count(), 1);
        assert_eq!(svg.matches("<circle").count(), 5 + 2);
    }

    #[test]
    fn empty_charts_say_no_data() {
        let svg = line_chart(&LineChart { title: "t".into(), ..Default::default() });
        assert_well_formed(&svg);
        assert!(svg.contains("no data"));
        let svg = stacked_bars(&StackedBars { title: "t".into(), categories: vec!["a".into()], ..Default::default() });
        assert!(svg.contains("no data"));
    }

    #[test]
    fn stacked_bars_stack_segments() {
        let svg = stacked_bars(&StackedBars {
            title: "server".into(),
            x_label: "load".into(),
            y_label: "µs".into(),
            categories: vec!["c=1".into(), "c=<2>".into()],
            segments: vec![
                Segment { name: "queue".into(), values: vec![10.0, 30.0] },
                Segment { name: "infer".into(), values: vec![20.0, 0.0] },
            ],
        });
        assert_well_formed(&svg);
        // Three non-empty segments plus two legend swatches and the frame.
        assert_eq!(svg.matches("<rect").count(), 3 + 2 + 1);
        assert!(svg.contains("c=&lt;2&gt;") && svg.contains("total 30"));
    }

    #[test]
    fn axes_end_on_nice_ticks() {
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(1.3), 2.0);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(7.0), 10.0);
        assert_eq!(nice_step(230.0), 500.0);
        let a = Axis::covering([3.0, 97.0]);
        assert_eq!((a.lo, a.hi, a.step), (0.0, 100.0, 20.0));
        assert_eq!(a.ticks().len(), 6);
        let a = Axis::covering([]);
        assert_eq!((a.lo, a.hi), (0.0, 1.0));
        let a = Axis::covering([-3.0, 4.0]);
        assert!(a.lo <= -3.0 && a.hi >= 4.0);
        assert_eq!(format_tick(12000.0, 2000.0), "12k");
        assert_eq!(format_tick(0.0, 2000.0), "0");
        assert_eq!(format_tick(0.25, 0.05), "0.25");
        assert_eq!(format_tick(-0.0, 0.5), "0");
        assert_eq!(format_tick(3e6, 1e6), "3M");
        assert_eq!(format_value(1234.5678), "1235");
        assert_eq!(format_value(0.012346), "0.01235");
        assert_eq!(format_value(5.0), "5");
        assert_eq!(format_value(437.5), "437.5");
    }

    #[test]
    fn escape_covers_markup_characters() {
        assert_eq!(escape(r#"<a href="x">'&'</a>"#), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
    }
}
