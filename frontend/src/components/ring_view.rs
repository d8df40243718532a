//! The ring, drawn: W rank cards on a circle (rank 0 at the top, the right neighbour
//! clockwise), each holding its buffer as W chunk boxes coloured by what they hold,
//! and for the step shown an arrow along the circle from every rank to its right
//! neighbour, labelled with the chunk it carried and its numbers. The naive and tree
//! all-reduces move whole buffers (one box per card) along straight arrows between any
//! two cards.
//!
//! [`RingLayout`] is the geometry (plain Rust, unit-tested); [`RingView`] draws one
//! frame of a [`Replay`].

use distlab_common::trace::RingPhase;
use leptos::prelude::*;

use crate::format;
use crate::ring_replay::{level_name, ChunkKind, ChunkState, Frame, Level, Replay, Schedule, Transfer};

const MARGIN: f64 = 16.0;
const PAD: f64 = 8.0;
const GAP: f64 = 5.0;
const HEADER_H: f64 = 22.0;
const BAR_H: f64 = 5.0;
const CHUNK_TITLE_H: f64 = 15.0;
const LINE_H: f64 = 13.0;
const BADGE_H: f64 = 16.0;
/// Numbers are drawn inside the chunks up to this many per chunk, and this many ranks.
const MAX_VALUE_LINES: usize = 8;
const MAX_VALUE_RANKS: usize = 5;
const LABEL_W: f64 = 190.0;
const LABEL_H: f64 = 36.0;
const MIN_CARD_W: f64 = 250.0;

/// An arrow from a rank to its right neighbour, along the circle.
#[derive(Clone, Debug, PartialEq)]
pub struct ArrowGeom {
    pub from: usize,
    pub to: usize,
    /// SVG path (`M x y A r r 0 0 1 x y`).
    pub path: String,
    pub start: (f64, f64),
    pub end: (f64, f64),
    /// Centre of the label.
    pub label: (f64, f64),
}

#[derive(Clone, Debug, PartialEq)]
pub struct RingLayout {
    pub world: usize,
    /// Chunk boxes per card: one per rank on a ring, one for whole buffers.
    pub chunks: usize,
    pub width: f64,
    pub height: f64,
    pub center: (f64, f64),
    pub radius: f64,
    pub card_w: f64,
    pub card_h: f64,
    pub chunk_w: f64,
    pub chunk_h: f64,
    /// Numbers inside the chunk boxes (else: size and badge only).
    pub show_values: bool,
    pub value_lines: usize,
    /// Top-left corner of each rank's card, by ring position.
    pub cards: Vec<(f64, f64)>,
    pub arrows: Vec<ArrowGeom>,
}

fn inside(p: (f64, f64), (x, y): (f64, f64), w: f64, h: f64, margin: f64) -> bool {
    p.0 >= x - margin && p.0 <= x + w + margin && p.1 >= y - margin && p.1 <= y + h + margin
}

