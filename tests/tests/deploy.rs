//! The files that place distlab with the schedulers people run (deploy/): as far as they
//! can be checked without a cluster. The Kubernetes manifest parses and names only settings
//! the binaries read; the container build file pins its bases, builds what it copies and
//! runs as a user; the Slurm script passes `bash -n` and starts the worker with flags it has.

use std::collections::BTreeSet;
use std::process::Command;

use distlab_tests::{bin_path, repo_root};
use yaml_rust2::{Yaml, YamlLoader};

/// Every `DISTLAB_*` setting the server and the worker read: the environment names their
/// `--help` lists, and the worker token (read apart, so it never shows in `ps`).
fn settings() -> BTreeSet<String> {
    let mut names = BTreeSet::from(["DISTLAB_WORKER_TOKEN".to_string()]);
    for bin in ["distlab-server", "distlab-worker"] {
        let help = Command::new(bin_path(bin)).arg("--help").output().expect("--help");
        let help = String::from_utf8_lossy(&help.stdout).into_owned();
        // ("[env: NAME=value]", or "[env: NAME]" for a setting whose value stays hidden)
        names.extend(help.split("[env: ").skip(1).filter_map(|s| s.split(['=', ']']).next()).map(str::to_string));
    }
    assert!(names.contains("DISTLAB_SERVER") && names.contains("DISTLAB_DATA_DIR"), "{names:?}");
    names
}

/// The long flags a binary's `--help` lists.
fn flags(bin: &str) -> BTreeSet<String> {
    let help = Command::new(bin_path(bin)).arg("--help").output().expect("--help");
    let help = String::from_utf8_lossy(&help.stdout).into_owned();
    help.split_whitespace().filter(|w| w.starts_with("--")).map(|w| w.trim_end_matches(',').to_string()).collect()
}

fn distlab_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("DISTLAB_"))
        .map(str::to_string)
        .collect()
}

#[test]
fn the_kubernetes_manifest_parses_and_sets_only_real_settings() {
    let text = std::fs::read_to_string(repo_root().join("deploy/kubernetes/distlab.yaml")).unwrap();
    let docs = YamlLoader::load_from_str(&text).expect("the manifest is YAML");
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().expect("every document has a kind")).collect();
    assert_eq!(
        kinds,
        [
            "PersistentVolumeClaim", // PostgreSQL's data
            "Deployment",
            "Service",
            "PersistentVolumeClaim", // the server's files
            "Deployment",
            "Service",
            "Deployment",
            "Deployment"
        ]
    );
    for doc in &docs {
        assert!(doc["apiVersion"].as_str().is_some() && doc["metadata"]["name"].as_str().is_some(), "{doc:?}");
        assert_eq!(doc["metadata"]["namespace"].as_str(), Some("distlab"));
    }
    let known = settings();
    let mut gpu_requested = false;
    for deployment in docs.iter().filter(|d| d["kind"].as_str() == Some("Deployment")) {
        let spec = &deployment["spec"];
        assert_eq!(spec["selector"]["matchLabels"], spec["template"]["metadata"]["labels"], "the selector selects");
        let containers = spec["template"]["spec"]["containers"].as_vec().expect("containers");
        // (PostgreSQL's container has settings of its own)
        for container in containers.iter().filter(|c| c["image"].as_str().is_some_and(|i| i.contains("distlab"))) {
            for env in container["env"].as_vec().into_iter().flatten() {
                let name = env["name"].as_str().expect("an env name");
                assert!(known.contains(name), "{name} is not a setting distlab reads");
            }
            gpu_requested |= !container["resources"]["limits"]["nvidia.com/gpu"].is_badvalue();
        }
    }
    assert!(gpu_requested, "a worker asks for a GPU");
    // The GPU workers run the image with CUDA's libraries.
    let gpu = docs.iter().find(|d| d["metadata"]["name"].as_str() == Some("distlab-gpu-worker")).unwrap();
    let image = gpu["spec"]["template"]["spec"]["containers"][0]["image"].as_str().unwrap();
    assert!(image.contains("gpu-worker"), "{image}");
    // The server's flags exist, and the workers reach the Service by its name.
    let server_flags = flags("distlab-server");
    let server = docs.iter().find(|d| d["metadata"]["name"].as_str() == Some("distlab-server")).unwrap();
    for arg in server["spec"]["template"]["spec"]["containers"][0]["args"].as_vec().unwrap() {
        if let Some(flag) = arg.as_str().filter(|a| a.starts_with("--")) {
            assert!(server_flags.contains(flag), "distlab-server has no {flag}");
        }
    }
    // The server stores in the PostgreSQL the manifest runs, its URL a Secret; the workers
    // say how many ranks they run and where their pods are reached.
    let server_env = server["spec"]["template"]["spec"]["containers"][0]["env"].as_vec().unwrap();
    let database = server_env.iter().find(|e| e["name"].as_str() == Some("DISTLAB_DATABASE_URL")).expect("a database");
    assert!(
        database["valueFrom"]["secretKeyRef"]["name"].as_str().is_some(),
        "the URL (with its password) is a Secret"
    );
    assert!(docs.iter().any(|d| d["metadata"]["name"].as_str() == Some("distlab-postgres")
        && d["spec"]["template"]["spec"]["containers"][0]["image"].as_str().is_some_and(|i| i.contains("postgres"))));
    for name in ["distlab-worker", "distlab-gpu-worker"] {
        let worker = docs.iter().find(|d| d["metadata"]["name"].as_str() == Some(name)).unwrap();
        let env = worker["spec"]["template"]["spec"]["containers"][0]["env"].as_vec().unwrap();
        for setting in ["DISTLAB_WORKER_RANKS", "DISTLAB_ADVERTISE_IP"] {
            assert!(env.iter().any(|e| e["name"].as_str() == Some(setting)), "{name} sets {setting}");
        }
    }
    let service = docs.iter().find(|d| d["metadata"]["name"].as_str() == Some("distlab")).unwrap();
    let service_name = service["metadata"]["name"].as_str().unwrap();
    assert!(text.contains(&format!("http://{service_name}.distlab.svc")));
    assert!(matches!(&service["spec"]["ports"][0]["port"], Yaml::Integer(80)));
}

