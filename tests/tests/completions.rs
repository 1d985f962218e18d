//! `crabctl completions SHELL`: scripts the shells load. Real bash sources
//! the bash script and completes crabctl's commands and options with it;
//! the zsh and fish scripts are the ones those shells look for.

use crab_tests::bin_dir;

fn script(shell: &str) -> String {
    let out = std::process::Command::new(bin_dir().join("crabctl"))
        .args(["completions", shell])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// What bash's completion of `words` (the last one being completed)
/// offers, with the script sourced.
fn bash_completes(script: &std::path::Path, words: &[&str]) -> Vec<String> {
    let line = words.join(" ");
    let program = format!(
        "source {}; COMP_WORDS=({line}); COMP_CWORD={}; COMP_LINE='{line}'; COMP_POINT={}; \
         _crabctl crabctl '{}' '{}'; printf '%s\\n' \"${{COMPREPLY[@]}}\"",
        script.display(),
        words.len() - 1,
        line.len(),
        words[words.len() - 1],
        words[words.len() - 2],
    );
    let out = std::process::Command::new("bash")
        .args(["-c", &program])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn bash_completes_commands_and_options() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("crabctl.bash");
    std::fs::write(&file, script("bash")).unwrap();
    assert_eq!(bash_completes(&file, &["crabctl", "rol"]), ["rollback"]);
    let doctor: Vec<String> = bash_completes(&file, &["crabctl", "do"]);
    assert_eq!(doctor, ["doctor"]);
    let options = bash_completes(&file, &["crabctl", "checkpoint", "--f"]);
    assert!(
        options.contains(&"--fs".to_owned()) && options.contains(&"--full".to_owned()),
        "{options:?}"
    );
}

#[test]
fn zsh_and_fish_get_their_own_scripts() {
    assert!(script("zsh").starts_with("#compdef crabctl"));
    assert!(script("fish").contains("complete -c crabctl"));
    let out = std::process::Command::new(bin_dir().join("crabctl"))
        .args(["completions", "tcsh"])
        .output()
        .unwrap();
    assert!(!out.status.success(), "an unknown shell is refused");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bash"),
        "and the known ones named"
    );
}