impl RingLayout {
    /// `chunks`: boxes per card; `max_chunk_len`: elements in the largest chunk; `values`:
    /// whether numbers are known.
    pub fn new(world: usize, chunks: usize, max_chunk_len: usize, values: bool) -> Self {
        let w = world.max(1);
        let n = chunks.max(1);
        let show_values = values && max_chunk_len <= MAX_VALUE_LINES && w <= MAX_VALUE_RANKS;
        let value_lines = if show_values { max_chunk_len.max(1) } else { 1 };
        let chunk_w = if show_values {
            54.0
        } else if w <= 8 {
            40.0
        } else {
            28.0
        };
        let chunk_h = CHUNK_TITLE_H + value_lines as f64 * LINE_H + BADGE_H;
        // Wide enough for the header ("rank 3   sent 105.9 KiB / 211.8 KiB"); the chunks share it.
        let card_w = (2.0 * PAD + n as f64 * chunk_w + (n as f64 - 1.0) * GAP).max(MIN_CARD_W);
        let chunk_w = (card_w - 2.0 * PAD - (n as f64 - 1.0) * GAP) / n as f64;
        let card_h = HEADER_H + BAR_H + 6.0 + chunk_h + PAD;
        // Far enough apart that neighbouring cards leave room for an arrow and its label.
        let radius = if w < 2 {
            0.0
        } else {
            let chord_needed = (card_w.max(card_h) * 1.25).max(card_w + 60.0);
            // At least enough room in the middle for the phase text beside the arrow labels.
            (chord_needed / (2.0 * (std::f64::consts::PI / w as f64).sin())).max(250.0)
        };
        let angle = |p: f64| -std::f64::consts::FRAC_PI_2 + 2.0 * std::f64::consts::PI * p / w as f64;
        let point = |a: f64| (radius * a.cos(), radius * a.sin());
        let mut cards: Vec<(f64, f64)> = (0..w)
            .map(|p| {
                let (x, y) = point(angle(p as f64));
                (x - card_w / 2.0, y - card_h / 2.0)
            })
            .collect();
        // Arrows: the arc between two neighbours, from where it leaves one card to where it meets the next.
        let mut arrows = Vec::new();
        if w >= 2 {
            for p in 0..w {
                let q = (p + 1) % w;
                let (a0, a1) = (angle(p as f64), angle(p as f64 + 1.0));
                let samples = 400;
                let at = |i: usize| a0 + (a1 - a0) * i as f64 / samples as f64;
                let leave = (0..=samples).find(|&i| !inside(point(at(i)), cards[p], card_w, card_h, 6.0)).unwrap_or(0);
                let arrive = (0..=samples)
                    .rev()
                    .find(|&i| !inside(point(at(i)), cards[q], card_w, card_h, 12.0))
                    .unwrap_or(samples);
                let (s, e) = (point(at(leave)), point(at(arrive)));
                let mid = point((at(leave) + at(arrive)) / 2.0);
                // The path is written once the picture has been moved into the view box.
                let large_arc = (at(arrive) - at(leave)).abs() > std::f64::consts::PI;
                arrows
                    .push((ArrowGeom { from: p, to: q, path: String::new(), start: s, end: e, label: mid }, large_arc));
            }
        }
        // Move everything so that the cards and labels sit inside the view box.
        let mut min = (f64::INFINITY, f64::INFINITY);
        let mut max = (f64::NEG_INFINITY, f64::NEG_INFINITY);
        let mut extend = |x0: f64, y0: f64, x1: f64, y1: f64| {
            min = (min.0.min(x0), min.1.min(y0));
            max = (max.0.max(x1), max.1.max(y1));
        };
        for &(x, y) in &cards {
            extend(x, y, x + card_w, y + card_h);
        }
        for (a, _) in &arrows {
            extend(
                a.label.0 - LABEL_W / 2.0,
                a.label.1 - LABEL_H / 2.0,
                a.label.0 + LABEL_W / 2.0,
                a.label.1 + LABEL_H / 2.0,
            );
        }
        let (dx, dy) = (MARGIN - min.0, MARGIN - min.1);
        let shift = |(x, y): (f64, f64)| (x + dx, y + dy);
        for c in cards.iter_mut() {
            *c = shift(*c);
        }
        let arrows = arrows
            .into_iter()
            .map(|(mut a, large_arc)| {
                a.start = shift(a.start);
                a.end = shift(a.end);
                a.label = shift(a.label);
                a.path = format!(
                    "M{:.1} {:.1} A{radius:.1} {radius:.1} 0 {} 1 {:.1} {:.1}",
                    a.start.0,
                    a.start.1,
                    u8::from(large_arc),
                    a.end.0,
                    a.end.1
                );
                a
            })
            .collect();
        RingLayout {
            world: w,
            chunks: n,
            width: max.0 - min.0 + 2.0 * MARGIN,
            height: max.1 - min.1 + 2.0 * MARGIN,
            center: shift((0.0, 0.0)),
            radius,
            card_w,
            card_h,
            chunk_w,
            chunk_h,
            show_values,
            value_lines,
            cards,
            arrows,
        }
    }

