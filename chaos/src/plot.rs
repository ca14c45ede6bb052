//! Draws a chaos run as one SVG picture: what happened, and what it cost.
//!
//! `ckpt-chaos run SCENARIO --plot FILE.svg` hands [`draw`] a [`Timeline`]: the steps rank 0
//! reported, the faults the harness fired, and the recoveries the job went through. The
//! picture is three panels stacked over one shared wall-time axis, so a reader can run an eye
//! straight down from an event and see its effect on every measure at the same instant:
//!
//! 1. **ranks training** — the world size of each generation, drawn as a filled block that
//!    spans only the time that generation was training (from the end of the recovery that
//!    formed it, or its first report, to its last report). A hole between blocks *is* the
//!    outage: nothing was training. Shrinking and growing show as block height.
//! 2. **steps / s** — throughput. It is computed from how many step reports arrived per unit
//!    of time (over a trailing window of [`RATE_WINDOW_S`]), never from differences of step
//!    numbers: after a recovery the job re-does steps it had already done (resume from step 10
//!    after reaching 13), and step-number arithmetic would go negative or hide that re-work.
//!    The rate is held at 0 wherever no generation is training, so stalls read as drops to 0
//!    rather than as a line interpolated across the hole, and slower re-formed worlds show as
//!    a lower plateau.
//! 3. **loss** — one line per generation, broken at each re-formation, so a resume from an
//!    older checkpoint shows as the loss stepping back up and redoing its descent.
//!
//! Every panel carries the events: each fault is a red vertical line, each recovery a shaded
//! amber span from "failure noticed" to "training again". Their text labels live once, in a
//! band above the top panel, as flags on poles that stand on the event's time; the band stacks
//! flags into as many rows as needed (up to 8) so they do not overprint each other or the data. A
//! summary line under the title states the cost in numbers: world sizes over time, number of
//! faults, time spent recovering and its share of the run, and steps re-done.
//!
//! Text is emitted as SVG `<text>` elements and rendered by whatever opens the file, so this
//! module needs no font files and no font feature of `plotters`; label sizes for layout are
//! estimated from character counts (see `text_width`), which errs on the wide side.

use std::ops::Range;
use std::path::Path;

use plotters::coord::Shift;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// One step as rank 0 reported it.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    /// Seconds since the run started.
    pub t_s: f64,
    /// Step number just completed (may repeat after a resume from a checkpoint).
    pub step: u64,
    /// Loss of that step; NaN or infinite values are left out of the loss panel.
    pub loss: f64,
    /// Ranks in the generation that ran the step.
    pub world: usize,
}

/// A fault fired.
#[derive(Debug, Clone)]
pub struct FaultMark {
    /// Seconds since the run started.
    pub t_s: f64,
    /// Short description, e.g. "kill rank 2".
    pub label: String,
}

/// A recovery: from the failure noticed to training again.
#[derive(Debug, Clone)]
pub struct RecoverySpan {
    /// When the failure was noticed (seconds since start).
    pub from_s: f64,
    /// When the re-formed generation trained again (seconds since start).
    pub to_s: f64,
    /// Short description, e.g. "gen 2: 3 ranks, 0.4 s".
    pub label: String,
}

/// Everything [`draw`] needs about one run.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// Step reports, in any order.
    pub samples: Vec<Sample>,
    /// Faults the harness fired.
    pub faults: Vec<FaultMark>,
    /// Recoveries the job went through.
    pub recoveries: Vec<RecoverySpan>,
    /// When the run ended (seconds since start).
    pub end_s: f64,
}

/// Trailing window over which steps per second are averaged.
pub const RATE_WINDOW_S: f64 = 1.0;

const WIDTH: u32 = 1280;
const MARGIN_L: u32 = 14;
const MARGIN_R: u32 = 30;
const Y_LABEL_AREA: u32 = 84;
const TITLE_H: u32 = 40;
const LINE_H: u32 = 26;
const ROW_H: u32 = 24;
const MAX_ROWS: usize = 8;
const PANEL_H: [u32; 3] = [190, 220, 220];
const X_AXIS_H: u32 = 52;
const FOOT_H: u32 = 8;

const FONT: &str = "sans-serif";
// Plotters writes `font-size` as size / 1.24 in the SVG.
const TITLE_SIZE: f64 = 28.0;
const TEXT_SIZE: f64 = 17.0;
const TICK_SIZE: f64 = 15.0;

