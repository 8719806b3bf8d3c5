//! The `postie` binary: parses arguments, loads settings, sets up logging, runs a command.

use std::process::ExitCode;

use clap::Parser;
use postie::cli::{self, Cli};
use postie::config::Settings;

fn main() -> ExitCode {
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
    let telemetry =
        match postie::ops::telemetry::init(&settings.log, &settings.otel, secrets.clone()) {
            Ok(guard) => guard,
            Err(e) => {
                eprintln!("postie: configuration error: {e}");
                return ExitCode::from(2);
            }
        };
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
            eprintln!("postie: {}", postie::endpoint::scrub(&message, &secrets));
            ExitCode::FAILURE
        }
    }
}