    /// A straight arrow from card `from` to card `to`, from where it leaves one card to
    /// where it meets the other (whole buffers go between any two ranks). It keeps a little
    /// to its right, its label before the middle, so that two ranks sending to each other
    /// in one step (the hierarchical all-reduce's leaders) show two arrows.
    pub fn chord(&self, from: usize, to: usize) -> ArrowGeom {
        let centre = |p: usize| (self.cards[p].0 + self.card_w / 2.0, self.cards[p].1 + self.card_h / 2.0);
        let (a, b) = (centre(from), centre(to));
        let (dx, dy) = (b.0 - a.0, b.1 - a.1);
        let length = dx.hypot(dy).max(1.0);
        let right = (-dy / length * CHORD_SIDE, dx / length * CHORD_SIDE);
        let (a, b) = ((a.0 + right.0, a.1 + right.1), (b.0 + right.0, b.1 + right.1));
        let samples = 400;
        let at = |i: usize| {
            let t = i as f64 / samples as f64;
            (a.0 + (b.0 - a.0) * t, a.1 + (b.1 - a.1) * t)
        };
        let leave =
            (0..=samples).find(|&i| !inside(at(i), self.cards[from], self.card_w, self.card_h, 6.0)).unwrap_or(0);
        let arrive = (0..=samples)
            .rev()
            .find(|&i| !inside(at(i), self.cards[to], self.card_w, self.card_h, 12.0))
            .unwrap_or(samples);
        let (start, end) = (at(leave), at(arrive.max(leave)));
        let label = (start.0 + (end.0 - start.0) * 0.35, start.1 + (end.1 - start.1) * 0.35);
        let path = format!("M{:.1} {:.1} L{:.1} {:.1}", start.0, start.1, end.0, end.1);
        ArrowGeom { from, to, path, start, end, label }
    }

    /// Top-left corner of chunk `c` in the card of position `p`.
    pub fn chunk_origin(&self, p: usize, c: usize) -> (f64, f64) {
        let (x, y) = self.cards[p];
        let used = self.chunks as f64 * self.chunk_w + (self.chunks as f64 - 1.0) * GAP;
        let left = x + (self.card_w - used) / 2.0;
        (left + c as f64 * (self.chunk_w + GAP), y + HEADER_H + BAR_H + 6.0)
    }
}

/// How far a straight arrow keeps to its right (px).
const CHORD_SIDE: f64 = 12.0;

/// Fill of a partial sum: paler with few contributions, deeper as they add up
/// (from #fff0c2 towards #f08c00; a complete sum is green).
pub fn partial_fill(count: usize, world: usize) -> String {
    let t = (count.saturating_sub(1)) as f64 / (world.max(2) - 1) as f64;
    let mix = |a: f64, b: f64| (a + (b - a) * t).round() as u8;
    format!("#{:02x}{:02x}{:02x}", mix(255.0, 240.0), mix(240.0, 140.0), mix(194.0, 0.0))
}

fn chunk_fill(chunk: &ChunkState, world: usize) -> Option<String> {
    (chunk.kind == ChunkKind::Partial).then(|| partial_fill(chunk.count(), world))
}

fn numbers(values: &[f32]) -> String {
    values.iter().map(|&v| format::value(v)).collect::<Vec<_>>().join(" ")
}

/// What an arrow carried.
enum Carried {
    /// A whole buffer (naive, tree, the hierarchical all-reduce's last steps).
    Buffer,
    /// The replay's chunk(s) it covers.
    Chunk,
    /// All-to-all: the sender's chunk for the receiver, into the receiver's chunk for it.
    ItsChunk,
}

/// The text on an arrow: what it carried and its numbers.
fn transfer_label(t: &Transfer, ranks: &[u32], carried: Carried) -> (String, Option<String>) {
    let rank = |p: usize| ranks.get(p).copied().unwrap_or(p as u32);
    let what = match (t.reduce, t.carried) {
        (true, 1) => format!("own data, 1/{}", ranks.len()),
        (true, n) => format!("{n}/{} partial sum", ranks.len()),
        (false, _) => "copy".into(),
    };
    let head = match carried {
        Carried::Buffer => format!("buffer → r{} · {what}", rank(t.to)),
        Carried::ItsChunk => format!("chunk {} → r{}'s chunk {}", t.chunk, rank(t.to), t.covers.start),
        Carried::Chunk => format!("{} → r{} · {what}", t.chunks_label(), rank(t.to)),
    };
    (head, t.values.as_ref().map(|v| format!("[{}]", numbers(v))))
}

