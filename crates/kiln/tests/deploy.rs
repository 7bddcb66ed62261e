//! The Kubernetes manifests under `deploy/kubernetes`, built and checked offline with the real
//! tools: each kustomization (the base and every overlay) is built by kubectl's kustomize
//! (Debian's `kubernetes-client`, kubectl 1.20, unpacked under the target directory: the oldest
//! kustomize the manifests promise to build with) and its output validated strictly against
//! the Kubernetes 1.30 schemas by `kubernetes-validate` (pip, in a venv under the target
//! directory). Then what the schemas cannot see: each kiln Deployment drains within its grace
//! period, probes `/health`, gives `--threads` its CPU request, and asks for a KV cache that
//! `kiln plan` says fits its memory limit.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{debian_package, repo, venv_with};

const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";

fn kustomizations() -> Vec<PathBuf> {
    let root = repo().join("deploy/kubernetes");
    let mut dirs = vec![root.join("base")];
    let mut overlays: Vec<PathBuf> =
        std::fs::read_dir(root.join("overlays")).unwrap().map(|e| e.unwrap().path()).collect();
    overlays.sort();
    dirs.extend(overlays);
    dirs
}

/// `kubectl kustomize dir`, as YAML documents.
fn build(dir: &PathBuf) -> String {
    let kubectl = debian_package("kubernetes-client").join("usr/bin/kubectl");
    let out = Command::new(kubectl).arg("kustomize").arg(dir).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kustomize {} failed: {stderr}", dir.display());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn every_kustomization_builds_and_validates_against_the_kubernetes_schemas() {
    let validate = venv_with("kubernetes-validate-venv", &[KUBERNETES_VALIDATE]);
    let validate = validate.join("bin/kubernetes-validate");
    let dirs = kustomizations();
    assert!(dirs.len() >= 4, "base and three overlays expected: {dirs:?}");
    let out_dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("kustomize");
    std::fs::create_dir_all(&out_dir).unwrap();
    for dir in &dirs {
        let yaml = build(dir);
        let kinds = yaml.lines().filter(|l| l.starts_with("kind: ")).count();
        assert!(kinds >= 8, "{}: only {kinds} resources", dir.display());
        let name = dir.file_name().unwrap().to_str().unwrap();
        let file = out_dir.join(format!("{name}.yaml"));
        std::fs::write(&file, &yaml).unwrap();
        let out = Command::new(&validate)
            .args(["--strict", "--kubernetes-version", "1.30.0"])
            .arg(&file)
            .output()
            .unwrap();
        let report = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name} does not validate:\n{report}");
        // Every resource was checked against a schema (none skipped as unknown).
        assert_eq!(report.matches(" passed for resource ").count(), kinds, "{name}:\n{report}");
        check_kiln_deployments(name, &yaml);
    }
}

/// A flag's value in a container's args (`--name=value`).
fn flag<'a>(args: &'a [serde_norway::Value], name: &str) -> Option<&'a str> {
    args.iter().filter_map(|a| a.as_str()).find_map(|a| a.strip_prefix(&format!("{name}=")))
}

/// Bytes of a Kubernetes quantity (`2Gi`, `1536Mi`) or of kiln's size flags (`1GiB`).
fn bytes(q: &str) -> u64 {
    let units = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("Gi", 1 << 30), ("Mi", 1 << 20)];
    for (suffix, unit) in units {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().unwrap() * unit;
        }
    }
    panic!("unexpected quantity {q}");
}

