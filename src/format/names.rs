//! Object names: the step directory, the rank files, and the check that confines
//! every name a manifest or part carries to one segment inside the checkpoint.
//! Kept apart because every other file (and the catalog) needs names, and the
//! confinement rule is what keeps a hostile checkpoint from reading elsewhere.

use super::{FResult, FormatError};

/// Name of the commit object inside a step directory.
pub const MANIFEST: &str = "manifest.json";
/// Name of the hint object at the root (the newest committed step, as text).
pub const LATEST: &str = "latest";

/// Longest run id accepted (it is part of every object name of a save attempt).
pub const MAX_RUN_ID_LEN: usize = 48;

/// Whether `run` is a run id: 1 to [`MAX_RUN_ID_LEN`] ASCII letters, digits, `_` or
/// `-`, safe in an object name on every store. Written here, with the other names,
/// because both the writers of attempts and the parsers of untrusted parts check it.
pub fn is_run_id(run: &str) -> bool {
    !run.is_empty()
        && run.len() <= MAX_RUN_ID_LEN
        && run
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// The directory of one checkpoint: `step-00000120`.
pub fn step_dir(step: u64) -> String {
    format!("step-{step:08}")
}

/// Parses a step directory name back into its step.
pub fn parse_step_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A rank's data file: `rank-00003.safetensors`, or `.safetensors.zst` compressed.
pub fn rank_file_name(rank: u32, compressed: bool) -> String {
    if compressed {
        format!("rank-{rank:05}.safetensors.zst")
    } else {
        format!("rank-{rank:05}.safetensors")
    }
}

/// A rank's part of the manifest: `rank-00003.json`.
pub fn rank_part_name(rank: u32) -> String {
    format!("rank-{rank:05}.json")
}

/// Parses `rank-00003.json` back into its rank.
pub fn parse_rank_part_name(name: &str) -> Option<u32> {
    let digits = name.strip_prefix("rank-")?.strip_suffix(".json")?;
    if digits.len() < 5 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A name inside the checkpoint directory: one path segment, no `..`, no `/`.
pub fn check_object_name(name: &str, object: &str, what: &str) -> FResult<()> {
    let bad = |why: &str| FormatError::new(object, None, format!("{what} {name:?} {why}"));
    if name.is_empty() || name.len() > 255 {
        return Err(bad("must be 1 to 255 bytes long"));
    }
    if name == "." || name == ".." || name.contains("..") {
        return Err(bad("must not contain '..'"));
    }
    if name.contains('/') || name.contains('\\') || name.contains('\0') {
        return Err(bad(
            "must be a plain name inside the checkpoint (no '/', '\\' or NUL)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_confined() {
        for bad in ["", "..", "../x", "a/b", "a\\b", "x\0", "a..b"] {
            assert!(check_object_name(bad, "m", "file").is_err(), "{bad:?}");
        }
        check_object_name("rank-00001.safetensors", "m", "file").unwrap();
    }

    #[test]
    fn step_and_rank_names_round_trip() {
        assert_eq!(parse_step_dir(&step_dir(120)), Some(120));
        assert_eq!(parse_step_dir("step-12"), None);
        assert_eq!(parse_step_dir("step-0000001x"), None);
        assert_eq!(parse_rank_part_name(&rank_part_name(3)), Some(3));
        assert_eq!(parse_rank_part_name("rank-3.json"), None);
    }
}
