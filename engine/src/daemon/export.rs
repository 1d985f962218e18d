//! Export: one verified version of a sandbox as an archive
//! (`crate::archive`), streamed to the caller.

use std::sync::Arc;

use axum::body::Body;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use crab_api::crabd::Registration;
use crab_api::{SandboxSelector, VersionSel};

use super::versions::movable_files;
use super::work::{blocking, blocking_io, detached};
use super::{ApiError, Daemon};
use crab_proxy::transcript::write_new;

use crate::archive;
use crate::containerd::Containerd;

// === impl Daemon ===

impl Daemon {
    /// The archive of version `which` of sandbox `sel`, as a streamed
    /// `application/x-tar` answer.
    pub(super) async fn export(
        self: &Arc<Self>,
        sel: &SandboxSelector,
        which: VersionSel,
    ) -> Result<Response, ApiError> {
        let reg = self.registry.find(sel)?.registration;
        let d = self.clone();
        let file = detached(async move {
            let busy = d.busy(&reg.id);
            let _one_at_a_time = busy.lock().await;
            d.archive_file(&reg, which).await
        })
        .await?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(0);
        let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file));
        Ok((
            [
                (header::CONTENT_TYPE, "application/x-tar".to_owned()),
                (header::CONTENT_LENGTH, len.to_string()),
            ],
            Body::from_stream(stream),
        )
            .into_response())
    }

    /// The archive of version `which` of sandbox `reg`, as an open file
    /// already unlinked (nothing stays behind). The caller holds the
    /// sandbox's lock.
    pub(super) async fn archive_file(
        self: &Arc<Self>,
        reg: &Registration,
        which: VersionSel,
    ) -> Result<std::fs::File, ApiError> {
        let d = self;
        let (v, images_dir) = d.restorable(&reg.id, which).await?;
        let number = v.record.version;
        let fs = movable_files(&v.record)?;
        // The image files: this version's, or those of the one it reuses.
        let images = match v.record.process_image {
            Some(holder) if holder != number => {
                let store = d.store.clone();
                let sid = reg.id.clone();
                blocking(move || store.get(&sid, holder)).await?.record.images
            }
            _ => v.record.images.clone(),
        };
        let template = Containerd::connect(&reg.containerd, &reg.namespace)
            .await?
            .template(reg.id.as_str())
            .await?;
        let conversation = d.version_conversation(reg, &v.record).await;
        let staging = d.staging("export")?;
        let record = v.record.clone();
        let d2 = d.clone();
        blocking_io(move || {
            let io = |op| move |source| ApiError::Io { op, source };
            let stream_path = staging.path().join(archive::FS_STREAM);
            let mut stream =
                std::fs::File::create(&stream_path).map_err(io("create the filesystem stream"))?;
            d2.files.export(&record.sandbox, &fs.name, &mut stream)?;
            let transcript_path = staging.path().join(archive::TRANSCRIPT);
            let transcript = match conversation {
                Some((at, records)) => {
                    match write_new(&transcript_path, record.sandbox.as_str(), records) {
                        Ok(()) => Some((transcript_path.as_path(), at)),
                        Err(e) => {
                            tracing::warn!(error = %crab_api::error_chain(&e), "exported without its conversation");
                            None
                        }
                    }
                }
                None => None,
            };
            let tar_path = staging.path().join("archive.tar");
            let out = std::fs::File::create(&tar_path).map_err(io("create the archive"))?;
            let contents = archive::Contents {
                version: &record,
                container: &template,
                images_dir: &images_dir,
                images: &images,
                fs_name: &fs.name,
                fs_stream: &stream_path,
                transcript,
            };
            archive::pack(std::io::BufWriter::new(out), &contents, |m| d2.signing_key.sign(m))?;
            let file = std::fs::File::open(&tar_path).map_err(io("open the archive"))?;
            // The open file outlives its directory (the guard removes it
            // here, or on any failure above): nothing stays behind.
            drop(staging);
            Ok(file)
        })
        .await
    }
}
