//! vhca-guest: the init of the test guest. Reads options, drives the device once, prints `VHCA-RESULT {json}`,
//! then powers the machine off. Every failure, panics included, still ends in a result line and a power-off.

use std::time::{Duration, Instant};

use vhca_guest::cmdline::Options;
use vhca_guest::report::{progress, Report};
use vhca_guest::run_process::{self, Forked, Next};
use vhca_guest::{agent, bring_up, hotplug_slot, kmsg, roundtrip, shutdown, sys_driver, test_modes};

/// How long a restored guest waits for its hot-plugged device to appear (ACPI hot-plug takes about 0.1 s).
const HOTPLUG_PATIENCE: Duration = Duration::from_secs(5);

fn main() {
    // Off PID 1 (tests on a host, debugging) a command-line argument stands in for /proc/cmdline.
    let cmdline = std::env::args().nth(1).or_else(|| std::fs::read_to_string("/proc/cmdline").ok()).unwrap_or_default();
    if agent::enabled(&cmdline) {
        serve_as_agent(&cmdline)
    }
    serve(&cmdline, Vec::new(), None, false)
}

/// The resident agent: the guest is saved while it waits for its first request; every restore continues from here.
/// Each request is served in a fresh process (`run_process`), and the guest takes another request when the run left
/// it as a fresh restore would be; otherwise it ends as a guest without the agent does.
fn serve_as_agent(cmdline: &str) -> ! {
    // Whichever driver the run asks for: loading vhca.sys here puts the loaded image into the snapshot.
    sys_driver::preload();
    agent::quiet_console();
    // Where runs' HCAs are hot-plugged: the slots empty before any run.
    let slots = hotplug_slot::empty().map_err(|e| e.to_string());
    let mut served = 0u32;
    loop {
        let (request, request_error) =
            match agent::wait_for_request(&mut std::io::stdin().lock(), &mut std::io::stdout()) {
                Ok(request) => (request.params, None),
                Err(e) => (Vec::new(), Some(e.to_string())),
            };
        // The agent's own look at the run's kernel log, and, for a run after the first, the run's (the first sees
        // the whole log, as a run on a fresh guest does).
        let mut agent_log = kmsg::KmsgFollower::from_now();
        let run_log = (served > 0).then(kmsg::KmsgFollower::from_now);
        served += 1;
        let forked = Instant::now();
        let child = match run_process::fork_run() {
            Ok(Forked::Run) => {
                sys_driver::forget_idle_watcher();
                if let Some(log) = run_log {
                    kmsg::scope_to_run(log);
                }
                serve(cmdline, request, request_error, true)
            }
            Ok(Forked::Agent(child)) => child,
            Err(e) => {
                // No process of its own: the run is served here, and the guest ends with it.
                progress(format_args!("cannot fork the run's process ({e}): serving it in the agent"));
                serve(cmdline, request, request_error, true)
            }
        };
        let left = run_process::finish_run(child, &slots, &mut agent_log);
        if let Ok(n) = &left.ejected {
            progress(format_args!(
                "agent: run process {:?}, {n} slot(s) ejected, {} ms after the request",
                left.ending,
                forked.elapsed().as_millis()
            ));
        }
        let options = Options::parse_words(cmdline.split_whitespace().chain(request.iter().map(String::as_str)));
        match run_process::after_run(left.ending, options.poweroff, left.faults, left.ejected) {
            Next::Serve => {}
            Next::End { why } => {
                progress(format_args!("agent: the guest ends here: {why}"));
                shutdown::end_machine(options.poweroff)
            }
            Next::Die { status, why } => {
                progress(format_args!("agent: {why}"));
                std::process::exit(status)
            }
        }
    }
}

/// Serves one run: its options are the kernel command line's words followed by the request's.
fn serve(cmdline: &str, request: Vec<String>, request_error: Option<String>, resident: bool) -> ! {
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
        // The round trip's bench is chosen here, with the modes, and handed to the bring-up it measures.
        None => bring_up::run(&options, patience, &mut report, &mut roundtrip::measure_into),
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