/// One frame of the replay on the ring.
#[component]
pub fn RingView(replay: StoredValue<Replay>, #[prop(into)] frame: Signal<usize>) -> impl IntoView {
    let layout = replay.with_value(|r| {
        let max_chunk = r.chunks.iter().map(|c| c.len()).max().unwrap_or(0);
        let known = r
            .frames
            .iter()
            .all(|f| f.buffers.iter().flatten().all(|c| c.values.is_some() || c.kind == ChunkKind::Empty));
        RingLayout::new(r.world(), r.chunks.len(), max_chunk, known)
    });
    let layout = StoredValue::new(layout);
    let (width, height) = layout.with_value(|l| (l.width, l.height));
    view! {
        <svg
            id="ring"
            class="chart ring"
            viewBox=format!("0 0 {width:.0} {height:.0}")
            preserveAspectRatio="xMidYMid meet"
            // Drawn at most 1.3 times its size, so that text keeps about the same size whatever W is.
            style=format!("max-width: {:.0}px; margin: 0 auto", width * 1.3)
            role="img"
            aria-label="the ring of ranks with their buffers"
            data-frame=move || frame.get().to_string()
        >
            <defs>
                <marker id="arrow-rs" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
                    <path d="M0 0 L10 5 L0 10 z" class="arrowhead-rs"></path>
                </marker>
                <marker id="arrow-ag" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse">
                    <path d="M0 0 L10 5 L0 10 z" class="arrowhead-ag"></path>
                </marker>
            </defs>
            <rect class="chart-bg" x="0" y="0" width=format!("{width:.0}") height=format!("{height:.0}")></rect>
            {move || {
                let k = frame.get();
                replay.with_value(|r| layout.with_value(|l| draw(r, l, k)))
            }}
        </svg>
    }
}

fn draw(replay: &Replay, l: &RingLayout, k: usize) -> AnyView {
    let Some(f) = replay.frames.get(k) else { return ().into_any() };
    let w = replay.world();
    let ranks = &replay.info.ranks;
    let (cx, cy) = l.center;
    let (phase, step) = match f.phase {
        None => ("before the first step".to_string(), "every rank holds its own input".to_string()),
        Some(_) if f.level != Level::Whole => {
            let label = replay.phase_label(k);
            let step = label.split_once(": ").map_or(label.clone(), |(_, step)| step.to_string());
            (level_name(f.level).to_string(), step)
        }
        Some(RingPhase::ReduceScatter) => {
            ("reduce-scatter".into(), format!("step {} of {}", f.step + 1, replay.rs_steps))
        }
        Some(RingPhase::AllGather) => ("all-gather".into(), format!("step {} of {}", f.step + 1, replay.ag_steps)),
        Some(RingPhase::Reduce) => ("reduce".into(), format!("step {} of {}", f.step + 1, replay.rs_steps)),
        Some(RingPhase::Broadcast) => ("broadcast".into(), format!("step {} of {}", f.step + 1, replay.ag_steps)),
        Some(RingPhase::PointToPoint) => (String::new(), String::new()),
        Some(RingPhase::Exchange) => ("all-to-all".into(), format!("step {} of {}", f.step + 1, replay.ag_steps)),
    };
    let direction = match replay.info.schedule {
        Schedule::Ring => ["every rank sends to its", "right neighbour (clockwise)"],
        Schedule::WholeBuffers => ["whole buffers between", "two ranks at a time"],
        Schedule::Hierarchical => ["rings inside nodes, a ring", "across their first ranks"],
        Schedule::Exchange => ["every rank sends to the rank", "k places on, k = 1 .. W-1"],
    };
    let ring_circle = view! {
        <circle class="ring-track" cx=format!("{cx:.1}") cy=format!("{cy:.1}") r=format!("{:.1}", l.radius)></circle>
        <text class="ring-phase-title" x=format!("{cx:.1}") y=format!("{:.1}", cy - 6.0) text-anchor="middle">{phase}</text>
        <text class="ring-phase-step" x=format!("{cx:.1}") y=format!("{:.1}", cy + 16.0) text-anchor="middle">{step}</text>
        <text class="ring-direction" x=format!("{cx:.1}") y=format!("{:.1}", cy + 40.0) text-anchor="middle">{direction[0]}</text>
        <text class="ring-direction" x=format!("{cx:.1}") y=format!("{:.1}", cy + 55.0) text-anchor="middle">{direction[1]}</text>
    };
    let arrows = draw_arrows(f, l, ranks, replay.info.schedule, replay.chunks.len());
    let cards = (0..w).map(|p| draw_card(replay, f, l, p, replay.formula_bytes_of(p))).collect_view();
    view! { <g>{ring_circle}</g> <g class="cards">{cards}</g> <g class="arrows">{arrows}</g> }.into_any()
}