const INK: RGBColor = RGBColor(33, 33, 33);
const MUTED: RGBColor = RGBColor(96, 96, 96);
const GRID: RGBColor = RGBColor(222, 222, 222);
const GRID_LIGHT: RGBColor = RGBColor(242, 242, 242);
const FAULT: RGBColor = RGBColor(211, 32, 32);
const RECOVERY: RGBColor = RGBColor(245, 166, 35);
const RECOVERY_INK: RGBColor = RGBColor(166, 90, 0);
const WORLD: RGBColor = RGBColor(33, 102, 204);
const RATE: RGBColor = RGBColor(24, 140, 72);
const LOSS: RGBColor = RGBColor(120, 60, 200);

type Chart<'a, DB> = ChartContext<'a, DB, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

/// Draws `timeline` as an SVG file at `path` titled `title`.
pub fn draw(timeline: &Timeline, title: &str, path: &Path) -> Result<(), String> {
    let data = Prepared::new(timeline);
    let labels = data.labels();
    let rows = assign_rows(&labels, &data.x);
    let row_count = rows.iter().copied().max().map_or(0, |r| r + 1) as u32;
    let band_h = row_count * ROW_H + if row_count > 0 { 10 } else { 0 };
    let summary = data.summary();
    // The legend shares the summary's line when both fit, else gets a line of its own.
    let legend_own_line = plot_left() + text_width(&summary, TEXT_SIZE) + 24 > legend_left();
    let header_h = TITLE_H + LINE_H * if legend_own_line { 2 } else { 1 } + 6;
    let height = header_h + band_h + PANEL_H.iter().sum::<u32>() + X_AXIS_H + FOOT_H;

    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        draw_header(&root, title, &summary, legend_own_line)?;
        let (_, rest) = root.split_vertically(header_h + band_h);
        let (top, rest) = rest.split_vertically(PANEL_H[0]);
        let (mid, bottom) = rest.split_vertically(PANEL_H[1]);

        let world = draw_world_panel(&top, &data)?;
        draw_rate_panel(&mid, &data)?;
        draw_loss_panel(&bottom, &data)?;
        draw_labels(&root, &world, &labels, &rows)?;
        root.present().map_err(err)?;
    }
    std::fs::write(path, svg).map_err(|e| format!("writing {}: {e}", path.display()))
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("drawing plot: {e}")
}

/// The timeline cleaned up for drawing: finite times, samples in time order, and the samples
/// cut into runs that each belong to one training generation.
struct Prepared {
    samples: Vec<Sample>,
    /// Index ranges into `samples`; each is one uninterrupted stretch of training.
    segments: Vec<Range<usize>>,
    /// When each segment began training: the end of the recovery that led into it, or its
    /// first report when no recovery did.
    starts: Vec<f64>,
    /// Steps per second at each sample (None where it cannot be known).
    rates: Vec<Option<f64>>,
    faults: Vec<(f64, String)>,
    spans: Vec<(f64, f64, String)>,
    /// Shared x range, in seconds.
    x: Range<f64>,
    /// Last moment anything happened (end of the run for the summary).
    wall_s: f64,
}

impl Prepared {
    fn new(tl: &Timeline) -> Self {
        let mut samples: Vec<Sample> = tl
            .samples
            .iter()
            .copied()
            .filter(|s| s.t_s.is_finite())
            .collect();
        samples.sort_by(|a, b| a.t_s.total_cmp(&b.t_s));
        let faults: Vec<(f64, String)> = tl
            .faults
            .iter()
            .filter(|f| f.t_s.is_finite())
            .map(|f| (f.t_s, f.label.clone()))
            .collect();
        let spans: Vec<(f64, f64, String)> = tl
            .recoveries
            .iter()
            .filter(|r| r.from_s.is_finite() && r.to_s.is_finite())
            .map(|r| (r.from_s.min(r.to_s), r.from_s.max(r.to_s), r.label.clone()))
            .collect();
        let stall = stall_gap(&samples);
        let segments = segments(&samples, &spans, stall);
        let starts = segment_starts(&samples, &segments, &spans, stall);
        let mut rates = step_rates(&samples, &segments, RATE_WINDOW_S);
        // The first step after a recovery took from "training again" to its report.
        for (seg, start) in segments.iter().zip(&starts) {
            let dt = samples[seg.start].t_s - start;
            if dt > 0.0 {
                rates[seg.start] = Some(1.0 / dt);
            }
        }

        let times = samples
            .iter()
            .map(|s| s.t_s)
            .chain(faults.iter().map(|f| f.0))
            .chain(spans.iter().flat_map(|s| [s.0, s.1]))
            .chain(std::iter::once(tl.end_s).filter(|t| t.is_finite()));
        let (lo, hi) = times.fold((0.0_f64, 0.0_f64), |(lo, hi), t| (lo.min(t), hi.max(t)));
        let hi = if hi - lo < 1e-9 { lo + 1.0 } else { hi };
        let pad = (hi - lo) * 0.015;
        Prepared {
            samples,
            segments,
            starts,
            rates,
            faults,
            spans,
            x: lo..hi + pad,
            wall_s: hi - lo,
        }
    }

