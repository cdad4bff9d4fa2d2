//! A served systrap sandbox's process table (`vmm::systrap::proctree`): signals between any of
//! its processes (siblings, grandchildren, process groups), bash job control, and
//! `/proc/<pid>` for every process of the sandbox and none of the host's, with the python
//! template's own Debian programs (bash, coreutils' sleep, CPython). No /dev/kvm involved.

mod common;

use std::time::Duration;

use collimate_engine::{Platform, RunExit, RunResult, SpawnSpec, Vm, VmConfig};

const T: Duration = Duration::from_secs(120);

fn run(argv: &[&str]) -> Option<RunResult> {
    run_with(argv, &[], |_, _| true)
}

/// As [`run`], with `prepare(work dir on the host, rootfs)` run first (false: skip the test) and
/// `env` added to the program's environment.
fn run_with(argv: &[&str], env: &[&str], prepare: impl FnOnce(&std::path::Path, &std::path::Path) -> bool) -> Option<RunResult> {
    let root = common::python_rootfs()?;
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = common::scratch(&format!("systrap-proctab-{}", N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)));
    std::fs::create_dir_all(dir.join("work")).expect("work dir");
    if !prepare(&dir.join("work"), &root) {
        return None;
    }
    let mut envp = vec![b"PATH=/usr/bin:/bin".to_vec(), b"HOME=/root".to_vec()];
    envp.extend(env.iter().map(|e| e.as_bytes().to_vec()));
    let spec = SpawnSpec {
        root,
        mounts: vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))],
        argv: argv.iter().map(|s| s.as_bytes().to_vec()).collect(),
        envp,
        cwd: "/work".into(),
        ..Default::default()
    };
    let cfg = VmConfig { platform: Platform::Systrap, ..Default::default() };
    let mut vm = Vm::spawn(&common::launcher(), &spec, &cfg).expect("spawn on systrap");
    let r = vm.run(T).expect("run on systrap");
    vm.destroy().expect("destroy");
    Some(r)
}

fn stdout(r: &RunResult) -> String {
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "stdout {:?} stderr {:?}", String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    String::from_utf8_lossy(&r.stdout).into_owned()
}

#[test]
fn bash_job_control_kills_a_background_job() {
    // `kill %1` is kill(-pgid of the job) with job control, else kill(pid): either way the
    // sleep is bash's child's group or bash's child. 143 = 128 + SIGTERM.
    let Some(r) = run(&["/bin/bash", "-c", "sleep 100 & kill %1; wait; echo rc=$?; sleep 100 & P=$!; kill $P; wait $P; echo rc=$?"]) else { return };
    assert_eq!(stdout(&r), "rc=0\nrc=143\n");
}

#[test]
fn a_process_kills_its_sibling() {
    // The sleep and the sh are both bash's children: the sh's kill of the sleep is a kill of a
    // sibling (ESRCH on main: only a parent and its children reached each other).
    let Some(r) = run(&["/bin/bash", "-c", "sleep 100 & A=$!; /bin/sh -c \"kill $A && echo sent\"; wait $A; echo rc=$?"]) else { return };
    assert_eq!(stdout(&r), "sent\nrc=143\n");
}

const GROUPS: &str = r#"
import os, signal, time
# A child that leads a group of its own, with a grandchild in the group; a sibling kills the
# grandchild by pid, then the parent kills the whole group with os.killpg.
r, w = os.pipe()
leader = os.fork()
if leader == 0:
    os.setpgid(0, 0)
    g = os.fork()
    if g == 0:
        time.sleep(100)
        os._exit(0)
    g2 = os.fork()
    if g2 == 0:
        time.sleep(100)
        os._exit(0)
    os.write(w, f"{g} {g2}\n".encode())
    _, st = os.waitpid(g, 0)
    os.write(w, f"grandchild {os.WTERMSIG(st) if os.WIFSIGNALED(st) else -1}\n".encode())
    time.sleep(100)
    os._exit(0)
line = b""
while not line.endswith(b"\n"):
    line += os.read(r, 100)