fn draw_arrows(f: &Frame, l: &RingLayout, ranks: &[u32], schedule: Schedule, chunks: usize) -> impl IntoView {
    f.transfers
        .iter()
        .map(|t| {
            let a = l.arrows.iter().find(|a| a.from == t.from && a.to == t.to).cloned().unwrap_or_else(|| l.chord(t.from, t.to));
            let (class, marker) = if t.reduce { ("ring-arrow rs", "url(#arrow-rs)") } else { ("ring-arrow ag", "url(#arrow-ag)") };
            let what = match schedule {
                Schedule::Ring => Carried::Chunk,
                Schedule::Exchange => Carried::ItsChunk,
                _ if t.covers.len() == chunks => Carried::Buffer,
                _ => Carried::Chunk,
            };
            let (head, values) = transfer_label(t, ranks, what);
            let chars = head.chars().count().max(values.as_ref().map(|v| v.chars().count()).unwrap_or(0));
            let lw = (chars as f64 * 7.0 + 16.0).max(90.0);
            let lh = if values.is_some() { LABEL_H } else { 20.0 };
            let (x, y) = a.label;
            view! {
                <g class="transfer" data-from=t.from.to_string() data-to=t.to.to_string() data-chunk=t.chunk.to_string()>
                    <path class=class d=a.path.clone() marker-end=marker></path>
                    <rect class=if t.reduce { "arrow-label rs" } else { "arrow-label ag" } x=format!("{:.1}", x - lw / 2.0) y=format!("{:.1}", y - lh / 2.0)
                        width=format!("{lw:.1}") height=format!("{lh:.1}") rx="5"></rect>
                    <text class="arrow-text" x=format!("{x:.1}") y=format!("{:.1}", y - lh / 2.0 + 14.0) text-anchor="middle">{head}</text>
                    {values.map(|v| view! {
                        <text class="arrow-values" x=format!("{x:.1}") y=format!("{:.1}", y - lh / 2.0 + 29.0) text-anchor="middle">{v}</text>
                    })}
                </g>
            }
        })
        .collect_view()
}