    /// Flags for the band above the top panel, in time order (faults before recoveries at
    /// the same instant, since the fault is the cause).
    fn labels(&self) -> Vec<Label> {
        let mut labels: Vec<Label> = self
            .faults
            .iter()
            .map(|(t, text)| Label {
                t: *t,
                text: text.clone(),
                color: FAULT,
            })
            .chain(self.spans.iter().map(|(from, _, text)| Label {
                t: *from,
                text: text.clone(),
                color: RECOVERY_INK,
            }))
            .filter(|l| !l.text.is_empty())
            .collect();
        labels.sort_by(|a, b| a.t.total_cmp(&b.t));
        labels
    }

    /// "world 4 → 3 → 2 → 4 · 2 faults · 1.9 s recovering (22% of 8.6 s) · 8 steps re-done"
    fn summary(&self) -> String {
        let mut parts = Vec::new();
        let worlds = crate::world_changes(
            self.segments
                .iter()
                .map(|seg| self.samples[seg.start].world),
        );
        if !worlds.is_empty() {
            let shown: Vec<String> = if worlds.len() > 8 {
                let mut v: Vec<String> = worlds[..3].iter().map(|w| w.to_string()).collect();
                v.push("…".into());
                v.extend(worlds[worlds.len() - 3..].iter().map(|w| w.to_string()));
                v
            } else {
                worlds.iter().map(|w| w.to_string()).collect()
            };
            parts.push(format!("ranks {}", shown.join(" → ")));
        }
        let n = self.faults.len();
        parts.push(format!("{n} fault{}", if n == 1 { "" } else { "s" }));
        if !self.spans.is_empty() {
            let down = union_len(self.spans.iter().map(|s| (s.0, s.1)));
            let share = if self.wall_s > 0.0 {
                format!(
                    " ({:.0}% of {:.1} s)",
                    100.0 * down / self.wall_s,
                    self.wall_s
                )
            } else {
                String::new()
            };
            parts.push(format!("{down:.1} s recovering{share}"));
        }
        let mut best: Option<u64> = None;
        let mut redone = 0usize;
        for s in &self.samples {
            if best.is_some_and(|b| s.step <= b) {
                redone += 1;
            }
            best = Some(best.map_or(s.step, |b| b.max(s.step)));
        }
        if redone > 0 {
            parts.push(format!("{redone} steps re-done"));
        }
        if let Some(b) = best {
            parts.push(format!("reached step {b}"));
        }
        parts.join(" · ")
    }
}

/// Cuts time-ordered samples into stretches of uninterrupted training. A new stretch starts
/// where the world size changes, the step number does not advance (a resume from a
/// checkpoint), a recovery lies between two reports, or reports stop for much longer than
/// usual (a hang).
fn segments(samples: &[Sample], spans: &[(f64, f64, String)], stall: f64) -> Vec<Range<usize>> {
    if samples.is_empty() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut start = 0;
    for i in 1..samples.len() {
        let (a, b) = (&samples[i - 1], &samples[i]);
        let recovered = spans.iter().any(|s| s.0 < b.t_s && s.1 > a.t_s);
        if b.world != a.world || b.step <= a.step || b.t_s - a.t_s > stall || recovered {
            out.push(start..i);
            start = i;
        }
    }
    out.push(start..samples.len());
    out
}

