//! The `postie` binary: parses arguments, loads settings, sets up logging, runs a command.
//!
//! First it fixes glibc's allocator thresholds (a large block mapped on its own and
//! returned when freed: peak memory follows the bodies held). Then it only loads
//! settings and logging, starts the runtime (`worker.threads`; one thread is tokio's
//! current-thread runtime) and runs the command as a task on its workers, never on
//! the main thread, which is outside the worker pool. It scrubs the configured
//! passwords from the last error line, and returns a command's own exit status
//! (`cli::Exit`).

use std::process::ExitCode;

use clap::Parser;
use postie::cli::{self, Cli};
use postie::config::Settings;

fn main() -> ExitCode {
    // First, while this is the only thread.
    fix_allocator_thresholds();
    let cli = Cli::parse();
    let settings = match Settings::load(cli.config.as_deref()) {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("postie: {e}");
            return ExitCode::from(2);
        }
    };
    // Before the runtime: the OTLP exporter runs a blocking client on its own thread.
    // Every password of the settings: scrubbed from each log line and the last word.
    let secrets = settings.passwords();
    let telemetry = match cli::init_telemetry(&settings.log, &settings.otel, secrets.clone()) {
        Ok(guard) => guard,
        Err(e) => {
            eprintln!("postie: configuration error: {e}");
            return ExitCode::from(2);
        }
    };
    // Settings load before logging: what they had to say (old key names) is said now,
    // once, whatever the command.
    for warning in settings.warnings() {
        tracing::warn!("{warning}");
    }
    // One thread: a runtime on this thread alone, where a task woken by another task
    // is polled without a wake-up across threads (no futex, no eventfd).
    let mut runtime = match settings.worker.threads {
        Some(1) => tokio::runtime::Builder::new_current_thread(),
        Some(threads) => {
            let mut runtime = tokio::runtime::Builder::new_multi_thread();
            runtime.worker_threads(threads);
            runtime
        }
        None => tokio::runtime::Builder::new_multi_thread(),
    };
    let runtime = runtime
        .enable_all()
        .build()
        .expect("starting the tokio runtime");
    // The command runs as a task on the runtime's workers, not on this thread:
    // `block_on`'s own future is polled here, outside the worker pool, so a consume
    // loop left on it would hand every delivery across threads (a wake-up each).
    let command = runtime.spawn(cli::run(cli.command, settings, cli.config));
    let result = runtime
        .block_on(command)
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()));
    // The log lines still queued go out before the last word.
    drop(runtime);
    drop(telemetry);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let message = postie::describe_error(&e);
            eprintln!("postie: {}", cli::scrub(&message, &secrets));
            match e.downcast_ref::<cli::Exit>() {
                Some(exit) => ExitCode::from(exit.code),
                None => ExitCode::FAILURE,
            }
        }
    }
}

/// Fixes glibc malloc's mmap and trim thresholds, so that peak memory follows the
/// bodies postie holds and not the allocator's history.
///
/// glibc raises its mmap threshold each time it frees a large mapped block (up to
/// 32 MiB); blocks of that size then come from the heap, and a heap block freed below
/// the heap's top stays resident. A body of tens of MB arrives as frames of 128 KiB
/// that lapin joins into one growing buffer, and its dead-letter copy is split into
/// frames again: with a raised threshold, the first copy's freed growth steps and the
/// frames of the second can each hold memory of their own, so the same 90 MB dead
/// letter peaked at 222 MiB in one run and 286 MiB in another (`tests/gray_memory.rs`).
/// Fixed, every block of 128 KiB or more is a mapping of its own, returned when freed,
/// and at most 4 MiB of free heap top is kept. Blocks that large are rare on the send
/// path (bodies above 128 KiB, the AMQP client's buffers at connect), so this costs no
/// system call per email. Other allocators and platforms are left alone.
fn fix_allocator_thresholds() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets malloc's tunables, to values within glibc's documented
    // ranges, and runs before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 4 * 1024 * 1024);
    }
}
