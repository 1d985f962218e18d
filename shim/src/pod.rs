//! Kubernetes pods. containerd's CRI plugin runs all containers of a pod in
//! one shim (grouped by the pod's id): first the pause container, which
//! only holds the pod's namespaces, then the app containers, which join
//! them. A pod is one sandbox: one LLM proxy in the pod's network
//! namespace, one registration with crabd, turns and versions of the pod's
//! sandbox container. That is the app container the pod's annotation
//! [`SANDBOX_CONTAINER`] names (containerd passes it on when the runtime's
//! `pod_annotations` lists it), else the first app container to run (an
//! init container until it ends); a restart of it takes the pod over once
//! the old one is deleted. The pause container is no sandbox. Any other
//! app container (a sidecar) is a member of the pod: it has no proxy of its
//! own, and every version of the pod covers its processes and files too
//! (`crate::container::members`), so its turns are whole versions.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Mutex;

use crab_api::crabd::PodMember;

/// The annotation naming the pod a CRI container belongs to.
pub const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";

/// The annotation saying whether a CRI container is the pod's pause
/// container (`sandbox`) or an app container (`container`).
const CONTAINER_TYPE: &str = "io.kubernetes.cri.container-type";

/// The annotation with a CRI container's name in its pod.
const CONTAINER_NAME: &str = "io.kubernetes.cri.container-name";

/// The pod annotation naming the app container that is the pod's sandbox.
pub const SANDBOX_CONTAINER: &str = "io.crab.sandbox-container";

/// What a container is to its pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Not in a pod (ctr, docker, nerdctl): a sandbox of its own.
    Alone,
    /// A pod's pause container: the pod's namespaces and nothing else.
    Infra,
    /// An app container of a pod.
    Member {
        /// The pod's id.
        pod: String,
        /// Whether the pod names its sandbox container, and this is it
        /// (`Some(true)`) or not (`Some(false)`); `None`: the pod names none.
        chosen: Option<bool>,
    },
}

/// The annotations naming a CRI container's pod.
const POD_NAMESPACE: &str = "io.kubernetes.cri.sandbox-namespace";
const POD_NAME: &str = "io.kubernetes.cri.sandbox-name";

/// The Kubernetes pod (`namespace/name`) the annotations of a container's
/// spec name, if they name one in Kubernetes' own alphabet (anything else
/// is no name to show).
pub fn name(annotations: &HashMap<String, String>) -> Option<String> {
    let part = |key| {
        annotations
            .get(key)
            .filter(|v: &&String| {
                (1..=253).contains(&v.len())
                    && v.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
            })
            .cloned()
    };
    Some(format!("{}/{}", part(POD_NAMESPACE)?, part(POD_NAME)?))
}

/// The role the annotations of a container's spec give it.
pub fn role(annotations: &HashMap<String, String>) -> Role {
    match (
        annotations.get(CONTAINER_TYPE).map(String::as_str),
        annotations.get(SANDBOX_ID),
    ) {
        (Some("sandbox"), _) => Role::Infra,
        (Some("container"), Some(pod)) => Role::Member {
            pod: pod.clone(),
            chosen: annotations
                .get(SANDBOX_CONTAINER)
                .map(|name| annotations.get(CONTAINER_NAME) == Some(name)),
        },
        _ => Role::Alone,
    }
}

/// The role of the container whose bundle is `bundle` (its `config.json`);
/// a spec that cannot be read is `Alone` (its create then says why).
pub fn role_of(bundle: &Path) -> Role {
    role(&annotations_of(bundle))
}

/// The pod id a CRI container's shim is shared under, from its spec.
pub fn group(bundle: &Path) -> Option<String> {
    annotations_of(bundle).remove(SANDBOX_ID)
}

/// The annotations of the spec in `bundle` (none if it cannot be read).
fn annotations_of(bundle: &Path) -> HashMap<String, String> {
    std::fs::read(bundle.join("config.json"))
        .ok()
        .and_then(|text| serde_json::from_slice::<serde_json::Value>(&text).ok())
        .and_then(|spec| serde_json::from_value(spec.get("annotations")?.clone()).ok())
        .unwrap_or_default()
}

/// The name of a pod's app container as CRI gives it, if it is a DNS label
/// (what Kubernetes allows): it names the container's part of a pod
/// version, so that a restarted container (a new id) takes its part.
pub fn member_name(annotations: &HashMap<String, String>) -> Option<String> {
    annotations
        .get(CONTAINER_NAME)
        .filter(|n| is_member_name(n))
        .cloned()
}