fn draw_card(replay: &Replay, f: &Frame, l: &RingLayout, p: usize, formula: f64) -> impl IntoView {
    let w = replay.world();
    let ranks = &replay.info.ranks;
    let (x, y) = l.cards[p];
    let sent = f.bytes_sent[p];
    let share = if formula > 0.0 { (sent as f64 / formula).min(1.0) } else { 0.0 };
    let bar_w = l.card_w - 2.0 * PAD;
    let chunks = f.buffers[p]
        .iter()
        .enumerate()
        .map(|(c, chunk)| {
            let (cx, cy) = l.chunk_origin(p, c);
            let mut class = format!("chunk {}", chunk.kind.class());
            if chunk.received {
                class.push_str(" received");
            }
            if chunk.sent {
                class.push_str(" sending");
            }
            let fill = chunk_fill(chunk, w);
            let title = chunk_title(replay, p, c, chunk);
            let mid = cx + l.chunk_w / 2.0;
            let dark = matches!(chunk.kind, ChunkKind::Complete);
            let text_class = if dark { "chunk-text on-dark" } else { "chunk-text" };
            let body = if l.show_values {
                chunk
                    .values
                    .as_ref()
                    .map(|v| {
                        v.iter()
                            .enumerate()
                            .map(|(i, &x)| view! {
                                <text class=format!("{text_class} chunk-value") x=format!("{mid:.1}")
                                    y=format!("{:.1}", cy + CHUNK_TITLE_H + (i as f64 + 0.8) * LINE_H) text-anchor="middle">{format::value(x)}</text>
                            })
                            .collect_view()
                            .into_any()
                    })
                    .unwrap_or_else(|| ().into_any())
            } else {
                let len = replay.chunks[c].len();
                let text = if chunk.kind == ChunkKind::Empty {
                    String::new()
                } else if l.chunk_w >= 70.0 {
                    format!("{len} el · {}", format::bytes(len as f64 * 4.0))
                } else if l.chunk_w >= 40.0 {
                    format!("{} el", format::si(len as f64))
                } else {
                    format::si(len as f64)
                };
                view! {
                    <text class=format!("{text_class} chunk-size") x=format!("{mid:.1}") y=format!("{:.1}", cy + CHUNK_TITLE_H + 0.8 * LINE_H)
                        text-anchor="middle">{text}</text>
                }
                .into_any()
            };
            let values_attr = chunk.values.as_ref().map(|v| numbers(v));
            let label = if l.chunk_w >= 46.0 { format!("chunk {c}") } else { format!("c{c}") };
            view! {
                <g class="chunk-g" data-rank=ranks[p].to_string() data-chunk=c.to_string() data-kind=chunk.kind.class() data-values=values_attr>
                    <rect class=class x=format!("{cx:.1}") y=format!("{cy:.1}") width=format!("{:.1}", l.chunk_w) height=format!("{:.1}", l.chunk_h)
                        rx="4" style=fill.map(|f| format!("fill: {f}"))>
                        <title>{title}</title>
                    </rect>
                    <text class=format!("{text_class} chunk-title") x=format!("{mid:.1}") y=format!("{:.1}", cy + 11.0) text-anchor="middle">{label}</text>
                    {body}
                    <text class=format!("{text_class} chunk-badge") x=format!("{mid:.1}") y=format!("{:.1}", cy + l.chunk_h - 5.0)
                        text-anchor="middle">{chunk.badge(ranks)}</text>
                </g>
            }
        })
        .collect_view();
    view! {
        <g class="rank-card" data-rank=ranks[p].to_string() id=format!("ring-rank-{}", ranks[p])>
            <rect class="card-box" x=format!("{x:.1}") y=format!("{y:.1}") width=format!("{:.1}", l.card_w) height=format!("{:.1}", l.card_h) rx="8"></rect>
            <text class="card-title" x=format!("{:.1}", x + PAD) y=format!("{:.1}", y + 16.0)>{format!("rank {}", ranks[p])}</text>
            <text class="card-bytes" x=format!("{:.1}", x + l.card_w - PAD) y=format!("{:.1}", y + 16.0) text-anchor="end"
                data-sent=sent.to_string()>
                {format!("sent {} / {}", format::bytes(sent as f64), format::bytes(formula))}
            </text>
            <rect class="bytes-track" x=format!("{:.1}", x + PAD) y=format!("{:.1}", y + HEADER_H) width=format!("{bar_w:.1}") height=BAR_H.to_string() rx="2"></rect>
            <rect class="bytes-fill" x=format!("{:.1}", x + PAD) y=format!("{:.1}", y + HEADER_H) width=format!("{:.1}", bar_w * share) height=BAR_H.to_string() rx="2"></rect>
            {chunks}
        </g>
    }
}

