//! The images of an evaluation's sandboxes, built once per content into a
//! cache (no registry is reachable): the development sandbox (busybox, the
//! host's /usr bound at run time) plus a SWE task's /testbed
//! (`bench/eval/mktestbed.sh`) or the terminal mix's tools.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context};
use crab_tests::Containerd;

use super::workload::Image;

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures");
const DATA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/eval");

/// Where built images are kept between runs.
pub const CACHE: &str = "/var/cache/crab-bench";

/// Builds (or finds in the cache) the archive of `image`, imports it into
/// `ctd`, and answers its reference.
pub fn import(ctd: &Containerd, image: &Image) -> anyhow::Result<String> {
    let (reference, archive) = archive(image)?;
    let out = ctd.ctr(&["image", "import", &archive.to_string_lossy()]);
    if !out.status.success() {
        bail!(
            "ctr image import {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(reference)
}

/// The reference and archive of `image`, built if not cached.
fn archive(image: &Image) -> anyhow::Result<(String, PathBuf)> {
    let (name, reference, scripts, args): (String, String, &[&str], Vec<String>) = match image {
        Image::Swe { pypi, release, deps } => {
            let lower = pypi.to_lowercase();
            let mut args = vec![pypi.clone(), release.clone()];
            args.extend(deps.iter().map(|(d, v)| format!("{d}=={v}")));
            (
                format!("{lower}-{release}"),
                format!("docker.io/crab/eval-{lower}:{release}"),
                &["mktestbed.sh"],
                args,
            )
        }
        Image::Terminal => (
            "terminal".into(),
            "docker.io/crab/eval-terminal:1".into(),
            &["tools.py"],
            Vec::new(),
        ),
    };
    let mut inputs = vec![
        read(&format!("{FIXTURES}/mkimage.sh"))?,
        read(&format!("{FIXTURES}/mkdevbox.sh"))?,
    ];
    for s in scripts {
        inputs.push(read(&format!("{DATA}/{s}"))?);
    }
    inputs.extend(args.iter().cloned());
    let hash = super::fault::fnv1a(&inputs.join("\0"));
    std::fs::create_dir_all(CACHE).with_context(|| format!("create {CACHE}"))?;
    std::fs::set_permissions(CACHE, std::os::unix::fs::PermissionsExt::from_mode(0o700))?;
    let path = Path::new(CACHE).join(format!("eval-{name}-{hash:016x}.tar"));
    if path.exists() {
        return Ok((reference, path));
    }
    eprintln!("eval: building image {reference} (cached in {CACHE})");
    let work = Path::new(CACHE).join(format!("build-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let devbox = work.join("devbox");
    let extra = work.join("extra");
    run(Command::new(format!("{FIXTURES}/mkdevbox.sh")).arg(&devbox))?;
    match image {
        Image::Swe { .. } => run(Command::new(format!("{DATA}/mktestbed.sh"))
            .arg(&extra)
            .args(&args))?,
        Image::Terminal => {
            std::fs::create_dir_all(extra.join("opt/eval"))?;
            std::fs::copy(format!("{DATA}/tools.py"), extra.join("opt/eval/tools.py"))?;
        }
    }
    // Per process: two evals building the same image at once (two tests
    // on a fresh machine) must not rename each other's archive away.
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    let built = run(Command::new(format!("{FIXTURES}/mkimage.sh"))
        .arg(&tmp)
        .arg(&reference)
        .arg(&devbox)
        .arg(&extra));
    let _ = std::fs::remove_dir_all(&work);
    if let Err(e) = built {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &path)
        .with_context(|| format!("rename {} to {}", tmp.display(), path.display()))?;
    Ok((reference, path))
}

fn read(path: &str) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("read {path}"))
}

fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let out = cmd.output().with_context(|| format!("run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
