//! A run's timeline as a small SVG: map registers in use over time, DMA faults, commands, the interrupts the device
//! raised, the driver's ISR and DPC runs, and the bugcheck, with a legend keying every kind of mark drawn and each
//! fault's cause written next to it.
//! Hand-written SVG: no plotting crate draws exactly this, and the output is small enough to write by hand.

use std::fmt::Write;

use crate::completion_seen::PathMarks;
use crate::event_log_reader::EventLog;
use crate::xml_text::escape;

const WIDTH: f64 = 800.0;
const HEIGHT: f64 = 344.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
/// Ticks and the axis label, then the legend's row under them.
const BOTTOM: f64 = 74.0;
const LEGEND_ROW: f64 = 24.0;

/// Where on the plot a time and a register count land.
struct Scale {
    t0: u64,
    t_span: f64,
    y_max: f64,
}

impl Scale {
    fn x(&self, t_us: u64) -> f64 {
        LEFT + (t_us.saturating_sub(self.t0) as f64 / self.t_span) * (WIDTH - LEFT - RIGHT)
    }

    fn y(&self, in_use: f64) -> f64 {
        let plot = HEIGHT - TOP - BOTTOM;
        HEIGHT - BOTTOM - (in_use / self.y_max).min(1.0) * plot
    }
}

/// Renders the timeline of one run. `bugcheck` is the STOP's time on the event log's clock (µs since the device
/// started) and its label (`STOP 0xE6`); the runner converts serial arrival time to that clock.
pub fn render_timeline(run_name: &str, log: &EventLog, bugcheck: Option<(u64, &str)>) -> String {
    render_timeline_with(run_name, log, bugcheck, &PathMarks::default())
}