/// When each segment began: the latest recovery end between the previous segment's last
/// report and this segment's first one, else the first report itself. A recovery end
/// followed by a stall before the first report does not count: that time was not training.
fn segment_starts(
    samples: &[Sample],
    segments: &[Range<usize>],
    spans: &[(f64, f64, String)],
    stall: f64,
) -> Vec<f64> {
    segments
        .iter()
        .map(|seg| {
            let first = samples[seg.start].t_s;
            let prev = seg
                .start
                .checked_sub(1)
                .map_or(f64::NEG_INFINITY, |i| samples[i].t_s);
            spans
                .iter()
                .map(|s| s.1)
                .filter(|to| *to > prev && *to < first && first - to <= stall)
                .max_by(f64::total_cmp)
                .unwrap_or(first)
        })
        .collect()
}

/// A pause between reports longer than this counts as a stall: five times the median
/// interval, and never under a quarter second (shorter blips are invisible at plot scale).
fn stall_gap(samples: &[Sample]) -> f64 {
    let mut dts: Vec<f64> = samples
        .windows(2)
        .map(|w| w[1].t_s - w[0].t_s)
        .filter(|d| *d > 0.0)
        .collect();
    if dts.len() < 4 {
        return f64::INFINITY;
    }
    dts.sort_by(f64::total_cmp);
    (5.0 * dts[dts.len() / 2]).max(0.25)
}

/// Steps per second at each sample: the reports that arrived within the trailing `window`
/// of the same segment, divided by the time they took. Counting reports (not step-number
/// differences) keeps it non-negative when steps are re-done after a resume.
fn step_rates(samples: &[Sample], segments: &[Range<usize>], window: f64) -> Vec<Option<f64>> {
    let mut out = vec![None; samples.len()];
    for seg in segments {
        let mut j = seg.start;
        for i in seg.start + 1..seg.end {
            while j + 1 < i && samples[i].t_s - samples[j].t_s > window {
                j += 1;
            }
            let dt = samples[i].t_s - samples[j].t_s;
            if dt > 0.0 {
                out[i] = Some((i - j) as f64 / dt);
            }
        }
    }
    out
}

