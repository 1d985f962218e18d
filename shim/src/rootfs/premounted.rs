//! A rootfs that someone else mounted before the shim ran: dockerd's
//! overlay2 graphdriver mounts the container's overlay on its own
//! `…/merged` directory, names it as the spec's root, and passes containerd
//! no rootfs mounts. The shim adopts it as the overlay it is, so that the
//! overlay-copy backend can snapshot its upper directory and a rollback can
//! unmount and mount it again with the same options.

use std::path::Path;

use containerd_shim::protos::api::Mount;

/// Overlay options the shim gives back as they were; a mount with any
/// other (an SELinux `context=`, say) is not adopted.
const KNOWN: &[&str] = &[
    "lowerdir",
    "upperdir",
    "workdir",
    "index",
    "redirect_dir",
    "metacopy",
    "xino",
    "userxattr",
    "volatile",
    "nfs_export",
    "uuid",
];

/// The overlay mounted on `root`, as a mount the shim can make again, if
/// `root` is the mount point of a whole overlay that it can.
pub(super) fn overlay_at(root: &Path) -> Option<Mount> {
    let mounts = procfs::process::Process::myself().ok()?.mountinfo().ok()?;
    let on_root = mounts.into_iter().rev().find(|m| m.mount_point == root)?;
    if on_root.fs_type != "overlay" || on_root.root != "/" {
        return None;
    }
    match overlay_mount(&on_root.super_options) {
        Ok(m) => Some(m),
        Err(why) => {
            tracing::warn!("the overlay on {} is not adopted: {why}", root.display());
            None
        }
    }
}

/// A mount of type overlay with `options` (the kernel shows the options it
/// was given that differ from its defaults; `rw`/`ro` are the mount's), or
/// why the shim cannot make it again.
fn overlay_mount(options: &std::collections::HashMap<String, Option<String>>) -> Result<Mount, String> {
    let mut kept = Vec::new();
    for (k, v) in options {
        match (k.as_str(), v) {
            ("rw" | "ro", _) => {}
            (k, _) if !KNOWN.contains(&k) => return Err(format!("option {k}")),
            ("lowerdir" | "upperdir" | "workdir", Some(dirs))
                if !dirs.split(':').all(|d| Path::new(d).is_absolute()) =>
            {
                return Err(format!("relative {k} {dirs}"));
            }
            (k, Some(v)) => kept.push(format!("{k}={v}")),
            (k, None) => kept.push(k.to_owned()),
        }
    }
    if !["lowerdir=", "upperdir=", "workdir="]
        .iter()
        .all(|o| kept.iter().any(|k| k.starts_with(o)))
    {
        return Err("no upper directory".to_owned());
    }
    kept.sort();
    Ok(Mount {
        type_: "overlay".to_owned(),
        source: "overlay".to_owned(),
        options: kept,
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(list: &[(&str, Option<&str>)]) -> std::collections::HashMap<String, Option<String>> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.map(str::to_owned)))
            .collect()
    }

    const DOCKER: &[(&str, Option<&str>)] = &[
        ("rw", None),
        ("lowerdir", Some("/d/l/A:/d/l/B")),
        ("upperdir", Some("/d/x/diff")),
        ("workdir", Some("/d/x/work")),
        ("index", Some("off")),
    ];

    #[test]
    fn refuses_what_it_could_not_mount_again() {
        let mut selinux = DOCKER.to_vec();
        selinux.push(("context", Some("system_u:object_r:container_file_t:s0:c1")));
        assert!(overlay_mount(&options(&selinux)).is_err());
        let mut relative = DOCKER.to_vec();
        relative[1] = ("lowerdir", Some("l/A:l/B"));
        assert!(overlay_mount(&options(&relative)).is_err());
        assert!(overlay_mount(&options(&DOCKER[..2])).is_err());
    }

    #[test]
    fn keeps_the_overlay_options_and_drops_the_mount_flags() {
        let m = overlay_mount(&options(DOCKER)).unwrap();
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
