//! Which kernels of a program may wait: reach `__syncthreads` or a warp shuffle, in their
//! own body or in a device function they call (at any depth). A kernel that never waits
//! runs each CUDA thread to its end in one go, with no fiber to switch to and from
//! (`kernels/runtime.h`, `run_block_directly`): the same threads in the same order, at a
//! fraction of the cost for the elementwise kernels, which are most launches.
//!
//! Read from the source text, not compiled: every function defined with `__device__` or
//! `__global__`, its body up to the matching brace, and in it the built-ins that wait and
//! the names of functions that do. Wherever the text is not that simple (a macro that waits,
//! braces that do not match), every kernel is taken to wait. And should a kernel taken not
//! to wait reach a barrier after all, the launch fails saying so: never a wrong result.

use std::collections::BTreeSet;

/// The built-ins a CUDA thread waits at (the shuffles by their common prefix).
const WAITS: [&str; 2] = ["__syncthreads", "__shfl"];

/// The names of `kernels` (of `source`) that may wait; all of them where the source cannot
/// be read that simply.
pub fn kernels_that_wait(source: &str, kernels: &[String]) -> BTreeSet<String> {
    let everything = || kernels.iter().cloned().collect();
    let code = without_comments(source);
    if code.lines().any(|l| l.trim_start().starts_with("#define") && WAITS.iter().any(|w| l.contains(w))) {
        return everything();
    }
    let Some(functions) = functions(&code) else { return everything() };
    // The functions that wait: those that call a built-in that does, then, until nothing
    // changes, those that call one of them.
    let mut waiting: BTreeSet<&str> = BTreeSet::new();
    loop {
        let before = waiting.len();
        for (name, body) in &functions {
            if WAITS.iter().any(|w| calls(body, w, true)) || waiting.iter().any(|w| calls(body, w, false)) {
                waiting.insert(name);
            }
        }
        if waiting.len() == before {
            break;
        }
    }
    kernels
        .iter()
        .filter(|k| waiting.contains(k.as_str()) || !functions.iter().any(|(n, _)| n == *k))
        .cloned()
        .collect()
}

/// The source with its comments blanked out (a brace or a name in one counts for nothing).
fn without_comments(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find('/') {
        out.push_str(&rest[..at]);
        let tail = &rest[at..];
        if tail.starts_with("//") {
            rest = tail.find('\n').map_or("", |end| &tail[end..]);
        } else if let Some(comment) = tail.strip_prefix("/*") {
            rest = comment.find("*/").map_or("", |end| &comment[end + 2..]);
            out.push(' ');
        } else {
            out.push('/');
            rest = &tail[1..];
        }
    }
    out.push_str(rest);
    out
}

/// Every function defined with `__device__` or `__global__`: its name and body (a name
/// defined more than once, as overloads, appears once per definition). None where a body's
/// braces do not match.
fn functions(code: &str) -> Option<Vec<(String, &str)>> {
    let mut found = Vec::new();
    let mut at = 0;
    while let Some(next) = ["__device__", "__global__"].iter().filter_map(|q| code[at..].find(q)).min() {
        let start = at + next;
        at = start + "__device__".len();
        let Some(open) = code[at..].find('(').map(|i| at + i) else { break };
        let head = code[..open].trim_end();
        let name = &head[head.rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).map_or(0, |i| i + 1)..];
        let close = open + matching(&code[open..], '(', ')')?;
        // A definition's body follows its parameters; a declaration ends at `;`.
        let after = &code[close + 1..];
        let Some(body_at) = after.find(['{', ';']) else { break };
        if after.as_bytes()[body_at] == b';' {
            at = close + 1;
            continue;
        }
        let body_start = close + 1 + body_at;
        let body_end = body_start + matching(&code[body_start..], '{', '}')?;
        found.push((name.to_string(), &code[body_start..=body_end]));
        at = body_end + 1;
    }
    Some(found)
}

/// The offset in `text` (which starts with `open`) of the `close` that matches it.
fn matching(text: &str, open: char, close: char) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        if c == open {
            depth += 1;
        } else if c == close {
            depth = depth.checked_sub(1)?;
            if depth == 0 {
                return Some(i);
            }
        }
    }
    None
}

/// Whether `body` names `name` as a call (followed by `(` or a template's `<`), or, with
/// `prefix`, names anything that starts with it.
fn calls(body: &str, name: &str, prefix: bool) -> bool {
    body.match_indices(name).any(|(i, _)| {
        let before_ok = body[..i].chars().next_back().is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_'));
        let after = &body[i + name.len()..];
        let after_ok = if prefix { true } else { after.trim_start().starts_with(['(', '<']) };
        before_ok && after_ok
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    const PROGRAM: &str = r#"
#define BLOCK 256
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
// block_sum waits through warp_sum; its comment names __syncthreads { for nothing
__device__ float block_sum(float x, float* shared) { x = warp_sum (x); return x; }
__device__ float half(float x);
__device__ float half(float x) { return x / 2; }
template <class T> __device__ T twice(T x) { return x + x; }
extern "C" __global__ void scale(float* x) { x[threadIdx.x] = twice<float>(half(x[threadIdx.x])); }
extern "C" __global__ void norm(float* x, float* s) { x[0] = block_sum(x[threadIdx.x], s); }
extern "C" __global__ void barrier(float* x) { if (x) { __syncthreads(); } }
/* a kernel in a comment: __global__ void gone() { __syncthreads(); } */
extern "C" __global__ void warp_sum_of_x(float* x) { float warp_sum_ = 0; x[0] = warp_sum_; }
"#;

    #[test]
    fn a_kernel_waits_when_it_or_anything_it_calls_reaches_a_barrier_or_a_shuffle() {
        let kernels = names(&["scale", "norm", "barrier", "warp_sum_of_x"]);
        let waiting = kernels_that_wait(PROGRAM, &kernels);
        assert_eq!(waiting, ["barrier", "norm"].iter().map(|s| s.to_string()).collect());
    }

    #[test]
    fn every_kernel_waits_where_the_source_is_not_simple_to_read() {
        let kernels = names(&["scale", "norm", "barrier", "warp_sum_of_x"]);
        let all: BTreeSet<String> = kernels.iter().cloned().collect();
        let with_macro = format!("#define SYNC __syncthreads()\n{PROGRAM}");
        assert_eq!(kernels_that_wait(&with_macro, &kernels), all);
        let unbalanced = format!("{PROGRAM}\n__device__ float broken(float x) {{ return x;");
        assert_eq!(kernels_that_wait(&unbalanced, &kernels), all);
        // A kernel the reading did not find is taken to wait.
        assert!(kernels_that_wait(PROGRAM, &names(&["elsewhere"])).contains("elsewhere"));
    }
}
