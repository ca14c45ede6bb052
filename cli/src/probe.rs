//! `ckpt probe`: checks that a store supports everything ckpt needs and prints
//! each step's outcome.

use std::process::ExitCode;

use ckpt::probe::probe;

use crate::exit;
use crate::output::{errln, outln, print_json};
use crate::store::{LibraryDefaults, StoreArgs};

/// Runs `ckpt probe URL`: exit 0 when every step passed, 1 when one failed, 2 when
/// the store cannot be opened.
pub(crate) async fn run_probe(
    url: &str,
    args: &StoreArgs<LibraryDefaults>,
    json: bool,
) -> ExitCode {
    let store = match args.open(url) {
        Ok(store) => store,
        Err(e) => {
            errln!("error: {e}");
            return ExitCode::from(exit::USAGE);
        }
    };
    let report = probe(&store).await;
    if json {
        if !print_json(&report) {
            return ExitCode::from(exit::CHECK_FAILED);
        }
    } else {
        outln!("probe of {}", report.url);
        for step in &report.steps {
            let status = if step.ok { "ok" } else { "FAILED" };
            outln!("  {:<18} {:>6}  {:>9.1} ms", step.step, status, step.ms);
            if let Some(error) = &step.error {
                outln!("    {error}");
            }
        }
    }
    if report.ok() {
        ExitCode::from(exit::OK)
    } else {
        ExitCode::from(exit::CHECK_FAILED)
    }
}