/// The hover text of a chunk: where it is, what it holds, its numbers.
fn chunk_title(replay: &Replay, p: usize, c: usize, chunk: &ChunkState) -> String {
    let ranks = &replay.info.ranks;
    let range = &replay.chunks[c];
    let holds: Vec<String> =
        chunk.holds.iter().enumerate().filter(|(_, &h)| h).map(|(q, _)| format!("r{}", ranks[q])).collect();
    let what = match chunk.kind {
        ChunkKind::Empty => "empty: not received yet".to_string(),
        ChunkKind::Own => "this rank's own data, untouched".to_string(),
        ChunkKind::Partial => format!("partial sum of {}", holds.join(" + ")),
        ChunkKind::Complete => format!("complete sum of all {} ranks", replay.world()),
        ChunkKind::Gathered => format!("copy received (all-gather, broadcast; holds {})", holds.join(" + ")),
    };
    let mut text = format!(
        "rank {}, chunk {c}: elements {}..{} ({} B) — {what}",
        ranks[p],
        range.start,
        range.end,
        range.len() * 4
    );
    if let Some(v) = &chunk.values {
        text.push_str(&format!("\n[{}]", numbers(v)));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overlaps(a: (f64, f64), b: (f64, f64), w: f64, h: f64) -> bool {
        a.0 < b.0 + w && b.0 < a.0 + w && a.1 < b.1 + h && b.1 < a.1 + h
    }

    #[test]
    fn cards_and_arrows_fit_without_overlapping() {
        for world in 2..=12 {
            for (len, values) in [(4, true), (40, true), (1000, false)] {
                let l = RingLayout::new(world, world, len, values);
                assert_eq!(l.cards.len(), world);
                assert_eq!(l.arrows.len(), world);
                for (i, &a) in l.cards.iter().enumerate() {
                    assert!(
                        a.0 >= 0.0 && a.1 >= 0.0 && a.0 + l.card_w <= l.width && a.1 + l.card_h <= l.height,
                        "W={world}: card {i} outside"
                    );
                    for &b in &l.cards[i + 1..] {
                        assert!(!overlaps(a, b, l.card_w, l.card_h), "W={world}: cards overlap");
                    }
                }
                for a in &l.arrows {
                    assert_eq!(a.to, (a.from + 1) % world);
                    // The arrow starts outside its own card and ends outside the next one.
                    for p in [a.start, a.end] {
                        for &c in &l.cards {
                            assert!(!inside(p, c, l.card_w, l.card_h, 0.0), "W={world}: arrow end inside a card");
                        }
                    }
                    assert!(a.label.0 > 0.0 && a.label.0 < l.width && a.label.1 > 0.0 && a.label.1 < l.height);
                    assert!(a.path.starts_with('M') && a.path.contains(" A"));
                }
                // Chunks sit inside their card.
                let (x, y) = l.chunk_origin(world - 1, world - 1);
                let (cx, cy) = l.cards[world - 1];
                assert!(x + l.chunk_w <= cx + l.card_w && y + l.chunk_h <= cy + l.card_h + 1e-9);
                assert!(l.chunk_origin(0, 0).0 >= l.cards[0].0);
            }
        }
    }

    #[test]
    fn whole_buffers_get_one_box_and_straight_arrows_between_any_two_cards() {
        for world in 2..=8 {
            let l = RingLayout::new(world, 1, 6, true);
            let (x, _) = l.chunk_origin(0, 0);
            assert!(
                x >= l.cards[0].0 && x + l.chunk_w <= l.cards[0].0 + l.card_w + 1e-9,
                "W={world}: one box fills the card"
            );
            for from in 0..world {
                for to in (0..world).filter(|&t| t != from) {
                    let a = l.chord(from, to);
                    assert!(
                        !inside(a.start, l.cards[from], l.card_w, l.card_h, 0.0),
                        "W={world}: {from}->{to} starts inside"
                    );
                    assert!(
                        !inside(a.end, l.cards[to], l.card_w, l.card_h, 0.0),
                        "W={world}: {from}->{to} ends inside"
                    );
                    assert!(a.path.starts_with('M') && a.path.contains(" L"));
                }
            }
        }
    }

    #[test]
    fn numbers_only_when_they_fit() {
        assert!(RingLayout::new(4, 4, 4, true).show_values);
        assert_eq!(RingLayout::new(4, 4, 4, true).value_lines, 4);
        assert!(!RingLayout::new(4, 4, 4, false).show_values, "no numbers recorded");
        assert!(!RingLayout::new(4, 4, 40, true).show_values, "too many per chunk");
        assert!(!RingLayout::new(8, 8, 2, true).show_values, "too many ranks");
        // Rank 0 at the top, rank 1 to its right (clockwise).
        let l = RingLayout::new(4, 4, 4, true);
        assert!(l.cards[0].1 < l.cards[1].1 && l.cards[1].0 > l.cards[0].0);
        assert!(l.cards[2].1 > l.cards[1].1 && l.cards[3].0 < l.cards[0].0);
    }

    #[test]
    fn partial_sums_deepen_with_contributions() {
        let green = |c: String| u8::from_str_radix(&c[3..5], 16).unwrap();
        assert_eq!(partial_fill(2, 4), "#facf81");
        assert!(green(partial_fill(3, 4)) < green(partial_fill(2, 4)));
        assert!(green(partial_fill(7, 8)) < green(partial_fill(6, 8)));
    }
}
