//! The systrap platform with real stub processes: guest code placed with `map` + `write` runs
//! natively in a confined host process, and every syscall it makes, its faults and its `rdtsc`
//! reach the test (playing the VMM) as exits.

use collimate_engine::platform::systrap::{kvm_regs, Confinement, Exit, Stub, Template, Traps};

const CODE: u64 = 0x40_0000;
const DATA: u64 = 0x50_0000;
const LAZY: u64 = 0x60_0000;
const STACK: u64 = 0x70_0000;
const PAGE: u64 = 4096;
const RW: i32 = libc::PROT_READ | libc::PROT_WRITE;
const RX: i32 = libc::PROT_READ | libc::PROT_EXEC;

/// getppid; store its result at DATA; write(1, DATA+8, 5); store at LAZY (unmapped: a fault);
/// rdtsc, store rax at LAZY+8; exit_group(getppid's result). Assembled with GNU as, bytes below.
const PROGRAM: &[u8] = &[
    0xb8, 0x6e, 0x00, 0x00, 0x00, // mov eax, 110 (getppid)
    0x0f, 0x05, // syscall
    0x49, 0x89, 0xc4, // mov r12, rax
    0x4c, 0x89, 0x24, 0x25, 0x00, 0x00, 0x50, 0x00, // mov [0x500000], r12
    0xb8, 0x01, 0x00, 0x00, 0x00, // mov eax, 1 (write)
    0xbf, 0x01, 0x00, 0x00, 0x00, // mov edi, 1
    0xbe, 0x08, 0x00, 0x50, 0x00, // mov esi, 0x500008
    0xba, 0x05, 0x00, 0x00, 0x00, // mov edx, 5
    0x0f, 0x05, // syscall
    0x4c, 0x89, 0x24, 0x25, 0x00, 0x00, 0x60, 0x00, // mov [0x600000], r12
    0x0f, 0x31, // rdtsc
    0x48, 0x89, 0x04, 0x25, 0x08, 0x00, 0x60, 0x00, // mov [0x600008], rax
    0xb8, 0xe7, 0x00, 0x00, 0x00, // mov eax, 231 (exit_group)
    0x4c, 0x89, 0xe7, // mov rdi, r12
    0x0f, 0x05, // syscall
    0xeb, 0xfe, // jmp .
];

/// A stub with PROGRAM at CODE (mapped read+execute, written through the debugger-like path),
/// "hello" at DATA+8, a stack, and registers at the program's entry.
fn loaded() -> (Stub, kvm_regs) {
    load(Stub::spawn(&Confinement::default()).expect("spawn a stub"))
}

/// PROGRAM and its data and stack, placed in an empty stub.
fn load(mut stub: Stub) -> (Stub, kvm_regs) {
    let private = libc::MAP_PRIVATE;
    stub.map(CODE, PAGE, RX, private, None, 0).expect("map code");
    stub.write(CODE, PROGRAM).expect("write into a read-only private page");
    stub.map(DATA, PAGE, RW, private, None, 0).expect("map data");
    stub.write(DATA + 8, b"hello").expect("write data");
    stub.map(STACK, 4 * PAGE, RW, private, None, 0).expect("map stack");
    let regs = kvm_regs { rip: CODE, rsp: STACK + 4 * PAGE, rflags: 0x202, ..Default::default() };
    (stub, regs)
}

fn read_u64(stub: &Stub, va: u64) -> u64 {
    let mut b = [0; 8];
    stub.read(va, &mut b).expect("read guest memory");
    u64::from_le_bytes(b)
}

#[test]
fn syscalls_faults_and_rdtsc_reach_the_vmm() {
    let (mut stub, mut regs) = loaded();
    let mut fs = 0x1234_5000u64;
    assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    assert_eq!((regs.rax, regs.rip), (libc::SYS_getppid as u64, CODE + 7));
    assert_eq!(fs, 0x1234_5000, "the FS base the guest ran with");
    regs.rax = 4242; // the answer the VMM chose

    assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    assert_eq!((regs.rax, regs.rdi, regs.rsi, regs.rdx), (1, 1, DATA + 8, 5));
    let mut buf = [0u8; 5];
    stub.read(regs.rsi, &mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    assert_eq!(read_u64(&stub, DATA), 4242, "the guest saw the VMM's getppid");
    regs.rax = 5;

    let e = stub.run(&mut regs, &mut fs).unwrap();
    assert_eq!(e, Exit::Fault { addr: LAZY, write: true, exec: false });
    assert_eq!(regs.rip, CODE + 0x28, "rip is the faulting instruction");
    stub.map(LAZY, PAGE, RW, libc::MAP_PRIVATE, None, 0).expect("serve the fault");

    assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Rdtsc { rdtscp: false });
    assert_eq!(regs.rip, CODE + 0x30);
    regs.rax = 0xabcd;
    regs.rdx = 0;
    regs.rip += 2;

    assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    assert_eq!((regs.rax, regs.rdi), (libc::SYS_exit_group as u64, 4242));
    assert_eq!(read_u64(&stub, LAZY), 4242, "the retried store landed in the page mapped for it");
    assert_eq!(read_u64(&stub, LAZY + 8), 0xabcd, "the guest saw the VMM's rdtsc");
}

