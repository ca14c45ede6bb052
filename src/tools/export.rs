//! `ckpt export` and `ckpt import`'s shared part: one consolidated safetensors file.
//!
//! Export writes every (selected) tensor whole into one standard safetensors file,
//! the form Hugging Face tools load, streaming dim-0 slabs from the checkpoint, with
//! an optional float conversion. The file is written beside its final name and
//! renamed into place after an fsync, so a failed export never leaves a torn file.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use ckpt_storage::Store;
use serde::Serialize;

use super::convert::convert_floats;
use super::{glob_match, slab_rows, slabs};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::format::build_safetensors_header;
use crate::load::{CheckpointReader, LoadRequest};
use crate::region::Region;

/// Settings of an export.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Tensors whose name matches this glob. Default `*`.
    pub tensors: String,
    /// Convert float tensors to this dtype (F32, F16 or BF16); others stay as saved.
    pub dtype: Option<DType>,
    /// Bytes of tensor data held at once. Default 512 MiB.
    pub memory_budget: u64,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self {
            tensors: "*".to_string(),
            dtype: None,
            memory_budget: 512 << 20,
        }
    }
}

/// What an export wrote.
#[derive(Debug, Clone, Serialize)]
pub struct ExportReport {
    /// The step exported.
    pub step: u64,
    /// The file written.
    pub path: String,
    /// Tensors written.
    pub tensors: usize,
    /// Size of the file.
    pub bytes: u64,
}

/// Exports the checkpoint `reader` opened on `source` into the safetensors file
/// `out`. Every data file read is checked first (its header included), so nothing is
/// written from a checkpoint `verify` rejects.
pub async fn export(
    source: &Store,
    reader: &CheckpointReader,
    out: &Path,
    options: &ExportOptions,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<ExportReport> {
    let manifest = reader.manifest();
    if let Some(dtype) = options.dtype
        && !matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
    {
        return Err(Error::invalid(format!(
            "--dtype must be f32, f16 or bf16, not {dtype}"
        )));
    }
    let selected: Vec<_> = manifest
        .tensors
        .iter()
        .filter(|t| glob_match(&options.tensors, &t.name))
        .collect();
    if selected.is_empty() {
        return Err(Error::NotFound(format!(
            "no tensor of step {} matches {:?} ({} tensors)",
            manifest.step,
            options.tensors,
            manifest.tensors.len()
        )));
    }
    super::check_data_headers(source, reader, selected.iter().copied()).await?;
    let out_dtype = |dtype: DType| match options.dtype {
        Some(to) if dtype.is_float() => to,
        _ => dtype,
    };
    let entries: Vec<_> = selected
        .iter()
        .map(|t| (t.name.clone(), out_dtype(t.dtype), t.shape.clone()))
        .collect();
    let mut metadata = BTreeMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    metadata.insert("ckpt.step".to_string(), manifest.step.to_string());
    let header = build_safetensors_header(&entries, &metadata);

    let file_name = out
        .file_name()
        .ok_or_else(|| Error::invalid(format!("{} is not a file path", out.display())))?;
    let tmp = out.with_file_name(format!(".{}.partial", file_name.to_string_lossy()));
    let io_err =
        |what: &str, e: std::io::Error| Error::Failed(format!("{what} {}: {e}", tmp.display()));
    let file = std::fs::File::create(&tmp).map_err(|e| io_err("cannot create", e))?;
    let mut writer = std::io::BufWriter::with_capacity(8 << 20, file);
    let result = async {
        writer
            .write_all(&header)
            .map_err(|e| io_err("cannot write", e))?;
        let mut bytes = header.len() as u64;
        for t in &selected {
            let whole = Region::full(&t.shape);
            let rows = slab_rows(&whole, t.dtype.size(), options.memory_budget.max(1));
            for slab in slabs(&whole, rows) {
                let loaded = reader
                    .load(&LoadRequest::new().tensor(t.name.clone(), slab))
                    .await?;
                let data = &loaded.tensors[0].data;
                let converted;
                let out_bytes: &[u8] = if out_dtype(t.dtype) != t.dtype {
                    converted = convert_floats(t.dtype, out_dtype(t.dtype), data);
                    &converted
                } else {
                    data
                };
                writer
                    .write_all(out_bytes)
                    .map_err(|e| io_err("cannot write", e))?;
                bytes += out_bytes.len() as u64;
                progress(data.len() as u64);
            }
        }
        let file = writer
            .into_inner()
            .map_err(|e| io_err("cannot write", e.into_error()))?;
        file.sync_all().map_err(|e| io_err("cannot fsync", e))?;
        Ok::<u64, Error>(bytes)
    }
    .await;
    let bytes = match result {
        Ok(bytes) => bytes,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, out)
        .map_err(|e| Error::Failed(format!("cannot move {} into place: {e}", out.display())))?;
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty())
        && let Ok(dir) = std::fs::File::open(dir)
    {
        let _ = dir.sync_all();
    }
    Ok(ExportReport {
        step: manifest.step,
        path: out.display().to_string(),
        tensors: selected.len(),
        bytes,
    })
}
