//! Kubernetes pods on crab: containerd's CRI plugin driven over its socket
//! as the kubelet drives it (`k8s-cri`'s generated client), with the
//! runtime handler `crab` from `packaging/containerd/config.toml`, a
//! bridge network from Debian's CNI plugins and a locally built pause
//! image (nothing is pulled). Real containerd, CRIU and CNI; needs root:
//! CI runs it as root.

use std::path::PathBuf;

use crab_tests::image::{fixtures_dir, pause_archive, python_sdk_archive, BUSYBOX, PAUSE, PYTHON_SDK};
use crab_tests::leftovers::assert_clean;
use crab_tests::llm::ScriptedLlm;
use crab_tests::sandbox::{
    ask, crabctl_err, crabctl_ok, listed, try_ask, version_turns, wait_forgotten, wait_registered, STORE,
};
use crab_tests::{unique, wait_until, Containerd};
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, CreateContainerRequest, ExecSyncRequest, ImageSpec, KeyValue,
    LinuxContainerConfig, LinuxContainerSecurityContext, LinuxPodSandboxConfig, LinuxSandboxSecurityContext,
    ListPodSandboxRequest, Mount, NamespaceMode, NamespaceOption, PodSandboxConfig, PodSandboxMetadata,
    RemovePodSandboxRequest, RunPodSandboxRequest, StartContainerRequest, StopPodSandboxRequest,
};
use tonic::transport::Channel;

/// The CRI namespace of containerd.
const K8S: &str = "k8s.io";

/// A containerd with its CRI plugin set up for crab pods, and a client.
struct Node {
    ctd: Containerd,
    rt: tokio::runtime::Runtime,
    cri: RuntimeServiceClient<Channel>,
    dir: PathBuf,
    bridge: String,
    cgroup_parent: String,
    /// Removes the pods' empty parent cgroup, after `ctd` (fields drop in
    /// order) has removed what ran in it.
    _parent_cleanup: ParentCleanup,
}

/// See [`Node::_parent_cleanup`].
struct ParentCleanup(String);

impl Drop for ParentCleanup {
    fn drop(&mut self) {
        crab_tests::cgroups::remove_empty(&self.0);
    }
}