#[test]
fn memory_access_is_safe_against_unmapped_addresses() {
    let (mut stub, _) = loaded();
    let mut b = [0u8; 16];
    assert!(stub.read(LAZY, &mut b).is_err(), "unmapped: EFAULT, not a crash");
    assert!(stub.write(LAZY, &b).is_err());
    stub.unmap(DATA, PAGE).unwrap();
    assert!(stub.read(DATA + 8, &mut b).is_err());
    // A read across the end of a mapping fails as a whole.
    stub.map(DATA, PAGE, RW, libc::MAP_PRIVATE, None, 0).unwrap();
    let mut big = vec![0u8; 2 * PAGE as usize];
    assert!(stub.read(DATA, &mut big).is_err());
}

#[test]
fn a_file_is_mapped_through_the_socket() {
    let (mut stub, _) = loaded();
    let f = tempfile_with(b"from a host file");
    use std::os::fd::AsFd;
    stub.map(LAZY, PAGE, libc::PROT_READ, libc::MAP_PRIVATE, Some(f.as_fd()), 0).expect("map a file");
    let mut b = [0u8; 16];
    stub.read(LAZY, &mut b).unwrap();
    assert_eq!(&b, b"from a host file");
}

/// A batch of edits is one round trip: two files (one named twice, sent once), anonymous memory
/// and a protect take effect in order; a call that fails ends the list with its error, after the
/// calls before it took effect; and the fds the stub received are closed either way (the stub
/// holds at most 8: a batch that left its fds open would fail within a few rounds).
#[test]
fn a_batch_of_edits_is_one_round_trip() {
    use collimate_engine::platform::systrap::batch::Batch;
    use std::os::fd::AsFd;
    let (mut stub, _) = loaded();
    let (f1, f2) = (tempfile_with(b"first file"), tempfile_with(b"second file"));
    for round in 0..12 {
        let before = stub.commands();
        let mut b = Batch::new();
        b.map(LAZY, PAGE, libc::PROT_READ, libc::MAP_PRIVATE, Some(f1.as_fd()), 0).unwrap();
        b.map(LAZY + PAGE, PAGE, libc::PROT_READ, libc::MAP_PRIVATE, Some(f2.as_fd()), 0).unwrap();
        b.map(LAZY + 2 * PAGE, PAGE, libc::PROT_READ, libc::MAP_PRIVATE, Some(f1.as_fd()), 0).unwrap();
        b.map(LAZY + 3 * PAGE, PAGE, RW, libc::MAP_PRIVATE, None, 0).unwrap();
        b.protect(LAZY + 3 * PAGE, PAGE, libc::PROT_READ).unwrap();
        assert_eq!(b.len(), 5);
        stub.run_batch(&mut b).unwrap_or_else(|e| panic!("round {round}: {e}"));
        assert!(b.is_empty());
        assert_eq!(stub.commands() - before, 1, "one round trip for the whole batch");
        let mut got = [0u8; 11];
        stub.read(LAZY, &mut got[..10]).unwrap();
        assert_eq!(&got[..10], b"first file");
        stub.read(LAZY + PAGE, &mut got).unwrap();
        assert_eq!(&got, b"second file");
        stub.read(LAZY + 2 * PAGE, &mut got[..10]).unwrap();
        assert_eq!(&got[..10], b"first file");
        assert_eq!(read_u64(&stub, LAZY + 3 * PAGE), 0);

        // The second call fails (an unaligned address): the first took effect, the third not.
        let mut b = Batch::new();
        b.unmap(LAZY + 2 * PAGE, PAGE).unwrap();
        b.map(LAZY + 2 * PAGE + 1, PAGE, libc::PROT_READ, libc::MAP_PRIVATE, Some(f2.as_fd()), 0).unwrap();
        b.unmap(LAZY, PAGE).unwrap();
        let e = stub.run_batch(&mut b).expect_err("a misaligned mmap fails");
        assert!(e.to_string().contains("mmap"), "{e}");
        assert!(stub.read(LAZY + 2 * PAGE, &mut got).is_err(), "the unmap before the failure ran");
        stub.read(LAZY, &mut got[..10]).expect("the unmap after the failure did not run");
    }
}

