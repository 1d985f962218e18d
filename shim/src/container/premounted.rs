//! A rootfs that someone else mounted before the shim ran: dockerd's
//! overlay2 graphdriver mounts the container's overlay on its own
//! `…/merged` directory, names it as the spec's root, and passes containerd
//! no rootfs mounts. The shim adopts it as the overlay it is, so that the
//! overlay-copy backend can snapshot its upper directory and a rollback can
//! unmount and mount it again with the same options.

use std::path::Path;

use containerd_shim::protos::api::Mount;

/// The overlay mounted on `root`, as a mount the shim can make again, if
/// `root` is an overlay mount point.
pub(super) fn overlay_at(root: &Path) -> Option<Mount> {
    let mounts = procfs::process::Process::myself().ok()?.mountinfo().ok()?;
    let on_root = mounts.into_iter().rev().find(|m| m.mount_point == root)?;
    (on_root.fs_type == "overlay").then(|| overlay_mount(&on_root.super_options))
}

/// A mount of type overlay with `options` (the kernel shows the options it
/// was given that differ from its defaults; `rw`/`ro` are the mount's).
fn overlay_mount(options: &std::collections::HashMap<String, Option<String>>) -> Mount {
    let mut options: Vec<String> = options
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "rw" | "ro"))
        .map(|(k, v)| match v {
            Some(v) => format!("{k}={v}"),
            None => k.clone(),
        })
        .collect();
    options.sort();
    Mount {
        type_: "overlay".to_owned(),
        source: "overlay".to_owned(),
        options,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_overlay_options_and_drops_the_mount_flags() {
        let options = [
            ("rw", None),
            ("lowerdir", Some("/d/l/A:/d/l/B")),
            ("upperdir", Some("/d/x/diff")),
            ("workdir", Some("/d/x/work")),
            ("index", Some("off")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.map(str::to_owned)))
        .collect();
        let m = overlay_mount(&options);
        assert_eq!(m.type_, "overlay");
        assert_eq!(
            m.options,
            [
                "index=off",
                "lowerdir=/d/l/A:/d/l/B",
                "upperdir=/d/x/diff",
                "workdir=/d/x/work"
            ]
        );
    }
}
