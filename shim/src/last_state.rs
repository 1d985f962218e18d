//! What State last answered for each process, to answer containerd while a
//! checkpoint or restore holds the container (`docker ps`, `ctr task ls`
//! and the kubelet ask State of every task, and must not wait out a
//! checkpoint on a loaded host, or show the task's status as unknown).

use std::collections::HashMap;
use std::sync::Mutex;

use containerd_shim::api::StateResponse;

/// The last State answer per container id and exec id.
#[derive(Debug, Default)]
pub struct LastStates(Mutex<HashMap<(String, String), StateResponse>>);

// === impl LastStates ===

impl LastStates {
    /// The last answer for `exec_id` ("" for the init) of container `id`.
    pub fn get(&self, id: &str, exec_id: &str) -> Option<StateResponse> {
        self.0
            .lock()
            .expect("last states lock")
            .get(&(id.to_owned(), exec_id.to_owned()))
            .cloned()
    }

    /// Keeps `answer` as the last for `exec_id` of container `id`.
    pub fn put(&self, id: &str, exec_id: &str, answer: &StateResponse) {
        self.0
            .lock()
            .expect("last states lock")
            .insert((id.to_owned(), exec_id.to_owned()), answer.clone());
    }

    /// Forgets exec `exec_id` of container `id`, or, for "", the whole
    /// container.
    pub fn forget(&self, id: &str, exec_id: &str) {
        self.0
            .lock()
            .expect("last states lock")
            .retain(|(c, e), _| c != id || (!exec_id.is_empty() && e != exec_id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(pid: u32) -> StateResponse {
        StateResponse {
            pid,
            ..Default::default()
        }
    }

    #[test]
    fn an_exec_or_a_whole_container_is_forgotten() {
        let last = LastStates::default();
        last.put("a", "", &answer(1));
        last.put("a", "e1", &answer(2));
        last.put("a", "e2", &answer(3));
        last.put("b", "", &answer(4));
        last.forget("a", "e1");
        assert!(last.get("a", "e1").is_none());
        assert_eq!(last.get("a", "e2").map(|r| r.pid), Some(3));
        last.forget("a", "");
        assert!(last.get("a", "").is_none() && last.get("a", "e2").is_none());
        assert_eq!(last.get("b", "").map(|r| r.pid), Some(4));
    }
}
