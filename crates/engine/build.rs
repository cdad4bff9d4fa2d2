//! Builds the guest's vDSO (`vdso/vdso.S`, linked by `vdso/vdso.lds`) into `$OUT_DIR/vdso.so`,
//! which `guestos::vdso` embeds. It needs the host's GNU assembler and linker (binutils).

use std::path::PathBuf;
use std::process::Command;

fn run(cmd: &mut Command) {
    let shown = format!("{cmd:?}");
    match cmd.status() {
        Ok(s) if s.success() => {}
        Ok(s) => panic!("building the guest vDSO: {shown} failed ({s})"),
        Err(e) => panic!("building the guest vDSO needs binutils (as, ld): {shown}: {e}"),
    }
}

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR"));
    let obj = out.join("vdso.o");
    let so = out.join("vdso.so");
    println!("cargo:rerun-if-changed=vdso/vdso.S");
    println!("cargo:rerun-if-changed=vdso/vdso.lds");
    run(Command::new("as").args(["--64", "-o"]).arg(&obj).arg("vdso/vdso.S"));
    run(Command::new("ld")
        .args(["-shared", "-nostdlib", "-soname=linux-vdso.so.1", "--hash-style=both", "-z", "max-page-size=4096"])
        .args(["-z", "noexecstack", "--build-id=none", "-T", "vdso/vdso.lds", "-o"])
        .arg(&so)
        .arg(&obj));
}
