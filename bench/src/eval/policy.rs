//! The recovery policies an evaluation compares: what each checkpoints at
//! a turn end, and what it does when the sandbox's init is killed.

use std::path::Path;

/// One way to survive a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    /// No checkpoints, no crash: the optimum every other policy is held to.
    /// The harness captures its state after every step (what a recovery
    /// is checked against).
    FaultFree,
    /// Fault-free without the harness's state capture after every step:
    /// the density study's time reference (on a loaded host the captures
    /// of the fault-free run slow its neighbours down, and so the
    /// reference).
    Bare,
    /// Fault-free with the inspector following every sandbox (no
    /// checkpoints, no crash): what its system-call programs alone cost,
    /// crab's end-to-end figure without the checkpoints and the recovery.
    Traced,
    /// Crab as shipped: the inspector's class per turn, the host's queue,
    /// the head version restored into the same container on a crash.
    Crab,
    /// A full checkpoint (files and processes) every turn, same queue and
    /// recovery.
    FullCkpt,
    /// On a crash: a fresh sandbox from the image; the agent goes on with
    /// its conversation as if nothing happened.
    ChatOnly,
    /// Files saved every turn (a tar of the task's directories); on a
    /// crash: a fresh sandbox with the files put back, no processes.
    ChatFs,
    /// On a crash: a fresh sandbox and the task again from its first turn.
    Restart,
    /// Crab with a deliberately wrong recovery (the head's parent restored
    /// in its place): shows that the verification catches a bad recovery.
    CrabBroken,
}

/// What a policy does once the init is dead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// crabd restores the head version into the same container on its
    /// own; `wrong` restores the head's parent after it.
    Automatic { wrong: bool },
    /// The container is replaced by a fresh one from the image.
    Fresh(Fresh),
}

/// What goes into the fresh sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fresh {
    /// Nothing: the conversation goes on.
    Nothing,
    /// The files of the last saved turn.
    Files,
    /// Nothing, and the task starts over.
    FromScratch,
}

// === impl Policy ===

impl Policy {
    /// Every policy, in report order.
    pub const ALL: [Policy; 9] = [
        Policy::FaultFree,
        Policy::Bare,
        Policy::Traced,
        Policy::Crab,
        Policy::FullCkpt,
        Policy::ChatOnly,
        Policy::ChatFs,
        Policy::Restart,
        Policy::CrabBroken,
    ];

    /// Its name on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Policy::FaultFree => "fault-free",
            Policy::Bare => "bare",
            Policy::Traced => "traced",
            Policy::Crab => "crab",
            Policy::FullCkpt => "full-ckpt",
            Policy::ChatOnly => "chat-only",
            Policy::ChatFs => "chat+fs",
            Policy::Restart => "restart",
            Policy::CrabBroken => "crab-broken",
        }
    }

    /// The policy named `name`.
    pub fn parse(name: &str) -> anyhow::Result<Policy> {
        Policy::ALL.into_iter().find(|p| p.name() == name).ok_or_else(|| {
            let names: Vec<_> = Policy::ALL.iter().map(|p| p.name()).collect();
            anyhow::anyhow!("unknown policy {name:?}: one of {}", names.join(", "))
        })
    }

    /// Whether crabd makes a version at each turn end.
    pub fn checkpoints(self) -> bool {
        matches!(self, Policy::Crab | Policy::FullCkpt | Policy::CrabBroken)
    }

    /// Whether a crash is injected.
    pub fn crashes(self) -> bool {
        !matches!(self, Policy::FaultFree | Policy::Bare | Policy::Traced)
    }

    /// What it does after the crash.
    pub fn recovery(self) -> Recovery {
        match self {
            Policy::Crab | Policy::FullCkpt => Recovery::Automatic { wrong: false },
            Policy::CrabBroken => Recovery::Automatic { wrong: true },
            Policy::ChatOnly | Policy::FaultFree | Policy::Bare | Policy::Traced => {
                Recovery::Fresh(Fresh::Nothing)
            }
            Policy::ChatFs => Recovery::Fresh(Fresh::Files),
            Policy::Restart => Recovery::Fresh(Fresh::FromScratch),
        }
    }

    /// The `crab.toml` of a run: the scripted LLM on `llm_port`,
    /// transcripts under `transcripts`.
    pub fn config(self, llm_port: u16, transcripts: &Path) -> String {
        let mut toml = format!(
            "[shim.proxy]\ntranscript_dir = \"{}\"\nopenai_upstream = \"http://127.0.0.1:{llm_port}\"\n\
             hold_timeout = 120\ncheckpoint_on_turn = {}\n[crabd]\ngc_interval_secs = 3600\n",
            transcripts.display(),
            self.checkpoints(),
        );
        toml += match self {
            Policy::Crab | Policy::CrabBroken => "inspector = true\nrecover = \"on-crash\"\n",
            Policy::FullCkpt => "inspector = false\nrecover = \"on-crash\"\n",
            Policy::Traced => "inspector = true\nrecover = \"off\"\n",
            _ => "inspector = false\nrecover = \"off\"\n",
        };
        toml
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for p in Policy::ALL {
            assert_eq!(Policy::parse(p.name()).unwrap(), p);
        }
        let err = Policy::parse("crab2").unwrap_err().to_string();
        assert!(err.contains("chat+fs"), "{err}");
    }

    #[test]
    fn only_crab_policies_checkpoint_or_recover_on_their_own() {
        let dir = Path::new("/tmp/t");
        for p in Policy::ALL {
            let toml = p.config(9, dir);
            let parsed: toml::Table = toml.parse().expect("valid toml");
            let on_turn = parsed["shim"]["proxy"]["checkpoint_on_turn"].as_bool();
            assert_eq!(on_turn, Some(p.checkpoints()), "{}", p.name());
            let recover = parsed["crabd"]["recover"].as_str().unwrap();
            let automatic = matches!(p.recovery(), Recovery::Automatic { .. });
            assert_eq!(recover == "on-crash", automatic, "{}", p.name());
        }
        assert!(Policy::FullCkpt.config(9, dir).contains("inspector = false"));
        assert!(!Policy::FaultFree.crashes());
        // Traced: the inspector attached, and nothing else of crab's.
        let traced = Policy::Traced.config(9, dir);
        assert!(traced.contains("inspector = true"), "{traced}");
        assert!(!Policy::Traced.crashes() && !Policy::Traced.checkpoints());
    }
}