/// The same, with the driver's ISR and DPC runs (`path_marks`) in two lanes above the commands'.
pub fn render_timeline_with(run_name: &str, log: &EventLog, bugcheck: Option<(u64, &str)>, path: &PathMarks) -> String {
    let usage: Vec<(u64, u64)> = log.events.iter().filter_map(|e| Some((e.t_us?, e.in_use()?))).collect();
    let faults: Vec<(u64, String)> = log
        .events
        .iter()
        .filter(|e| e.is_fault())
        .filter_map(|e| Some((e.t_us?, e.str_field("cause").unwrap_or("unknown").to_string())))
        .collect();
    let commands: Vec<(u64, String, bool)> = log
        .events
        .iter()
        .filter(|e| e.kind == "command")
        .filter_map(|e| {
            let status = e.str_field("status").unwrap_or("?");
            let label = format!("{} {status}", e.str_field("opcode").unwrap_or("command"));
            // A command line carries proto's `Status` name; anything but OK is drawn as a failed command.
            Some((e.t_us?, label, status == vhca_proto::Status::Ok.name()))
        })
        .collect();
    // The device's call-eventfd writes, each one MSI-X message: on the device's own clock, so exact.
    let notifies: Vec<(u64, String)> = log
        .events
        .iter()
        .filter(|e| e.kind == "notify")
        .filter_map(|e| {
            let queue = e.u64_field("queue").map_or("?".to_string(), |q| q.to_string());
            Some((e.t_us?, format!("interrupt raised: queue {queue}, {}", e.str_field("cause").unwrap_or("?"))))
        })
        .collect();

    let times = usage
        .iter()
        .map(|u| u.0)
        .chain(faults.iter().map(|f| f.0))
        .chain(commands.iter().map(|c| c.0))
        .chain(notifies.iter().map(|n| n.0))
        .chain(path.isr_us.iter().chain(&path.dpc_us).copied())
        .chain(bugcheck.map(|b| b.0));
    let (t0, t1) = times.fold((u64::MAX, 0), |(lo, hi), t| (lo.min(t), hi.max(t)));
    let total = log.map_register_total().unwrap_or(0);
    let peak = usage.iter().map(|u| u.1).max().unwrap_or(0);
    let scale = Scale { t0, t_span: t1.saturating_sub(t0).max(1) as f64, y_max: y_axis_max(total, peak) as f64 };

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(svg, r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#);
    let _ = writeln!(
        svg,
        r#"<text class="title" x="{}" y="20" text-anchor="middle" font-size="14">{} — map registers in use{}</text>"#,
        WIDTH / 2.0,
        escape(run_name),
        if total > 0 { format!(" (pool of {total})") } else { String::new() }
    );
    if t0 > t1 {
        let _ = writeln!(
            svg,
            r#"<text class="empty" x="{}" y="{}" text-anchor="middle">no timed events in the device log</text>"#,
            WIDTH / 2.0,
            HEIGHT / 2.0
        );
        svg.push_str("</svg>\n");
        return svg;
    }
    axes(&mut svg, &scale, t1);
    let mut keys = Vec::new();

    if !usage.is_empty() {
        // A step line: the count holds until the next event changes it.
        let mut points = vec![(scale.x(t0), scale.y(0.0))];
        let mut last = 0.0;
        for &(t, n) in &usage {
            let x = scale.x(t);
            points.push((x, scale.y(last)));
            last = n as f64;
            points.push((x, scale.y(last)));
        }
        points.push((scale.x(t1), scale.y(last)));
        let pts: Vec<String> = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(
            svg,
            r#"<polyline class="in-use" fill="none" stroke="steelblue" stroke-width="1.5" points="{}"/>"#,
            pts.join(" ")
        );
        keys.push(Key::InUse);
    }
    let lane_y = HEIGHT - BOTTOM - 6.0;
    for (t, label, ok) in &commands {
        let x = scale.x(*t);
        let colour = if *ok { "gray" } else { "darkorange" };
        let _ = writeln!(
            svg,
            r#"<line class="command" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{colour}"><title>{}</title></line>"#,
            lane_y - 5.0,
            lane_y + 5.0,
            escape(label)
        );
    }
    if commands.iter().any(|c| c.2) {
        keys.push(Key::CommandOk);
    }
    if commands.iter().any(|c| !c.2) {
        keys.push(Key::CommandFailed);
    }
    for (t, label) in &notifies {
        let x = scale.x(*t);
        let _ = writeln!(
            svg,
            r#"<line class="notify" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{NOTIFY_COLOUR}"><title>{}</title></line>"#,
            lane_y - 44.0,
            lane_y - 36.0,
            escape(label)
        );
    }
    if !notifies.is_empty() {
        keys.push(Key::Notify(notifies.len()));
    }
    for (routine, times, untimed, y) in [
        (Routine::Isr, &path.isr_us, path.isr_untimed, lane_y - 16.0),
        (Routine::Dpc, &path.dpc_us, path.dpc_untimed, lane_y - 28.0),
    ] {
        for &t in times {
            let _ = writeln!(
                svg,
                r#"<line class="{}" x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="{}"><title>{} (guest clock, placed back from the result line)</title></line>"#,
                routine.class(),
                y - 4.0,
                y + 4.0,
                routine.colour(),
                routine.name(),
                x = scale.x(t)
            );
        }
        if !times.is_empty() {
            keys.push(Key::Path(routine, times.len(), untimed));
        }
    }
    // Each cause is written once, at its first fault, one row per cause so two causes close in time stay legible.
    let mut causes: Vec<(&str, usize)> = Vec::new();
    for (t, cause) in &faults {
        let (x, y) = (scale.x(*t), TOP + 8.0);
        let _ = writeln!(
            svg,
            r#"<circle class="fault" cx="{x:.1}" cy="{y:.1}" r="4" fill="red"><title>DMA fault: {}</title></circle>"#,
            escape(cause)
        );
        match causes.iter_mut().find(|c| c.0 == cause.as_str()) {
            Some(c) => c.1 += 1,
            None => {
                let row = causes.len() as f64 * 12.0;
                // Near the right edge the label goes to the dot's left.
                let (lx, anchor) = if x > WIDTH * 0.75 { (x - 7.0, "end") } else { (x + 7.0, "start") };
                let _ = writeln!(
                    svg,
                    r#"<text class="fault-label" x="{lx:.1}" y="{:.1}" fill="red" text-anchor="{anchor}">{}</text>"#,
                    y + 4.0 + row,
                    escape(cause)
                );
                causes.push((cause, 1));
            }
        }
    }
    if !causes.is_empty() {
        keys.push(Key::Fault(fault_key(&causes)));
    }
    if let Some((t, label)) = bugcheck {
        let x = scale.x(t);
        let _ = writeln!(
            svg,
            r#"<line class="bugcheck" x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="darkred" stroke-width="2" stroke-dasharray="6,3"/>"#,
            HEIGHT - BOTTOM
        );
        let _ = writeln!(
            svg,
            r#"<text class="bugcheck-label" x="{:.1}" y="{:.1}" fill="darkred" text-anchor="end">{}</text>"#,
            x - 4.0,
            TOP + 24.0,
            escape(label)
        );
        keys.push(Key::Bugcheck);
    }
    legend(&mut svg, &keys);
    svg.push_str("</svg>\n");
    svg
}

/// One kind of mark the timeline drew, for its legend.
enum Key {
    InUse,
    CommandOk,
    CommandFailed,
    /// The text names the causes seen.
    Fault(String),
    /// How many interrupts the device raised (its `notify` lines).
    Notify(usize),
    /// The routine, how many runs are drawn, how many more the guest counted without times.
    Path(Routine, usize, u64),
    Bugcheck,
}

const NOTIFY_COLOUR: &str = "olive";

/// The driver's interrupt-path routines the timeline marks.
#[derive(Clone, Copy)]
enum Routine {
    Isr,
    Dpc,
}

impl Routine {
    fn name(self) -> &'static str {
        match self {
            Routine::Isr => "ISR",
            Routine::Dpc => "DPC",
        }
    }
    fn class(self) -> &'static str {
        match self {
            Routine::Isr => "isr",
            Routine::Dpc => "dpc",
        }
    }
    fn colour(self) -> &'static str {
        match self {
            Routine::Isr => "purple",
            Routine::Dpc => "teal",
        }
    }
}