fn tempfile_with(data: &[u8]) -> std::fs::File {
    use std::io::Write;
    // A name of its own per call: the tests of this file run in parallel threads of one process.
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("systrap-test-{}-{n}", std::process::id()));
    let mut f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    f.write_all(data).unwrap();
    f
}

#[test]
fn a_forked_stub_has_its_own_memory() {
    let (mut parent, mut regs) = loaded();
    let mut fs = 0;
    assert_eq!(parent.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    let before = parent.commands();
    let mut child = parent.fork().expect("fork the stub");
    assert_ne!(child.pid(), parent.pid());
    assert_eq!(parent.commands() - before, 1, "the fds' recvmsg and the fork are one round trip");

    let (mut cregs, mut cfs) = (regs, fs);
    cregs.rax = 1;
    assert_eq!(child.run(&mut cregs, &mut cfs).unwrap(), Exit::Syscall, "the child continues the guest");
    assert_eq!(cregs.rax, 1, "write");
    assert_eq!(read_u64(&child, DATA), 1);
    assert_eq!(read_u64(&parent, DATA), 0, "the child's store does not show in the parent");
    child.write(DATA + 8, b"CHILD").unwrap();
    let mut b = [0u8; 5];
    parent.read(DATA + 8, &mut b).unwrap();
    assert_eq!(&b, b"hello", "nor does the VMM's write into the child");

    regs.rax = 2;
    assert_eq!(parent.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    assert_eq!(read_u64(&parent, DATA), 2);
    assert_eq!(read_u64(&child, DATA), 1, "the parent's store does not show in the child");
    drop(parent);
    // The child outlives its parent stub.
    let mut b = [0u8; 5];
    child.read(DATA + 8, &mut b).unwrap();
    assert_eq!(&b, b"CHILD");
    cregs.rax = 5;
    assert!(matches!(child.run(&mut cregs, &mut cfs).unwrap(), Exit::Fault { addr: LAZY, .. }));
}

#[test]
fn forks_left_unparked_park_on_their_own_and_are_independent() {
    // A served VMM forks a fork group's stubs one after another without waiting for each new
    // stub to park (its clone does, `Stub::await_parked`): every fork made that way must still
    // park at the parent's exit, with its own memory.
    let (mut parent, mut regs) = loaded();
    let mut fs = 0;
    assert_eq!(parent.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    let mut kids: Vec<Stub> = (0..8).map(|_| parent.fork_unparked().expect("fork the stub")).collect();
    for (i, kid) in kids.iter_mut().enumerate() {
        kid.await_parked().expect("the fork parks");
        let (mut r, mut f) = (regs, fs);
        r.rax = 100 + i as u64;
        assert_eq!(kid.run(&mut r, &mut f).unwrap(), Exit::Syscall, "each continues the guest");
        assert_eq!(read_u64(kid, DATA), 100 + i as u64);
    }
    assert_eq!(read_u64(&parent, DATA), 0, "no fork's store shows in the parent");
    assert_eq!(read_u64(&kids[3], DATA), 103, "nor in a sibling");
}

#[test]
fn a_fork_takes_the_faults_it_is_told_of_ahead_and_reports_them() {
    // How a clone takes its first exec's faults before it is handed out (vmm/systrap/warm.rs):
    // the pages another fork wrote, learned from pagemap, faulted in by the stub in one round
    // trip; a range that is not mapped here is skipped, and the guest's data is untouched.
    use collimate_engine::platform::systrap::written::Learned;
    let (mut parent, mut regs) = loaded();
    let mut fs = 0;
    assert_eq!(parent.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    let mut child = parent.fork().expect("fork the stub");
    let has = |l: &Learned, va: u64| l.write.iter().any(|&(s, n)| s <= va && va < s + n);
    assert!(!has(&child.learn(1024).unwrap(), DATA), "a fresh fork has written nothing");
    let told = Learned { write: vec![(DATA, PAGE), (LAZY, PAGE)], read: vec![(CODE, PAGE)] };
    assert_eq!(child.populate(&told).unwrap(), 2, "DATA and CODE; LAZY is not mapped");
    assert!(has(&child.learn(1024).unwrap(), DATA), "DATA is the fork's own page now");
    let mut b = [0u8; 5];
    child.read(DATA + 8, &mut b).unwrap();
    assert_eq!(&b, b"hello");
    child.write(DATA + 8, b"CHILD").unwrap();
    parent.read(DATA + 8, &mut b).unwrap();
    assert_eq!(&b, b"hello", "the parent's page is its own still");
}

/// `syscall; jmp back`: the test sets rax and the arguments before each run.
const SYSCALL_LOOP: &[u8] = &[0x0f, 0x05, 0xeb, 0xfc];

#[test]
fn host_facing_syscalls_trap_instead_of_running() {
    let (mut stub, mut regs) = loaded();
    stub.write(CODE, SYSCALL_LOOP).unwrap();
    stub.write(DATA, b"/etc/passwd\0").unwrap();
    let mut fs = 0;
    let calls: [(i64, [u64; 3]); 5] = [
        (libc::SYS_open, [DATA, libc::O_RDONLY as u64, 0]),
        (libc::SYS_openat, [libc::AT_FDCWD as u64, DATA, 0]),
        (libc::SYS_socket, [libc::AF_INET as u64, libc::SOCK_STREAM as u64, 0]),
        (libc::SYS_kill, [1, libc::SIGKILL as u64, 0]),
        (libc::SYS_ptrace, [libc::PTRACE_ATTACH as u64, 1, 0]),
    ];
    for (nr, [a, b, c]) in calls {
        regs.rip = CODE;
        regs.rax = nr as u64;
        (regs.rdi, regs.rsi, regs.rdx) = (a, b, c);
        assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Syscall, "syscall {nr}");
        assert_eq!((regs.rax, regs.rdi, regs.rsi), (nr as u64, a, b), "syscall {nr} reached the VMM, not the host");
    }
    // The host's init is alive and the stub survived its own "kill(1, SIGKILL)".
    regs.rip = CODE;
    regs.rax = libc::SYS_getpid as u64;
    assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    let r = stub.report().clone();
    assert!(r.unprivileged_uid, "runs as nobody: {r:?}");
}

#[test]
fn the_stub_region_is_out_of_the_guests_reach() {
    let (mut stub, mut regs) = loaded();
    let (base, end) = Stub::reserved_range();
    // mov [rcx], rax; syscall
    stub.write(CODE, &[0x48, 0x89, 0x01, 0x0f, 0x05]).unwrap();
    regs.rcx = base;
    let mut fs = 0;
    assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Fault { addr: base, write: true, exec: false }, "the blob's code is read-only");
    assert!(stub.protect(base, PAGE, RW | libc::PROT_EXEC).is_err(), "the VMM side refuses to change it");
    assert!(stub.map(end - PAGE, 2 * PAGE, RW, libc::MAP_PRIVATE, None, 0).is_err());
    assert!(stub.unmap(base - PAGE, 2 * PAGE).is_err());
    assert!(stub.write(base, &[0]).is_err());
}

#[test]
fn xsave_area_round_trips() {
    let (mut stub, mut regs) = loaded();
    let mut fs = 0;
    assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    let mut x = stub.xsave().expect("xsave");
    assert!(x.len() >= 512);
    // xmm0 is at byte 160 of the legacy area.
    x[160..176].copy_from_slice(&[7; 16]);
    stub.set_xsave(&x).unwrap();
    assert_eq!(&stub.xsave().unwrap()[160..176], &[7; 16]);
}

#[test]
fn guest_code_jumping_into_the_blob_gets_only_the_allow_list() {
    use collimate_engine::platform::systrap::blob;
    // The restorer is `mov eax, 15; syscall; ud2`: jump straight to its syscall with our own rax.
    let syscall_in_blob = blob::restorer() + 5;
    let (mut stub, mut regs) = loaded();
    let mut fs = 0;
    // An admitted syscall from the blob runs (close(-1) fails with EBADF) and falls into the ud2.
    regs.rip = syscall_in_blob;
    regs.rax = libc::SYS_close as u64;
    regs.rdi = u64::MAX;
    assert!(matches!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Signal { signo: libc::SIGILL, .. }));
    assert_eq!(regs.rax as i64, -(libc::EBADF as i64));
    // One outside the list kills the stub instead of reaching the host.
    regs.rip = syscall_in_blob;
    regs.rax = libc::SYS_openat as u64;
    assert!(matches!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Exited { .. }));
    assert!(matches!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Exited { .. }), "and stays gone");
}