g, g2 = map(int, line.split())
killer = os.fork()
if killer == 0:
    os.kill(g, signal.SIGUSR1)  # a grandchild of our parent, not our child
    os._exit(0)
os.waitpid(killer, 0)
print(os.read(r, 100).decode().strip(), flush=True)
print("pgid", os.getpgid(leader) == leader, os.getpgid(g2) == leader, os.getpgid(0) != leader)
os.killpg(leader, signal.SIGTERM)
_, st = os.waitpid(leader, 0)
print("leader", os.WTERMSIG(st))
"#;

#[test]
fn kill_reaches_grandchildren_and_killpg_a_group() {
    let Some(r) = run(&["/usr/bin/python3", "-c", GROUPS]) else { return };
    assert_eq!(stdout(&r), format!("grandchild {}\npgid True True True\nleader {}\n", libc::SIGUSR1, libc::SIGTERM));
}

const PS: &str = r#"
import os, subprocess, time
job = subprocess.Popen(["/bin/sh", "-c", "sleep 300; : marker-arg"])
deadline = time.time() + 60
while time.time() < deadline:
    rows = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = open(f"/proc/{d}/stat").read()
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode().strip()[:40].replace("\n", " ")
            except OSError:
                continue
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            rows[int(d)] = (ppid, comm, cmd)
    if any(c == "sleep" for _, c, _ in rows.values()):
        break
    time.sleep(0.05)
for pid in sorted(rows):
    print(pid, *rows[pid], sep="|")
print("status", open(f"/proc/{job.pid}/status").read().splitlines()[0])
print("cwd", os.readlink(f"/proc/{job.pid}/cwd"))
job.kill()
job.wait()
"#;

#[test]
fn proc_lists_the_sandboxs_processes_only() {
    let Some(r) = run(&["/usr/bin/python3", "-c", PS]) else { return };
    let out = stdout(&r);
    let rows: Vec<Vec<&str>> = out.lines().filter(|l| !l.starts_with("status") && !l.starts_with("cwd")).map(|l| l.split('|').collect()).collect();
    // python3 (1), its sh (2) and that sh's sleep (3): guest pids, nothing of the host's.
    assert_eq!(rows.len(), 3, "{out}");
    assert_eq!(rows[0][..3], ["1", "0", "python3"], "{out}");
    assert_eq!(rows[1][..4], ["2", "1", "sh", "/bin/sh -c sleep 300; : marker-arg"], "{out}");
    assert_eq!(rows[2][..4], ["3", "2", "sleep", "sleep 300"], "{out}");
    assert!(out.contains("status Name:\tsh\n"), "{out}");
    assert!(out.contains("cwd /work\n"), "{out}");
}

const KILLPG: &str = r#"
import os, signal, subprocess, time
p = subprocess.Popen(["sh", "-c", "sleep 300 & sleep 300 & wait"], start_new_session=True)
def members():
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            f = open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[2]) == p.pid and f[0] != "Z":
            out.append(int(d))
    return out
for _ in range(2000):
    if len(members()) == 3:
        break
    time.sleep(0.01)
print(len(members()), os.getpgid(p.pid) == p.pid)
os.killpg(p.pid, signal.SIGTERM)
print(p.wait())
for _ in range(2000):
    if not members():
        break
    time.sleep(0.01)
print(members())
"#;

#[test]
fn killpg_ends_a_whole_group() {
    let Some(r) = run(&["/usr/bin/python3", "-c", KILLPG]) else { return };
    assert_eq!(stdout(&r), "3 True\n-15\n[]\n");
}

/// Debian's ps, pgrep (procps) and timeout (coreutils) in `work`/debian, by tests/debian_tools.py
/// (apt-get download + dpkg -x into the cache). False (the test skips) where that cannot run.
fn debian_tools(work: &std::path::Path, rootfs: &std::path::Path) -> bool {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/debian_tools.py");
    let ok = std::process::Command::new("python3").arg(&script).arg(work.join("debian")).arg(rootfs).status().is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipped: tests/debian_tools.py could not get Debian's procps and coreutils");
    }
    ok
}