/// Total length covered by possibly overlapping intervals.
fn union_len(spans: impl Iterator<Item = (f64, f64)>) -> f64 {
    let mut v: Vec<(f64, f64)> = spans.collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut cur: Option<(f64, f64)> = None;
    for (a, b) in v {
        cur = match cur {
            Some((ca, cb)) if a <= cb => Some((ca, cb.max(b))),
            Some((ca, cb)) => {
                total += cb - ca;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + cur.map_or(0.0, |(a, b)| b - a)
}

struct Label {
    t: f64,
    text: String,
    color: RGBColor,
}

/// Estimated rendered width in pixels of `text` at plotters font `size`: SVG font size is
/// size / 1.24, and 0.56 em per character covers common sans-serif faces with a margin.
fn text_width(text: &str, size: f64) -> i32 {
    (text.chars().count() as f64 * 0.56 * size / 1.24).ceil() as i32
}

fn plot_left() -> i32 {
    (MARGIN_L + Y_LABEL_AREA) as i32
}

fn plot_right() -> i32 {
    (WIDTH - MARGIN_R) as i32
}

/// Pixel span of a flag whose pole stands at `px`: to the right of the pole, or to its left
/// when it would run off the picture.
fn flag_box(px: i32, text: &str) -> (i32, i32) {
    let w = text_width(text, TEXT_SIZE) + 12;
    if px + w <= WIDTH as i32 - 4 {
        (px, px + w)
    } else {
        (px - w, px)
    }
}

/// Gives each flag the lowest row (row 0 sits on the top panel) where it overprints no
/// earlier flag; past [`MAX_ROWS`] it takes the row that frees up first.
fn assign_rows(labels: &[Label], x: &Range<f64>) -> Vec<usize> {
    let scale = (plot_right() - plot_left()) as f64 / (x.end - x.start);
    let mut row_ends: Vec<i32> = Vec::new();
    labels
        .iter()
        .map(|l| {
            let px = plot_left() + ((l.t - x.start) * scale).round() as i32;
            let (left, right) = flag_box(px, &l.text);
            let row = match row_ends.iter().position(|end| *end + 6 <= left) {
                Some(r) => r,
                None if row_ends.len() < MAX_ROWS => {
                    row_ends.push(i32::MIN);
                    row_ends.len() - 1
                }
                None => (0..row_ends.len())
                    .min_by_key(|r| row_ends[*r])
                    .unwrap_or(0),
            };
            row_ends[row] = right;
            row
        })
        .collect()
}

const LEGEND_FAULT: &str = "fault";
const LEGEND_RECOVERY: &str = "recovery (noticed → training)";

/// Left end of the legend, which is right-aligned with the plots.
fn legend_left() -> i32 {
    plot_right()
        - text_width(LEGEND_RECOVERY, TEXT_SIZE)
        - text_width(LEGEND_FAULT, TEXT_SIZE)
        - 22
        - 28
        - 22
}

fn draw_header<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    summary: &str,
    legend_own_line: bool,
) -> Result<(), String> {
    let title_style = (FONT, TITLE_SIZE)
        .into_font()
        .style(FontStyle::Bold)
        .color(&INK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    root.draw(&Text::new(
        title.to_string(),
        (WIDTH as i32 / 2, 8),
        title_style,
    ))
    .map_err(err)?;

    let y = (TITLE_H + LINE_H / 2) as i32;
    let style = (FONT, TEXT_SIZE)
        .into_font()
        .color(&MUTED)
        .pos(Pos::new(HPos::Left, VPos::Center));
    root.draw(&Text::new(summary.to_string(), (plot_left(), y), style))
        .map_err(err)?;
    let y = if legend_own_line {
        y + LINE_H as i32
    } else {
        y
    };

    // Legend, right-aligned: what a red line and an amber span mean.
    let legend = (FONT, TEXT_SIZE)
        .into_font()
        .color(&INK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    let (fault_text, rec_text) = (LEGEND_FAULT, LEGEND_RECOVERY);
    let fault_x = legend_left();
    let rec_x = fault_x + 22 + text_width(fault_text, TEXT_SIZE) + 28;
    root.draw(&PathElement::new(
        vec![(fault_x + 8, y - 9), (fault_x + 8, y + 9)],
        FAULT.stroke_width(3),
    ))
    .map_err(err)?;
    root.draw(&Text::new(fault_text, (fault_x + 18, y), legend.clone()))
        .map_err(err)?;
    root.draw(&Rectangle::new(
        [(rec_x, y - 9), (rec_x + 16, y + 9)],
        RECOVERY.mix(0.35).filled(),
    ))
    .map_err(err)?;
    root.draw(&Text::new(rec_text, (rec_x + 22, y), legend))
        .map_err(err)?;
    Ok(())
}

/// One panel: axes, grid and y description; only the bottom one labels the time axis.
fn panel<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    x: &Range<f64>,
    y: Range<f64>,
    desc: &str,
    bottom: bool,
    y_fmt: Option<&dyn Fn(&f64) -> String>,
) -> Result<Chart<'a, DB>, String> {
    let mut chart = ChartBuilder::on(area)
        .margin_left(MARGIN_L)
        .margin_right(MARGIN_R)
        .margin_top(6)
        .margin_bottom(6)
        .y_label_area_size(Y_LABEL_AREA)
        .x_label_area_size(if bottom { X_AXIS_H } else { 0 })
        .build_cartesian_2d(x.clone(), y)
        .map_err(err)?;
    let mut mesh = chart.configure_mesh();
    mesh.x_label_formatter(&tidy)
        .y_label_formatter(y_fmt.unwrap_or(&tidy))
        .x_labels(14)
        .y_labels(6)
        .bold_line_style(GRID)
        .light_line_style(GRID_LIGHT)
        .axis_style(MUTED)
        .label_style((FONT, TICK_SIZE).into_font().color(&MUTED))
        .axis_desc_style((FONT, TEXT_SIZE).into_font().color(&INK))
        .y_desc(desc);
    if bottom {
        mesh.x_desc("wall time since start (s)");
    }
    mesh.draw().map_err(err)?;
    Ok(chart)
}

/// Tick labels without trailing zeros: "10", "2.5", "0.25".
fn tidy(v: &f64) -> String {
    let s = format!("{v:.6}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

/// Recovery shading behind the data, drawn over the panel's full height.
fn draw_spans<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    data: &Prepared,
    y: &Range<f64>,
) -> Result<(), String> {
    // At least ~2 px wide, so an instant recovery still shows.
    let min_w = 2.0 * (data.x.end - data.x.start) / (plot_right() - plot_left()) as f64;
    chart
        .draw_series(data.spans.iter().map(|(a, b, _)| {
            Rectangle::new(
                [(*a, y.start), (b.max(a + min_w), y.end)],
                RECOVERY.mix(0.25).filled(),
            )
        }))
        .map_err(err)?;
    Ok(())
}

/// Fault lines over the data.
fn draw_faults<DB: DrawingBackend>(
    chart: &mut Chart<'_, DB>,
    data: &Prepared,
    y: &Range<f64>,
) -> Result<(), String> {
    for (t, _) in &data.faults {
        chart
            .draw_series(LineSeries::new(
                [(*t, y.start), (*t, y.end)],
                FAULT.stroke_width(2),
            ))
            .map_err(err)?;
    }
    Ok(())
}

fn note<DB: DrawingBackend>(
    chart: &Chart<'_, DB>,
    text: &str,
    x: &Range<f64>,
    y: &Range<f64>,
) -> Result<(), String> {
    let style = (FONT, TEXT_SIZE)
        .into_font()
        .style(FontStyle::Italic)
        .color(&MUTED)
        .pos(Pos::new(HPos::Center, VPos::Center));
    let at = ((x.start + x.end) / 2.0, (y.start + y.end) / 2.0);
    chart
        .plotting_area()
        .draw(&Text::new(text.to_string(), at, style))
        .map_err(err)
}

fn draw_world_panel<'a, DB: DrawingBackend>(
    area: &'a DrawingArea<DB, Shift>,
    data: &Prepared,
) -> Result<Chart<'a, DB>, String> {
    let max_world = data
        .samples
        .iter()
        .map(|s| s.world)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let y = 0.0..(max_world * 1.2).max(max_world + 1.0);
    let integers = |v: &f64| {
        if (v - v.round()).abs() < 1e-6 {
            format!("{v:.0}")
        } else {
            String::new()
        }
    };
    let mut chart = panel(
        area,
        &data.x,
        y.clone(),
        "ranks training",
        false,
        Some(&integers),
    )?;
    draw_spans(&mut chart, data, &y)?;
    for (seg, &start) in data.segments.iter().zip(&data.starts) {
        let (a, b) = (&data.samples[seg.start], &data.samples[seg.end - 1]);
        let w = a.world as f64;
        if b.t_s > start {
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(start, 0.0), (b.t_s, w)],
                    WORLD.mix(0.14).filled(),
                )))
                .map_err(err)?;
            chart
                .draw_series(LineSeries::new(
                    [(start, 0.0), (start, w), (b.t_s, w), (b.t_s, 0.0)],
                    WORLD.stroke_width(2),
                ))
                .map_err(err)?;
        } else {
            chart
                .draw_series(std::iter::once(Circle::new((a.t_s, w), 4, WORLD.filled())))
                .map_err(err)?;
        }
    }
    if data.samples.is_empty() {
        note(&chart, "no step samples recorded", &data.x, &y)?;
    }
    draw_faults(&mut chart, data, &y)?;
    Ok(chart)
}