/// `DMA fault: iommu_unmapped ×3, stale_translation`; past three causes the rest are counted, not named (the
/// labels on the plot name each).
fn fault_key(causes: &[(&str, usize)]) -> String {
    const NAMED: usize = 3;
    let mut parts: Vec<String> = causes
        .iter()
        .take(NAMED)
        .map(|(cause, n)| if *n > 1 { format!("{cause} ×{n}") } else { cause.to_string() })
        .collect();
    if causes.len() > NAMED {
        parts.push(format!("{} more", causes.len() - NAMED));
    }
    format!("DMA fault: {}", parts.join(", "))
}

/// The legend's row under the x axis: a sample of each mark drawn and what it is.
fn legend(svg: &mut String, keys: &[Key]) {
    let y = HEIGHT - LEGEND_ROW / 2.0;
    let mut x = LEFT;
    for key in keys {
        let (sample, text) = match key {
            Key::InUse => (
                format!(
                    r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="steelblue" stroke-width="1.5"/>"#,
                    x + 16.0
                ),
                "map registers in use".to_string(),
            ),
            Key::CommandOk => (tick(x + 8.0, y, "gray"), "command (OK)".to_string()),
            Key::CommandFailed => (tick(x + 8.0, y, "darkorange"), "command failed".to_string()),
            Key::Fault(text) => (format!(r#"<circle cx="{}" cy="{y}" r="4" fill="red"/>"#, x + 8.0), text.clone()),
            Key::Notify(n) => (tick(x + 8.0, y, NOTIFY_COLOUR), format!("interrupt raised ×{n}")),
            Key::Path(routine, drawn, untimed) => (
                tick(x + 8.0, y, routine.colour()),
                match untimed {
                    0 => format!("{} ×{drawn}", routine.name()),
                    n => format!("{} ×{drawn} (+{n} untimed)", routine.name()),
                },
            ),
            Key::Bugcheck => (
                format!(
                    r#"<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="darkred" stroke-width="2" stroke-dasharray="4,2"/>"#,
                    x + 8.0,
                    y - 7.0,
                    x + 8.0,
                    y + 7.0
                ),
                "bugcheck (STOP)".to_string(),
            ),
        };
        let _ = writeln!(
            svg,
            r#"<g class="legend">{sample}<text x="{:.1}" y="{:.1}">{}</text></g>"#,
            x + 22.0,
            y + 4.0,
            escape(&text)
        );
        // An estimate of the text's width at 11 px sans-serif; the row has room to spare.
        x += 22.0 + text.chars().count() as f64 * 6.2 + 18.0;
    }
}

fn tick(x: f64, y: f64, colour: &str) -> String {
    format!(r#"<line x1="{x}" y1="{}" x2="{x}" y2="{}" stroke="{colour}"/>"#, y - 5.0, y + 5.0)
}

/// The top of the y axis. A small pool is drawn whole, so exhaustion reaches the top; a large one would flatten a
/// driver's handful of registers onto the floor, so the axis then ends a quarter above the peak (the title names the
/// pool's size).
fn y_axis_max(total: u64, peak: u64) -> u64 {
    const DRAW_WHOLE_POOL_UP_TO: u64 = 64;
    if total > 0 && total <= DRAW_WHOLE_POOL_UP_TO {
        return total.max(peak);
    }
    let headroom = peak.saturating_add(peak.div_ceil(4)).max(4);
    if total > 0 {
        headroom.min(total).max(peak)
    } else {
        headroom
    }
}

fn axes(svg: &mut String, scale: &Scale, t1: u64) {
    let (x0, x1) = (LEFT, WIDTH - RIGHT);
    let (y0, y1) = (HEIGHT - BOTTOM, TOP);
    let _ = writeln!(svg, r#"<line class="axis" x1="{x0}" y1="{y0}" x2="{x1}" y2="{y0}" stroke="black"/>"#);
    let _ = writeln!(svg, r#"<line class="axis" x1="{x0}" y1="{y0}" x2="{x0}" y2="{y1}" stroke="black"/>"#);
    // Fractions in f64: device timestamps are guest-visible numbers and may be huge; integer maths could overflow.
    let span_us = t1.saturating_sub(scale.t0) as f64;
    for i in 0..=4u32 {
        let fraction = f64::from(i) / 4.0;
        let x = x0 + fraction * (x1 - x0);
        let ms = fraction * span_us / 1000.0;
        let _ =
            writeln!(svg, r#"<text class="tick" x="{x:.1}" y="{:.1}" text-anchor="middle">{ms:.1}</text>"#, y0 + 15.0);
    }
    for i in 0..=2u32 {
        let n = (scale.y_max * f64::from(i) / 2.0).round();
        let _ = writeln!(
            svg,
            r#"<text class="tick" x="{:.1}" y="{:.1}" text-anchor="end">{n}</text>"#,
            x0 - 6.0,
            scale.y(n) + 4.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text class="axis-label" x="{:.1}" y="{:.1}" text-anchor="middle">time since first event (ms)</text>"#,
        (x0 + x1) / 2.0,
        HEIGHT - LEGEND_ROW - 12.0
    );
    let _ = writeln!(
        svg,
        r#"<text class="axis-label" transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">map registers in use</text>"#,
        (y0 + y1) / 2.0
    );
}