/// Whether `name` is a DNS label: the only names [`member_name`] gives.
pub fn is_member_name(name: &str) -> bool {
    (1..=63).contains(&name.len())
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// The pods of one shim: which app container is each pod's sandbox, and
/// which are its other app containers (its members: a version of the pod
/// covers them too).
#[derive(Debug, Default)]
pub struct Pods(Mutex<HashMap<String, Pod>>);

#[derive(Debug, Default)]
struct Pod {
    /// Its sandbox container, once one claimed it.
    sandbox: Option<String>,
    /// Its other app containers, by id, with what the inspector needs to
    /// follow each (once it is known: [`Pods::describe`]).
    members: BTreeMap<String, Option<PodMember>>,
}

impl Pods {
    /// Whether container `id` of role `role` is a sandbox: every container
    /// outside pods, and of each pod's app containers the first of those
    /// the pod names (any, when it names none), claimed here until
    /// [`Pods::release`] (its delete: a restart of it takes the pod then).
    /// Any other app container becomes a member of its pod.
    pub fn claim(&self, role: &Role, id: &str) -> bool {
        let Role::Member { pod, chosen } = role else {
            return matches!(role, Role::Alone);
        };
        let mut pods = self.0.lock().expect("pods lock");
        let p = pods.entry(pod.clone()).or_default();
        let sandbox = *chosen != Some(false) && p.sandbox.get_or_insert_with(|| id.to_owned()) == id;
        if !sandbox {
            p.members.insert(id.to_owned(), None);
        }
        sandbox
    }

    /// Says how the inspector follows member `id`, once it is created.
    pub fn describe(&self, id: &str, member: PodMember) {
        let mut pods = self.0.lock().expect("pods lock");
        if let Some(slot) = pods.values_mut().find_map(|p| p.members.get_mut(id)) {
            *slot = Some(member);
        }
    }

    /// Gives up container `id` (it is gone, or was never made): when it was
    /// its pod's sandbox, the pod's next app container becomes the sandbox;
    /// when a member, the pod's versions no longer cover it.
    pub fn release(&self, id: &str) {
        let mut pods = self.0.lock().expect("pods lock");
        for p in pods.values_mut() {
            if p.sandbox.as_deref() == Some(id) {
                p.sandbox = None;
            }
            p.members.remove(id);
        }
        pods.retain(|_, p| p.sandbox.is_some() || !p.members.is_empty());
    }

    /// The members of the pod whose sandbox is `id` (none if it is no pod's
    /// sandbox).
    pub fn members(&self, id: &str) -> Vec<String> {
        self.with_pod_of(id, |p| p.members.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// What a turn end of the pod whose sandbox is `id` tells crabd of its
    /// members: how many there are, and those the inspector can follow.
    pub fn turn_view(&self, id: &str) -> (u32, Vec<PodMember>) {
        self.with_pod_of(id, |p| {
            let known = p.members.values().flatten().cloned().collect();
            (p.members.len() as u32, known)
        })
        .unwrap_or_default()
    }

    /// `f` of the pod whose sandbox is `id`, if it is one's.
    fn with_pod_of<T>(&self, id: &str, f: impl FnOnce(&Pod) -> T) -> Option<T> {
        let pods = self.0.lock().expect("pods lock");
        pods.values().find(|p| p.sandbox.as_deref() == Some(id)).map(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotations(kind: &str, pod: &str) -> HashMap<String, String> {
        HashMap::from([
            (CONTAINER_TYPE.to_owned(), kind.to_owned()),
            (SANDBOX_ID.to_owned(), pod.to_owned()),
        ])
    }

    fn member(pod: &str) -> Role {
        Role::Member {
            pod: pod.into(),
            chosen: None,
        }
    }

    #[test]
    fn roles_come_from_the_cri_annotations() {
        assert_eq!(role(&HashMap::new()), Role::Alone);
        assert_eq!(role(&annotations("sandbox", "p")), Role::Infra);
        assert_eq!(role(&annotations("container", "p")), member("p"));
        let mut named = annotations("container", "p");
        named.insert(SANDBOX_CONTAINER.into(), "agent".into());
        named.insert(CONTAINER_NAME.into(), "sidecar".into());
        let chosen = |c| Role::Member {
            pod: "p".into(),
            chosen: Some(c),
        };
        assert_eq!(role(&named), chosen(false));
        named.insert(CONTAINER_NAME.into(), "agent".into());
        assert_eq!(role(&named), chosen(true));
        // An app container without its pod is no member of one.
        let lone = HashMap::from([(CONTAINER_TYPE.to_owned(), "container".to_owned())]);
        assert_eq!(role(&lone), Role::Alone);
    }

    #[test]
    fn a_pods_name_is_shown_only_in_kubernetes_alphabet() {
        let named = |ns: &str, name: &str| {
            HashMap::from([
                (POD_NAMESPACE.to_owned(), ns.to_owned()),
                (POD_NAME.to_owned(), name.to_owned()),
            ])
        };
        assert_eq!(name(&named("agents", "run-17.a")), Some("agents/run-17.a".into()));
        assert_eq!(name(&named("agents", "")), None);
        assert_eq!(name(&named("agents", "a\u{1b}[2J")), None);
        assert_eq!(name(&named("../x", "a")), None);
        assert_eq!(name(&HashMap::new()), None);
    }

    #[test]
    fn a_pod_has_one_sandbox_until_it_is_released() {
        let pods = Pods::default();
        let p = member("p");
        assert!(!pods.claim(&Role::Infra, "pause"));
        assert!(pods.claim(&Role::Alone, "other"));
        assert!(pods.claim(&p, "agent"));
        assert!(pods.claim(&p, "agent"), "its own claim again");
        assert!(!pods.claim(&p, "sidecar"));
        assert!(pods.claim(&member("q"), "agent-q"), "another pod");
        pods.release("sidecar");
        assert!(!pods.claim(&p, "sidecar2"), "a sidecar's release frees nothing");
        pods.release("agent");
        assert!(pods.claim(&p, "agent2"), "a restarted agent takes the pod");
        // A pod that names its sandbox: that container, whatever came first.
        let named = |c| Role::Member {
            pod: "r".into(),
            chosen: Some(c),
        };
        assert!(!pods.claim(&named(false), "sidecar-r"));
        assert!(pods.claim(&named(true), "agent-r"));
        assert!(!pods.claim(&named(true), "agent-r2"), "not while the first runs");
        assert!(!pods.claim(&member("r"), "other-r"), "the pod is taken");
        pods.release("agent-r");
        assert!(
            pods.claim(&named(true), "agent-r2"),
            "its restart takes the pod once it is gone"
        );
    }

    #[test]
    fn a_pods_other_app_containers_are_its_members_and_counted() {
        let pods = Pods::default();
        let p = member("p");
        assert!(pods.claim(&p, "agent"));
        assert_eq!(pods.turn_view("agent"), (0, vec![]));
        assert!(!pods.claim(&p, "sidecar"));
        assert!(
            !pods.claim(&Role::Infra, "pause"),
            "the pause container is no member"
        );
        assert_eq!(pods.members("agent"), vec!["sidecar".to_owned()]);
        assert_eq!(
            pods.turn_view("agent"),
            (1, vec![]),
            "counted before it is described"
        );
        let described = PodMember {
            id: crab_api::SandboxId::new("sidecar").unwrap(),
            cgroup: "/sys/fs/cgroup/k8s/sidecar".into(),
            crab_init: true,
        };
        pods.describe("sidecar", described.clone());
        assert_eq!(pods.turn_view("agent"), (1, vec![described.clone()]));
        assert!(pods.members("sidecar").is_empty(), "a member is no pod's sandbox");
        assert_eq!(pods.turn_view("other"), (0, vec![]));
        // A restarted agent keeps the members.
        pods.release("agent");
        assert!(pods.claim(&p, "agent2"));
        assert_eq!(pods.turn_view("agent2"), (1, vec![described]));
        pods.release("sidecar");
        assert!(pods.members("agent2").is_empty());
        pods.release("agent2");
        assert!(pods.0.lock().unwrap().is_empty(), "an empty pod is forgotten");
    }

    #[test]
    fn a_members_name_is_a_dns_label() {
        let named = |n: &str| HashMap::from([(CONTAINER_NAME.to_owned(), n.to_owned())]);
        assert_eq!(member_name(&named("side-car2")), Some("side-car2".into()));
        for bad in ["", "-x", "A", "a/b", "..", "a.b", &"x".repeat(64)] {
            assert_eq!(member_name(&named(bad)), None, "{bad:?}");
        }
    }
}