#[test]
fn cpuid_traps_where_the_cpu_has_cpuid_faulting_and_root_gets_namespaces() {
    let (mut stub, mut regs) = loaded();
    let r = stub.report().clone();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        assert!(r.mount_ns && r.net_ns && r.ipc_ns && r.uts_ns && r.unprivileged_uid, "{r:?}");
    }
    let has_fault = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default().contains(" cpuid_fault");
    assert_eq!(r.cpuid_faulting, has_fault, "the report matches the CPU's flags");
    stub.write(CODE, &[0x0f, 0xa2, 0x0f, 0x05]).unwrap(); // cpuid; syscall
    let mut fs = 0;
    let e = stub.run(&mut regs, &mut fs).unwrap();
    if has_fault {
        assert_eq!((e, regs.rip), (Exit::Cpuid, CODE));
        regs.rip += 2;
        assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Syscall);
    } else {
        assert_eq!(e, Exit::Syscall, "without CPUID faulting cpuid runs natively");
    }
}

/// The rdtsc/cpuid traps are the stub's own setting, switched while it is parked (one command to
/// its blob, which the filter admits: a stub whose blob made a syscall it may not would be
/// killed) and inherited by forks: so a VMM traps per exec, not for the stub's whole life.
#[test]
fn the_rdtsc_and_cpuid_traps_switch_per_exec_and_forks_inherit_them() {
    let stub = Stub::spawn(&Confinement::for_replay(false)).expect("spawn a stub");
    assert_eq!(stub.traps(), Traps { rdtsc: false, cpuid: false });
    let (mut stub, mut regs) = load(stub);
    // loop: rdtsc; cpuid; syscall; jmp loop
    stub.write(CODE, &[0x0f, 0x31, 0x0f, 0xa2, 0x0f, 0x05, 0xeb, 0xf8]).unwrap();
    let mut fs = 0;
    assert_eq!(stub.run(&mut regs, &mut fs).unwrap(), Exit::Syscall, "rdtsc and cpuid ran natively");
    assert_eq!(regs.rip, CODE + 6);

    let has_fault = stub.report().cpuid_faulting;
    let on = stub.set_traps(Traps { rdtsc: true, cpuid: true }).expect("switch the traps on");
    assert_eq!(on, Traps { rdtsc: true, cpuid: has_fault }, "cpuid traps only where the CPU has CPUID faulting");
    let step = |stub: &mut Stub, regs: &mut kvm_regs, traps: Traps| {
        let mut fs = 0;
        if traps.rdtsc {
            assert_eq!((stub.run(regs, &mut fs).unwrap(), regs.rip), (Exit::Rdtsc { rdtscp: false }, CODE));
            regs.rip += 2;
        }
        if traps.cpuid {
            assert_eq!((stub.run(regs, &mut fs).unwrap(), regs.rip), (Exit::Cpuid, CODE + 2));
            regs.rip += 2;
        }
        assert_eq!((stub.run(regs, &mut fs).unwrap(), regs.rip), (Exit::Syscall, CODE + 6));
    };
    step(&mut stub, &mut regs, on);
    step(&mut stub, &mut regs, on);

    let mut child = stub.fork().expect("fork the stub");
    assert_eq!(child.traps(), on, "a fork inherits the traps");
    let mut child_regs = regs;
    assert_eq!(stub.set_traps(Traps::default()).unwrap(), Traps::default(), "switch them off");
    step(&mut stub, &mut regs, Traps::default());
    step(&mut child, &mut child_regs, on);
    assert_eq!(stub.set_traps(Traps::default()).unwrap(), Traps::default(), "no change: nothing to do");
    assert_eq!(stub.set_traps(Traps { rdtsc: true, cpuid: false }).unwrap(), Traps { rdtsc: true, cpuid: false });
    step(&mut stub, &mut regs, Traps { rdtsc: true, cpuid: false });
}

#[test]
fn stubs_forked_from_a_template_are_empty_and_independent() {
    let mut t = Template::new(&Confinement::default()).expect("spawn a template stub");
    let a = t.spawn().expect("a stub from the template");
    let b = t.spawn().expect("another stub from the template");
    assert_ne!(a.pid(), b.pid());
    let mut byte = [0u8; 1];
    assert!(a.read(CODE, &mut byte).is_err(), "nothing of the guest's is mapped in a new stub");
    let ((mut a, mut ra), (mut b, mut rb)) = (load(a), load(b));
    let mut fs = 0u64;
    for (stub, regs, answer) in [(&mut a, &mut ra, 11u64), (&mut b, &mut rb, 22)] {
        assert_eq!(stub.run(regs, &mut fs).unwrap(), Exit::Syscall);
        assert_eq!(regs.rax, libc::SYS_getppid as u64);
        regs.rax = answer;
        assert_eq!(stub.run(regs, &mut fs).unwrap(), Exit::Syscall, "write");
    }
    assert_eq!((read_u64(&a, DATA), read_u64(&b, DATA)), (11, 22), "each stub has its own memory");
}