/// The template's /bin/sh is busybox (its own ps, pgrep and timeout applets): Debian's by path.
const TOOLS_ENV: &[&str] = &["LD_LIBRARY_PATH=/work/debian/lib", "PS=/work/debian/bin/ps", "PG=/work/debian/bin/pgrep", "TO=/work/debian/bin/timeout"];
/// A background job with a recognisable command line, and a bounded wait until its sleep runs.
const JOB: &str = "M=marker; sh -c \"sleep 300; : $M-arg\" & for i in $(seq 400); do $PG -x sleep >/dev/null && break; sleep 0.05; done; ";

#[test]
fn procps_ps_ef_and_pgrep_f_see_the_sandboxs_processes_only() {
    let cmd = format!("{JOB} echo $$ $!; echo ===; $PS -ef; echo ===; $PG -f '300; : marke[r]-arg'; echo ===; $PG -f 'no-such-proces[s]'; echo rc=$?; kill %1");
    let Some(r) = run_with(&["/bin/bash", "-c", &cmd], TOOLS_ENV, debian_tools) else { return };
    let out = stdout(&r);
    let parts: Vec<&str> = out.split("===\n").collect();
    let ids: Vec<i32> = parts[0].split_whitespace().map(|x| x.parse().unwrap()).collect();
    let (shell, job) = (ids[0], ids[1]);
    let lines: Vec<&str> = parts[1].lines().collect();
    assert_eq!(lines[0].split_whitespace().take(3).collect::<Vec<_>>(), ["UID", "PID", "PPID"], "{out}");
    let rows: Vec<Vec<&str>> = lines[1..].iter().map(|l| l.split_whitespace().collect()).collect();
    let row = |pid: i32| rows.iter().find(|r| r[1] == pid.to_string()).unwrap_or_else(|| panic!("no pid {pid}: {out}"));
    // bash is the sandbox's first process (1); the job its child, the job's sleep the job's.
    assert_eq!(shell, 1, "{out}");
    assert_eq!(row(job)[2], "1", "{out}");
    assert_eq!(row(job)[7..], ["sh", "-c", "sleep", "300;", ":", "marker-arg"], "{out}");
    let sleep = rows.iter().find(|r| r[7..] == ["sleep", "300"]).unwrap_or_else(|| panic!("no sleep: {out}"));
    assert_eq!(sleep[2], job.to_string(), "{out}");
    assert!(rows.iter().any(|r| r[7..] == ["/work/debian/bin/ps", "-ef"]), "{out}");
    // The sandbox's processes only: bash, the job, its sleep, ps (and a finished pgrep at most).
    assert!(rows.len() <= 5 && rows.iter().all(|r| r[1].parse::<i32>().unwrap() < 100), "{out}");
    assert_eq!(parts[2].split_whitespace().collect::<Vec<_>>(), [job.to_string()], "{out}");
    assert_eq!(parts[3].trim(), "rc=1", "{out}");
}

#[test]
fn coreutils_timeout_kills_its_child_and_reports_124() {
    let cmd = "$TO 1 sleep 5; echo $?; $TO -s KILL 1 sleep 5; echo $?; $TO 5 sleep 0; echo $?";
    let Some(r) = run_with(&["/bin/bash", "-c", cmd], TOOLS_ENV, debian_tools) else { return };
    assert_eq!(stdout(&r), "124\n137\n0\n");
}

#[test]
fn an_orphan_is_adopted_by_the_first_process() {
    // The job's shell exits once its sleep has started (and published its parent); the sleep
    // lives on (on main it died with its parent) as the first process's child, shown as such at
    // once though it is parked in its sleep, and a kill of it from the first process reaches it.
    let cmd = "sh -c 'sleep 300 & echo $!; sleep 0.5' > /work/pid; read -r P < /work/pid; for i in $(seq 400); do \
               read -r a b c d e < /proc/$P/stat; [ \"$d\" = 1 ] && break; sleep 0.05; done; echo $b $c $d; kill $P && echo killed";
    let Some(r) = run(&["/bin/bash", "-c", cmd]) else { return };
    assert_eq!(stdout(&r), "(sleep) S 1\nkilled\n");
}