/// Every kiln Deployment of a build (`kiln`; the PD overlay's `kiln-prefill` too) drains in
/// its grace period, probes `/health`, and fits its memory limit; in the PD overlay both roles
/// take the shared secret and the router runs vLLM's PD mode.
fn check_kiln_deployments(name: &str, yaml: &str) {
    let docs: Vec<serde_norway::Value> =
        yaml.split("\n---\n").map(|d| serde_norway::from_str(d).unwrap()).collect();
    let deployments: Vec<&serde_norway::Value> = docs
        .iter()
        .filter(|d| d["kind"] == "Deployment")
        .filter(|d| d["metadata"]["name"].as_str().is_some_and(|n| n.starts_with("kiln")))
        .filter(|d| d["metadata"]["name"] != "kiln-router")
        .collect();
    assert!(deployments.iter().any(|d| d["metadata"]["name"] == "kiln"), "{name}: no kiln");
    for deployment in &deployments {
        check_kiln_deployment(name, deployment);
    }
    let roles: Vec<&str> = deployments
        .iter()
        .filter_map(|d| {
            flag(d["spec"]["template"]["spec"]["containers"][0]["args"].as_sequence()?, "--kv-role")
        })
        .collect();
    if roles.is_empty() {
        return;
    }
    assert_eq!(roles.len(), deployments.len(), "{name}: every kiln Deployment has a role");
    assert!(roles.contains(&"prefill") && roles.contains(&"decode"), "{name}: {roles:?}");
    for deployment in &deployments {
        let env = &deployment["spec"]["template"]["spec"]["containers"][0]["env"];
        let secret =
            env.as_sequence().unwrap().iter().find(|e| e["name"] == "KILN_KV_TRANSFER_SECRET");
        assert!(
            secret.is_some(),
            "{name}: {} lacks the KV transfer secret",
            deployment["metadata"]["name"].as_str().unwrap()
        );
    }
    let router = docs
        .iter()
        .find(|d| d["metadata"]["name"] == "kiln-router" && d["kind"] == "Deployment")
        .unwrap();
    let args = &router["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(
        args.as_sequence().unwrap().iter().any(|a| a == "--vllm-pd-disaggregation"),
        "{name}: router"
    );
}

fn check_kiln_deployment(name: &str, deployment: &serde_norway::Value) {
    let name = format!("{name}/{}", deployment["metadata"]["name"].as_str().unwrap());
    let pod = &deployment["spec"]["template"]["spec"];
    let container = &pod["containers"][0];
    let args = container["args"].as_sequence().unwrap();
    let shutdown: u64 = flag(args, "--shutdown-timeout").unwrap().parse().unwrap();
    let pre_stop = &container["lifecycle"]["preStop"]["exec"]["command"];
    let sleep: u64 = pre_stop[1].as_str().unwrap().parse().unwrap();
    let grace = pod["terminationGracePeriodSeconds"].as_u64().unwrap();
    assert!(grace > sleep + shutdown, "{name}: grace {grace} s < preStop + drain");
    for probe in ["startupProbe", "readinessProbe", "livenessProbe"] {
        assert_eq!(container[probe]["httpGet"]["path"], "/health", "{name}: {probe}");
    }
    let requests = &container["resources"]["requests"];
    let limits = &container["resources"]["limits"];
    assert_eq!(requests, limits, "{name}: requests != limits (not Guaranteed QoS)");
    let cpu = requests["cpu"].as_str().unwrap();
    assert_eq!(flag(args, "--threads"), Some(cpu), "{name}: --threads != the CPU request");

    // `kiln plan` at the memory limit: the KV cache asked for must fit what it leaves.
    let memory = limits["memory"].as_str().unwrap();
    let kv = bytes(flag(args, "--kv-cache-memory").unwrap());
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["plan", args[1].as_str().unwrap(), "--memory"])
        .arg(format!("{}MiB", bytes(memory) >> 20))
        .args(["--max-model-len", flag(args, "--max-model-len").unwrap()])
        .args(["--kv-cache-dtype", flag(args, "--kv-cache-dtype").unwrap()])
        .output()
        .unwrap();
    let plan = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "kiln plan failed: {}", String::from_utf8_lossy(&out.stderr));
    // "memory M MiB − weights W MiB − reserve R MiB = K MiB of KV cache: N tokens"
    let line = plan.lines().find(|l| l.contains("of KV cache")).unwrap();
    let fits: f64 = line.split("= ").nth(1).unwrap().split(" MiB").next().unwrap().parse().unwrap();
    assert!(
        kv as f64 <= fits * f64::from(1u32 << 20),
        "{name}: --kv-cache-memory {kv} B > the {fits} MiB kiln plan leaves in {memory}"
    );
}