fn draw_rate_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    data: &Prepared,
) -> Result<(), String> {
    // A step line held at 0 wherever no segment is training.
    let mut pts = vec![(data.x.start, 0.0)];
    for (seg, &start) in data.segments.iter().zip(&data.starts) {
        pts.push((start, 0.0));
        for i in seg.clone() {
            if let Some(r) = data.rates[i] {
                let from = if i == seg.start {
                    start
                } else {
                    data.samples[i - 1].t_s
                };
                pts.push((from, r));
                pts.push((data.samples[i].t_s, r));
            }
        }
        pts.push((data.samples[seg.end - 1].t_s, 0.0));
    }
    pts.push((data.x.end, 0.0));
    let max_rate = data.rates.iter().flatten().fold(0.0_f64, |m, r| m.max(*r));
    let y = 0.0..if max_rate > 0.0 { max_rate * 1.2 } else { 1.0 };

    let desc = format!("steps / s  ({RATE_WINDOW_S:.0} s window)");
    let mut chart = panel(area, &data.x, y.clone(), &desc, false, None)?;
    draw_spans(&mut chart, data, &y)?;
    chart
        .draw_series(std::iter::once(Polygon::new(
            pts.clone(),
            RATE.mix(0.12).filled(),
        )))
        .map_err(err)?;
    chart
        .draw_series(LineSeries::new(pts, RATE.stroke_width(2)))
        .map_err(err)?;
    if data.samples.is_empty() {
        note(&chart, "no step samples recorded", &data.x, &y)?;
    }
    draw_faults(&mut chart, data, &y)?;
    Ok(())
}