#[test]
fn the_container_build_pins_its_bases_and_copies_what_it_builds() {
    let text = std::fs::read_to_string(repo_root().join("deploy/Containerfile")).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
    let mut stages = Vec::new();
    for line in lines.iter().filter(|l| l.starts_with("FROM ")) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let image = words[1];
        let tag = image.rsplit_once(':').map(|(_, t)| t).unwrap_or("");
        assert!(!tag.is_empty() && tag != "latest", "{image}: pin a tag");
        assert_eq!(words.get(2).map(|w| w.to_ascii_uppercase()), Some("AS".into()), "{line}: name the stage");
        stages.push(words[3].to_string());
    }
    assert_eq!(stages, ["build", "server", "worker", "gpu-worker"]);
    for line in lines.iter().filter(|l| l.starts_with("COPY --from=")) {
        let from = line["COPY --from=".len()..].split_whitespace().next().unwrap();
        assert!(stages.contains(&from.to_string()), "{line}: no stage {from}");
        let source = line.split_whitespace().nth(2).unwrap();
        if let Some(bin) = source.strip_prefix("/src/target/release/") {
            assert!(["distlab-server", "distlab-worker"].contains(&bin), "the build makes no {bin}");
        }
    }
    assert!(text.contains("cargo build --release -p distlab-server -p distlab-worker"));
    assert!(text.contains("cargo xtask build-frontend"), "the server image serves the built frontend");
    assert!(text.contains("--features distlab-worker/cuda"), "the workers can drive GPUs");
    assert!(
        text.contains("FROM docker.io/nvidia/cuda:13."),
        "the GPU worker has CUDA 13's libraries (cudarc's cuda-13000)"
    );
    assert!(!lines.iter().any(|l| l.starts_with("ADD ")), "COPY, not ADD");
    // The runtime stages run as a user, through an entry point that exists.
    for stage in text.split("\nFROM ").skip(1).filter(|s| !s.starts_with(|c: char| c.is_whitespace())) {
        if stage.contains("AS build") {
            continue;
        }
        assert!(stage.contains("\nUSER 10001"), "a runtime stage runs as a user:\n{stage}");
        let entry = stage.lines().find(|l| l.starts_with("ENTRYPOINT ")).expect("an entry point");
        let entry: Vec<String> = serde_json::from_str(&entry["ENTRYPOINT ".len()..]).expect("exec form");
        assert!(stage.contains(&format!(" {}\n", entry[0])), "{} is copied in", entry[0]);
    }
    let known = settings();
    for name in distlab_names(&text) {
        assert!(known.contains(&name), "{name} is not a setting distlab reads");
    }
    let ignore = std::fs::read_to_string(repo_root().join(".dockerignore")).expect("a .dockerignore");
    assert!(ignore.lines().any(|l| l.trim() == "target"), "the build context leaves target/ out");
}

#[test]
fn the_slurm_script_is_valid_bash_and_starts_the_worker_with_real_flags() {
    let path = repo_root().join("deploy/slurm/distlab-workers.sbatch");
    let check = Command::new("bash").arg("-n").arg(&path).output().expect("bash");
    assert!(check.status.success(), "{}", String::from_utf8_lossy(&check.stderr));
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(text.starts_with("#!/usr/bin/env bash\n"));
    assert!(text.contains("#SBATCH --ntasks-per-node=1"), "one worker per node");
    let worker_flags = flags("distlab-worker");
    let used: BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.contains("srun"))
        .flat_map(str::split_whitespace)
        .filter(|w| w.starts_with("--"))
        .collect();
    assert!(used.contains("--checkpoint-dir"), "{used:?}");
    for flag in used {
        assert!(worker_flags.contains(flag), "distlab-worker has no {flag}");
    }
    let known = settings();
    for name in distlab_names(&text) {
        assert!(known.contains(&name), "{name} is not a setting distlab reads");
    }
}
