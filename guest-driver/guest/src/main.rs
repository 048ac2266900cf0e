//! vhca-guest: the init of the test guest. Reads options, drives the device once, prints `VHCA-RESULT {json}`,
//! then powers the machine off. Every failure, panics included, still ends in a result line and a power-off.

use std::time::{Duration, Instant};

use vhca_guest::cmdline::Options;
use vhca_guest::report::{progress, Report};
use vhca_guest::{agent, bring_up, shutdown, sys_driver, test_modes};

/// How long a restored guest waits for its hot-plugged device to appear (ACPI hot-plug takes about 0.1 s).
const HOTPLUG_PATIENCE: Duration = Duration::from_secs(5);

fn main() {
    // Off PID 1 (tests on a host, debugging) a command-line argument stands in for /proc/cmdline.
    let cmdline = std::env::args().nth(1).or_else(|| std::fs::read_to_string("/proc/cmdline").ok()).unwrap_or_default();
    // As the agent, the guest is saved while it waits here; every restore continues from this call with its own run.
    let resident = agent::enabled(&cmdline);
    let (request, request_error) = if resident {
        // Whichever driver the run asks for: loading vhca.sys here puts the loaded image into the snapshot.
        sys_driver::preload();
        agent::quiet_console();
        match agent::wait_for_request(&mut std::io::stdin().lock(), &mut std::io::stdout()) {
            Ok(request) => (request.params, None),
            Err(e) => (Vec::new(), Some(e.to_string())),
        }
    } else {
        (Vec::new(), None)
    };
    let started = Instant::now();
    let options = Options::parse_words(cmdline.split_whitespace().chain(request.iter().map(String::as_str)));
    if resident {
        progress(format_args!("run request: {}", request.join(" ")));
    }
    let mut report =
        Report { scenario: options.scenario.clone(), warnings: options.warnings.clone(), ..Report::default() };
    for warning in &options.warnings {
        progress(format_args!("warning: {warning}"));
    }
    if let Some(mode) = &options.init {
        test_modes::run(mode, &options);
    }
    let patience = if resident { HOTPLUG_PATIENCE } else { Duration::ZERO };

    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &request_error {
        Some(e) => Err(anyhow::anyhow!("run request: {e}")),
        None => bring_up::run(&options, patience, &mut report),
    }));
    let error = match outcome {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("{e:#}")),
        Err(panic) => {
            let what =
                panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
            Some(format!("panic: {}", what.unwrap_or_else(|| "(no message)".into())))
        }
    };
    report.ok = error.is_none();
    report.error = error;
    report.elapsed_ms = started.elapsed().as_millis() as u64;
    report.uptime_ms = vhca_guest::report::uptime_ms();
    progress(format_args!("{} in {} ms", if report.ok { "passed" } else { "FAILED" }, report.elapsed_ms));
    report.print();
    finish(&options, report.ok);
}

fn finish(options: &Options, ok: bool) -> ! {
    shutdown::finish(options.poweroff, ok)
}
