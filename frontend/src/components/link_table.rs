//! The links a run's recorded ring steps used: per link (one rank to the next), the bytes,
//! the steps' time and what that makes per second, and whether it crossed hosts (TCP)
//! rather than staying in one host's shared memory.

use distlab_common::trace::{link_class_bytes, link_uses, ExperimentTrace, LinkUse};
use leptos::prelude::*;

use crate::format;

/// Bytes over busy time of a set of links, in GB/s (None when there are none).
fn gbps_of<'a>(links: impl Iterator<Item = &'a LinkUse>) -> Option<f64> {
    let (bytes, us) = links.fold((0u64, 0u64), |(b, t), l| (b + l.bytes, t + l.busy_us));
    (us > 0).then(|| bytes as f64 / (us as f64 * 1e3))
}

#[component]
pub fn LinkTable(trace: ExperimentTrace) -> impl IntoView {
    let links = link_uses(&trace);
    if links.is_empty() {
        return None;
    }
    // Every call's bytes by where they went (not only the steps recorded in detail).
    let (inside_bytes, across_bytes) = link_class_bytes(&trace);
    let classes = (across_bytes > 0).then(|| {
        format!(
            "Every traced collective of the run, all ranks together: {} sent inside a host, {} across hosts ({:.0}%).",
            format::bytes(inside_bytes as f64),
            format::bytes(across_bytes as f64),
            100.0 * across_bytes as f64 / (inside_bytes + across_bytes).max(1) as f64
        )
    });
    let across = gbps_of(links.iter().filter(|l| l.crosses_hosts));
    let inside = gbps_of(links.iter().filter(|l| !l.crosses_hosts));
    let summary = match (across, inside) {
        (Some(a), Some(i)) => format!("Between hosts {a:.2} GB/s, inside a host {i:.2} GB/s."),
        (Some(a), None) => format!("Every link crossed hosts: {a:.2} GB/s."),
        (None, Some(i)) => format!("All ranks on one host (shared memory): {i:.2} GB/s."),
        (None, None) => String::new(),
    };
    let rows = links
        .into_iter()
        .map(|l| {
            let over = if l.crosses_hosts { "TCP (another host)" } else { "shared memory" };
            view! {
                <tr data-crosses=l.crosses_hosts.to_string() class=if l.crosses_hosts { "crosses" } else { "" }>
                    <td>{format!("rank {} → rank {}", l.from, l.to)}</td>
                    <td>{over}</td>
                    <td class="num">{l.steps}</td>
                    <td class="num">{format::bytes(l.bytes as f64)}</td>
                    <td class="num">{format!("{:.3} ms", l.busy_us as f64 / 1e3)}</td>
                    <td class="num">{format!("{:.2}", l.gbps())}</td>
                </tr>
            }
        })
        .collect_view();
    Some(view! {
        <section class="card" id="links">
            <h2>"Links"</h2>
            <p class="muted small">
                "What each rank sent to each peer in the recorded steps, and the steps' time as the sender measured it "
                "(sending its chunk while it received the next): bytes ÷ step time is what the link delivered under the ring's load. "
                "A step also waits for its incoming chunk, so one slow hop slows every step of the ring; collectives that send "
                "whole buffers (a broadcast, a tree) count as one step. Ranks of one host share memory; between hosts the bytes go over TCP."
            </p>
            <p id="links-summary" data-across=across.map(|g| format!("{g:.3}")) data-inside=inside.map(|g| format!("{g:.3}"))>
                <strong>{summary}</strong>
            </p>
            {classes.map(|text| view! {
                <p id="link-classes" data-inside=inside_bytes.to_string() data-across=across_bytes.to_string()>{text}</p>
            })}
            <table class="data">
                <thead><tr><th>"link"</th><th>"over"</th><th>"steps"</th><th>"bytes"</th><th>"step time"</th><th>"GB/s"</th></tr></thead>
                <tbody>{rows}</tbody>
            </table>
        </section>
    })
}
