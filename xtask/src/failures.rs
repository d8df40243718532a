//! `cargo test`'s output passed through as it comes, with the failing tests' reports kept
//! and printed again at the end: a run prints thousands of lines (the servers' logs among
//! them), and whoever reads only its tail still sees what failed and why.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result};

/// The lines kept of each failing test's report: its last ones, where the panic is.
const LINES_PER_TEST: usize = 40;

/// Runs `cmd` (a `cargo test`), echoing its standard output line by line; when it fails,
/// prints every failing test's report again, last.
pub fn run(cmd: &mut Command) -> Result<ExitStatus> {
    let mut child = cmd.stdout(Stdio::piped()).spawn().context("cannot start cargo test")?;
    let stdout = child.stdout.take().context("cargo test's standard output")?;
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let mut reports = FailureReports::default();
        let mut out = std::io::stdout();
        for line in BufReader::new(stdout).lines() {
            // Output that is not UTF-8 is passed through as far as it reads.
            let Ok(line) = line else { continue };
            let _ = writeln!(out, "{line}");
            reports.read(&line);
        }
        let _ = sender.send(reports);
    });
    let status = child.wait().context("cargo test")?;
    // A process a test left behind may hold the pipe open: its output is not waited for.
    let reports = receiver.recv_timeout(Duration::from_secs(10)).unwrap_or_default();
    if !status.success() && !reports.tests.is_empty() {
        println!("\nxtask: {} failing test(s), their reports again:", reports.tests.len());
        for test in &reports.tests {
            println!("\n---- {} ----", test.name);
            let skipped = test.lines.len().saturating_sub(LINES_PER_TEST);
            if skipped > 0 {
                println!("({skipped} earlier lines left out)");
            }
            for line in &test.lines[skipped..] {
                println!("{line}");
            }
        }
    }
    Ok(status)
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
