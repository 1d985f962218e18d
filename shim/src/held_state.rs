//! What State answers while a checkpoint holds the container: its
//! processes' state as the checkpoint found it. A checkpoint holds the
//! container for its whole length and changes no process's state or pid
//! (an exit is recorded after it), so that answer stays true; containerd's
//! State (`docker ps`, `ctr task ls`, the kubelet) must not wait out a
//! checkpoint on a loaded host, or show the task's status as unknown.

use std::collections::HashMap;
use std::sync::Mutex;

use containerd_shim::api::StateResponse;

/// A container's State answers by exec id ("" for the init), while a
/// checkpoint holds it.
#[derive(Debug, Default)]
pub struct HeldStates(Mutex<Option<HashMap<String, StateResponse>>>);

/// Keeps the answers until dropped (also when the checkpoint panics or is
/// cancelled).
#[derive(Debug)]
pub struct Hold<'a>(&'a HeldStates);

// === impl HeldStates ===

impl HeldStates {
    /// Keeps `answers` (the container's, taken under its lock, which the
    /// caller holds until the returned hold drops) until the hold drops.
    pub fn hold(&self, answers: HashMap<String, StateResponse>) -> Hold<'_> {
        *self.0.lock().expect("held states lock") = Some(answers);
        Hold(self)
    }

    /// The answer for `exec_id`, while a checkpoint holds the container.
    pub fn answer(&self, exec_id: &str) -> Option<StateResponse> {
        self.0
            .lock()
            .expect("held states lock")
            .as_ref()
            .and_then(|answers| answers.get(exec_id).cloned())
    }
}

// === impl Hold ===

impl Drop for Hold<'_> {
    fn drop(&mut self) {
        *self.0 .0.lock().expect("held states lock") = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_are_kept_only_while_held() {
        let held = HeldStates::default();
        assert!(held.answer("").is_none());
        let answers = HashMap::from([(
            String::new(),
            StateResponse {
                pid: 7,
                ..Default::default()
            },
        )]);
        {
            let _hold = held.hold(answers);
            assert_eq!(held.answer("").map(|a| a.pid), Some(7));
            assert!(held.answer("exec1").is_none(), "an exec it did not find");
        }
        assert!(held.answer("").is_none(), "the checkpoint ended");
    }
}
