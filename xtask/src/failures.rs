//! `cargo test`'s output passed through as it comes, with the failing tests' reports kept
//! and printed again at the end: a run prints thousands of lines (the servers' logs among
//! them), and whoever reads only its tail still sees what failed and why.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

/// The lines kept of each failing test's report, backtraces left out: its first ones, where
/// the error or the panic's message is (a test returning `Err` prints it first).
const LINES_PER_TEST: usize = 60;

/// Runs `cmd` (a `cargo test`), echoing its standard output line by line; when it fails,
/// prints every failing test's report again, last.
pub fn run(cmd: &mut Command) -> Result<ExitStatus> {
    // A process a test left behind may hold the pipe open: its output is not waited for
    // longer than this once cargo is done.
    let (status, reports) = run_reading_reports(cmd, Duration::from_secs(10), std::io::stdout())?;
    if !status.success() && !reports.is_empty() {
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "\nxtask: {} failing test(s), their reports again:", reports.len());
        for test in &reports {
            let _ = writeln!(out, "\n---- {} ----", test.name);
            let lines = without_backtraces(&test.lines);
            for line in lines.iter().take(LINES_PER_TEST) {
                let _ = writeln!(out, "{line}");
            }
            if lines.len() > LINES_PER_TEST {
                let _ = writeln!(out, "({} more lines left out)", lines.len() - LINES_PER_TEST);
            }
        }
    }
    Ok(status)
}

/// Runs `cmd`, passing its standard output through as bytes into `echo`, and returns its status and
/// the failing tests' reports read by the time it ended (and `patience` after, while
/// something else still writes into the pipe).
fn run_reading_reports(
    cmd: &mut Command,
    patience: Duration,
    mut echo: impl Write + Send + 'static,
) -> Result<(ExitStatus, Vec<FailureReport>)> {
    let mut child = cmd.stdout(Stdio::piped()).spawn().context("cannot start cargo test")?;
    let stdout = child.stdout.take().context("cargo test's standard output")?;
    let reports = Arc::new(Mutex::new(FailureReports::default()));
    let reader = {
        let reports = Arc::clone(&reports);
        std::thread::spawn(move || {
            let mut input = BufReader::new(stdout);
            let mut line = Vec::new();
            // (read as text only to find the reports)
            while input.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
                let _ = echo.write_all(&line);
                let text = String::from_utf8_lossy(&line);
                reports.lock().unwrap_or_else(|e| e.into_inner()).read(text.trim_end_matches(['\n', '\r']));
                line.clear();
            }
        })
    };
    let status = child.wait().context("cargo test")?;
    let deadline = Instant::now() + patience;
    while !reader.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let tests = std::mem::take(&mut reports.lock().unwrap_or_else(|e| e.into_inner()).tests);
    Ok((status, tests))
}

/// `lines` without the frames of their backtraces (each the lines after `stack backtrace:`
/// that read `  12: name` or `at file:line`), which say where, not what.
fn without_backtraces(lines: &[String]) -> Vec<&str> {
    let mut in_backtrace = false;
    let mut kept = Vec::new();
    for line in lines {
        let trimmed = line.trim_start();
        let frame = trimmed.starts_with("at ")
            || trimmed.split_once(": ").is_some_and(|(n, _)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()));
        in_backtrace = trimmed.eq_ignore_ascii_case("stack backtrace:") || (in_backtrace && frame);
        if !(in_backtrace && frame) {
            kept.push(line.as_str());
        }
    }
    kept
}

/// One failing test's report, as libtest prints it under `---- NAME stdout ----`.
#[derive(Debug, Default)]
struct FailureReport {
    name: String,
    lines: Vec<String>,
}

/// The reports read so far: libtest prints them after a binary's tests, between a line
/// `failures:` and the list of names that ends with `test result:`.
#[derive(Debug, Default)]
struct FailureReports {
    tests: Vec<FailureReport>,
    in_report: bool,
}

impl FailureReports {
    fn read(&mut self, line: &str) {
        if let Some(name) = line.strip_prefix("---- ").and_then(|l| l.strip_suffix(" stdout ----")) {
            self.tests.push(FailureReport { name: name.to_string(), lines: Vec::new() });
            self.in_report = true;
        } else if line == "failures:" || line.starts_with("test result:") {
            // The second `failures:` starts the list of names; the result ends the binary.
            self.in_report = false;
        } else if self.in_report {
            if let Some(test) = self.tests.last_mut() {
                test.lines.push(line.to_string());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failing run whose report comes through a pipe that a process left behind still
    /// holds open: the status and the report come back after the patience, not after it.
    #[test]
    fn a_report_is_kept_when_a_left_behind_process_holds_the_pipe() {
        let script = "printf 'failures:\\n\\n---- t stdout ----\\nthread panicked\\n\\nfailures:\\n    t\\n'; \
                      (sleep 30 &); exit 101";
        let started = Instant::now();
        let (status, reports) =
            run_reading_reports(Command::new("sh").args(["-c", script]), Duration::from_millis(300), std::io::sink())
                .unwrap();
        assert_eq!(status.code(), Some(101));
        assert!(started.elapsed() < Duration::from_secs(20), "{:?}", started.elapsed());
        assert_eq!(reports.len(), 1);
        assert_eq!((reports[0].name.as_str(), reports[0].lines[0].as_str()), ("t", "thread panicked"));
    }

    #[test]
    fn backtraces_are_left_out_and_causes_kept() {
        let report: Vec<String> = [
            "Error: the pipeline page showed no bubbles",
            "",
            "Caused by:",
            "    0: timed out",
            "",
            "Stack backtrace:",
            "   0: std::backtrace::Backtrace::create",
            "             at ./library/std/src/backtrace.rs:331:13",
            "  41: clone3",
            "note: some note",
        ]
        .map(String::from)
        .into();
        assert_eq!(
            without_backtraces(&report),
            [
                "Error: the pipeline page showed no bubbles",
                "",
                "Caused by:",
                "    0: timed out",
                "",
                "Stack backtrace:",
                "note: some note"
            ]
        );
    }

    #[test]
    fn failing_tests_reports_are_kept_and_the_rest_is_not() {
        let output = "\
running 2 tests
test a ... ok
test b ... FAILED

failures:

---- b stdout ----
some output
thread 'b' panicked at tests/x.rs:3:5:
timed out

failures:
    b

test result: FAILED. 1 passed; 1 failed
running 1 test
test c ... ok
test result: ok. 1 passed; 0 failed";
        let mut reports = FailureReports::default();
        for line in output.lines() {
            reports.read(line);
        }
        assert_eq!(reports.tests.len(), 1);
        assert_eq!(reports.tests[0].name, "b");
        assert_eq!(reports.tests[0].lines, ["some output", "thread 'b' panicked at tests/x.rs:3:5:", "timed out", ""]);
    }
}