fn draw_loss_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    data: &Prepared,
) -> Result<(), String> {
    let finite = data
        .samples
        .iter()
        .map(|s| s.loss)
        .filter(|l| l.is_finite());
    let (lo, hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), l| {
        (lo.min(l), hi.max(l))
    });
    let y = if lo > hi {
        0.0..1.0
    } else if hi - lo < 1e-12 {
        let pad = (lo.abs() * 0.1).max(0.5);
        lo - pad..hi + pad
    } else {
        let pad = (hi - lo) * 0.08;
        lo - pad..hi + pad
    };
    let mut chart = panel(area, &data.x, y.clone(), "loss", true, None)?;
    draw_spans(&mut chart, data, &y)?;
    for seg in &data.segments {
        let pts: Vec<(f64, f64)> = data.samples[seg.clone()]
            .iter()
            .filter(|s| s.loss.is_finite())
            .map(|s| (s.t_s, s.loss))
            .collect();
        if pts.len() == 1 {
            chart
                .draw_series(std::iter::once(Circle::new(pts[0], 4, LOSS.filled())))
                .map_err(err)?;
        } else {
            chart
                .draw_series(LineSeries::new(pts, LOSS.stroke_width(2)))
                .map_err(err)?;
        }
    }
    if data.samples.is_empty() {
        note(&chart, "no step samples recorded", &data.x, &y)?;
    } else if lo > hi {
        note(&chart, "no finite loss values", &data.x, &y)?;
    }
    draw_faults(&mut chart, data, &y)?;
    Ok(())
}