impl Node {
    fn start(llm: &ScriptedLlm) -> Self {
        let dir = std::env::temp_dir().join(unique("crab-cri"));
        let cni = dir.join("cni");
        std::fs::create_dir_all(&cni).unwrap();
        // A bridge and a subnet of this node's own (its name fits IFNAMSIZ).
        static NODES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = std::process::id() * 4 + NODES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let bridge = format!("crab{n}");
        let subnet = format!("10.231.{}.0/24", n % 250);
        std::fs::write(
            cni.join("10-crab.conflist"),
            serde_json::json!({
                "cniVersion": "0.4.0",
                "name": "crab-test",
                "plugins": [
                    {"type": "bridge", "bridge": bridge, "isGateway": true,
                     "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]],
                              "dataDir": dir.join("ipam")}},
                    {"type": "loopback"}
                ]
            })
            .to_string(),
        )
        .unwrap();
        let config = dir.join("crab.toml");
        std::fs::write(
            &config,
            format!(
                "[shim]\nlog_level = \"debug\"\n[shim.proxy]\nopenai_upstream = \"http://127.0.0.1:{}\"\n\
                 [crabd]\ninspector = true\n",
                llm.port
            ),
        )
        .unwrap();
        let extra = format!(
            "  sandbox_image = \"{PAUSE}\"\n  restrict_oom_score_adj = true\n\
             [plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"/usr/lib/cni\"\n  conf_dir = \"{}\"\n\
             [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]\n  runtime_type = \"io.containerd.runc.v2\"\n{}",
            cni.display(),
            include_str!("../../packaging/containerd/config.toml")
                .lines()
                .filter(|l| !l.starts_with("version"))
                .collect::<Vec<_>>()
                .join("\n")
        ) + "\n[debug]\n  level = \"debug\"\n";
        // crabd logs why each turn got its class (what a failure shows).
        let env = [("CRAB_CONFIG", &*config.to_string_lossy()), ("CRAB_LOG", "debug")];
        let mut ctd = Containerd::start_full(&extra, &env);
        ctd.namespace = K8S.to_owned();
        ctd.ctr_ok(&[
            "image",
            "import",
            &crab_tests::image::busybox_archive().to_string_lossy(),
        ]);
        ctd.ctr_ok(&["image", "import", &pause_archive().to_string_lossy()]);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let channel = rt
            .block_on(containerd_client::connect(ctd.address()))
            .expect("connect to containerd");
        let cri = RuntimeServiceClient::new(channel);
        let cgroup_parent = unique("crabcri");
        Node {
            ctd,
            rt,
            cri,
            dir: dir.clone(),
            bridge,
            _parent_cleanup: ParentCleanup(cgroup_parent.clone()),
            cgroup_parent,
        }
    }

    /// A pod named `name`; `shared_pid`: its containers share one pid
    /// namespace (`shareProcessNamespace: true`).
    fn pod_config(&self, name: &str, shared_pid: bool) -> PodSandboxConfig {
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.to_owned(),
                uid: unique("uid"),
                namespace: "default".to_owned(),
                attempt: 0,
            }),
            hostname: name.to_owned(),
            log_directory: self.dir.join("logs").to_string_lossy().into_owned(),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: format!("/{}", self.cgroup_parent),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(namespaces(shared_pid)),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn run_pod(&mut self, config: &PodSandboxConfig) -> String {
        let req = RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: "crab".to_owned(),
        };
        self.rt
            .block_on(self.cri.run_pod_sandbox(req))
            .expect("RunPodSandbox")
            .into_inner()
            .pod_sandbox_id
    }

    /// Creates and starts container `name` of `pod`: `command` in `image`.
    fn run_container(
        &mut self,
        pod: &str,
        config: &PodSandboxConfig,
        name: &str,
        image: &str,
        command: &[&str],
        mounts: Vec<Mount>,
    ) -> String {
        let req = CreateContainerRequest {
            pod_sandbox_id: pod.to_owned(),
            config: Some(ContainerConfig {
                metadata: Some(ContainerMetadata {
                    name: name.to_owned(),
                    attempt: 0,
                }),
                image: Some(ImageSpec {
                    image: image.to_owned(),
                    ..Default::default()
                }),
                command: command.iter().map(|a| a.to_string()).collect(),
                mounts,
                envs: vec![KeyValue {
                    key: "AGENT".into(),
                    value: name.into(),
                }],
                log_path: format!("{name}.log"),
                linux: Some(LinuxContainerConfig {
                    security_context: Some(LinuxContainerSecurityContext {
                        namespace_options: config
                            .linux
                            .as_ref()
                            .and_then(|l| l.security_context.as_ref())
                            .and_then(|s| s.namespace_options.clone()),
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            sandbox_config: Some(config.clone()),
        };
        let id = self
            .rt
            .block_on(self.cri.create_container(req))
            .expect("CreateContainer")
            .into_inner()
            .container_id;
        self.rt
            .block_on(self.cri.start_container(StartContainerRequest {
                container_id: id.clone(),
            }))
            .expect("StartContainer");
        id
    }

    /// `sh -c script` in container `id` through CRI's ExecSync: (exit, stdout).
    fn exec(&mut self, id: &str, script: &str) -> (i32, String) {
        let req = ExecSyncRequest {
            container_id: id.to_owned(),
            cmd: vec!["sh".into(), "-c".into(), script.into()],
            timeout: 30,
        };
        let out = self
            .rt
            .block_on(self.cri.exec_sync(req))
            .expect("ExecSync")
            .into_inner();
        (out.exit_code, String::from_utf8_lossy(&out.stdout).into_owned())
    }

    fn remove_pod(&mut self, pod: &str) {
        self.rt
            .block_on(self.cri.stop_pod_sandbox(StopPodSandboxRequest {
                pod_sandbox_id: pod.to_owned(),
            }))
            .expect("StopPodSandbox");
        self.rt
            .block_on(self.cri.remove_pod_sandbox(RemovePodSandboxRequest {
                pod_sandbox_id: pod.to_owned(),
            }))
            .expect("RemovePodSandbox");
    }
}

/// The kubelet's: the pod's network and IPC, a pid namespace per container
/// unless the pod shares one.
fn namespaces(shared_pid: bool) -> NamespaceOption {
    let pid = if shared_pid {
        NamespaceMode::Pod
    } else {
        NamespaceMode::Container
    };
    NamespaceOption {
        network: NamespaceMode::Pod.into(),
        pid: pid.into(),
        ipc: NamespaceMode::Pod.into(),
        ..Default::default()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Pods a failed test left: the CRI plugin releases their network
        // namespace and shm mount only when told to remove them. Bounded:
        // a containerd stuck on a hung shim must not hang the test binary.
        let limit = std::time::Duration::from_secs(30);
        let cri = &mut self.cri;
        self.rt.block_on(async {
            // The timers exist only inside the runtime.
            let listed =
                tokio::time::timeout(limit, cri.list_pod_sandbox(ListPodSandboxRequest::default())).await;
            let pods = listed
                .ok()
                .and_then(Result::ok)
                .map(|r| r.into_inner().items)
                .unwrap_or_default();
            for pod in pods {
                let stop = StopPodSandboxRequest {
                    pod_sandbox_id: pod.id.clone(),
                };
                let _ = tokio::time::timeout(limit, cri.stop_pod_sandbox(stop)).await;
                let remove = RemovePodSandboxRequest {
                    pod_sandbox_id: pod.id,
                };
                let _ = tokio::time::timeout(limit, cri.remove_pod_sandbox(remove)).await;
            }
        });
        let _ = std::process::Command::new("ip")
            .args(["link", "delete", &self.bridge])
            .output();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn env_of(pid: i32) -> Vec<String> {
    std::fs::read(format!("/proc/{pid}/environ"))
        .map(|b| {
            b.split(|c| *c == 0)
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// `checkpointctl args…`'s output, asserting success.
fn checkpointctl(args: &[&str]) -> String {
    let out = std::process::Command::new("checkpointctl")
        .args(args)
        .output()
        .expect("checkpointctl runs: packaging/install-deps.sh installs it");
    assert!(
        out.status.success(),
        "checkpointctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn namespace(pid: i32, ns: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).expect("a namespace")
}

fn has_proxy_vars(pid: i32) -> bool {
    env_of(pid).iter().any(|v| v.starts_with("OPENAI_BASE_URL="))
}

/// One turn of an agent in the pod, from container `id`: a chat completion
/// posted to the pod's proxy on the pod's loopback.
fn turn_from(node: &mut Node, id: &str) {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"next"}]}"#;
    let (code, out) = node.exec(
        id,
        &format!(
            "wget -q -O - --header 'content-type: application/json' --post-data '{body}' \
             http://127.0.0.1:7878/v1/chat/completions"
        ),
    );
    assert_eq!(code, 0, "the pod's proxy answers {id}: {out}");
    assert!(out.contains("choices"), "{out}");
}

/// One turn of an agent outside the pod's processes: a chat completion
/// posted to the pod's proxy on the pod's loopback, from the test's own
/// thread in the network namespace of `pid`.
fn turn_from_outside(pid: i32) {
    let body = r#"{"model":"m","messages":[{"role":"user","content":"next"}]}"#;
    let (status, answer) =
        crab_tests::http::request_in(pid, 7878, "POST", "/v1/chat/completions", &[], Some(body));
    assert_eq!(status, 200, "{answer}");
}

#[test]
fn a_pod_is_one_sandbox_that_checkpoints_and_rolls_back() {
    let llm = ScriptedLlm::start();
    let mut node = Node::start(&llm);
    node.ctd
        .ctr_ok(&["image", "import", &python_sdk_archive().to_string_lossy()]);
    let mut config = node.pod_config("agent", false);
    config
        .annotations
        .insert("io.crab.sandbox-container".into(), "agent".into());
    let pod = node.run_pod(&config);
    let fixtures = Mount {
        container_path: "/fixtures".into(),
        host_path: fixtures_dir().to_string_lossy().into_owned(),
        readonly: true,
        ..Default::default()
    };
    // The sidecar comes first: the pod names its sandbox, the agent.
    let sidecar = node.run_container(&pod, &config, "sidecar", BUSYBOX, &["sleep", "100000"], vec![]);
    let agent = node.run_container(
        &pod,
        &config,
        "agent",
        PYTHON_SDK,
        &["/opt/crab/sdk-venv/bin/python3", "/fixtures/stateful.py"],
        vec![fixtures],
    );
    let pid = |node: &Node, id: &str| node.ctd.task_pid(id).expect("the task runs");
    let agent_pid = pid(&node, &agent);
    wait_until(20, || try_ask(agent_pid, STORE, "get nothing").ok()).expect("the agent's store answers");

    // The pod is one sandbox: its agent. Neither the pause container nor
    // the sidecar is one, nor do they get the proxy's variables.
    wait_registered(&node.ctd, &agent);
    assert!(
        listed(&node.ctd, &pod).is_none(),
        "the pause container is no sandbox"
    );
    assert!(listed(&node.ctd, &sidecar).is_none(), "a sidecar is no sandbox");
    assert!(has_proxy_vars(agent_pid));
    assert!(!has_proxy_vars(pid(&node, &pod)));
    assert!(!has_proxy_vars(pid(&node, &sidecar)));

    // One proxy in the pod's network namespace: the agent's turns and any
    // container's requests through it are the pod's turns.
    turn_from(&mut node, &agent);
    turn_from(&mut node, &sidecar);
    assert_eq!(
        wait_until(20, || {
            let turns = version_turns(&node.ctd, &agent);
            (turns.len() >= 2).then_some(turns)
        })
        .unwrap_or_else(|| {
            let log = std::fs::read_to_string(node.ctd.dir.join("containerd.log")).unwrap_or_default();
            let bad: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("level=warn") || l.contains("level=error") || l.contains("turn"))
                .collect();
            panic!(
                "versions {}\n{}",
                crabctl_ok(&node.ctd, &["versions", &agent]),
                bad.join("\n")
            )
        }),
        vec![1, 2]
    );
    assert_eq!(llm.seen().len(), 2, "each turn reached the LLM once");
    // The inspector follows the sidecar with the agent. The first two
    // turns are whole (no version before them; the sidecar's past unknown,
    // then a request from it). Turns asked from outside the pod's
    // processes (into its network, as an agent outside does): one in which
    // no container changed anything is `none`, one after the sidecar wrote
    // a file is whole.
    let agent_pid = pid(&node, &agent);
    turn_from_outside(agent_pid);
    turn_from_outside(agent_pid);
    assert_eq!(node.exec(&sidecar, "echo x > /side-note").0, 0);
    turn_from_outside(agent_pid);
    let versions = wait_until(20, || {
        let v = crabctl_ok(&node.ctd, &["versions", &agent]);
        (v.as_array().is_some_and(|a| a.len() >= 5)).then_some(v)
    })
    .expect("five turn versions");
    let classes: Vec<&str> = versions
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["class"].as_str().unwrap_or_default())
        .collect();
    let log = std::fs::read_to_string(node.ctd.crabd_root().join("crabd.log")).unwrap_or_default();
    let why: Vec<&str> = log.lines().filter(|l| l.contains("classified")).collect();
    assert_eq!(classes[3..], ["none", "full"], "{}", why.join("\n"));

    // Checkpoint, change files and memory, roll back: the agent comes back
    // as it was, in the pod's network, and execs run in it again.
    assert_eq!(ask(agent_pid, STORE, "set k before"), "ok");
    assert_eq!(
        node.exec(
            &agent,
            "echo one > /data/f && rm /etc/ssl/certs/ca-certificates.crt"
        )
        .0,
        0
    );
    // The sidecar's files and processes are the pod's too.
    let sidecar_script = |file: &str, sleep: u32| {
        format!("echo {file} > /side && (sleep {sleep} </dev/null >/dev/null 2>&1 &)")
    };
    assert_eq!(node.exec(&sidecar, &sidecar_script("one", 4242)).0, 0);
    // A connection from the agent's container to the sidecar, over the
    // pod's loopback, idle once its line is read: killed together at a
    // rollback, its ends leave a closed socket in the pod's network with
    // the addresses the restore needs (the restore must not fail on it).
    assert_eq!(
        node.exec(&sidecar, "(nc -l -p 5000 </dev/null >/conn 2>/dev/null &)")
            .0,
        0
    );
    let talker = "import socket, time\n\
                  for _ in range(100):\n    \
                      try:\n        s = socket.create_connection(('127.0.0.1', 5000)); break\n    \
                      except OSError: time.sleep(0.05)\n\
                  s.sendall(b'x\\n'); time.sleep(100000)\n";
    let (code, out) = node.exec(
        &agent,
        &format!(
            "cat > /tmp/talker.py <<'EOF'\n{talker}EOF\n\
             (/opt/crab/sdk-venv/bin/python3 /tmp/talker.py </dev/null >/dev/null 2>&1 &)"
        ),
    );
    assert_eq!(code, 0, "{out}");
    let conn_size = |node: &mut Node| -> usize {
        let (_, out) = node.exec(&sidecar, "wc -c < /conn");
        out.trim().parse().unwrap_or(0)
    };
    wait_until(10, || (conn_size(&mut node) > 0).then_some(())).expect("the connection carries its line");
    let made = crabctl_ok(&node.ctd, &["checkpoint", &agent]);
    let v = made["version"]["version"].as_u64().expect("a version");
    // The sidecar's files are copied beside the agent's in crabd's store,
    // under the version's own snapshot name.
    let snapshot = made["version"]["fs_snapshot"]["name"]
        .as_str()
        .expect("a snapshot");
    let sidecar_copies = node
        .ctd
        .crabd_root()
        .join("fs")
        .join(&agent)
        .join(".pod-members/sidecar");
    assert_eq!(
        std::fs::read_to_string(sidecar_copies.join(snapshot).join("side")).unwrap(),
        "one\n"
    );
    // The version in Kubernetes' checkpoint archive layout, as its tools
    // read it: the pod's container, its image, its process tree.
    let archive = node.dir.join("agent-checkpoint.tar");
    let archive_arg = archive.to_string_lossy().into_owned();
    crabctl_ok(
        &node.ctd,
        &[
            "export",
            &agent,
            &v.to_string(),
            &archive_arg,
            "--format",
            "checkpointctl",
        ],
    );
    let show = checkpointctl(&["show", &archive_arg]);
    for want in ["agent", PYTHON_SDK, &agent[..12], "containerd"] {
        assert!(show.contains(want), "checkpointctl show lacks {want}: {show}");
    }
    // Its file changes as the engines write them: the changed files in
    // rootfs-diff.tar, the image's deleted ones in deleted.files.
    let member = |name: &str| -> Vec<u8> {
        let out = std::process::Command::new("tar")
            .args(["-xOf", &archive_arg, name])
            .output()
            .expect("tar");
        assert!(out.status.success(), "{name}: {out:?}");
        out.stdout
    };
    let diff = node.dir.join("rootfs-diff.tar");
    std::fs::write(&diff, member("rootfs-diff.tar")).unwrap();
    let f = std::process::Command::new("tar")
        .args(["-xOf", &diff.to_string_lossy(), "data/f"])
        .output()
        .expect("tar");
    assert_eq!(String::from_utf8_lossy(&f.stdout), "one\n", "{f:?}");
    let deleted: Vec<String> = serde_json::from_slice(&member("deleted.files")).unwrap();
    assert!(
        deleted.contains(&"/etc/ssl/certs/ca-certificates.crt".to_owned()),
        "{deleted:?}"
    );
    let listing = std::process::Command::new("tar")
        .args(["-tf", &archive_arg])
        .output()
        .expect("tar");
    let listing = String::from_utf8_lossy(&listing.stdout);
    assert!(
        !listing.contains("pod-members"),
        "the layout holds the agent's container only: {listing}"
    );
    let inspect = checkpointctl(&["inspect", &archive_arg, "--ps-tree"]);
    for want in ["Engine: containerd", "Process tree", "python3"] {
        assert!(
            inspect.contains(want),
            "checkpointctl inspect lacks {want}: {inspect}"
        );
    }
    assert_eq!(ask(agent_pid, STORE, "set k after"), "ok");
    assert_eq!(node.exec(&agent, "echo two > /data/f; touch /data/g").0, 0);
    assert_eq!(node.exec(&sidecar, &sidecar_script("two", 4343)).0, 0);
    assert_eq!(node.exec(&sidecar, "touch /side2").0, 0);
    let sidecar_pid = pid(&node, &sidecar);
    // A rollback of files only would leave the sidecar's: refused.
    let refused = crabctl_err(&node.ctd, &["rollback", &agent, &v.to_string(), "--files-only"]);
    assert!(refused.contains("pod's other containers"), "{refused}");
    crabctl_ok(&node.ctd, &["rollback", &agent, &v.to_string()]);
    let agent_pid = pid(&node, &agent);
    assert_eq!(ask(agent_pid, STORE, "get k"), "before");
    let pause_pid = pid(&node, &pod);
    for ns in ["net", "ipc", "uts"] {
        assert_eq!(
            namespace(agent_pid, ns),
            namespace(pause_pid, ns),
            "the restored agent is in the pod's {ns} namespace"
        );
    }
    assert_eq!(
        node.exec(&agent, "cat /data/f; ls /data"),
        (0, "one\nf\n".to_owned())
    );
    turn_from(&mut node, &agent);
    // The sidecar came back with the pod: its files and its processes as
    // they were at the version, in the pod's namespaces.
    let sidecar_now = pid(&node, &sidecar);
    assert_ne!(sidecar_now, sidecar_pid, "the sidecar was restored");
    for ns in ["net", "ipc", "uts"] {
        assert_eq!(
            namespace(sidecar_now, ns),
            namespace(pause_pid, ns),
            "the restored sidecar is in the pod's {ns} namespace"
        );
    }
    assert_eq!(
        node.exec(&sidecar, "cat /side; test -e /side2 || echo gone"),
        (0, "one\ngone\n".to_owned())
    );
    let (code, ps) = node.exec(&sidecar, "ps -o args");
    assert_eq!(code, 0, "{ps}");
    assert!(ps.contains("sleep 4242"), "{ps}");
    assert!(!ps.contains("sleep 4343"), "{ps}");

    // A crash of the agent brings the whole pod back to its head version
    // (the last turn's, taken after the rollback): the sidecar's files too.
    assert_eq!(node.exec(&sidecar, "echo three > /side").0, 0);
    let (agent_before, sidecar_before) = (pid(&node, &agent), pid(&node, &sidecar));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent_before),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let agent_pid = wait_until(30, || node.ctd.task_pid(&agent).filter(|&p| p != agent_before))
        .unwrap_or_else(|| {
            let log = std::fs::read_to_string(node.ctd.crabd_root().join("crabd.log")).unwrap_or_default();
            let bad: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("recover") || l.contains(" WARN ") || l.contains(" ERROR "))
                .collect();
            let ctd_log = std::fs::read_to_string(node.ctd.dir.join("containerd.log")).unwrap_or_default();
            let shim: Vec<&str> = ctd_log
                .lines()
                .filter(|l| {
                    l.contains("recover")
                        || l.contains("level=warn")
                        || l.contains("level=error")
                        || l.contains("restore")
                })
                .collect();
            panic!(
                "the agent is not recovered: {}\n--- shim ---\n{}",
                bad.join("\n"),
                shim[shim.len().saturating_sub(20)..].join("\n")
            )
        });
    assert_eq!(ask(agent_pid, STORE, "get k"), "before");
    assert_ne!(
        pid(&node, &sidecar),
        sidecar_before,
        "the sidecar was restored with it"
    );
    assert_eq!(node.exec(&sidecar, "cat /side"), (0, "one\n".to_owned()));

    // Still one sandbox, the agent, now that everything ran.
    let ids: Vec<String> = crabctl_ok(&node.ctd, &["ps"])
        .as_array()
        .expect("a list")
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, vec![agent.clone()]);

    node.remove_pod(&pod);
    wait_forgotten(&node.ctd, &agent);
    assert!(
        !sidecar_copies.exists(),
        "the sidecar's copies go with the pod's history"
    );
    let scope = node.ctd.scope_of(K8S, &node.cgroup_parent);
    assert_clean(&scope, &[&pod, &agent, &sidecar]);
}

/// In a pod that shares one process namespace the pause container is the
/// namespace's init, and CRIU dumps a pid namespace only with its init: a
/// checkpoint is refused with the reason and what to do (a sandbox's first
/// version holds its processes), and the pod runs on, its turns answered.
#[test]
fn a_pod_sharing_its_process_namespace_is_refused_a_checkpoint_clearly() {
    let llm = ScriptedLlm::start();
    let mut node = Node::start(&llm);
    let config = node.pod_config("shared", true);
    let pod = node.run_pod(&config);
    let agent = node.run_container(&pod, &config, "agent", BUSYBOX, &["sleep", "100000"], vec![]);
    wait_registered(&node.ctd, &agent);
    for args in [["checkpoint", "--fs"].as_slice(), &["checkpoint"]] {
        let e = crabctl_err(&node.ctd, &[args, &[agent.as_str()]].concat());
        assert!(
            e.contains("shareProcessNamespace") && e.contains("pid namespace of its own"),
            "{e}"
        );
    }
    turn_from(&mut node, &agent);
    assert!(version_turns(&node.ctd, &agent).is_empty());
    assert_eq!(node.exec(&agent, "echo alive").1, "alive\n");
    node.remove_pod(&pod);
    wait_forgotten(&node.ctd, &agent);
    assert_clean(&node.ctd.scope_of(K8S, &node.cgroup_parent), &[&pod, &agent]);
}