/// Flags above the top panel: poles first, then boxes over them, so a pole that passes a
/// lower flag runs behind it instead of through its text.
fn draw_labels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    top: &Chart<'_, DB>,
    labels: &[Label],
    rows: &[usize],
) -> Result<(), String> {
    let y_top = top.as_coord_spec().y_spec().range().end;
    let boxes: Vec<(i32, i32, i32, i32)> = labels
        .iter()
        .zip(rows)
        .map(|(l, row)| {
            let (px, plot_top) = top.backend_coord(&(l.t, y_top));
            let bottom = plot_top - 4 - (*row as i32) * ROW_H as i32;
            (px, plot_top, bottom, bottom - ROW_H as i32 + 4)
        })
        .collect();
    for (l, (px, plot_top, bottom, _)) in labels.iter().zip(&boxes) {
        root.draw(&PathElement::new(
            vec![(*px, *bottom), (*px, *plot_top)],
            l.color.stroke_width(1),
        ))
        .map_err(err)?;
    }
    for (l, (px, _, bottom, top_y)) in labels.iter().zip(&boxes) {
        let (left, right) = flag_box(*px, &l.text);
        root.draw(&Rectangle::new(
            [(left, *top_y), (right, *bottom)],
            WHITE.filled(),
        ))
        .map_err(err)?;
        root.draw(&Rectangle::new(
            [(left, *top_y), (right, *bottom)],
            l.color.stroke_width(1),
        ))
        .map_err(err)?;
        let style = (FONT, TEXT_SIZE)
            .into_font()
            .color(&l.color)
            .pos(Pos::new(HPos::Left, VPos::Center));
        root.draw(&Text::new(
            l.text.clone(),
            (left + 6, (top_y + bottom) / 2),
            style,
        ))
        .map_err(err)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loss_at(step: u64) -> f64 {
        0.35 + 2.4 * (-(step as f64) / 14.0).exp() + 0.02 * ((step * 7919 % 13) as f64 / 13.0)
    }

    /// Steps `from..=to` on `world` ranks, starting at `t0`, one every `dt` seconds (with a
    /// little deterministic jitter).
    fn generation(out: &mut Vec<Sample>, world: usize, from: u64, to: u64, t0: f64, dt: f64) {
        for (k, step) in (from..=to).enumerate() {
            let jitter = 0.012 * (((step * 37) % 7) as f64 / 7.0 - 0.5);
            out.push(Sample {
                t_s: t0 + dt * (k as f64 + 1.0) + jitter,
                step,
                loss: loss_at(step),
                world,
            });
        }
    }

    /// 4 ranks at ~10 steps/s; rank 2 killed at 1.5 s, back on 3 ranks at 2.1 s from the
    /// step-10 checkpoint after reaching 13; a node (2 ranks) lost at 4.2 s, back on 2 ranks
    /// from step 20; the world grows back to 4 at 7.4 s from step 30; done at step 40.
    fn synthetic() -> Timeline {
        let mut samples = Vec::new();
        generation(&mut samples, 4, 1, 13, 0.15, 0.1);
        generation(&mut samples, 3, 11, 25, 2.1, 0.133);
        generation(&mut samples, 2, 21, 30, 4.95, 0.2);
        generation(&mut samples, 4, 31, 40, 7.4, 0.1);
        Timeline {
            samples,
            faults: vec![
                FaultMark {
                    t_s: 1.5,
                    label: "kill rank 2".into(),
                },
                FaultMark {
                    t_s: 4.2,
                    label: "node lost (ranks 2-3)".into(),
                },
            ],
            recoveries: vec![
                RecoverySpan {
                    from_s: 1.5,
                    to_s: 2.1,
                    label: "gen 2: 3 ranks, 0.6 s".into(),
                },
                RecoverySpan {
                    from_s: 4.25,
                    to_s: 4.95,
                    label: "gen 3: 2 ranks, 0.7 s".into(),
                },
                RecoverySpan {
                    from_s: 7.05,
                    to_s: 7.4,
                    label: "gen 4: 4 ranks, 0.35 s".into(),
                },
            ],
            end_s: 8.6,
        }
    }

    fn temp_svg(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("ckpt-plot-{}-{name}.svg", std::process::id()))
    }

    #[test]
    fn draws_synthetic_run() {
        let tl = synthetic();
        let path = temp_svg("synthetic");
        let title = "chaos: kill-then-node-loss (4 ranks)";
        draw(&tl, title, &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(svg.len() > 5_000, "svg too small: {} bytes", svg.len());
        assert!(svg.starts_with("<svg"));
        assert!(svg.trim_end().ends_with("</svg>"));
        for text in [
            title,
            "kill rank 2",
            "node lost (ranks 2-3)",
            "gen 2: 3 ranks, 0.6 s",
            "gen 4: 4 ranks, 0.35 s",
            "8 steps re-done",
        ] {
            assert!(svg.contains(text), "missing {text:?}");
        }
        // Keep a copy to look at: PLOT_KEEP_SVG=/some/file.svg cargo test
        if let Some(keep) = std::env::var_os("PLOT_KEEP_SVG") {
            draw(&tl, title, Path::new(&keep)).unwrap();
        }
    }

    #[test]
    fn rates_count_reports_not_step_numbers() {
        let tl = synthetic();
        let data = Prepared::new(&tl);
        assert_eq!(data.segments.len(), 4);
        let rates: Vec<f64> = data.rates.iter().flatten().copied().collect();
        assert!(rates.iter().all(|r| *r > 0.0));
        // First generation runs at ~10 steps/s, the 2-rank one at ~5.
        let first = data.rates[12].unwrap();
        assert!((first - 10.0).abs() < 1.0, "{first}");
        let slow = data.rates[13 + 15 + 9].unwrap();
        assert!((slow - 5.0).abs() < 0.6, "{slow}");
    }

    #[test]
    fn empty_timeline_draws() {
        let path = temp_svg("empty");
        draw(&Timeline::default(), "empty run", &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(svg.contains("empty run"));
        assert!(svg.contains("no step samples recorded"));
    }

    #[test]
    fn odd_inputs_draw() {
        let one = Timeline {
            samples: vec![Sample {
                t_s: 0.5,
                step: 1,
                loss: f64::NAN,
                world: 2,
            }],
            faults: vec![FaultMark {
                t_s: 30.0,
                label: "hang rank 1".into(),
            }],
            recoveries: vec![RecoverySpan {
                from_s: 31.0,
                to_s: 31.0,
                label: "gen 2: 1 rank, 0.0 s".into(),
            }],
            end_s: 2.0,
        };
        let path = temp_svg("odd");
        draw(&one, "one sample", &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(svg.contains("hang rank 1"));
        assert!(svg.contains("no finite loss values"));

        let mut tl = synthetic();
        for s in tl.samples.iter_mut().step_by(3) {
            s.loss = f64::NAN;
        }
        tl.samples.reverse();
        tl.faults.push(FaultMark {
            t_s: 12.0,
            label: "late fault".into(),
        });
        let path = temp_svg("nan");
        draw(&tl, "nan loss", &path).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).ok();
        assert!(!svg.contains("NaN"));
        assert!(svg.contains("late fault"));
    }

    #[test]
    fn unwritable_path_is_an_error() {
        let path = Path::new("/nonexistent-dir-for-ckpt-plot/x.svg");
        assert!(draw(&synthetic(), "t", path).is_err());
    }
}
